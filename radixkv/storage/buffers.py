"""Tensor <-> raw bytes, the one place where a KV dtype name becomes a ``torch.dtype``.

The disk store writes and reads block payloads straight from/into tensor memory (a pinned host
slot, a staging tensor) through these views: no pickle, no intermediate copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixkv.errors import InvalidBlockError
from radixkv.storage.layout import TORCH_NAMES, KVLayout, dtype_name


def torch_dtype(name: str) -> torch.dtype:
    """``torch.dtype`` of a canonical or alias dtype name ("float16", "bf16"; the scaled
    ``fp8_e4m3`` KV format is stored as ``float8_e4m3fn``)."""
    canonical = dtype_name(name)
    dtype = getattr(torch, TORCH_NAMES.get(canonical, canonical))
    if not isinstance(dtype, torch.dtype):
        raise InvalidBlockError(f"{name!r} names no torch dtype")
    return dtype


def byte_view(tensor: torch.Tensor) -> memoryview:
    """Writable flat ``memoryview`` (format ``B``) over a contiguous CPU tensor's memory.

    Works for every dtype (bfloat16 and float8 included) because the tensor is reinterpreted as
    uint8 first; the view aliases the tensor, so writes into it land in the tensor.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise InvalidBlockError(
            f"byte_view needs a contiguous CPU tensor, got device={tensor.device}, "
            f"contiguous={tensor.is_contiguous()}")
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def check_blocks(blocks: torch.Tensor, layout: KVLayout, n: int | None = None,
                 what: str = "blocks") -> None:
    """Raise ``InvalidBlockError`` unless ``blocks`` is ``[n, *layout.block_shape]`` of layout.dtype
    (``n=None``: a single block of shape ``layout.block_shape``)."""
    want = layout.block_shape if n is None else (n, *layout.block_shape)
    if tuple(blocks.shape) != want or blocks.dtype != torch_dtype(layout.dtype):
        raise InvalidBlockError(
            f"{what}: expected shape {list(want)} dtype {layout.dtype}, "
            f"got shape {list(blocks.shape)} dtype {str(blocks.dtype).removeprefix('torch.')}")


def index_tensor(ids: Iterable[int], limit: int, what: str,
                 device: torch.device | str = "cpu", unique: bool = False) -> torch.Tensor:
    """int64 index tensor of ``ids`` after checking ``0 <= id < limit`` (and no duplicates when
    ``unique``: a scatter with duplicate targets would keep an arbitrary one)."""
    idx = [int(i) for i in ids]
    bad = [i for i in idx if not 0 <= i < limit]
    if bad:
        raise InvalidBlockError(f"{what} {bad[:5]} outside [0, {limit})")
    if unique and len(set(idx)) != len(idx):
        raise InvalidBlockError(f"duplicate {what} in one write: {sorted(idx)[:10]}...")
    return torch.tensor(idx, dtype=torch.int64, device=device)


__all__ = ["torch_dtype", "byte_view", "check_blocks", "index_tensor"]
