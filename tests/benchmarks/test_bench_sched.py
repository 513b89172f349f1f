"""``radixkv bench sched``'s bookkeeping: quantiles, the work an unbounded cache leaves, the
policy variants, and one small open-loop replay per policy on the CPU clock."""

from __future__ import annotations

import argparse

import pytest
from radixkv.benchmarks.bench_sched import (
    CPUClock,
    make_engine,
    percentile,
    policy_names,
    replay,
    uncached_work,
)

from radixkv import cli


def test_percentile_and_uncached_work_and_policy_names():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)
    # the second prompt shares 2 full blocks; the third is all new; a prompt never matches
    # its own last token's block
    assert uncached_work([[1] * 9, [1] * 8 + [2], [5] * 4], 4) == 9 + 1 + 4
    assert uncached_work([[1] * 8, [1] * 8], 4) == 8 + 4
    assert policy_names([0.5]) == ["fcfs", "lpm/0.5s"]


def test_cpu_clock_skips_idle_time_only_forward():
    c = CPUClock()
    t = c()
    c.skip_to(t + 5.0)
    assert c() >= t + 5.0
    before = c()
    c.skip_to(0.0)
    assert c() >= before


def test_bench_sched_help(capsys):
    with pytest.raises(SystemExit) as exc:   # argparse exits after printing --help
        cli.main(["bench", "sched", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--max-wait" in text and "``" not in text


def test_replay_counts_every_request_and_lpm_shares_the_document():
    """Six requests over one document arriving at once, then three cold ones: each policy's
    replay reports one TTFT per request, and both compute the document once."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=512,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(0, 128, (64,), generator=g).tolist()
    prompts = [doc + [i + 1, i + 2] for i in range(6)]
    prompts += [torch.randint(0, 128, (40,), generator=g).tolist() for _ in range(3)]
    arrivals = [0.0] * 6 + [0.01] * 3
    args = argparse.Namespace(block_size=16, pool_tokens=1024, max_seqs=4, batch_tokens=256)
    for policy in policy_names([5.0]):
        res = replay(make_engine(model, None, "t", policy, args), prompts, arrivals, 2)
        assert len(res["ttft_s"]) == 9 and all(t > 0 for t in res["ttft_s"])
        assert res["prefill_tokens"] == 66 + 5 * 2 + 3 * 40, policy
        assert res["ttft_p50_s"] <= res["ttft_p99_s"]
