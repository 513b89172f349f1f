"""What every benchmark shares: a run header, a median timer, a table printer, JSON results.

A benchmark answers one question, measures a baseline in the same run, and reports ratios.
Results go to ``benchmarks/results/<name>.json`` (override the folder with RADIXKV_RESULTS_DIR);
``--quick`` smoke runs go to a temporary folder instead (printed), so they never leave files
in the checkout.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    """Folder for JSON results: $RADIXKV_RESULTS_DIR, else benchmarks/results in the checkout."""
    env = os.environ.get("RADIXKV_RESULTS_DIR")
    path = Path(env) if env else REPO_ROOT / "benchmarks" / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def quick_results_dir() -> Path:
    """Folder for ``--quick`` runs: $RADIXKV_RESULTS_DIR, else ``<tmp>/radixkv-bench-quick``
    (smoke runs are not results worth committing)."""
    env = os.environ.get("RADIXKV_RESULTS_DIR")
    path = Path(env) if env else Path(tempfile.gettempdir()) / "radixkv-bench-quick"
    path.mkdir(parents=True, exist_ok=True)
    return path


def temp_results_unless_set(prefix: str = "radixkv-bench-") -> None:
    """Point $RADIXKV_RESULTS_DIR at a new temporary folder unless it is set (a ``--quick``
    run's results are not worth keeping). Not ``os.environ.setdefault(..., mkdtemp())``: that
    makes the folder even when the variable is set, and every test run left empty ones."""
    if not os.environ.get("RADIXKV_RESULTS_DIR"):
        os.environ["RADIXKV_RESULTS_DIR"] = tempfile.mkdtemp(prefix=prefix)


def is_quick(name: str, header: dict[str, Any]) -> bool:
    """Whether a result comes from a ``--quick`` run (its header says so, or its name)."""
    return bool(header.get("quick")) or re.search(r"[-_]quick\Z", name) is not None


def plain_doc(doc: str | None) -> str:
    r"""A module docstring's first paragraph as plain text for ``--help`` (no RST markup).

    >>> plain_doc("``radixkv bench x``: what :mod:`a.b` costs.\n\nMore.")
    'radixkv bench x: what a.b costs.'
    """
    first = (doc or "").strip().split("\n\n")[0]
    first = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", first)
    return " ".join(first.replace("``", "").split())


def cache_dir() -> Path:
    """Folder for derived data (tokenized traces): $RADIXKV_CACHE_DIR, else benchmarks/.cache."""
    env = os.environ.get("RADIXKV_CACHE_DIR")
    path = Path(env) if env else REPO_ROOT / "benchmarks" / ".cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def import_root(code: str | os.PathLike) -> str:
    """A folder to put first on ``PYTHONPATH`` so that a process imports ``radixkv`` and its
    ``radixkv.kernels`` / ``radixkv.benchmarks`` all from the source tree ``code`` (e.g. an
    export of an earlier commit, for a paired A/B).

    Why: in a source tree those two are the top-level folders ``kernels/`` and ``benchmarks/``
    that pyproject.toml maps into the package, so ``PYTHONPATH=code`` alone gives that tree's
    ``radixkv`` but this installation's kernels (an editable install maps them by name), and an
    A/B of a kernel change would compare the new kernel with itself. A tree that already holds
    ``radixkv/kernels`` is returned as is; otherwise a temporary folder whose ``radixkv/`` links
    every entry of ``code/radixkv`` plus ``kernels`` and ``benchmarks`` (removed at exit).
    scripts/gpu_check.sh builds the same layout in shell, since it runs where radixkv is not
    installed and nothing of it can be imported yet."""
    import atexit
    import shutil

    tree = Path(code).resolve()
    if (tree / "radixkv" / "kernels").exists() or not (tree / "kernels").is_dir():
        return str(tree)
    root = Path(tempfile.mkdtemp(prefix="radixkv-code-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    pkg = root / "radixkv"
    pkg.mkdir()
    for entry in (tree / "radixkv").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for sub in ("kernels", "benchmarks"):
        if (tree / sub).is_dir():
            (pkg / sub).symlink_to(tree / sub)
    return str(root)


def run_header(seed: int | None = None, **extra: Any) -> dict[str, Any]:
    """Commit, machine, versions and seed: printed first and stored with every result."""
    header: dict[str, Any] = {
        "commit": _git_commit(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "seed": seed,
    }
    for mod in ("torch", "triton", "transformers", "xxhash", "sortedcontainers"):
        m = sys.modules.get(mod)
        if m is not None:
            header[f"{mod}_version"] = getattr(m, "__version__", getattr(m, "VERSION", "?"))
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        header["device"] = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    header.update(extra)
    return header


def time_median(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1,
                number: int = 1) -> float:
    """Median wall time in seconds of ``number`` calls of fn, over ``repeat`` repetitions."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                title: str | None = None) -> None:
    """Print rows (dicts) as an aligned text table."""
    if not rows:
        return
    columns = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    if title:
        print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_results(name: str, header: dict[str, Any], results: Any) -> Path:
    """Write ``{"header": ..., "results": ...}`` to results_dir()/<name>.json (a quick run:
    quick_results_dir()); return the path."""
    quick = is_quick(name, header)
    path = (quick_results_dir() if quick else results_dir()) / f"{name}.json"
    path.write_text(json.dumps({"header": header, "results": results}, indent=2, default=str))
    print(f"\nwrote {path}" + (" (a --quick run: kept out of benchmarks/results)" if quick
                               else ""))
    return path
