"""The remote tier's scheduler side: find a new request's blocks on the shared server and admit
the request once they are in the host tier.

vLLM splits a KV connector into a scheduler role and a worker role; :class:`RemoteLookup` is
the scheduler role of radixkv's remote tier (the worker role, which writes, is
:class:`~radixkv.tiers.remote_writer.RemoteWriter`). Read path of a new request:

1. :meth:`RemoteLookup.lookup` (loop thread, in ``add_request``): the chain hashes of the
   prompt's full blocks past what the tree already caches. A background thread asks the
   server ``EXISTS`` for all of them in one round trip, then ``MGET``\\ s the leading run of
   hits in a second; every value is verified by
   :class:`~radixkv.storage.remote.RemoteStore` (layout, namespace, tokens, checksum or MAC): a
   bad value is a miss and is deleted. Until the lookup is done the request waits here,
   outside the scheduler, for at most ``CacheConfig.remote_timeout_s``.
2. :meth:`RemoteLookup.admit` (loop thread, at the start of each step): each finished lookup
   installs its blocks in the host tier (the block manager's ``install_lower`` + a
   ``put_many`` into the host pool's slot; room is made by the host tier's own eviction) and
   hands the request to the scheduler, which then promotes them into the device like any host
   hit. A lookup past its deadline is abandoned: the request runs without it (recompute), so a
   slow or dead server costs time, bounded, never correctness.

The blocks a request got from the server are counted as ``remote`` in its
``cached_tokens_per_tier`` (:meth:`RemoteLookup.take_remote_tokens`, at its first admission).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import xxhash

from radixkv.core.hashing import TOKEN_BYTES, BlockHash, token_bytes
from radixkv.core.node import MoveOp
from radixkv.errors import StorageError
from radixkv.storage.backend import BlockWrite
from radixkv.tiers.protocol import CacheWriter

if TYPE_CHECKING:
    from radixkv.core.tree import RadixTree
    from radixkv.storage.host import HostPool
    from radixkv.storage.remote import RemoteBlock, RemoteStore

log = logging.getLogger("radixkv.tiers.remote")


class _Seq(Protocol):
    @property
    def token_ids(self) -> Sequence[int]: ...


class _Namespace(Protocol):
    @property
    def seed(self) -> bytes: ...


class LookupRequest(Protocol):
    """What a lookup reads of the engine's request (``radixkv.engine.sequence.Request``): its
    id, its namespace's root seed and its first sequence's prompt tokens."""

    @property
    def request_id(self) -> str: ...

    @property
    def namespace(self) -> _Namespace: ...

    @property
    def seqs(self) -> Sequence[_Seq]: ...


@dataclass
class LookupCounters:
    """What the lookups did since construction (part of ``stats()["remote"]``)."""

    lookups: int = 0              # requests looked up
    lookup_timeouts: int = 0      # lookups abandoned at their deadline
    lookup_failures: int = 0      # lookups whose job failed (I/O error): computed instead
    blocks_found: int = 0         # blocks the server had (leading run, verified)
    blocks_installed: int = 0     # of those, placed in the host tier
    blocks_not_installed: int = 0  # no room / parent gone / already cached meanwhile
    parent_lost: int = 0          # lookups whose local parent left (or sits on disk) meanwhile
    hit_tokens: int = 0           # prompt tokens served from the remote tier (first admission)
    lookup_seconds: float = 0.0   # total wall time of finished lookups


#: The engine's request type (the tier hands back the objects it was given).
R = TypeVar("R", bound=LookupRequest)


@dataclass
class _Arrival(Generic[R]):
    req: R
    hashes: list[bytes]           # chain hashes of the blocks past the local match
    tokens: list[bytes]           # their tokens (int32 bytes), for install_lower
    parent_hash: bytes | None     # the last locally cached block's hash (None: root)
    cached: list[bytes]           # the locally cached chain it ends (to find it again)
    future: Future[list[RemoteBlock]] | None
    deadline: float
    started: float = field(default_factory=time.perf_counter)


class RemoteLookup(Generic[R]):
    """Looks new requests' blocks up on the shared server and installs the hits in the host
    tier (see the module docstring). Every method runs on the engine's loop thread except the
    lookup jobs, which only call the store.

    Args:
        store: the shared store.
        tree: the radix tree (read: local matches, room in the host tier).
        host: the host tier's pool (tree tier ``host_tier``): hits are written into the slots
            the block manager gives them, through its ``put_many``.
        writer: the tree's writer (the block manager): ``touch``, ``evict``,
            ``install_lower``.
        block_size: tokens per block.
        timeout_s: how long a request may wait for its lookup.
    """

    def __init__(self, store: RemoteStore, tree: RadixTree, host: HostPool, host_tier: int,
                 writer: CacheWriter, block_size: int, timeout_s: float) -> None:
        self.store, self.tree, self.host, self.host_tier = store, tree, host, host_tier
        self._writer = writer
        self.block_size, self.timeout_s = block_size, timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="radixkv-remote-lookup")
        self._arrivals: dict[str, _Arrival[R]] = {}
        self._remote_tokens: dict[str, int] = {}
        self.counts = LookupCounters()

    def lookup(self, req: R) -> None:
        """Start the remote lookup of ``req``'s prompt; the request waits in here until
        :meth:`admit` hands it to the scheduler."""
        cached, hashes, tokens = self._chain(req)
        future = self._pool.submit(self._fetch, hashes) if hashes else None
        self.counts.lookups += 1 if hashes else 0
        self._arrivals[req.request_id] = _Arrival(
            req, hashes, tokens, cached[-1] if cached else None, cached, future,
            time.perf_counter() + self.timeout_s)

    def _chain(self, req: R) -> tuple[list[bytes], list[bytes], list[bytes]]:
        """``req``'s prompt against the tree: the chain hashes of its locally cached full blocks,
        then the hashes and tokens (int32 bytes) of the full blocks past them (the last token
        is always computed: it makes the logits)."""
        ids = req.seqs[0].token_ids
        bs = self.block_size
        n_full = (len(ids) - 1) // bs
        tb = token_bytes(ids)
        cached = self.tree.match_hashes(tb, req.namespace.seed, n_full)
        hashes: list[bytes] = []
        tokens: list[bytes] = []
        width = bs * TOKEN_BYTES
        h = cached[-1] if cached else req.namespace.seed
        for i in range(len(cached), n_full):
            chunk = tb[i * width:(i + 1) * width]
            h = xxhash.xxh3_128_digest(h + chunk)
            hashes.append(h)
            tokens.append(chunk)
        return cached, hashes, tokens

    def _fetch(self, hashes: list[bytes]) -> list[RemoteBlock]:
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
        """Whether any request waits for its lookup."""
        return bool(self._arrivals)

    def is_arriving(self, request_id: str) -> bool:
        return request_id in self._arrivals

    def forget(self, request_id: str) -> R | None:
        """Drop a request still waiting for its lookup (abort); returns it, or None."""
        a = self._arrivals.pop(request_id, None)
        return None if a is None else a.req

    def admit(self, run_ops: Callable[[list[MoveOp]], object], wait: bool
              ) -> list[R]:
        """Requests whose lookup finished (their blocks installed) or timed out, in arrival
        order; ``wait``: nothing else to do, so block until the first one is ready.
        ``run_ops(moves)`` runs the moves that make room in the host tier."""
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
                self.counts.lookup_timeouts += 1
                log.warning("remote lookup of %r timed out after %.2f s; computing it",
                            rid, self.timeout_s)
            else:
                continue
            del self._arrivals[rid]
            ready.append(a.req)
        return ready

    def admit_now(self, request_id: str, run_ops: Callable[[list[MoveOp]], object]) -> int:
        """Wait for one lookup (at most until its deadline), install its blocks in the host
        tier like :meth:`admit` and return the prompt tokens installed (also counted as
        ``hit_tokens``); 0 for a miss, a failed or timed-out lookup, or an unknown id. The
        lookup is done with either way. For a caller on the loop thread that needs the blocks
        before it goes on (a blend's document entries: ``radixkv.engine.blend``), with a
        ``request_id`` of its own; scheduled requests go through :meth:`admit`."""
        a = self._arrivals.pop(request_id, None)
        if a is None:
            return 0
        if a.future is not None and not a.future.done():
            try:
                a.future.result(max(0.0, a.deadline - time.perf_counter()))
            except FuturesTimeout:
                a.future.cancel()
                self.counts.lookup_timeouts += 1
                log.warning("remote lookup of %r timed out after %.2f s; computing it",
                            request_id, self.timeout_s)
                return 0
            except (OSError, StorageError):   # the job's failure: logged in _install
                pass
        self._install(a, run_ops)
        return self.take_remote_tokens(request_id)

    def _install(self, a: _Arrival[R], run_ops: Callable[[list[MoveOp]], object]) -> None:
        if a.future is None:
            return
        try:
            blocks = a.future.result()
        except (OSError, StorageError) as exc:   # a failed lookup is a miss, logged, counted
            log.warning("remote lookup failed (%s: %s); computing the request",
                        type(exc).__name__, exc)
            self.counts.lookup_failures += 1
            return
        self.counts.lookup_seconds += time.perf_counter() - a.started
        self.counts.blocks_found += len(blocks)
        if not blocks:
            return
        tree, t = self.tree, self.host_tier
        if a.parent_hash is not None:
            # the local match, found again by its chain (the tree indexes nodes, not blocks)
            where = tree.locate_chain([BlockHash(h) for h in a.cached])
            if len(where) == len(a.cached):   # making room below must not evict the parent
                self._writer.touch(BlockHash(a.parent_hash), near=where[-1][0])
        # Make room in the host tier by its own eviction (demotions/drops run now, before the
        # slots are written: the tree hands out the freed slots).
        free = self.host.num_blocks - tree.num_resident(t) - tree.num_copies(t)
        short = len(blocks) - free
        if short > 0:
            moves = self._writer.evict(t, min(short, tree.num_evictable(t)))
            if moves:
                run_ops(moves)
        # (touched above: the parent now ends its node, unless it was lost meanwhile)
        parent = None if a.parent_hash is None else tree.get(BlockHash(a.parent_hash),
                                                             scan=False)
        if a.parent_hash is not None and (parent is None or parent.tier > t):
            self.counts.parent_lost += 1
            self.counts.blocks_not_installed += len(blocks)
            return
        installed = 0
        parent_hash = a.parent_hash
        for block, h, tok in zip(blocks, a.hashes, a.tokens):
            if block.block_hash != h or (parent_hash is not None
                                         and block.parent_hash != parent_hash):
                break   # the store verified the value against its key; a chain break ends it
            ref = self._writer.install_lower(
                None if parent_hash is None else BlockHash(parent_hash), BlockHash(h), tok, t)
            if ref is None:
                break
            self.host.put_many([BlockWrite(ref.block_id, parent_hash, (), block.payload)])
            parent_hash = h
            installed += 1
        self.counts.blocks_installed += installed
        self.counts.blocks_not_installed += len(blocks) - installed
        if installed:
            self._remote_tokens[a.req.request_id] = installed * self.block_size

    def fetch_now(self, reqs: Sequence[R], run_ops: Callable[[list[MoveOp]], object]
                  ) -> dict[str, int]:
        """Look several requests' prompts up together and install their hits in the host tier
        now, for a caller on the loop thread that needs them before it goes on (a blend's
        document entries, :mod:`radixkv.engine.blend`); returns, per request id, the prompt
        tokens installed (counted as ``hit_tokens``).

        One job for all of them, waited for at most ``timeout_s`` in all (a lookup per
        request would cost up to that each): one ``EXISTS`` batch over the distinct blocks
        past each prompt's local match (chains that share a lead, as document entries do, ask
        for it once) and one ``MGET`` of every chain's leading run of hits; each value verified
        by the store, as for :meth:`lookup`. Then each request in order is installed as
        :meth:`admit_now` does, its chain matched against the tree again first, so the blocks
        an earlier one installed (the shared lead) are its local parent. A miss, a bad value,
        a failed or timed-out job installs nothing for the chains it touches: the caller
        computes them."""
        chains = [self._chain(r)[1] for r in reqs]
        asked = sum(1 for c in chains if c)
        out = {r.request_id: 0 for r in reqs}
        if not asked:
            return out
        self.counts.lookups += asked
        started = time.perf_counter()
        job = self._pool.submit(self._fetch_runs, chains)
        try:
            found = job.result(self.timeout_s)
        except FuturesTimeout:
            job.cancel()
            self.counts.lookup_timeouts += asked
            log.warning("remote lookup of %d prompts timed out after %.2f s; computing them",
                        asked, self.timeout_s)
            return out
        except (OSError, StorageError) as exc:   # a failed lookup is a miss, logged, counted
            self.counts.lookup_failures += asked
            log.warning("remote lookup failed (%s: %s); computing %d prompts",
                        type(exc).__name__, exc, asked)
            return out
        for req in reqs:
            cached, hashes, tokens = self._chain(req)
            k = 0
            while k < len(hashes) and hashes[k] in found:
                k += 1
            if not k:
                continue
            done: Future[list[RemoteBlock]] = Future()
            done.set_result([found[h] for h in hashes[:k]])
            self._install(_Arrival(req, hashes[:k], tokens[:k], cached[-1] if cached else None,
                                   cached, done, started, started), run_ops)
            out[req.request_id] = self.take_remote_tokens(req.request_id)
        return out

    def _fetch_runs(self, chains: list[list[bytes]]) -> dict[bytes, RemoteBlock]:
        """Background, for :meth:`fetch_now`: the verified blocks of the leading run of hits of
        every chain, by hash (2 round trips for all of them: one EXISTS batch over the
        distinct hashes, one MGET of the distinct hashes of the runs)."""
        distinct = list(dict.fromkeys(h for c in chains for h in c))
        present = dict(zip(distinct, self.store.contains_many(distinct)))
        runs: dict[bytes, None] = {}
        for c in chains:
            for h in c:
                if not present[h]:
                    break
                runs[h] = None
        want = list(runs)
        if not want:
            return {}
        return {h: b for h, b in zip(want, self.store.get_many(want)) if b is not None}

    def take_remote_tokens(self, request_id: str) -> int:
        """Prompt tokens of ``request_id`` installed from the server (once; counted as
        ``hit_tokens``)."""
        n = self._remote_tokens.pop(request_id, 0)
        self.counts.hit_tokens += n
        return n

    def close(self) -> None:
        """Abandon lookups in flight (their requests are the engine's to finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["RemoteLookup", "LookupCounters", "LookupRequest"]
