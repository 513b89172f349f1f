"""Asynchronous promotions in the scheduler, over a real two-tier BlockManager and a fake mover
whose promotions stay in flight until the test lets them land (or fail).

Pinned here: a request whose blocks are loading keeps its blocks and its place but computes
nothing, while other requests compute; a request that matched a freshly promoted block waits
too; no scheduled chunk ever touches a block in flight; a failed load sends every holder back
to the head of the queue in order and invalidates the node; a step with nothing else to do
waits for the loads instead of returning empty; an aborted loading request waits for its loads
before its blocks are freed.
"""

from __future__ import annotations

from radixkv.core.block_manager import BlockManager, CopyOp
from radixkv.core.hashing import Namespace, token_bytes
from radixkv.core.tree import DEVICE
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, RequestStatus, Sequence

NS = Namespace("toy")
BS = 4
_ids = iter(range(10**6))


class FakeMover:
    """Runs the scheduler's KV ops: promotions into the device stay in flight until
    ``land()``/``wait()``; hashes in ``fail`` fail when they land."""

    def __init__(self) -> None:
        self.flight: dict[bytes, int] = {}   # block hash -> device block being written
        self.fail: set[bytes] = set()
        self.landed: list[bytes] = []
        self.failed: list[bytes] = []        # failures not yet handed to the scheduler
        self.waits = 0

    def run_ops(self, ops) -> list[bytes]:
        for op in ops:
            if isinstance(op, CopyOp):
                assert op.src not in self.flight.values() and op.dst not in self.flight.values()
                continue
            if op.dst_tier == DEVICE and op.src_tier != DEVICE:
                self.flight[op.block_hash] = op.dst_block_id
            else:
                assert op.src_tier != DEVICE or op.src_block_id not in self.flight.values()
        return []

    def land(self, hashes=None) -> list[bytes]:
        failed = []
        for h in list(self.flight if hashes is None else hashes):
            del self.flight[h]
            self.landed.append(h)
            if h in self.fail:
                failed.append(h)
        self.failed += failed
        return failed

    # the scheduler's Loads protocol
    def _take(self) -> list[bytes]:
        out, self.failed = self.failed, []
        return out

    def poll(self) -> list[bytes]:
        return self._take()   # nothing lands by itself: the test decides

    def wait(self) -> list[bytes]:
        self.waits += 1
        self.land()
        return self._take()

    def inflight(self) -> frozenset[int]:
        return frozenset(self.flight.values())


def _req(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), NS)
    r.seqs.append(Sequence(next(_ids), 0, list(prompt), len(prompt), IncrementalDetokenizer(None)))
    return r


def _prompt(base: int, n: int = 17) -> list[int]:
    return [(base * 7 + i) % 97 + 1 for i in range(n)]


def _setup(device=8, host=32, max_seqs=8, max_tokens=64):
    bm = BlockManager.create(device, BS, lower_tier_blocks=[host])
    mover = FakeMover()
    return Scheduler(bm, max_seqs, max_tokens, run_ops=mover.run_ops, loads=mover), mover


def _step(s: Scheduler, mover: FakeMover):
    """Schedule, check no chunk touches a block in flight, 'compute' (commit + token 7)."""
    out = s.schedule()
    busy = mover.inflight()
    for c in out.chunks:
        assert busy.isdisjoint(s.bm.block_table(c.seq.seq_id)), f"{c.request} reads a load"
        s.bm.commit(c.seq.seq_id, c.start + c.num_tokens)
        if c.wants_logits:
            c.seq.token_ids.append(7)
    for req in list(s.running):
        for seq in list(req.seqs):
            if seq.num_output_tokens >= req.params.max_tokens:
                s.free_seq(req, seq)
        if not req.seqs:
            s.remove(req)
    s.bm.check_invariants()
    return out


def _run(s, mover, reqs):
    for r in reqs:
        s.add(r)
    while s.has_unfinished():
        _step(s, mover)
        mover.land()


def _host_resident_prompt(s, mover) -> list[int]:
    """A prompt whose 4 full blocks end up in the host tier (evicted by later requests)."""
    p = _prompt(1)
    _run(s, mover, [_req("warm", p, max_tokens=1)])
    _run(s, mover, [_req(f"evict{i}", _prompt(10 + i), max_tokens=1) for i in range(3)])
    tree = s.bm.tree
    nodes = tree.match_tokens(token_bytes(p), NS.seed)
    assert len(nodes) == 4 and all(n.tier == 1 for n in nodes)
    return p


def _hit_loading_beside_busy():
    """A request "busy" decodes while "hit" (whose prefix sits in the host tier) was admitted
    and is loading; returns (scheduler, mover, hit's prompt, hit)."""
    s, mover = _setup()
    p = _host_resident_prompt(s, mover)
    s.add(_req("busy", _prompt(50, 5), max_tokens=10))
    _step(s, mover)
    hit = _req("hit", p)
    s.add(hit)
    _step(s, mover)
    return s, mover, p, hit


def _chunks(out):
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_loading_request_waits_while_others_compute():
    s, mover = _setup()
    p = _host_resident_prompt(s, mover)
    s.add(_req("busy", _prompt(50, 5), max_tokens=10))
    _step(s, mover)                                   # "busy" prefills
    s.add(_req("hit", p, max_tokens=2))
    out = _step(s, mover)
    assert _chunks(out) == [("busy", 5, 1)]           # "hit" is admitted but loading
    assert s.loading == {"hit"} and len(mover.flight) == 4
    assert s.counters.cached_tokens_per_tier[1] == 16
    out = _step(s, mover)                             # still in flight: still waiting
    assert _chunks(out) == [("busy", 6, 1)] and s.loading == {"hit"}
    mover.land()
    out = _step(s, mover)                             # landed: computes only its suffix
    assert _chunks(out) == [("busy", 7, 1), ("hit", 16, 1)] and not s.loading
    assert mover.waits == 0 and s.counters.loading_steps == 2


def test_a_request_matching_a_block_in_flight_waits_too():
    s, mover = _setup()
    p = _host_resident_prompt(s, mover)
    s.add(_req("busy", _prompt(50, 5), max_tokens=10))
    _step(s, mover)
    s.add(_req("a", p + [3, 3]))
    s.add(_req("b", p + [4, 4, 4]))    # matches a's promoted blocks (device hits, no moves)
    out = _step(s, mover)
    assert _chunks(out) == [("busy", 5, 1)] and s.loading == {"a", "b"}
    mover.land()
    out = _step(s, mover)
    assert _chunks(out) == [("busy", 6, 1), ("a", 16, 3), ("b", 16, 4)]


def test_failed_load_sends_every_holder_back_in_order_and_invalidates():
    s, mover = _setup()
    p = _host_resident_prompt(s, mover)
    s.add(_req("busy", _prompt(50, 5), max_tokens=10))
    _step(s, mover)
    a, b = _req("a", p + [3, 3]), _req("b", p + [4, 4, 4])
    s.add(a)
    s.add(b)
    _step(s, mover)
    tree = s.bm.tree
    nodes = tree.match_tokens(token_bytes(p), NS.seed)

    hashes = [n.block_hash for n in nodes]
    bad = hashes[2]
    old = [tree.get(h) for h in hashes]
    dropped = tree.stats.dropped
    mover.fail.add(bad)
    assert mover.land() == [bad]     # handed to the scheduler by the next step's poll
    out = _step(s, mover)
    # invalidated with everything after it (the step then recomputed and cached them again)
    assert tree.stats.dropped - dropped == len(hashes) - 2
    assert tree.get(hashes[1]) == old[1]
    # both sent back in their order; a is re-admitted and recomputes from the bad block
    # (8 cached tokens), b waits at the head of the queue (the pool holds 8 blocks)
    assert _chunks(out) == [("busy", 6, 1), ("a", 8, 11)] and s.waiting[0] is b
    assert s.counters.load_failures == 1 and s.counters.load_retries == 2
    # first admission counted the host hits once; the retry kept the first tiers
    assert a.num_cached_tokens == 8 and a.cached_tokens_per_tier == (0, 8)
    # b's first admission was taken back: only a's retry counts (b counts when re-admitted)
    assert s.counters.cached_prompt_tokens == 8 == s.counters.cached_tokens_per_tier[1]


def test_step_with_nothing_else_to_do_waits_for_the_loads():
    s, mover = _setup()
    p = _host_resident_prompt(s, mover)
    s.add(_req("hit", p, max_tokens=1))
    out = _step(s, mover)
    assert _chunks(out) == [("hit", 16, 1)] and mover.waits == 1
    assert s.counters.load_waits == 1 and not s.loading


def test_aborting_a_loading_request_waits_for_its_loads_then_frees():
    s, mover, p, hit = _hit_loading_beside_busy()
    assert s.loading == {"hit"} and mover.flight
    free_before = s.bm.num_free_blocks
    s.remove(hit)
    assert not mover.flight and mover.waits == 1 and not s.loading
    assert hit.status is RequestStatus.FINISHED
    # the 4 loaded blocks stay cached (unreferenced); only the private tail block is freed
    assert s.bm.num_free_blocks == free_before + 1
    assert s.bm.tree.num_evictable(DEVICE) >= 4
    s.bm.check_invariants()


def test_failure_seen_while_aborting_is_recovered_before_any_allocation():
    s, mover, p, hit = _hit_loading_beside_busy()
    hashes = s.bm.tree.match_hashes(token_bytes(p), NS.seed)
    mover.fail.add(hashes[0])
    s.remove(hit)                 # waits: the failure is filed, the block is unreferenced
    s.add(_req("again", p))
    out = _step(s, mover)         # recovered first: "again" must not match the bad block
    assert ("again", 0, 17) in _chunks(out)
    assert s.bm.tree.get(hashes[0]) is not None     # recomputed and cached again
    assert s.counters.load_failures == 1


def test_synchronous_scheduler_is_unchanged_without_loads():
    bm = BlockManager.create(8, BS, lower_tier_blocks=[32])
    mover = FakeMover()
    s = Scheduler(bm, 8, 64, run_ops=lambda ops: (mover.run_ops(ops), mover.land())[1])
    p = _prompt(1)
    for i, q in enumerate([p, _prompt(10), _prompt(11), _prompt(12)]):
        s.add(_req(f"r{i}", q, max_tokens=1))
        while s.has_unfinished():
            out = s.schedule()
            for c in out.chunks:
                bm.commit(c.seq.seq_id, c.start + c.num_tokens)
                c.seq.token_ids.append(7)
            for req in list(s.running):
                s.remove(req)
    s.add(_req("hit", p, max_tokens=1))
    out = s.schedule()
    assert _chunks(out) == [("hit", 16, 1)] and not s.loading   # loaded inside schedule()
