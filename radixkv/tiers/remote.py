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
  slot, then it is skipped). Parent hash and tokens of a dropped block come from
  ``RadixTree.drop_listener`` (:meth:`on_drop`; the block is gone from the tree by the time the group
  runs).
* ``write_through``: also every block as soon as it is computed (``RadixTree.insert_listener``,
  :meth:`on_computed`),
  copied off the device after the step, so another replica finds a conversation at once.
* Writes are queued to the store's writer thread (never blocking the step); a full queue or a
  server that is down drops the write and counts it (a write is only a future hit).

Accounting: the blocks a request got from the server are counted as ``remote`` in its
``cached_tokens_per_tier`` (moved out of the host count at its first admission).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import Any

from radixkv.core.hashing import TOKEN_BYTES, token_bytes
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
    lookup_seconds: float = 0.0   # total wall time of finished lookups

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Arrival:
    req: Any
    hashes: list[bytes]           # chain hashes of the blocks past the local match
    tokens: list[bytes]           # their tokens (int32 bytes), for insert_lower
    parent_hash: bytes | None     # the last locally cached block's hash (None: root)
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
        self._computed: list[bytes] = []
        self._remote_tokens: dict[str, int] = {}
        self.counters = RemoteCounters()
        self.write.attach(self, tree, mover)

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
            req, hashes, tokens, cached[-1] if cached else None, future,
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
        if a.parent_hash is not None and tree.get(a.parent_hash) is not None:
            self._writer.touch(a.parent_hash)   # making room below must not evict the parent
        # Make room in the host tier by its own eviction (demotions/drops run now, before the
        # slots are written: the tree hands out the freed slots).
        free = self.host.num_slots - tree.num_resident(t) - tree.num_copies(t)
        short = len(blocks) - free
        if short > 0:
            moves = self._writer.evict(t, min(short, tree.num_evictable(t)))
            if moves:
                run_ops(moves)
        parent = tree.get(a.parent_hash) if a.parent_hash is not None else None
        if a.parent_hash is not None and (parent is None or parent.tier > t):
            self.counters.parent_lost += 1
            self.counters.blocks_not_installed += len(blocks)
            return
        installed = 0
        parent_hash = a.parent_hash
        for block, h, tok in zip(blocks, a.hashes, a.tokens):
            if block.block_hash != h or (parent_hash is not None and block.parent_hash != parent_hash):
                break   # the store verified the value against its key; a chain break ends it
            ref = self._writer.install_lower(parent_hash, h, tok, t)
            if ref is None:
                break
            self.host.slot_bytes(ref.slot)[:] = block.payload
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
    def on_computed(self, hashes: list[bytes]) -> None:
        """Blocks just committed (write-through: written after the step)."""
        self._computed.extend(hashes)

    def on_drop(self, blocks: list[BlockRef]) -> None:
        """Blocks about to leave the cache: keep what a write-back of the host ones needs."""
        for b in blocks:
            if b.tier == self.host_tier:
                self._dropped[b.block_hash] = (b.parent_hash, b.tokens)

    def apply_moves(self, moves: Sequence[MoveOp]) -> None:
        """Write back the blocks leaving the host tier in ``moves``, a group of one direction
        that the mover is about to run (the groups before it have landed, so each source
        slot holds exactly its block)."""
        t = self.host_tier
        if not moves or moves[0].src_tier != t:
            return
        items = []
        for m in moves:
            if m.keep_src or not (m.dst_tier is None or m.dst_tier > t):
                continue
            meta = self._dropped.pop(m.block_hash, None)
            if meta is None:
                ref = self.tree.get(m.block_hash)
                if ref is None:
                    continue
                meta = (ref.parent_hash, ref.tokens)
            if self._unsafe(m.block_hash):
                self.counters.writes_skipped += 1
                continue
            items.append((m.block_hash, meta[0], _ids(meta[1]),
                          self.host.slot_bytes(m.src_slot)))
        if items:
            self._put(items)

    def after_step(self) -> None:
        """Write-through: queue the blocks computed this step (copied off the device).
        Forget drop records no move list used (blocks invalidated, never written)."""
        self._dropped.clear()
        if not self._computed:
            return
        nodes = [r for r in map(self.tree.get, self._computed) if r is not None and r.tier == 0]
        self._computed.clear()
        if not nodes:
            return
        import torch

        kv = self._device_cache   # [L, 2, N, bs, h, d]
        idx = torch.tensor([n.slot for n in nodes], dtype=torch.long, device=kv.device)
        blocks = kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        self._put([(n.block_hash, n.parent_hash,
                    _ids(n.tokens), blocks[i].view(-1).view(torch.uint8).numpy())
                   for i, n in enumerate(nodes)])

    def _put(self, items: list[Any]) -> None:
        queued = self.store.put_many(items)
        ok = sum(queued)
        self.counters.blocks_written += ok
        self.counters.writes_skipped += len(queued) - ok

    def copy_blocks(self, copies: Sequence[Any]) -> None:
        """Device copies are not the remote tier's business."""

    def counters(self) -> dict[str, Any]:
        return self.stats()

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


__all__ = ["RemoteTier", "RemoteCounters"]
