"""benchmarks/bench_decode_ops.py: the quick run pairs both op sets and finds the same tokens."""

from __future__ import annotations

import json


def test_quick_run_pairs_both_op_sets_and_they_give_the_same_tokens(tmp_path, monkeypatch,
                                                                     capsys):
    from radixkv.benchmarks import bench_decode_ops
    from radixkv.engine import decoder_forward

    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bench_decode_ops.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens equal with either op set (40 tokens): yes" in out
    [path] = list(tmp_path.glob("decode_ops*.json"))
    result = json.loads(path.read_text())["results"]
    assert result["same_tokens"] is True
    assert [r["scenario"].split(",")[0] for r in result["rows"]] == ["decode", "decode",
                                                                      "cached turn"]
    # every scenario timed both arms in pairs (decode: about one pair per two tokens)
    assert all(r["pairs"] >= 1 and r["reference_ms"] > 0 and r["native_ms"] > 0
               for r in result["rows"])
    assert result["rows"][0]["pairs"] >= 15
    assert decoder_forward._native_cpu_ops[0] is True    # the switch is restored
