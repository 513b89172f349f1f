"""TieredKVMover: execute the radix tree's tier moves on real memory (device, host RAM, disk).

The tree decides residency and returns ``MoveOp(block_hash, src_tier, src_slot, dst_tier,
dst_slot)``; this mover makes the bytes follow, in list order, before anything reads them.
Tier indices are the tree's: 0 is the device, then the configured lower tiers fastest first
(host, disk; a disk tier without a host tier is tier 1). Each consecutive run of moves with the
same direction becomes one :class:`~radixkv.storage.transfer.TransferEngine` batch (one
gather/scatter for device<->host, ``io_threads`` parallel file operations for disk), submitted
and waited for at once: a slot vacated by one move may be refilled by a later move of the same
list, so a run must land before the next one starts.

What each move does:

=====================  =====================================================================
device -> host         copy the device block into the host slot
host/device -> disk    ``DiskStore.put`` with the node's parent hash and token ids (so another
                       process can rebuild the tree); skipped if the tree no longer caches the
                       block (it was dropped later in the same list)
host/disk -> device    copy into the device block (a promotion); a disk file is removed once
                       loaded (write-back: a block lives in one tier, so the disk holds exactly
                       the disk tier's blocks)
drop (dst None)        disk: remove the file (a dropped block is never served, not even after
                       a restart); device/host: nothing to do
=====================  =====================================================================

Faults (the disk is the only tier that fails at run time):

* a **load** that fails (missing, corrupt, foreign, EIO): the device block holds garbage. Its
  hash goes to :meth:`take_failed_loads`; the caller must free the sequences that reference it,
  ``tree.invalidate`` the node and allocate again (the scheduler does this right after the
  allocation, before any other sequence can lock the node). The file is removed too.
* a **write** that fails (ENOSPC, EIO): at the end of the list, if the tree still places the
  block on disk, the node (and its subtree, all on disk and unreferenced) is invalidated, so the
  bookkeeping never claims a block the disk does not hold; counted, warned by the store.

Device <-> device copies (copy-on-write of a shared tail) run on the cache tensor as in
:class:`~radixkv.engine.kv_mover.DeviceOnlyMover`.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixkv.core.block_manager import CopyOp
from radixkv.core.tree import DEVICE, MoveOp, RadixTree
from radixkv.engine.kv_mover import DeviceOnlyMover
from radixkv.errors import ConfigError, StorageError
from radixkv.storage.device import DevicePool
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.storage.transfer import DeviceBlock, DiskBlock, HostSlot, Move, TransferEngine

log = logging.getLogger(__name__)


def wrap_device_pool(kv_cache: torch.Tensor, layout: KVLayout) -> DevicePool:
    """A :class:`DevicePool` over an existing cache tensor (the model runner's), no copy."""
    want = layout.cache_shape(int(kv_cache.shape[2]))
    if tuple(kv_cache.shape) != want:
        raise ConfigError(f"kv_cache shape {tuple(kv_cache.shape)} does not match {want}")
    pool = DevicePool.__new__(DevicePool)
    pool.layout = layout
    pool.num_blocks = int(kv_cache.shape[2])
    pool.device = kv_cache.device
    pool.kv_cache = kv_cache
    return pool


@dataclass
class MoverStats:
    """Counters of a TieredKVMover. Directions are ``"device->host"``, ``"disk->device"``, ...;
    bytes are block payload bytes of moves that landed."""

    moves: dict[str, int] = field(default_factory=dict)
    bytes_moved: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    drops: int = 0
    files_removed: int = 0
    load_failures: int = 0       # promotions from disk whose read failed (block recomputed)
    write_failures: int = 0      # demotions to disk whose write failed (block dropped)
    skipped_writes: int = 0      # demotions of blocks dropped later in the same list
    invalidated_blocks: int = 0  # nodes dropped because of a failed write (with subtrees)
    copies: int = 0

    def as_dict(self) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self).items()}


class TieredKVMover:
    """KVMover over a device cache tensor plus optional host and disk tiers.

    Args:
        kv_cache: the device cache ``[L, 2, num_blocks, block_size, kv_heads, head_dim]``.
        layout: its block layout.
        host: the host tier (tree tier 1), or None.
        disk: the disk tier (the last tree tier), or None.
        tree: the radix tree whose moves this mover executes (read for parent hashes and
            tokens of blocks written to disk; mutated only to invalidate failed writes).
        io_threads: parallel file operations per disk batch.
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, host: HostPool | None,
                 disk: DiskStore | None, tree: RadixTree, io_threads: int = 4) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.host, self.disk, self.tree = host, disk, tree
        self.kinds = ["device"] + (["host"] if host is not None else []) \
            + (["disk"] if disk is not None else [])
        if len(self.kinds) != tree.num_tiers:
            raise ConfigError(f"the tree has {tree.num_tiers} tiers, the mover {self.kinds}")
        self.disk_tier = self.kinds.index("disk") if disk is not None else None
        self.device = wrap_device_pool(kv_cache, layout)
        self.engine = TransferEngine(self.device, host, disk, io_threads=io_threads)
        self._cow = DeviceOnlyMover(kv_cache)
        self._failed_loads: list[bytes] = []
        self.stats = MoverStats()
        self._block_bytes = layout.bytes_per_block

    # ------------------------------------------------------------------ KVMover protocol
    def apply_moves(self, moves: Sequence[MoveOp]) -> None:
        """Execute ``moves`` in order (consecutive moves of one direction as one batch)."""
        failed_writes: list[MoveOp] = []
        i = 0
        while i < len(moves):
            key = (moves[i].src_tier, moves[i].dst_tier)
            j = i + 1
            while j < len(moves) and (moves[j].src_tier, moves[j].dst_tier) == key:
                j += 1
            self._run_group(moves[i:j], failed_writes)
            i = j
        if failed_writes:
            self._drop_failed_writes(failed_writes)

    def copy_blocks(self, copies: Sequence[CopyOp]) -> None:
        self._cow.copy_blocks(copies)
        self.stats.copies += len(copies)

    # ------------------------------------------------------------------ faults
    def take_failed_loads(self) -> list[bytes]:
        """Hashes of blocks whose promotion failed since the last call (the caller must
        invalidate them before any sequence reads them)."""
        out, self._failed_loads = self._failed_loads, []
        return out

    def close(self) -> None:
        """Stop the transfer worker threads."""
        self.engine.close()

    # ------------------------------------------------------------------ internals
    def _loc(self, tier: int, slot: int, block_hash: bytes, writing: bool) -> object:
        kind = self.kinds[tier]
        if kind == "device":
            return DeviceBlock(slot)
        if kind == "host":
            return HostSlot(slot)
        if not writing:
            return DiskBlock(block_hash)
        node = self.tree.get(block_hash)
        parent = node.parent.block_hash if node.parent is not None else None
        return DiskBlock(block_hash, parent, tuple(array("i", node.tokens)))

    def _run_group(self, group: Sequence[MoveOp], failed_writes: list[MoveOp]) -> None:
        m0 = group[0]
        src_kind = self.kinds[m0.src_tier]
        if m0.dst_tier is None:
            self.stats.drops += len(group)
            if src_kind == "disk":
                for m in group:
                    self.stats.files_removed += self.disk.remove(m.block_hash)
            return
        dst_kind = self.kinds[m0.dst_tier]
        direction = f"{src_kind}->{dst_kind}"
        ops = list(group)
        if dst_kind == "disk":  # a block dropped later in this list is not worth writing
            keep = [m for m in ops if self.tree.get(m.block_hash) is not None]
            self.stats.skipped_writes += len(ops) - len(keep)
            ops = keep
            if not ops:
                return
        batch = [Move(self._loc(m.src_tier, m.src_slot, m.block_hash, False),
                      self._loc(m.dst_tier, m.dst_slot, m.block_hash, dst_kind == "disk"))
                 for m in ops]
        eng = self.engine
        result = eng.wait(eng.submit(eng.prepare(batch)))
        self.stats.batches += 1
        if result is None:  # wait() without timeout only returns a result
            raise StorageError(f"transfer batch of {len(batch)} {direction} moves vanished")
        ok_n = 0
        for m, ok, err in zip(ops, result.ok, result.errors):
            if ok:
                ok_n += 1
                if src_kind == "disk":  # promoted: the disk tier no longer holds it
                    self.stats.files_removed += self.disk.remove(m.block_hash)
            elif src_kind == "disk":
                self.stats.load_failures += 1
                log.warning("loading KV block %s from disk failed (%s); it will be recomputed",
                            m.block_hash.hex()[:16], err)
                self.disk.remove(m.block_hash)  # corrupt ones are gone already
                self._failed_loads.append(m.block_hash)
            elif dst_kind == "disk":
                self.stats.write_failures += 1
                failed_writes.append(m)
            else:  # a copy between device and host memory: a bug, never a miss
                raise StorageError(f"{direction} copy of block {m.block_hash.hex()[:16]} "
                                   f"failed: {err}")
        self.stats.moves[direction] = self.stats.moves.get(direction, 0) + ok_n
        self.stats.bytes_moved[direction] = (self.stats.bytes_moved.get(direction, 0)
                                             + ok_n * self._block_bytes)

    def _drop_failed_writes(self, failed: list[MoveOp]) -> None:
        """Nodes the tree still places on disk although their file was never written: drop
        them (and their subtrees, which live on disk too) so that they degrade to a miss."""
        tree = self.tree
        for m in failed:
            node = tree.get(m.block_hash)
            if node is None or node.tier != m.dst_tier or node.slot != m.dst_slot:
                continue  # promoted (its load failed too, handled there) or dropped since
            drops = tree.invalidate(node)
            self.stats.invalidated_blocks += len(drops)
            for d in drops:  # descendants on disk: remove their files
                if self.kinds[d.src_tier] == "disk" and d.block_hash != m.block_hash:
                    self.stats.files_removed += self.disk.remove(d.block_hash)
        if failed:
            log.warning("%d KV block(s) could not be written to the disk tier; dropped from "
                        "the cache (they will be recomputed when needed)", len(failed))


__all__ = ["TieredKVMover", "MoverStats", "wrap_device_pool"]
