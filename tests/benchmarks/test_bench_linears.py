"""benchmarks/bench_linears.py: the quick run times both arms in pairs, at the GEMM level and
over whole forwards, reports the invariance of each arm, and restores the switch."""

from __future__ import annotations

import json

import pytest
import torch

from radixkv.engine import packed_linear


@pytest.mark.skipif(torch.float32 not in packed_linear.PACKED_DTYPES,
                    reason="float32 linears are packed on x86-64 with oneDNN only")
def test_quick_run_pairs_both_arms_and_restores_the_switch(tmp_path, monkeypatch, capsys):
    from radixkv.benchmarks import bench_linears

    before = packed_linear.PACKED_DTYPES
    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bench_linears.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens equal with either arm" in out
    [path] = list(tmp_path.glob("linears*.json"))
    result = json.loads(path.read_text())["results"]
    assert [r["rows"] for r in result["gemms"] if r["dtype"] == "float32"] == [1, 16, 243]
    assert all(r["pairs"] == 4 and r["plain_ms"] > 0 and r["packed_ms"] > 0
               for r in result["gemms"])
    # the packed float32 rows are what the runner's thread choice relies on
    assert result["invariance"]["float32"]["packed"] == {"rows_invariant": True,
                                                         "thread_invariant": True}
    assert [r["scenario"].split(",")[0] for r in result["forwards"]] == [
        "decode", "decode", "decode", "cached turn"]
    assert all(r["pairs"] >= 1 and r["plain_ms"] > 0 and r["packed_ms"] > 0
               for r in result["forwards"])
    assert result["forwards"][0]["pairs"] >= 4
    assert packed_linear.PACKED_DTYPES == before
