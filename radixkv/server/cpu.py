"""CPU threads for a server that shares its cores: how many, and how idle threads wait.

Why: torch's default is one OpenMP thread per physical core of the machine, and the GNU OpenMP
runtime (libgomp, which torch's Linux wheels use) lets a thread that finished its share of a
parallel region spin for a while before it sleeps. On a machine whose cores are shared (other
processes, a container limited by a CPU quota or an affinity mask), every parallel region
then waits for its slowest thread, which may be descheduled, while the other threads burn the
CPU that thread needs: issue 33 measured a 60-token request at 10-78 s on a loaded 2-core box
with the defaults and 1.1-2.5 s with one thread or ``OMP_WAIT_POLICY=PASSIVE``.

So ``radixkv serve`` starts with:

* threads = the CPUs this process may actually use: the affinity mask
  (``os.sched_getaffinity``), capped by the cgroup's CPU quota (``cpu.max`` in cgroup v2,
  ``cpu.cfs_quota_us / cpu.cfs_period_us`` in v1), rounded up; never more than torch's own
  default. ``--threads`` overrides it.
* ``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=2000`` (idle threads poll ~20 us, then
  sleep) unless the environment sets the policy (an empty value keeps the runtime's own
  default: spin ~3 ms, then sleep); a ``GOMP_SPINCOUNT`` the environment sets is kept. The
  short poll (2026-11-28) lets a forward's threads catch its next parallel region without a
  wake-up, so small forwards use both cores (``model_runner.SPIN_FOR_SMALL_FORWARDS``).
  libgomp reads it once, when torch loads it, so it is set before torch is imported; when
  torch was already imported the effective policy is whatever was there, and the start-up
  line says so.

``radixkv bench serve --background-load N`` measures the result (docs/serve.md).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

#: What ``OMP_WAIT_POLICY`` is set to when the environment does not say.
DEFAULT_WAIT_POLICY = "PASSIVE"
#: ``GOMP_SPINCOUNT`` set with it (unless the environment sets one): an idle thread polls this
#: many iterations (~20 us) before it sleeps. Enough to catch the next parallel region of a
#: forward, so small forwards use every thread (``model_runner.SPIN_FOR_SMALL_FORWARDS``), and
#: far too little to take a descheduled thread's CPU for long: libgomp's own default polls
#: 150x longer, which is what collapsed under load.
DEFAULT_SPIN_COUNT = "2000"


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (``os.cpu_count()`` where there is no mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (e.g. 1.5), or None when unlimited or
    unknown. Reads cgroup v2's ``cpu.max`` (``"150000 100000"`` or ``"max 100000"``) of the
    process's own group, else v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    candidates = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and parts[0] == "0":          # v2: "0::/path"
                candidates.append(root / parts[2].lstrip("/") / "cpu.max")
    except OSError:
        pass
    candidates.append(root / "cpu.max")
    for path in candidates:
        try:
            limit, every = path.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if limit == "max":
            return None
        try:
            return int(limit) / int(every) if int(every) > 0 and int(limit) > 0 else None
        except ValueError:
            return None
    for base in (root / "cpu,cpuacct", root / "cpu"):
        try:
            quota = int((base / "cpu.cfs_quota_us").read_text())
            period = int((base / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def default_threads(torch_default: int | None = None) -> tuple[int, dict[str, object]]:
    """(threads, why): the CPUs this process may use (affinity, capped by the cgroup quota
    rounded up), at most ``torch_default`` (torch's own choice, the physical cores) when
    given; ``why`` holds the inputs for the start-up line."""
    cpus = affinity_cpus()
    quota = cgroup_quota()
    n = cpus if quota is None else max(1, min(cpus, math.ceil(quota)))
    if torch_default:
        n = min(n, torch_default)
    return max(1, n), {"affinity": cpus, "quota": quota, "torch_default": torch_default}


def prepare_openmp(environ: dict[str, str] | None = None) -> str:
    """Set ``OMP_WAIT_POLICY`` to :data:`DEFAULT_WAIT_POLICY` and ``GOMP_SPINCOUNT`` to
    :data:`DEFAULT_SPIN_COUNT` (unless set) unless the environment sets the policy, before
    torch (and its OpenMP runtime) is loaded. Returns what the start-up line reports:
    the policy and where it came from."""
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env:   # set, even empty (= the runtime's default): left alone
        given = env["OMP_WAIT_POLICY"]
        return f"{given} (from the environment)" if given else \
            "the OpenMP runtime's default (OMP_WAIT_POLICY is empty)"
    if "torch" in sys.modules:
        return "the OpenMP default (torch was loaded before radixkv could set it)"
    env["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
    spins = env.setdefault("GOMP_SPINCOUNT", DEFAULT_SPIN_COUNT)
    return (f"{DEFAULT_WAIT_POLICY}, GOMP_SPINCOUNT {spins} (radixkv's default; set "
            f"OMP_WAIT_POLICY to override)")


def apply_threads(requested: int | None) -> str:
    """Set torch's intra-op threads (``requested``, else :func:`default_threads`) and return
    the start-up line's description of the choice."""
    import torch

    if requested:
        torch.set_num_threads(requested)
        return f"{requested} CPU threads (--threads)"
    n, why = default_threads(torch.get_num_threads())
    torch.set_num_threads(n)
    quota = why["quota"]
    return (f"{n} CPU threads (affinity {why['affinity']} CPUs, cgroup quota "
            f"{'none' if quota is None else f'{quota:g} CPUs'}; --threads to change)")


__all__ = ["affinity_cpus", "apply_threads", "cgroup_quota", "default_threads",
           "prepare_openmp", "DEFAULT_WAIT_POLICY"]
