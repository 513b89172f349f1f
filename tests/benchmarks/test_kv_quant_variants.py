"""The fake quantizations of ``bench kv-quant --variants`` (``benchmarks/kv_quant_variants.py``):
the ``int8`` and ``fp8_e4m3`` variants reproduce the shipped formats' round trips, the others
stay on their grids, and the per-channel (KIVI-style) key variant re-quantizes a block only once
it is full."""

from __future__ import annotations

import torch

from radixkv.benchmarks.kv_quant_variants import ROW, FakeQuant, row_bytes
from radixkv.engine.kv_quant import dequantize_rows, quantize_rows, rotation


def _x(seed: int, shape=(5, 3, 64)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 8


def test_shipped_variants_equal_the_real_round_trip():
    x = _x(0)
    for kv in ("int8", "fp8_e4m3"):
        real = dequantize_rows(quantize_rows(x, kv), torch.float32)
        torch.testing.assert_close(ROW[kv](x), real, atol=1e-5, rtol=1e-5)


def test_int4_groups_use_at_most_15_levels_per_group():
    x = _x(1)
    h = rotation(64)
    for name, group in (("int4", 64), ("int4 g32", 32), ("int4 g16", 16)):
        y = (ROW[name](x) @ h).reshape(-1, group)       # back in the rotated domain
        steps = y / (y.abs().amax(-1, keepdim=True) / 7)  # grid points, up to float rounding
        assert (steps - steps.round()).abs().max() < 1e-3
        assert max(len(set(row.round().tolist())) for row in steps) <= 15
        err = (ROW[name](x) - x).abs().amax()
        assert err < (x @ h).abs().amax() / 7          # within a step of the coarsest grid


def test_row_bytes_of_each_layout():
    assert row_bytes("int8", 64) == 66 and row_bytes("bf16", 64) == 128
    assert row_bytes("int4", 64) == 34 and row_bytes("int4 g16", 64) == 40
    assert row_bytes("kivi", 64) == (64 + 8 + 66) / 2


def test_kivi_quantizes_a_block_of_keys_per_channel_once_it_is_full():
    bs, d = 4, 64
    k_cache = torch.zeros(3, bs, 1, d)
    v_cache = torch.zeros(3, bs, 1, d)

    def write(key, value, kc, vc, slots, **kw):
        kc.view(-1, 1, d)[slots] = key
        vc.view(-1, 1, d)[slots] = value

    fq = FakeQuant(write, "kivi", set())
    x = _x(2, (bs, 1, d))
    fq(x[:3], x[:3], k_cache, v_cache, torch.tensor([4, 5, 6]))   # block 1, not full yet
    assert torch.equal(k_cache[1, :3], x[:3])                     # keys kept exactly
    fq(x[3:], x[3:], k_cache, v_cache, torch.tensor([7]))          # the block is full now
    s = (x.abs().amax(0, keepdim=True) / 127).to(torch.float16).float()
    torch.testing.assert_close(k_cache[1], torch.round(x / s) * s)
