"""benchmarks/bench_sampling.py: the quick run on the embedded model's logits."""

from __future__ import annotations

import json


def test_quick_run_times_both_paths_and_they_keep_the_same_tokens(tmp_path, monkeypatch, capsys):
    from radixkv.benchmarks import bench_sampling

    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bench_sampling.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "same tokens kept by both paths: yes" in out
    [path] = list(tmp_path.glob("sampling*.json"))
    rows = json.loads(path.read_text())["results"]["rows"]
    assert len(rows) == len(bench_sampling.SETTINGS)
    assert all(r["sort_ms"] > 0 and r["candidates_ms"] > 0 and 0 <= r["rows_inside"] <= 4
               for r in rows)
