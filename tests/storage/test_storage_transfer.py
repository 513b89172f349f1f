"""TransferEngine: every direction round-trips, the two-phase protocol, failures roll back."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from radixkv.errors import ConfigError, InvalidBlockError, StorageError
from radixkv.storage.device import DevicePool
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.tiers.transfer import (DeviceBlock, DiskBlock, HostBlock, Move, TransferEngine)


@pytest.fixture
def tiers(tmp_path, layout, namespace):
    dev = DevicePool(layout, 8, device="cpu")
    dev.kv_cache.normal_()
    host = HostPool(layout, 8)
    disk = DiskStore(tmp_path / "kv", layout, namespace)
    eng = TransferEngine(dev, host, disk, queue_depth=2, io_threads=2)
    yield dev, host, disk, eng
    eng.close()


def _run(eng, moves):
    batch = eng.submit(eng.prepare(moves))
    eng.check_invariants()
    result = eng.wait(batch, timeout=30)
    assert result is not None, "batch did not finish"
    eng.check_invariants()
    return result


def test_demote_to_disk_and_promote_back(tiers, layout):
    dev, host, disk, eng = tiers
    original = dev.read_blocks([0, 1, 2])
    hashes = [os.urandom(16) for _ in range(3)]
    r = _run(eng, [Move(DeviceBlock(i), HostBlock(i + 4)) for i in range(3)])
    assert r.all_ok and torch.equal(host.read_blocks([4, 5, 6]), original)
    r = _run(eng, [Move(HostBlock(i + 4), DiskBlock(hashes[i], None, (1, 2, 3, 4)))
                   for i in range(3)])
    assert r.all_ok and all(torch.equal(disk.get(h), original[i]) for i, h in enumerate(hashes))
    r = _run(eng, [Move(DiskBlock(hashes[0]), HostBlock(0)),
                   Move(DiskBlock(hashes[1]), DeviceBlock(6)),
                   Move(HostBlock(6), DeviceBlock(7))])
    assert r.all_ok and r.errors == (None, None, None)
    assert torch.equal(host.read_blocks([0])[0], original[0])
    assert torch.equal(dev.read_blocks([6, 7]), original[1:])
    r = _run(eng, [Move(DeviceBlock(0), DiskBlock(os.urandom(16), hashes[0], (5, 6, 7, 8))),
                   Move(DeviceBlock(1), DeviceBlock(5)), Move(HostBlock(0), HostBlock(1))])
    assert r.all_ok and torch.equal(dev.read_blocks([5])[0], original[1])
    s = eng.stats()
    assert s.batches == 4 and s.moves_ok == 12 and s.moves_failed == 0
    assert s.bytes_moved["device->host"] == 3 * layout.bytes_per_block
    assert set(s.bytes_moved) == {"device->host", "host->disk", "disk->host", "disk->device",
                                  "host->device", "device->disk", "device->device",
                                  "host->host"}


def test_failed_disk_write_is_reported_per_move_and_rolls_back(tiers, monkeypatch):
    dev, host, disk, eng = tiers
    good, bad = os.urandom(16), os.urandom(16)
    real_write = os.write
    target = disk.path_of(bad).stem

    def enospc_for_bad(fd, data):  # only the file of `bad` hits a full disk
        if target in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", enospc_for_bad)
    r = _run(eng, [Move(HostBlock(0), DiskBlock(good, None, (1,))),
                   Move(HostBlock(1), DiskBlock(bad, None, (2,)))])
    assert r.ok == (True, False) and r.failed == (r.moves[1],)
    assert "disk write failed" in r.errors[1]
    assert disk.contains(good) and not disk.contains(bad) and disk.get(bad) is None
    # reservations were released: the same locations can move again at once
    r = _run(eng, [Move(HostBlock(1), DiskBlock(bad, None, (2,)))])
    assert r.ok == (False,)
    monkeypatch.undo()
    assert _run(eng, [Move(HostBlock(1), DiskBlock(bad, None, (2,)))]).all_ok
    assert eng.stats().moves_failed == 2


def test_missing_or_corrupt_disk_block_fails_only_its_move(tiers):
    dev, host, disk, eng = tiers
    h_ok, h_bad = os.urandom(16), os.urandom(16)
    assert disk.put(h_ok, None, (), host.block_tensor(3)) and disk.put(h_bad, None, (),
                                                                     host.block_tensor(3))
    disk.path_of(h_bad).write_bytes(b"garbage")
    before = dev.read_blocks([2])
    r = _run(eng, [Move(DiskBlock(h_ok), DeviceBlock(1)), Move(DiskBlock(h_bad), DeviceBlock(2)),
                   Move(DiskBlock(os.urandom(16)), DeviceBlock(3))])
    assert r.ok == (True, False, False)
    assert torch.equal(dev.read_blocks([2]), before)  # a failed promotion writes nothing
    assert torch.equal(dev.read_blocks([1])[0], host.block_tensor(3))


def test_exception_in_a_copy_fails_the_group_and_the_worker_lives(tiers, monkeypatch):
    dev, host, disk, eng = tiers

    def broken(*a, **k):
        raise RuntimeError("injected DMA failure")
    monkeypatch.setattr(host, "write_blocks", broken)
    monkeypatch.setattr(eng, "_cpu_copies", broken)  # the device<->host path of a CPU device
    monkeypatch.setattr(disk, "put_many", broken)
    r = _run(eng, [Move(DeviceBlock(0), HostBlock(0)), Move(DeviceBlock(1), HostBlock(2)),
                   Move(HostBlock(5), DiskBlock(os.urandom(16))),
                   Move(DeviceBlock(2), DeviceBlock(3))])
    assert r.ok == (False, False, False, True)
    assert "injected DMA failure" in r.errors[0] and "injected" in r.errors[2]
    monkeypatch.undo()
    assert _run(eng, [Move(DeviceBlock(0), HostBlock(0))]).all_ok  # worker still serving


def test_prepare_validates_and_reserves(tiers):
    dev, host, disk, eng = tiers
    with pytest.raises(InvalidBlockError):
        eng.prepare([Move(DeviceBlock(8), HostBlock(0))])            # out of range
    with pytest.raises(InvalidBlockError):
        eng.prepare([Move(DeviceBlock(0), HostBlock(0)), Move(DeviceBlock(1), HostBlock(0))])
    with pytest.raises(InvalidBlockError):                           # read and written
        eng.prepare([Move(DeviceBlock(0), HostBlock(0)), Move(HostBlock(0), DeviceBlock(1))])
    with pytest.raises(ConfigError):
        eng.prepare([Move(DiskBlock(os.urandom(16)), DiskBlock(os.urandom(16)))])
    assert eng.in_flight == 0                                        # nothing reserved
    a = eng.prepare([Move(DeviceBlock(0), HostBlock(0)), Move(DeviceBlock(0), DiskBlock(b"h" *
                                                                                    16))])
    with pytest.raises(InvalidBlockError):
        eng.prepare([Move(DeviceBlock(1), HostBlock(0))])             # target in flight
    with pytest.raises(InvalidBlockError):
        eng.prepare([Move(HostBlock(0), DeviceBlock(4))])             # reads an in-flight target
    with pytest.raises(InvalidBlockError):
        eng.prepare([Move(HostBlock(3), DeviceBlock(0))])             # overwrites a source
    b = eng.prepare([Move(DeviceBlock(0), HostBlock(1))])             # shared read: fine
    eng.check_invariants()
    eng.abort(b)
    eng.check_invariants()
    eng.submit(a)
    assert eng.wait(a).all_ok and eng.in_flight == 0
    eng.prepare([Move(HostBlock(0), DeviceBlock(4))])                 # released


def test_poll_complete_and_bounded_queue(tiers):
    dev, host, disk, eng = tiers
    gate = threading.Event()
    real = eng._copy_group

    def slow(*a, **k):  # the worker blocks inside the first batch until the gate opens
        gate.wait(10)
        return real(*a, **k)
    eng._copy_group = slow
    batches = [eng.submit(eng.prepare([Move(DeviceBlock(i), HostBlock(i))])) for i in range(3)]
    assert eng.complete(batches[0]) is None and eng.poll() == []
    with pytest.raises(StorageError):  # worker busy with #0, #1 and #2 queued: depth 2 full
        eng.submit(eng.prepare([Move(DeviceBlock(5), HostBlock(5))]), timeout=0.1)
    assert eng.wait(batches[0], timeout=0.05) is None
    gate.set()
    assert eng.wait(batches[0], timeout=10).all_ok
    results = eng.drain()
    assert [r.batch_id for r in results] == [batches[1].id, batches[2].id]
    assert eng.complete(batches[1]) is None  # handed out once
    eng._copy_group = real


def test_tiers_must_share_a_layout(tmp_path, layout):
    from radixkv.storage.layout import KVLayout
    other = KVLayout(2, 2, 8, 8, "float32")
    with pytest.raises(ConfigError):
        TransferEngine(DevicePool(layout, 2, device="cpu"), HostPool(other, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stream_round_trip(tmp_path, layout, namespace):
    dev, host = DevicePool(layout, 8), HostPool(layout, 8)
    disk = DiskStore(tmp_path, layout, namespace)
    with TransferEngine(dev, host, disk) as eng:
        dev.kv_cache.normal_()  # on the compute stream: the worker must wait for it
        want = dev.read_blocks([0, 1]).cpu()
        h = os.urandom(16)
        assert _run(eng, [Move(DeviceBlock(0), HostBlock(0)),
                          Move(DeviceBlock(1), DiskBlock(h))]).all_ok
        assert _run(eng, [Move(HostBlock(0), DeviceBlock(5)),
                          Move(DiskBlock(h), DeviceBlock(6))]).all_ok
        assert torch.equal(dev.read_blocks([5, 6]).cpu(), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_device_host_copies_scattered_both_ways(tmp_path, dtype):
    """A CPU device tier copies block by block over the I/O threads (NumPy byte views, any
    dtype): scattered ids on both sides land exactly, nothing else is touched."""
    from radixkv.storage.layout import KVLayout
    lay = KVLayout(2, 2, 8, 4, dtype)
    dev, host = DevicePool(lay, 16, device="cpu"), HostPool(lay, 16)
    dev.kv_cache.copy_(torch.randn(dev.kv_cache.shape))
    with TransferEngine(dev, host, io_threads=3) as eng:
        ids, slots = [9, 2, 15, 4, 3, 0, 11], [5, 6, 1, 12, 0, 8, 7]
        assert _run(eng, [Move(DeviceBlock(b), HostBlock(s)) for b, s in zip(ids, slots)]).all_ok
        assert torch.equal(host.read_blocks(slots), dev.read_blocks(ids))
        assert not host.blocks[[s for s in range(16) if s not in slots]].any()
        dev2 = DevicePool(lay, 16, device="cpu")
        with TransferEngine(dev2, host, io_threads=2) as eng2:
            back = [14, 1, 7, 8, 10, 3, 2]
            assert _run(eng2, [Move(HostBlock(s), DeviceBlock(b))
                               for s, b in zip(slots, back)]).all_ok
        assert torch.equal(dev2.read_blocks(back), dev.read_blocks(ids))
        assert not dev2.kv_cache[:, :, [b for b in range(16) if b not in back]].any()
