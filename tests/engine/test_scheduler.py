"""The scheduler alone, over a real BlockManager and no model: a fake "forward" commits the
scheduled tokens and appends a made-up next token, so the order of admission, chunking,
preemption and resumption can be pinned exactly (vLLM-style scenario tests)."""

from __future__ import annotations

import sys

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, RequestStatus, Sequence
from radixkv.engine.detokenizer import IncrementalDetokenizer

NS = Namespace("toy")
_ids = iter(range(10**6))


def _req(rid: str, prompt_len: int, max_tokens: int = 100, base: int = 0) -> Request:
    prompt = [(base + i) % 50 + 1 for i in range(prompt_len)]
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), NS)
    r.seqs.append(Sequence(next(_ids), 0, list(prompt), prompt_len, IncrementalDetokenizer(None)))
    return r


def _sched(num_blocks=16, block_size=4, max_seqs=8, max_tokens=64) -> Scheduler:
    return Scheduler(BlockManager.create(num_blocks, block_size), max_seqs, max_tokens)


def _fake_step(s: Scheduler) -> list:
    """Schedule, 'compute' (commit), and append token 7 to every sequence that got logits."""
    out = s.schedule()
    for c in out.chunks:
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


def test_scheduler_imports_no_torch():
    import subprocess  # a fresh interpreter: other tests load torch into this one
    code = "import sys, radixkv.engine.scheduler; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_fcfs_admission_and_batched_decode():
    s = _sched()
    for rid, n in (("a", 5), ("b", 6), ("c", 3)):
        s.add(_req(rid, n, max_tokens=3, base=ord(rid)))
    out = _fake_step(s)
    assert [(c.request.request_id, c.start, c.num_tokens, c.wants_logits) for c in out.chunks] == [
        ("a", 0, 5, True), ("b", 0, 6, True), ("c", 0, 3, True)]
    out = _fake_step(s)   # one decode token per sequence, in admission order
    assert ([(c.request.request_id, c.num_tokens) for c in out.chunks]
            == [("a", 1), ("b", 1), ("c", 1)])
    _fake_step(s)
    assert not s.has_unfinished()


def test_prefix_hit_prefills_only_the_suffix():
    s = _sched()
    s.add(_req("a", 10, max_tokens=1))
    _fake_step(s)
    s.add(_req("b", 10, max_tokens=1))
    out = _fake_step(s)
    [c] = out.chunks
    # (10 - 1) // 4 = 2 cached blocks, and a's partial last block (its rows 8, 9), kept as a
    # tail: b takes row 8 (its last prompt token is computed for the logits)
    assert (c.start, c.num_tokens) == (9, 1)
    assert s.running == [] and s.counters.cached_prompt_tokens == 9


def test_prefix_hit_without_tails_prefills_from_the_block_boundary():
    s = Scheduler(BlockManager.create(16, 4, tail_blocks=0), 8, 64)
    s.add(_req("a", 10, max_tokens=1))
    _fake_step(s)
    s.add(_req("b", 10, max_tokens=1))
    [c] = _fake_step(s).chunks
    assert (c.start, c.num_tokens) == (8, 2)          # whole blocks only
    assert s.counters.cached_prompt_tokens == 8


def test_chunked_prefill_respects_budget_and_withholds_logits():
    s = _sched(max_seqs=2, max_tokens=4)
    s.add(_req("a", 10, max_tokens=2))
    got = []
    for _ in range(4):
        out = _fake_step(s)
        got.append([(c.start, c.num_tokens, c.wants_logits) for c in out.chunks])
    # Budget 4: [0,4) [4,8) then the last 2 tokens together (logits), then one decode token.
    assert got == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)], [(10, 1, True)]]


def test_preemption_takes_newest_puts_it_first_and_resumes_from_cache():
    s = _sched(num_blocks=6, block_size=4)
    a, b = _req("a", 8, max_tokens=8), _req("b", 8, max_tokens=8, base=20)
    s.add(a)
    s.add(b)
    preempted_at = None
    for step in range(30):
        out = _fake_step(s)
        if out.preempted and preempted_at is None:
            preempted_at = step
            assert out.preempted == [b]              # newest running request
            assert s.waiting[0] is b and b.status is RequestStatus.WAITING
            assert [c.request for c in out.chunks] == [a]   # no admission in a preempting step
        if not s.has_unfinished():
            break
    assert preempted_at is not None and b.num_preemptions >= 1
    assert a.seqs == [] and b.seqs == [] and s.counters.recomputed_tokens > 0
    assert not s.has_unfinished()


def test_head_of_queue_is_not_overtaken():
    s = _sched(num_blocks=5, block_size=4)
    s.add(_req("a", 12, max_tokens=4))
    s.add(_req("big", 16, max_tokens=1, base=9))     # needs 4 blocks: waits for a
    s.add(_req("small", 2, max_tokens=1, base=30))   # would fit now, must not overtake
    out = _fake_step(s)
    assert [c.request.request_id for c in out.chunks] == ["a"]
    order = []
    while s.has_unfinished():
        for c in _fake_step(s).chunks:
            if c.request.request_id not in order:
                order.append(c.request.request_id)
    assert order == ["a", "big", "small"]


def test_max_num_seqs_counts_future_samples():
    s = _sched(max_seqs=4)
    r = _req("n3", 4)
    r.params = SamplingParams(max_tokens=4, n=3, temperature=1.0)
    s.add(r)
    s.add(_req("x", 4, base=5))
    s.add(_req("y", 4, base=9))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["n3", "x"]   # 3 + 1 slots


def test_request_too_big_for_the_pool_is_unschedulable():
    s = _sched(num_blocks=2, block_size=4)
    r = _req("a", 4)
    r.seqs[0].token_ids += [1] * 6                  # 10 tokens > 8 slots, as after a preemption
    s.add(r)
    out = s.schedule()
    assert out.unschedulable == [r] and not s.has_unfinished()


# ----------------------------------------------------------------------------- prefill priority

def _chunks(out) -> list[tuple[str, int]]:
    return [(c.request.request_id, c.num_tokens) for c in out.chunks]


def test_prefill_priority_leaves_the_decodes_out_of_an_admission_step_at_most_n_in_a_row():
    """prefill_priority_steps=2: a step that admits a new request computes its prefill alone
    (the decodes keep their reserved slot and run next step); after two such steps in a row
    the third admission step carries the decodes; a step without admissions always does."""
    s = Scheduler(BlockManager.create(64, 4), 8, 64, prefill_priority_steps=2)
    s.add(_req("a", 5, base=1))
    s.add(_req("b", 6, base=2))
    assert _chunks(_fake_step(s)) == [("a", 5), ("b", 6)]
    assert _chunks(_fake_step(s)) == [("a", 1), ("b", 1)]
    s.add(_req("c", 3, base=3))
    assert _chunks(_fake_step(s)) == [("c", 3)]                  # a, b wait
    s.add(_req("d", 4, base=4))
    assert _chunks(_fake_step(s)) == [("d", 4)]                  # c is decoding now: waits too
    s.add(_req("e", 2, base=5))
    assert _chunks(_fake_step(s)) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 2)]
    s.add(_req("f", 3, base=6))
    assert _chunks(_fake_step(s)) == [("f", 3)]                  # the count started again
    assert _chunks(_fake_step(s)) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1),
                                      ("f", 1)]
    # a: its prefill's token and one per step that carried it; none lost or doubled
    tokens = {r.request_id: r.seqs[0].num_output_tokens for r in s.running}
    assert tokens == {"a": 4, "b": 4, "c": 3, "d": 3, "e": 2, "f": 2}


def test_prefill_priority_runs_the_decodes_when_nothing_can_be_admitted():
    """A waiting request that does not fit (max_num_seqs, or the pool) gives no chunk: the
    decodes run in that same step, not a step later."""
    s = Scheduler(BlockManager.create(64, 4), 2, 64, prefill_priority_steps=4)
    s.add(_req("a", 5, base=1))
    s.add(_req("b", 6, base=2))
    _fake_step(s)
    s.add(_req("c", 3, base=3))                                 # over max_num_seqs = 2
    assert _chunks(_fake_step(s)) == [("a", 1), ("b", 1)]
    assert [r.request_id for r in s.waiting] == ["c"]
    # a pool too small for the waiting request: the decodes still run
    s = Scheduler(BlockManager.create(6, 4), 8, 64, prefill_priority_steps=4)
    s.add(_req("a", 8, base=1))
    _fake_step(s)
    s.add(_req("big", 17, base=9))                              # 5 blocks; 4 left
    assert _chunks(_fake_step(s)) == [("a", 1)]


def test_long_prefill_threshold_caps_a_prompt_only_while_others_run_or_wait():
    """vLLM's long_prefill_token_threshold: with another request in the engine a prompt
    computes at most N tokens a step (chunks without logits until its last), and the budget it
    leaves goes to the others; alone it is not cut; decodes are never cut."""
    s = Scheduler(BlockManager.create(64, 4), 8, 64, long_prefill_token_threshold=8)
    s.add(_req("long", 30, base=1))
    assert _chunks(_fake_step(s)) == [("long", 30)]          # alone: the whole prompt
    s = Scheduler(BlockManager.create(64, 4), 8, 64, long_prefill_token_threshold=8)
    s.add(_req("long", 30, base=1))
    s.add(_req("short", 5, base=2))
    out = _fake_step(s)
    assert _chunks(out) == [("long", 8), ("short", 5)]        # short is not held back
    assert [c.wants_logits for c in out.chunks] == [False, True]
    assert _chunks(_fake_step(s)) == [("long", 8), ("short", 1)]
    assert _chunks(_fake_step(s)) == [("long", 8), ("short", 1)]
    out = _fake_step(s)
    assert _chunks(out) == [("long", 6), ("short", 1)] and out.chunks[0].wants_logits
    assert _chunks(_fake_step(s)) == [("long", 1), ("short", 1)]
    # the same requests without the cap: the long prompt's step holds everything up
    s = Scheduler(BlockManager.create(64, 4), 8, 64)
    s.add(_req("long", 30, base=1))
    s.add(_req("short", 5, base=2))
    assert _chunks(_fake_step(s)) == [("long", 30), ("short", 5)]


def test_long_prefill_threshold_adaptive_is_at_least_the_fair_share():
    """With the adaptive flag the cap is max(N, budget // requests running and waiting)."""
    s = Scheduler(BlockManager.create(64, 4), 8, 64, long_prefill_token_threshold=4,
                  long_prefill_adaptive=True)
    s.add(_req("a", 40, base=1))
    s.add(_req("b", 40, base=2))
    assert _chunks(_fake_step(s)) == [("a", 32), ("b", 32)]   # 64 // 2 > 4
    s = Scheduler(BlockManager.create(64, 4), 8, 64, long_prefill_token_threshold=4)
    s.add(_req("a", 40, base=1))
    s.add(_req("b", 40, base=2))
    assert _chunks(_fake_step(s)) == [("a", 4), ("b", 4)]


def test_long_prefill_threshold_never_stalls_a_group_decode():
    """A cap below a group's sequence count (n samples decode one token each, together) still
    lets the group decode whole: it would never get its logits otherwise."""
    s = Scheduler(BlockManager.create(64, 4), 8, 64, long_prefill_token_threshold=1)
    r = _req("g", 6, base=1)
    seq0 = r.seqs[0]
    r.seqs.append(Sequence(next(_ids), 1, list(seq0.token_ids), 6, IncrementalDetokenizer(None)))
    s.add(r)
    s.add(_req("other", 3, base=2))
    for _ in range(12):
        _fake_step(s)
    assert all(q.num_output_tokens >= 2 for q in r.seqs)


def test_prefill_priority_off_mixes_every_decode_into_every_step():
    s = Scheduler(BlockManager.create(64, 4), 8, 64, prefill_priority_steps=0)
    s.add(_req("a", 5, base=1))
    _fake_step(s)
    s.add(_req("b", 3, base=2))
    assert _chunks(_fake_step(s)) == [("a", 1), ("b", 3)]
