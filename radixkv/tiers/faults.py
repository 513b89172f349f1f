"""How the tiered mover files failed moves: the bookkeeping must never claim bytes a tier does
not hold. Split out of ``mover.py``; each function takes the ``TieredKVMover`` (``self``) and
changes the
tree only through its writer (the block manager).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixkv.core.node import MoveOp

if TYPE_CHECKING:
    from radixkv.tiers.mover import TieredKVMover

log = logging.getLogger("radixkv.tiers.mover")


def drop_failed_prefetches(self: TieredKVMover, failed: list[MoveOp]) -> None:
    """Prefetch loads (disk -> host) that failed: the host block holds garbage. A node still
    there is dropped with its subtree (host/disk, unreferenced); one the tree moved since
    is poisoned, so its next move out of the host fails instead of copying garbage."""
    tree = self.tree
    for m in failed:
        h = m.block_hash
        node = tree.block_of(h, (m.dst_tier, m.dst_block_id))
        if node is None:
            continue
        if node.tier == m.dst_tier and node.block_id == m.dst_block_id:
            drops = self._writer.invalidate(h)
            self.stats.invalidated_blocks += len(drops)
            for d in drops:
                self._prefetched.discard(d.block_hash)
                if self.kinds[d.src_tier] == "disk":
                    self.stats.files_removed += self._disk().remove_many([d.block_hash])
        else:
            self._poisoned.add(m.block_hash)


def drop_failed_writes(self: TieredKVMover, failed: list[MoveOp]) -> None:
    """Nodes the tree still places on disk although their file was never written: drop
    them (and their subtrees, which live on disk too) so that they degrade to a miss."""
    tree = self.tree
    for m in failed:
        h, dst_tier = m.block_hash, m.dst_tier
        if dst_tier is None:
            continue   # a drop writes nothing, so it cannot fail a write
        node = tree.block_of(h, (dst_tier, m.dst_block_id))
        if node is None:
            continue
        if node.tier != dst_tier or node.block_id != m.dst_block_id:
            # a write-through copy: drop just the copy (the node lives on faster up);
            # otherwise promoted (its load failed too, handled there) or dropped since
            if tree.copy_block_id(h, dst_tier) == m.dst_block_id:
                self._writer.drop_copy(h, dst_tier)
                self.stats.dropped_copies += 1
            continue
        drops = self._writer.invalidate(h)
        self.stats.invalidated_blocks += len(drops)
        for d in drops:  # descendants on disk: remove their files
            if self.kinds[d.src_tier] == "disk" and d.block_hash != m.block_hash:
                self.stats.files_removed += self._disk().remove_many([d.block_hash])
    if failed:
        log.warning("%d KV block(s) could not be written to the disk tier; dropped from "
                    "the cache (they will be recomputed when needed)", len(failed))


__all__ = ["drop_failed_prefetches", "drop_failed_writes"]
