"""Paged-attention kernels (installed as radixkv.kernels). See docs/kernels.md.

Each operation has three implementations behind one checked launcher: a Triton kernel
(``triton_attention``, ``triton_cache``; used on CUDA), an efficient torch path (``torch_path``;
used on the CPU) and a plain reference (``reference``; for tests).
"""

from .ops import (
    copy_blocks,
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    scatter_blocks,
    write_kv,
)
from .reference import PAD_SLOT
from .windowed import paged_attention_windowed

__all__ = [
    "PAD_SLOT", "write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks",
    "gather_blocks", "scatter_blocks", "paged_attention_windowed",
]
