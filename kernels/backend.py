"""Which implementation a launcher runs: "triton", "torch" (efficient path) or "reference".

Resolution of ``backend=None`` / ``"auto"``:

1. ``$RADIXKV_KERNEL_BACKEND`` when set to one of the names above (tests use "triton");
2. else "triton" when the tensors are on CUDA and Triton imports;
3. else "torch".

An explicit backend name always wins over the environment. Triton on CPU tensors runs under the
Triton interpreter (as ``TRITON_INTERPRET=1`` would): slow, for tests only.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from radixkv.errors import ConfigError

BACKENDS = ("triton", "torch", "reference")
ENV_VAR = "RADIXKV_KERNEL_BACKEND"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Name of the implementation to run for tensors on ``device``."""
    if backend is None or backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env and env != "auto":
            if env not in BACKENDS:
                raise ConfigError(f"${ENV_VAR}={env!r}: expected one of {BACKENDS} or 'auto'")
            backend = env
        else:
            return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r}: expected None, 'auto' or one of {BACKENDS}")
    if backend == "triton" and not triton_available():
        raise ConfigError("backend='triton' but triton is not installed; use backend='torch'")
    return backend
