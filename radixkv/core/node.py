"""The radix tree's value types: a cached block (``Node``), a residency change (``MoveOp``) and
the tree's counters (``TreeStats``). Pure Python; see ``tree.py`` for the structure itself."""

from __future__ import annotations

from typing import NamedTuple

DEVICE = 0
_CBITS = 20                      # child counts of one tier are packed in 20 bits of one int
_CMASK = (1 << _CBITS) - 1
MAX_TIERS = 3


class Node:
    """One cached full block. ``slot`` is its block id in ``tier``'s pool.

    ``children`` packs the number of children per tier (20 bits each) into one int, which costs
    no memory for the common small values; ``last_access`` and ``hits`` feed the policies.
    """

    __slots__ = ("block_hash", "parent", "tokens", "tier", "slot", "children", "last_access", "hits")

    def __init__(self, block_hash: bytes, parent: Node | None, tokens: bytes, tier: int,
                 slot: int, now: float) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.tokens = tokens
        self.tier = tier
        self.slot = slot
        self.children = 0
        self.last_access = now
        self.hits = 0

    def num_children(self, tier: int) -> int:
        return (self.children >> (_CBITS * tier)) & _CMASK

    def __repr__(self) -> str:
        return (f"Node({self.block_hash.hex()[:8]}, tier={self.tier}, slot={self.slot}, "
                f"children={[self.num_children(t) for t in range(MAX_TIERS)]})")


class MoveOp(NamedTuple):
    """A change of residency, to be executed in list order by the storage layer.

    ``dst_tier is None`` means the block was dropped from the cache (no copy needed).
    """

    block_hash: bytes
    src_tier: int
    src_slot: int
    dst_tier: int | None
    dst_slot: int | None


class TreeStats:
    """Counters since construction (per tier lists are indexed by tier)."""

    __slots__ = ("inserted", "evicted", "demoted_in", "promoted", "dropped", "collisions",
                 "adopted", "expired")

    def __init__(self, num_tiers: int) -> None:
        self.inserted = 0
        self.evicted = [0] * num_tiers       # left the tier under eviction
        self.demoted_in = [0] * num_tiers    # arrived in the tier by demotion
        self.promoted = [0] * num_tiers      # left the tier upwards to the device
        self.dropped = 0                     # left the cache altogether
        self.collisions = 0                  # hash matched, tokens did not
        self.adopted = 0                     # slow-tier node given a recomputed device block
        self.expired = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}
