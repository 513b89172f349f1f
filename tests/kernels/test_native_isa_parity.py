"""The AVX2 build's float32 kernels give the AVX-512 build's bits (docs/kernels.md, "AVX2 with
FMA").

``DEFINE_PREFILL8`` in ``cpu_attention.c`` is written as the AVX-512 float32 prefill's
arithmetic lane for lane in two 8-lane halves, so a server's prefill output does not depend on
which of the two a machine builds. Only a CPU with AVX-512 can run both: this builds the library
a second time for ``x86-64-v3`` (AVX2 + FMA: ``$RADIXKV_NATIVE_MARCH``), runs
``isa_parity_probe.py`` under each build in a fresh interpreter (float, int8 and fp8 caches,
every head dim, groups 1-8, chunks across 16-row tiles) and compares the outputs to the bit:
prefill (two 8-lane halves written as the 16-lane kernel's arithmetic) and decode (the same
AVX2 heads in both builds since 2026-12-07).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixkv.kernels import native

HERE = Path(__file__).resolve().parent

pytestmark = [
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets"),
    pytest.mark.skipif(native._compiler() is None, reason="no C compiler"),
    pytest.mark.skipif("avx512f" not in native._cpu_flags().split(),
                       reason="needs AVX512F (to run the AVX-512 and the AVX2 build side by side)"),
]


def _outputs(tmp_path: Path, march: str | None) -> dict:
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop(native.MARCH_VAR, None)
    if march is not None:   # its own cache folder; the native build is the suite's own
        env[native.MARCH_VAR] = march
        env["RADIXKV_CACHE_DIR"] = str(tmp_path / march)
    path = tmp_path / f"{march or 'native'}.pt"
    done = subprocess.run([sys.executable, str(HERE / "isa_parity_probe.py"), str(path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=HERE)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(path)


def test_avx2_build_is_the_avx512_build_to_the_bit(tmp_path):
    wide = _outputs(tmp_path, None)
    narrow = _outputs(tmp_path, "x86-64-v3")
    # the two libraries are the two builds: only the native one has the bf16 prefill, where the
    # CPU has AVX512-BF16 (the AVX2 build has none)
    assert narrow.pop("bf16_prefill_ran") is False
    wide.pop("bf16_prefill_ran")
    assert wide.keys() == narrow.keys()
    assert len(wide) == 2 * 3 * 4 * len(native.HEAD_DIMS)   # prefill and decode, 3 caches
    differ = [k for k in wide if not torch.equal(wide[k], narrow[k])]
    assert not differ, differ
