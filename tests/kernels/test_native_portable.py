"""The native kernels built for a CPU without AVX2 or AVX-512 (``RADIXKV_NATIVE_MARCH=x86-64-v2``)
pass the same tests: decode runs its generic C code, the prefill kernels decline (their AVX2 and
AVX-512 bodies are compiled out) and the torch path takes over: older x86-64 CPUs, and any
machine whose build is pinned to that target. (An AVX2 laptop's ``-march=native`` build runs the
float32 prefill and decode in AVX2; the suite's own run covers whichever the machine has.)
Runs the kernel test module in a fresh interpreter with its own cache folder."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.kernels import native

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets"),
    pytest.mark.skipif(native._compiler() is None, reason="no C compiler"),
]


def test_kernels_built_without_avx_pass_the_kernel_tests(tmp_path):
    env = dict(os.environ, RADIXKV_NATIVE_MARCH="x86-64-v2", RADIXKV_CACHE_DIR=str(tmp_path))
    tests = Path(__file__).with_name("test_native_kernels.py")
    # the build machinery's own tests (the cache, a compiler without OpenMP) do not depend on
    # the target and rebuild the library themselves (~60 s here): run them once, in the suite
    machinery = "not build_is_cached and not compiler_without_openmp"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-rs", "-k", machinery, str(tests)], env=env, capture_output=True,
                          text=True,
                          timeout=900, cwd=Path(__file__).parents[2])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "needs AVX512-BF16" in out, out[-4000:]           # prefill declined, as it must
    assert "needs AVX512F or AVX2 + FMA" in out, out[-4000:]
    assert "native kernel unavailable" not in out, out[-4000:]
    built = list((tmp_path / "kernels").glob("cpu_attention-*.so"))
    assert len(built) == 1, built
