"""Smoke test of ``radixkv bench tiers --parts remote``: tiny sizes, every path runs and the
rows are well formed (no timing assertions: targets live in the benchmark)."""

from __future__ import annotations

from radixkv.benchmarks.bench_remote import bench_remote
from radixkv.benchmarks.bench_tiers import _interleaved
from radixkv.storage.layout import KVLayout


def test_bench_remote_runs(redis_server):  # the fixture fails clearly if redis-server is missing
    lay = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=16, dtype="float16")
    rows, facts = bench_remote(lay, n=6, repeat=1, interleaved=_interleaved, batch=4)
    assert {r["path"] for r in rows} == {
        "raw redis SET (pipelined)", "store put (caller thread)", "store put (background writer)",
        "raw redis MGET", "raw redis GET (pipelined)", "store get_many (verified views)",
        "store read_into_many (host slots)"}
    assert all(r["GB/s"] > 0 and r["vs raw"] > 0 for r in rows)
    assert facts["redis_server"].split(".")[0].isdigit() and facts["batch_blocks"] == 4
