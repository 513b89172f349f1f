"""The remote tier's worker side: what this engine writes to the shared Redis/Valkey server.

vLLM splits a KV connector into a scheduler role and a worker role; :class:`RemoteWriter` is
the worker role of radixkv's remote tier (the scheduler role is
:class:`~radixkv.tiers.remote_lookup.RemoteLookup`). It reads bytes (host blocks, device blocks)
and queues them to the store; it never changes the radix tree.

What it writes, as its :mod:`~radixkv.tiers.write_policy` wires it:

* write-back (default): a block leaving the host tier (demoted to disk or dropped). The tiered
  mover shows :meth:`RemoteWriter.apply_moves` each group of moves before running it, so the
  host block of such a move still holds the block (unless an earlier move of the same list
  wrote the slot: then it is skipped). Parent hash and tokens of a dropped block come from the
  tree's KV events (``BlockRemoved``, drained from this writer's own cursor on
  ``RadixTree.event_queue()`` with ``take_events()``; the block is gone from the tree by the time
  the group runs).
* write-through: also every block as soon as it is computed (the events' ``BlockStored`` on the
  device), copied off the device after the step, so another replica finds a conversation at
  once.
* retention (any policy but read-only): :meth:`RemoteWriter.persist` writes the blocks a request
  asks to keep (a ``CachePoint(persist=True)``, the server's ``"24h"`` retention) after the
  step, with their TTL on the keys; a block written before only has its key's expiry restarted.
* shutdown: :meth:`RemoteWriter.flush_resident` writes the cached device and host blocks the
  server lacks.

Writes are queued to the store's writer thread (never blocking the step); a full queue or a
server that is down drops the write and counts it (a write is only a future hit). Every method
runs on the engine's loop thread.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixkv.core.events import BlockRemoved, BlockStored, EventCursor
from radixkv.core.hashing import TOKEN_BYTES, BlockHash
from radixkv.core.pool import BlockId
from radixkv.core.node import BlockRef, MoveOp
from radixkv.storage.backend import BlockWrite
from radixkv.tiers.protocol import KVMover

if TYPE_CHECKING:
    from radixkv.core.block_manager import CopyOp
    from radixkv.core.node import Node
    from radixkv.core.tree import RadixTree
    from radixkv.storage.host import HostPool
    from radixkv.storage.remote import RemoteStore


@dataclass
class WriteCounters:
    """What the writer did since construction (part of ``stats()["remote"]``)."""

    blocks_written: int = 0       # writes queued to the server
    writes_skipped: int = 0       # slot rewritten earlier in its move list, or queue full
    blocks_persisted: int = 0     # blocks written for a retention (``persist``)
    persist_refreshes: int = 0    # retained blocks used again: their key's expiry restarted
    persist_skipped: int = 0      # retained blocks not written (read-only tier, or gone)


@dataclass
class FlushReport:
    """What :meth:`RemoteWriter.flush_resident` wrote: ``written`` (acknowledged), ``present``
    (the server had them), ``skipped`` (a host block whose bytes may be garbage), ``left`` (not
    reached by the deadline), ``seconds``."""

    written: int = 0
    present: int = 0
    skipped: int = 0
    left: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _never_unsafe(block_hash: bytes) -> bool:
    return False


class RemoteWriter(KVMover):
    """Writes this engine's blocks to a :class:`~radixkv.storage.remote.RemoteStore` (see the
    module docstring).

    As a :class:`~radixkv.tiers.protocol.KVMover` it moves blocks from the host tier to the
    server: the tiered mover shows it each group of moves first (``add_observer``) and
    :meth:`apply_moves` writes back those leaving the host. Its writes are asynchronous (the
    store's writer thread) and a failed one is a future miss, counted.

    Args:
        store: the shared store.
        tree: the radix tree (read only: block snapshots by place or hash).
        host: the host tier's pool (tree tier ``host_tier``).
        device_cache: the device cache ``[L, 2, num_blocks, block_size, kv_heads, head_dim]``.
        block_size: tokens per block.
        read_only: True for a tier that never writes (``persist`` and ``flush_resident``
            then write nothing either).
        unsafe: ``unsafe(block_hash)`` is True for a host block whose slot may not hold its
            bytes (a prefetch load in flight or failed, in the mover): never written.
    """

    #: how many retained block hashes the writer remembers (forgetting one costs one rewrite)
    MAX_RETAINED = 1 << 16
    #: blocks per round of :meth:`flush_resident` (one EXISTS batch + one SET batch each)
    FLUSH_BATCH = 32

    def __init__(self, store: RemoteStore, tree: RadixTree, host: HostPool, host_tier: int,
                 device_cache: torch.Tensor, block_size: int, read_only: bool = False,
                 unsafe: Callable[[bytes], bool] | None = None) -> None:
        self.store, self.tree, self.host, self.host_tier = store, tree, host, host_tier
        self.block_size = block_size
        self.read_only = read_only
        self._device_cache = device_cache
        self._unsafe = unsafe or _never_unsafe
        self._dropped: dict[bytes, tuple[bytes | None, bytes]] = {}
        self._computed: list[tuple[BlockHash, BlockId]] = []   # (hash, device block id)
        self._events: EventCursor | None = None   # the tree's KV events (read_events)
        self._read_computed = False
        # blocks kept for a retention (``persist``): hash -> the retention in seconds, most
        # recently used last; bounded, since forgetting one only costs rewriting it once
        self._retained: OrderedDict[bytes, float] = OrderedDict()
        self._to_persist: dict[bytes, None] = {}   # retained blocks to write after the step
        self.counts = WriteCounters()

    # ------------------------------------------------------------------ KV events
    def read_events(self, cursor: EventCursor, computed: bool) -> None:
        """Read the tree's KV events from ``cursor`` (the write policy's wiring): blocks that
        left the host tier (write-back needs their parent hash and tokens) and, with
        ``computed``, blocks committed on the device (write-through writes them)."""
        self._events, self._read_computed = cursor, computed

    def _take_events(self) -> None:
        """Drain the events since the last call (on the loop thread, before their use)."""
        if self._events is None:
            return
        w = self.block_size * TOKEN_BYTES
        for e in self._events.take_events():
            if type(e) is BlockRemoved:
                if e.tier == self.host_tier:
                    parent = e.parent_hash
                    for i, h in enumerate(e.block_hashes):
                        self._dropped[h] = (parent, e.tokens[i * w:(i + 1) * w])
                        parent = h
            elif type(e) is BlockStored and self._read_computed and e.tier == 0:
                self._computed.extend(zip(e.block_hashes, e.block_ids))

    # ------------------------------------------------------------------ KVMover
    def apply_moves(self, moves: Sequence[MoveOp]) -> None:
        """Write back the blocks leaving the host tier in ``moves``, a group of one direction
        that the mover is about to run (the groups before it have landed, so each source
        slot holds exactly its block)."""
        self._take_events()
        t = self.host_tier
        if not moves or moves[0].src_tier != t:
            return
        items = []
        for m in moves:
            if m.keep_src or not (m.dst_tier is None or m.dst_tier > t):
                continue
            meta = self._dropped.pop(m.block_hash, None)
            if meta is None:   # (a demotion: the block is where the move puts it)
                ref = self.tree.block_of(m.block_hash, (m.dst_tier, m.dst_block_id))
                if ref is None:
                    continue
                meta = (ref.parent_hash, ref.tokens)
            if self._unsafe(m.block_hash):
                self.counts.writes_skipped += 1
                continue
            items.append(BlockWrite(m.block_hash, meta[0], _ids(meta[1]),
                                    self.host.block_bytes(m.src_block_id)))
        if items:
            self._put(items)

    def copy_blocks(self, copies: Sequence[CopyOp]) -> None:
        """Device copies are not the remote tier's business."""

    def counters(self) -> dict[str, Any]:
        return dict(self.counts.__dict__)

    # ------------------------------------------------------------------ after a step
    def after_step(self) -> None:
        """Write-through: queue the blocks computed this step (copied off the device), and the
        blocks ``persist`` asked for. Forget drop records no move list used (blocks
        invalidated, never written)."""
        self._take_events()
        self._dropped.clear()
        self._forget_lost()
        computed, self._computed = self._computed, []
        done = self.flush_retained()
        if computed:
            # where a block computed this step still is: its device block, if it holds it
            block_at = self.tree.block_at
            refs = []
            for h, s in computed:
                if h not in done:
                    r = block_at(0, s)
                    if r is not None and r.block_hash == h:
                        refs.append(r)
            if refs:
                self._write_refs(refs)

    def flush_retained(self) -> set[bytes]:
        """Queue the writes ``persist`` asked for now (``after_step`` does it after each
        step; an idle engine's caller may not want to wait for one). Returns their hashes."""
        retained = list(self._to_persist)
        self._to_persist = {}
        if retained:
            self._write_blocks(retained, persist=True)
        return set(retained)

    def _write_blocks(self, hashes: list[bytes], persist: bool = False) -> None:
        """Queue writes of cached blocks by hash (chains: ``RadixTree.refs_of``), their bytes
        copied off the device (where a block computed this step still is; one that already
        left is skipped: the host copy may still be in flight behind the step, and a write is
        only ever a future hit)."""
        refs = [r for r in self.tree.refs_of([BlockHash(h) for h in hashes])
                if r is not None and r.tier == 0]
        if persist and len(refs) < len(hashes):
            on_device = {r.block_hash for r in refs}
            for h in hashes:
                if h not in on_device:   # not written: a later use writes it again
                    self._retained.pop(h, None)
                    self.counts.persist_skipped += 1
        if refs:
            self._write_refs(refs, persist)

    def _device_bytes(self, refs: Sequence[BlockRef]) -> list[Any]:
        """Byte views (``bytes_per_block`` each) of copies of these device blocks, taken off
        the device in one gather."""
        kv = self._device_cache   # [L, 2, N, bs, h, d]
        idx = torch.tensor([r.block_id for r in refs], dtype=torch.long, device=kv.device)
        blocks = kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        return [blocks[i].view(-1).view(torch.uint8).numpy() for i in range(len(refs))]

    def _write_refs(self, refs: list[BlockRef], persist: bool = False) -> None:
        """Queue writes of these device blocks (snapshots taken now), bytes copied off the
        device."""
        data = self._device_bytes(refs)
        n = self._put([BlockWrite(r.block_hash, r.parent_hash, _ids(r.tokens), d)
                       for r, d in zip(refs, data)])
        if persist:
            self.counts.blocks_persisted += n

    # ------------------------------------------------------------------ retention
    def persist(self, hashes: Sequence[bytes], ttl_s: float | None = None) -> None:
        """Keep these cached blocks on the server for at least ``ttl_s`` seconds after their
        last use, whatever the write policy (a ``prompt_cache_retention: "24h"`` prompt): a
        block not yet written by this tier is written after the step, copied off the device
        (one that left the device by then is skipped and written at a later use), one written
        before has its key's expiry restarted (no payload resent),
        and any later write of it keeps that retention. ``ttl_s`` None: the store's own key
        TTL. A read-only tier writes nothing."""
        ttl = ttl_s or 0.0   # 0.0: the store's key TTL (RemoteStore.put_many's ttl_s=None)
        self._forget_lost()
        if self.read_only:
            self.counts.persist_skipped += len(hashes)
            return
        retained, pending = self._retained, self._to_persist
        known: list[bytes] = []
        for h in hashes:
            old = retained.pop(h, None)
            retained[h] = ttl if old is None else max(old, ttl)
            if old is None:
                pending[h] = None
            elif h not in pending:   # (one queued this step is not on the server yet)
                known.append(h)
        while len(retained) > self.MAX_RETAINED:
            retained.popitem(last=False)
        for group_ttl, group in _by_ttl(known, retained).items():
            self.counts.persist_refreshes += sum(
                self.store.refresh_many(group, group_ttl or None))

    def _forget_lost(self) -> None:
        """Retained blocks whose key the server lost (expired or evicted meanwhile) are
        written again at their next use."""
        for h in self.store.take_lost():
            self._retained.pop(h, None)

    def _put(self, items: Sequence[BlockWrite[bytes]]) -> int:
        """Queue ``items``; those under a retention keep it. Returns how many were queued."""
        ok = 0
        for ttl, group in self._by_retention(items).items():
            queued = self.store.put_many(group, ttl_s=ttl)
            ok += sum(queued)
            self.counts.writes_skipped += queued.failed
        self.counts.blocks_written += ok
        return ok

    def _by_retention(self, items: Iterable[BlockWrite[bytes]]
                      ) -> dict[float | None, list[BlockWrite[bytes]]]:
        """``items`` grouped by the retention their keys need (None: the store's TTL), the
        plain ones first."""
        groups: dict[float | None, list[BlockWrite[bytes]]] = {None: []}
        for it in items:
            groups.setdefault(self._retained.get(it.key) or None, []).append(it)
        if not groups[None]:
            del groups[None]
        return groups

    # ------------------------------------------------------------------ shutdown
    def flush_resident(self, timeout_s: float) -> FlushReport:
        """Write every cached device and host block that the server does not hold yet, parents
        before children (shortest prefixes first: the most shared), until done or
        ``timeout_s`` has passed; for a graceful shutdown. Why: write-back writes a block only
        when it leaves the host tier, so a replica whose memory never filled would otherwise
        leave nothing for the replica that replaces it (a rolling restart, a scale-down).

        Synchronous, on the caller's thread, once the engine no longer steps (so the tree and
        the slots hold still): the writer's queue is drained first, then rounds of
        :data:`FLUSH_BATCH` blocks each cost one pipelined ``EXISTS`` and one pipelined ``SET``
        of the missing ones. The deadline is checked between rounds, so a hung server can
        overrun it by one call's socket timeout at most. A read-only tier, a server that is
        down, or ``timeout_s <= 0`` writes nothing.
        """
        t0 = time.perf_counter()
        out = FlushReport()
        if self.read_only or not timeout_s > 0:
            return out
        deadline = t0 + timeout_s
        self.flush_retained()
        self.store.flush(timeout_s)   # what is queued goes first (it may be most of it)
        refs = self._resident_refs()
        for start in range(0, len(refs), self.FLUSH_BATCH):
            batch = refs[start:start + self.FLUSH_BATCH]
            if time.perf_counter() >= deadline or not self.store.available:
                out.left = len(refs) - start
                break
            held = self.store.contains_many([r.block_hash for r in batch])
            todo = []
            for r, there in zip(batch, held):
                if there:
                    out.present += 1
                elif r.tier == self.host_tier and self._unsafe(r.block_hash):
                    out.skipped += 1
                else:
                    todo.append(r)
            out.written += self._put_now(todo)
        out.seconds = time.perf_counter() - t0
        self.counts.blocks_written += out.written
        return out

    def _resident_refs(self) -> list[BlockRef]:
        """The cached blocks whose primary is in the device or host tier, by depth in their
        chain (a parent before its children)."""
        tiers = (0, self.host_tier)
        depth: dict[int, int] = {}   # id(node) -> blocks above its first block

        def depth_of(node: Node | None) -> int:
            path = []
            while node is not None and id(node) not in depth:
                path.append(node)
                node = node.parent
            d = 0 if node is None else depth[id(node)] + len(node.hashes)
            for n in reversed(path):
                depth[id(n)] = d
                d += len(n.hashes)
            return depth[id(path[0])] if path else d

        keyed: list[tuple[int, bytes]] = []
        for node in self.tree.nodes():
            if node.tier in tiers:
                d = depth_of(node)
                keyed.extend((d + i, h) for i, h in enumerate(node.hashes))
        keyed.sort(key=lambda x: x[0])
        return [r for r in self.tree.refs_of([BlockHash(h) for _, h in keyed]) if r is not None]

    def _put_now(self, refs: list[BlockRef]) -> int:
        """Write these device/host blocks now (``put_many(wait=True)``; blocks under a
        retention keep it). Returns how many the server acknowledged."""
        if not refs:
            return 0
        dev = [r for r in refs if r.tier == 0]
        payload: dict[bytes, Any] = {}
        if dev:
            payload = {r.block_hash: d for r, d in zip(dev, self._device_bytes(dev))}
        items = []
        for r in refs:
            data = payload.get(r.block_hash)
            if data is None:
                data = self.host.block_bytes(r.block_id)
            items.append(BlockWrite(r.block_hash, r.parent_hash, _ids(r.tokens), data))
        return sum(sum(self.store.put_many(g, wait=True, ttl_s=ttl))
                   for ttl, g in self._by_retention(items).items())


def _ids(tokens: bytes) -> list[int]:
    """Token ids of a block's int32 token bytes."""
    return array("i", tokens).tolist()


def _by_ttl(hashes: list[bytes], retained: dict[bytes, float]) -> dict[float, list[bytes]]:
    groups: dict[float, list[bytes]] = {}
    for h in hashes:
        groups.setdefault(retained[h], []).append(h)
    return groups


__all__ = ["RemoteWriter", "WriteCounters", "FlushReport"]
