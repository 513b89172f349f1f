"""Whether, and where, this process runs the package's Triton kernels.

A module of its own, not a conftest function: ``from conftest import ...`` in a test resolves to
whichever directory's conftest Python imported first under that name, which depends on which
test folders one run collects (``pytest tests/engine tests/kernels`` got the engine's)."""

from __future__ import annotations

import torch


def triton_interpreted_here() -> bool:
    """True when this process runs the package's Triton kernels under the interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from radixkv.kernels import triton_attention
    except ImportError:
        return False
    return isinstance(triton_attention._decode_kernel, InterpretedFunction)


def triton_device_here() -> torch.device | None:
    """Where the Triton kernel cases run in this process: the CPU under the interpreter,
    CUDA when triton compiles and a GPU is present, else nowhere (None: triton was imported
    compiled on a machine without CUDA; test_triton_cases_in_subprocess reruns them)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    if triton_interpreted_here():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return None
