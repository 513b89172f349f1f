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
    ``child`` is the child inserted last under this node, or None (cleared when it leaves the
    cache): matching follows it and compares tokens before hashing, so a request that goes on
    the way the last one went (a conversation's next turn) pays no hash for the blocks it hits.
    A child with equal tokens has the request's chain hash by construction (invariant 5).
    ``RequestOps.insert_run`` builds nodes field by field (no ``__init__`` call on the commit
    path): a new field must be set there too.
    """

    __slots__ = ("block_hash", "parent", "tokens", "tier", "slot", "children", "last_access",
                 "hits", "child")

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
        self.child: Node | None = None

    def num_children(self, tier: int) -> int:
        return (self.children >> (_CBITS * tier)) & _CMASK

    def __repr__(self) -> str:
        return (f"Node({self.block_hash.hex()[:8]}, tier={self.tier}, slot={self.slot}, "
                f"children={[self.num_children(t) for t in range(MAX_TIERS)]})")


class MoveOp(NamedTuple):
    """A change of residency, to be executed in list order by the storage layer.

    ``dst_tier is None`` means the residency ``(src_tier, src_slot)`` was dropped (a block
    leaving the cache, or one of its copies going away): nothing to copy, the slot or file is
    released. Otherwise the bytes of ``(src_tier, src_slot)`` are copied to
    ``(dst_tier, dst_slot)``; the source is then released, unless ``keep_src`` is true: the
    source stays a valid residency of the block (a write-through copy made from the primary, or
    a promotion out of a write-through tier that keeps the slower copy, whose file the storage
    layer must then *not* remove).
    """

    block_hash: bytes
    src_tier: int
    src_slot: int
    dst_tier: int | None
    dst_slot: int | None
    keep_src: bool = False


class TreeStats:
    """Counters since construction (per tier lists are indexed by tier)."""

    __slots__ = ("inserted", "evicted", "demoted_in", "promoted", "dropped", "collisions",
                 "adopted", "expired", "copies_made", "copies_skipped", "copies_dropped",
                 "free_demotions")

    def __init__(self, num_tiers: int) -> None:
        self.inserted = 0
        self.evicted = [0] * num_tiers       # left the tier under eviction
        self.demoted_in = [0] * num_tiers    # arrived in the tier by demotion
        self.promoted = [0] * num_tiers      # left the tier upwards to the device
        self.dropped = 0                     # left the cache altogether
        self.collisions = 0                  # hash matched, tokens did not
        self.adopted = 0                     # slow-tier node given a recomputed device block
        self.expired = 0
        self.copies_made = 0                 # write-through copies, and sources kept by promotions
        self.copies_skipped = 0              # write-through copies given up: no room in the tier
        self.copies_dropped = 0              # copies evicted, invalidated or dropped (drop_copy)
        self.free_demotions = 0              # demotions onto an existing copy: no bytes moved

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}
