"""Fixtures and profile switches for the kernel tests (scoped to tests/kernels).

* ``@pytest.mark.slow`` cases run only when ``RADIXKV_PROFILE=soak``.
* Triton runs on CPU tensors under the Triton interpreter. Triton 3.9 reads ``TRITON_INTERPRET``
  when ``@triton.jit`` decorates -- its own standard library (``tl.zeros``, ``tl.sum``) included,
  at the first ``import triton`` -- so the variable must be set before anything in the process
  imports triton. This conftest sets it (on machines without CUDA) when triton is not imported
  yet; nothing else in the repository imports triton, and the variable changes nothing for code
  that does not decorate Triton kernels.
* On a machine with CUDA the variable is left unset and the same Triton cases run compiled on
  the GPU (``triton_device`` fixture), and ``test_triton_cases_in_subprocess`` reruns them
  interpreted. If triton was already imported compiled on a machine without CUDA, the
  ``triton_backend`` fixture skips the in-process Triton cases and that test reruns them in a
  fresh interpreter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton_probe import triton_device_here  # noqa: E402  (after the variable is set)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RADIXKV_PROFILE") == "soak":
        return
    skip = pytest.mark.skip(reason="slow: set RADIXKV_PROFILE=soak to run")
    for item in items:
        if "slow" in item.keywords and _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    """"triton", with "auto" launchers also routed to Triton; skips if Triton cannot run in
    this process (see :func:`triton_device_here`)."""
    pytest.importorskip("triton")
    if triton_device_here() is None:
        pytest.skip("triton was imported compiled on a machine without CUDA (before "
                    "TRITON_INTERPRET=1 could be set); test_triton_cases_in_subprocess runs "
                    "these cases")
    monkeypatch.setenv("RADIXKV_KERNEL_BACKEND", "triton")
    return "triton"


@pytest.fixture
def triton_device(triton_backend: str) -> torch.device:
    """The device the Triton cases run on here: CUDA (compiled kernels) on a machine with a
    GPU, the CPU (interpreted) otherwise."""
    device = triton_device_here()
    assert device is not None
    return device
