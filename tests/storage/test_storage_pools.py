"""Device and host pools: round trips, layout contract, validation before mutation."""

from __future__ import annotations

import pytest
import torch

from radixkv.errors import ConfigError, InvalidBlockError
from radixkv.storage.device import DevicePool
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_device_round_trip_and_layout(dtype):
    lay = KVLayout(3, 2, 4, 4, dtype)
    pool = DevicePool(lay, num_blocks=6, device="cpu")
    assert pool.kv_cache.shape == (3, 2, 6, 4, 2, 4)
    blocks = torch.randn(2, *lay.block_shape).to(getattr(torch, dtype))
    pool.write_blocks([4, 1], blocks)
    assert torch.equal(pool.read_blocks([4, 1]), blocks)
    # the kernels' view: k_cache[block, token, head, dim] of layer i is blocks[j, i, 0]
    for i in range(3):
        k, v = pool.layer(i)
        assert k.shape == (6, 4, 2, 4)
        assert torch.equal(k[4], blocks[0, i, 0]) and torch.equal(v[1], blocks[1, i, 1])
        assert k.data_ptr() == pool.kv_cache[i, 0].data_ptr()  # a view, not a copy
    assert torch.count_nonzero(pool.read_blocks([0, 2, 3, 5])) == 0  # others untouched
    pool.copy_blocks([4], [0])
    assert torch.equal(pool.read_blocks([0])[0], blocks[0])


def test_device_validates_before_writing(layout):
    pool = DevicePool(layout, 4, device="cpu")
    good = torch.ones(2, *layout.block_shape)
    with pytest.raises(InvalidBlockError):
        pool.write_blocks([1, 4], good)            # out of range
    with pytest.raises(InvalidBlockError):
        pool.write_blocks([1, 1], good)            # duplicate target
    with pytest.raises(InvalidBlockError):
        pool.write_blocks([1, 2], good.half())     # wrong dtype
    with pytest.raises(InvalidBlockError):
        pool.write_blocks([1], good)               # wrong count
    with pytest.raises(ConfigError):
        DevicePool(layout, 0, device="cpu")
    assert torch.count_nonzero(pool.kv_cache) == 0


def test_host_round_trip_views_and_pinning(layout):
    pool = HostPool(layout, 5)
    assert pool.pinned == torch.cuda.is_available()
    assert pool.blocks.shape == (5, *layout.block_shape) and pool.blocks.is_contiguous()
    blocks = torch.randn(3, *layout.block_shape)
    pool.write_blocks([2, 0, 4], blocks)
    assert torch.equal(pool.read_blocks([2, 0, 4]), blocks)
    out = torch.empty(2, *layout.block_shape)
    assert pool.read_blocks([4, 2], out=out) is out and torch.equal(out, blocks[[2, 0]])
    pool.block_tensor(1).fill_(7.0)                   # a live view writes into the pool
    assert torch.all(pool.read_blocks([1]) == 7.0)
    with pytest.raises(InvalidBlockError):
        pool.write_blocks([0, 0, 1], blocks)
    with pytest.raises(InvalidBlockError):
        pool.read_blocks([5])
    assert pool.num_bytes == 5 * layout.bytes_per_block


def test_read_blocks_into_a_view(layout):
    dev, host = DevicePool(layout, 8, device="cpu"), HostPool(layout, 8)
    dev.kv_cache.normal_()
    dev.read_blocks_into([6, 1, 3], host.blocks[2:5])
    assert torch.equal(host.read_blocks([2, 3, 4]), dev.read_blocks([6, 1, 3]))
    with pytest.raises(InvalidBlockError):
        dev.read_blocks_into([1, 2], host.blocks[0:3])


def test_device_to_host_via_staging(layout):
    dev, host = DevicePool(layout, 8, device="cpu"), HostPool(layout, 8)
    dev.kv_cache.normal_()
    host.write_blocks([3, 6], dev.read_blocks([7, 2]))
    dev2 = DevicePool(layout, 8, device="cpu")
    dev2.write_blocks([0, 1], host.read_blocks([3, 6]))
    assert torch.equal(dev2.read_blocks([0, 1]), dev.read_blocks([7, 2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_round_trip(layout):
    dev = DevicePool(layout, 8)
    host = HostPool(layout, 4)
    assert dev.kv_cache.is_cuda and host.pinned
    blocks = torch.randn(2, *layout.block_shape)
    dev.write_blocks([5, 3], blocks)
    host.write_blocks([0, 1], dev.read_blocks([5, 3]))
    assert torch.equal(host.read_blocks([0, 1]), blocks)


def test_cpu_write_blocks_runs_and_scattered_ids_match_the_reference(layout):
    """The CPU path copies one run of consecutive ids at a time: mixed runs, single ids and
    a non-contiguous source all land exactly where kv_cache[:, :, id] says."""
    dev = DevicePool(layout, 12, device="cpu")
    ids = [3, 4, 5, 0, 9, 10, 7]
    blocks = torch.randn((len(ids), *layout.block_shape))
    dev.write_blocks(ids, blocks)
    for i, b in enumerate(ids):
        assert torch.equal(dev.kv_cache[:, :, b], blocks[i])
    untouched = [b for b in range(12) if b not in ids]
    assert not dev.kv_cache[:, :, untouched].any()
    strided = torch.randn((2 * len(ids), *layout.block_shape))[::2]  # not contiguous
    dev.write_blocks(ids, strided)
    assert torch.equal(dev.read_blocks(ids), strided)
    out = torch.empty((len(ids), *layout.block_shape))[:, :, :, :2]  # wrong shape: rejected
    with pytest.raises(InvalidBlockError):
        dev.read_blocks_into(ids, out)


def test_host_slot_bytes_alias_the_pool(layout):
    host = HostPool(layout, 3)
    view = host.block_bytes(1)
    assert view.nbytes == layout.bytes_per_block and not view.readonly
    view[:] = bytes(range(256)) * (layout.bytes_per_block // 256)
    assert torch.equal(host.block_tensor(1).reshape(-1).view(torch.uint8)[:256],
                       torch.arange(256, dtype=torch.uint8))
    assert not host.block_tensor(0).any() and not host.block_tensor(2).any()
    with pytest.raises(ConfigError):
        host.block_bytes(3)
