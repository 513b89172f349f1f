"""KV events: what entered and left one cache, as a queue its readers drain.

The tree appends a typed event wherever blocks enter a tier from outside (``BlockStored``: a
commit on the device, a block placed in a slower tier by ``insert_lower``) or leave the cache
(``BlockRemoved``: dropped from the last tier, invalidated); moves between tiers are not events
(the block stays cached). Readers do not install callbacks: each one ``subscribe``\\ s and drains
what arrived since its last call with ``take_events()`` on the engine loop, as vLLM's
``BlockPool.take_events`` and SGLang's ``take_events`` do, so the remote tier, a fleet replica's
recorder and metrics read the same stream without chaining listeners.

The queue exists only once someone subscribes (``RadixTree.event_queue()``); until then the
tree builds no event, and the device-only LRU loop stays on its fast path.

Event shapes follow vLLM's KV events (``vllm/distributed/kv_events.py``): a ``BlockStored``
carries a chain of consecutive blocks (root side first), the hash of the block before the
first (``None``: a root) and the token ids of all of them; a ``BlockRemoved`` the same for the
blocks that left, so that a reader that must write them elsewhere (the remote tier's
write-back) has what it needs. ``AllCleared``: forget everything known about this cache (sent
to a new subscriber that asks for a snapshot, before the snapshot).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Union

from radixkv.core.hashing import TOKEN_BYTES, BlockHash
from radixkv.core.pool import BlockId

__all__ = ["AllCleared", "BlockRemoved", "BlockStored", "EventCursor", "KVEvent",
           "KVEventCounts", "KVEventQueue"]


class BlockStored(NamedTuple):
    """Blocks that entered the cache in ``tier``: ``block_hashes`` (a chain, root side first;
    the first block's parent is ``parent_hash``, None for a root), their token ids as int32
    little-endian ``tokens`` (``block_size`` per block), and their block ids in ``tier``'s
    pool (``block_ids[i]`` holds ``block_hashes[i]``)."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    tokens: bytes
    tier: int
    block_ids: tuple[BlockId, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES


class BlockRemoved(NamedTuple):
    """Blocks that left the cache from ``tier`` (their primary residency): a chain, root side
    first, after ``parent_hash``, with their token ids (what the blocks held, for a reader
    that keeps them elsewhere)."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    tokens: bytes
    tier: int

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES


class AllCleared(NamedTuple):
    """Forget every block of this cache seen so far (what follows describes it again)."""


KVEvent = Union[BlockStored, BlockRemoved, AllCleared]


class EventCursor:
    """One reader's place in a ``KVEventQueue``: ``take_events()`` returns what arrived since
    its last call (each event once, in order). Build with ``KVEventQueue.subscribe``."""

    __slots__ = ("_queue", "pos", "_first")

    def __init__(self, queue: KVEventQueue, pos: int, first: list[KVEvent]) -> None:
        self._queue = queue
        self.pos = pos   # absolute index of the next event this reader gets
        self._first = first   # the snapshot it asked for, given before the queue's events

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first. Runtime complexity: O(events)."""
        if self._first:
            first, self._first = self._first, []
            return first + self._queue.take(self)
        return self._queue.take(self)

    def close(self) -> None:
        """Stop reading (the queue no longer keeps events for this reader)."""
        self._queue.unsubscribe(self)


class KVEventQueue:
    """An append-only event log with one cursor per reader; events every reader has taken are
    dropped. Appends come from the engine loop (the tree); ``take`` may run on another thread
    (a fleet replica's publisher), so both hold a lock.

    >>> q = KVEventQueue()
    >>> a = q.subscribe()
    >>> q.append(AllCleared())
    >>> b = q.subscribe()
    >>> q.append(AllCleared())
    >>> len(a.take_events()), len(b.take_events()), len(a.take_events())
    (2, 1, 0)
    """

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._base = 0                      # absolute index of self._events[0]
        self._cursors: list[EventCursor] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Events kept (not yet taken by every reader)."""
        return len(self._events)

    @property
    def num_readers(self) -> int:
        return len(self._cursors)

    def append(self, event: KVEvent) -> None:
        with self._lock:
            if self._cursors:
                self._events.append(event)

    def extend(self, events: list[KVEvent]) -> None:
        with self._lock:
            if self._cursors:
                self._events.extend(events)

    def subscribe(self, snapshot: list[KVEvent] | None = None) -> EventCursor:
        """A new reader, from now on; with ``snapshot`` (the events that describe the cache
        as it is: ``RadixTree.snapshot_events()``), it first gets ``AllCleared`` and those."""
        first: list[KVEvent] = [] if snapshot is None else [AllCleared(), *snapshot]
        with self._lock:
            cursor = EventCursor(self, self._base + len(self._events), first)
            self._cursors.append(cursor)
        return cursor

    def unsubscribe(self, cursor: EventCursor) -> None:
        with self._lock:
            if cursor in self._cursors:
                self._cursors.remove(cursor)
                self._trim()

    def take(self, cursor: EventCursor) -> list[KVEvent]:
        with self._lock:
            start = cursor.pos - self._base
            out = self._events[start:]
            cursor.pos = self._base + len(self._events)
            self._trim()
        return out

    def _trim(self) -> None:
        """Drop the events every reader has taken (the lock is held)."""
        if not self._cursors:
            self._base += len(self._events)
            self._events.clear()
            return
        low = min(c.pos for c in self._cursors) - self._base
        if low > 0:
            del self._events[:low]
            self._base += low


class KVEventCounts:
    """Blocks stored in and removed from each tier, counted by a reader of a ``KVEventQueue``
    (the server's ``radixkv_kv_blocks_{stored,removed}_total``). Call ``drain()`` on the
    engine loop (every step, so the queue keeps no backlog for this reader whether or not
    anyone reads the counts); a move between tiers is no event, so it counts nowhere.

    >>> q = KVEventQueue()
    >>> c = KVEventCounts(q.subscribe(), num_tiers=2)
    >>> q.append(BlockStored((b"a", b"b"), None, bytes(16), 0, ()))
    >>> q.append(BlockRemoved((b"a",), None, bytes(8), 1))
    >>> c.drain(), c.stored, c.removed
    (2, [2, 0], [0, 1])
    """

    __slots__ = ("_cursor", "stored", "removed")

    def __init__(self, cursor: EventCursor, num_tiers: int) -> None:
        self._cursor = cursor
        self.stored = [0] * num_tiers    # blocks, per tier (0 = device)
        self.removed = [0] * num_tiers

    def drain(self) -> int:
        """Count the events since the last call; returns how many there were.
        Runtime complexity: O(events)."""
        events = self._cursor.take_events()
        for e in events:
            if type(e) is BlockStored:
                self.stored[e.tier] += len(e.block_hashes)
            elif type(e) is BlockRemoved:
                self.removed[e.tier] += len(e.block_hashes)
        return len(events)

    def close(self) -> None:
        """Stop counting (the queue no longer keeps events for this reader)."""
        self._cursor.close()
