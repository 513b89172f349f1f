"""benchmarks._common.import_root: a paired A/B against another source tree runs that tree's
``radixkv`` *and* its kernels (which a source tree keeps in top-level folders)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from radixkv.benchmarks._common import import_root

_PROBE = ("import radixkv, radixkv.kernels, radixkv.benchmarks; "
          "print(radixkv.MARK, radixkv.kernels.MARK, radixkv.benchmarks.MARK)")


def _tree(root: Path) -> Path:
    for sub, mark in (("radixkv", "pkg"), ("kernels", "kern"), ("benchmarks", "bench")):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text(f"MARK = {mark!r}\n")
    return root


def _imports(pythonpath: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_source_tree_is_imported_whole_kernels_included(tmp_path):
    tree = _tree(tmp_path / "old")
    root = import_root(tree)
    assert root != str(tree)
    assert _imports(root, tmp_path) == "pkg kern bench"
    # the tree itself is left as it was
    assert sorted(p.name for p in (tree / "radixkv").iterdir()) == ["__init__.py"]


def test_a_tree_that_already_holds_its_kernels_is_used_as_is(tmp_path):
    tree = _tree(tmp_path / "wheel-like")
    (tree / "kernels").rename(tree / "radixkv" / "kernels")
    (tree / "benchmarks").rename(tree / "radixkv" / "benchmarks")
    assert import_root(tree) == str(tree.resolve())
    assert _imports(str(tree), tmp_path) == "pkg kern bench"
