"""benchmarks/bench_kernels.py on the CPU: the quick run times decode, prefill, copies and the
cold decode (each layer's K/V from memory) against its streaming-read baseline."""

from __future__ import annotations

import json


def test_quick_run_writes_every_table_and_the_cold_decode_against_a_read(tmp_path, monkeypatch,
                                                                         capsys):
    import torch

    from radixkv.benchmarks import bench_kernels

    monkeypatch.setenv("RADIXKV_RESULTS_DIR", str(tmp_path))
    threads = torch.get_num_threads()
    try:
        assert bench_kernels.main(["--quick", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "attention as a step meets it" in capsys.readouterr().out
    [path] = list(tmp_path.glob("kernels*.json"))
    result = json.loads(path.read_text())["results"]
    assert result["decode"] and result["prefill"] and result["copies"]
    cold = result["cold_decode"]
    assert sorted((r["op"], r["dtype"], r["pool"]) for r in cold) == [
        ("cold decode", "bfloat16", 1), ("cold decode", "bfloat16", 8),
        ("cold decode", "float32", 1), ("cold decode", "float32", 8),
        ("cold prefill", "bfloat16", 1), ("cold prefill", "float32", 1)]
    assert {r["case"] for r in cold if r["pool"] == 8} == {"4 x 256 x 4 layers, pool 8x"}
    for r in cold:
        # 4 sequences x 256 keys (decode) or 1 x 256 (prefill) x 3 KV heads x 64 x (K and V)
        # x 4 layers, in the row's dtype
        size = 4 if r["dtype"] == "float32" else 2
        kv_bytes = (4 if r["op"] == "cold decode" else 1) * 256 * 3 * 64 * 2 * size * 4
        assert abs(r["kv_GBps"] - kv_bytes / (r["step_ms"] / 1e3) / 1e9) < 1e-6 * r["kv_GBps"]
        assert r["read_GBps"] > 0
        assert abs(r["fraction_of_read"] - r["kv_GBps"] / r["read_GBps"]) < 1e-9
