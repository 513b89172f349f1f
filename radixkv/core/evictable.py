"""One tier's evictable blocks in the policy's order: the tree's eviction component.

Each tier of a ``RadixTree`` has one ``EvictableSet`` (``tree.evictable[tier]``). It owns the
tier's eviction index (``evict_index.py``: whatever the policy's ``new_index()`` builds) and
knows the policy's key, so it is the only code that files, unfiles and pops entries, as vLLM's
``FreeKVCacheBlockQueue`` is the only code that touches its links. What it holds:

* every *qualifying primary* of the tier: a node of the tier with no child node in that tier
  and (on the device) no holder, filed once under ``entry(node) = (*key(node), hash of its
  last block)``: every block of a node has the node's key, so its tail is the smallest of them;
* every write-through copy in the tier, under ``(*key(its node), its block hash)`` (the write
  policy files those: ``writes.py``).

The smallest entry goes first; the trailing block hash makes entries unique and the order
deterministic. ``take`` is the per-block tie rule: where another entry has exactly the same
key, a victim gives up only the blocks a per-block cache would take before it.

The hot methods ``add``, ``remove``, ``pop_min`` and ``min`` are the index's own bound methods
(bound once here), so calling them costs what calling the index did. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from radixkv.core.node import _CBITS, _CMASK, DEVICE, Node
from radixkv.core.policy import DEFAULT_HINTS, LRUPolicy

if TYPE_CHECKING:
    from radixkv.core.evict_index import Entry, EvictionIndex
    from radixkv.core.policy import EvictionPolicy

__all__ = ["EvictableSet"]


class EvictableSet:
    """The evictable entries of one tier (see the module docstring).

    Args:
        tier: the tier (0 = device) whose nodes this set files.
        policy: the tree's eviction policy (its ``key`` and ``new_index``).
    """

    __slots__ = ("tier", "index", "policy", "add", "remove", "pop_min", "min", "_lru",
                 "_shift")

    def __init__(self, tier: int, policy: EvictionPolicy) -> None:
        self.tier = tier
        self._shift = _CBITS * tier
        self.use_policy(policy)

    def use_policy(self, policy: EvictionPolicy) -> None:
        """Order this tier by ``policy`` from now on, starting from an empty index (the
        tree's ``switch_policy`` files every evictable node again). O(1)."""
        self.policy = policy
        self.index: EvictionIndex = policy.new_index()
        #: ``add(entry)``, ``remove(entry)`` (must be present), ``pop_min()``, ``min()``: the
        #: index's methods. Runtime complexity: amortised O(1) (``RecencyIndex``), O(log n)
        #: (``SortedIndex``).
        self.add = self.index.add
        self.remove = self.index.remove
        self.pop_min = self.index.pop_min
        self.min = self.index.min
        self._lru = type(policy) is LRUPolicy   # key = (last_access,): no call

    # ------------------------------------------------------------------ keys
    def key(self, node: Node) -> Entry:
        """The policy key of every block of ``node``. O(1) (the policy's ``key``)."""
        if self._lru:
            return (node.last_access,)
        return self.policy.key(node, DEFAULT_HINTS if node.hints is None else node.hints)

    def entry(self, node: Node) -> Entry:
        """The entry ``node`` is filed under: its key plus its last block's hash (unique)."""
        if self._lru:
            return (node.last_access, node.hashes[-1])
        return (*self.policy.key(node, DEFAULT_HINTS if node.hints is None else node.hints),
                node.hashes[-1])

    def qualifies(self, node: Node) -> bool:
        """Whether ``node`` (of this tier) belongs here: no child node in this tier and, on
        the device, no holder. O(1)."""
        if (node.children >> self._shift) & _CMASK:
            return False
        return self.tier != DEVICE or node.ref == 0

    # ------------------------------------------------------------------ filing
    def file(self, node: Node) -> None:
        """File ``node`` (of this tier) if it qualifies: after a change that may make it
        evictable (its last child left the tier, its last holder let go, it arrived)."""
        if (node.children >> self._shift) & _CMASK or (self.tier == DEVICE and node.ref):
            return
        self.add(self.entry(node))

    def unfile(self, node: Node) -> None:
        """Take ``node`` (of this tier) out if it is filed: before a change of its key, its
        children or its holders."""
        if (node.children >> self._shift) & _CMASK or (self.tier == DEVICE and node.ref):
            return
        self.remove(self.entry(node))

    def take(self, node: Node, num: int, e: Entry) -> int:
        """How many blocks of the victim ``node`` (just popped as entry ``e``) go now: all of
        them, or the ``num`` still wanted; where another entry has exactly the same key, only
        those that a per-block cache would take before it (block hash order breaks the tie).
        Runtime complexity: O(blocks taken) comparisons (+ one ``min``)."""
        n = len(node.hashes)
        take = n if num >= n else num
        if take > 1:
            try:
                m = self.min()
            except IndexError:   # nothing else is evictable: no tie
                return take
            if m[:-1] == e[:-1]:
                key, hashes = e[:-1], node.hashes
                j = 1
                while j < take and (*key, hashes[n - 1 - j]) < m:
                    j += 1
                return j
        return take

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[Entry]:
        """The entries in eviction order."""
        return iter(self.index)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self.index

    def check_invariants(self) -> None:
        """The index's own order (if it has a check). O(n)."""
        own = getattr(self.index, "check_invariants", None)
        if own is not None:
            own()

    def __repr__(self) -> str:
        return f"EvictableSet(tier={self.tier}, {len(self.index)} entries)"
