"""The KV-aware request router: send a request where its prefix is cached, unless that is busy.

Plugged into Ray Serve's request-router extension point (``RequestRouterConfig``): Serve calls
:meth:`KVAwareRouter.choose_replicas` for every request to the engine deployment and sends it to
the first replica of the first rank that has room (``max_ongoing_requests``). The router:

1. reads the request's block chain hashes, computed by the HTTP process (``route`` keyword of
   the replica's ``generate``; the hashes include the model, KV layout and tenant salt, so they
   are exactly the names the replicas' trees use);
2. looks them up in its :class:`~radixkv.fleet.index.PrefixIndex`, kept current by long-polling
   the fleet's :class:`~radixkv.fleet.events.KVEventBus` (what entered and left each replica's
   cache, any tier);
3. scores each replica ``cached prefix tokens - load_tokens x (its requests in flight - the
   least loaded replica's)``, and ranks replicas by score: the best first, the rest as a
   fallback rank. ``load_tokens`` is the prefill a queued request is worth: a replica with the
   longest prefix wins unless it is that much busier, so one hot prefix cannot pile every request
   onto one replica. A request with no cached prefix anywhere goes to the least-loaded replica.

A request counts as in flight on a replica from the moment the router chooses it
(:class:`InFlight`), not only once Serve reports it accepted a round trip later, so a burst of
new conversations spreads instead of all seeing equal loads.

A conversation sticks to its replica because its previous turn's blocks are there; it moves only
if that replica dies (removed from the index at once) or is ``load_tokens`` per request busier.
A routed request's blocks count as cached on its replica at once (tentatively, until its events
confirm them or :data:`SPECULATE_S` passes), so requests sharing a new prefix follow the first.

Each router counts its decisions (:class:`RouterStats`) and reports them to the event bus with
every poll; the fleet's ``/metrics`` sums the reports. (Not a module global: Serve may load the
router class by value, which gives its methods their own copy of this module's globals.)
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import (PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from radixkv.fleet.index import PrefixIndex

log = logging.getLogger("radixkv.fleet")

#: Default prefill tokens one request in flight is worth when weighing cache against load.
LOAD_TOKENS = 64
#: Seconds a routed request's blocks count as cached on its replica before its events confirm
#: them (see :meth:`radixkv.fleet.index.PrefixIndex.speculate`).
SPECULATE_S = 20.0
#: Seconds a request counts as in flight on the replica chosen for it before Serve reports it
#: sent there (a request cancelled while queued in Serve is never reported either way).
PLACED_S = 10.0


@dataclass
class RouterStats:
    """Counters of routing decisions, for ``/metrics``."""

    requests: dict[str, int] = field(default_factory=lambda: {"prefix": 0, "load": 0,
                                                                "cold": 0})
    #: Sum over requests of the cached prefix (tokens) on the replica chosen, and the best one
    #: available: their ratio is what load balancing cost in cache hits.
    chosen_hit_tokens: int = 0
    best_hit_tokens: int = 0
    index_blocks: int = 0
    index_replicas: int = 0
    snapshots: int = 0
    events_applied: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)

    @classmethod
    def total(cls, reports: list[dict[str, Any]]) -> RouterStats:
        """The sum of several routers' reports (one per ingress replica)."""
        out = cls()
        for r in reports:
            for k, v in r.get("requests", {}).items():
                out.requests[k] = out.requests.get(k, 0) + v
            for k, v in r.get("per_replica", {}).items():
                out.per_replica[k] = out.per_replica.get(k, 0) + v
            for k in ("chosen_hit_tokens", "best_hit_tokens", "snapshots", "events_applied"):
                setattr(out, k, getattr(out, k) + r.get(k, 0))
            out.index_blocks = max(out.index_blocks, r.get("index_blocks", 0))
            out.index_replicas = max(out.index_replicas, r.get("index_replicas", 0))
        return out

    def prometheus(self) -> bytes:
        lines = [
            "# HELP radixkv_router_requests Requests routed, by the reason of the choice "
            "(prefix: longest cached prefix; load: a less loaded replica over a longer prefix; "
            "cold: no prefix cached anywhere).",
            "# TYPE radixkv_router_requests counter",
            *(f'radixkv_router_requests_total{{decision="{k}"}} {v}'
              for k, v in self.requests.items()),
            "# HELP radixkv_router_hit_tokens Cached prefix tokens of routed requests on the "
            "replica chosen and on the best replica available.",
            "# TYPE radixkv_router_hit_tokens counter",
            f'radixkv_router_hit_tokens_total{{choice="chosen"}} {self.chosen_hit_tokens}',
            f'radixkv_router_hit_tokens_total{{choice="best"}} {self.best_hit_tokens}',
            "# HELP radixkv_router_routed Requests routed to each replica.",
            "# TYPE radixkv_router_routed counter",
            *(f'radixkv_router_routed_total{{replica="{r}"}} {n}'
              for r, n in sorted(self.per_replica.items())),
            "# HELP radixkv_router_index_blocks Distinct blocks in the router's index.",
            "# TYPE radixkv_router_index_blocks gauge",
            f"radixkv_router_index_blocks {self.index_blocks}",
            "# HELP radixkv_router_index_replicas Replicas in the router's index.",
            "# TYPE radixkv_router_index_replicas gauge",
            f"radixkv_router_index_replicas {self.index_replicas}",
            "# HELP radixkv_router_event_batches Event batches applied to the index.",
            "# TYPE radixkv_router_event_batches counter",
            f"radixkv_router_event_batches_total {self.events_applied}",
        ]
        return ("\n".join(lines) + "\n").encode()



def rank(hits: dict[str, int], load: dict[str, int], block_size: int,
         load_tokens: int) -> tuple[list[str], str]:
    """Replica ids best first, and the decision's kind. Pure: the policy, tested alone.

    ``hits``: cached prefix blocks per candidate; ``load``: its requests in flight."""
    ids = list(hits)
    random.shuffle(ids)                  # ties go anywhere, not always to the first replica
    floor = min(load.get(r, 0) for r in ids)
    best_hit = max(hits.values())
    if best_hit == 0:
        ids.sort(key=lambda r: load.get(r, 0))
        return ids, "cold"
    ids.sort(key=lambda r: -(hits[r] * block_size - load_tokens * (load.get(r, 0) - floor)))
    return ids, "prefix" if hits[ids[0]] == best_hit else "load"


def with_documents(index: PrefixIndex, hits: dict[str, int],
                   documents: Sequence[tuple[int, Sequence[bytes]]], lead_blocks: int,
                   block_size: int) -> dict[str, int]:
    """``hits`` (cached prefix blocks per replica) plus the blocks of the request's document
    entries each replica caches, past their lead: what a blend there reuses. Pure.

    ``documents``: per document, its first token's position in the prompt and its entry's chain
    hashes (lead + document, :meth:`radixkv.fleet.ingress.FleetBackend.document_hashes`);
    ``lead_blocks``: the lead's length. A document that starts inside a replica's cached prefix
    adds nothing there (the prefix has it already). Runtime: one index lookup per entry block
    until every replica has missed."""
    out = dict(hits)
    for start, hashes in documents:
        cached = index.match(hashes, hits)
        for r, n in cached.items():
            if start >= hits[r] * block_size:
                out[r] += max(0, n - lead_blocks)
    return out


class InFlight:
    """Requests in flight per replica, as this router knows them. Pure bookkeeping.

    A request counts on its replica from the moment it is *chosen*, not when Serve reports it
    accepted: between the two lies a round trip to the replica (Serve's rejection protocol), and
    a burst of new conversations chosen inside that window would all see equal loads and could
    pile onto one replica. A choice not confirmed within ``ttl`` seconds (the request was
    cancelled while queued in Serve, which reports nothing) stops counting. Keyed by Serve's
    internal request id, so a completion is counted once and only for a request it placed.
    """

    def __init__(self, ttl: float = PLACED_S) -> None:
        self._ttl = ttl
        #: request id -> (replica, deadline of an unconfirmed choice, or None once sent)
        self._where: dict[str, tuple[str, float | None]] = {}
        self._count: dict[str, int] = {}
        #: (deadline, request) of choices in the order made: deadlines are ``now + ttl`` with a
        #: monotonic clock, so they come out in order; an entry whose request was since sent,
        #: chosen again or completed no longer matches ``_where`` and is skipped
        self._deadlines: deque[tuple[float, str]] = deque()

    def _drop(self, request: str) -> None:
        replica, _ = self._where.pop(request)
        self._count[replica] -= 1
        if not self._count[replica]:
            del self._count[replica]

    def _put(self, request: str, replica: str, deadline: float | None) -> None:
        if request in self._where:
            self._drop(request)
        self._where[request] = (replica, deadline)
        self._count[replica] = self._count.get(replica, 0) + 1
        if deadline is not None:
            self._deadlines.append((deadline, request))

    def chosen(self, request: str, replica: str, now: float) -> None:
        """The router ranked ``replica`` first for ``request`` (again, on a retry)."""
        self._put(request, replica, now + self._ttl)

    def sent(self, request: str, replica: str) -> None:
        """Serve sent ``request`` to ``replica`` (the first choice or a fallback) and it was
        accepted: it counts there until :meth:`done`."""
        self._put(request, replica, None)

    def done(self, request: str, replica: str) -> None:
        """``request`` completed, failed, or was rejected on ``replica``. Ignored unless the
        request is counted there: a rejected attempt's report may arrive after the retry was
        placed elsewhere."""
        got = self._where.get(request)
        if got is not None and got[0] == replica:
            self._drop(request)

    def expire(self, now: float) -> list[str]:
        """Stop counting choices unconfirmed past their deadline; their request ids. Amortized
        O(1) per choice: it runs on every routing decision."""
        gone = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, r = self._deadlines.popleft()
            got = self._where.get(r)
            if got is not None and got[1] == deadline:
                self._drop(r)
                gone.append(r)
        return gone

    def forget(self, replica: str) -> None:
        """``replica`` is gone: its requests no longer load anything."""
        for r in [r for r, (rep, _) in self._where.items() if rep == replica]:
            self._drop(r)

    def load(self, replica: str) -> int:
        return self._count.get(replica, 0)

    def __len__(self) -> int:
        return len(self._where)


class KVAwareRouter(RequestRouter):
    """Ray Serve request router over the fleet's KV events (see the module docstring).

    ``request_router_kwargs``: ``bus_name``/``bus_namespace`` (the :class:`KVEventBus` actor),
    ``block_size``, ``load_tokens``.
    """

    def initialize_state(self, bus_name: str = "", bus_namespace: str = "",
                         block_size: int = 16, load_tokens: int = LOAD_TOKENS,
                         **_: Any) -> None:
        self._bus_name, self._bus_ns = bus_name, bus_namespace
        self._block_size, self._load_tokens = block_size, load_tokens
        self._index = PrefixIndex()
        self._inflight = InFlight()
        self._pending_hits: dict[str, tuple[dict[str, int], int, list[bytes]]] = {}
        self._poller: asyncio.Task | None = None
        self.stats = RouterStats()
        self._key = uuid.uuid4().hex[:12]

    # ------------------------------------------------------------------ events
    def _ensure_poller(self) -> None:
        if self._bus_name and (self._poller is None or self._poller.done()):
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        import ray

        cursor, bus = -1, None
        while True:
            try:
                if bus is None:
                    bus = ray.get_actor(self._bus_name, namespace=self._bus_ns)
                cursor, batches, snapshot = await bus.poll.remote(cursor, 1.0)
                self._apply(batches, snapshot)
                bus.report_router.remote(self._key, asdict(self.stats))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (poll task must not die: retry, resync by snapshot)
                log.warning("radixkv router: KV event poll failed (%s); retrying", exc)
                bus = None
                cursor = -1
                await asyncio.sleep(0.5)

    def _apply(self, batches: list[Any], snapshot: bool) -> None:
        if snapshot:
            self._index = PrefixIndex()
            self.stats.snapshots += 1
        for replica, reset, added, removed in batches:
            if reset:
                self._index.remove_replica(replica)
            self._index.apply(replica, added, removed)
            self.stats.events_applied += 1
        self.stats.index_blocks = len(self._index)
        self.stats.index_replicas = len(self._index.replicas)

    def _forget(self, replica: str) -> None:
        """A replica left (died, or was replaced): drop it here and on the bus, so that no
        other router resurrects it from old events."""
        self._index.remove_replica(replica)
        self._inflight.forget(replica)
        self.stats.index_replicas = len(self._index.replicas)
        if self._bus_name:
            try:
                import ray

                ray.get_actor(self._bus_name, namespace=self._bus_ns).remove.remote(replica)
            except Exception as exc:  # noqa: BLE001 (Serve callback must not raise; bus down: stale)
                log.warning("radixkv router: could not drop %s from the bus (%s)", replica, exc)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id.unique_id for r in replicas}
        for gone in [r for r in self._index.replicas if r not in alive]:
            self._forget(gone)

    # ------------------------------------------------------------------ routing
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        self._ensure_poller()
        if not candidate_replicas:
            return []
        now = time.monotonic()
        self._index.expire(now)
        for req in self._inflight.expire(now):   # cancelled while queued in Serve
            self._pending_hits.pop(req, None)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        route = pending_request.kwargs.get("route") if pending_request is not None else None
        hashes = (route or {}).get("hashes") or []
        hits = self._index.match(hashes, by_id)
        docs = (route or {}).get("documents") or []
        if docs:   # a RAG request: its documents' entries count where they are cached
            hits = with_documents(self._index, hits, docs, (route or {}).get("lead_blocks", 0),
                                  self._block_size)
            hashes = list(hashes) + [h for _, hs in docs for h in hs]   # all computed there
        load = {r: self._inflight.load(r) for r in by_id}
        order, kind = rank(hits, load, self._block_size, self._load_tokens)
        if pending_request is not None:
            req = pending_request.metadata.internal_request_id
            self._pending_hits[req] = (hits, max(hits.values()), hashes)
            self._inflight.chosen(req, order[0], now)
            self.stats.requests[kind] += 1
        first, rest = by_id[order[0]], [by_id[r] for r in order[1:]]
        return [[first], rest] if rest else [[first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        rid = replica_id.unique_id
        self._inflight.sent(pending_request.metadata.internal_request_id, rid)
        self.stats.per_replica[rid] = self.stats.per_replica.get(rid, 0) + 1
        got = self._pending_hits.pop(pending_request.metadata.internal_request_id, None)
        if got is not None:
            hits, best, hashes = got
            self.stats.chosen_hit_tokens += hits.get(rid, 0) * self._block_size
            self.stats.best_hit_tokens += best * self._block_size
            # what it computes there counts as cached there from now on (tentatively)
            self._index.speculate(rid, hashes, time.monotonic() + SPECULATE_S)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._inflight.done(internal_request_id, replica_id.unique_id)
        self._pending_hits.pop(internal_request_id, None)


__all__ = ["KVAwareRouter", "InFlight", "RouterStats", "rank", "with_documents", "LOAD_TOKENS",
           "SPECULATE_S", "PLACED_S"]
