"""The remote tier inside the engine: a Redis/Valkey store that replicas share.

Why a *look-aside* tier rather than a fourth tier of the radix tree: the server is shared.
Other replicas add blocks to it, and its ``maxmemory`` policy or a key TTL removes them, without
telling this process. A tree residency "this block is remote" would be a guess that goes stale
on its own, so the tree never records one: what the server holds is learned by asking it, once
per new request, and a block found there becomes an ordinary host-tier block of the tree.

Read path (a new request):

1. ``lookup`` (loop thread, in ``add_request``): the chain hashes of the prompt's full blocks
   past what the tree already caches. A background thread asks the server ``EXISTS`` for all of
   them in one round trip, then ``MGET``\\ s the leading run of hits in a second; every value is
   verified by :class:`~radixkv.storage.remote.RemoteStore` (layout, namespace, tokens,
   checksum or MAC): a bad value is a miss and is deleted. Until the lookup is done the request
   waits here, outside the scheduler, for at most ``CacheConfig.remote_timeout_s``.
2. ``admit`` (loop thread, at the start of each step): each finished lookup installs its blocks
   in the host tier (``RadixTree.insert_lower`` + a copy into the host slot; room is made by the
   host tier's own eviction) and hands the request to the scheduler, which then promotes them
   into the device like any host hit. A lookup past its deadline is abandoned: the request runs
   without it (recompute), so a slow or dead server costs time, bounded, never correctness.

Write path (the policy objects of :mod:`radixkv.tiers.write_policy` install these hooks):

* ``write_back`` (default): a block leaving the host tier (demoted to disk or dropped) is
  written. The mover shows :meth:`apply_moves` each group of moves before running it: the host
  slot of such a move still holds the block (unless an earlier move of the same list wrote the
  slot, then it is skipped). Parent hash and tokens of a dropped block come from the tree's
  KV events (``BlockRemoved``, taken from the tier's reader of ``RadixTree.event_queue()`` at
  :meth:`apply_moves`; the block is gone from the tree by the time the group runs).
* ``write_through``: also every block as soon as it is computed (the events' ``BlockStored``
  on the device), copied off the device after the step, so another replica finds a
  conversation at once.
* retention (any policy but ``read_only``): :meth:`persist` writes the blocks a request asks to
  keep (a ``CachePoint(persist=True)``, the server's ``"24h"`` retention) after the step, with
  their TTL on the keys; a block written before only has its key's expiry restarted.
* Writes are queued to the store's writer thread (never blocking the step); a full queue or a
  server that is down drops the write and counts it (a write is only a future hit).

Accounting: the blocks a request got from the server are counted as ``remote`` in its
``cached_tokens_per_tier`` (moved out of the host count at its first admission).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import Any

from radixkv.core.hashing import TOKEN_BYTES, token_bytes
from radixkv.core.events import BlockRemoved, BlockStored, EventCursor
from radixkv.core.node import BlockRef, MoveOp
from radixkv.core.tree import RadixTree
from radixkv.errors import StorageError
from radixkv.tiers.protocol import KVMover
from radixkv.tiers.write_policy import WritePolicy, write_policy

log = logging.getLogger(__name__)


@dataclass
class RemoteCounters:
    """What the engine's remote tier did since construction (``stats()["remote"]``)."""

    lookups: int = 0              # requests looked up
    lookup_timeouts: int = 0      # lookups abandoned at their deadline
    lookup_failures: int = 0      # lookups whose job failed (I/O error): computed instead
    blocks_found: int = 0         # blocks the server had (leading run, verified)
    blocks_installed: int = 0     # of those, placed in the host tier
    blocks_not_installed: int = 0  # no room / parent gone / already cached meanwhile
    parent_lost: int = 0          # lookups whose local parent left (or sits on disk) meanwhile
    hit_tokens: int = 0           # prompt tokens served from the remote tier (first admission)
    blocks_written: int = 0       # writes queued to the server
    writes_skipped: int = 0       # slot rewritten earlier in its move list, or queue full
    blocks_persisted: int = 0     # blocks written for a retention (``persist``)
    persist_refreshes: int = 0    # retained blocks used again: their key's expiry restarted
    persist_skipped: int = 0      # retained blocks not written (read-only tier, or gone)
    lookup_seconds: float = 0.0   # total wall time of finished lookups

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Arrival:
    req: Any
    hashes: list[bytes]           # chain hashes of the blocks past the local match
    tokens: list[bytes]           # their tokens (int32 bytes), for insert_lower
    parent_hash: bytes | None     # the last locally cached block's hash (None: root)
    cached: list[bytes]           # the locally cached chain it ends (to find it again)
    future: Future | None
    deadline: float
    started: float = field(default_factory=time.perf_counter)


class RemoteTier(KVMover):
    """The engine's side of a :class:`~radixkv.storage.remote.RemoteStore` (see the module
    docstring). Every method runs on the engine's loop thread except the lookup jobs.

    As a :class:`~radixkv.tiers.protocol.KVMover` it moves blocks from the host tier to the
    server: the tiered mover shows it each group of moves first (``add_observer``), and
    :meth:`apply_moves` writes back those leaving the host. Its writes are asynchronous (the
    store's writer thread) and a failed one is a future miss, counted; its reads are the
    lookups, whose failures are misses."""

    def __init__(self, store: Any, tree: RadixTree, host_pool: Any, host_tier: int,
                 device_cache: Any, block_size: int, write: str | WritePolicy,
                 timeout_s: float, mover: Any, unsafe: Any = None, writer: Any = None) -> None:
        """``write``: the write policy (or its name), attached here to ``tree`` and ``mover``.
        ``unsafe(block_hash)``: True for a host block whose slot may not hold its bytes
        (a prefetch load in flight or failed, in the mover): never written back."""
        self.store, self.tree, self.host, self.host_tier = store, tree, host_pool, host_tier
        self._writer = writer if writer is not None else tree   # the block manager
        self._unsafe = unsafe or (lambda h: False)
        self.block_size, self.timeout_s = block_size, timeout_s
        self.write = write_policy(write)
        self._device_cache = device_cache
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixkv-remote-lookup")
        self._arrivals: dict[str, _Arrival] = {}
        self._dropped: dict[bytes, tuple[bytes | None, bytes]] = {}
        self._computed: list[tuple[bytes, int | None]] = []   # (hash, device block id)
        self._events: EventCursor | None = None   # the tree's KV events (read_events)
        self._read_computed = False
        # blocks kept for a retention (``persist``): hash -> the retention in seconds, most
        # recently used last; bounded, since forgetting one only costs rewriting it once
        self._retained: OrderedDict[bytes, float] = OrderedDict()
        self._to_persist: dict[bytes, None] = {}   # retained blocks to write after the step
        self._remote_tokens: dict[str, int] = {}
        self.counters = RemoteCounters()
        self.write.attach(self, tree, mover)
        if getattr(store, "signer", None) is None:
            log.warning(
                "radixkv: the remote tier's values are not authenticated: anyone who can write "
                "to the server can make this engine serve forged KV (checksums are "
                "recomputable). Give every replica the same secret: radixkv serve "
                "--kv-secret-file PATH, $RADIXKV_KV_SECRET or CacheConfig(disk_secret=...)")

    # ------------------------------------------------------------------ read path
    def lookup(self, req: Any) -> None:
        """Start the remote lookup of ``req``'s prompt; the request waits in here until
        :meth:`admit` hands it to the scheduler."""
        seq = req.seqs[0]
        ids = seq.token_ids
        bs = self.block_size
        n_full = (len(ids) - 1) // bs   # the last token is always computed (it makes logits)
        tb = token_bytes(ids)
        cached = self.tree.match_hashes(tb, req.namespace.seed, n_full)
        start = len(cached)
        hashes: list[bytes] = []
        tokens: list[bytes] = []
        if start < n_full:
            import xxhash

            width = bs * TOKEN_BYTES
            h = cached[-1] if cached else req.namespace.seed
            for i in range(start, n_full):
                chunk = tb[i * width:(i + 1) * width]
                h = xxhash.xxh3_128_digest(h + chunk)
                hashes.append(h)
                tokens.append(chunk)
        future = self._pool.submit(self._fetch, hashes) if hashes else None
        self.counters.lookups += 1 if hashes else 0
        self._arrivals[req.request_id] = _Arrival(
            req, hashes, tokens, cached[-1] if cached else None, cached, future,
            time.perf_counter() + self.timeout_s)

    def _fetch(self, hashes: list[bytes]) -> list[Any]:
        """Background: the verified leading run of ``hashes`` the server holds (2 round trips:
        one EXISTS batch, one MGET of the run)."""
        present = self.store.contains_many(hashes)
        k = 0
        while k < len(present) and present[k]:
            k += 1
        if not k:
            return []
        out = []
        for block in self.store.get_many(hashes[:k]):
            if block is None:   # vanished between the two calls, or bad: the run ends here
                break
            out.append(block)
        return out

    def has_arrivals(self) -> bool:
        return bool(self._arrivals)

    def is_arriving(self, request_id: str) -> bool:
        return request_id in self._arrivals

    def forget(self, request_id: str) -> Any | None:
        """Drop a request still waiting for its lookup (abort); returns it, or None."""
        a = self._arrivals.pop(request_id, None)
        return None if a is None else a.req

    def admit(self, run_ops: Any, wait: bool) -> list[Any]:
        """Requests whose lookup finished (their blocks installed) or timed out, in arrival
        order; ``wait``: nothing else to do, so block until the first one is ready."""
        if not self._arrivals:
            return []
        if wait:
            first = next(iter(self._arrivals.values()))
            if first.future is not None and not first.future.done():
                try:
                    first.future.result(max(0.0, first.deadline - time.perf_counter()))
                except FuturesTimeout:   # past its deadline: abandoned below
                    pass
                except (OSError, StorageError):   # the job's failure: logged in _install
                    pass
        now = time.perf_counter()
        ready = []
        for rid, a in list(self._arrivals.items()):
            if a.future is None or a.future.done():
                self._install(a, run_ops)
            elif now >= a.deadline:
                a.future.cancel()
                self.counters.lookup_timeouts += 1
                log.warning("remote lookup of %r timed out after %.2f s; computing it",
                            rid, self.timeout_s)
            else:
                continue
            del self._arrivals[rid]
            ready.append(a.req)
        return ready

    def _install(self, a: _Arrival, run_ops: Any) -> None:
        if a.future is None:
            return
        try:
            blocks = a.future.result()
        except (OSError, StorageError) as exc:   # a failed lookup is a miss, logged, counted
            log.warning("remote lookup failed (%s: %s); computing the request",
                        type(exc).__name__, exc)
            self.counters.lookup_failures += 1
            return
        self.counters.lookup_seconds += time.perf_counter() - a.started
        self.counters.blocks_found += len(blocks)
        if not blocks:
            return
        tree, t = self.tree, self.host_tier
        if a.parent_hash is not None:
            # the local match, found again by its chain (the tree indexes nodes, not blocks)
            where = tree.locate_chain(a.cached)
            if len(where) == len(a.cached):   # making room below must not evict the parent
                self._writer.touch(a.parent_hash, near=where[-1][0])
        # Make room in the host tier by its own eviction (demotions/drops run now, before the
        # slots are written: the tree hands out the freed slots).
        free = self.host.num_slots - tree.num_resident(t) - tree.num_copies(t)
        short = len(blocks) - free
        if short > 0:
            moves = self._writer.evict(t, min(short, tree.num_evictable(t)))
            if moves:
                run_ops(moves)
        # (touched above: the parent now ends its node, unless it was lost meanwhile)
        parent = tree.get(a.parent_hash, scan=False) if a.parent_hash is not None else None
        if a.parent_hash is not None and (parent is None or parent.tier > t):
            self.counters.parent_lost += 1
            self.counters.blocks_not_installed += len(blocks)
            return
        installed = 0
        parent_hash = a.parent_hash
        for block, h, tok in zip(blocks, a.hashes, a.tokens):
            if block.block_hash != h or (parent_hash is not None
                                         and block.parent_hash != parent_hash):
                break   # the store verified the value against its key; a chain break ends it
            ref = self._writer.install_lower(parent_hash, h, tok, t)
            if ref is None:
                break
            self.host.slot_bytes(ref.block_id)[:] = block.payload
            parent_hash = h
            installed += 1
        self.counters.blocks_installed += installed
        self.counters.blocks_not_installed += len(blocks) - installed
        if installed:
            self._remote_tokens[a.req.request_id] = installed * self.block_size

    def take_remote_tokens(self, request_id: str) -> int:
        """Prompt tokens of ``request_id`` installed from the server (once; counted as
        ``hit_tokens``)."""
        n = self._remote_tokens.pop(request_id, 0)
        self.counters.hit_tokens += n
        return n

    # ------------------------------------------------------------------ write path
    def read_events(self, cursor: EventCursor, computed: bool) -> None:
        """Read the tree's KV events from ``cursor`` (the write policy's wiring): blocks that
        left the host tier (write-back needs their parent hash and tokens) and, with
        ``computed``, blocks committed on the device (write-through writes them)."""
        self._events, self._read_computed = cursor, computed

    def _take_events(self) -> None:
        """Take the events since the last call (on the loop thread, before their use)."""
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
                self.counters.writes_skipped += 1
                continue
            items.append((m.block_hash, meta[0], _ids(meta[1]),
                          self.host.slot_bytes(m.src_block_id)))
        if items:
            self._put(items)

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
        refs = [r for r in self.tree.refs_of(hashes) if r is not None and r.tier == 0]
        if persist and len(refs) < len(hashes):
            on_device = {r.block_hash for r in refs}
            for h in hashes:
                if h not in on_device:   # not written: a later use writes it again
                    self._retained.pop(h, None)
                    self.counters.persist_skipped += 1
        if refs:
            self._write_refs(refs, persist)

    def _write_refs(self, refs: list[BlockRef], persist: bool = False) -> None:
        """Queue writes of these device blocks (snapshots taken now), bytes copied off the
        device."""
        import torch

        kv = self._device_cache   # [L, 2, N, bs, h, d]
        idx = torch.tensor([r.block_id for r in refs], dtype=torch.long, device=kv.device)
        blocks = kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        n = self._put([(r.block_hash, r.parent_hash, _ids(r.tokens),
                        blocks[i].view(-1).view(torch.uint8).numpy())
                       for i, r in enumerate(refs)])
        if persist:
            self.counters.blocks_persisted += n

    # ------------------------------------------------------------------ retention
    #: how many retained block hashes the tier remembers (forgetting one costs one rewrite)
    MAX_RETAINED = 1 << 16

    def persist(self, hashes: Sequence[bytes], ttl_s: float | None = None) -> None:
        """Keep these cached blocks on the server for at least ``ttl_s`` seconds after their
        last use, whatever the write policy (a ``prompt_cache_retention: "24h"`` prompt): a
        block not yet written by this tier is written after the step, copied off the device
        (one that left the device by then is skipped and written at a later use), one written
        before has its key's expiry restarted (no payload resent),
        and any later write of it keeps that retention. ``ttl_s`` None: the store's own key
        TTL. A read-only tier writes nothing."""
        ttl_s = ttl_s or 0.0   # 0.0: the store's key TTL (RemoteStore.put_many's ttl_s=None)
        self._forget_lost()
        if self.write.name == "read_only":
            self.counters.persist_skipped += len(hashes)
            return
        retained, known, pending = self._retained, [], self._to_persist
        for h in hashes:
            old = retained.pop(h, None)
            retained[h] = ttl_s if old is None else max(old, ttl_s)
            if old is None:
                pending[h] = None
            elif h not in pending:   # (one queued this step is not on the server yet)
                known.append(h)
        while len(retained) > self.MAX_RETAINED:
            retained.popitem(last=False)
        for ttl, group in _by_ttl(known, retained).items():
            self.counters.persist_refreshes += sum(self.store.refresh_many(group, ttl or None))

    def _forget_lost(self) -> None:
        """Retained blocks whose key the server lost (expired or evicted meanwhile) are
        written again at their next use."""
        for h in self.store.take_lost():
            self._retained.pop(h, None)

    def _put(self, items: list[Any]) -> int:
        """Queue ``items``; those under a retention keep it. Returns how many were queued."""
        retained = self._retained
        plain = [it for it in items if it[0] not in retained]
        groups: dict[float, list[Any]] = {}
        for it in items:
            ttl = retained.get(it[0])
            if ttl is not None:
                groups.setdefault(ttl, []).append(it)
        ok = 0
        for ttl, group in [(None, plain), *groups.items()]:
            if group:
                queued = self.store.put_many(group, ttl_s=ttl or None)
                ok += sum(queued)
                self.counters.writes_skipped += len(queued) - sum(queued)
        self.counters.blocks_written += ok
        return ok

    def copy_blocks(self, copies: Sequence[Any]) -> None:
        """Device copies are not the remote tier's business."""

    def counters(self) -> dict[str, Any]:
        return self.stats()

    # ------------------------------------------------------------------ shutdown
    #: blocks per round of :meth:`flush_resident` (one EXISTS batch + one SET batch each)
    FLUSH_BATCH = 32

    def flush_resident(self, timeout_s: float) -> dict[str, Any]:
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
        down, or ``timeout_s <= 0`` writes nothing. Returns counts: ``written``,
        ``present`` (the server had them), ``skipped`` (a host slot whose bytes may be
        garbage), ``left`` (not reached by the deadline), ``seconds``.
        """
        t0 = time.perf_counter()
        out: dict[str, Any] = {"written": 0, "present": 0, "skipped": 0, "left": 0,
                               "seconds": 0.0}
        if self.write.name == "read_only" or not timeout_s > 0:
            return out
        deadline = t0 + timeout_s
        self.flush_retained()
        self.store.flush(timeout_s)   # what is queued goes first (it may be most of it)
        refs = self._resident_refs()
        for start in range(0, len(refs), self.FLUSH_BATCH):
            batch = refs[start:start + self.FLUSH_BATCH]
            if time.perf_counter() >= deadline or not self.store.available:
                out["left"] = len(refs) - start
                break
            held = self.store.contains_many([r.block_hash for r in batch])
            todo = []
            for r, there in zip(batch, held):
                if there:
                    out["present"] += 1
                elif r.tier == self.host_tier and self._unsafe(r.block_hash):
                    out["skipped"] += 1
                else:
                    todo.append(r)
            out["written"] += self._put_now(todo)
        out["seconds"] = time.perf_counter() - t0
        self.counters.blocks_written += out["written"]
        return out

    def _resident_refs(self) -> list[BlockRef]:
        """The cached blocks whose primary is in the device or host tier, by depth in their
        chain (a parent before its children)."""
        tiers = (0, self.host_tier)
        depth: dict[int, int] = {}   # id(node) -> blocks above its first block

        def depth_of(node: Any) -> int:
            path = []
            while node is not None and id(node) not in depth:
                path.append(node)
                node = node.parent
            d = 0 if node is None else depth[id(node)] + len(node.hashes)
            for n in reversed(path):
                depth[id(n)] = d
                d += len(n.hashes)
            return depth[id(path[0])] if path else d

        keyed = []
        for node in self.tree.nodes():
            if node.tier in tiers:
                d = depth_of(node)
                keyed.extend((d + i, h) for i, h in enumerate(node.hashes))
        keyed.sort(key=lambda x: x[0])
        return [r for r in self.tree.refs_of([h for _, h in keyed]) if r is not None]

    def _put_now(self, refs: list[BlockRef]) -> int:
        """Write these device/host blocks now (``put_many(wait=True)``; blocks under a
        retention keep it). Returns how many the server acknowledged."""
        import torch

        if not refs:
            return 0
        kv = self._device_cache   # [L, 2, N, bs, h, d]
        dev = [r for r in refs if r.tier == 0]
        payload: dict[bytes, Any] = {}
        if dev:
            idx = torch.tensor([r.block_id for r in dev], dtype=torch.long, device=kv.device)
            blocks = kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
            for i, r in enumerate(dev):
                payload[r.block_hash] = blocks[i].view(-1).view(torch.uint8).numpy()
        groups: dict[float | None, list[Any]] = {}
        for r in refs:
            data = payload.get(r.block_hash)
            if data is None:
                data = self.host.slot_bytes(r.block_id)
            groups.setdefault(self._retained.get(r.block_hash) or None, []).append(
                (r.block_hash, r.parent_hash, _ids(r.tokens), data))
        return sum(sum(self.store.put_many(g, wait=True, ttl_s=ttl))
                   for ttl, g in groups.items())

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> dict[str, Any]:
        out = self.counters.as_dict()
        out["server"] = dict(self.store.stats().__dict__)
        out["available"] = self.store.available
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def _ids(tokens: bytes) -> list[int]:
    from array import array

    return array("i", tokens).tolist()


def _by_ttl(hashes: list[bytes], retained: dict[bytes, float]) -> dict[float, list[bytes]]:
    groups: dict[float, list[bytes]] = {}
    for h in hashes:
        groups.setdefault(retained[h], []).append(h)
    return groups


__all__ = ["RemoteTier", "RemoteCounters"]

