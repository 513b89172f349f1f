"""The native CPU kernels (kernels/cpu_attention.c via kernels/native.py).

Decode, against the reference launcher for every instantiated (head_dim, group) and both
dtypes, with ragged lengths, lengths that end inside a block and at a block's end, one-token
sequences, long contexts (several 16-key tiles, online-softmax rescaling), shared prefix blocks
and NaN in every slot a sequence must not read (unused tails, unused blocks). bf16 prefill the
same way, with packed sequences of any cached length and chunk length (empty chunks, one-token
chunks, chunks longer than a 16-row tile), checked to be the float32 attention rounded once.
Plus: what they decline (fp16, fp32 prefill, head dims not built, more than 8 query heads per
KV head in decode) is left to the torch path, the environment switch, and the build cache (one
library per source, flags, compiler and CPU).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernel_cases import assert_close, check_decode, make_case
from radixkv.kernels import native, paged_decode_attention
from radixkv.kernels.reference import paged_prefill_attention as reference_prefill

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel unavailable: {native._state.get('error')}")


def _run(case, q, out=None):
    out = torch.full_like(q, float("nan")) if out is None else out
    ran = native.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                              q.shape[-1] ** -0.5, out)
    return ran, out


@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       head_dim=st.sampled_from(sorted(native.HEAD_DIMS)),
       group=st.integers(1, native.MAX_GROUP), num_kv_heads=st.integers(1, 3),
       block_size=st.sampled_from([1, 4, 16, 32]))
def test_native_decode_matches_reference(data, dtype, head_dim, group, num_kv_heads,
                                         block_size):
    lens = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=5), label="lens")
    share = data.draw(st.integers(0, min(lens) // block_size), label="shared blocks")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    case = make_case(lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=dtype, share_prefix=share, gen=gen)
    q = (torch.randn(len(lens), group * num_kv_heads, head_dim, generator=gen) * 2).to(dtype)
    ran, out = _run(case, q)
    assert ran
    ref = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables,
                                 case.seq_lens, backend="reference")
    assert_close(out, ref, dtype, "native vs reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_and_peaked_scores(dtype):
    """Thousands of keys (many tiles, the running max rising late) and scores so peaked that
    most weights underflow: still the reference's answer, and through the launcher."""
    gen = torch.Generator().manual_seed(7)
    case = make_case([2500, 17, 1200], block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype,
                     gen=gen)
    q = (torch.randn(3, 6, 64, generator=gen) * 8).to(dtype)
    check_decode("torch", case, q, dtype)
    ran, out = _run(case, q)
    assert ran and not torch.isnan(out).any()


def test_declined_operands_fall_back_to_the_torch_path(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    fp16 = make_case([20, 5], head_dim=64, dtype=torch.float16, gen=gen)
    q16 = torch.randn(2, 4, 64, generator=gen).half()
    odd_dim = make_case([20, 5], head_dim=48, gen=gen)
    q48 = torch.randn(2, 4, 48, generator=gen)
    wide = make_case([20, 5], num_kv_heads=1, head_dim=64, gen=gen)
    q_wide = torch.randn(2, 12, 64, generator=gen)
    for case, q in ((fp16, q16), (odd_dim, q48), (wide, q_wide)):
        assert _run(case, q)[0] is False
        check_decode("torch", case, q, q.dtype)   # the launcher still answers, via SDPA
    case = make_case([20, 5], head_dim=64, gen=gen)
    q = torch.randn(2, 4, 64, generator=gen)
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert _run(case, q)[0] is False
    monkeypatch.setenv(native.ENV_VAR, "1")
    assert _run(case, q)[0] is True


def _prefill(case, q, cu, out=None):
    out = torch.full_like(q, float("nan")) if out is None else out
    ran = native.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables, cu,
                               case.seq_lens, int(case.seq_lens.max()), q.shape[-1] ** -0.5, out)
    return ran, out


def _prefill_or_skip(case, q, cu):
    ran, out = _prefill(case, q, cu)
    if not ran:
        pytest.skip("native bf16 prefill unavailable here (needs AVX512-BF16)")
    return out


@given(data=st.data(), head_dim=st.sampled_from(sorted(native.HEAD_DIMS)),
       group=st.integers(1, 12), num_kv_heads=st.integers(1, 3),
       block_size=st.sampled_from([1, 4, 16, 32]))
def test_native_prefill_is_float32_attention_rounded_once(data, head_dim, group, num_kv_heads,
                                                           block_size):
    shapes = data.draw(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 40)),
                                min_size=1, max_size=4), label="(cached, q_len)")
    shapes = [(c, n) if c + n else (c, 1) for c, n in shapes]
    shapes[0] = (shapes[0][0], max(shapes[0][1], 1))   # at least one query token in all
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    lens = [c + n for c, n in shapes]
    case = make_case(lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=torch.bfloat16, gen=gen)
    q_lens = [n for _, n in shapes]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = (torch.randn(sum(q_lens), group * num_kv_heads, head_dim, generator=gen) * 2).bfloat16()
    out = _prefill_or_skip(case, q, cu)
    want = reference_prefill(q.float(), case.k_cache.float(), case.v_cache.float(),
                             case.block_tables, cu, case.seq_lens, head_dim ** -0.5)
    assert not torch.isnan(out).any()
    # Within one bf16 rounding of the float32 attention (plus float32 summation-order noise).
    torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2 ** -8)
    once = (want.bfloat16().float() - want).abs().mean()
    assert (out.float() - want).abs().mean() <= 1.05 * once + 1e-6


def test_native_prefill_long_sequence_and_declines():
    gen = torch.Generator().manual_seed(4)
    case = make_case([1300, 40], block_size=16, num_kv_heads=2, head_dim=64,
                     dtype=torch.bfloat16, gen=gen)
    # one cold 1300-token prompt, and a 24-token chunk on 16 cached tokens
    cu = torch.tensor([0, 1300, 1324], dtype=torch.int32)
    q = (torch.randn(1324, 6, 64, generator=gen) * 4).bfloat16()
    out = _prefill_or_skip(case, q, cu)
    want = reference_prefill(q.float(), case.k_cache.float(), case.v_cache.float(),
                             case.block_tables, cu, case.seq_lens, 0.125)
    torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2 ** -8)
    f32 = make_case([30], head_dim=64, gen=gen)
    assert _prefill(f32, torch.randn(30, 4, 64, generator=gen),
                    torch.tensor([0, 30], dtype=torch.int32))[0] is False   # bf16 only
    odd = make_case([30], head_dim=48, dtype=torch.bfloat16, gen=gen)
    assert _prefill(odd, torch.randn(30, 4, 48, generator=gen).bfloat16(),
                    torch.tensor([0, 30], dtype=torch.int32))[0] is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_calls_give_the_same_bits(dtype):
    """Split over threads (every n-th (sequence, KV head) in decode, every n-th (query head,
    tile) in prefill), the results are bit-identical to one part, whatever the count."""
    gen = torch.Generator().manual_seed(11)
    lens = [300, 17, 64, 1, 90]
    case = make_case(lens, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype, gen=gen)
    q = torch.randn(len(lens), 9, 64, generator=gen).to(dtype)
    outs = []
    for parts in (1, 2, 3, 7):
        out = torch.full_like(q, float("nan"))
        assert native.paged_decode(q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, 0.125, out, parts=parts)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    if dtype != torch.bfloat16:
        return
    q_lens = [100, 17, 40, 1, 90]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(sum(q_lens), 9, 64, generator=gen).bfloat16()
    outs = []
    for parts in (1, 2, 3, 7):
        out = torch.full_like(qp, float("nan"))
        ran = native.paged_prefill(qp, case.k_cache, case.v_cache, case.block_tables, cu,
                                   case.seq_lens, 300, 0.125, out, parts=parts)
        if not ran:
            pytest.skip("native bf16 prefill unavailable here (needs AVX512-BF16)")
        outs.append(out)
    assert not torch.isnan(outs[0]).any()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_build_is_cached_per_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    cc = native._compiler()
    first = native._build(cc)
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native._build(cc) == first and first.stat().st_mtime_ns == stamp   # reused
    assert [p.name for p in first.parent.iterdir()] == [first.name]   # no temporaries left
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
    assert native._build(cc) != first                                   # rebuilt for it
