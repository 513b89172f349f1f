"""``bench kv-quant --extend``: cached-turn prefill timed per KV dtype, quantized caches read in
place and through the dequantizing scratch (a quick run end to end)."""

from __future__ import annotations

import json

from radixkv.benchmarks import bench_kv_quant


def test_extend_timing_quick_run_writes_one_row_per_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    assert bench_kv_quant.main(["--extend", "--quick"]) == 0
    rows = json.loads((tmp_path / "kv_quant_extend_quick.json").read_text())["results"]["rows"]
    assert [r["kv"] for r in rows] == ["float32 (auto)", "int8", "fp8_e4m3", "int8 + scratch",
                                       "fp8_e4m3 + scratch"]
    assert all(r["shape"] == "64+16" and r["wall_ms"] > 0 and r["cpu_ms"] > 0 for r in rows)
    assert rows[0]["wall_vs_float32"] == 1.0
    for r in rows:
        assert abs(r["wall_vs_float32"] - r["wall_ms"] / rows[0]["wall_ms"]) < 0.01


def test_extend_shapes_are_checked_before_anything_runs(capsys):
    import pytest

    for bad in ("1024x64", "1024+0", "+64", "1024+64,abc"):
        with pytest.raises(SystemExit):
            bench_kv_quant.main(["--extend", bad])
        assert "is not C+S" in capsys.readouterr().err
