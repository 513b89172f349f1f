"""Each package's ``__init__`` states its public surface in ``__all__`` (issue 30), and every
name there resolves. Eager packages (``radixkv.core``) are imported; lazy ones (``radixkv``,
``radixkv.api``, ``radixkv.engine``, ``radixkv.fleet``, ``radixkv.server``: ``_LAZY`` maps each
name to its module, imported on first use) are checked from the AST of the module named, so the
test imports no torch, FastAPI or Ray."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import radixkv

ROOT = Path(radixkv.__file__).parent
LAZY_PACKAGES = ["radixkv", "radixkv.api", "radixkv.engine", "radixkv.fleet", "radixkv.server"]


def _top_level_names(module: str) -> set[str]:
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_every_package_declares_all() -> None:
    missing = [p.parent.relative_to(ROOT.parent).as_posix() for p in ROOT.rglob("__init__.py")
               if "__all__" not in p.read_text()]
    assert not missing, f"packages without __all__: {missing}"


def test_the_core_exports_resolve() -> None:
    core = importlib.import_module("radixkv.core")
    assert len(core.__all__) == len(set(core.__all__))
    assert [n for n in core.__all__ if not hasattr(core, n)] == []


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_lazy_exports_name_what_their_module_defines(package: str) -> None:
    pkg = importlib.import_module(package)
    lazy = pkg._LAZY
    assert set(lazy) <= set(pkg.__all__)
    wrong = [f"{n} (in {m})" for n, m in lazy.items() if n not in _top_level_names(m)]
    assert not wrong, f"{package}: _LAZY names its modules do not define: {wrong}"
