"""scripts/gpu_check.sh, the one prepared GPU check, kept from rotting on machines without a GPU:
its CPU self-check runs here through the real script (temporary import root of symlinks, no
top-level ``kernels`` importable, the machine's python), and its pytest-summary parsing is
checked on pytest's real closing lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixkv.benchmarks.gpu_check import _pytest_counts

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the script runs the full "
                    "check (minutes); the CPU self-check is what CI runs")
def test_gpu_check_script_cpu_self_check(tmp_path):
    """The script's engine step on the tiny model (the same benchmark code as on CUDA) writes
    its JSON with every figure labelled with the device, exits 0, and leaves no scratch
    folder behind (its import root and the steps' folder: every CI run made two more)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(scratch))
    for var in ("RADIXKV_KERNEL_BACKEND", "TRITON_INTERPRET", "RADIXKV_RESULTS_DIR"):
        env.pop(var, None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--skip", "tests",
                           "kernels", "--results-dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: PASSED on cpu" in proc.stdout
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("radixkv-")]
    data = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    eng = data["results"]["engine"]
    assert [r["batch"] for r in eng["decode"]] == [1, 4]
    for row in eng["decode"] + eng["prefill"] + eng["ttft"]:
        assert row["device"].startswith("cpu")
    for row in eng["decode"]:
        # Timings on a shared CPU are noise (a difference of two runs may even come out
        # negative); what is checked is that every figure was computed, and the limit.
        assert all(isinstance(row[k], float) for k in ("radixkv_ms", "transformers_ms"))
        assert row["limit_ms"] > 0 and row["bytes_per_step"] > 0
        assert row["preemptions"] == 0
    assert eng["ttft"][0]["cached_tokens"] == 128      # the whole prefix came from the cache
    assert [r["batch"] for r in eng["sampling"]] == [1, 4]   # greedy / sampled / penalized
    for row in eng["sampling"]:
        assert all(isinstance(row[f"{m}_ms"], float) for m in ("greedy", "sampled", "penalized"))
    assert data["results"]["steps"] == [
        {"step": "engine", "rc": 0, "seconds": data["results"]["steps"][0]["seconds"],
         "ok": True}]


def test_pytest_summary_parsing():
    tail = ("FAILED tests/kernels/test_triton.py::test_decode_triton[a] - AssertionError\n"
            "ERROR tests/kernels/test_x.py::test_y - RuntimeError\n"
            "= 2 failed, 257 passed, 7 skipped, 1 error in 81.20s (0:01:21) =\n")
    got = _pytest_counts(tail)
    assert (got["passed"], got["failed"], got["skipped"], got["error"]) == (257, 2, 7, 1)
    assert got["failed_tests"] == ["tests/kernels/test_triton.py::test_decode_triton[a]",
                                   "tests/kernels/test_x.py::test_y"]
