"""The block manager's tier plans: every change the tier components ask of the radix tree.

The block manager is the tree's only writer. The code that moves blocks between tiers
(:mod:`radixkv.tiers`: the mover's fault handling, disk restore, prefetch, the remote tier's
installs; the engine's cache hints) reads the tree (``get``, ``match_tokens``: snapshots by
block hash) but changes it only through these methods, which take block hashes and return the
``MoveOp``\\ s to run. Kept apart from ``block_manager.py`` (sequences, block tables,
copy-on-write) as a mixin; ``self.tree`` is the manager's tree.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixkv.core.node import BlockRef, MoveOp, Node
from radixkv.core.tree import RadixTree


class TierPlans:
    """Tree changes planned for the tier components (see the module docstring)."""

    tree: RadixTree

    def expire(self, now: float | None = None) -> list[MoveOp]:
        """Blocks whose TTL ran out at ``now`` (the TTL policy's, or a per-block ``ttl`` hint
        under any policy, e.g. a cache breakpoint's) leave their tier: the moves to run.
        Runtime complexity: O(expired blocks + nodes * log n)."""
        return self.tree.evict_expired(now)

    def take_moves(self) -> list[MoveOp]:
        """The MoveOps of write-through copies made by ``commit`` (and of the evictions that
        made room for them), in execution order; clears them. Empty without write-through.
        Runtime complexity: O(1)."""
        return self.tree.take_moves()

    def get(self, block_hash: bytes) -> BlockRef | None:
        """The cached block ``block_hash`` (a snapshot, read only). O(its node's length)."""
        return self.tree.get(block_hash)

    def install_lower(self, parent_hash: bytes | None, block_hash: bytes, tokens: bytes,
                      tier: int) -> BlockRef | None:
        """Cache a block whose bytes the caller places in slower tier ``tier`` (a disk file
        found at start, a remote block fetched into the host) after ``parent_hash``; None if
        it cannot be placed. The tree's insert listener hears of it as of a computed block
        (a block entered the cache; e.g. a fleet replica announces it to the router).
        Runtime complexity: O(1) (+ a cut of the parent's node)."""
        ref = self.tree.insert_lower(parent_hash, block_hash, tokens, tier)
        listener = self.tree.insert_listener
        if ref is not None and listener is not None:
            listener([block_hash], None)
        return ref

    def promote_lower(self, block_hash: bytes, tier: int, max_blocks: int | None = None
                      ) -> list[MoveOp]:
        """Plan moving the slower-tier run starting at ``block_hash`` (up to ``max_blocks``
        blocks) up into slower tier ``tier`` (a prefetch): its moves."""
        return self.tree.promote_lower(block_hash, tier, max_blocks)

    def invalidate(self, block_hash: bytes) -> list[MoveOp]:
        """``block_hash`` and everything after it leave the cache (their bytes are bad or
        lost): the drops to run. Runtime complexity: O(dropped blocks)."""
        return self.tree.invalidate(block_hash)

    def drop_copy(self, block_hash: bytes, tier: int) -> MoveOp | None:
        """Forget ``block_hash``'s write-through copy in ``tier`` (its write failed)."""
        return self.tree.writes.drop_copy(block_hash, tier)

    def touch(self, block_hash: bytes, now: float | None = None, near: Node | None = None
              ) -> None:
        """Mark ``block_hash`` and its prefix used now (so making room next to it does not
        evict it); ``near``: the node holding it, if known (``RadixTree.locate_chain``)."""
        self.tree.touch(block_hash, now, near)

    def evict(self, tier: int, num_blocks: int) -> list[MoveOp]:
        """Make room: ``num_blocks`` unheld blocks leave ``tier`` by the policy's order
        (demoted when a slower tier exists, else dropped); the moves to run."""
        return self.tree.evict(tier, num_blocks)

    def set_hints(self, block_hashes: Sequence[bytes], priority: int | None = None,
                  ttl: float | None = None) -> None:
        """Eviction hints (priority, TTL) for cached blocks (cache breakpoints)."""
        self.tree.set_hints(block_hashes, priority=priority, ttl=ttl)


__all__ = ["TierPlans"]
