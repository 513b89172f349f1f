"""The block manager's tier plans: every change the tier components ask of the radix tree.

The block manager is the tree's only writer. The code that moves blocks between tiers
(:mod:`radixkv.tiers`: the mover's fault handling, disk restore, prefetch, the remote tier's
installs; the engine's cache hints) reads the tree but changes it only through these methods,
which return the ``MoveOp``\ s to run. Kept apart from ``block_manager.py`` (sequences, block
tables, copy-on-write) as a mixin; ``self.tree`` is the manager's tree.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixkv.core.node import MoveOp, Node
from radixkv.core.tree import RadixTree


class TierPlans:
    """Tree changes planned for the tier components (see the module docstring)."""

    tree: RadixTree

    def expire(self, now: float | None = None) -> list[MoveOp]:
        """Blocks whose TTL ran out at ``now`` (the TTL policy's, or a per-block ``ttl`` hint
        under any policy, e.g. a cache breakpoint's) leave their tier: the moves to run.
        Runtime complexity: O(expired * log n)."""
        return self.tree.evict_expired(now)

    def take_moves(self) -> list[MoveOp]:
        """The MoveOps of write-through copies made by ``commit`` (and of the evictions that
        made room for them), in execution order; clears them. Empty without write-through.
        Runtime complexity: O(1)."""
        return self.tree.take_moves()

    # The block manager is the only writer of the tree: the tier components (the mover's
    # fault handling, disk restore and prefetch, the remote tier's installs, the engine's cache
    # hints) ask it for plans and execute the MoveOps it returns; they only read the tree.
    def get(self, block_hash: bytes) -> Node | None:
        """The cached node of ``block_hash`` (read only). Runtime complexity: O(1)."""
        return self.tree.get(block_hash)

    def install_lower(self, parent: Node | None, block_hash: bytes, tokens: bytes,
                      tier: int) -> Node | None:
        """Cache a block whose bytes the caller places in slower tier ``tier`` (a disk file
        found at start, a remote block fetched into the host); None if it cannot be placed.
        The tree's insert listener hears of it as of a computed block (a block entered the
        cache; e.g. a fleet replica announces it to the router).
        Runtime complexity: O(1) (+ the tier's evictions)."""
        node = self.tree.insert_lower(parent, block_hash, tokens, tier)
        listener = self.tree.insert_listener
        if node is not None and listener is not None:
            listener([node])
        return node

    def promote_lower(self, node: Node, tier: int) -> list[MoveOp]:
        """Plan moving ``node`` up into slower tier ``tier`` (a prefetch): its moves."""
        return self.tree.promote_lower(node, tier)

    def invalidate(self, node: Node) -> list[MoveOp]:
        """``node`` and its subtree leave the cache (their bytes are bad or lost): the drops
        to run. Runtime complexity: O(subtree)."""
        return self.tree.invalidate(node)

    def drop_copy(self, node: Node, tier: int) -> MoveOp | None:
        """Forget ``node``'s write-through copy in ``tier`` (its write failed)."""
        return self.tree.drop_copy(node, tier)

    def touch(self, node: Node, now: float | None = None) -> None:
        """Mark ``node`` used now (so making room next to it does not evict it)."""
        self.tree.touch(node, now)

    def evict(self, tier: int, num_blocks: int) -> list[MoveOp]:
        """Make room: ``num_blocks`` unreferenced blocks leave ``tier`` by the policy's order
        (demoted when a slower tier exists, else dropped); the moves to run."""
        return self.tree.evict(tier, num_blocks)

    def set_hints(self, nodes: Sequence[Node], priority: int | None = None,
                  ttl: float | None = None) -> None:
        """Eviction hints (priority, TTL) for cached blocks (cache breakpoints)."""
        self.tree.set_hints(nodes, priority=priority, ttl=ttl)


__all__ = ["TierPlans"]
