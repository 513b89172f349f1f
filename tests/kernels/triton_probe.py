"""Whether this process runs the package's Triton kernels under the interpreter.

A module of its own, not a conftest function: ``from conftest import ...`` in a test resolves to
whichever directory's conftest Python imported first under that name, which depends on which
test folders one run collects (``pytest tests/engine tests/kernels`` got the engine's)."""

from __future__ import annotations


def triton_interpreted_here() -> bool:
    """True when this process runs the package's Triton kernels under the interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from radixkv.kernels import triton_attention
    except ImportError:
        return False
    return isinstance(triton_attention._decode_kernel, InterpretedFunction)
