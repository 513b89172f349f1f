"""How computed blocks reach the tree's slower tiers: write policies as strategy objects.

``RadixTree(writes=...)`` takes one; the tree calls it at the few points where a policy can
matter (a run inserted, a node's policy key about to change, a demotion, a promotion, a node
invalidated) and never checks a flag.

* :class:`TreeWriteBack` (the default, a null object): a block reaches a slower tier only when it is
  evicted from a faster one. Every hook does nothing.
* :class:`TreeWriteThrough`: every block inserted on the device is also *copied* into each of the
  policy's tiers at once (an inclusive hierarchy; KV blocks are immutable, so a copy stays
  valid for as long as its block is cached). A promotion out of such a tier keeps its source
  as a copy, and a demotion onto an existing copy moves no bytes (a *free demotion*). Copies
  take block_ids of their tier's pool, compete with that tier's primaries for them under the same
  policy key (their node's), are always evictable (dropping one loses nothing) and do not count
  for prefix closure. Why: a crash or restart loses the device and host tiers; with the disk
  tier written through, every computed block survives it, and demotions of blocks that already
  have copies cost nothing.

Copies are kept per block (``copies[tier]: block hash -> block_id``), because a copy can be evicted
on its own; each one is filed in its tier's eviction index as ``(*policy key of its node, its
block hash)``, which is how eviction tells it from a primary (whose node lives in that tier).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from radixkv.core.node import DEVICE, MoveOp, Node
from radixkv.core.pool import BlockId
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.core.evictable import EvictableSet
    from radixkv.core.hashing import BlockHash
    from radixkv.core.node import TreeStats
    from radixkv.core.pool import BlockPool


class WritesHost(Protocol):
    """The tree as a write policy sees it (``RadixTree`` is one): the structure it reads, the
    moves list it appends to, and the eviction it may ask for in its tiers. Declared here so
    that this module imports no tree (the tree imports it)."""

    num_tiers: int
    pools: list[BlockPool]
    heads: dict[bytes, Node]
    evictable: list[EvictableSet]
    pending_moves: list[MoveOp]
    stats: TreeStats

    def evict_from(self, tier: int, num: int, moves: list[MoveOp]) -> None: ...

    def find(self, block_hash: BlockHash, near: Node | None = None) -> Node | None: ...

_tuple_new = tuple.__new__


class TreeWrites:
    """Write-back: the null policy (see the module docstring). Subclasses override the hooks.

    The hooks run inside tree operations, with the tree's structures consistent except for the
    change being made; they may evict in the policy's tiers (through ``tree.evict_from``) and
    append moves to the list they are given (or to ``tree.pending_moves``)."""

    name = "write_back"
    tiers: tuple[int, ...] = ()

    def bind(self, tree: WritesHost) -> TreeWrites:
        """Attach to ``tree`` (once); returns the policy object the tree keeps."""
        return self

    def after_insert(self, node: Node, start: int) -> None:
        """Blocks ``node.hashes[start:]`` were just inserted on the device."""

    def unfile(self, node: Node) -> list[int] | None:
        """``node``'s policy key is about to change: take its copies out of their indexes.
        Returns what ``refile`` needs (None: nothing was taken)."""
        return None

    def refile(self, node: Node, tiers: list[int]) -> None:
        """File ``node``'s copies again under its new key."""

    def take_for_demotion(self, node: Node, tier: int) -> list[int | None] | None:
        """``node`` is about to be demoted into ``tier``: hand over its copies there as its
        new primary block_ids (a list aligned with its blocks, None where it has none), or None."""
        return None

    def keep_sources(self, node: Node, tier: int, block_ids: Sequence[int]) -> bool:
        """``node`` moved out of ``tier`` up to a faster one: keep ``block_ids`` (its old block_ids
        there, still allocated) as copies? False: the caller frees them."""
        return False

    def drop_block_copies(self, node: Node, block_hash: BlockHash, moves: list[MoveOp]) -> None:
        """Block ``block_hash`` of ``node`` leaves the cache: drop its copies, fastest tier
        first."""

    def drop_popped_copy(self, block_hash: BlockHash, tier: int, moves: list[MoveOp]) -> None:
        raise AssertionError("a write-back tree has no copies")

    def drop_copy(self, block_hash: BlockHash, tier: int) -> MoveOp | None:
        return None

    def copy_block_id(self, block_hash: BlockHash, tier: int) -> BlockId | None:
        return None

    def num_copies(self, tier: int) -> int:
        return 0

    def copies(self, tier: int) -> dict[BlockHash, int]:
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.tiers)})"


TreeWriteBack = TreeWrites


class TreeWriteThrough(TreeWrites):
    """Copies of every inserted block in ``tiers`` (each in ``1 .. num_tiers - 1``)."""

    name = "write_through"

    def __init__(self, tiers: Sequence[int]) -> None:
        try:
            wt = tuple(tiers)
        except TypeError:
            raise ConfigError(f"write_through must be a sequence of tiers, got {tiers!r}") from None
        if not wt or any(type(u) is not int or u < 1 for u in wt) or len(set(wt)) != len(wt):
            raise ConfigError(
                f"write_through must list distinct slower tiers (>= 1), got {tiers!r}")
        self.tiers = tuple(sorted(wt))
        self.tree: WritesHost      # set by ``bind``
        self._copies: list[dict[BlockHash, int]] = []

    def bind(self, tree: WritesHost) -> TreeWrites:
        bound = getattr(self, "tree", None)
        if bound is not None and bound is not tree:
            raise ConfigError("a TreeWriteThrough policy belongs to one tree")
        if any(u >= tree.num_tiers for u in self.tiers):
            raise ConfigError(f"write_through must list distinct slower tiers in "
                              f"1..{tree.num_tiers - 1}, got {list(self.tiers)}")
        self.tree = tree
        self._copies = [{} for _ in range(tree.num_tiers)]
        return self

    # ------------------------------------------------------------------ queries
    def copy_block_id(self, block_hash: BlockHash, tier: int) -> BlockId | None:
        block_id = self._copies[tier].get(block_hash)
        return None if block_id is None else BlockId(block_id)

    def num_copies(self, tier: int) -> int:
        return len(self._copies[tier])

    def copies(self, tier: int) -> dict[BlockHash, int]:
        return self._copies[tier]

    # ------------------------------------------------------------------ hooks
    def after_insert(self, node: Node, start: int) -> None:
        """Copy each new block into each write-through tier, fastest first, making room by
        the tier's own eviction (a copy is dropped, a primary demoted, cascading as usual);
        if nothing there can give way the copy is skipped (best effort)."""
        tree = self.tree
        pending = tree.pending_moves
        stats = tree.stats
        key = None
        for i in range(start, len(node.hashes)):
            h = node.hashes[i]
            for u in self.tiers:
                pool = tree.pools[u]
                if pool.num_free == 0:
                    if not tree.evictable[u]:
                        stats.copies_skipped += 1
                        continue
                    tree.evict_from(u, 1, pending)
                    if len(node.hashes) <= i or node.hashes[i] is not h or \
                            tree.heads.get(node.hashes[0]) is not node:
                        # the cascade cannot take it: a guard
                        raise AssertionError(f"making room for a copy dropped its block {h.hex()}")
                block_id = pool.allocate_one()
                self._copies[u][h] = block_id
                ev = tree.evictable[u]
                if key is None:
                    key = ev.key(node)
                ev.add((*key, h))
                stats.copies_made += 1
                pending.append(
                    _tuple_new(MoveOp, (h, DEVICE, node.block_ids[i], u, block_id, True)))

    def unfile(self, node: Node) -> list[int] | None:
        out: list[int] | None = None
        key = None
        for u in self.tiers:
            copies = self._copies[u]
            if not copies:
                continue
            found = False
            for h in node.hashes:
                if h in copies:
                    ev = self.tree.evictable[u]
                    if key is None:
                        key = ev.key(node)
                    ev.remove((*key, h))
                    found = True
            if found:
                out = [u] if out is None else [*out, u]
        return out

    def refile(self, node: Node, tiers: list[int]) -> None:
        key = self.tree.evictable[node.tier].key(node)
        for u in tiers:
            copies, idx = self._copies[u], self.tree.evictable[u]
            for h in node.hashes:
                if h in copies:
                    idx.add((*key, h))

    def take_for_demotion(self, node: Node, tier: int) -> list[int | None] | None:
        copies = self._copies[tier]
        if not copies:
            return None
        out: list[int | None] = [copies.pop(h, None) for h in node.hashes]
        if all(s is None for s in out):
            return None
        idx = self.tree.evictable[tier]
        key = idx.key(node)
        for h, s in zip(node.hashes, out):
            if s is not None:
                idx.remove((*key, h))
        return out

    def keep_sources(self, node: Node, tier: int, block_ids: Sequence[int]) -> bool:
        if tier not in self.tiers:
            return False
        copies = self._copies[tier]
        idx = self.tree.evictable[tier]
        key = idx.key(node)
        for h, s in zip(node.hashes, block_ids):
            copies[h] = s
            idx.add((*key, h))
        self.tree.stats.copies_made += len(block_ids)
        return True

    def drop_block_copies(self, node: Node, block_hash: BlockHash, moves: list[MoveOp]) -> None:
        key = None
        for u in self.tiers:
            if block_hash in self._copies[u]:
                ev = self.tree.evictable[u]
                if key is None:
                    key = ev.key(node)
                ev.remove((*key, block_hash))
                self.drop_popped_copy(block_hash, u, moves)

    def drop_popped_copy(self, block_hash: BlockHash, tier: int, moves: list[MoveOp]) -> None:
        """Free ``block_hash``'s copy in ``tier`` (its entry already out of the index)."""
        block_id = self._copies[tier].pop(block_hash)
        self.tree.pools[tier].free_one(block_id)
        self.tree.stats.copies_dropped += 1
        moves.append(_tuple_new(MoveOp, (block_hash, tier, block_id, None, None, False)))

    def drop_copy(self, block_hash: BlockHash, tier: int) -> MoveOp | None:
        block_id = self._copies[tier].get(block_hash)
        if block_id is None:
            return None
        node = self.tree.find(block_hash)
        assert node is not None, f"a copy of uncached block {block_hash.hex()}"
        ev = self.tree.evictable[tier]
        ev.remove((*ev.key(node), block_hash))
        moves: list[MoveOp] = []
        self.drop_popped_copy(block_hash, tier, moves)
        return moves[0]


def make_writes(write_through: Sequence[int] | TreeWrites) -> TreeWrites:
    """The policy object for ``RadixTree(write_through=...)``: an object passes through, an
    empty sequence is write-back, a non-empty one lists the write-through tiers."""
    if isinstance(write_through, TreeWrites):
        return write_through
    try:
        tiers = tuple(write_through)
    except TypeError:
        raise ConfigError(
            f"write_through must be a sequence of tiers, got {write_through!r}") from None
    return TreeWriteThrough(tiers) if tiers else TreeWrites()


__all__ = ["TreeWrites", "TreeWriteBack", "TreeWriteThrough", "make_writes"]
