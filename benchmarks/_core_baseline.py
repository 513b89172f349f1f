"""The core of an earlier commit, importable beside the current one (for ``bench core``'s
before/after columns).

``load_core(commit)`` copies ``radixkv/core/*.py`` as of ``commit`` (``git show``) into a temporary
package ``radixkv_core_<commit>``, with its ``radixkv.core.`` imports pointed at that package, and
returns its ``BlockManager`` class. ``radixkv.core.hashing`` and ``radixkv.errors`` stay shared.
So one process times the old and the new bookkeeping on the same trace, machine and load.
Needs a git checkout; returns None (and says why) without one.
"""

from __future__ import annotations

import atexit
import importlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from radixkv.benchmarks._common import REPO_ROOT

#: The last commit before issue 14 (path-compressed/O(1) bookkeeping) changed radixkv/core.
BEFORE_ISSUE_14 = "2947032"


def load_core(commit: str) -> tuple[Any, str] | None:
    """``(BlockManager class, package name)`` of ``radixkv/core`` at ``commit``, or None."""
    try:
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:radixkv/core"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                               check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"(no baseline: cannot read radixkv/core at {commit}: {exc})")
        return None
    pkg = f"radixkv_core_{commit}"
    root = Path(tempfile.mkdtemp(prefix="radixkv-core-baseline-"))
    # removed when the process ends, not before: the package imports its modules lazily
    atexit.register(shutil.rmtree, root, True)
    (root / pkg).mkdir()
    for name in names.stdout.split():
        if not name.endswith(".py"):
            continue
        src = subprocess.run(["git", "show", f"{commit}:radixkv/core/{name}"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=30, check=True).stdout
        # hashing stays shared: the Namespace type (and the hashes) must be the same objects
        src = src.replace("radixkv.core.", f"{pkg}.")
        src = src.replace(f"{pkg}.hashing", "radixkv.core.hashing")
        (root / pkg / name).write_text(src)
    sys.path.insert(0, str(root))
    try:
        mod = importlib.import_module(f"{pkg}.block_manager")
    finally:
        sys.path.remove(str(root))
    return mod.BlockManager, pkg


_PARTS: dict[str, SimpleNamespace | None] = {}


def _make_policy(pkg: str) -> Any:
    """``make_policy`` of a loaded core: in ``policy_registry`` since the registry left
    ``policy.py`` (issue 30: one-way imports), in ``policy`` before."""
    try:
        return importlib.import_module(f"{pkg}.policy_registry").make_policy
    except ModuleNotFoundError:
        return importlib.import_module(f"{pkg}.policy").make_policy


def load_core_parts(commit: str) -> SimpleNamespace | None:
    """``radixkv/core`` at ``commit`` as what a replay builds a manager from: a namespace with
    ``BlockManager``, ``RadixTree``, ``BlockPool``, ``make_policy`` and ``commit`` (loaded once
    per process), or None without a git checkout (``bench hit-rate --workloads --baseline``)."""
    if commit not in _PARTS:
        loaded = load_core(commit)
        if loaded is None:
            _PARTS[commit] = None
        else:
            pkg = loaded[1]
            mod = sys.modules.__getitem__
            _PARTS[commit] = SimpleNamespace(
                commit=commit, BlockManager=loaded[0], RadixTree=mod(f"{pkg}.tree").RadixTree,
                BlockPool=mod(f"{pkg}.pool").BlockPool,
                make_policy=_make_policy(pkg))
    return _PARTS[commit]
