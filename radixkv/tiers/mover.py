"""TieredKVMover: execute the radix tree's tier moves on real memory (device, host RAM, disk).

The tree decides residency and returns ``MoveOp(block_hash, src_tier, src_block_id, dst_tier,
dst_block_id)``; this mover makes the bytes follow, in list order, before anything reads them.
Tier indices are the tree's: 0 is the device, then the configured lower tiers fastest first
(host, disk; a disk tier without a host tier is tier 1). Each consecutive run of moves with the
same direction becomes one batch: a :class:`~radixkv.tiers.transfer.TransferEngine` batch
(one gather/scatter for device<->host, ``io_threads`` parallel file reads for disk loads), or a
batch of staged file writes for demotions to disk. A slot vacated by one move may be refilled by
a later move of the same list, so a run must land before the next one that touches the same
memory starts.

Off the critical path (write-behind and prefetch):

* **Writes to disk** (host/device -> disk) copy their source blocks into a staging buffer at
  once (so the host block or device block is free for reuse when ``apply_moves`` returns) and
  write the files on the mover's I/O threads; they are *pending* until :meth:`drain`. The next
  group drains them only if it reads or removes a file (a load from disk, a drop of a disk
  block); device/host copies and further writes go on. The engine drains at the start of each
  step and when it goes idle, so the writes overlap the forward pass.
* **Prefetch loads** (disk -> host, from ``RadixTree.promote_lower``) are transfer-engine
  batches left running too; they write host blocks, so any later group drains them first.
* **Promotions into the device** (disk -> device with ``async_loads``, host -> device with
  ``async_host_loads``) are left running
  too: :meth:`inflight_device_blocks` names the device blocks they write, and the caller (the
  engine's scheduler) keeps every sequence holding one of them out of the forward until
  :meth:`poll_loads` (non-blocking) or :meth:`wait_loads` settles it. A later group that would
  rewrite a host block such a load still reads (a demotion into the slot the promotion freed),
  or touch one of its device blocks, waits for it first. ``drain(loads=False)`` settles
  everything else and leaves unfinished promotions running.
* At drain, failures are filed exactly as for synchronous moves (below); a prefetch load that
  failed drops its node (still on the host, unreferenced) with its subtree. Should the tree have
  moved that node meanwhile, its host copy is *poisoned*: its next move out of the host fails
  (a load failure or a failed write) instead of copying garbage on.

What each move does:

=====================  =====================================================================
device -> host         copy the device block into the host block
host/device -> disk    ``DiskStore.put`` with the node's parent hash and token ids (so another
                       process can rebuild the tree); skipped if the tree no longer caches the
                       block (it was dropped later in the same list)
host/disk -> device    copy into the device block (a promotion); a disk file is removed once
                       loaded (write-back: the disk holds exactly the disk tier's blocks),
                       unless the move keeps its source (``keep_src``: a write-through tier
                       keeps the block's copy, so its later demotion moves no bytes)
copy (``keep_src``)    the same copies for write-through: device -> host / disk right after a
                       block is committed; the source stays where it is
drop (dst None)        disk: remove the file (a dropped block is never served, not even after
                       a restart); device/host: nothing to do
=====================  =====================================================================

Faults (the disk is the only tier that fails at run time):

* a **load** that fails (missing, corrupt, foreign, EIO): the device block holds garbage. Its
  hash goes to :meth:`take_failed_loads`; the caller must free the sequences that reference it,
  ``tree.invalidate`` the node and allocate again (the scheduler does this right after the
  allocation, before any other sequence can lock the node). The file is removed too.
* a **write** that fails (ENOSPC, EIO): when it is drained, if the tree still places the
  block on disk, the node (and its subtree, all on disk and unreferenced) is invalidated, so the
  bookkeeping never claims a block the disk does not hold; counted, warned by the store. If the
  write was a write-through copy (the node lives in a faster tier), only the copy is dropped.

Device <-> device copies (copy-on-write of a shared tail) run on the cache tensor as in
:class:`~radixkv.tiers.protocol.DeviceOnlyMover`.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence
from typing import Any
from concurrent.futures import ThreadPoolExecutor

import torch

from radixkv.core.block_manager import CopyOp
from radixkv.core.tree import DEVICE, BlockRef, MoveOp, RadixTree
from radixkv.tiers.protocol import CacheWriter, DeviceOnlyMover, KVMover, TreeCacheWriter
from radixkv.tiers.mover_state import MoverStats, _Outcome, _Pending, wrap_device_pool
from radixkv.errors import ConfigError, InvalidBlockError, StorageError
from radixkv.storage.backend import BlockWrite
from radixkv.storage.buffers import byte_view
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.tiers.transfer import (IO_ERRORS, BatchResult, DeviceBlock, DiskBlock, HostBlock,
                                     Location, Move, TransferEngine)

log = logging.getLogger(__name__)


class TieredKVMover(KVMover):
    """KVMover over a device cache tensor plus optional host and disk tiers.

    Args:
        kv_cache: the device cache ``[L, 2, num_blocks, block_size, kv_heads, head_dim]``.
        layout: its block layout.
        host: the host tier (tree tier 1), or None.
        disk: the disk tier (the last tree tier), or None.
        tree: the radix tree whose moves this mover executes (read for parent hashes and
            tokens of blocks written to disk; read only).
        io_threads: parallel file operations per disk batch.
        async_loads: leave promotions from disk into the device running past
            ``apply_moves``; the caller must not read or free their device blocks before
            :meth:`poll_loads` / :meth:`wait_loads` settles them (see
            :meth:`inflight_device_blocks`). The engine's scheduler does this; False waits for
            every promotion inside ``apply_moves``.
        async_host_loads: the same for promotions from the host tier. Off by default: a host
            -> device copy is a memory copy (a DMA on a GPU) far shorter than a step, and
            leaving it running costs the request a step of time to first token
            (docs/benchmarks.md, "Asynchronous promotions").
    """

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, host: HostPool | None,
                 disk: DiskStore | None, tree: RadixTree, io_threads: int = 4,
                 async_loads: bool = False, async_host_loads: bool = False,
                 writer: CacheWriter | None = None) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.host, self.disk, self.tree = host, disk, tree
        # who changes the tree when a move fails (the engine's block manager, the tree's only
        # writer; unit tests may pass none and let the tree itself take the calls)
        self._writer: CacheWriter = writer if writer is not None else TreeCacheWriter(tree)
        self.kinds = ["device"] + (["host"] if host is not None else []) \
            + (["disk"] if disk is not None else [])
        if len(self.kinds) != tree.num_tiers:
            raise ConfigError(f"the tree has {tree.num_tiers} tiers, the mover {self.kinds}")
        self.disk_tier = self.kinds.index("disk") if disk is not None else None
        self.device = wrap_device_pool(kv_cache, layout)
        self.engine = TransferEngine(self.device, host, disk, io_threads=io_threads)
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="radixkv-write")
        self._cow = DeviceOnlyMover(kv_cache)
        self._failed_loads: list[bytes] = []
        self.async_loads = bool(async_loads or async_host_loads)
        self._async_src = {"disk"} if async_loads else set()
        if async_host_loads:
            self._async_src.add("host")
        self._pending: list[_Pending] = []     # batches left running (write, prefetch, load)
        self._prefetched: set[bytes] = set()   # loaded disk -> host, not yet moved on
        self._last_moves: dict[bytes, MoveOp] = {}   # per apply_moves (see there)
        self._wasted: set[int] = set()
        self._poisoned: set[bytes] = set()     # host copy is garbage (failed late prefetch)
        self.stats = MoverStats()
        self._block_bytes = layout.bytes_per_block
        #: Called with each group of a move list right before it runs, after the groups before
        #: it have landed (the remote tier's write-back reads the host blocks of blocks leaving
        #: the host tier: at that moment they hold exactly those blocks).
        self._observers: list[Callable[[Sequence[MoveOp]], None]] = []

    def add_observer(self, fn: Callable[[Sequence[MoveOp]], None]) -> None:
        self._observers.append(fn)

    def counters(self) -> dict[str, Any]:
        return self.stats.as_dict()

    def unsafe_host_block(self, block_hash: bytes) -> bool:
        """True while the host copy of ``block_hash`` may not hold its bytes: a prefetch load
        still in flight (or landed but not yet settled), or a failed one (poisoned)."""
        return block_hash in self._prefetched or block_hash in self._poisoned

    # ------------------------------------------------------------------ KVMover protocol
    def apply_moves(self, moves: Sequence[MoveOp]) -> None:
        """Execute ``moves`` in order (consecutive moves of one direction as one batch).

        Writes to disk, disk -> host prefetch loads and (with ``async_loads``) promotions into
        the device are left running (see the module docstring); a later group that could touch
        what they touch waits for them first. Nothing but moves reads or writes host blocks or
        block files, so the result is the same as waiting for each batch at once."""
        failed_writes: list[MoveOp] = []
        # Where a block written to disk is found (the tree indexes nodes, not blocks: by its
        # place, not its hash): its last move in this list that leaves it somewhere. And the
        # writes whose very residency a later move of the list drops (not worth writing).
        self._last_moves = {m.block_hash: m for m in moves if m.dst_tier is not None}
        self._wasted = set()
        dropped: set[tuple[bytes, int, int]] = set()
        for m in reversed(moves):
            if m.dst_tier is None:
                dropped.add((m.block_hash, m.src_tier, m.src_block_id))
            elif (m.block_hash, m.dst_tier, m.dst_block_id) in dropped:
                self._wasted.add(id(m))
        i = 0
        while i < len(moves):
            key = (moves[i].src_tier, moves[i].dst_tier)
            writes = {moves[i].dst_block_id}
            j = i + 1
            while j < len(moves) and (moves[j].src_tier, moves[j].dst_tier) == key:
                dst = moves[j].dst_block_id   # a slot written twice in the run (freed by a move
                if dst is not None and dst in writes:   # that emits no op): a new group
                    break
                writes.add(dst)
                j += 1
            self._wait_conflicts(moves[i:j])
            for observe in self._observers:   # earlier groups have landed: slots are exact
                observe(moves[i:j])
            self._run_group(moves[i:j], failed_writes)
            i = j
        if failed_writes:
            self._drop_failed_writes(failed_writes)

    def drain(self, loads: bool = True) -> None:
        """Wait for the batches left running by :meth:`apply_moves` and settle their outcome:
        a failed write drops its node (as :meth:`apply_moves` does for a synchronous one), a
        failed prefetch load (disk -> host) drops the node it was loading, a failed promotion
        goes to :meth:`take_failed_loads`. The engine drains before the scheduler touches the
        tree, so these nodes are still where the moves put them; if one was moved meanwhile,
        its host copy is *poisoned* (never copied on).

        ``loads=False`` leaves unfinished promotions running (settling the finished ones): the
        scheduler keeps their requests out of the forward until they land."""
        if not self._pending:
            return
        if loads:
            pending, self._pending = self._pending, []
        else:
            pending = [p for p in self._pending if p.kind != "load"]
            self._pending = [p for p in self._pending if p.kind == "load"]
        self._settle_pending(pending, block=True)
        if not loads:
            self.poll_loads()

    def poll_loads(self) -> None:
        """Settle the promotions that have finished (non-blocking)."""
        done = []
        for p in self._pending:
            if p.kind == "load":
                result = self.engine.complete(p.transfer)
                if result is not None:
                    done.append((p, result))
        if done:
            ids = {id(p) for p, _ in done}
            self._pending = [p for p in self._pending if id(p) not in ids]
            failed: list[MoveOp] = []
            for p, result in done:
                self._settle(p.ops, result, failed, None)
            assert not failed, "a promotion cannot fail a write"

    def wait_loads(self) -> None:
        """Block until every promotion in flight has landed or failed, and settle them."""
        loads = [p for p in self._pending if p.kind == "load"]
        if loads:
            self._pending = [p for p in self._pending if p.kind != "load"]
            self._settle_pending(loads, block=True)

    def inflight_device_blocks(self) -> frozenset[int]:
        """Device blocks that promotions in flight are writing: nothing may read, free or
        overwrite them until :meth:`poll_loads`/:meth:`wait_loads` settles the load."""
        loads = [p.dev for p in self._pending if p.kind == "load"]
        if not loads:
            return frozenset()
        return loads[0] if len(loads) == 1 else frozenset().union(*loads)

    @property
    def failed_loads(self) -> tuple[bytes, ...]:
        """Hashes of failed promotions not yet taken by :meth:`take_failed_loads`."""
        return tuple(self._failed_loads)

    def _settle_pending(self, pending: list[_Pending], block: bool) -> None:
        failed_writes: list[MoveOp] = []
        failed_loads: list[MoveOp] = []
        for p in pending:
            result: BatchResult | _Outcome | None
            if p.kind == "write":
                errors = [f.result() for f in p.writes]
                result = _Outcome(tuple(e is None for e in errors), tuple(errors))
            else:
                result = self.engine.wait(p.transfer)
            if result is None:  # wait() without timeout only returns a result
                raise StorageError(f"transfer batch of {len(p.ops)} {p.direction} moves vanished")
            self._settle(p.ops, result, failed_writes, failed_loads)
        if failed_writes:
            self._drop_failed_writes(failed_writes)
        if failed_loads:
            self._drop_failed_prefetches(failed_loads)

    def _wait_conflicts(self, group: Sequence[MoveOp]) -> None:
        """Wait for the pending batches the next group may touch. A pending prefetch writes
        host blocks (drain everything first); a pending write only its own file (drain before a
        load or removal of a file); a pending promotion reads its host blocks (wait before one
        of them is rewritten) and writes its device blocks (wait before one is read or
        written)."""
        if not self._pending:
            return
        m0 = group[0]
        if any(p.kind == "prefetch" for p in self._pending):
            self.drain()
            return
        if m0.src_tier == self.disk_tier:
            # reading or removing files: their writes must have landed; promotions reading
            # other files go on, one reading a file about to be removed is waited for
            if any(p.kind == "write" for p in self._pending):
                self.drain(loads=False)
            if m0.dst_tier is None:
                hashes = {m.block_hash for m in group}
                if any(m.block_hash in hashes for p in self._pending if p.kind == "load"
                       for m in p.ops):
                    self.wait_loads()
            return
        if m0.dst_tier is None or not any(p.kind == "load" for p in self._pending):
            return
        dst_kind = self.kinds[m0.dst_tier]
        if dst_kind == "host":
            busy = frozenset().union(*(p.host_src for p in self._pending if p.kind == "load"))
            if any(m.dst_block_id in busy for m in group):
                self.wait_loads()
                return
        dev = self.inflight_device_blocks()
        touched = [m.dst_block_id for m in group if m.dst_tier == DEVICE] + \
            [m.src_block_id for m in group if m.src_tier == DEVICE]
        if any(b in dev for b in touched):
            self.wait_loads()

    @property
    def num_pending(self) -> int:
        """Batches submitted and not yet drained."""
        return len(self._pending)

    def copy_blocks(self, copies: Sequence[CopyOp]) -> None:
        dev = self.inflight_device_blocks()
        if dev and any(c.src in dev or c.dst in dev for c in copies):
            self.wait_loads()
        self._cow.copy_blocks(copies)
        self.stats.copies += len(copies)

    # ------------------------------------------------------------------ faults
    # How failed moves are filed: the bookkeeping must never claim bytes a tier does not hold
    # (changes go through the writer, the block manager).
    def _drop_failed_prefetches(self, failed: list[MoveOp]) -> None:
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


    def _drop_failed_writes(self, failed: list[MoveOp]) -> None:
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

    def take_failed_loads(self) -> list[bytes]:
        """Hashes of blocks whose promotion failed since the last call (the caller must
        invalidate them before any sequence reads them)."""
        out, self._failed_loads = self._failed_loads, []
        return out

    def close(self) -> None:
        """Finish the batches in flight, then stop the transfer worker threads."""
        try:
            self.drain()
        finally:
            self.engine.close()
            self._io.shutdown(wait=True)

    # ------------------------------------------------------------------ internals
    def _loc(self, tier: int | None, slot: int | None, block_hash: bytes) -> Location:
        if tier is None or slot is None:
            raise InvalidBlockError(f"a drop of {block_hash.hex()[:16]} has no location")
        kind = self.kinds[tier]
        if kind == "device":
            return DeviceBlock(slot)
        if kind == "host":
            return HostBlock(slot)
        return DiskBlock(block_hash)

    def _disk(self) -> DiskStore:
        if self.disk is None:   # the tree has no disk tier then: a bug if reached
            raise ConfigError("a move needs the disk tier, and there is none")
        return self.disk

    def _host(self) -> HostPool:
        if self.host is None:
            raise ConfigError("a move needs the host tier, and there is none")
        return self.host

    def _still_cached(self, m: MoveOp) -> BlockRef | None:
        """The block ``m`` writes, if the written residency is still wanted (None: a later
        move of the list drops it, or the block left the cache): looked up where the moves
        put it."""
        if id(m) in self._wasted:
            return None
        last = self._last_moves.get(m.block_hash, m)
        return self.tree.block_of(m.block_hash, (m.dst_tier, m.dst_block_id),
                                  (last.dst_tier, last.dst_block_id), (m.src_tier, m.src_block_id))

    def _run_group(self, group: Sequence[MoveOp], failed_writes: list[MoveOp]) -> None:
        m0 = group[0]
        src_kind = self.kinds[m0.src_tier]
        ops = list(group)
        if src_kind == "host" and (self._poisoned or self._prefetched):
            ops = self._host_sources(ops, failed_writes)
            if not ops:
                return
        if m0.dst_tier is None:
            self.stats.drops += len(ops)
            if src_kind == "disk":
                for m in ops:
                    self.stats.files_removed += self._disk().remove_many([m.block_hash])
            return
        dst_kind = self.kinds[m0.dst_tier]
        direction = f"{src_kind}->{dst_kind}"
        if dst_kind == "disk":  # a block dropped later in this list is not worth writing
            refs = [self._still_cached(m) for m in ops]
            keep = [(m, r) for m, r in zip(ops, refs) if r is not None]
            self.stats.skipped_writes += len(ops) - len(keep)
            if keep:
                self._write_behind([m for m, _ in keep], [r for _, r in keep], src_kind,
                                   direction)
            return
        batch = [Move(self._loc(m.src_tier, m.src_block_id, m.block_hash),
                      self._loc(m.dst_tier, m.dst_block_id, m.block_hash)) for m in ops]
        eng = self.engine
        submitted = eng.submit(eng.prepare(batch))
        self.stats.batches += 1
        if direction == "disk->host":
            # A prefetch: it writes host blocks only, which only later moves read (and they
            # drain first); it runs while the step computes.
            self._pending.append(_Pending(ops, direction, "prefetch", submitted))
            self.stats.async_batches += 1
            return
        if dst_kind == "device" and src_kind in self._async_src:
            # A promotion: the caller keeps its device blocks out of every forward until it
            # is settled (poll_loads/wait_loads); it runs while other requests compute.
            host_src = frozenset(m.src_block_id for m in ops) if src_kind == "host" else frozenset()
            self._pending.append(_Pending(ops, direction, "load", submitted,
                                          dev=frozenset(_slot_of(m.dst_block_id) for m in ops),
                                          host_src=host_src))
            self.stats.async_batches += 1
            self.stats.async_loads += 1
            return
        result = eng.wait(submitted)
        if result is None:  # wait() without timeout only returns a result
            raise StorageError(f"transfer batch of {len(batch)} {direction} moves vanished")
        self._settle(ops, result, failed_writes, None)

    def _write_behind(self, ops: list[MoveOp], refs: list[BlockRef], src_kind: str,
                      direction: str) -> None:
        """Copy the sources to a staging buffer now (the slots are free for reuse when this
        returns), then write the files on the I/O threads while the step goes on."""
        src = [m.src_block_id for m in ops]
        if src_kind == "host":
            staged = self._host().read_blocks(src)
        else:  # the device block may be rewritten by the next forward: copy it out first
            staged = self.device.read_blocks(src).to("cpu")
        disk = self._disk()
        # per-block byte views of the staging copy (one view of it, sliced)
        view, n = byte_view(staged), self._block_bytes
        # parent hash and tokens are read from the tree here, never on the I/O threads
        items = [BlockWrite(m.block_hash, r.parent_hash, array("i", r.tokens).tolist(),
                            view[i * n:(i + 1) * n])
                 for i, (m, r) in enumerate(zip(ops, refs))]

        def put(i: int) -> str | None:
            try:
                good = disk.put_many([items[i]])[0]
            except IO_ERRORS as e:  # reported per move, like the transfer engine does
                return f"{type(e).__name__}: {e}"
            return None if good else "disk write failed (disk full or I/O error; see log)"

        futures = [self._io.submit(put, i) for i in range(len(ops))]
        self._pending.append(_Pending(ops, direction, "write", writes=futures))
        self.stats.batches += 1
        self.stats.async_batches += 1

    def _host_sources(self, ops: list[MoveOp], failed_writes: list[MoveOp]) -> list[MoveOp]:
        """Moves out of the host tier: count prefetch hits; fail (never copy) poisoned slots."""
        keep = []
        for m in ops:
            h = m.block_hash
            if h in self._prefetched:
                self._prefetched.discard(h)
                if m.dst_tier == DEVICE:
                    self.stats.prefetch_hits += 1
            if h not in self._poisoned:
                keep.append(m)
                continue
            self._poisoned.discard(h)
            if m.dst_tier == DEVICE:     # the request must recompute it (scheduler retries)
                self.stats.load_failures += 1
                self._failed_loads.append(h)
            elif m.dst_tier is not None:  # never write garbage under a valid checksum
                self.stats.write_failures += 1
                failed_writes.append(m)
        return keep

    def _settle(self, ops: Sequence[MoveOp], result: BatchResult | _Outcome,
                failed_writes: list[MoveOp],
                failed_prefetches: list[MoveOp] | None) -> None:
        """Account a finished batch; file its failures (see the module docstring)."""
        m0 = ops[0]
        src_kind, dst_kind = self.kinds[m0.src_tier], self.kinds[_slot_of(m0.dst_tier)]
        direction = f"{src_kind}->{dst_kind}"
        ok_n = 0
        for m, ok, err in zip(ops, result.ok, result.errors):
            if ok:
                ok_n += 1
                if src_kind == "disk" and not m.keep_src:  # promoted: the disk no longer holds it
                    self.stats.files_removed += self._disk().remove_many([m.block_hash])
                    if dst_kind == "host":
                        self._prefetched.add(m.block_hash)
                        self.stats.prefetched_blocks += 1
            elif src_kind == "disk":
                if dst_kind == "host":
                    self.stats.prefetch_failures += 1
                else:
                    self.stats.load_failures += 1
                log.warning("loading KV block %s from disk failed (%s); it will be recomputed",
                            m.block_hash.hex()[:16], err)
                self._disk().remove_many([m.block_hash])  # corrupt ones are gone already
                if dst_kind == "host" and failed_prefetches is not None:
                    failed_prefetches.append(m)
                else:
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


def _slot_of(slot: int | None) -> int:
    if slot is None:
        raise InvalidBlockError("a move into a tier without a slot")
    return slot


__all__ = ["TieredKVMover", "MoverStats", "wrap_device_pool"]
