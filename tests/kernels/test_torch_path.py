"""The torch path's fast paths, each forced and checked against the reference and dense SDPA.

Prefill: sequences of one (cached_len, q_len) shape are attended without a mask -- causal SDPA when
nothing is cached, prefix part + causal self part merged by log-sum-exp otherwise -- and many small
shapes go through the padded, masked path. Decode: equal lengths need no mask, ragged groups do.
Also the trusted ``check=False`` launchers and write_kv's stride rule for one KV head.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kernel_cases import GARBAGE_BLOCK_ID, check_decode, check_prefill, make_case
from radixkv.errors import InvalidRequestError
from radixkv.kernels import (PAD_SLOT, native, paged_decode_attention,
                             paged_prefill_attention, torch_path, write_kv)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _force(monkeypatch, path: str) -> None:
    """path: "exact" (every shape unmasked) or "masked" (every shape padded + masked). Decode
    goes through SDPA (the native kernel, tests/kernels/test_native_decode.py, is off)."""
    monkeypatch.setenv(native.ENV_VAR, "0")
    if path == "exact":
        monkeypatch.setattr(torch_path, "_MAX_EXACT_SHAPES", 1 << 30)
    else:
        monkeypatch.setattr(torch_path, "_MAX_EXACT_SHAPES", 0)
        monkeypatch.setattr(torch_path, "_MIN_EXACT_PAIRS", 1 << 60)


@pytest.mark.parametrize("path", ["exact", "masked"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [(3, 3), (1, 8), (2, 1)])
def test_prefill_paths(monkeypatch, path, dtype, gqa):
    """Shapes repeated (batched together), no prefix, partial/whole-block prefixes, q_len 1."""
    _force(monkeypatch, path)
    gen = torch.Generator().manual_seed(hash((path, str(dtype), gqa)) % 2**31)
    kv_heads, group = gqa
    cached = [0, 0, 0, 21, 21, 32, 5, 40]
    q_lens = [17, 17, 3, 11, 11, 16, 1, 1]
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=16, num_kv_heads=kv_heads, head_dim=64, dtype=dtype,
                     gen=gen)
    check_prefill("torch", case, q_lens, kv_heads * group, dtype, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_mixed_exact_and_masked(dtype):
    """More shapes than _MAX_EXACT_SHAPES: the big ones unmasked, the small ones masked."""
    gen = torch.Generator().manual_seed(21)
    cached = [0, 300, 0, 2, 7, 1, 9, 3, 4, 6, 8, 10, 12]
    q_lens = [260, 220, 5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert len(set(zip(cached, q_lens))) > torch_path._MAX_EXACT_SHAPES
    assert q_lens[0] ** 2 >= torch_path._MIN_EXACT_PAIRS
    lens = [c + n for c, n in zip(cached, q_lens)]
    case = make_case(lens, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype, gen=gen)
    check_prefill("torch", case, q_lens, 9, dtype, gen)


def test_prefill_without_lse_kernel_falls_back_to_mask(monkeypatch):
    monkeypatch.setattr(torch_path, "_flash_with_lse", lambda: None)
    gen = torch.Generator().manual_seed(22)
    cached, q_lens = [0, 19, 32], [9, 4, 1]
    case = make_case([c + n for c, n in zip(cached, q_lens)], num_kv_heads=3, gen=gen)
    check_prefill("torch", case, q_lens, 9, torch.float32, gen)


def test_prefill_empty_chunks_are_skipped():
    gen = torch.Generator().manual_seed(23)
    cached, q_lens = [7, 0, 16], [0, 5, 3]
    case = make_case([c + n for c, n in zip(cached, q_lens)], num_kv_heads=3, gen=gen)
    check_prefill("torch", case, q_lens, 9, torch.float32, gen)


@pytest.fixture(params=["native", "sdpa"])
def decode_impl(request, monkeypatch) -> str:
    """Run a decode test through the native kernel (where it builds) and through SDPA."""
    if request.param == "sdpa":
        monkeypatch.setenv(native.ENV_VAR, "0")
    elif not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native._state.get('error')}")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens", [[37] * 5, [16] * 3, [1] * 4, [37, 37, 900, 3, 3, 40]])
def test_decode_uniform_and_ragged_groups(dtype, lens, decode_impl):
    """Equal lengths with a ragged last block (no mask: a view cuts the NaN tail), and groups."""
    gen = torch.Generator().manual_seed(len(lens) * 1000 + lens[0])
    case = make_case(lens, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype, gen=gen)
    q = torch.randn(len(lens), 9, 64, generator=gen).to(dtype)
    check_decode("torch", case, q, dtype)


def test_decode_workspace_reused_across_calls_and_shapes(monkeypatch):
    """Gathers go through a per-thread workspace: results stay right as shapes change."""
    monkeypatch.setenv(native.ENV_VAR, "0")
    gen = torch.Generator().manual_seed(24)
    for lens in ([300, 300], [5], [64] * 6, [300, 2]):
        case = make_case(lens, num_kv_heads=3, gen=gen)
        q = torch.randn(len(lens), 9, 64, generator=gen)
        check_decode("torch", case, q, torch.float32)


# ---------------------------------------------------------------- trusted launchers


def test_check_false_skips_value_checks_only():
    gen = torch.Generator().manual_seed(25)
    case = make_case([20, 3], num_kv_heads=3, gen=gen)
    q = torch.randn(2, 9, 64, generator=gen)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    trusted = paged_decode_attention(*args, check=False)
    torch.testing.assert_close(trusted, paged_decode_attention(*args))
    # structural checks still run
    with pytest.raises(InvalidRequestError, match="dtype"):
        paged_decode_attention(q.double(), *args[1:], check=False)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(InvalidRequestError, match="num_seqs \\+ 1"):
        paged_prefill_attention(q, *args[1:4], cu[:2], case.seq_lens, check=False)
    got = paged_prefill_attention(q, *args[1:4], cu, case.seq_lens, check=False)
    torch.testing.assert_close(got, paged_prefill_attention(q, *args[1:4], cu, case.seq_lens))
    # value checks run by default...
    bad = case.block_tables.clone()
    bad[1, 0] = GARBAGE_BLOCK_ID
    with pytest.raises(InvalidRequestError, match="block_tables"):
        paged_decode_attention(q, case.k_cache, case.v_cache, bad, case.seq_lens)
    with pytest.raises(InvalidRequestError, match="block_tables"):
        paged_prefill_attention(q, case.k_cache, case.v_cache, bad, cu, case.seq_lens)
    # ...and write_kv's too; check=False skips them (torch still bounds-checks its indexing)
    key = torch.randn(2, 3, 64, generator=gen)
    slots = torch.tensor([5, 5])
    with pytest.raises(InvalidRequestError, match="duplicate"):
        write_kv(key, key, case.k_cache, case.v_cache, slots)
    write_kv(key, key, case.k_cache, case.v_cache, slots, check=False)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_write_kv_single_kv_head_ignores_size1_stride(backend):
    """[T, 1, D] after .contiguous() of a transposed [1, 1, T, D] has an odd stride on axis 1."""
    gen = torch.Generator().manual_seed(26)
    pool = torch.randn(1, 2, 4, 8, 1, 64, generator=gen)
    key = torch.randn(1, 1, 5, 64, generator=gen)[0].transpose(0, 1).contiguous()
    value = torch.randn(1, 1, 5, 64, generator=gen)[0].transpose(0, 1).contiguous()
    odd_key = key.as_strided((5, 1, 64), (64, 7, 1))
    assert odd_key.stride(1) != 64
    slots = torch.tensor([0, 9, PAD_SLOT, 31, 12])
    write_kv(odd_key, value, pool[0, 0], pool[0, 1], slots, backend=backend)
    flat_k, flat_v = pool[0, 0].reshape(-1, 1, 64), pool[0, 1].reshape(-1, 1, 64)
    live = slots != PAD_SLOT
    assert torch.equal(flat_k[slots[live]], key[live])
    assert torch.equal(flat_v[slots[live]], value[live])
    with pytest.raises(InvalidRequestError, match="contiguous"):
        write_kv(torch.randn(5, 1, 128, generator=gen)[:, :, ::2], value, pool[0, 0],
                 pool[0, 1], slots, backend=backend)


@pytest.mark.parametrize("path", ["exact", "masked"])
def test_plan_reused_across_layers_is_exact(monkeypatch, path):
    """A per-batch ``plan`` (what the engine keeps for one forward): the second "layer" (other
    caches, same tables and lengths) reuses the first's groups, gather ids and masks and gets
    exactly what a call without a plan gets; ragged decode (masked groups), prefill of both
    paths, and write_kv's PAD filter."""
    _force(monkeypatch, path)
    gen = torch.Generator().manual_seed(31)
    cached = [0, 0, 21, 21, 5, 40, 300]
    q_lens = [17, 3, 11, 11, 1, 1, 2]
    lens = [c + n for c, n in zip(cached, q_lens)]
    first = make_case(lens, block_size=16, num_kv_heads=2, head_dim=64, gen=gen)
    second = copy.copy(first)   # one batch, two layers' caches: same tables, other values
    second.k_cache = torch.randn(first.k_cache.shape, generator=gen) + 0 * first.k_cache
    second.v_cache = torch.randn(first.v_cache.shape, generator=gen) + 0 * first.v_cache
    layers = [first, second]
    tables, seq_lens = layers[0].block_tables, layers[0].seq_lens
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    total = int(cu[-1])
    prefill_plan: dict = {}
    decode_plan: dict = {}
    for case in layers:
        q = torch.randn(total, 4, 64, generator=gen)
        want = paged_prefill_attention(q, case.k_cache, case.v_cache, tables, cu, seq_lens,
                                       backend="torch")
        got = paged_prefill_attention(q, case.k_cache, case.v_cache, tables, cu, seq_lens,
                                      backend="torch", plan=prefill_plan)
        assert torch.equal(got, want)
        qd = torch.randn(len(lens), 4, 64, generator=gen)
        want = paged_decode_attention(qd, case.k_cache, case.v_cache, tables, seq_lens,
                                      backend="torch")
        got = paged_decode_attention(qd, case.k_cache, case.v_cache, tables, seq_lens,
                                     backend="torch", plan=decode_plan)
        assert torch.equal(got, want)
    assert "prefill" in prefill_plan
    assert decode_plan["decode"][0].mask is not None   # ragged lengths: a masked group
    write_plan: dict = {}
    slots = torch.tensor([3, PAD_SLOT, 7])
    for case in layers:
        key, value = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
        write_kv(key, value, case.k_cache, case.v_cache, slots, backend="torch", plan=write_plan)
        flat = case.k_cache.view(-1, 2, 64)
        assert torch.equal(flat[3], key[0]) and torch.equal(flat[7], key[2])
    assert write_plan["write_keep"] is not None
