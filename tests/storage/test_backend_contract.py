"""One contract suite, run against every StorageBackend: HostPool (keys: block ids), DiskStore and
RemoteStore (keys: block hashes; the remote one against a real redis-server on 127.0.0.1 and a
free port). The contract is the docstring of radixkv/storage/backend.py."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from radixkv.errors import InvalidBlockError
from radixkv.storage.backend import BlockWrite, PutResult, StorageBackend, block_view
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.storage.remote import RemoteStore
from test_remote import block as payload   # the remote tests' payload maker (a bare-name
                                           # import, as the package's conftest imports its helpers)


@dataclass
class Harness:
    """A backend and what the suite needs to drive it: ``keys(n)`` fresh valid keys,
    ``bad_keys`` keys of the wrong kind, ``settle()`` waits for background writes,
    ``damage(key, how)`` alters the stored form of a block (None: the backend has none)."""

    backend: Any
    keys: Callable[[int], list[Any]]
    bad_keys: list[Any]
    settle: Callable[[], None]
    damage: Callable[[Any, str], None] | None


def _hashes(n: int) -> list[bytes]:
    return [os.urandom(16) for _ in range(n)]


@pytest.fixture(params=["host", "disk", "remote"])
def harness(request, tmp_path, layout, namespace) -> Iterator[Harness]:
    kind = request.param
    if kind == "host":
        pool = HostPool(layout, 8, pin_memory=False)
        ids = iter(range(8))
        yield Harness(pool, lambda n: [next(ids) for _ in range(n)],
                      [8, -1, b"x" * 16, 1.0], lambda: None, None)
        return
    if kind == "disk":
        store = DiskStore(tmp_path / "kv", layout, namespace)

        def damage_file(h: bytes, how: str) -> None:
            path = store.path_of(h)
            data = bytearray(path.read_bytes())
            if how == "truncate":
                data = data[:len(data) // 2]
            else:   # flip one payload byte
                data[-7] ^= 0x40
            path.write_bytes(bytes(data))

        yield Harness(store, _hashes, [b"short", "0" * 16, 7], lambda: None, damage_file)
        store.check_invariants()
        return
    url = request.getfixturevalue("redis_url")
    store = RemoteStore(url, layout, namespace)
    client = request.getfixturevalue("redis_server").client()

    def damage_value(h: bytes, how: str) -> None:
        key = store.key_of(h)
        value = bytearray(client.get(key))
        if how == "truncate":
            value = value[:len(value) // 2]
        else:
            value[-7] ^= 0x40
        client.set(key, bytes(value))

    yield Harness(store, _hashes, [b"short", "0" * 16, 7], lambda: store.flush(5.0),
                  damage_value)
    store.check_invariants()
    store.close()


def _put(h: Harness, layout: KVLayout, keys: list[Any], seed0: int = 0) -> PutResult:
    res = h.backend.put_many([BlockWrite(k, None, [1, 2, 3, 4], payload(layout, seed0 + i))
                              for i, k in enumerate(keys)])
    h.settle()
    return res


def _snapshot(h: Harness, layout: KVLayout, keys: list[Any]) -> list[tuple[bool, bytes | None]]:
    """What the backend shows for ``keys``: contains, and the bytes a read gives."""
    outs = [bytearray(layout.bytes_per_block) for _ in keys]
    got = h.backend.read_into_many(keys, outs)
    return [(c, bytes(o) if g else None)
            for c, g, o in zip(h.backend.contains_many(keys), got, outs)]


def test_implements_the_protocol(harness):
    assert isinstance(harness.backend, StorageBackend)


def test_put_contains_read_round_trip(harness, layout):
    keys = harness.keys(3)
    assert harness.backend.contains_many(keys) == [False] * 3
    res = _put(harness, layout, keys[:2])
    assert isinstance(res, PutResult) and list(res) == [True, True] and res.failed == 0
    assert harness.backend.contains_many(keys) == [True, True, False]
    outs = [bytearray(layout.bytes_per_block) for _ in keys]
    marker = bytes(outs[2])
    assert harness.backend.read_into_many(keys, outs) == [True, True, False]
    assert bytes(outs[0]) == payload(layout, 0) and bytes(outs[1]) == payload(layout, 1)
    assert bytes(outs[2]) == marker   # a miss leaves its buffer alone
    # a memoryview of a bigger buffer works as an output too (caller buffers, no allocation)
    big = bytearray(2 * layout.bytes_per_block)
    view = memoryview(big)[layout.bytes_per_block:]
    assert harness.backend.read_into_many(keys[1:2], [view]) == [True]
    assert bytes(big[layout.bytes_per_block:]) == payload(layout, 1)


def test_remove_and_pins(harness, layout):
    keys = harness.keys(3)
    _put(harness, layout, keys)
    harness.backend.pin([keys[0]])
    harness.backend.pin([keys[0]])          # counted
    assert harness.backend.remove_many(keys[:2]) == 1
    assert harness.backend.contains_many(keys) == [True, False, True]
    harness.backend.unpin([keys[0]])
    assert harness.backend.remove_many([keys[0]]) == 0   # still pinned once
    harness.backend.unpin([keys[0]])
    assert harness.backend.remove_many([keys[0]]) == 1
    assert harness.backend.contains_many(keys) == [False, False, True]
    with pytest.raises(InvalidBlockError):
        harness.backend.unpin([keys[2]])    # never pinned
    assert harness.backend.read_into_many([keys[2]], [bytearray(layout.bytes_per_block)]) \
        == [True]


@pytest.mark.parametrize("bad", ["key", "short_payload", "long_payload", "readonly_out",
                                 "short_out", "count", "not_bytes"])
def test_bad_input_raises_typed_error_and_changes_nothing(harness, layout, bad):
    keys = harness.keys(3)
    _put(harness, layout, keys[:2])
    before = _snapshot(harness, layout, keys)
    n = layout.bytes_per_block
    good = BlockWrite(keys[2], None, [1], payload(layout, 9))
    for bad_key in (harness.bad_keys if bad == "key" else [None]):
        with pytest.raises(InvalidBlockError):
            if bad == "key":
                # the bad item comes last: nothing before it may have been written
                harness.backend.put_many([good, BlockWrite(bad_key, None, [1], bytes(n))])
            elif bad == "short_payload":
                harness.backend.put_many([good, BlockWrite(keys[0], None, [1], bytes(n - 1))])
            elif bad == "long_payload":
                harness.backend.put_many([good, BlockWrite(keys[0], None, [1], bytes(n + 8))])
            elif bad == "not_bytes":
                harness.backend.put_many([good, BlockWrite(keys[0], None, [1], 12345)])
            elif bad == "readonly_out":
                harness.backend.read_into_many(keys[:2], [bytearray(n), bytes(n)])
            elif bad == "short_out":
                harness.backend.read_into_many(keys[:2], [bytearray(n), bytearray(n - 1)])
            else:
                harness.backend.read_into_many(keys[:2], [bytearray(n)])
        if bad == "key":
            for call in (harness.backend.contains_many, harness.backend.remove_many,
                         harness.backend.pin):
                with pytest.raises(InvalidBlockError):
                    call([keys[0], bad_key])
    harness.settle()
    assert _snapshot(harness, layout, keys) == before


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_entries_are_never_served(harness, layout, how):
    if harness.damage is None:
        assert isinstance(harness.backend, HostPool)   # RAM: no stored form to damage
        return
    keys = harness.keys(2)
    _put(harness, layout, keys)
    harness.damage(keys[0], how)
    outs = [bytearray(layout.bytes_per_block) for _ in keys]
    assert harness.backend.read_into_many(keys, outs) == [False, True]
    assert bytes(outs[1]) == payload(layout, 1)
    # the damaged entry is gone (deleted on sight), so it stays a miss
    assert harness.backend.read_into_many(keys[:1], outs[:1]) == [False]


def test_close_is_idempotent_and_keeps_data(harness, layout):
    keys = harness.keys(1)
    _put(harness, layout, keys)
    harness.backend.close()
    harness.backend.close()


def test_block_view_is_the_one_validator(layout):
    n = layout.bytes_per_block
    assert block_view(bytearray(n), n, "x", writable=True).nbytes == n
    for buf, writable in [(bytes(n), True), (bytearray(n + 1), False), ("text", False),
                          (memoryview(bytearray(2 * n))[::2], False)]:
        with pytest.raises(InvalidBlockError):
            block_view(buf, n, "x", writable=writable)


def test_the_package_exports_resolve():
    """Every public name of ``radixkv.storage`` loads (a lazy export pointing at a moved module
    failed only when used), and the interface comes from the package itself."""
    import radixkv.storage as storage

    for name in storage.__all__:
        assert getattr(storage, name) is not None, name
    assert storage.StorageBackend is StorageBackend and storage.HostPool is HostPool
