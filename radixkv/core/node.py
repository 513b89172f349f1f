"""The radix tree's value types: a cached run of blocks (``Node``), a residency change
(``MoveOp``), one cached block as the other layers see it (``BlockRef``) and the tree's
counters (``TreeStats``). Pure Python; see ``tree.py`` for the structure itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from radixkv.core.hashing import BlockHash
from radixkv.core.pool import BlockId


@dataclass(frozen=True)
class NodeHints:
    """Per-node scheduling hints set by callers (e.g. pin a system prompt).

    ``priority``: higher survives longer under PriorityPolicy (default 0).
    ``ttl``: seconds a block is kept after its last use under TTLPolicy (None: the policy's).
    """

    priority: int = 0
    ttl: float | None = None

DEVICE = 0
_CBITS = 20                      # child counts of one tier are packed in 20 bits of one int
_CMASK = (1 << _CBITS) - 1
MAX_TIERS = 3


class Node:
    """A *run*: consecutive cached full blocks of one chain that nothing tells apart.

    Path compression. Every block of a node has the same parent chain before it, lives in the
    same tier, is held by the same live sequences and has the same policy key, so one object
    carries them all and lock, release, touch and filing in an eviction index cost O(1) per
    node instead of O(blocks). A node is cut in two (``RadixTree.split``) where that stops
    being true: where two chains diverge, where a request holds only a prefix of it, where
    eviction takes only its tail, where a hint marks only a prefix.

    Block ``i`` (``0 <= i < len(hashes)``) of the node has chain hash ``hashes[i]``, token ids
    ``tokens[i*w:(i+1)*w]`` (``w = block_size * 4`` bytes, little-endian int32) and block id
    ``block_ids[i]`` in the pool of tier ``tier`` (``block_ids`` is an ``array("i")``: 4 bytes a
    block, no int object per cached block; reading one makes a transient int). Its first block's
    parent is the *last* block of ``parent`` (None: a root); children hang off the last block only.

    ``children`` packs the number of child nodes per tier (20 bits each); the child nodes form
    an intrusive doubly-linked list (``child`` is the first, then ``next``; ``prev`` back), most
    recently linked first, which is also the child ``match`` tries before hashing.
    ``ref`` counts the live sequences holding the node (device only): each of them holds every
    block of it. ``last_access``/``hits``/``hints`` (a ``NodeHints`` or None) feed the policy;
    ``aux`` is the policy's own per-node state (None for LRU and the other policies without
    hooks; an immutable value, since a cut copies it to both sides: ``policy.py``).
    ``tokens`` is a ``bytearray``: a run grows at its end (a conversation's next blocks) and
    shrinks at either end (eviction takes the tail, a split the head) in place.
    """

    __slots__ = ("hashes", "tokens", "block_ids", "tier", "ref", "parent", "child", "next", "prev",
                 "children", "last_access", "hits", "hints", "aux")

    def __init__(self, hashes: list[BlockHash], tokens: bytearray,
                 block_ids: array[int] | list[int], tier: int, parent: Node | None, now: float,
                 ref: int = 0) -> None:
        self.hashes = hashes
        self.tokens = tokens
        self.block_ids = block_ids if type(block_ids) is array else array("i", block_ids)
        self.tier = tier
        self.ref = ref
        self.parent = parent
        self.child: Node | None = None
        self.next: Node | None = None
        self.prev: Node | None = None
        self.children = 0
        self.last_access = now
        self.hits = 0
        self.hints: NodeHints | None = None
        #: the policy's per-node state: an immutable value (a number, a tuple), or None
        self.aux: object = None

    def __len__(self) -> int:
        return len(self.hashes)

    def num_children(self, tier: int) -> int:
        return (self.children >> (_CBITS * tier)) & _CMASK

    def iter_children(self) -> Iterator[Node]:
        c = self.child
        while c is not None:
            yield c
            c = c.next

    def __repr__(self) -> str:
        return (f"Node({self.hashes[0].hex()[:8] if self.hashes else '-'}+{len(self.hashes)}, "
                f"tier={self.tier}, ref={self.ref}, block_ids={self.block_ids[:4]}"
                f"{'...' if len(self.block_ids) > 4 else ''}, "
                f"children={[self.num_children(t) for t in range(MAX_TIERS)]})")


class BlockRef(NamedTuple):
    """One cached block as the tier layer and the tests see it: a snapshot, valid until the
    tree changes. ``block_id`` is its block id in ``tier`` (its primary residency); the tokens are
    int32 little-endian bytes."""

    block_hash: BlockHash
    tier: int
    block_id: BlockId
    parent_hash: BlockHash | None
    tokens: bytes


class MoveOp(NamedTuple):
    """A change of residency, to be executed in list order by the storage layer.

    ``dst_tier is None`` means the residency ``(src_tier, src_block_id)`` was dropped (a block
    leaving the cache, or one of its copies going away): nothing to copy, the block id or file is
    released. Otherwise the bytes of ``(src_tier, src_block_id)`` are copied to
    ``(dst_tier, dst_block_id)``; the source is then released, unless ``keep_src`` is true: the
    source stays a valid residency of the block (a write-through copy made from the primary, or
    a promotion out of a write-through tier that keeps the slower copy, whose file the storage
    layer must then *not* remove).
    """

    block_hash: BlockHash
    src_tier: int
    src_block_id: BlockId
    dst_tier: int | None
    dst_block_id: BlockId | None
    keep_src: bool = False


class TreeStats:
    """Counters since construction (per tier lists are indexed by tier), in blocks."""

    __slots__ = ("inserted", "evicted", "demoted_in", "promoted", "dropped", "collisions",
                 "adopted", "expired", "copies_made", "copies_skipped", "copies_dropped",
                 "free_demotions", "splits")

    def __init__(self, num_tiers: int) -> None:
        self.inserted = 0
        self.evicted = [0] * num_tiers       # left the tier under eviction
        self.demoted_in = [0] * num_tiers    # arrived in the tier by demotion
        self.promoted = [0] * num_tiers      # left the tier upwards to the device
        self.dropped = 0                     # left the cache altogether
        self.collisions = 0                  # hash matched, tokens did not
        self.adopted = 0                     # slow-tier block given a recomputed device block
        self.expired = 0
        self.copies_made = 0                 # write-through copies, and sources kept by promotions
        self.copies_skipped = 0              # write-through copies given up: no room in the tier
        self.copies_dropped = 0              # copies evicted, invalidated or dropped (drop_copy)
        self.free_demotions = 0              # demotions onto an existing copy: no bytes moved
        self.splits = 0                      # nodes cut in two (divergence, partial use)

    def as_dict(self) -> dict[str, int | list[int]]:
        return {k: getattr(self, k) for k in self.__slots__}
