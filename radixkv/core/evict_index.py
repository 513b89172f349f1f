"""Eviction indexes: the per-tier ordered sets of evictable entries behind the tree's policies.

An *entry* is a tuple ``(*policy.key(node, hints), block_hash)``; the smallest entry is
evicted first and the trailing hash makes entries unique and the order deterministic. Every
index keeps exactly that order; they differ only in what they are fast at.

``SortedIndex`` is a ``sortedcontainers.SortedList``: O(log n) for everything, right for keys
that arrive in any order (priority, a cost-aware score). ``FrequencyIndex`` (LFU) keeps one
``RecencyIndex`` per hit count and a sorted list of the counts in use.

``RecencyIndex`` is for keys that are mostly *times*: LRU's ``(last_access,)`` and TTL's
``(last_access + ttl,)``. A block becomes evictable either when its last reference goes (its
key is "now", larger than every entry) or when its last child leaves its tier (its key is
its child's, or close to it: at the front). So it keeps a sorted ``deque`` of entries, adds at
either end in O(1) when the new entry belongs there, removes lazily (a dict from block hash to
the live entry object says which queued entries are still live), and puts the rare entry that
belongs in the middle into a ``SortedList`` beside it. The minimum is the smaller of the two
heads. Add, remove and pop-min cost amortised O(1) for queued entries and O(log m) for the m
side entries (m is 0 on the traces we measured). An index holds at most one entry per block
hash (a node is filed once per tier), which is what lets liveness be keyed by the hash. An
``OrderedDict`` run did the same at about twice the cost per operation (its iterators and node
bookkeeping).

The seam for new policies (issue 15): a policy may define ``new_index()`` returning any
object with this interface (``add``, ``remove``, ``pop_min``, ``min``, ``__len__``,
``__iter__`` in order, ``__contains__``); without it the tree uses ``SortedIndex``. Pure Python.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from heapq import heappop, heappush, merge
from typing import Any, Protocol

from sortedcontainers import SortedList

#: An index entry: ``(*policy key, tail block hash)``, compared lexicographically (the policy's
#: key fields are numbers; the trailing hash makes entries unique).
Entry = tuple[Any, ...]


class SortedIndex:
    """Evictable entries in a SortedList. Runtime complexity: O(log n) per operation."""

    __slots__ = ("_s",)

    def __init__(self) -> None:
        self._s = SortedList()

    def add(self, entry: Entry) -> None:
        self._s.add(entry)

    def remove(self, entry: Entry) -> None:
        """Remove ``entry`` (must be present; ValueError otherwise)."""
        self._s.remove(entry)

    def pop_min(self) -> Entry:
        entry: Entry = self._s.pop(0)
        return entry

    def min(self) -> Entry:
        entry: Entry = self._s[0]
        return entry

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._s

    def __len__(self) -> int:
        return len(self._s)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._s)


class RecencyIndex:
    """Evictable entries as a sorted ``deque`` with lazy deletion, plus a sorted side list.

    ``_q`` holds entries in strictly increasing order; ``_live`` maps each live queued entry's
    block hash (its last field, unique in a tier's index) to the entry object itself, so a
    queued entry is *live* iff ``_live.get(entry[-1]) is entry``: one lookup of a ``bytes`` key
    (whose hash is cached) instead of hashing a tuple, and no generation pair per entry. An
    entry removed and added again is a new tuple (the tree builds one per add), so its dead copy
    still queued is not mistaken for it; ``check_invariants`` would catch an object queued
    twice. ``remove`` only forgets the entry in ``_live`` (O(1)); dead entries are dropped when
    they reach the head, and the deque is compacted when they outnumber the live ones
    (amortised O(1)). Entries that belong in the middle go to the side list.
    Runtime complexity: ``add``/``remove``/``pop_min`` amortised O(1), O(log m) for the side
    list's m entries.
    """

    __slots__ = ("_q", "_live", "_dead", "_side", "_nside")

    def __init__(self) -> None:
        self._q: deque[Entry] = deque()
        self._live: dict[bytes, Entry] = {}
        self._dead = 0      # dead entries still in _q
        self._side = SortedList()
        self._nside = 0     # len(self._side), kept here: SortedList.__len__ is a Python call

    def add(self, entry: Entry) -> None:
        """Add ``entry`` (a tuple not in the index, ending with its unique block hash; pass a
        new tuple, not one added and removed before)."""
        q = self._q
        if not q or entry > q[-1]:
            self._live[entry[-1]] = entry
            q.append(entry)
        elif entry < q[0]:
            self._live[entry[-1]] = entry
            q.appendleft(entry)
        else:
            self._side.add(entry)
            self._nside += 1

    def remove(self, entry: Entry) -> None:
        """Remove ``entry`` (must be present; ValueError otherwise)."""
        live = self._live
        h = entry[-1]
        queued = live.get(h)
        if queued is None or queued != entry:
            self._side.remove(entry)
            self._nside -= 1
            return
        del live[h]
        self._dead = dead = self._dead + 1
        if dead > 64 and dead > 2 * len(live):
            self._q = deque(e for e in self._q if live.get(e[-1]) is e)
            self._dead = 0

    @property
    def num_side(self) -> int:
        """Entries in the side list (those that arrived out of order). O(1)."""
        return self._nside

    def clear(self) -> None:
        """Forget every entry, live and dead (an emptied index made ready for reuse). O(n)."""
        self._q.clear()
        self._live.clear()
        self._dead = 0
        self._side.clear()
        self._nside = 0

    def is_clear(self) -> bool:
        """Whether nothing is queued, live, dead or on the side (as ``clear`` leaves it)."""
        return not (self._q or self._live or self._side or self._dead or self._nside)

    def pop_min(self) -> Entry:
        # the head, skipping dead entries, inlined (called once per victim)
        q, live = self._q, self._live
        while q:
            entry = q[0]
            h = entry[-1]
            if live.get(h) is entry:
                if self._nside and self._side[0] < entry:
                    break
                q.popleft()
                del live[h]
                return entry
            q.popleft()
            self._dead -= 1
        if self._nside:
            self._nside -= 1
            side: Entry = self._side.pop(0)
            return side
        raise IndexError("pop_min() of an empty index")

    def pop_min_peek(self) -> tuple[Entry, Entry | None]:
        """``(pop_min(), min() after it or None)`` in one call: the device-only LRU eviction
        loop needs the next entry's key to apply the per-block tie rule (``EvictableSet.take``)
        only where two victims have the same key. Runtime complexity: as ``pop_min``."""
        q, live = self._q, self._live
        entry: Entry
        while True:   # pop_min, inlined
            if not q:
                if not self._nside:
                    raise IndexError("pop_min() of an empty index")
                self._nside -= 1
                entry = self._side.pop(0)
                break
            entry = q[0]
            h = entry[-1]
            if live.get(h) is entry:
                if self._nside and self._side[0] < entry:
                    self._nside -= 1
                    entry = self._side.pop(0)
                    break
                q.popleft()
                del live[h]
                break
            q.popleft()
            self._dead -= 1
        while q:
            nxt = q[0]
            if live.get(nxt[-1]) is nxt:
                if self._nside and self._side[0] < nxt:
                    side: Entry = self._side[0]
                    return entry, side
                return entry, nxt
            q.popleft()
            self._dead -= 1
        after: Entry | None = self._side[0] if self._nside else None
        return entry, after

    def min(self) -> Entry:
        # the head, skipping dead entries, inlined (the tie rule asks once per victim)
        q, live = self._q, self._live
        side: Entry
        while q:
            entry = q[0]
            if live.get(entry[-1]) is entry:
                if self._nside and self._side[0] < entry:
                    side = self._side[0]
                    return side
                return entry
            q.popleft()
            self._dead -= 1
        if self._nside:
            side = self._side[0]
            return side
        raise IndexError("min() of an empty index")

    def __contains__(self, entry: Entry) -> bool:
        return self._live.get(entry[-1]) == entry or entry in self._side

    def __len__(self) -> int:
        return len(self._live) + self._nside

    def __iter__(self) -> Iterator[Entry]:
        live = self._live
        return merge((e for e in self._q if live.get(e[-1]) is e), self._side)

    def check_invariants(self) -> None:
        q = list(self._q)
        assert all(a < b for a, b in zip(q, q[1:])), "queue out of order"
        alive = [e for e in q if self._live.get(e[-1]) is e]
        assert len(alive) == len(self._live), (
            f"{len(self._live)} live entries, {len(alive)} of them queued")
        dead = len(q) - len(alive)
        assert dead == self._dead, f"dead count {self._dead} != {dead}"
        assert not self._live.keys() & {e[-1] for e in self._side}, (
            "an entry both queued and in the side list")
        assert self._nside == len(self._side), f"side count {self._nside} != {len(self._side)}"


class FrequencyIndex:
    """LFU's entries ``(hits, last_access, hash)`` in frequency buckets.

    One ``RecencyIndex`` per hit count (within a bucket entries are ordered by time, so they
    mostly arrive at an end: O(1)), and a heap of the hit counts in use. The order is exactly
    the ``SortedIndex`` order of the same entries.

    Buckets open and close all the time under ``lfu-ghost``, whose restored counts spread the
    entries over many counts (about one bucket opened per entry added on round-robin chat), so
    both are cheap here: the counts are a ``heapq`` heap (C) with lazy deletion (a closed
    bucket's count stays in the heap until it reaches the top, or until stale counts outnumber
    live ones and the heap is rebuilt: amortised O(log b)) instead of a ``SortedList``
    (a Python-level add and remove per bucket), and a closed bucket's empty ``RecencyIndex`` is
    kept for the next bucket to open (up to ``_SPARE``) instead of building a new one.
    Runtime complexity: O(1) amortised per operation within a bucket, O(log b) amortised when a
    bucket opens or empties (b buckets).
    """

    __slots__ = ("_buckets", "_heap", "_n", "_spare")

    _SPARE = 64

    def __init__(self) -> None:
        self._buckets: dict[int, RecencyIndex] = {}
        self._heap: list[int] = []        # counts of open buckets, and stale ones (lazily)
        self._n = 0
        self._spare: list[RecencyIndex] = []

    def add(self, entry: Entry) -> None:
        b = self._buckets.get(entry[0])
        if b is None:
            b = self._buckets[entry[0]] = self._spare.pop() if self._spare else RecencyIndex()
            heap = self._heap
            if len(heap) > 2 * len(self._buckets) + 32:
                heap[:] = sorted(self._buckets)       # drop stale counts (a sorted list is a heap)
            else:
                heappush(heap, entry[0])
        b.add(entry)
        self._n += 1

    def _close(self, hits: int, b: RecencyIndex) -> None:
        """Bucket ``hits`` is empty: forget it (its count leaves the heap lazily) and keep its
        index, emptied of dead queued entries, for reuse."""
        del self._buckets[hits]
        if len(self._spare) < self._SPARE:
            b.clear()
            self._spare.append(b)

    def _top(self) -> int:
        """The smallest count with an open bucket (drops stale counts at the top)."""
        heap, buckets = self._heap, self._buckets
        while heap[0] not in buckets:
            heappop(heap)
        return heap[0]

    def remove(self, entry: Entry) -> None:
        """Remove ``entry`` (must be present; KeyError or ValueError otherwise)."""
        b = self._buckets[entry[0]]
        b.remove(entry)
        self._n -= 1
        if not len(b):
            self._close(entry[0], b)

    def pop_min(self) -> Entry:
        if not self._n:
            raise IndexError("pop_min() of an empty index")
        hits = self._top()
        b = self._buckets[hits]
        entry = b.pop_min()
        self._n -= 1
        if not len(b):
            self._close(hits, b)
        return entry

    def min(self) -> Entry:
        if not self._n:
            raise IndexError("min() of an empty index")
        return self._buckets[self._top()].min()

    def __contains__(self, entry: Entry) -> bool:
        b = self._buckets.get(entry[0])
        return b is not None and entry in b

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Entry]:
        for hits in sorted(self._buckets):
            yield from self._buckets[hits]

    def check_invariants(self) -> None:
        assert set(self._heap) >= self._buckets.keys(), "an open bucket's count not in the heap"
        heap = self._heap
        assert all(heap[(i - 1) // 2] <= heap[i] for i in range(1, len(heap))), "not a heap"
        assert sum(len(b) for b in self._buckets.values()) == self._n, "entry count"
        for hits, b in self._buckets.items():
            assert len(b), f"empty bucket {hits} kept"
            b.check_invariants()
            assert all(e[0] == hits for e in b), f"bucket {hits} holds another count"
        for b in self._spare:
            assert b.is_clear(), "a spare not empty"
            assert all(b is not x for x in self._buckets.values()), "a spare in use"


class AgingIndex(SortedIndex):
    """A ``SortedIndex`` that reports every entry it pops (to ``on_pop``): LFU with dynamic
    aging raises its level ``L`` to each victim's key. Runtime complexity: O(log n)."""

    __slots__ = ("_on_pop",)

    def __init__(self, on_pop: Callable[[Entry], None]) -> None:
        super().__init__()
        self._on_pop = on_pop

    def pop_min(self) -> Entry:
        e: Entry = self._s.pop(0)
        self._on_pop(e)
        return e


class EvictionIndex(Protocol):
    """What the tree needs of a per-tier index (``SortedIndex``, ``RecencyIndex``,
    ``FrequencyIndex``, or a policy's own, e.g. ``ForecastIndex``, ``DuelIndex``): the seam of
    the module docstring, structurally typed."""

    def add(self, entry: Entry) -> None: ...

    def remove(self, entry: Entry) -> None: ...

    def pop_min(self) -> Entry: ...

    def min(self) -> Entry: ...

    def __contains__(self, entry: Entry) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Entry]: ...
