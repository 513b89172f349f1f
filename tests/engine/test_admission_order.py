"""Admission order (issue 32, item 4): longest cached prefix first, groups over an uncached
prefix led by one request, and an age limit so that nothing starves; and vLLM's priority
scheduling (issue 33): waiting requests by ``(priority, arrival)``, the least urgent running
request preempted first.

The ordering is tested alone (``LongestPrefixFirst.order`` over a real tree), inside the real
scheduler over a real block manager with the fake forward of ``test_scheduler.py`` (a step
clock stands in for seconds: a request's ``arrival_time`` is the step it arrived at), and in the
engine on a tiny random model (prefill tokens computed, outputs equal to FCFS's).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from hypothesis.stateful import initialize, rule

from radixkv.config import CacheConfig, EngineConfig
from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.engine.admission_order import (
    FCFSOrder,
    LongestPrefixFirst,
    PriorityOrder,
    make_admission_order,
)
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, Sequence
from radixkv.errors import ConfigError, InvalidRequestError

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "core"))
import test_scheduler_manager_state as sm
from engine_helpers import run_requests

NS = Namespace("lpm")
BS = 4


class Clock:
    """A settable clock (steps or seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


_SEQ_IDS = iter(range(10**6))        # sequence ids of requests
_CACHE_IDS = iter(range(10**6, 2 * 10**6))   # sequence ids that only fill the cache


def _req(rid: str, tokens: list[int], t: float = 0.0, max_tokens: int = 1, ns=NS) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=max_tokens), ns, arrival_time=t)
    r.seqs.append(Sequence(next(_SEQ_IDS), 0, list(tokens), len(tokens),
                           IncrementalDetokenizer(None)))
    return r


def _cache(bm: BlockManager, tokens: list[int], ns=NS) -> None:
    """Put ``tokens``' full blocks in the cache (what a finished request leaves behind)."""
    sid = next(_CACHE_IDS)
    bm.allocate(sid, tokens, ns)
    bm.commit(sid, len(tokens))
    bm.free(sid)


def _doc(base: int, n_blocks: int) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def _ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# ----------------------------------------------------------------------------- the order alone

def test_longest_cached_prefix_first_ties_in_arrival_order():
    bm = BlockManager.create(64, BS)
    a, b = _doc(100, 3), _doc(200, 1)
    _cache(bm, a + [1])
    _cache(bm, b + [1])
    lpm = LongestPrefixFirst(bm, window=8, max_wait_s=100.0, clock=Clock())
    waiting = [_req("cold", _doc(300, 2) + [5], 0.0), _req("b", b + [7, 8], 1.0),
               _req("a", a + [9], 2.0), _req("cold2", _doc(400, 2) + [5], 3.0),
               _req("b2", b + [6], 4.0)]
    assert _ids(lpm.order(waiting)) == ["a", "b", "b2", "cold", "cold2"]
    assert lpm.matches == 5


def test_match_stops_where_allocate_would():
    """A prompt that is exactly its cached blocks matches one block less (the block of its
    last token is private), as allocate() does: no overstated priority."""
    bm = BlockManager.create(64, BS)
    a = _doc(100, 2)
    _cache(bm, a + [1])
    lpm = LongestPrefixFirst(bm, window=8, max_wait_s=100.0, clock=Clock())
    exact, longer = _req("exact", list(a), 0.0), _req("longer", a + [3], 1.0)
    assert _ids(lpm.order([exact, longer])) == ["longer", "exact"]


def test_group_leader_first_followers_right_behind():
    """Three requests over an uncached document form a group: its leader (the oldest) goes
    before an unrelated cold request (same cached length, bigger group), its followers right
    behind it; a request with a cached prefix goes first."""
    bm = BlockManager.create(64, BS)
    hot = _doc(100, 2)
    _cache(bm, hot + [1])
    doc = _doc(500, 3)
    lpm = LongestPrefixFirst(bm, window=8, max_wait_s=100.0, clock=Clock())
    waiting = [_req("u", _doc(900, 3) + [1], 0.0), _req("g1", doc + [1, 2], 1.0),
               _req("x", _doc(700, 1) + [4], 2.0), _req("g2", doc + [3], 3.0),
               _req("h", hot + [5], 4.0), _req("g3", doc + [4, 4, 4], 5.0)]
    assert _ids(lpm.order(waiting)) == ["h", "g1", "g2", "g3", "u", "x"]


def test_groups_are_per_namespace():
    bm = BlockManager.create(64, BS)
    doc = _doc(500, 3)
    other = Namespace("lpm", cache_salt="tenant-2")
    lpm = LongestPrefixFirst(bm, window=8, max_wait_s=100.0, clock=Clock())
    waiting = [_req("u", _doc(900, 3) + [1], 0.0), _req("t1", doc + [1], 1.0, ns=other),
               _req("a1", doc + [1], 2.0), _req("a2", doc + [2], 3.0)]
    # t1 shares tokens with a1/a2 but not their namespace: it is a group of one
    assert _ids(lpm.order(waiting)) == ["a1", "a2", "u", "t1"]


def test_over_age_requests_go_first_in_arrival_order():
    bm = BlockManager.create(64, BS)
    hot = _doc(100, 3)
    _cache(bm, hot + [1])
    clock = Clock()
    lpm = LongestPrefixFirst(bm, window=8, max_wait_s=10.0, clock=clock)
    waiting = [_req("h1", hot + [2], 5.0), _req("old2", _doc(300, 1) + [1], 1.0),
               _req("old1", _doc(400, 1) + [1], 0.0), _req("new", _doc(600, 2) + [1], 6.0)]
    clock.now = 11.0          # old1 and old2 waited >= 10 s
    assert _ids(lpm.order(waiting)) == ["old1", "old2", "h1", "new"]
    assert lpm.over_age == 2
    clock.now = 9.0           # nobody is over age
    assert _ids(lpm.order(waiting)) == ["h1", "old1", "old2", "new"]


def test_window_bounds_matching_and_the_memo_follows_the_tree():
    bm = BlockManager.create(64, BS)
    hot = _doc(100, 2)
    lpm = LongestPrefixFirst(bm, window=2, max_wait_s=100.0, clock=Clock())
    waiting = [_req(f"c{i}", _doc(1000 + 100 * i, 2) + [1], float(i)) for i in range(4)]
    waiting.append(_req("h", hot + [9], 9.0))
    assert _ids(lpm.order(waiting)) == ["c0", "c1", "c2", "c3", "h"]
    assert lpm.matches == 2                      # only the window's two are matched
    lpm.order(waiting)
    assert (lpm.matches, lpm.memo_hits) == (2, 2)   # the tree did not change: no tree read
    _cache(bm, _doc(1100, 2) + [1])              # c1's prefix enters the cache
    assert _ids(lpm.order(waiting)) == ["c1", "c0", "c2", "c3", "h"]
    assert lpm.matches == 4


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_order_is_a_permutation_with_over_age_first(data):
    bm = BlockManager.create(64, BS)
    docs = [_doc(100 * (i + 1), i % 3 + 1) for i in range(4)]
    for d in data.draw(st.lists(st.sampled_from(docs), max_size=3)):
        _cache(bm, d + [1])
    clock = Clock()
    clock.now = 20.0
    window = data.draw(st.integers(1, 6))
    lpm = LongestPrefixFirst(bm, window=window, max_wait_s=10.0, clock=clock)
    n = data.draw(st.integers(0, 12))
    waiting = [_req(f"r{i}", data.draw(st.sampled_from(docs + [[]])) + [i + 1] * data.draw(
        st.integers(1, 6)), float(data.draw(st.integers(0, 20)))) for i in range(n)]
    got = lpm.order(waiting)
    assert sorted(_ids(got)) == sorted(_ids(waiting))
    over = [r for r in waiting if r.arrival_time <= 10.0]
    assert got[:len(over)] == sorted(over, key=lambda r: r.arrival_time)
    rest = sorted((r for r in waiting if r.arrival_time > 10.0), key=lambda r: r.arrival_time)
    assert got[len(over) + window:] == rest[window:]   # beyond the window: arrival order


def test_make_admission_order_and_config_validate():
    bm = BlockManager.create(8, BS)
    assert isinstance(make_admission_order("fcfs", bm), FCFSOrder)
    assert make_admission_order("lpm", bm, 4, 1.5).window == 4
    with pytest.raises(ConfigError, match="scheduling_policy"):
        make_admission_order("sjf", bm)
    with pytest.raises(ConfigError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="LPM")
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ConfigError, match="window"):
            EngineConfig(scheduling_window=bad)
    for bad in (-1.0, float("nan"), float("inf"), "3"):
        with pytest.raises(ConfigError, match="max_wait_s"):
            EngineConfig(scheduling_max_wait_s=bad)
    assert EngineConfig(scheduling_policy="lpm").scheduling_policy == "lpm"
    assert isinstance(make_admission_order("priority", bm), PriorityOrder)
    assert EngineConfig(scheduling_policy="priority").scheduling_policy == "priority"


def _prio(rid: str, priority: int, t: float, tokens: list[int] | None = None,
          max_tokens: int = 1) -> Request:
    r = _req(rid, tokens or [1, 2, 3], t, max_tokens)
    r.priority = priority
    return r


def test_priority_order_sorts_by_priority_then_arrival_and_is_stable():
    from collections import deque

    reqs = [_prio("a", 0, 3.0), _prio("b", -1, 5.0), _prio("c", 0, 1.0), _prio("d", 2, 0.0),
            _prio("e", -1, 5.0), _prio("f", 0, 3.0)]
    q = deque(reqs)
    PriorityOrder().reorder(q)
    assert _ids(q) == ["b", "e", "c", "a", "f", "d"]   # b before e, a before f: queue order
    q = deque(reqs[:1])
    PriorityOrder().reorder(q)
    assert _ids(q) == ["a"]


def test_priority_victim_is_the_least_urgent_and_ties_go_to_the_newest():
    o = PriorityOrder()
    running = [_prio("a", 0, 1.0), _prio("b", 5, 0.0), _prio("c", 0, 2.0), _prio("d", 5, 0.0)]
    assert o.victim(running) == 3          # (5, 0.0) twice: the later admitted goes first
    assert o.victim(running[:3]) == 1
    assert o.victim(running[:1]) == 0
    assert o.victim([_prio("x", -3, 9.0), _prio("y", -3, 1.0)]) == 0   # later arrival
    for other in (FCFSOrder(), LongestPrefixFirst(BlockManager.create(8, BS))):
        assert other.victim(running) == 3 and other.victim(running[:3]) == 2


def test_scheduler_under_priority_admits_the_urgent_first_and_preempts_the_least_urgent():
    """One sequence at a time: the queue is served by priority whatever the arrival order.
    Then a pool too small for three growing requests: the one with the highest priority value
    is preempted, not the most recently admitted (which FCFS would take)."""
    bm = BlockManager.create(64, BS)
    s = Scheduler(bm, 1, 64, admission=PriorityOrder())
    for r in (_prio("low", 5, 0.0), _prio("mid", 0, 1.0), _prio("high", -5, 2.0),
              _prio("mid2", 0, 0.5)):
        s.add(r)
    admitted: dict[str, int] = {}
    while s.has_unfinished():
        _step(s, admitted)
    assert sorted(admitted, key=admitted.get) == ["high", "mid2", "mid", "low"]

    def grow(policy):
        bm = BlockManager.create(6, BS)
        s = Scheduler(bm, 3, 64, admission=policy)
        s.add(_prio("urgent", -1, 0.0, [11, 12, 13], max_tokens=50))
        s.add(_prio("batch", 3, 1.0, [21, 22, 23], max_tokens=50))
        s.add(_prio("normal", 0, 2.0, [31, 32, 33], max_tokens=50))
        for _ in range(40):
            out = s.schedule()
            if out.preempted:
                return [r.request_id for r in out.preempted]
            for c in out.chunks:
                s.bm.commit(c.seq.seq_id, c.start + c.num_tokens)
                if c.wants_logits:
                    c.seq.token_ids.append(7)
        raise AssertionError("no preemption")

    assert grow(PriorityOrder()) == ["batch"]
    assert grow(FCFSOrder()) == ["normal"]


# ----------------------------------------------------------------------------- in the scheduler

def _lpm_sched(num_blocks: int, max_seqs: int, budget: int, max_wait_s: float,
               window: int = 32) -> Scheduler:
    """A scheduler whose lpm clock is its own step counter (arrival_time = arrival step)."""
    bm = BlockManager.create(num_blocks, BS)
    s = Scheduler(bm, max_seqs, budget)
    s.admission = LongestPrefixFirst(bm, window=window, max_wait_s=max_wait_s,
                                     clock=lambda: s.counters.steps)
    return s


def _step(s: Scheduler, admitted: dict[str, int]) -> None:
    """schedule, fake forward (commit, token 7), finish requests that reached max_tokens; record
    each request's admission step."""
    step = s.counters.steps + 1
    out = s.schedule()
    for c in out.chunks:
        admitted.setdefault(c.request.request_id, step)
        s.bm.commit(c.seq.seq_id, c.start + c.num_tokens)
        if c.wants_logits:
            c.seq.token_ids.append(7)
    for req in list(s.running):
        admitted.setdefault(req.request_id, step)   # (admitted, but loading or held: none here)
        for seq in list(req.seqs):
            if seq.num_output_tokens >= req.params.max_tokens:
                s.free_seq(req, seq)
        if not req.seqs:
            s.remove(req)
    s.bm.check_invariants()


def test_scheduler_admits_cached_first_and_holds_followers_for_their_leader():
    s = _lpm_sched(num_blocks=64, max_seqs=3, budget=256, max_wait_s=100.0)
    hot = _doc(100, 2)
    _cache(s.bm, hot + [1])
    doc = _doc(500, 3)
    reqs = [_req("u", _doc(900, 2) + [1]), _req("g1", doc + [1]), _req("g2", doc + [2]),
            _req("h", hot + [3])]
    for r in reqs:
        s.add(r)
    admitted: dict[str, int] = {}
    _step(s, admitted)
    # order h, g1, g2, u: g2 is held (g1 computes the document), u takes the third slot
    assert admitted == {"h": 1, "g1": 1, "u": 1} and s.counters.held_admissions == 1
    _step(s, admitted)
    assert admitted["g2"] == 2 and reqs[2].num_cached_tokens == len(doc)
    # h: 1 token past its 2 cached blocks; g1: 13; u: 9; g2: 1 past the document g1 committed
    assert s.counters.prefill_tokens == 1 + 13 + 9 + 1


def test_without_an_age_limit_lpm_starves_a_cold_request_and_with_one_it_does_not():
    """A stream of requests over a cached document, one per step, and one slot: lpm alone
    admits the stream and passes over the cold request until the stream ends; with an age
    limit of 3 steps the cold request is admitted at the first step it is over age."""
    for max_wait, expect in ((1e9, None), (3.0, 3)):
        s = _lpm_sched(num_blocks=64, max_seqs=1, budget=256, max_wait_s=max_wait)
        hot = _doc(100, 3)
        _cache(s.bm, hot + [1])
        admitted: dict[str, int] = {}
        s.add(_req("cold", _doc(900, 2) + [1], t=0.0))
        for step in range(1, 22):
            s.add(_req(f"hot{step}", hot + [step % 50 + 1], t=float(step - 1)))
            _step(s, admitted)
        assert admitted.get("cold") == expect


@st.composite
def _arrivals(draw):
    docs = [_doc(100 * (i + 1), i + 1) for i in range(3)]
    n = draw(st.integers(1, 30))
    steps = sorted(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)))
    out = []
    for i, t in enumerate(steps):
        prefix = draw(st.sampled_from(docs + [[]]))
        out.append((t, prefix + [i % 40 + 1] * draw(st.integers(1, 5))))
    return out


@given(arrivals=_arrivals(), max_seqs=st.integers(1, 4), max_wait=st.integers(0, 6),
       window=st.integers(1, 8), cached=st.lists(st.integers(0, 2), max_size=2))
@settings(max_examples=80, deadline=None)
def test_property_no_request_waits_past_the_age_limit_plus_the_older_backlog(
        arrivals, max_seqs, max_wait, window, cached):
    """Blocks and the token budget never bind, each request runs one step (max_tokens=1), so
    each step admits up to ``max_seqs`` requests. A request that arrived at step a is over age
    from step a + L on; from then only older over-age requests go before it (C per step), and
    a follower held for its leader waits one step more. So it is admitted by step
    ``a + L + floor(older / C) + 1``, ``older`` = the requests that arrived before it and
    were still waiting at step a + L."""
    s = _lpm_sched(num_blocks=512, max_seqs=max_seqs, budget=4096, max_wait_s=float(max_wait),
                   window=window)
    for i in cached:
        _cache(s.bm, _doc(100 * (i + 1), i + 1) + [99])
    reqs = [_req(f"r{i}", toks, t=float(t)) for i, (t, toks) in enumerate(arrivals)]
    admitted: dict[str, int] = {}
    pending = list(reqs)
    while pending or s.has_unfinished():
        step = s.counters.steps + 1
        while pending and pending[0].arrival_time <= step:
            s.add(pending.pop(0))
        _step(s, admitted)
        assert step < 500, "no progress"
    assert set(admitted) == {r.request_id for r in reqs}
    for r in reqs:
        a = int(r.arrival_time)
        due = max(a + max_wait, a, 1)   # over age and in the queue (added at step max(a, 1))
        older = sum(1 for q in reqs if q is not r and q.arrival_time <= a
                    and admitted[q.request_id] >= due)
        bound = due + older // max_seqs + 1
        assert admitted[r.request_id] <= bound, (r.request_id, a, admitted[r.request_id], bound)


class LPMSchedulerMachine(sm.SchedulerMachine):
    """The scheduler + block manager state machine (admit, step, preempt, abort, fork) with
    the lpm order: every conservation invariant holds while the queue is reordered."""

    @initialize(blocks=st.integers(4, 12), max_seqs=st.integers(1, 4),
                budget=st.integers(3, 16), policy=st.sampled_from(["lru", "lfu"]),
                window=st.integers(1, 4), max_wait=st.integers(0, 4),
                priority=st.sampled_from([0, 4]), long_prefill=st.sampled_from([0, 3]))
    def setup(self, blocks, max_seqs, budget, policy, window, max_wait, priority,
              long_prefill) -> None:
        sm.SchedulerMachine.setup(self, blocks, max_seqs, budget, policy, priority, long_prefill)
        s = self.s
        s.admission = LongestPrefixFirst(self.bm, window=window, max_wait_s=max_wait,
                                         clock=lambda: s.counters.steps)
        add = s.add

        def add_at_step(req: Request) -> None:
            req.arrival_time = float(s.counters.steps)
            add(req)

        s.add = add_at_step


TestLPMSchedulerManager = LPMSchedulerMachine.TestCase
TestLPMSchedulerManager.settings = settings(max_examples=40, stateful_step_count=30,
                                            deadline=None)


def _urgency(r: Request) -> tuple[int, float]:
    return r.priority, r.arrival_time


class PrioritySchedulerMachine(sm.SchedulerMachine):
    """The scheduler + block manager state machine under the ``priority`` order, requests with
    random priorities. Besides every conservation invariant, after each step:

    * each preempted request was, when it was preempted, the least urgent running one (no
      request left running, nor one preempted after it, has a higher ``(priority, arrival)``);
    * no request admitted in the step is less urgent than one left waiting, unless that one is
      held for a leader computing the prefix it shares (``Scheduler._held``).
    """

    @initialize(blocks=st.integers(4, 12), max_seqs=st.integers(1, 4),
                budget=st.integers(3, 16), policy=st.sampled_from(["lru", "lfu"]),
                priority=st.sampled_from([0, 4]), long_prefill=st.sampled_from([0, 3]))
    def setup(self, blocks, max_seqs, budget, policy, priority, long_prefill) -> None:
        sm.SchedulerMachine.setup(self, blocks, max_seqs, budget, policy, priority, long_prefill)
        s = self.s
        s.admission = PriorityOrder()
        plan = s.schedule

        def checked_schedule():
            before = set(map(id, s.running))
            out = plan()
            after = list(s.running)
            for i, v in enumerate(out.preempted):
                others = after + out.preempted[i + 1:]
                assert all(_urgency(r) <= _urgency(v) for r in others), (
                    f"preempted {v.request_id} {_urgency(v)} while "
                    f"{[(r.request_id, _urgency(r)) for r in others]} ran")
            admitted = [r for r in after if id(r) not in before]
            if admitted:
                assert not out.preempted
                worst = max(map(_urgency, admitted))
                for w in s.waiting:
                    assert _urgency(w) > worst or s._held(w), (
                        f"{w.request_id} {_urgency(w)} waits (not held) behind admitted "
                        f"{[(r.request_id, _urgency(r)) for r in admitted]}")
                if any(s._held(w) for w in s.waiting):
                    sm.STEPS.event(self.name, "urgent one held")
            return out

        s.schedule = checked_schedule

    @rule(prompt=sm.PROMPTS, max_tokens=st.integers(1, 6), priority=st.integers(-2, 2))
    def admit_urgent(self, prompt, max_tokens, priority) -> None:
        """A request with a priority joins the queue."""
        sm.SchedulerMachine.admit(self, prompt, max_tokens)
        self.s.waiting[-1].priority = priority   # (add appends it)


TestPrioritySchedulerManager = PrioritySchedulerMachine.TestCase
TestPrioritySchedulerManager.settings = settings(max_examples=40, stateful_step_count=30,
                                                 deadline=None)


# ----------------------------------------------------------------------------- in the engine

@pytest.fixture(scope="module")
def hf(make_tiny):
    return make_tiny("llama", num_layers=2)


def _engine(model, policy: str, num_blocks: int, budget: int = 2048, max_seqs: int = 32):
    return LLMEngine(copy.deepcopy(model), None,
                     CacheConfig(block_size=16, num_device_blocks=num_blocks),
                     EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                  scheduling_policy=policy), model_id="tiny")


def _rand(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def test_engine_lpm_burst_over_a_shared_document_computes_it_once(hf):
    """Two documents, each asked five questions in one burst, interleaved with unrelated
    prompts: each document's 12 full blocks are computed once, and every answer is the one
    FCFS gives."""
    d1, d2 = _rand(2, 200, seed=5)
    qs = _rand(10, 20, seed=6)
    other = _rand(4, 60, seed=7)
    batch = []
    for i in range(5):
        batch += [(f"a{i}", d1 + qs[i]), (f"b{i}", d2 + qs[5 + i])]
        if i < 4:
            batch.append((f"o{i}", other[i]))
    params = SamplingParams(max_tokens=4)
    lpm = _engine(hf, "lpm", 256)
    got = run_requests(lpm, [(rid, p, params) for rid, p in batch])
    st_ = lpm.stats()
    fresh = 2 * (len(d1) + 20) + 8 * (len(d1) + 20 - 192) + 4 * 60
    assert st_["prefill_tokens_computed"] == fresh
    assert sorted(o.num_cached_tokens for o in got.values()) == [0] * 6 + [192] * 8
    fcfs = run_requests(_engine(hf, "fcfs", 256), [(rid, p, params) for rid, p in batch])
    assert {k: v.outputs[0].token_ids for k, v in got.items()} == \
        {k: v.outputs[0].token_ids for k, v in fcfs.items()}


def test_engine_lpm_admits_a_cached_document_before_it_is_evicted(hf):
    """A small pool and one prefill per step: FCFS admits three cold prompts between two
    questions on one document, which evicts the document, so the second question computes it
    again; lpm admits the second question as soon as the first has committed the document."""
    doc = _rand(1, 200, seed=11)[0]
    q1, q2 = _rand(2, 20, seed=12)
    cold = _rand(3, 200, seed=13)
    batch = [("q1", doc + q1)] + [(f"c{i}", c) for i, c in enumerate(cold)] + [("q2", doc + q2)]
    params = SamplingParams(max_tokens=1)
    prefill = {}
    for policy in ("fcfs", "lpm"):
        eng = _engine(hf, policy, num_blocks=16, budget=256, max_seqs=1)
        out = run_requests(eng, [(rid, p, params) for rid, p in batch])
        prefill[policy] = (eng.stats()["prefill_tokens_computed"], out["q2"].num_cached_tokens)
    total = sum(len(p) for _, p in batch)
    assert prefill["fcfs"] == (total, 0)
    assert prefill["lpm"] == (total - 192, 192)


def test_engine_priority_serves_the_queue_by_priority_with_fcfs_tokens(hf):
    """One sequence at a time, five requests queued at once with priorities: they finish in
    ``(priority, arrival)`` order, with the tokens FCFS gives each."""
    prompts = _rand(5, 40, seed=21)
    prios = [3, -1, 0, -1, 7]
    params = SamplingParams(max_tokens=3)
    eng = _engine(hf, "priority", 64, max_seqs=1)
    for i, (p, prio) in enumerate(zip(prompts, prios)):
        eng.add_request(f"r{i}", p, params, arrival_time=float(i), priority=prio)
    order, final = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
                final[out.request_id] = out
    assert order == ["r1", "r3", "r2", "r0", "r4"]
    fcfs = run_requests(_engine(hf, "fcfs", 64), [(f"r{i}", p, params)
                                                 for i, p in enumerate(prompts)])
    assert {k: v.outputs[0].token_ids for k, v in final.items()} == \
        {k: v.outputs[0].token_ids for k, v in fcfs.items()}


def test_engine_priority_is_validated_before_anything_changes(hf):
    lpm, prio = _engine(hf, "lpm", 64), _engine(hf, "priority", 64)
    with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
        lpm.add_request("a", [1, 2, 3], None, priority=2)
    lpm.add_request("a", [1, 2, 3], {"max_tokens": 1}, priority=0)   # 0 is everyone's default
    for bad in (True, 1.0, "1", 2 ** 63, -(2 ** 63) - 1, None):
        with pytest.raises(InvalidRequestError, match="priority"):
            prio.add_request("b", [1, 2, 3], None, priority=bad)
    assert not prio.has_unfinished_requests() and not prio.has_request("b")
    prio.add_request("b", [1, 2, 3], {"max_tokens": 1}, priority=-(2 ** 63))
    assert prio.has_request("b")
