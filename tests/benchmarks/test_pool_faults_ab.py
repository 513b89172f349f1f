"""Smoke test of the paired pool benchmark (``benchmarks/pool_faults_ab.py``): the bare-pool
child, in process and as a child process on this tree."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixkv.benchmarks import pool_faults_ab as ab

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/statm and /proc/self/stat")


def test_pool_child_in_process():
    row = ab.child_pool(0.05)
    assert 50 < row["pool_MiB"] <= 52
    assert row["cold_write_16_minflt"] >= 0 and row["cold_write_112_ms"] > 0
    assert row["rss_one_block_MiB"] < 16


def test_pool_child_runs_on_a_tree():
    row = ab.run_child(str(REPO), ["--child-pool", "--pool-gib", "0.05"])
    assert {"rss_construct_MiB", "rss_one_block_MiB", "cold_write_16_ms"} <= row.keys()
