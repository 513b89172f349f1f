"""The CPU device pool commits memory as blocks are written, not at construction (issue 17).

Before: ``torch.zeros`` wrote the whole pool, so an engine with the default 512 MiB of KV grew
the process by 512 MiB before its first request.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from radixkv.storage.device import DevicePool
from radixkv.storage.layout import KVLayout


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_cpu_pool_is_zero_and_not_resident_until_written():
    layout = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    before = _rss()
    pool = DevicePool(layout, 2048, device="cpu")    # 2048 x 128 KiB = 256 MiB
    grown = _rss() - before
    assert pool.num_bytes == 256 << 20
    assert grown < 32 << 20, f"constructing the pool made {grown >> 20} MiB resident"
    blocks = torch.randn(2, *layout.cache_shape(1)[:2], *layout.cache_shape(1)[3:])
    pool.write_blocks([5, 900], blocks)
    torch.testing.assert_close(pool.read_blocks([5, 900]), blocks)
    assert not pool.kv_cache[:, :, 6:900].any() and not pool.kv_cache[:, :, 901:].any()


def test_pool_dtypes_and_layout_unchanged():
    for dtype in ("float32", "bfloat16", "float16"):
        layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=dtype)
        pool = DevicePool(layout, 3, device="cpu")
        assert pool.kv_cache.dtype == getattr(torch, dtype)
        assert tuple(pool.kv_cache.shape) == layout.cache_shape(3)
        assert pool.kv_cache.is_contiguous() and not pool.kv_cache.any()
