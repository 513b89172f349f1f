"""One interface for the stores that hold KV block bytes: host RAM, disk files, a Redis server.

:class:`StorageBackend` is what :class:`~radixkv.storage.host.HostPool`,
:class:`~radixkv.storage.disk.DiskStore` and :class:`~radixkv.storage.remote.RemoteStore`
implement (after LMCache's ``StorageBackendInterface``), and what the tier code in
``radixkv/tiers`` calls. The contract, checked for all three by one test suite
(``tests/storage/test_backend_contract.py``):

**Keys.** A backend addresses a block by a key: the host pool by *block id* (``BlockId``,
an ``int``: which block an id holds is the radix tree's business), the disk and remote stores by
*chain hash* (``BlockHash``, 16 ``bytes``: they are content-addressed and outlive the process).

**Batched calls, caller buffers.** Every call takes a batch: ``contains_many`` answers per key;
``read_into_many`` copies each found block into the caller's buffer (a writable bytes-like
object of exactly ``layout.bytes_per_block`` bytes, e.g. ``HostPool.block_bytes(block_id)``), so no
backend allocates a block per read; ``put_many`` stores :class:`BlockWrite` items and returns a
:class:`PutResult` (per block whether it was stored or queued, and how many failed).

**Bad input raises, and changes nothing.** A key of the wrong type or length, a block id out of
range, a buffer of the wrong size, a read-only output buffer, mismatched batch lengths: the
call raises :class:`~radixkv.errors.InvalidBlockError` before touching any block (every item
is validated first). The byte-view check is :func:`block_view`, the one validator all three
share.

**Faults are misses, never wrong bytes.** A block that is absent, truncated, corrupt, foreign
(another namespace, layout or format) or unreadable is a ``False`` from ``read_into_many`` (the
buffer may then hold garbage and must not be used); a write that fails (disk full, server down,
queue full) is a ``False`` in the :class:`PutResult`, counted by the backend. Only I/O errors are
caught; a bug propagates.

**Pins.** ``pin(keys)`` keeps blocks from ``remove_many`` (and ``DiskStore.remove``) until as
many ``unpin`` calls: a reader holding a block (a load in flight) keeps it. Pins are counted per
key and local to this process: another process, or the remote server's own eviction and TTLs,
may still remove a pinned block, which is then a miss.

**close()** finishes background work (the remote store's queued writes, bounded) and releases
sockets; the data stays (files, server keys). Calling it twice is harmless.

This module is torch-free, so the remote store (also torch-free) and the core can import it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from radixkv.errors import InvalidBlockError
from radixkv.storage.layout import KVLayout

#: Length of a block hash (xxh3-128 chain hash) and of a namespace fingerprint, in bytes.
HASH_BYTES = 16

if TYPE_CHECKING:
    # any object with the buffer protocol (bytes, bytearray, memoryview, array; a NumPy array
    # through its ``.data``); typing_extensions ships with torch's dependencies
    from typing_extensions import Buffer

#: A backend's key type: ``int`` (host block id) or ``bytes`` (block hash).
K = TypeVar("K")
K_contra = TypeVar("K_contra", contravariant=True)
K_co = TypeVar("K_co", covariant=True)   # a BlockWrite[BlockHash] is a BlockWrite[bytes]


class BlockWrite(NamedTuple, Generic[K_co]):
    """One block to store: ``key`` (block id or hash), its parent's hash (None for a first block)
    and token ids (written with the block so that another process can rebuild the tree; the
    host pool ignores both), and ``payload``, a bytes-like object of ``bytes_per_block`` bytes.

    A plain tuple ``(key, parent_hash, token_ids, payload)`` is accepted wherever a
    ``BlockWrite`` is."""

    key: K_co
    parent_hash: bytes | None
    token_ids: Sequence[int]
    payload: Buffer


class PutResult(list[bool]):
    """Per block of a ``put_many``, in order: True if stored (or, for a store that writes in
    the background, queued); False if it failed or was dropped (counted by the backend).
    A ``list[bool]``, so ``sum(result)`` is the number stored."""

    @property
    def failed(self) -> int:
        """How many blocks of the call were not stored."""
        return sum(1 for ok in self if not ok)


@runtime_checkable
class StorageBackend(Protocol[K_contra]):
    """Byte storage of KV blocks addressed by a key (see the module docstring for the
    contract). ``layout`` fixes the block size: every payload and output buffer is
    ``layout.bytes_per_block`` bytes."""

    layout: KVLayout

    def contains_many(self, keys: Sequence[K_contra]) -> list[bool]:
        """Per key, whether the backend holds the block now (a True may still miss on read:
        evicted meanwhile, or failing verification). Raises ``InvalidBlockError`` on a bad
        key."""
        ...

    def read_into_many(self, keys: Sequence[K_contra], outs: Sequence[Buffer]) -> list[bool]:
        """Copy each block into ``outs[i]`` (writable, ``bytes_per_block`` bytes); True where
        ``outs[i]`` now holds the verified block. Raises ``InvalidBlockError`` (and reads
        nothing) on a bad key or buffer, or ``len(outs) != len(keys)``."""
        ...

    def put_many(self, blocks: Sequence[BlockWrite[K_contra]]) -> PutResult:
        """Store blocks; per block True once stored or queued. Raises ``InvalidBlockError``
        (and stores nothing) if any item is malformed."""
        ...

    def pin(self, keys: Iterable[K_contra]) -> None:
        """Keep these blocks from ``remove_many`` until as many ``unpin`` calls."""
        ...

    def unpin(self, keys: Iterable[K_contra]) -> None:
        """Release pins taken by ``pin``; raises ``InvalidBlockError`` for a key not pinned."""
        ...

    def remove_many(self, keys: Sequence[K_contra]) -> int:
        """Remove blocks (pinned ones are kept); the number removed."""
        ...

    def close(self) -> None:
        """Finish background work and release resources; the stored data stays."""
        ...


def check_hash(block_hash: object, what: str = "block_hash") -> bytes:
    """``block_hash`` itself if it is ``HASH_BYTES`` bytes, else ``InvalidBlockError``."""
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_BYTES:
        raise InvalidBlockError(f"{what} must be {HASH_BYTES} bytes, got {block_hash!r}")
    return block_hash


def block_view(buf: Buffer, nbytes: int, what: str, writable: bool = False) -> memoryview:
    """The one byte-view check of every backend: a flat ``memoryview`` (format ``B``) of a
    bytes-like ``buf`` that is C-contiguous and exactly ``nbytes`` long (and writable when
    ``writable``), else ``InvalidBlockError`` naming ``what``. Aliases ``buf`` (no copy)."""
    try:
        view = memoryview(buf)   # a TypeError for what is no buffer (checked at run time too)
    except TypeError:
        raise InvalidBlockError(f"{what}: expected a bytes-like object of {nbytes} bytes, "
                                f"got {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise InvalidBlockError(f"{what}: expected {nbytes} contiguous bytes, got a "
                                "non-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes != nbytes:
        raise InvalidBlockError(f"{what}: expected {nbytes} contiguous bytes, got {view.nbytes}")
    if writable and view.readonly:
        raise InvalidBlockError(f"{what} needs a writable buffer")
    return view


def check_outs(keys: Sequence[object], outs: Sequence[Buffer], nbytes: int, what: str
               ) -> list[memoryview]:
    """Writable byte views of ``outs`` after checking there is one per key (``read_into_many``
    validates every buffer before reading any block)."""
    if len(outs) != len(keys):
        raise InvalidBlockError(f"{what}: {len(keys)} keys but {len(outs)} output buffers")
    return [block_view(o, nbytes, what, writable=True) for o in outs]


class Pins(Generic[K]):
    """Per-key pin counts of one backend (thread-safe). ``pin``/``unpin`` as in
    :class:`StorageBackend`; ``pinned(key)`` is O(1)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[K, int] = {}

    def pin(self, keys: Iterable[K]) -> None:
        with self._lock:
            for k in keys:
                self._counts[k] = self._counts.get(k, 0) + 1

    def unpin(self, keys: Iterable[K]) -> None:
        keys = list(keys)
        with self._lock:
            need: dict[K, int] = {}
            for k in keys:
                need[k] = need.get(k, 0) + 1
            short = [k for k, n in need.items() if self._counts.get(k, 0) < n]
            if short:   # checked first: a bad call releases nothing
                raise InvalidBlockError(f"unpin of {len(short)} key(s) not pinned: "
                                        f"{short[:3]!r}")
            for k, n in need.items():
                left = self._counts[k] - n
                if left:
                    self._counts[k] = left
                else:
                    del self._counts[k]

    def pinned(self, key: K) -> bool:
        with self._lock:
            return key in self._counts

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)


__all__ = ["HASH_BYTES", "BlockWrite", "PutResult", "StorageBackend", "Pins", "block_view",
           "check_hash", "check_outs"]
