"""The workloads of issue 15 that the older trace tests do not cover: round-robin chat and agent
loops, built from synthetic text with the fake character tokenizer (no dataset, no model)."""

from __future__ import annotations

import pytest
from fake_tokenizer import FakeTokenizer

from radixkv.benchmarks import traces as T

CONVS = [[(f"question {i}.{k}", f"answer {i}.{k} " * (k + 1)) for k in range(1 + i % 4)]
         for i in range(40)]


def tk():
    return T.ChatTokenizer(FakeTokenizer())


def rr(**kw):
    params = dict(n_conversations=25, slots=4, interval_s=2.0, max_context=400)
    params.update(kw)
    return T.build_chat_rr(CONVS, tk(), seed=3, progress=False, **params)


def test_round_robin_same_conversations_as_open_loop():
    reqs, _ = rr()
    open_loop, _ = T.build_chat(CONVS, tk(), seed=3, n_conversations=25, window=4, rate=1.0,
                                think_s=5.0, decode_tps=100.0, max_context=400, progress=False)
    key = lambda r: (r.meta["src"], r.turn, r.prompt, r.reply)  # noqa: E731
    assert sorted(map(key, reqs)) == sorted(map(key, open_loop))


def test_round_robin_fixed_order_and_period():
    reqs, _ = rr()
    assert [r.t for r in reqs] == [2.0 * j for j in range(len(reqs))]
    turns: dict[int, list] = {}
    for j, r in enumerate(reqs):
        turns.setdefault(r.conv, []).append((j, r))
    last_start = max(rs[0][0] for rs in turns.values())  # the queue is empty after this
    for rs in turns.values():
        assert [r.turn for _, r in rs] == list(range(len(rs)))
        for (j0, a), (j1, b) in zip(rs, rs[1:]):
            assert b.prompt[:len(a.prompt) + len(a.reply)] == a.prompt + a.reply
            assert j1 - j0 <= 4 and (j1 - j0 == 4 or j1 > last_start)
    live = set()
    for j, r in enumerate(reqs):  # at most `slots` conversations are open at once
        live.add(r.conv)
        live -= {c for c in live if turns[c][-1][0] < j}
        assert len(live) <= 4


def test_round_robin_validates():
    with pytest.raises(ValueError, match="slots"):
        rr(slots=0)


def shuffled(**kw):
    params = dict(n_conversations=25, slots=4, interval_s=2.0, max_context=400)
    params.update(kw)
    return T.build_chat_shuffled(CONVS, tk(), seed=3, progress=False, **params)


def test_held_out_chat_is_shuffled_and_drawn_apart():
    """``chat-shuffled``: every turn of every kept conversation once, in order, at most
    ``slots`` conversations live, the next request from a random live one (not a round robin),
    and other conversations than ``chat-rr``'s with the same seed."""
    reqs, _ = shuffled()
    assert [r.t for r in reqs] == [2.0 * j for j in range(len(reqs))]
    turns: dict[int, list] = {}
    for j, r in enumerate(reqs):
        turns.setdefault(r.conv, []).append((j, r))
    assert len(turns) == 25
    for rs in turns.values():
        assert [r.turn for _, r in rs] == list(range(len(rs)))
        for (_, a), (_, b) in zip(rs, rs[1:]):
            assert b.prompt[:len(a.prompt) + len(a.reply)] == a.prompt + a.reply
    live = set()
    for j, r in enumerate(reqs):
        live.add(r.conv)
        live -= {c for c in live if turns[c][-1][0] < j}
        assert len(live) <= 4
    gaps = [j1 - j0 for rs in turns.values() for (j0, _), (j1, _) in zip(rs, rs[1:])]
    assert len(set(gaps)) > 1                       # not a fixed period
    src = [r.meta["src"] for r in reqs if r.turn == 0]
    assert src != [r.meta["src"] for r in rr()[0] if r.turn == 0]
    assert shuffled()[0] == reqs                    # deterministic
    with pytest.raises(ValueError, match="slots"):
        shuffled(slots=0)


AGENT_CONVS = [[(f"task {i} " + "word " * (3 + i % 30), f"result {i} " + "x " * (10 + i % 90))]
               for i in range(300)]


def agent(**kw):
    params = dict(n_sessions=12, n_tools=4, instruction_tokens=(60, 200), call_tokens=(8, 60),
                  result_tokens=(20, 200), min_steps=1, steps_alpha=1.0, max_steps=30,
                  rate=1.0, tool_s=1.0, decode_tps=100.0, max_context=4000)
    params.update(kw)
    return T.build_agent(AGENT_CONVS, tk(), seed=0, progress=False, **params)


def test_agent_sessions_share_prefix_and_extend_history():
    reqs, stats = agent()
    assert stats["assembly_verified"] == "20/20"
    n = stats["prefix_tokens"]
    assert n > 100 and len({tuple(r.prompt[:n]) for r in reqs}) == 1
    by: dict[int, list] = {}
    for r in reqs:
        by.setdefault(r.conv, []).append(r)
        assert r.reply[-1] == 2 and len(r.prompt) + len(r.reply) <= 4000
    assert [r.t for r in reqs] == sorted(r.t for r in reqs)
    for rs in by.values():
        assert [r.turn for r in rs] == list(range(len(rs)))
        assert len(rs) == rs[0].meta["steps"] + 1  # every call, then the final answer
        for a, b in zip(rs, rs[1:]):
            assert b.prompt[:len(a.prompt) + len(a.reply)] == a.prompt + a.reply
            assert len(b.prompt) - len(a.prompt) - len(a.reply) < 260  # one short tool turn
    lengths = sorted(len(rs) for rs in by.values())
    assert lengths[-1] >= 3 * lengths[0]  # sessions of very different lengths


def test_agent_context_cut_and_determinism():
    reqs, stats = agent(max_context=900)
    assert all(len(r.prompt) + len(r.reply) <= 900 for r in reqs)
    assert stats["sessions_cut_at_context"] > 0
    again, _ = agent(max_context=900)
    assert [(r.t, r.prompt, r.reply) for r in again] == [(r.t, r.prompt, r.reply) for r in reqs]


def test_session_steps_heavy_tailed():
    import random

    from radixkv.benchmarks.traces_agent import session_steps

    s = session_steps(random.Random(1), 4000, 2, 1.1, 64)
    assert min(s) >= 2 and max(s) == 64
    assert sorted(s)[2000] <= 5 and sum(x >= 32 for x in s) > 40


def test_workload_kinds_registered():
    assert set(T.WORKLOADS) <= set(T.KINDS) == set(T.DEFAULTS) == set(T.QUICK)
    for kind in T.KINDS:
        assert T.trace_params(kind, quick=True)["seed"] == 0
