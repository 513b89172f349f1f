"""``bench kv-quant --quality``: the teacher-forced harness itself (tiny models, fast)."""

from __future__ import annotations

import json

import pytest
import torch

from radixkv.benchmarks import bench_kv_quant as bq


def test_teacher_forced_scores_the_reference_perfectly_and_a_perturbation_less():
    """Float32 KV against itself agrees on every position with KL 0, cold and served from the
    cache (prefill then one decode step per token); the bf16 model and fp8 KV move away from
    it, and the perplexity is that of the reference tokens."""
    model = bq.tiny_arch_model("llama")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 37)]
    conts = bq.greedy_reference(model, prompts, 12)
    assert [len(c) for c in conts] == [12, 12]
    seqs = list(zip(prompts, conts))
    ref = bq.teacher_forced(model, "auto", seqs, cached=False)
    # the greedy continuation is the reference's own argmax at every position
    for lp, (_, tgt) in zip(ref, seqs):
        assert lp.shape == (12, 256) and lp.argmax(-1).tolist() == tgt
    cached = bq.teacher_forced(model, "auto", seqs, cached=True)
    for a, b in zip(ref, cached):
        assert torch.allclose(a, b, atol=1e-4)
    scores = bq.quality_for(model, seqs)
    for mode in ("cold", "cached"):
        s = scores["float32", mode]
        assert s["agree"] == 1.0 and abs(s["kl_mean"]) < 1e-5 and s["positions"] == 24
        nll = -sum(float(lp[torch.arange(12), torch.tensor(t)].sum())
                   for lp, (_, t) in zip(ref, seqs))
        assert s["ppl"] == pytest.approx(torch.tensor(nll / 24).exp().item(), rel=1e-4)
        for row in ("bf16 model", "int8", "fp8_e4m3"):
            assert scores[row, mode]["kl_mean"] > 1e-6, row
        assert scores["fp8_e4m3", mode]["kl_mean"] > scores["int8", mode]["kl_mean"]


def test_quality_quick_run_writes_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bq.main(["--quality", "--quick", "--archs", "qwen2,gemma2_window_softcap"]) == 0
    rows = json.loads((tmp_path / "kv_quant_quality_quick.json").read_text())["results"]["rows"]
    assert [(r["arch"], r["kv"], r["mode"]) for r in rows] == [
        (a, kv, m) for a in ("qwen2", "gemma2_window_softcap") for m in ("cold", "cached")
        for kv in bq.QUALITY_KV]
    for r in rows:
        assert 0 <= r["agree_pct"] <= 100 and r["positions"] == 32
    with pytest.raises(SystemExit):
        bq.main(["--quality", "--quick", "--archs", "gpt9"])
