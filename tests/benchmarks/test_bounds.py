"""Bounds on tiny synthetic traces: hand-checked answers, orderings, Belady vs exhaustive search.

No dataset and no tokenizer: tokens are small integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hitrate_strategies import R, traces

from radixkv.benchmarks.bounds import (
    INF, chain_hashes, exhaustive_optimum, infinite, prepare, session_phantoms, simulate,
)


def rates(reqs, block_size, cap):
    bt = prepare(reqs, block_size)
    return (infinite(bt).hit_tokens, simulate(bt, cap, "belady", check=True).hit_tokens,
            simulate(bt, cap, "lru", check=True).hit_tokens)


def test_cyclic_pages_belady_beats_lru_by_known_amount():
    # Block size 2, prompts [x, x, 0] for x = a b c a b c: one matchable full block per request
    # plus a transient tail slot, capacity 3 = two cached blocks, the classic cycle over three
    # pages with two frames. LRU always evicts the page needed next (0 hits); Belady evicts b at
    # t=2 (hits a at t=3), then a at t=4 (hits c at t=5). Infinite hits a, b, c at t=3..5.
    reqs = [R([x, x, 0]) for x in [1, 2, 3, 1, 2, 3]]
    inf, bel, lru = rates(reqs, 2, 3)
    assert (inf, bel, lru) == (6, 4, 0)


def test_last_prompt_token_is_always_computed():
    # As in BlockManager.allocate: a prompt of exactly k blocks can hit at most k - 1 of them.
    reqs = [R([1, 2, 3, 4]), R([1, 2, 3, 4])]
    assert infinite(prepare(reqs, 2)).hit_tokens == 2


def test_partial_blocks_never_hit_and_tail_slot_counts():
    # 5-token prompt at block size 2: 2 full blocks; the tail needs a transient slot.
    reqs = [R([1, 2, 3, 4, 5]), R([1, 2, 3, 4, 5])]
    bt = prepare(reqs, 2)
    assert bt.min_capacity == 3
    assert infinite(bt).hit_tokens == 4 and infinite(bt).prompt_tokens == 10
    assert simulate(bt, 3, "belady").hit_tokens == 4
    with pytest.raises(ValueError, match="largest request"):
        simulate(bt, 2, "belady")


def test_reply_blocks_are_inserted_and_hit_by_next_turn():
    # Chat: turn 2's prompt = turn 1's prompt + reply + new message.
    p1, a1 = [1, 2, 3, 4], [5, 6, 7, 8]
    reqs = [R(p1, a1), R(p1 + a1 + [9, 10])]
    inf, bel, lru = rates(reqs, 2, 10)
    assert inf == bel == lru == 8  # 4 full blocks of turn 2's prompt were cached


def test_hit_stops_at_first_divergent_block():
    reqs = [R([1, 2, 3, 4, 5, 6]), R([1, 2, 9, 4, 5, 6])]
    bt = prepare(reqs, 2)
    assert infinite(bt).hit_tokens == 2  # [5, 6] matches by content but not by chain


def test_leaves_only_prefers_deepest_on_ties():
    # Two chains sharing a root block; capacity forces one eviction among blocks never used
    # again: the deepest (a leaf) goes, so the cache stays prefix-closed (check=True asserts it).
    reqs = [R([1, 1, 2, 2]), R([1, 1, 3, 3]), R([4, 4])]
    bt = prepare(reqs, 2)
    res = simulate(bt, 3, "belady", check=True)
    assert res.evictions == 1


def test_chain_hash_depends_on_parent():
    a = chain_hashes([1, 2, 3, 4], 2)
    b = chain_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1] and len(a) == 2
    assert chain_hashes([1, 2, 3], 2) == a[:1]


@given(traces(max_requests=20, max_len=24), st.sampled_from([1, 2, 4]), st.integers(0, 30))
def test_infinite_ge_belady_ge_lru(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    inf = infinite(bt).hit_tokens
    bel = simulate(bt, cap, "belady", check=True).hit_tokens
    lru = simulate(bt, cap, "lru", check=True).hit_tokens
    assert inf >= bel >= lru
    if cap >= bt.num_blocks + 1:  # everything fits: no eviction needed
        assert inf == bel == lru


@settings(max_examples=60)
@given(traces(max_requests=6, max_len=6), st.sampled_from([1, 2]), st.integers(0, 3))
def test_belady_matches_exhaustive_search(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    assert simulate(bt, cap, "belady").hit_tokens == exhaustive_optimum(bt, cap)


# Cost-weighted savings (benchmarks/prefill_cost.py): a small L0 makes depth matter.
L0 = 2.0


def test_cost_weighted_hits_on_hand_checked_trace():
    # Block size 2, L0 = 2: a token at position p costs 1 + (p + 1) / 2. Request 2 hits the
    # first two blocks (4 tokens: 1.5 + 2 + 2.5 + 3 = 9) of its 5-token prompt (cost 12.5).
    reqs = [R([1, 2, 3, 4, 5]), R([1, 2, 3, 4, 5])]
    res = infinite(prepare(reqs, 2), l0=L0)
    assert res.hit_cost == 9.0 and res.prompt_cost == 25.0
    assert simulate(prepare(reqs, 2), 3, "cost-belady", l0=L0).hit_cost == 9.0


@given(traces(max_requests=20, max_len=24), st.sampled_from([1, 2, 4]), st.integers(0, 30))
def test_cost_belady_within_infinite_and_consistent(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    inf = infinite(bt, l0=L0)
    cb = simulate(bt, cap, "cost-belady", check=True, l0=L0)
    assert cb.hit_cost <= inf.hit_cost + 1e-9 and cb.hit_tokens <= inf.hit_tokens
    assert cb.prompt_cost == inf.prompt_cost
    if cap >= bt.num_blocks + 1:
        assert cb.hit_cost == inf.hit_cost


@settings(max_examples=60)
@given(traces(max_requests=6, max_len=6), st.sampled_from([1, 2]), st.integers(0, 3))
def test_no_policy_beats_exhaustive_cost_optimum(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    best = exhaustive_optimum(bt, cap, l0=L0)
    for pol in ("belady", "cost-belady", "lru"):
        assert simulate(bt, cap, pol, l0=L0).hit_cost <= best + 1e-9


# End-blind Belady (every return time known, session ends not): the reference for online
# policies that learn of an end only from a session's silence.
@dataclass
class S:
    prompt: list[int]
    conv: str
    reply: list[int] = field(default_factory=list)


def test_session_phantoms_use_the_sessions_own_gap_else_the_mean():
    # A: requests 0, 2, 4 (gap 2); B: 1 and 5 (gap 4); C: 3 only (mean gap (2+2+4)/3 -> 3).
    reqs = [S([1], "A"), S([2], "B"), S([1], "A"), S([3], "C"), S([1], "A"), S([2], "B")]
    assert session_phantoms(reqs) == [INF, INF, INF, 3 + 3, 4 + 2, 5 + 4]
    # No session with two turns: nothing to guess a gap from, so no phantoms at all.
    assert session_phantoms([R([1]), R([2])]) == [INF, INF]


def test_end_blind_keeps_an_ended_session_until_its_phantom_passes():
    # Block size 2, prompts [x, x, 0]: one matchable block + a tail slot each; capacity 3 holds
    # two blocks. B ends at t=1 (one turn: phantom t=1 + mean gap 2 = 3). At t=3 (C arrives)
    # Belady evicts b (never used again) and hits a at t=4 and c at t=5 (3 hits). End-blind
    # still expects B at t=3, so it evicts a (next use t=4, the farthest); at t=4 B is overdue,
    # b goes, A misses; it hits a at t=2 and c at t=5 (2 hits).
    reqs = [S([1, 1, 0], "A"), S([2, 2, 0], "B"), S([1, 1, 0], "A"), S([3, 3, 0], "C"),
            S([1, 1, 0], "A"), S([3, 3, 0], "C")]
    bt = prepare(reqs, 2)
    ph = session_phantoms(reqs)
    assert ph[1] == 3
    assert simulate(bt, 3, "belady", check=True).hit_tokens == 6
    assert simulate(bt, 3, "end-blind", check=True, phantoms=ph).hit_tokens == 4


def test_end_blind_needs_phantoms_and_only_it_takes_them():
    bt = prepare([R([1, 2, 3])], 2)
    with pytest.raises(ValueError, match="phantoms"):
        simulate(bt, 4, "end-blind")
    with pytest.raises(ValueError, match="phantoms"):
        simulate(bt, 4, "belady", phantoms=[INF])
    with pytest.raises(ValueError, match="1 requests"):
        simulate(bt, 4, "end-blind", phantoms=[INF, INF])


@st.composite
def session_traces(draw, max_requests=20, max_len=24):
    reqs = draw(traces(max_requests=max_requests, max_len=max_len))
    convs = draw(st.lists(st.sampled_from("ABCD"), min_size=len(reqs), max_size=len(reqs)))
    return [S(r.prompt, c, r.reply) for r, c in zip(reqs, convs)]


@given(session_traces(), st.sampled_from([1, 2, 4]), st.integers(0, 30))
def test_end_blind_is_a_valid_cache_and_without_phantoms_is_belady(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    eb = simulate(bt, cap, "end-blind", check=True, phantoms=session_phantoms(reqs))
    assert eb.hit_tokens <= infinite(bt).hit_tokens
    if cap >= bt.num_blocks + 1:
        assert eb.hit_tokens == infinite(bt).hit_tokens
    none = simulate(bt, cap, "end-blind", phantoms=[INF] * len(reqs))
    bel = simulate(bt, cap, "belady")
    assert (none.hit_tokens, none.evictions) == (bel.hit_tokens, bel.evictions)


@settings(max_examples=60)
@given(session_traces(max_requests=6, max_len=6), st.sampled_from([1, 2]), st.integers(0, 3))
def test_end_blind_never_beats_the_exhaustive_optimum(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    eb = simulate(bt, cap, "end-blind", phantoms=session_phantoms(reqs)).hit_tokens
    assert eb <= exhaustive_optimum(bt, cap)
