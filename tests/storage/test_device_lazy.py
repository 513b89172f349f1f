"""The CPU device pool commits memory as blocks are written, not at construction (issue 17).

Before: ``torch.zeros`` wrote the whole pool, so an engine with the default 512 MiB of KV grew
the process by 512 MiB before its first request. Then numpy's calloc, which numpy advises onto
transparent huge pages: the first block written made 2 MiB resident in each of the pool's
``2 x num_layers`` regions (120 MiB on SmolLM2). Now a mapping advised against huge pages.
"""

from __future__ import annotations

import gc
import mmap
import os
import sys

import pytest
import torch

from radixkv.storage.device import DevicePool, lazy_cpu_zeros, mapping_info, resident_bytes
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


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE") or not os.path.exists("/proc/self/smaps"),
                    reason="needs MADV_NOHUGEPAGE (Linux) and /proc/self/smaps")
def test_a_committed_pool_is_resident_at_once_and_still_zero():
    """``commit=True`` (``CacheConfig.commit_device_pool``, what ``radixkv serve`` sets): every
    page of the pool's own mapping is resident after construction, so no block write faults a
    fresh page in; the contents are the same zeros, and writes work as in a lazy pool. The
    lazy pool of the same size has (almost) nothing resident."""
    layout = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    lazy = DevicePool(layout, 512, device="cpu")        # 64 MiB
    assert resident_bytes(lazy.kv_cache) < 1 << 20
    # (measured before the next pool: the kernel may merge two adjacent mappings into one)
    committed = DevicePool(layout, 512, device="cpu", commit=True)
    assert resident_bytes(committed.kv_cache) >= committed.num_bytes
    assert not committed.kv_cache.any()
    shape = layout.cache_shape(1)
    block = torch.ones(1, shape[0], shape[1], *shape[3:])
    committed.write_blocks([7], block)
    assert committed.kv_cache[:, :, 7].eq(1).all() and not committed.kv_cache[:, :, 8:].any()


def test_the_server_commits_its_pool_and_the_library_does_not():
    from radixkv.config import CacheConfig
    from radixkv.errors import ConfigError
    from radixkv.server.cli import build_parser, configs

    assert CacheConfig().commit_device_pool is False
    assert configs(build_parser().parse_args([]))[0].commit_device_pool is True
    assert configs(build_parser().parse_args(["--no-commit-kv-pool"]))[0] \
        .commit_device_pool is False
    with pytest.raises(ConfigError, match="commit_device_pool"):
        CacheConfig(commit_device_pool=1)


def test_pool_dtypes_and_layout_unchanged():
    for dtype in ("float32", "bfloat16", "float16"):
        layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=dtype)
        pool = DevicePool(layout, 3, device="cpu")
        assert pool.kv_cache.dtype == getattr(torch, dtype)
        assert tuple(pool.kv_cache.shape) == layout.cache_shape(3)
        assert pool.kv_cache.is_contiguous() and not pool.kv_cache.any()


@pytest.mark.skipif(not hasattr(mmap, "MADV_NOHUGEPAGE") or not os.path.exists("/proc/self/smaps"),
                    reason="needs MADV_NOHUGEPAGE (Linux) and /proc/self/smaps; elsewhere the "
                           "pool is numpy's calloc")
def test_large_pool_is_its_own_mapping_advised_against_huge_pages():
    layout = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    pool = DevicePool(layout, 512, device="cpu")       # 64 MiB: 16 regions of 4 MiB
    shape = layout.cache_shape(1)
    block = torch.ones(1, shape[0], shape[1], *shape[3:])
    # One block touches 16 regions of 8 KiB: a few pages each, not a 2 MiB huge page each.
    before = _rss()
    pool.write_blocks([3], block)
    grown = _rss() - before
    assert grown < 4 << 20, f"writing one block made {grown >> 10} KiB resident"
    assert pool.kv_cache[:, :, 3].eq(1).all() and not pool.kv_cache[:, :, 4:].any()
    flags = mapping_info(pool.kv_cache.data_ptr())["VmFlags"].split()
    assert "nh" in flags and "hg" not in flags, flags


def test_pool_views_keep_the_mapping_alive():
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")
    pool = DevicePool(layout, 256, device="cpu")       # 8 MiB: above the mapping threshold
    k, v = pool.layer(3)
    k[255].fill_(2.0)
    del pool
    gc.collect()
    assert k[255].eq(2.0).all() and not v.any() and not k[:255].any()
    v[0].fill_(1.0)                                    # still writable
    assert v[0].eq(1.0).all()


@pytest.mark.parametrize("broken", ["no_advice", "madvise_fails"])
def test_falls_back_to_calloc_where_the_mapping_cannot_be_advised(monkeypatch, broken):
    if broken == "no_advice":
        monkeypatch.delattr(mmap, "MADV_NOHUGEPAGE", raising=False)
    else:
        class Refusing(mmap.mmap):
            def madvise(self, *a):
                raise OSError(22, "Invalid argument")
        monkeypatch.setattr(mmap, "mmap", Refusing)
    t = lazy_cpu_zeros((4, 2, 64, 16, 2, 64), torch.bfloat16)   # 4 MiB
    assert tuple(t.shape) == (4, 2, 64, 16, 2, 64) and t.dtype == torch.bfloat16
    assert t.is_contiguous() and not t.any()
    t[1, 1, 5].fill_(3.0)
    assert t.sum().item() == 3.0 * 16 * 2 * 64
