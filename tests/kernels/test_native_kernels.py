"""The native CPU kernels (kernels/cpu_attention.c via kernels/native.py).

Decode, against the reference launcher for every instantiated (head_dim, group) and both
dtypes, with ragged lengths, lengths that end inside a block and at a block's end, one-token
sequences, long contexts (several 16-key tiles, online-softmax rescaling), shared prefix blocks
and NaN in every slot a sequence must not read (unused tails, unused blocks). bf16 prefill the
same way, with packed sequences of any cached length and chunk length (empty chunks, one-token
chunks, chunks longer than a 16-row tile), checked to be the float32 attention rounded once;
float32 prefill (AVX512F, or AVX2 + FMA) against the reference to float32 summation-order noise.
Plus: what they decline (fp16, head dims not built, more than 8 query heads per
KV head in decode) is left to the torch path, the environment switch, and the build cache (one
library per source, flags, compiler and CPU).
"""

from __future__ import annotations

import ctypes
import os

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
       group=st.integers(1, native.MAX_GROUP), num_kv_heads=st.integers(1, 6),
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


def _quantized_case(case, fmt: str, gen: torch.Generator):
    """``case``'s K/V quantized as ``engine/kv_quant.py`` stores them, random bytes in every
    row no sequence reads (so a kernel that read one would differ)."""
    from radixkv.engine.kv_quant import quantize_rows

    unused = torch.isnan(case.k_cache[..., 0])
    caches = []
    for x in (case.k_cache, case.v_cache):
        qx = quantize_rows(x.nan_to_num(0.0) * 3, fmt)
        raw = qx.view(torch.int8)
        junk = torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=gen)
        raw[unused] = junk[unused]
        caches.append(qx)
    return caches


@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fmt=st.sampled_from(["int8", "fp8_e4m3"]),
       head_dim=st.sampled_from(sorted(native.HEAD_DIMS)),
       group=st.integers(1, native.MAX_GROUP), num_kv_heads=st.integers(1, 3),
       block_size=st.sampled_from([1, 4, 16, 32]))
def test_quantized_decode_in_place_matches_the_dequantized_scratch(data, dtype, fmt, head_dim,
                                                                   group, num_kv_heads,
                                                                   block_size):
    """int8 / fp8 rows read in place give what the float kernel gives on the scratch the torch
    path dequantizes them into (engine/attention.py's fallback), to float32 rounding: the
    quantized heads take the group size at run time, so the compiler may sum in another
    order. That the rows themselves are widened exactly is the next test's."""
    from radixkv.engine.kv_quant import dequantize_rows

    lens = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=5), label="lens")
    share = data.draw(st.integers(0, min(lens) // block_size), label="shared blocks")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    case = make_case(lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     share_prefix=share, gen=gen)
    kq, vq = _quantized_case(case, fmt, gen)
    q = (torch.randn(len(lens), group * num_kv_heads, head_dim, generator=gen) * 2).to(dtype)
    out = torch.full_like(q, float("nan"))
    assert native.paged_decode_quantized(q, kq, vq, case.block_tables, case.seq_lens, 0.125,
                                         out)
    ks, vs = (dequantize_rows(x, dtype, rotated=True) for x in (kq, vq))
    ref = torch.full_like(q, float("nan"))
    assert native.paged_decode(q, ks, vs, case.block_tables, case.seq_lens, 0.125, ref)
    assert_close(out, ref, dtype, "in place vs scratch")


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", sorted(native.HEAD_DIMS))
def test_quantized_rows_are_widened_exactly(fmt, dtype, head_dim):
    """Every value code, scales from fp16 subnormals up: with a zero query over two keys the
    output is ``(v1 + v2) / 2``, exact in float32, so the rows must be widened to exactly what
    the torch path's dequantized scratch holds (values times scale, rounded to the query's
    dtype), bit for bit."""
    from radixkv.engine.kv_quant import FORMATS, dequantize_rows

    gen = torch.Generator().manual_seed(head_dim)
    seqs, heads = 128, 2
    raw = torch.empty(seqs, 2, heads, head_dim + 2, dtype=torch.int8)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    raw[..., :head_dim] = codes[torch.randint(0, 256, raw[..., :head_dim].shape, generator=gen)]
    if fmt == "int8":
        raw[..., :head_dim].clamp_(-127, 127)                      # -128 is never written
    mags = torch.cat([torch.exp2(torch.linspace(-24, 15, 2 * seqs - 1)), torch.zeros(1)])
    perm = torch.randperm(2 * seqs, generator=gen)
    scales = mags[perm].half().view(seqs, 2, 1).expand(seqs, 2, heads).contiguous()
    raw[..., head_dim:] = scales.view(torch.int8).view(seqs, 2, heads, 2)
    cache = raw.view(FORMATS[fmt].storage)
    deq = dequantize_rows(cache, dtype, rotated=True).float()       # [seqs, 2, heads, D]
    ref = ((deq[:, 0] + deq[:, 1]) * 0.5).to(dtype)
    q = torch.zeros(seqs, heads, head_dim, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    tables = torch.arange(seqs, dtype=torch.int32)[:, None]
    assert native.paged_decode_quantized(q, cache, cache.clone(), tables,
                                         torch.full((seqs,), 2, dtype=torch.int32), 1.0, out)
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()


def test_e4m3_decode_declines_where_denormals_read_as_zero():
    """torch.set_flush_denormal(True) sets DAZ on this thread: the e4m3 decode, whose e = 0
    codes pass through float subnormals, must decline (the caller's scratch path does not
    depend on it) rather than read them as 0; int8 is unaffected and still runs."""
    from radixkv.engine.kv_quant import FORMATS

    heads, d = 2, 64
    raw = torch.zeros(1, 2, heads, d + 2, dtype=torch.int8)
    raw[..., :d] = 0x03                                           # e = 0: 3 x 2^-9
    raw[..., d:] = torch.ones(1, 2, heads, 1).half().view(torch.int8)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32), 1.0)
    q = torch.zeros(1, heads, d)
    cache = raw.view(FORMATS["fp8_e4m3"].storage)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        out = torch.zeros_like(q)
        declined = not native.paged_decode_quantized(q, cache, cache, *args, out, parts=1)
        ran_int8 = native.paged_decode_quantized(q, raw, raw, *args, out, parts=1)
    finally:
        torch.set_flush_denormal(False)
    assert declined and ran_int8
    out = torch.zeros_like(q)
    assert native.paged_decode_quantized(q, cache, cache, *args, out, parts=1)
    assert torch.equal(out, torch.full_like(q, 3 * 2.0 ** -9))


def test_quantized_decode_declines_what_it_does_not_read():
    gen = torch.Generator().manual_seed(3)
    case = make_case([9, 20], head_dim=64, gen=gen)
    kq, vq = _quantized_case(case, "int8", gen)
    q = torch.randn(2, 4, 64, generator=gen)
    out = torch.empty_like(q)
    args = (case.block_tables, case.seq_lens, 0.125)
    assert not native.paged_decode_quantized(q.half(), kq, vq, *args, out.half())   # fp16
    assert not native.paged_decode_quantized(q, kq[..., :-1].contiguous(),          # row width
                                             vq[..., :-1].contiguous(), *args, out)
    assert not native.paged_decode_quantized(q, kq, vq.view(torch.float8_e4m3fn), *args, out)
    assert not native.paged_decode_quantized(q[:, :, :32].contiguous(), kq, vq, *args,
                                             out[:, :, :32].contiguous())
    assert native.paged_decode_quantized(q, kq, vq, *args, out)


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
        need = "AVX512-BF16" if q.dtype == torch.bfloat16 else "AVX512F or AVX2 + FMA"
        pytest.skip(f"native {q.dtype} prefill unavailable here (needs {need})")
    return out


def _want_prefill(case, q, cu):
    """The float32 attention of ``q`` over the case's cache, and (bf16 only, else None) the
    same attention applied to |V|: the scale of the error that rounding P can make."""
    args = (case.block_tables, cu, case.seq_lens, q.shape[-1] ** -0.5)
    want = reference_prefill(q.float(), case.k_cache.float(), case.v_cache.float(), *args)
    if q.dtype != torch.bfloat16:
        return want, None
    return want, reference_prefill(q.float(), case.k_cache.float(), case.v_cache.float().abs(),
                                   *args)


def _check_prefill(out, want, dtype, abs_v=None):
    """float32: the float32 attention up to summation order. bf16: the kernel rounds P to bf16
    for its P.V dot products (as FlashAttention's P.V does): each weight is off by at most
    2^-8 of itself (bf16's unit roundoff), so an output is off by at most 2^-8 sum_k p_k |v_k|
    (``abs_v``), plus its own rounding to bf16 (2^-8 of it), plus float32 noise. Measured on
    243 rows over 543 keys, head dims 16-128: the mean error 1.47-1.50x that of rounding the
    float32 attention once."""
    assert not torch.isnan(out).any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
        return
    bound = 2.0 ** -8 * (abs_v + want.abs()) * 1.02 + 1e-6
    err = (out.float() - want).abs()
    assert (err <= bound).all(), f"{int((err > bound).sum())} outputs past the bound, " \
        f"worst {float((err / bound).max()):.3f}x"


@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       head_dim=st.sampled_from(sorted(native.HEAD_DIMS)),
       group=st.integers(1, 12), num_kv_heads=st.integers(1, 3),
       block_size=st.sampled_from([1, 4, 16, 32]))
def test_native_prefill_matches_the_float32_attention(data, dtype, head_dim, group,
                                                           num_kv_heads, block_size):
    shapes = data.draw(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 40)),
                                min_size=1, max_size=4), label="(cached, q_len)")
    shapes = [(c, n) if c + n else (c, 1) for c, n in shapes]
    shapes[0] = (shapes[0][0], max(shapes[0][1], 1))   # at least one query token in all
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    lens = [c + n for c, n in shapes]
    case = make_case(lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=dtype, gen=gen)
    q_lens = [n for _, n in shapes]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = (torch.randn(sum(q_lens), group * num_kv_heads, head_dim, generator=gen) * 2).to(dtype)
    out = _prefill_or_skip(case, q, cu)
    want, abs_v = _want_prefill(case, q, cu)
    _check_prefill(out, want, dtype, abs_v)


@given(data=st.data(), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       fmt=st.sampled_from([None, "int8", "fp8_e4m3"]),
       head_dim=st.sampled_from(sorted(native.HEAD_DIMS)),
       group=st.integers(1, native.MAX_GROUP), num_kv_heads=st.integers(1, 3),
       parts=st.integers(1, 3))
def test_one_row_sequences_in_a_prefill_call_take_the_decode_head(data, dtype, fmt, head_dim,
                                                                  group, num_kv_heads, parts):
    """A mixed batch (decodes riding with chunks) gives its one-row sequences exactly the bits
    a pure decode call gives them (they run the decode head in place, not a 16-row tile), and
    its chunks what a prefill call of the chunks alone gives them, at any split."""
    kinds = data.draw(st.lists(st.sampled_from(["decode", "chunk"]), min_size=1, max_size=5),
                      label="sequences")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    lens = [data.draw(st.integers(1, 90)) for _ in kinds]
    q_lens = [1 if k == "decode" else data.draw(st.integers(2, min(n, 40)) if n >= 2
                                                else st.just(1))
              for k, n in zip(kinds, lens)]
    case = make_case(lens, block_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=dtype, gen=gen)
    k_cache, v_cache = (case.k_cache, case.v_cache) if fmt is None else \
        _quantized_case(case, fmt, gen)
    hq = group * num_kv_heads
    q = (torch.randn(sum(q_lens), hq, head_dim, generator=gen) * 2).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    call = native.paged_prefill if fmt is None else native.paged_prefill_quantized
    if not call(q, k_cache, v_cache, case.block_tables, cu, case.seq_lens, max(lens),
                head_dim ** -0.5, out, parts=parts):
        pytest.skip(f"native {dtype} prefill unavailable here (needs "
                    f"{'AVX512-BF16' if dtype == torch.bfloat16 else 'AVX512F or AVX2 + FMA'})")
    one = [s for s, n in enumerate(q_lens) if n == 1]
    if one:
        rows = cu[torch.tensor(one)].long()
        dec = torch.full((len(one), hq, head_dim), float("nan")).to(dtype)
        decode = native.paged_decode if fmt is None else native.paged_decode_quantized
        assert decode(q[rows].contiguous(), k_cache, v_cache,
                      case.block_tables[torch.tensor(one)].contiguous(),
                      case.seq_lens[torch.tensor(one)].contiguous(), head_dim ** -0.5, dec)
        assert torch.equal(out[rows], dec)
    many = [s for s, n in enumerate(q_lens) if n > 1]
    if many:
        idx = torch.tensor(many)
        sub_q = torch.cat([q[cu[s]:cu[s + 1]] for s in many])
        sub_cu = torch.tensor([0] + torch.tensor([q_lens[s] for s in many]).cumsum(0).tolist(),
                              dtype=torch.int32)
        alone = torch.full_like(sub_q, float("nan"))
        assert call(sub_q, k_cache, v_cache, case.block_tables[idx].contiguous(), sub_cu,
                    case.seq_lens[idx].contiguous(), max(lens), head_dim ** -0.5, alone)
        assert torch.equal(torch.cat([out[cu[s]:cu[s + 1]] for s in many]), alone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_prefill_long_sequence_and_declines(dtype):
    gen = torch.Generator().manual_seed(4)
    case = make_case([1300, 40], block_size=16, num_kv_heads=2, head_dim=64,
                     dtype=dtype, gen=gen)
    # one cold 1300-token prompt, and a 24-token chunk on 16 cached tokens
    cu = torch.tensor([0, 1300, 1324], dtype=torch.int32)
    q = (torch.randn(1324, 6, 64, generator=gen) * 4).to(dtype)
    out = _prefill_or_skip(case, q, cu)
    want, abs_v = _want_prefill(case, q, cu)
    _check_prefill(out, want, dtype, abs_v)
    f16 = make_case([30], head_dim=64, dtype=torch.float16, gen=gen)
    assert _prefill(f16, torch.randn(30, 4, 64, generator=gen).half(),
                    torch.tensor([0, 30], dtype=torch.int32))[0] is False   # no fp16
    odd = make_case([30], head_dim=48, dtype=torch.bfloat16, gen=gen)
    assert _prefill(odd, torch.randn(30, 4, 48, generator=gen).bfloat16(),
                    torch.tensor([0, 30], dtype=torch.int32))[0] is False


@pytest.mark.parametrize("openmp", [True, False], ids=["torch-openmp-team", "python-pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_calls_give_the_same_bits(dtype, openmp, monkeypatch):
    """Split over threads (every n-th (sequence, KV head) in decode, every n-th (query head,
    tile) in prefill), the results are bit-identical to one part, whatever the count; on
    torch's OpenMP team (``radixkv_*_parallel``) and on the Python pool alike."""
    assert native.available()
    if openmp and "prefill_parallel" not in native._state:
        pytest.skip("native kernels built without OpenMP here")
    if not openmp:
        for key in ("prefill_parallel", "decode_parallel"):
            monkeypatch.delitem(native._state, key, raising=False)
    gen = torch.Generator().manual_seed(11)
    lens = [300, 17, 64, 1, 90]
    case = make_case(lens, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype, gen=gen)
    q = torch.randn(len(lens), 9, 64, generator=gen).to(dtype)
    outs = []
    for parts in (1, 2, 3, 7, native.MAX_PARALLEL_PARTS + 44):   # over the C bound: clamped
        out = torch.full_like(q, float("nan"))
        assert native.paged_decode(q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, 0.125, out, parts=parts)
        outs.append(out)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    q_lens = [100, 17, 40, 1, 90]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    qp = torch.randn(sum(q_lens), 9, 64, generator=gen).to(dtype)
    outs = []
    for parts in (1, 2, 3, 7):
        out = torch.full_like(qp, float("nan"))
        ran = native.paged_prefill(qp, case.k_cache, case.v_cache, case.block_tables, cu,
                                   case.seq_lens, 300, 0.125, out, parts=parts)
        if not ran:
            pytest.skip(f"native {dtype} prefill unavailable here (needs "
                    f"{'AVX512-BF16' if dtype == torch.bfloat16 else 'AVX512F or AVX2 + FMA'})")
        outs.append(out)
    assert not torch.isnan(outs[0]).any()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_the_parts_share_torchs_openmp_runtime():
    """Built with -fopenmp, the library links libgomp.so.1 by soname and so gets torch's copy,
    already loaded: one OpenMP runtime in the process, whose team the parallel entries use."""
    assert native.available()
    if native.OPENMP_FLAG not in native.flags():
        pytest.skip("OpenMP flag removed")
    assert native.one_openmp_runtime()
    assert "prefill_parallel" in native._state and "decode_parallel" in native._state
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    torch_lib = os.path.dirname(torch.__file__)
    assert len(gomp) == 1 and all(p.startswith(torch_lib) for p in gomp), gomp


def test_a_compiler_without_openmp_builds_the_library_without_it(tmp_path, monkeypatch):
    """The -fopenmp build failing (clang without an OpenMP runtime) is not the end: the library
    is built without it, and split calls go to the Python pool, with the same bits."""
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    real_build = native._build
    tried = []

    def build(cc, sources=native.SOURCES, headers=native.HEADERS, build_flags=None,
              stem="cpu_attention"):
        flags = native.flags() if build_flags is None else build_flags
        tried.append(native.OPENMP_FLAG in flags)
        if native.OPENMP_FLAG in flags:
            raise RuntimeError("cc: error: unsupported option '-fopenmp'")
        return real_build(cc, sources, headers, build_flags, stem)

    monkeypatch.setattr(native, "_build", build)
    monkeypatch.setattr(native, "_state", {})
    assert native._load() is not None
    assert tried == [True, False]
    assert "prefill_parallel" not in native._state and "decode_parallel" not in native._state
    gen = torch.Generator().manual_seed(3)
    case = make_case([40, 90], block_size=16, num_kv_heads=3, head_dim=64,
                     dtype=torch.float32, gen=gen)
    q = torch.randn(2, 9, 64, generator=gen)
    outs = []
    for parts in (1, 2):
        out = torch.full_like(q, float("nan"))
        assert native.paged_decode(q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, 0.125, out, parts=parts)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_build_is_cached_per_source_and_machine(tmp_path, monkeypatch):
    """The cache logic on a one-function source with the kernels' own flags (building the
    kernels themselves twice took ~40 s of a 2-core CI machine; every other test here loads
    the real build through the same function)."""
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path))
    cc = native._compiler()
    src = tmp_path / "probe.c"
    src.write_text("int probe(int x) { return x + 1; }\n")

    def build():
        return native._build(cc, (src,), (), None, "probe")

    first = build()
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert build() == first and first.stat().st_mtime_ns == stamp      # reused
    assert [p.name for p in first.parent.iterdir()] == [first.name]   # no temporaries left
    assert ctypes.CDLL(str(first)).probe(41) == 42
    src.write_text("int probe(int x) { return x + 2; }\n")
    second = build()
    assert second != first and ctypes.CDLL(str(second)).probe(41) == 43   # per source
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
    assert build() not in (first, second)                              # rebuilt for it
