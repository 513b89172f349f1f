"""The source tree's ``kernels/`` folder is ``radixkv.kernels``, never a top-level ``kernels``.

Where the tree's root is on ``sys.path`` (``python -m pytest`` or ``python -c`` run there), a
plain ``import kernels`` finds this folder before site-packages. transformers >= 5.25 imports
Hugging Face's ``kernels`` package (``from kernels import CUDAProperties``) when it is installed,
and every model load failed on the folder instead. These run Python in the tree's root, as a
user would, and fail on a ``kernels/__init__.py`` that does not hand the name over.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import radixkv.kernels

ROOT = Path(radixkv.kernels.__file__).resolve().parent.parent
FOLDER = str(ROOT / "kernels")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_import_kernels_in_the_tree_root_is_never_this_folder():
    done = _run("import os, sys; from importlib.machinery import PathFinder\n"
                "root = os.getcwd()\n"
                "rest = [p for p in sys.path if p not in ('', root)]\n"
                "other = PathFinder.find_spec('kernels', rest)\n"
                "try:\n"
                "    import kernels\n"
                "except ModuleNotFoundError:\n"
                "    print('absent', other is None)\n"
                "else:\n"
                "    print('found', os.path.dirname(os.path.abspath(kernels.__file__)),\n"
                "          other is not None and kernels.__spec__.origin == other.origin)\n")
    assert done.returncode == 0, done.stderr
    what, *rest = done.stdout.split()
    if what == "found":  # Hugging Face's package is installed (transformers >= 5.25 needs it)
        assert rest[0] != FOLDER and rest[1] == "True", done.stdout
    else:
        assert rest == ["True"], done.stdout


def test_without_another_kernels_the_name_is_absent_and_nothing_is_left_behind():
    done = _run("import sys\n"
                "sys.path = [p for p in sys.path if 'site-packages' not in p]\n"
                "try:\n"
                "    import kernels\n"
                "except ModuleNotFoundError as error:\n"
                "    print(error.name, 'kernels' in sys.modules)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kernels", "False"]


def test_transformers_loads_a_model_class_in_the_tree_root():
    done = _run("import transformers.activations\n"
                "from transformers import AutoConfig, LlamaConfig\n"
                "print(type(AutoConfig.for_model('llama')).__name__)\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "LlamaConfig"
