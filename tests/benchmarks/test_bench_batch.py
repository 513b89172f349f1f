"""benchmarks/bench_batch.py: the quick run (two ``radixkv run-batch`` processes over one file)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.model
def test_quick_run_compares_the_cache_with_none(tmp_path, monkeypatch) -> None:
    from radixkv.benchmarks import bench_batch

    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bench_batch.main(["--quick", "--threads", "1"]) == 0
    data = json.loads((tmp_path / "batch.json").read_text())
    rows = {r["run"]: r for r in data["results"]["table"]}
    assert set(rows) == {"radixkv", "radixkv, no prefix cache"}
    assert all(r["ok"] == 6 for r in rows.values())   # 2 documents x 3 questions
    # the second and third question of each document read its prefix from the cache
    assert rows["radixkv"]["cached share"] > 0.3
    assert rows["radixkv, no prefix cache"]["cached share"] == 0
    assert data["header"]["lines"] == 6 and data["header"]["quick"]
