"""The server's CPU defaults (issue 33, item 4): threads from the affinity mask capped by the
cgroup quota, and ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it. The effect under
load is measured by ``radixkv bench serve --background-load N`` (docs/serve.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixkv.server import cpu


@pytest.mark.parametrize("text, quota", [("150000 100000\n", 1.5), ("max 100000\n", None),
                                         ("400000 100000", 4.0), ("garbage", None)])
def test_cgroup_v2_quota(tmp_path: Path, text: str, quota: float | None) -> None:
    (tmp_path / "cpu.max").write_text(text)
    assert cpu.cgroup_quota(tmp_path) == quota


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    base = tmp_path / "cpu,cpuacct"
    base.mkdir()
    (base / "cpu.cfs_quota_us").write_text("50000\n")
    (base / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu.cgroup_quota(tmp_path) == 0.5
    (base / "cpu.cfs_quota_us").write_text("-1\n")       # unlimited
    assert cpu.cgroup_quota(tmp_path) is None
    assert cpu.cgroup_quota(tmp_path / "absent") is None


@pytest.mark.parametrize("affinity, quota, torch_default, want",
                         [(8, None, 8, 8), (8, 1.5, 8, 2), (8, 0.2, 8, 1), (4, 6.0, 8, 4),
                          (16, None, 8, 8)])
def test_default_threads(monkeypatch, affinity, quota, torch_default, want) -> None:
    monkeypatch.setattr(cpu, "affinity_cpus", lambda: affinity)
    monkeypatch.setattr(cpu, "cgroup_quota", lambda: quota)
    n, why = cpu.default_threads(torch_default)
    assert n == want and why["affinity"] == affinity and why["quota"] == quota


def test_wait_policy_is_passive_unless_the_environment_says(monkeypatch) -> None:
    # as in `radixkv serve` before the model loads
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    env: dict[str, str] = {}
    line = cpu.prepare_openmp(env)
    assert line.startswith("PASSIVE, GOMP_SPINCOUNT 2000") and env == {
        "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": cpu.DEFAULT_SPIN_COUNT}
    env = {"GOMP_SPINCOUNT": "0"}   # the user's spin count is kept (0: sleep at once)
    assert "GOMP_SPINCOUNT 0" in cpu.prepare_openmp(env) and env["GOMP_SPINCOUNT"] == "0"
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert "from the environment" in cpu.prepare_openmp(env) and env == {
        "OMP_WAIT_POLICY": "ACTIVE"}   # nothing added to a policy the user chose
    env = {"OMP_WAIT_POLICY": ""}
    assert "runtime's default" in cpu.prepare_openmp(env) and env["OMP_WAIT_POLICY"] == ""


@pytest.mark.parametrize("env, spins", [
    ({}, 300_000),                                             # libgomp's default
    ({"OMP_WAIT_POLICY": "PASSIVE"}, 0),
    ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "2000"}, 2000),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, 30_000_000_000),
    ({"GOMP_SPINCOUNT": "20k"}, 20_000),
    ({"GOMP_SPINCOUNT": "3M"}, 3_000_000),
    ({"GOMP_SPINCOUNT": "infinite"}, 2**63 - 1),
    ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "lots"}, 0),   # invalid: ignored
])
def test_openmp_spin_count_reads_the_environment_as_libgomp(env, spins) -> None:
    from radixkv.config import openmp_spin_count

    assert openmp_spin_count(env) == spins


def test_server_defaults_make_small_forwards_use_every_thread() -> None:
    """The default spin count reaches the runner's threshold; PASSIVE alone does not."""
    from radixkv.config import openmp_spin_count
    from radixkv.engine.model_runner import SPIN_FOR_SMALL_FORWARDS

    assert int(cpu.DEFAULT_SPIN_COUNT) >= SPIN_FOR_SMALL_FORWARDS
    env: dict[str, str] = {}
    cpu.prepare_openmp(env)
    assert openmp_spin_count(env) >= SPIN_FOR_SMALL_FORWARDS
    assert openmp_spin_count({"OMP_WAIT_POLICY": "PASSIVE"}) < SPIN_FOR_SMALL_FORWARDS


def test_too_late_is_said_not_pretended(monkeypatch) -> None:
    import torch  # noqa: F401  (loaded: its OpenMP runtime has read the environment)

    env: dict[str, str] = {}
    assert "torch was loaded" in cpu.prepare_openmp(env) and "OMP_WAIT_POLICY" not in env


def test_apply_threads_sets_torch(monkeypatch) -> None:
    import torch

    before = torch.get_num_threads()
    try:
        assert cpu.apply_threads(1) == "1 CPU threads (--threads)" and torch.get_num_threads() == 1
        monkeypatch.setattr(cpu, "affinity_cpus", lambda: 64)
        monkeypatch.setattr(cpu, "cgroup_quota", lambda: 1.0)
        torch.set_num_threads(2)
        line = cpu.apply_threads(None)
        assert torch.get_num_threads() == 1 and "quota 1 CPUs" in line and "affinity 64" in line
    finally:
        torch.set_num_threads(before)


def test_bench_compares_the_default_with_every_other_setting() -> None:
    from radixkv.benchmarks.bench_serve import contention_settings

    got = contention_settings(4, 2)
    assert [(n, t) for n, t, _ in got] == [
        ("default (2 threads)", None), ("threads=1", 1), ("threads=3", 3), ("threads=4", 4),
        ("threads=2,passive-nospin", 2), ("threads=4,omp-default", 4)]
    assert got[0][2] == {} and got[-1][2] == {"OMP_WAIT_POLICY": ""}
    assert got[-2][2] == {"OMP_WAIT_POLICY": "PASSIVE"}   # the default before the short poll


def test_serve_sets_the_wait_policy_before_anything_loads_torch() -> None:
    """Everything ``radixkv serve`` runs before :func:`cpu.prepare_openmp` (the ``radixkv``
    entry point, the server's flag parser and its configs) leaves torch unloaded, so libgomp
    reads ``PASSIVE`` when torch loads it. If an import on that path loaded torch, the server
    would fall back to spinning threads: issue 33's 4-client replay with 2 threads and the cache
    off then took 176-364 s instead of 20-45 s (reproduced on the 2-core box beside 2 busy
    processes: 384 s spinning, 36 s PASSIVE; docs/serve.md)."""
    import subprocess

    code = ("import sys, radixkv.cli, radixkv.server.cli as c\n"
            "c.configs(c.build_parser().parse_args([]))\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
