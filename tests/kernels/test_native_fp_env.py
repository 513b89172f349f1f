"""Loading the native kernels leaves the process's floating-point environment alone.

``-ffast-math`` makes gcc < 13 and clang link ``crtfastmath.o`` into a shared library, whose
constructor turns on flush-to-zero and denormals-are-zero; every later float operation of the
process, torch's included, then rounds subnormals to zero. Checked in a fresh interpreter (in
this one the library may already be loaded)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixkv.kernels import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"native kernel unavailable: {native._state.get('error')}")


def test_loading_the_kernels_keeps_subnormals():
    code = ("import torch; x = torch.tensor([1e-38]); before = (x * 0.01).item(); "
            "from radixkv.kernels import native; assert native.available(); "
            "print(before, (x * 0.01).item(), (torch.tensor([1e-39]) + 0).item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    before, after, kept = map(float, out)
    assert before > 0 and after == before and kept > 0
