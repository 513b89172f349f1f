"""Eviction indexes: the per-tier ordered sets of evictable entries behind the tree's policies.

An *entry* is a tuple ``(*policy.key(node, hints), block_hash)``; the smallest entry is
evicted first and the trailing hash makes entries unique and the order deterministic. Every
index keeps exactly that order; they differ only in what they are fast at.

``SortedIndex`` is a ``sortedcontainers.SortedList``: O(log n) for everything, right for keys
that arrive in any order (LFU, priority, a cost-aware score).

``RecencyIndex`` is for keys that are mostly *times*: LRU's ``(last_access,)`` and TTL's
``(last_access + ttl,)``. A block becomes evictable either when its last reference goes (its
key is "now", larger than every entry) or when its last child leaves its tier (its key is
its child's, or close to it: at the front). So it keeps an ``OrderedDict`` run of entries in
increasing order, adds at either end in O(1) when the new entry belongs there, and puts the
rare entry that belongs in the middle into a ``SortedList`` beside it. The minimum is the
smaller of the two heads. Add, remove and pop-min cost O(1) for entries in the run and
O(log m) for the m entries in the side list (m is 0 on the traces we measured).

The seam for new policies (issue 15): a policy may define ``new_index()`` returning any
object with this interface (``add``, ``remove``, ``pop_min``, ``min``, ``__len__``,
``__iter__`` in order, ``__contains__``); without it the tree uses ``SortedIndex``. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from heapq import merge

from sortedcontainers import SortedList


class SortedIndex:
    """Evictable entries in a SortedList. Runtime complexity: O(log n) per operation."""

    __slots__ = ("_s",)

    def __init__(self) -> None:
        self._s = SortedList()

    def add(self, entry: tuple) -> None:
        self._s.add(entry)

    def remove(self, entry: tuple) -> None:
        """Remove ``entry`` (must be present; ValueError otherwise)."""
        self._s.remove(entry)

    def pop_min(self) -> tuple:
        return self._s.pop(0)

    def min(self) -> tuple:
        return self._s[0]

    def __contains__(self, entry: tuple) -> bool:
        return entry in self._s

    def __len__(self) -> int:
        return len(self._s)

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._s)


class RecencyIndex:
    """Evictable entries as an ordered run (``OrderedDict``) plus a sorted side list.

    Invariant: the run's keys are strictly increasing front to back; every entry is in exactly
    one of the run and the side list. Runtime complexity: ``add``/``remove``/``pop_min`` O(1)
    when the entry is (or goes) at an end of the run, O(log m) for the side list's m entries.
    """

    __slots__ = ("_run", "_side", "_nside")

    def __init__(self) -> None:
        self._run: OrderedDict[tuple, None] = OrderedDict()
        self._side = SortedList()
        self._nside = 0     # len(self._side), kept here: SortedList.__len__ is a Python call

    def add(self, entry: tuple) -> None:
        run = self._run
        if not run or entry > next(reversed(run)):
            run[entry] = None
        elif entry < next(iter(run)):
            run[entry] = None
            run.move_to_end(entry, last=False)
        else:
            self._side.add(entry)
            self._nside += 1

    def remove(self, entry: tuple) -> None:
        """Remove ``entry`` (must be present; ValueError otherwise)."""
        try:
            del self._run[entry]
        except KeyError:
            self._side.remove(entry)
            self._nside -= 1

    def pop_min(self) -> tuple:
        run = self._run
        if self._nside and (not run or self._side[0] < next(iter(run))):
            self._nside -= 1
            return self._side.pop(0)
        return run.popitem(last=False)[0]

    def min(self) -> tuple:
        run = self._run
        if self._nside and (not run or self._side[0] < next(iter(run))):
            return self._side[0]
        return next(iter(run))

    def __contains__(self, entry: tuple) -> bool:
        return entry in self._run or entry in self._side

    def __len__(self) -> int:
        return len(self._run) + self._nside

    def __iter__(self) -> Iterator[tuple]:
        return merge(self._run, self._side)

    def check_invariants(self) -> None:
        run = list(self._run)
        assert all(a < b for a, b in zip(run, run[1:])), "run out of order"
        assert not set(run) & set(self._side), "an entry is both in the run and the side list"
        assert self._nside == len(self._side), f"side count {self._nside} != {len(self._side)}"


EvictionIndex = SortedIndex | RecencyIndex
"""The index types the tree accepts (any object with the same methods works)."""
