"""write_kv, copy_blocks, gather_blocks / scatter_blocks on every backend vs the reference."""

from __future__ import annotations

import pytest
import torch

from radixkv.errors import InvalidRequestError
from radixkv.kernels import (PAD_SLOT, copy_blocks, gather_blocks, scatter_blocks, write_kv)

BACKENDS = ["torch", "reference"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _pool(gen, layers=2, blocks=9, block_size=8, heads=3, head_dim=64, dtype=torch.float32):
    return torch.randn(layers, 2, blocks, block_size, heads, head_dim, generator=gen).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_skips_pad_and_touches_nothing_else(backend, dtype):
    gen = torch.Generator().manual_seed(0)
    pool = _pool(gen, dtype=dtype)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    before = pool.clone()
    slots = torch.tensor([17, PAD_SLOT, 3, 70, PAD_SLOT, 8], dtype=torch.int64)
    key = torch.randn(6, 3, 64, generator=gen).to(dtype)
    value = torch.randn(6, 3, 64, generator=gen).to(dtype)
    write_kv(key, value, k_cache, v_cache, slots, backend=backend)
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s != PAD_SLOT:
            expected[1, 0, s // 8, s % 8] = key[t]
            expected[1, 1, s // 8, s % 8] = value[t]
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_accepts_token_strided_slices(backend):
    """K and V sliced out of a fused [T, (Hq + 2 Hkv) * D] projection, as the model has them."""
    gen = torch.Generator().manual_seed(1)
    pool = _pool(gen)
    qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=gen)
    key = qkv[:, 9 * 64:12 * 64].view(5, 3, 64)
    value = qkv[:, 12 * 64:].view(5, 3, 64)
    assert not key.is_contiguous()
    slots = torch.tensor([0, 1, 2, 40, 41])
    write_kv(key, value, pool[0, 0], pool[0, 1], slots, backend=backend)
    flat_k = pool[0, 0].reshape(-1, 3, 64)
    flat_v = pool[0, 1].reshape(-1, 3, 64)
    assert torch.equal(flat_k[slots], key) and torch.equal(flat_v[slots], value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_copies_every_layer_and_nothing_else(backend):
    gen = torch.Generator().manual_seed(2)
    pool = _pool(gen, layers=3)
    before = pool.clone()
    src = torch.tensor([4, 0, 4])   # one source may feed several destinations
    dst = torch.tensor([7, 2, 5])
    copy_blocks(pool, src, dst, backend=backend)
    expected = before.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[:, :, d] = before[:, :, s]
    assert torch.equal(pool, expected)


def test_gather_scatter_round_trip():
    gen = torch.Generator().manual_seed(3)
    pool = _pool(gen, layers=3, dtype=torch.bfloat16)
    ids = torch.tensor([5, 1, 8])
    staged = gather_blocks(pool, ids)
    assert staged.shape == (3, 3, 2, 8, 3, 64) and staged.is_contiguous()
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(staged[i], pool[:, :, b])
    other = _pool(gen, layers=3, dtype=torch.bfloat16)
    untouched = other.clone()
    scatter_blocks(other, torch.tensor([0, 2, 4]), staged)
    for i, b in enumerate([0, 2, 4]):
        assert torch.equal(other[:, :, b], staged[i])
    for b in [1, 3, 5, 6, 7, 8]:
        assert torch.equal(other[:, :, b], untouched[:, :, b])
    assert gather_blocks(pool, torch.tensor([], dtype=torch.int64)).shape == (0, 3, 2, 8, 3, 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_block_ops_move_quantized_bytes_as_they_are(backend, dtype):
    """copy_blocks, gather_blocks and scatter_blocks on a quantized pool (rows of head_dim
    1-byte values + a 2-byte scale, engine/kv_quant.py): every byte arrives unchanged (random
    bytes, NaN codes of e4m3 included), nothing else is touched."""
    gen = torch.Generator().manual_seed(5)
    pool = torch.randint(-128, 128, (3, 2, 9, 8, 3, 66), dtype=torch.int8,
                         generator=gen).view(dtype)
    before = pool.view(torch.int8).clone()
    copy_blocks(pool, torch.tensor([4, 0, 4]), torch.tensor([7, 2, 5]), backend=backend)
    want = before.clone()
    for s, d in ((4, 7), (0, 2), (4, 5)):
        want[:, :, d] = before[:, :, s]
    assert torch.equal(pool.view(torch.int8), want)
    staged = gather_blocks(pool, torch.tensor([5, 1]))
    assert staged.dtype == dtype and staged.shape == (2, 3, 2, 8, 3, 66)
    assert torch.equal(staged.view(torch.int8), want[:, :, [5, 1]].permute(2, 0, 1, 3, 4, 5))
    scatter_blocks(pool, torch.tensor([8, 3]), staged)
    want[:, :, 8], want[:, :, 3] = want[:, :, 5], want[:, :, 1]
    assert torch.equal(pool.view(torch.int8), want)


def test_cache_ops_bad_input():
    gen = torch.Generator().manual_seed(4)
    pool = _pool(gen)
    key = torch.randn(2, 3, 64, generator=gen)
    with pytest.raises(InvalidRequestError, match="slot_mapping entries"):
        write_kv(key, key, pool[0, 0], pool[0, 1], torch.tensor([0, 72]))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        write_kv(key, key, pool[0, 0], pool[0, 1], torch.tensor([5, 5]))
    with pytest.raises(InvalidRequestError, match="int64"):
        write_kv(key, key, pool[0, 0], pool[0, 1], torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(InvalidRequestError, match="same number of tokens"):
        write_kv(key, key[:1], pool[0, 0], pool[0, 1], torch.tensor([0, 1]))
    with pytest.raises(InvalidRequestError, match="dtype"):
        write_kv(key.half(), key.half(), pool[0, 0], pool[0, 1], torch.tensor([0, 1]))
    with pytest.raises(InvalidRequestError, match="distinct"):
        copy_blocks(pool, torch.tensor([1, 2]), torch.tensor([3, 3]))
    with pytest.raises(InvalidRequestError, match="both a source and a destination"):
        copy_blocks(pool, torch.tensor([1, 2]), torch.tensor([2, 3]))
    with pytest.raises(InvalidRequestError, match=r"\[0, 9\)"):
        copy_blocks(pool, torch.tensor([1]), torch.tensor([9]))
    with pytest.raises(InvalidRequestError, match="dim 1 must be 2"):
        gather_blocks(pool[:, :1].contiguous(), torch.tensor([0]))
    with pytest.raises(InvalidRequestError, match="blocks must be"):
        scatter_blocks(pool, torch.tensor([0]), torch.zeros(1, 2, 2, 8, 3, 32))
