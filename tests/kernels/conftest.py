"""Fixtures and profile switches for the kernel tests (scoped to tests/kernels).

* ``@pytest.mark.slow`` cases run only when ``RADIXKV_PROFILE=soak``.
* Triton runs on CPU tensors under the Triton interpreter. The launchers build interpreted
  kernels for CPU tensors themselves (whatever ``TRITON_INTERPRET`` said when triton was first
  imported; triton reads it when ``@triton.jit`` decorates), so nothing here has to be set before
  other test folders import torch or triton. The ``triton_interpret`` fixture still sets the
  variable for the duration of each Triton test, as the issue asks, and restores it after.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RADIXKV_PROFILE") == "soak":
        return
    skip = pytest.mark.skip(reason="slow: set RADIXKV_PROFILE=soak to run")
    for item in items:
        if "slow" in item.keywords and _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def triton_interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run "auto" launchers on Triton, interpreted, for one test."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("RADIXKV_KERNEL_BACKEND", "triton")
