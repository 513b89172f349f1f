"""Trace building and file format on synthetic conversations with a fake character tokenizer.

No dataset and no real tokenizer: ``FakeTokenizer`` renders ChatML like SmolLM2's template and
maps each character to its code point (``fake_tokenizer.py``).
"""

from __future__ import annotations

import json

import pytest
from fake_tokenizer import FakeTokenizer

from radixkv.benchmarks import traces as T

CONVS = [[(f"question {i}.{k}", f"answer {i}.{k} " * (k + 1)) for k in range(1 + i % 3)]
         for i in range(30)]


def test_clean_conversation_rules():
    msgs = [{"from": "system", "value": "s"}, {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
            {"from": "gpt", "value": ""}]
    assert T.clean_conversation(msgs) == [("q1", "a1")]
    assert T.clean_conversation([{"from": "human", "value": "q"}]) == []


def test_iter_sharegpt_stops_at_truncated_tail(tmp_path):
    objs = [{"id": str(i), "conversations": [{"from": "human", "value": "x"}]} for i in range(3)]
    text = json.dumps(objs, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"value"') + 5])  # cut inside the last object
    assert [o["id"] for o in T.iter_sharegpt(path)] == ["0", "1"]
    path.write_text(text)
    assert len(list(T.iter_sharegpt(path))) == 3


def build_chat(seed=0, **kw):
    params = dict(n_conversations=20, window=4, rate=1.0, think_s=5.0, decode_tps=100.0,
                  max_context=200)
    params.update(kw)
    return T.build_chat(CONVS, T.ChatTokenizer(FakeTokenizer()), seed=seed, progress=False,
                        **params)


def test_chat_trace_turns_extend_history():
    reqs, stats = build_chat()
    assert [r.t for r in reqs] == sorted(r.t for r in reqs)
    assert len({r.conv for r in reqs}) == 20
    by_conv: dict[int, list] = {}
    for r in reqs:
        by_conv.setdefault(r.conv, []).append(r)
        assert r.reply[-1] == 2 and len(r.prompt) + len(r.reply) <= 200
    for turns in by_conv.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for a, b in zip(turns, turns[1:]):
            assert b.prompt[: len(a.prompt) + len(a.reply)] == a.prompt + a.reply
    assert stats["prefix_property_turns"] == stats["turn_pairs"]


def test_chat_trace_window_and_determinism():
    reqs, _ = build_chat(window=2)
    spans = {}
    for r in reqs:
        lo, hi = spans.get(r.conv, (r.t, r.t))
        spans[r.conv] = (min(lo, r.t), max(hi, r.t))
    for t in sorted(x for s in spans.values() for x in s):
        assert sum(lo <= t <= hi for lo, hi in spans.values()) <= 2 + 1  # boundary touch
    again, _ = build_chat(window=2)
    assert [(r.t, r.prompt) for r in again] == [(r.t, r.prompt) for r in reqs]
    other, _ = build_chat(seed=1, window=2)
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


def test_chat_trace_context_limit_cuts_conversations():
    reqs, stats = build_chat(max_context=120)
    assert all(len(r.prompt) + len(r.reply) <= 120 for r in reqs)
    assert stats["cut_at_context"] + stats["dropped_too_long"] > 0


def test_file_round_trip(tmp_path):
    reqs, _ = build_chat()
    path = tmp_path / "t.jsonl"
    header = {"format": T.TRACE_FORMAT, "version": T.TRACE_VERSION, "kind": "chat"}
    T.write_trace(path, header, reqs)
    back = T.read_trace(path)
    assert back.header == header
    assert [(r.t, r.conv, r.turn, r.prompt, r.reply, r.meta) for r in back] == \
        [(round(r.t, 6), r.conv, r.turn, r.prompt, r.reply, r.meta) for r in reqs]
    (tmp_path / "bad.jsonl").write_text('{"format": "other"}\n')
    with pytest.raises(ValueError, match="not a radixkv-trace"):
        T.read_trace(tmp_path / "bad.jsonl")


def test_trace_params_and_cache_key():
    full = T.trace_params("chat", quick=True)
    assert full["n_conversations"] == T.QUICK["chat"]["n_conversations"] and full["seed"] == 0
    assert T.trace_path("chat", full) != T.trace_path("chat", T.trace_params("chat", seed=1))
    with pytest.raises(ValueError, match="unknown parameter"):
        T.trace_params("chat", bogus=1)
    with pytest.raises(ValueError, match="unknown trace kind"):
        T.trace_params("nope")


def test_zipf_sampler_is_skewed():
    import random

    draw = T._zipf_sampler(random.Random(0), 50, 1.0)
    counts = [0] * 50
    for _ in range(5000):
        counts[draw()] += 1
    assert counts[0] > 3 * counts[9] > 0


def test_sampling_and_system_builders_with_fake_tokenizer():
    convs = [[(f"q{i} " * (4 + i % 20), f"a{i} " * (10 + i % 40))] for i in range(400)]
    tk = T.ChatTokenizer(FakeTokenizer())
    reqs, _ = T.build_sampling(convs, tk, seed=0, n_groups=5, n=3, beams=2, steps=2, chunk=4,
                               reply_tokens=64, rate=1.0, progress=False)
    assert len(reqs) == 5 * (3 + 2 * 2)
    reqs, stats = T.build_system(convs, tk, seed=0, n_requests=30, n_prefixes=2, shots=(1, 2),
                                 prefix_tokens=(40, 400), zipf_s=1.0, question_tokens=(8, 128),
                                 reply_tokens=32, rate=1.0, progress=False)
    assert stats["assembly_verified"] == "20/20"
    reqs, stats = T.build_rag(convs, tk, seed=0, n_requests=30, n_docs=10, k=3, zipf_s=1.0,
                              doc_tokens=(20, 400), question_tokens=(8, 128), reply_tokens=32,
                              rate=1.0, progress=False)
    assert stats["assembly_verified"] == "20/20"
    assert all(r.meta["docs"] == sorted(r.meta["docs"]) and len(r.meta["docs"]) == 3
               for r in reqs)
