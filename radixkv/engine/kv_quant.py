"""int8 KV blocks: each (token, head) row of K or V is stored as ``head_dim`` int8 values plus
its own fp16 scale in the row's last 2 bytes (``KVLayout(dtype="int8")``: rows of
``head_dim + 2`` int8).

Why per row, and why inside the row: decode appends one token at a time, so a per-row scale is
fixed when the row is written (a per-block scale would have to grow, re-quantizing the rows
already there); and a scale that lives in the block's own bytes makes the block
self-describing, so every tier move, disk file and remote value carries it unchanged. The cost
is 2 bytes per row: (d + 2) / (2 d) of bf16, 0.516x at d = 64.

Symmetric: ``scale = max|x| / 127`` (rounded to fp16 first, then used to quantize, so that
dequantization uses exactly the scale the values were rounded with); an all-zero row keeps
scale 0 and values 0. Error per element <= scale / 2.
"""

from __future__ import annotations

import torch

QMAX = 127.0


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` float -> ``[..., d + 2]`` int8 (values, then the fp16 scale's bytes)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).to(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, torch.round(xf / torch.where(s > 0, s, torch.ones_like(s))),
                    torch.zeros_like(xf)).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(qx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., d + 2]`` int8 -> ``[..., d]`` in ``dtype``."""
    scale = qx[..., -2:].contiguous().view(torch.float16).float()
    return (qx[..., :-2].float() * scale).to(dtype)


def write_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize this step's ``[T, Hkv, d]`` K/V rows once and scatter them into the int8
    caches ``[N, block_size, Hkv, d + 2]`` at ``slot_mapping`` (PAD slots, -1, skipped): the
    quantized counterpart of the kernels' ``write_kv``."""
    keep = slot_mapping >= 0
    slots = slot_mapping if bool(keep.all()) else slot_mapping[keep]
    for x, cache in ((key, k_cache), (value, v_cache)):
        rows = quantize_rows(x if slots is slot_mapping else x[keep])
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


__all__ = ["quantize_rows", "dequantize_rows", "write_quantized", "QMAX"]
