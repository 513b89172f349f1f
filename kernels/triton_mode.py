"""Whether this process runs Triton compiled (CUDA) or interpreted (CPU), and a clear error when
the tensors do not match the mode.

Triton 3.9 reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function -- including its
own standard library (``tl.zeros``, ``tl.sum``...) when ``triton`` is first imported. So the mode is
fixed per process by the environment at the first ``import triton``: set ``TRITON_INTERPRET=1``
before anything imports triton to run these kernels on CPU tensors (tests/kernels/conftest.py does).
"""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction

from radixkv.errors import ConfigError


def check_mode(kernel: object, device: torch.device) -> None:
    """Raise ConfigError unless ``kernel`` can run on tensors on ``device``."""
    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type != "cuda" and not interpreted:
        raise ConfigError(
            f"Triton kernels need CUDA tensors, got {device}; to run them on the CPU set "
            "TRITON_INTERPRET=1 before triton is first imported, or use backend='torch'")
    if device.type == "cuda" and interpreted:
        raise ConfigError("triton was imported with TRITON_INTERPRET=1: kernels would run "
                          "interpreted on the host; unset it to compile for CUDA")


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) runs under the Triton interpreter."""
    return isinstance(kernel, InterpretedFunction)
