"""Quantized KV blocks: each (token, head) row of K or V is stored as ``head_dim`` 1-byte
values plus its own fp16 scale in the row's last 2 bytes (``KVLayout(dtype="int8")`` or
``KVLayout(dtype="fp8_e4m3")``: rows of ``head_dim + 2`` bytes).

Why per row, and why inside the row: decode appends one token at a time, so a per-row scale is
fixed when the row is written (a per-block scale would have to grow, re-quantizing the rows
already there); and a scale that lives in the block's own bytes makes the block
self-describing, so every tier move, disk file and remote value carries it unchanged. The cost
is 2 bytes per row: (d + 2) / (2 d) of bf16, 0.516x at d = 64.

The two formats share everything but the value grid (:data:`FORMATS`):

* ``int8``: symmetric, ``scale = max|x| / 127``, round to nearest; error per element
  <= scale / 2 (uniform over the row's range).
* ``fp8_e4m3``: ``scale = max|x| / 448`` (e4m3's largest finite value), then a cast to
  ``float8_e4m3fn`` (round to nearest even); 3 mantissa bits, so the error is relative to each
  element (<= 2^-4 of it), not to the row's maximum, down to e4m3's subnormals.

Rotation (why int8 first fell short): a K row of a Llama-family model has a few outlier
channels (per-channel RMS up to 12x the median on SmolLM2), so ``max|x|`` is set by them and
the many small channels keep few of the 255 levels. Every row is therefore multiplied by an
orthonormal Hadamard matrix ``H`` (:func:`rotation`) before it is quantized: the outliers are
spread over all channels, ``max|x H|`` falls to about 3 RMS, and the rounding error per row
drops accordingly. ``H`` is symmetric and its own inverse, and attention does not need the
rows back: ``q . k = (q H) . (k H)`` and ``sum p v = (sum p (v H)) H``, so attention reads
the rotated rows as they are, with the query rotated before and the output rotated after
(a ``[T, d] x [d, d]`` product each, instead of un-rotating every cached row). On SmolLM2 in
float32, 64-token greedy continuations identical to float32 KV's went from 13/32 (plain per-row
int8) to 19/32 (bf16 KV: 29/32), perplexity +0.03% (docs/quantization.md).

In both, the scale is rounded to fp16 *before* it is used, so dequantization uses exactly the
scale the values were quantized with, and an all-zero row keeps scale 0 and values 0. The
cache tensor's torch dtype (``int8`` or ``float8_e4m3fn``) says which format a cache holds;
the scale's 2 bytes are reinterpreted in place (``Tensor.view``), never converted.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools
import math

import torch

from radixkv.errors import ConfigError


@dataclass(frozen=True)
class QuantFormat:
    """One quantized KV format: its name (``CacheConfig.kv_dtype``, ``KVLayout.dtype``), the
    torch dtype of its cache tensor and the largest magnitude of its value grid."""

    name: str
    storage: torch.dtype
    qmax: float
    rotated: bool = True


FORMATS: dict[str, QuantFormat] = {
    "int8": QuantFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": QuantFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
}
_BY_STORAGE = {f.storage: f for f in FORMATS.values()}
#: Back-compat: the int8 grid's largest value.
QMAX = FORMATS["int8"].qmax
#: Largest fp16 value: a scale is clamped to it (rows beyond 65504 * qmax do not occur in KV).
_FP16_MAX = 65504.0


@functools.lru_cache(maxsize=None)
def _hadamard(d: int) -> torch.Tensor:
    """float32 ``[d, d]``: block-diagonal normalized Sylvester-Hadamard matrices of size ``b``,
    the largest power of two dividing ``d`` (``d`` = 64 or 128: one block). Symmetric and
    orthonormal, so it is its own inverse."""
    b = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*([h / math.sqrt(b)] * (d // b)))


def rotation(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 rotation ``H`` applied to rows of ``d`` values (cached per device)."""
    return _rotation_on(d, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _rotation_on(d: int, device: str) -> torch.Tensor:
    return _hadamard(d).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x @ H`` over the last axis, computed in float32, returned in ``x``'s dtype (its own
    inverse: ``rotate(rotate(x)) == x`` up to rounding)."""
    return (x.float() @ rotation(x.shape[-1], x.device)).to(x.dtype)


def format_of(dtype: torch.dtype) -> QuantFormat | None:
    """The quantized format whose cache tensor has ``dtype``; None for a plain float cache."""
    return _BY_STORAGE.get(dtype)


def get_format(kv_dtype: str) -> QuantFormat:
    """The :class:`QuantFormat` named ``kv_dtype``; ConfigError for any other name."""
    try:
        return FORMATS[kv_dtype]
    except KeyError:
        raise ConfigError(f"unknown quantized KV dtype {kv_dtype!r}; use one of "
                          f"{sorted(FORMATS)}") from None


def row_scales(x: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """``[..., 1]`` fp16 scales of the rows of ``x`` (``max|x| / qmax``, clamped to fp16)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    return (amax / fmt.qmax).clamp_(max=_FP16_MAX).to(torch.float16)


def quantize_rows(x: torch.Tensor, kv_dtype: str = "int8") -> torch.Tensor:
    """``[..., d]`` float -> ``[..., d + 2]`` in the format's storage dtype (the rotated row's
    values, then the fp16 scale's two bytes)."""
    fmt = get_format(kv_dtype)
    xf = x.float()
    if fmt.rotated:
        xf = xf @ rotation(xf.shape[-1], xf.device)
    scale = row_scales(xf, fmt)
    s = scale.float()
    y = torch.where(s > 0, xf / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xf))
    if fmt.storage == torch.int8:
        y = torch.round(y)
    q = y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.storage)
    return torch.cat([q.view(torch.int8), scale.view(torch.int8)], dim=-1).view(fmt.storage)


def dequantize_rows(qx: torch.Tensor, dtype: torch.dtype, rotated: bool = False
                    ) -> torch.Tensor:
    """``[..., d + 2]`` quantized rows (int8 or float8_e4m3fn) -> ``[..., d]`` in ``dtype``:
    the original rows, or with ``rotated=True`` the rotated rows as stored (what attention
    reads, see the module doc)."""
    fmt = format_of(qx.dtype)
    if fmt is None:
        raise TypeError(f"not a quantized KV tensor: {qx.dtype}")
    scale = qx[..., -2:].contiguous().view(torch.float16).float()
    y = qx[..., :-2].float() * scale
    if fmt.rotated and not rotated:
        y = y @ rotation(y.shape[-1], y.device)
    return y.to(dtype)


def write_quantized(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize this step's ``[T, Hkv, d]`` K/V rows once, in the format of the caches
    ``[N, block_size, Hkv, d + 2]``, and scatter them at ``slot_mapping`` (PAD slots, -1,
    skipped): the quantized counterpart of the kernels' ``write_kv``."""
    fmt = format_of(k_cache.dtype)
    if fmt is None or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"write_quantized needs quantized caches, got {k_cache.dtype} / "
                        f"{v_cache.dtype}")
    keep = slot_mapping >= 0
    slots = slot_mapping if bool(keep.all()) else slot_mapping[keep]
    for x, cache in ((key, k_cache), (value, v_cache)):
        rows = quantize_rows(x if slots is slot_mapping else x[keep], fmt.name)
        # index_copy_ is not implemented for float8 on every backend: scatter the bytes.
        flat = cache.view(torch.int8).view(-1, *cache.shape[2:])
        flat.index_copy_(0, slots, rows.view(torch.int8))


__all__ = ["QuantFormat", "FORMATS", "QMAX", "format_of", "get_format", "row_scales",
           "rotation", "rotate",
           "quantize_rows", "dequantize_rows", "write_quantized"]
