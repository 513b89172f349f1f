"""benchmarks/bench_rag.py: layout, work accounting, and one quality pass on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from radixkv.benchmarks import bench_rag as br
from radixkv.engine.blend import BlendReport


def test_case_layout_and_spans():
    c = br.Case(head=[1] * 16, docs=[[2] * 32, [3] * 16], question=[4, 5], order=[1, 0],
                other=[0, 1])
    p = c.prompt(c.order)
    assert p == [1] * 16 + [3] * 16 + [2] * 32 + [4, 5]
    assert [(s.start, s.end) for s in c.spans(c.order)] == [(16, 32), (32, 64)]


def test_computed_tokens_counts_layers():
    assert br.computed_tokens(100, 32, None, 30, 1) == 68
    rep = BlendReport("x", 96, 0, 80, 12, 16, False, 0.0)
    # fresh on all layers, reused on layers 0-1, recomputed on the 28 others, then the rest
    want = (16 * 30 + 80 * 2 + 12 * 28) / 30 + 4
    assert math.isclose(br.computed_tokens(100, 96, rep, 30, 1, 0.15), want)
    assert math.isclose(br.computed_tokens(100, 96, rep, 30, 1, 0.0), (16 * 30 + 12 * 30) / 30 + 4)
    warm = BlendReport("x", 96, 0, 0, 0, 0, True, 0.0)
    assert br.computed_tokens(100, 96, warm, 30, 1) == 4


def test_compare_identical_and_different_logits():
    a = torch.randn(5, 11)
    kl, kl_max, agree = br.compare(a, a)
    assert kl == pytest.approx(0, abs=1e-6) and agree == 1.0
    b = a.clone()
    b[0] = -b[0]
    kl, kl_max, agree = br.compare(a, b)
    assert kl > 0 and kl_max >= kl and agree == pytest.approx(0.8)


def test_quality_pass_on_a_tiny_model():
    torch.set_num_threads(1)
    m = br.tiny_model("llama")
    e = br.make_engine(m, None, "float32", 256, "tiny-bench")
    try:
        cases = br.tiny_cases(1, 3, 3, 16, 40, seed=1)
        rows = br.quality(br.Runner(e), None, cases, 4, "tiny")
    finally:
        e.close()
    modes = {r["mode"]: r for r in rows}
    assert set(modes) == {"prefix-only", "plain (0%)", "blend 5%", "blend 15%", "blend 30%"}
    assert modes["prefix-only"]["top1"] == 1.0
    assert all(0 <= r["top1"] <= 1 and r["kl_mean"] >= 0 for r in rows)


def test_quality_pass_on_a_quantized_cache_compares_with_both_prefills():
    """--kv-dtype: each mode against the same int8 cache's full prefill and against fp32's;
    the int8 engine blends (its modes differ from prefix-only), its prefix-only is exact to
    float32 rounding (bit-exact where the native float32 prefill kernel runs, AVX-512 or AVX2; the
    torch path attends a cached prefix in two parts merged by log-sum-exp)."""
    torch.set_num_threads(1)
    m = br.tiny_model("llama")
    e = br.make_engine(m, None, "float32", 256, "tiny-bench-int8", "int8")
    ref = br.make_engine(br.tiny_model("llama"), None, "float32", 256, "tiny-bench-ref")
    try:
        cases = br.tiny_cases(1, 3, 3, 16, 40, seed=1)
        rows = br.quality(br.Runner(e), None, cases, 4, "tiny", br.Runner(ref))
    finally:
        e.close()
        ref.close()
    modes = {r["mode"]: r for r in rows}
    assert set(modes) == {"prefix-only", "plain (0%)", "blend 5%", "blend 15%", "blend 30%",
                          "full prefill"}
    assert modes["prefix-only"]["top1"] == 1.0
    assert modes["prefix-only"]["kl_mean"] == pytest.approx(0, abs=1e-6)
    assert modes["plain (0%)"]["kl_mean"] > 1e-4                    # blended, not a fallback
    assert "kl_mean" not in modes["full prefill"] and modes["full prefill"]["kl_fp32"] >= 0
    assert all(0 <= r["top1_fp32"] <= 1 and r["kl_fp32"] >= 0 for r in rows)


def test_held_out_texts_pick_documents_and_questions_by_length():
    """The documents and questions both RAG benchmarks draw (bench rag, bench rag-serve)."""
    import random

    class Words:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": text.split()}

    docs, questions = br.held_out_texts(Words(), 5, 3, 20, 60, random.Random(0))
    assert len(docs) == 5 and len(questions) == 3
    assert all(20 <= len(d.split()) <= 60 for d in docs)
    assert all(5 <= len(q) <= 200 for q in questions)
    again = br.held_out_texts(Words(), 5, 3, 20, 60, random.Random(0))
    assert again == (docs, questions)                 # seeded: the same held-out texts
