"""Tier bandwidth per KV dtype (issue 16, ``benchmarks/tiers_dtypes.py``): a smoke run of every
direction on a few blocks. The benchmark itself checks that each dtype's bytes come back
unchanged; here: one row per (direction, dtype), bf16 as the baseline, and a quantized block
at about half a bf16 block's bytes."""

from __future__ import annotations

from radixkv.benchmarks import tiers_dtypes as td


def test_every_direction_reports_every_dtype_against_bf16(tmp_path):
    kvs = ("bfloat16", "int8", "fp8_e4m3")
    rows = td.bench_device_host(4, 1, kvs) + td.bench_host_disk(tmp_path, 4, 1, kvs)
    rm, facts = td.bench_remote_dtypes(4, 1, kvs, batch=2)
    rows += rm
    assert facts["redis_server"]
    directions = ["device->host", "host->device", "host->disk", "disk->host", "disk->host",
                  "host->remote", "remote->host"]
    assert [r["direction"] for r in rows] == [d for d in directions for _ in kvs]
    for r in rows:
        assert r["blocks"] == 4 and r["blocks/s"] > 0 and r["GB/s"] > 0
        assert abs(r["GB/s"] * 1e9 - r["blocks/s"] * r["block_bytes"]) <= 1e-6 * r["GB/s"] * 1e9
        if r["kv_dtype"] == "bfloat16":
            assert r["vs bf16"] == 1.0
    sizes = {r["kv_dtype"]: r["block_bytes"] for r in rows}
    assert sizes["int8"] == sizes["fp8_e4m3"] == 190080 and sizes["bfloat16"] == 368640
