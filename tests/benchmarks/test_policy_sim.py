"""The policy simulator: same model as bounds.py, victims are always evictable leaves, no
candidate beats the exhaustive optimum, and the behaviours each candidate exists for."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hitrate_strategies import traces

from radixkv.benchmarks.bounds import exhaustive_optimum, infinite, prepare, simulate
from radixkv.benchmarks.policy_sim import CANDIDATES, run_policy


@dataclass
class T:
    t: float
    conv: int
    turn: int
    prompt: list[int]
    reply: list[int] = field(default_factory=list)


@given(traces(max_requests=20, max_len=24), st.sampled_from([1, 2, 4]), st.integers(0, 30))
def test_lru_candidate_equals_block_model_and_all_stay_valid(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    assert run_policy(bt, cap, "lru", reqs).hit_tokens == simulate(bt, cap, "lru").hit_tokens
    inf = infinite(bt).hit_tokens
    for name in CANDIDATES:  # check=True: prefix-closed and within capacity after each request
        res = run_policy(bt, cap, name, reqs, check=True)
        assert res.hit_tokens <= inf
        if cap >= bt.num_blocks + 1:
            assert res.hit_tokens == inf


@settings(max_examples=25)
@given(traces(max_requests=6, max_len=6), st.sampled_from([1, 2]), st.integers(0, 3))
def test_no_candidate_beats_the_exhaustive_optimum(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = bt.min_capacity + extra
    best = exhaustive_optimum(bt, cap)
    for name in CANDIDATES:
        assert run_policy(bt, cap, name, reqs).hit_tokens <= best


def loop(n_conv=4, turns=6, size=4):
    """Round-robin chats: conversation c's turn k re-sends its history plus ``size`` tokens."""
    hist = {c: [] for c in range(n_conv)}
    out = []
    for k in range(turns):
        for c in range(n_conv):
            prompt = hist[c] + [1000 * c + 10 * k + i for i in range(size)]
            reply = [1000 * c + 10 * k + 5 + i for i in range(2)]
            out.append(T(float(len(out)), c, k, prompt, reply))
            hist[c] = prompt + reply
    return out


def test_next_use_keeps_a_stable_subset_of_a_loop_lru_thrashes():
    reqs = loop()
    bt = prepare(reqs, 2)
    cap = bt.min_capacity + 24  # room for about half of the live histories
    lru = run_policy(bt, cap, "lru", reqs).hit_tokens
    nxt = run_policy(bt, cap, "next-use", reqs).hit_tokens
    assert lru < nxt <= simulate(bt, cap, "belady").hit_tokens
    duel = run_policy(bt, cap, "duel-lru-next", reqs).hit_tokens
    assert duel > lru


def test_scan_resistance():
    # A hot prompt (2 full blocks) every third request, two one-off 3-block scans in between:
    # its LRU stack distance exceeds the cache, so LRU never hits; the scan-resistant candidates
    # keep it (next-use learns its reuse interval and matches Belady).
    hot = [7, 7, 8, 8, 9]
    reqs, k = [], 0
    for i in range(30):
        reqs.append(T(float(len(reqs)), 0, i, hot))
        for _ in range(2):
            k += 1
            reqs.append(T(float(len(reqs)), k, 0, [1000 + 100 * k + x for x in range(7)]))
    bt = prepare(reqs, 2)
    cap = bt.min_capacity + 3
    assert run_policy(bt, cap, "lru", reqs).hit_tokens == 0
    assert run_policy(bt, cap, "next-use", reqs).hit_tokens == simulate(bt, cap).hit_tokens
    for name in ("s3fifo", "arc"):
        assert run_policy(bt, cap, name, reqs).hit_tokens >= 100


def test_unknown_candidate():
    with pytest.raises(ValueError, match="unknown candidate"):
        run_policy(prepare([T(0.0, 0, 0, [1, 2])], 1), 5, "nope", [])


def test_end_hint_frees_ended_sessions_first():
    # Round robin where sessions end at different turns: told which turn is the last, the
    # forecast policy drops ended sessions at once instead of waiting for them to be overdue.
    reqs = [r for r in loop(n_conv=6, turns=6) if r.turn <= 1 + r.conv]
    bt = prepare(reqs, 2)
    cap = bt.min_capacity + 30
    plain = run_policy(bt, cap, "next-use", reqs).hit_tokens
    hinted = run_policy(bt, cap, "next-use+end-hint", reqs, check=True).hit_tokens
    assert plain < hinted <= simulate(bt, cap, "belady").hit_tokens
