"""benchmarks/bench_kv_pool.py: the quick run times both pools in pairs; only the committed one
is resident from the start."""

from __future__ import annotations

import json
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_quick_run_pairs_a_lazy_and_a_committed_pool(tmp_path, monkeypatch, capsys):
    from radixkv.benchmarks import bench_kv_pool

    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bench_kv_pool.main(["--quick", "--tokens", "64"]) == 0
    assert "committed / lazy, median of the pair ratios" in capsys.readouterr().out
    [path] = list(tmp_path.glob("kv_pool*.json"))
    result = json.loads(path.read_text())["results"]
    assert len(result["lazy_s"]) == len(result["committed_s"]) == result["summary"]["pairs"] == 5
    rows = {r["arm"]: r for r in result["rows"]}
    pool = result["summary"]["pool_mib"]
    # the committed engine's pool is resident at once, the lazy one's only where written
    assert rows["committed"]["pool_resident_mib"] >= pool
    assert rows["lazy"]["pool_resident_mib"] < 0.1 * pool
