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
float32 the rotation cut int8's teacher-forced flips from 12.7 to 7.8 per 1,000 tokens; int8 then
keeps the full-precision top-1 token more often than a bf16 model does (99.27% against 98.44%;
docs/quantization.md). fp8_e4m3 does not (97.31%): its error is relative to each element, 4.5x
rotated int8's, and an engine started with it warns (:func:`fp8_warning`).

In both, the scale is rounded to fp16 *before* it is used, so dequantization uses exactly the
scale the values were quantized with, and an all-zero row keeps scale 0 and values 0. The
cache tensor's torch dtype (``int8`` or ``float8_e4m3fn``) says which format a cache holds;
the scale's 2 bytes are reinterpreted in place (``Tensor.view``), never converted.
"""

from __future__ import annotations

from dataclasses import dataclass

import functools
import math
from collections.abc import Sequence

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


#: ``(b << 7) & _E4M3_F16_MASK`` turns an e4m3 byte ``b`` (sign-extended to int16) into the
#: fp16 whose value is 2^-8 times b's: sign to bit 15, exponent and mantissa to bits 13..7
#: (fp16's exponent bias is 15, e4m3's 7, so fp16 reads the exponent 8 too low; e4m3
#: subnormals land on fp16 subnormals, which are exact). 0xBF80 as a signed int16.
_E4M3_F16_MASK = -0x4080
#: e4m3 byte values read through fp16 are 2^-8 of the real ones: this goes into the scale.
_E4M3_F16_UNSCALE = 256.0


class Workspace:
    """Reusable tensors by name, grown on demand and never shrunk.

    A multi-megabyte tensor allocated afresh for every layer is handed back to the OS when
    freed and page-faulted in again by the next one; on the CPU that costs more than the
    arithmetic (docs/quantization.md). One workspace serves the layers of one forward pass:
    a layer's dequantized blocks are dead once its attention has returned.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """An uninitialized contiguous ``shape`` tensor, valid until the next ``get(name)``."""
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._bufs[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(*shape)


#: Values dequantized per chunk: the chunk's float output (512 KiB in float32) stays in L2
#: between the widening copy and the in-place multiply (a microbenchmark, a layer's K and V
#: of 264 blocks of 16 x 3 x 64 rows: 0.70 ms in chunks of about this size, 0.78 ms in one).
_CHUNK_ELEMS = 1 << 17


def _scaled_values(raw: torch.Tensor, storage: torch.dtype, out: torch.Tensor,
                   work: Workspace | None, name: str) -> torch.Tensor:
    """``[R, ..., d + 2]`` quantized rows as int8 bytes -> ``out`` ``[R, ..., d]``: values
    times their scale (the stored, rotated domain), in ``out``'s dtype.

    The values are widened into ``out`` by a ``copy_`` and scaled in place, chunk by chunk
    along the first axis: a multiply of mixed dtypes would first copy its int8 operand into a
    fresh float tensor. e4m3 values (``storage`` float8_e4m3fn) are not cast (torch's float8 ->
    float32 conversion on the CPU is ~10x slower than int8's): their bytes are moved into
    fp16 bit positions with two int16 operations and the fp16 read scaled by 2^8, exactly
    (see ``_E4M3_F16_MASK``). The NaN codes 0x7f / 0xff, which are never written (values are
    clamped to +-448), read as +-480 there. Every value of both grids is exact in bf16 and
    fp16 too, so ``out`` rounds once, after the multiply.
    """
    d = raw.shape[-1] - 2
    # the scale: the row's last int16, read as fp16 (a strided view, widened once)
    scale = raw.view(torch.int16)[..., -1:].view(torch.float16).float()
    vals = raw[..., :d]
    if storage == torch.float8_e4m3fn:
        h = (vals.to(torch.int16) if work is None else
             work.get(name + ".fp16", vals.shape, torch.int16, raw.device).copy_(vals))
        vals = h.bitwise_left_shift_(7).bitwise_and_(_E4M3_F16_MASK).view(torch.float16)
        scale.mul_(_E4M3_F16_UNSCALE)
    step = max(1, _CHUNK_ELEMS // max(1, out[0].numel()))
    for i in range(0, out.shape[0], step):
        out[i:i + step].copy_(vals[i:i + step]).mul_(scale[i:i + step])
    return out


def dequantize_rows(qx: torch.Tensor, dtype: torch.dtype, rotated: bool = False
                    ) -> torch.Tensor:
    """``[..., d + 2]`` quantized rows (int8 or float8_e4m3fn) -> ``[..., d]`` in ``dtype``:
    the original rows, or with ``rotated=True`` the rotated rows as stored (what attention
    reads, see the module doc)."""
    fmt = format_of(qx.dtype)
    if fmt is None:
        raise TypeError(f"not a quantized KV tensor: {qx.dtype}")
    raw = qx.view(torch.int8).reshape(-1, qx.shape[-1])
    y = torch.empty(*qx.shape[:-1], qx.shape[-1] - 2, device=qx.device,
                    dtype=dtype if rotated or not fmt.rotated else torch.float32)
    _scaled_values(raw, fmt.storage, y.view(-1, y.shape[-1]), None, "")
    if rotated or not fmt.rotated:
        return y
    return (y @ rotation(y.shape[-1], y.device)).to(dtype)


def dequantize_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype,
                      work: Workspace, name: str) -> torch.Tensor:
    """The blocks ``block_ids`` of a quantized cache, dequantized in their stored (rotated)
    domain: what the torch path attends over.

    cache:     ``[num_blocks, block_size, num_kv_heads, head_dim + 2]`` int8 or float8_e4m3fn,
               or ``[2, num_blocks, ...]``: one layer's K and V caches, done in one go.
    block_ids: int64 ``[n]``, in ``[0, num_blocks)``.
    Returns    ``[n, block_size, num_kv_heads, head_dim]`` (``[2, n, ...]``) in ``dtype``: a
               view of ``work``'s tensor ``name``, valid until the next call with that name.

    Two passes over the blocks' bytes: an ``index_select`` of them (a quarter of float32's),
    then the widening copy and the scale multiply straight into the workspace, chunk by chunk
    (no intermediate float tensor, no fresh allocation per layer: freshly allocated
    megabytes are page-faulted in again by every layer).
    """
    fmt = format_of(cache.dtype)
    if fmt is None or cache.dim() not in (4, 5):
        raise TypeError(f"dequantize_blocks needs a [(2,) N, bs, H, d + 2] quantized cache, "
                        f"got {tuple(cache.shape)} {cache.dtype}")
    axis = cache.dim() - 4
    shape = (*cache.shape[:axis], block_ids.shape[0], *cache.shape[axis + 1:])
    raw = torch.index_select(cache.view(torch.int8), axis, block_ids,
                             out=work.get(name + ".raw", shape, torch.int8, cache.device))
    out = work.get(name, (*shape[:-1], shape[-1] - 2), dtype, cache.device)
    flat = (-1, *shape[axis + 1:])
    _scaled_values(raw.view(flat), fmt.storage, out.view(*flat[:-1], shape[-1] - 2), work,
                   name)
    return out


class QuantizedKVWarning(UserWarning):
    """A quantized KV format measured to fall short of the bf16 model's quality."""


#: fp8_e4m3 KV against the bar (issue 31): teacher-forced top-1 agreement with the float32
#: model's own greedy continuation, fp8_e4m3 KV (float32 weights) / the bf16 model (bf16
#: weights and KV), in %, cold, per ``config.model_type``: (what was measured, fp8, bf16).
#: ``radixkv bench kv-quant --quality`` at 9f26040 (docs/quantization.md). fp8 falls short on
#: every architecture measured: e4m3 keeps 3 mantissa bits, a round trip's error is ~2.4% of a
#: row's norm (int8, rotated: 0.5%; bf16: 0.16%), and attention logits amplify K's.
FP8_MEASURED: dict[str, tuple[tuple[str, float, float], ...]] = {
    "llama": (("SmolLM2-135M, held-out ShareGPT prompts", 97.31, 98.44),
              ("a random 2-layer Llama", 77.98, 93.07)),
    "qwen2": (("a random 2-layer Qwen2 with q/k/v biases", 78.71, 93.51),),
    "mistral": (("a random 2-layer Mistral, window 32", 79.10, 94.19),),
    "gemma2": (("a random 2-layer Gemma-2, window 32 and soft cap", 97.46, 98.44),),
    "phi3": (("a random 2-layer Phi-3", 78.17, 92.77),),
}


def fp8_warning(model_type: str | None) -> str:
    """Why ``kv_dtype="fp8_e4m3"`` is not as safe as bf16 for a model of ``model_type``: its
    architecture's measured figures, or, for one not measured, the range over those that were
    (fp8 fell short on all of them)."""
    rows = FP8_MEASURED.get(model_type or "")
    if rows:
        figures = "; ".join(f"{what}: {fp8:.2f}% against {bf16:.2f}%"
                            for what, fp8, bf16 in rows)
        head = (f"kv_dtype='fp8_e4m3' on {model_type}: the top-1 token agrees with full "
                f"precision less often than with the bf16 model (measured, {figures})")
    else:
        gaps = [bf16 - fp8 for rs in FP8_MEASURED.values() for _, fp8, bf16 in rs]
        head = (f"kv_dtype='fp8_e4m3' on {model_type or 'this model'}, an architecture not "
                f"measured: on every one measured ({', '.join(FP8_MEASURED)}) the top-1 token "
                f"agreed with full precision {min(gaps):.1f} to {max(gaps):.1f} points less "
                "often than with the bf16 model")
    return (f"{head}; teacher-forced, `radixkv bench kv-quant --quality`, "
            "docs/quantization.md. kv_dtype='int8' takes the same bytes and agreed at least "
            "as often as the bf16 model on every architecture measured.")


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
    kv = torch.stack([key, value])                # one quantization for K and V
    rows = quantize_rows(kv if slots is slot_mapping else kv[:, keep], fmt.name)
    for x, cache in zip(rows.view(torch.int8), (k_cache, v_cache)):
        # index_copy_ is not implemented for float8 on every backend: scatter the bytes.
        flat = cache.view(torch.int8).view(-1, *cache.shape[2:])
        flat.index_copy_(0, slots, x)


__all__ = ["QuantFormat", "FORMATS", "QMAX", "Workspace", "format_of", "get_format",
           "QuantizedKVWarning", "FP8_MEASURED", "fp8_warning",
           "row_scales", "rotation", "rotate", "quantize_rows", "dequantize_rows",
           "dequantize_blocks", "write_quantized"]
