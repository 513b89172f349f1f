"""The fleet's pure parts without Ray: the router's index against a naive model, the event log's
cursor/snapshot contract, the engine-side event recorder, and the routing policy."""

from __future__ import annotations

import weakref

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixkv.fleet.events import EventLog, EventRecorder
from radixkv.fleet.index import PrefixIndex

try:
    from radixkv.fleet.router import InFlight, rank, with_documents
except ImportError:   # ray missing: the router module imports Ray Serve's base class
    InFlight = rank = with_documents = None

REPLICAS = ["a", "b", "c"]
HASHES = [bytes([i]) * 16 for i in range(12)]


def naive_match(sets: dict[str, set[bytes]], hashes: list[bytes], replicas: list[str]
                ) -> dict[str, int]:
    out = {}
    for r in replicas:
        n = 0
        for h in hashes:
            if h not in sets.get(r, set()):
                break
            n += 1
        out[r] = n
    return out


class IndexMachine(RuleBasedStateMachine):
    """PrefixIndex == per-replica sets (confirmed by events) plus tentative entries (routed, not
    yet confirmed, with deadlines), under adds, removes, speculation, expiry, replica removal
    and slot reuse."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[str, set[bytes]] = {}
        self.tentative: dict[str, dict[bytes, float]] = {}
        self.now = 0.0

    def _effective(self) -> dict[str, set[bytes]]:
        out = {r: set(s) for r, s in self.model.items()}
        for r, t in self.tentative.items():
            out.setdefault(r, set()).update(t)
        return out

    @rule(r=st.sampled_from(REPLICAS), add=st.lists(st.sampled_from(HASHES), max_size=6),
          rm=st.lists(st.sampled_from(HASHES), max_size=6))
    def apply(self, r: str, add: list[bytes], rm: list[bytes]) -> None:
        self.index.apply(r, add, rm)
        s = self.model.setdefault(r, set())
        t = self.tentative.setdefault(r, {})
        s.update(add)
        s.difference_update(rm)
        for h in [*add, *rm]:
            t.pop(h, None)

    @rule(r=st.sampled_from(REPLICAS), hs=st.lists(st.sampled_from(HASHES), max_size=6),
          ttl=st.integers(1, 5))
    def speculate(self, r: str, hs: list[bytes], ttl: int) -> None:
        eff = self._effective().get(r, set())
        new = self.index.speculate(r, hs, self.now + ttl)
        fresh = {h for h in hs if h not in eff}
        assert new == len(fresh)
        self.model.setdefault(r, set())
        for h in fresh:
            self.tentative.setdefault(r, {})[h] = self.now + ttl

    @rule(dt=st.integers(0, 4))
    def tick(self, dt: int) -> None:
        self.now += dt
        dropped = self.index.expire(self.now)
        gone = 0
        for t in self.tentative.values():
            for h in [h for h, d in t.items() if d <= self.now]:
                del t[h]
                gone += 1
        assert dropped == gone

    @rule(r=st.sampled_from(REPLICAS))
    def remove(self, r: str) -> None:
        held = self.index.remove_replica(r)
        assert held == len(self.model.pop(r, set()))
        self.tentative.pop(r, None)

    @rule(q=st.lists(st.sampled_from(HASHES), max_size=8),
          among=st.lists(st.sampled_from(REPLICAS + ["zz"]), min_size=1, unique=True))
    def match(self, q: list[bytes], among: list[str]) -> None:
        assert self.index.match(q, among) == naive_match(self._effective(), q, among)

    @invariant()
    def counts(self) -> None:
        for r, s in self.model.items():
            assert self.index.num_blocks(r) == len(s)          # confirmed blocks only
            assert self.index.num_tentative(r) == len(self.tentative.get(r, {}))
        eff = self._effective()
        assert len(self.index) == len(set().union(*eff.values()) if eff else set())


TestIndex = IndexMachine.TestCase


def test_match_stops_at_the_first_missing_block_per_replica() -> None:
    idx = PrefixIndex()
    h = HASHES
    idx.apply("a", h[:5], [])
    idx.apply("b", h[:2] + h[3:5], [])   # b lost block 2: its prefix ends there
    assert idx.match(h[:5], ["a", "b", "c"]) == {"a": 5, "b": 2, "c": 0}
    assert idx.match([], ["a"]) == {"a": 0}


@given(st.lists(st.tuples(st.sampled_from(REPLICAS), st.booleans(),
                          st.lists(st.sampled_from(HASHES), max_size=4),
                          st.lists(st.sampled_from(HASHES), max_size=4)), max_size=30),
       st.integers(1, 8), st.data())
def test_event_log_readers_converge_from_any_cursor(batches: list[Any], cap: int,
                                                    data: st.DataObject) -> None:
    """A reader that applies what read() returns, starting at any time and reading at any
    pace, ends with the log's sets (a truncated log answers with a snapshot)."""
    log = EventLog(max_batches=cap)
    idx, cursor = PrefixIndex(), -1
    for r, reset, add, rm in batches:
        if data.draw(st.booleans()):
            cursor, got, snap = log.read(cursor)
            idx = _apply(PrefixIndex() if snap else idx, got)
        log.publish(r, add, rm, reset)
        if data.draw(st.integers(0, 9)) == 0:
            log.remove(r)
    cursor, got, snap = log.read(cursor)
    idx = _apply(PrefixIndex() if snap else idx, got)
    assert cursor == log.seq
    want = {r: n for r, n in log.holders().items()}
    assert {r: idx.num_blocks(r) for r in want} == want
    for r in idx.replicas:
        assert r in want or idx.num_blocks(r) == 0


def _apply(idx: PrefixIndex, batches: list[Any]) -> PrefixIndex:
    for r, reset, add, rm in batches:
        if reset:
            idx.remove_replica(r)
        idx.apply(r, add, rm)
    return idx


def test_recorder_starts_from_the_tree_reads_beside_others_and_cancels_round_trips() -> None:
    """The recorder reads the tree's KV events beside another reader (the remote tier's),
    starts from what the tree holds, and a block that came and went (or left and came back)
    between two drains is announced neither way."""
    from itertools import count

    from radixkv.core.block_manager import BlockManager
    from radixkv.core.events import BlockRemoved
    from radixkv.core.hashing import Namespace, hash_token_blocks

    ticks = count()
    bm = BlockManager.create(8, 2, clock=lambda: float(next(ticks)))
    ns = Namespace("m")

    def run(sid: str, toks: list[int]) -> bytes:
        bm.allocate(sid, toks + [9], ns)
        bm.commit(sid, len(toks) + 1)
        bm.free(sid)
        return hash_token_blocks(toks, 2, ns)[0]

    h0 = run("z", [0, 0])
    other = bm.event_queue().subscribe()          # e.g. the remote tier's reader
    rec = EventRecorder(bm.tree)
    assert rec.drain() == ([h0], [])
    h2, h3 = run("b", [2, 2]), run("c", [3, 3])
    bm.tree.evict(0, 2)                           # LRU: h0 (an older block) and h2 (came, went)
    assert rec.drain() == ([h3], [h0])
    bm.tree.evict(0, 1)                           # h3 leaves and comes back: no event
    assert run("c2", [3, 3]) == h3
    assert rec.drain() == ([], [])
    gone = [h for e in other.take_events() if type(e) is BlockRemoved for h in e.block_hashes]
    assert gone == [h0, h2, h3]                   # the other reader saw every event itself


def test_rank_prefers_the_cached_prefix_until_load_outweighs_it() -> None:
    if rank is None:
        import os

        import pytest

        assert not os.environ.get("CI"), "ray[serve] missing in CI: scripts/dev.sh installs it"
        pytest.skip("ray[serve] not installed")
    order, kind = rank({"a": 10, "b": 0}, {"a": 0, "b": 0}, 16, 256)
    assert order[0] == "a" and kind == "prefix"
    # a has 160 cached tokens but 1 more request in flight (worth 256 tokens): b wins
    order, kind = rank({"a": 10, "b": 0}, {"a": 1, "b": 0}, 16, 256)
    assert order[0] == "b" and kind == "load"
    order, kind = rank({"a": 0, "b": 0}, {"a": 3, "b": 1}, 16, 256)
    assert order == ["b", "a"] and kind == "cold"
    seen = {rank({"a": 0, "b": 0}, {}, 16, 256)[0][0] for _ in range(50)}
    assert seen == {"a", "b"}                         # ties spread


def test_document_entries_count_where_they_are_cached_past_the_prefix() -> None:
    """A RAG request's score on a replica: its cached prefix plus the cached blocks of its
    documents' entries past their lead, for the documents that start after that prefix; the
    entries' hashes are those the replicas' blends give them (FleetBackend.document_hashes)."""
    if with_documents is None:
        import os

        import pytest

        assert not os.environ.get("CI"), "ray[serve] missing in CI: scripts/dev.sh installs it"
        pytest.skip("ray[serve] not installed")
    from radixkv.core.hashing import Namespace, hash_token_blocks
    from radixkv.engine.blend import document_namespace
    from radixkv.fleet.ingress import FleetBackend

    bs = 4
    backend = FleetBackend(None, None, {"model_id": "m", "vocab_size": 100, "max_model_len": 99,
                                        "output_tier_names": ["device"], "max_num_seqs": 1,
                                        "block_size": bs, "namespace_model": "m"}, None)
    head, d1, d2 = [1] * 4, [2] * 8, [3] * 6          # d2's last 2 tokens: no full block
    prompt = head + d1 + d2 + [9, 9]
    docs, lead = backend.document_hashes(prompt, [(4, 12), (12, 18)], "salt")
    dns = document_namespace(Namespace("m").with_salt("salt"))
    assert lead == 1 and docs == [(4, hash_token_blocks(head + d1, bs, dns)),
                                  (12, hash_token_blocks(head + d2, bs, dns))]
    assert [len(h) for _, h in docs] == [3, 2]
    index = PrefixIndex()
    index.apply("a", docs[0][1] + docs[1][1], [])     # both entries, lead once
    index.apply("b", docs[1][1][:1], [])              # the lead only
    index.apply("c", [], [])
    hits = {"a": 0, "b": 0, "c": 1}                   # c caches the head as a prefix
    assert with_documents(index, hits, docs, lead, bs) == {"a": 2 + 1, "b": 0, "c": 1}
    # a prefix that covers d1 on a: only d2 adds there
    assert with_documents(index, {"a": 3, "b": 0, "c": 0}, docs, lead, bs)["a"] == 3 + 1
    order, kind = rank(with_documents(index, hits, docs, lead, bs), {}, bs, 64)
    assert order[0] == "a" and kind == "prefix"
    import pytest

    from radixkv.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):          # refused before it is routed
        backend.document_hashes(prompt, [(12, 18), (4, 12)], None)


def test_fleet_handle_fails_over_only_what_the_client_has_not_seen() -> None:
    """A replica dying mid-request: a non-streamed request (restartable) is sent again and
    completes; a stream that already delivered output ends with a 503 replica_failed."""
    import asyncio

    import pytest

    pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError

    from radixkv.fleet.ingress import FleetBackend, _FleetHandle
    from radixkv.server.errors import APIError

    class Gen:
        def __init__(self, items: list[Any]) -> None:
            self.items = items

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> Any:
            if not self.items:
                raise StopAsyncIteration
            item = self.items.pop(0)
            if isinstance(item, BaseException):
                raise item
            return item

    class Out:
        def __init__(self, n: int, finished: bool) -> None:
            self.n, self.finished = n, finished

    class Handle:
        """First call: one output, then the replica dies; later calls: a whole answer."""

        def __init__(self) -> None:
            self.calls = 0

        def options(self, **_: Any) -> Any:
            return self

        @property
        def generate(self) -> Any:
            return self

        def remote(self, *args: Any, **kw: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                return Gen([Out(1, False), ActorDiedError()])
            return Gen([Out(1, False), Out(2, True)])

    backend = FleetBackend.__new__(FleetBackend)
    backend.failovers = 0
    backend.open_handles = weakref.WeakSet()

    async def collect(restartable: bool) -> list[Any]:
        backend.handle = Handle()
        h = _FleetHandle(backend, ("r", [1, 2], None, None, None), {"hashes": []}, restartable)
        got = []
        while True:
            try:
                out = await asyncio.wait_for(h.aget(), 5)
            except APIError as exc:
                got.append(exc)
                return got
            got.append(out)
            if out.finished:
                return got

    got = asyncio.run(collect(restartable=True))
    assert [o.n for o in got] == [1, 1, 2] and got[-1].finished   # the rerun's outputs follow
    got = asyncio.run(collect(restartable=False))
    assert got[0].n == 1 and isinstance(got[-1], APIError) and got[-1].code == "replica_failed"
    assert backend.failovers == 2


def test_a_drain_lets_requests_finish_then_ends_the_rest_with_a_503() -> None:
    """The fleet's shutdown (``--shutdown-timeout``): the ingress refuses new requests with a
    503 at once, a request that finishes before the deadline finishes, and one still running
    then is ended: its replica's stream is cancelled (the replica aborts it) and its reader
    gets a 503 ``shutting_down`` (a stream's last event), so every admission slot comes back
    and the replicas are idle when Serve stops them."""
    import asyncio

    import pytest

    pytest.importorskip("ray")
    from radixkv.fleet.ingress import FleetBackend, _FleetHandle
    from radixkv.server import app as app_mod
    from radixkv.server.errors import APIError
    from radixkv.server.tenants import Tenants

    cancelled: list[int] = []

    class Out:
        def __init__(self, finished: bool) -> None:
            self.finished = finished

    class Replica:
        """A replica's stream of ``count`` outputs, one every 50 ms."""

        def __init__(self, count: int) -> None:
            self.count, self.sent = count, 0

        def __aiter__(self) -> Any:
            return self

        async def __anext__(self) -> Any:
            if self.sent == self.count:
                raise StopAsyncIteration
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancelled.append(self.count)
                raise
            self.sent += 1
            return Out(self.sent == self.count)

    class Handle:
        def options(self, **_: Any) -> Any:
            return self

        @property
        def generate(self) -> Any:
            return self

        def remote(self, rid: str, prompt: list[int], *args: Any, **kw: Any) -> Any:
            return Replica(prompt[0])   # the prompt says how long the answer is

    async def scenario() -> None:
        backend = FleetBackend.__new__(FleetBackend)
        backend.failovers, backend.handle = 0, Handle()
        backend.open_handles = weakref.WeakSet()
        backend.max_num_seqs = 4
        state = app_mod.ServerState("m", Tenants.create([], None), 4, None)
        state.engine = backend

        async def read(count: int) -> Any:
            state.acquire(1, "n")
            handle = _FleetHandle(backend, ("r", [count], None, None, None), {"hashes": []},
                                  False)
            try:
                while not (await handle.aget()).finished:
                    pass
                return "finished"
            except APIError as exc:
                return exc
            finally:
                state.release(1)

        short, long = asyncio.create_task(read(4)), asyncio.create_task(read(1000))
        await asyncio.sleep(0.01)
        drain = asyncio.create_task(state.drain(0.6))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as info:   # no new request once the drain began
            state.acquire(1, "n")
        assert (info.value.status, info.value.code) == (503, "shutting_down")
        assert await asyncio.wait_for(drain, 20) == {"finished_sequences": 1,
                                                     "aborted_requests": 1}
        assert await short == "finished"
        ended = await asyncio.wait_for(long, 10)
        assert isinstance(ended, APIError) and (ended.status, ended.code) == (503,
                                                                           "shutting_down")
        assert state.in_flight == 0 and cancelled == [1000]
        assert backend.abort_open(ended) == 0   # nothing left open

    asyncio.run(scenario())


def test_each_replica_gets_its_own_disk_tier_directory(tmp_path: Any) -> None:
    from radixkv.config import CacheConfig
    from radixkv.fleet.replica import replica_cache_config

    cc = CacheConfig(disk_dir=str(tmp_path), disk_blocks=8)
    a, b = replica_cache_config(cc, 0), replica_cache_config(cc, 1)
    assert a.disk_dir != b.disk_dir and a.disk_dir.startswith(str(tmp_path))
    assert replica_cache_config(cc, 0).disk_dir == a.disk_dir   # a replacement restores it
    assert a.disk_blocks == 8 and cc.disk_dir == str(tmp_path)
    plain = CacheConfig()
    assert replica_cache_config(plain, 3) is plain


def test_fleet_flags_that_cannot_work_are_refused_before_ray_starts(capsys: Any) -> None:
    import pytest

    pytest.importorskip("ray.serve")
    from radixkv.server.cli import main

    assert main(["--replicas", "2", "--port", "0"]) == 2
    assert "--port 0" in capsys.readouterr().err
    assert main(["--replicas", "0", "--port", "8999"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err


def test_serve_gives_a_stopping_replica_the_drain_and_the_flush() -> None:
    """A replica Serve stops by itself (a scale-down, an update) gets ``--shutdown-timeout``
    for its requests plus the remote flush's bound plus slack before Serve kills it."""
    import pytest

    pytest.importorskip("ray.serve")
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.fleet.deploy import build_app

    for drain, flush in ((0.0, None), (120.0, 5.0), (30.0, 0.0)):
        cc = CacheConfig() if flush is None else CacheConfig(remote_shutdown_flush_s=flush)
        app = build_app(replicas=2, cache_config=cc, engine_config=EngineConfig(),
                        shutdown_timeout_s=drain)
        engines = app._bound_deployment.init_args[0]._bound_deployment   # ingress(engines)
        assert engines.name == "RadixkvEngine"
        want = drain + 5.0 + (cc.remote_shutdown_flush_s or 0.0)
        assert engines._deployment_config.graceful_shutdown_timeout_s == want


def test_blocks_installed_in_a_lower_tier_are_announced() -> None:
    """A block fetched from the remote tier (or restored from disk) into a lower tier is in the
    replica's cache: the router must hear of it like of a computed block."""
    from radixkv.core.block_manager import BlockManager
    from radixkv.core.hashing import Namespace, hash_token_blocks, token_bytes

    bm = BlockManager.create(8, 4, lower_tier_blocks=[8])
    rec = EventRecorder(bm.tree)
    ns = Namespace("m")
    ids = list(range(8))
    h = hash_token_blocks(ids, 4, ns)
    bm.install_lower(None, h[0], token_bytes(ids[:4]), 1)
    bm.install_lower(h[0], h[1], token_bytes(ids[4:]), 1)
    assert rec.drain() == ([h[0], h[1]], [])


class InFlightMachine(RuleBasedStateMachine):
    """The router's in-flight ledger == a naive list of live requests: a choice counts until its
    deadline unless Serve confirms it sent; a confirmed request counts until its completion on
    that replica; a completion elsewhere (a rejected attempt's late report) or of an unknown id
    changes nothing; a removed replica loads nothing."""

    def __init__(self) -> None:
        super().__init__()
        if InFlight is None:
            import os

            import pytest

            assert not os.environ.get("CI"), "ray[serve] missing in CI: scripts/dev.sh installs it"
            pytest.skip("ray[serve] not installed")
        self.ledger = InFlight(ttl=5.0)
        self.model: dict[str, tuple[str, float | None]] = {}
        self.now = 0.0

    reqs = st.sampled_from([f"q{i}" for i in range(6)])
    reps = st.sampled_from(REPLICAS)

    @rule(req=reqs, rep=reps)
    def choose(self, req: str, rep: str) -> None:
        self.ledger.chosen(req, rep, self.now)
        self.model[req] = (rep, self.now + 5.0)

    @rule(req=reqs, rep=reps)
    def sent(self, req: str, rep: str) -> None:
        self.ledger.sent(req, rep)
        self.model[req] = (rep, None)

    @rule(req=reqs, rep=reps)
    def done(self, req: str, rep: str) -> None:
        self.ledger.done(req, rep)
        if req in self.model and self.model[req][0] == rep:
            del self.model[req]

    @rule(dt=st.sampled_from([0.5, 2.0, 5.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        gone = self.ledger.expire(self.now)
        want = {r for r, (_, d) in self.model.items() if d is not None and d <= self.now}
        assert set(gone) == want
        for r in want:
            del self.model[r]

    @rule(rep=reps)
    def forget(self, rep: str) -> None:
        self.ledger.forget(rep)
        self.model = {r: v for r, v in self.model.items() if v[0] != rep}

    @invariant()
    def loads_match(self) -> None:
        for rep in REPLICAS:
            assert self.ledger.load(rep) == sum(v[0] == rep for v in self.model.values())
        assert len(self.ledger) == len(self.model)


TestInFlight = InFlightMachine.TestCase


def test_the_bus_carries_a_reset_epoch_to_every_replica_and_collects_their_answers() -> None:
    """``/reset_prefix_cache`` under a fleet: the ingress raises the epoch and learns which
    replicas to wait for (those that report stats); each sees the epoch in its next publish
    answer and reports what it dropped; a replica that left is not waited for."""
    import asyncio

    from radixkv.fleet.events import KVEventBus

    async def run() -> None:
        bus = KVEventBus()
        assert (await bus.publish("a", [b"x"], [], True, {"n": 1}))[1] == 0
        await bus.publish("b", [], [], True, {"n": 2})
        epoch, expected = await bus.request_reset()
        assert (epoch, expected) == (1, ["a", "b"])
        assert (await bus.publish("a", [], [b"x"]))[1] == 1   # a sees it, answers
        await bus.reset_done("a", 1, 7)
        assert await bus.reset_report(1) == {"a": 7}
        await bus.remove("b")                                   # b left the fleet
        epoch2, expected2 = await bus.request_reset()
        assert (epoch2, expected2) == (2, ["a"])
        assert await bus.reset_report(2) == {}                  # a's answer was for epoch 1
        await bus.reset_done("a", 2, 0)
        assert await bus.reset_report(2) == {"a": 0} and await bus.reset_report(1) == {"a": 0}

    asyncio.run(run())
