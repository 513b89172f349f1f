"""DiskStore: round trips, the index, and every in-process fault injected for real."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.errors import ConfigError, InvalidBlockError
from radixkv.storage.disk import DiskStore
from radixkv.storage.disk_format import FORMAT_VERSION, header_len_for
from radixkv.storage.layout import KVLayout


def _files(store: DiskStore, pattern: str = "*/*") -> list:
    return sorted(p for p in store.dir.glob(pattern) if p.is_file())


def _put(store, make_block, seed, h=None, parent=None):
    h = h or seed.to_bytes(16, "little")
    tokens = tuple(range(seed * 4, seed * 4 + 4))
    assert store.put(h, parent, tokens, make_block(seed))
    return h


# ---- round trips and the index ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_every_dtype(tmp_path, dtype):
    lay = KVLayout(2, 2, 8, 4, dtype)
    store = DiskStore(tmp_path, lay, lay.fingerprint("m"))
    block = torch.randn(lay.block_shape).to(getattr(torch, dtype))
    h, parent = os.urandom(16), os.urandom(16)
    assert store.put(h, parent, [5, 6, 7, 8], block)
    got = store.get(h)
    assert got.dtype == block.dtype and torch.equal(got, block)
    (entry,) = store.scan().entries
    assert (entry.block_hash, entry.parent_hash, entry.token_ids) == (h, parent, (5, 6, 7, 8))
    assert entry.num_bytes == header_len_for(4) + lay.bytes_per_block == store.bytes_used


def test_put_and_read_into_take_raw_bytes_too(store, make_block, layout):
    """The transfer engine hands the store byte views of pool slots (no tensor per block):
    same files, same checks, same results as with tensors."""
    block = make_block(7)
    raw = bytearray(block.numpy().tobytes())
    h1, h2 = os.urandom(16), os.urandom(16)
    assert store.put(h1, None, (1, 2), memoryview(raw)) and store.put(h2, None, (1, 2), block)
    assert store.path_of(h1).read_bytes()[-len(raw):] == store.path_of(h2).read_bytes()[-len(raw):]
    out = bytearray(layout.bytes_per_block)
    assert store.read_into(h1, memoryview(out)) and out == raw
    assert torch.equal(store.get(h1), block)
    with pytest.raises(InvalidBlockError):
        store.put(os.urandom(16), None, (), raw[:-4])
    with pytest.raises(InvalidBlockError):
        store.read_into(h1, bytes(layout.bytes_per_block))  # read-only buffer
    flipped = bytearray(store.path_of(h1).read_bytes())
    flipped[-1] ^= 0xFF
    store.path_of(h1).write_bytes(flipped)
    assert not store.read_into(h1, memoryview(out)) and store.stats().corrupt == 1


def test_index_contains_remove_and_bytes_used(store, make_block, layout):
    hashes = [_put(store, make_block, i) for i in range(5)]
    file_len = header_len_for(layout.block_size) + layout.bytes_per_block
    assert len(store) == 5 and store.bytes_used == 5 * file_len
    assert all(store.contains(h) for h in hashes) and hashes[0] in store
    assert store.remove(hashes[0]) and not store.remove(hashes[0])
    assert not store.contains(hashes[0]) and store.get(hashes[0]) is None
    assert store.bytes_used == 4 * file_len and len(_files(store)) == 4
    assert store.put(hashes[1], None, (4, 5, 6, 7), make_block(1))  # already there: skipped
    s = store.stats()
    assert (s.puts, s.put_existing, s.removed, s.misses) == (5, 1, 1, 1)
    store.check_invariants()


def test_put_rejects_caller_bugs(store, layout):
    with pytest.raises(InvalidBlockError):
        store.put(b"short", None, (), torch.zeros(layout.block_shape))
    with pytest.raises(InvalidBlockError):
        store.put(os.urandom(16), None, (), torch.zeros(3, 3))
    with pytest.raises(InvalidBlockError):
        store.put(os.urandom(16), None, (), torch.zeros(layout.block_shape, dtype=torch.float16))
    with pytest.raises(ConfigError):
        DiskStore(store.root, layout, b"not 16 bytes")
    with pytest.raises(ConfigError):
        DiskStore(store.root, layout, store.namespace, fsync="sometimes")


def test_scan_orders_parents_first(store, make_block):
    chain = []
    for i in range(6):  # a chain 0 <- 1 <- ... <- 5, written children-first
        chain.append(i.to_bytes(16, "little"))
    for i in reversed(range(6)):
        _put(store, make_block, i, chain[i], chain[i - 1] if i else None)
    order = [e.block_hash for e in DiskStore(store.root, store.layout, store.namespace)
             .scan().entries]
    assert order == chain


@pytest.mark.parametrize("num_tokens", [0, 1, 4])
def test_token_ids_of_any_length_round_trip(store, layout, num_tokens):
    # the header length depends on the number of token ids; the payload must still be found
    block, h = torch.randn(layout.block_shape), os.urandom(16)
    assert store.put(h, None, range(num_tokens), block)
    assert torch.equal(store.get(h), block)
    fresh = DiskStore(store.root, layout, store.namespace)
    assert fresh.entries()[0].token_ids == tuple(range(num_tokens))
    assert torch.equal(fresh.get(h), block) and fresh.stats().corrupt == 0


@pytest.mark.parametrize("fsync", [False, "data", True])
def test_fsync_modes_round_trip(tmp_path, layout, namespace, make_block, fsync):
    store = DiskStore(tmp_path, layout, namespace, fsync=fsync)
    h = _put(store, make_block, 3)
    assert torch.equal(store.get(h), make_block(3))


# ---- corrupt files: never served, counted, removed ---------------------------------------------
def _corrupt_and_get(store, make_block, mutate):
    h = _put(store, make_block, 1)
    path = store.path_of(h)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(mutate(data)))
    fresh = DiskStore(store.root, store.layout, store.namespace, scan=False)
    return fresh, h, path


def _flip(pos):
    def mutate(b):
        b[pos] ^= 0x40
        return b
    return mutate


@pytest.mark.parametrize("name,mutate", [
    ("garbage", lambda b: os.urandom(len(b))),
    ("empty", lambda b: b""),
    ("truncated-in-header", lambda b: b[:100]),
    ("truncated-at-payload", lambda b: b[:header_len_for(4)]),
    ("truncated-last-byte", lambda b: b[:-1]),
    ("appended", lambda b: b + b"x"),
    ("payload-flip-first", _flip(header_len_for(4))),
    ("payload-flip-last", _flip(-1)),
    ("header-flip-hash", _flip(40)),
    ("header-flip-token", _flip(120)),
    ("header-flip-checksum", _flip(112 + 8 * 4)),
    ("header-padding", _flip(header_len_for(4) - 1)),
    ("bad-magic", _flip(0)),
])
def test_corrupt_file_is_a_miss_and_removed(store, make_block, name, mutate):
    fresh, h, path = _corrupt_and_get(store, make_block, mutate)
    assert fresh.get(h) is None
    assert fresh.stats().corrupt == 1 and fresh.stats().hits == 0
    assert not path.exists()
    assert fresh.get(h) is None and fresh.stats().misses == 1  # now simply absent
    assert _put(fresh, make_block, 1) == h and torch.equal(fresh.get(h), make_block(1))


def test_corrupt_files_found_by_scan(store, make_block):
    good = [_put(store, make_block, i) for i in range(4)]
    bad = [_put(store, make_block, i) for i in range(4, 7)]
    with open(store.path_of(bad[0]), "r+b") as f:
        f.truncate(50)
    with open(store.path_of(bad[1]), "r+b") as f:
        f.seek(30)
        f.write(b"\xff")
    shutil.copy(store.path_of(good[0]), store.path_of(bad[2]))  # right bytes, wrong name
    (store.dir / "zz").mkdir()
    (store.dir / "zz" / ("zz" * 16 + ".kvb")).write_bytes(b"junk")  # not a hash name
    report = DiskStore(store.root, store.layout, store.namespace, scan=False).scan()
    assert sorted(e.block_hash for e in report.entries) == sorted(good)
    assert report.corrupt == 4 and report.foreign == 0
    assert len(_files(store)) == 4


def test_payload_corruption_is_caught_by_a_deep_scan_only(store, make_block):
    h = _put(store, make_block, 2)
    with open(store.path_of(h), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    assert len(DiskStore(store.root, store.layout, store.namespace).scan().entries) == 1
    report = DiskStore(store.root, store.layout, store.namespace,
                       scan=False).scan(verify_payload=True)
    assert report.entries == () and report.corrupt == 1


def test_quarantine_keeps_corrupt_files_aside(tmp_path, layout, namespace, make_block):
    store = DiskStore(tmp_path, layout, namespace, on_corrupt="quarantine")
    h = _put(store, make_block, 1)
    store.path_of(h).write_bytes(b"garbage")
    assert store.get(h) is None
    (q,) = list((store.dir / "quarantine").iterdir())
    assert q.read_bytes() == b"garbage" and not store.path_of(h).exists()


# ---- foreign files: never served, counted, left in place ------------------------------------
def test_foreign_namespace_file_is_skipped_not_deleted(tmp_path, layout, make_block):
    mine = DiskStore(tmp_path, layout, layout.fingerprint("model-a"))
    theirs = DiskStore(tmp_path, layout, layout.fingerprint("model-b"))
    h = _put(theirs, make_block, 1)
    assert mine.get(h) is None and mine.stats().foreign == 0  # other directory: just absent
    # a file of namespace b planted where namespace a looks for it
    mine.path_of(h).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(theirs.path_of(h), mine.path_of(h))
    assert mine.get(h) is None and mine.stats().foreign == 1
    assert mine.path_of(h).exists()
    report = DiskStore(tmp_path, layout, mine.namespace, scan=False).scan()
    assert report.entries == () and report.foreign == 1 and report.corrupt == 0
    assert torch.equal(theirs.get(h), make_block(1))  # the owner still serves it


def test_foreign_version_file_is_skipped_not_deleted(store, make_block):
    h = _put(store, make_block, 1)
    path = store.path_of(h)
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 8, FORMAT_VERSION + 2)  # a future format (2 = signed)
    path.write_bytes(bytes(data))
    fresh = DiskStore(store.root, store.layout, store.namespace)
    assert fresh.get(h) is None and path.exists()
    assert fresh.stats().foreign == 2 and fresh.stats().corrupt == 0  # scan + get


def test_foreign_layout_under_same_namespace_is_skipped(tmp_path, layout, namespace):
    # a misconfiguration (namespace not derived from the layout) must still not serve bytes
    other = KVLayout(2, 2, 8, 8, "float32")
    writer = DiskStore(tmp_path, other, namespace)
    h = os.urandom(16)
    assert writer.put(h, None, range(8), torch.ones(other.block_shape))
    reader = DiskStore(tmp_path, layout, namespace)
    assert reader.get(h) is None and reader.stats().foreign >= 1
    assert writer.path_of(h).exists()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1,
                      max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 10**6)))
def test_random_corruption_never_serves_a_block(tmp_path, layout, namespace, edits, cut):
    """Any change to a block file (byte edits anywhere, truncation) yields a miss; an
    unchanged file (edits that cancel out) yields exactly the bytes written."""
    root = tmp_path / os.urandom(8).hex()  # tmp_path is shared by all examples
    store = DiskStore(root, layout, namespace, scan=False)
    block = torch.randn(layout.block_shape)
    h = os.urandom(16)
    assert store.put(h, os.urandom(16), (1, 2, 3, 4), block)
    path = store.path_of(h)
    data = bytearray(path.read_bytes())
    focus = header_len_for(layout.block_size)
    for pos, xor in edits:  # half the edits hit the header, where parsing is subtle
        data[pos % focus if pos % 2 else pos % len(data)] ^= xor
    if cut is not None:
        data = data[: cut % len(data)]
    changed = bytes(data) != path.read_bytes()
    path.write_bytes(bytes(data))
    got = store.get(h)
    if changed:
        assert got is None
        assert DiskStore(root, layout, namespace, scan=False).scan(True).entries == ()
    else:
        assert torch.equal(got, block)


# ---- write failures: a miss and a warning, never a crash or a visible partial file -----------
def _enospc_after(monkeypatch, n_ok):
    real = os.write
    calls = {"n": 0}

    def failing_write(fd, data):
        calls["n"] += 1
        if calls["n"] > n_ok:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data[: max(1, len(data) // 2)])  # short writes on the way
    monkeypatch.setattr(os, "write", failing_write)


@pytest.mark.parametrize("n_ok", [0, 1, 3])
def test_enospc_at_the_syscall_is_a_counted_miss(store, make_block, monkeypatch, caplog, n_ok):
    h = os.urandom(16)
    _enospc_after(monkeypatch, n_ok)
    with caplog.at_level(logging.WARNING, logger="radixkv.storage.disk"):
        assert store.put(h, None, (1, 2, 3, 4), make_block(1)) is False
        assert store.put(os.urandom(16), None, (1, 2, 3, 4), make_block(2)) is False
    warned = [r for r in caplog.records if "ENOSPC" in r.getMessage()]
    assert len(warned) == 1  # rate limited: one warning per errno per 10 s
    s = store.stats()
    assert s.put_failures == 2 and s.failures_by_errno == {"ENOSPC": 2} and s.puts == 0
    assert list(store.dir.rglob("*")) == list(store.dir.rglob("*/"))  # no file at all
    assert not store.contains(h) and store.bytes_used == 0
    monkeypatch.undo()
    assert store.get(h) is None
    assert store.put(h, None, (1, 2, 3, 4), make_block(1)) and torch.equal(store.get(h),
                                                                           make_block(1))


@pytest.mark.parametrize("target", ["fdatasync", "replace", "close"])
def test_eio_in_fsync_rename_or_close_is_a_counted_miss(tmp_path, layout, namespace, make_block,
                                                        monkeypatch, target):
    store = DiskStore(tmp_path, layout, namespace, fsync="data")
    real = getattr(os, target)

    def eio(*args, **kwargs):
        if target == "close":
            real(*args, **kwargs)  # really close, then report the error (NFS style)
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, target, eio)
    h = os.urandom(16)
    assert store.put(h, None, (1, 2, 3, 4), make_block(1)) is False
    monkeypatch.undo()
    assert store.stats().failures_by_errno == {"EIO": 1}
    assert [p for p in store.dir.rglob("*") if p.is_file()] == []
    assert store.get(h) is None


def test_eio_on_read_is_a_miss(store, make_block, monkeypatch):
    h = _put(store, make_block, 1)

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "preadv", eio)
    assert store.get(h) is None
    monkeypatch.undo()
    assert store.stats().read_errors == 1 and store.path_of(h).exists()  # not judged corrupt
    assert torch.equal(store.get(h), make_block(1))


def _mount_tmpfs(path, size):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); "
                    "ENOSPC is still covered at the syscall boundary")


def test_real_full_filesystem(tmp_path):
    """Fill a 1 MiB tmpfs with 64 KiB blocks: puts start failing, nothing crashes, every
    visible file is whole, and removing blocks makes room again."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "1m")
    try:
        lay = KVLayout(2, 2, 64, 32, "float32")  # 64 KiB payload
        store = DiskStore(mnt, lay, lay.fingerprint("m"))
        blocks = {os.urandom(16): torch.randn(lay.block_shape) for _ in range(24)}
        results = {h: store.put(h, None, range(32), b) for h, b in blocks.items()}
        stored = [h for h, ok in results.items() if ok]
        assert 0 < len(stored) < len(blocks), f"{len(stored)} of {len(blocks)} stored"
        assert store.stats().failures_by_errno.get("ENOSPC", 0) == len(blocks) - len(stored)
        assert not list(mnt.rglob("*.tmp"))
        fresh = DiskStore(mnt, lay, lay.fingerprint("m"))
        assert sorted(e.block_hash for e in fresh.scan().entries) == sorted(stored)
        assert all(torch.equal(fresh.get(h), blocks[h]) for h in stored)
        failed = next(h for h, ok in results.items() if not ok)
        assert fresh.get(failed) is None
        for h in stored[:3]:
            fresh.remove(h)
        assert fresh.put(failed, None, range(32), blocks[failed])
        assert torch.equal(fresh.get(failed), blocks[failed])
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---- leftovers of killed writers ---------------------------------------------------------------
def test_scan_removes_temp_files_of_dead_writers_only(store, make_block):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    h = os.urandom(16).hex()
    d = store.dir / h[:2]
    d.mkdir()
    dead_tmp = d / f".{h}.{store._host}-{dead.pid}-0.tmp"
    live_tmp = d / f".{h}.{store._host}-{os.getpid()}-1.tmp"
    old_tmp = d / f".{h}.otherhost-{os.getpid()}-2.tmp"
    for p in (dead_tmp, live_tmp, old_tmp):
        p.write_bytes(b"partial")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))
    report = store.scan()
    assert report.stale_tmp == 2 and report.entries == ()
    assert live_tmp.exists() and not dead_tmp.exists() and not old_tmp.exists()


# ---- concurrency within a process ---------------------------------------------------------------
def test_threads_reading_writing_removing_never_see_wrong_bytes(store, make_block):
    hashes = [i.to_bytes(16, "little") for i in range(12)]
    expected = {h: make_block(i) for i, h in enumerate(hashes)}
    wrong, served = [], [0]
    stop = time.monotonic() + 1.0

    def worker(seed):
        import random
        rng = random.Random(seed)
        while time.monotonic() < stop:
            h = rng.choice(hashes)
            r = rng.random()
            if r < 0.35:
                store.put(h, None, (0, 1, 2, 3), expected[h])
            elif r < 0.9:
                got = store.get(h)
                if got is not None:
                    served[0] += 1
                    if not torch.equal(got, expected[h]):
                        wrong.append(h)
            else:
                store.remove(h)
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and served[0] > 50
    store.check_invariants()
    assert store.stats().corrupt == 0 and store.stats().put_failures == 0
    assert not list(store.dir.rglob("*.tmp"))
    on_disk = {e.block_hash for e in DiskStore(store.root, store.layout, store.namespace)
               .scan().entries}
    assert {h for h in hashes if store.path_of(h).exists()} == on_disk
