"""Fixtures and profile switches for the kernel tests (scoped to tests/kernels).

* ``@pytest.mark.slow`` cases run only when ``RADIXKV_PROFILE=soak``.
* Triton runs on CPU tensors under the Triton interpreter. Triton 3.9 reads ``TRITON_INTERPRET``
  when ``@triton.jit`` decorates -- its own standard library (``tl.zeros``, ``tl.sum``) included,
  at the first ``import triton`` -- so the variable must be set before anything in the process
  imports triton. This conftest sets it (on machines without CUDA) when triton is not imported
  yet; nothing else in the repository imports triton, and the variable changes nothing for code
  that does not decorate Triton kernels. If triton was already imported in compiled mode, the
  ``triton_backend`` fixture skips the in-process Triton cases and
  ``test_triton.py::test_triton_cases_in_subprocess`` reruns them in a fresh interpreter.
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

from triton_probe import triton_interpreted_here  # noqa: E402  (after the variable is set)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RADIXKV_PROFILE") == "soak":
        return
    skip = pytest.mark.skip(reason="slow: set RADIXKV_PROFILE=soak to run")
    for item in items:
        if "slow" in item.keywords and _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> str:
    """"triton", with "auto" launchers also routed to Triton; skips if not interpretable here."""
    pytest.importorskip("triton")
    if not triton_interpreted_here():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; "
                    "test_triton_cases_in_subprocess runs these cases")
    monkeypatch.setenv("RADIXKV_KERNEL_BACKEND", "triton")
    return "triton"
