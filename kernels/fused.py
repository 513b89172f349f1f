"""The fused per-layer ops of a decoder step, as registered custom ops (namespace ``radixkv``).

Why: a decode step of a small batch is bound by launches, not by arithmetic. transformers'
modules spend about 40 kernel launches per layer (RMSNorm alone is pow/mean/add/rsqrt/mul plus
two dtype conversions; rope is five elementwise ops per tensor; the K/V write two scatters).
The lean forward (:mod:`radixkv.engine.decoder_forward`) runs each layer as

    add_rms_norm -> qkv GEMM -> rope_write_kv -> paged_decode -> o GEMM
                 -> add_rms_norm -> gate_up GEMM -> silu_mul -> down GEMM

nine launches, the four below plus the GEMMs (``docs/gpu.md`` has the counts measured before
and after). Each op here is a ``torch.library.custom_op``:

* its default implementation is the torch reference (``*_ref`` below), which runs on any
  device and computes exactly what transformers' modules compute, op for op, in the same dtype
  (so CPU logits stay bit-identical to the module path: tests/engine/test_decoder_forward.py);
* on CUDA, when the kernel backend resolves to ``"triton"`` (kernels/backend.py), the op runs
  one Triton kernel (:mod:`radixkv.kernels.triton_fused`, tested against the references in the
  Triton interpreter: tests/kernels/test_fused.py);
* each has a fake (meta) implementation, so the ops trace under ``torch.compile`` and
  ``FakeTensorMode``.

A dispatch mode sees one op per call (its implementation runs below the mode), which is what
tests/engine/test_decode_ops.py counts.

On the CPU outside ``torch.compile`` and dispatch modes the lean forward skips the custom-op
dispatch and calls ``*_cpu`` below: the native kernels of :mod:`radixkv.kernels.native_fused`
where they are bit-identical to the references on this machine, the references otherwise.

Shapes: ``T`` packed tokens, ``H`` hidden size, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim,
``I`` MLP intermediate size. None of these ops reads a tensor's value on the host: no
``.item()``, no device sync (tests/engine/test_decode_ops.py checks a whole decode step).
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from . import native_fused
from .backend import resolve_backend
from .reference import PAD_SLOT

# ----------------------------------------------------------------------------- references


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, op for op: float32 statistics, the scale applied
    in the input dtype. ``x`` ``[..., H]``, ``weight`` ``[H]``."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to the dtype, as transformers' residual add), then
    ``(rms_norm(s), s)``. ``x``, ``residual`` ``[T, H]``."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up GEMM's output ``[T, 2I]`` (gate first) ->
    ``[T, I]``, rounding as ``F.silu(gate) * up`` does."""
    inter = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) = [-x2, x1]``) in
    five ops instead of seven, rounding exactly as it does (``x1*c1 + (-x2)*s1`` is
    ``x1*c1 - x2*s1`` in IEEE arithmetic, product by product). ``x`` ``[T, heads, D]`` (any
    strides), ``cos``/``sin`` ``[T, D]`` in ``x``'s dtype; returns a new contiguous tensor."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half].sub_(x2 * sin[..., :half])
    out[..., half:].add_(x1 * sin[..., half:])
    return out


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, has_pad: bool) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write rotated ``k`` and ``v`` to their cache slots; returns the
    rotated ``q`` (``[T, Hq, D]``, contiguous). ``has_pad``: ``slot_mapping`` may hold
    ``PAD_SLOT`` rows (CUDA-graph padding), which are skipped; False (the host knows the batch
    has none) writes every row with one ``index_copy_`` per cache and no mask."""
    q_out = rope_ref(q, cos, sin)
    k_rot = rope_ref(k, cos, sin)
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if has_pad:
        keep = slot_mapping != PAD_SLOT
        slot_mapping, k_rot, v = slot_mapping[keep], k_rot[keep], v[keep]
    k_flat.index_copy_(0, slot_mapping, k_rot)
    v_flat.index_copy_(0, slot_mapping, v)
    return q_out


# ------------------------------------------------------- CPU, called directly (no dispatch)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_ref`'s result: the native kernel where it is bit-identical to it
    (:mod:`radixkv.kernels.native_fused`), else the reference itself."""
    out = native_fused.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps) if out is None else out


def add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_ref`'s result, natively where that is bit-identical."""
    out = native_fused.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps) if out is None else out


def rope_write_kv_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, has_pad: bool) -> torch.Tensor:
    """:func:`rope_write_kv_ref`'s result and writes, natively where that is bit-identical."""
    out = native_fused.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    if out is None:
        return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, has_pad)
    return out


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul_ref`'s result, natively where that is bit-identical."""
    out = native_fused.silu_mul(gate_up)
    return silu_mul_ref(gate_up) if out is None else out


def _use_triton(t: torch.Tensor) -> bool:
    return resolve_backend(None, t.device) == "triton"


def _triton():
    from . import triton_fused  # imported on first use: importing triton takes seconds
    return triton_fused


# ----------------------------------------------------------------------------- custom ops


@custom_op("radixkv::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ``[T, H]`` (or ``[T, heads, D]``) with ``weight``
    ``[H]`` (or ``[D]``); see :func:`rms_norm_ref`."""
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        return _triton().rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op("radixkv::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` for ``[T, H]`` inputs: a layer's residual
    add fused with the next norm (vLLM's ``fused_add_rms_norm``, without mutating inputs)."""
    return add_rms_norm_ref(x, residual, weight, eps)


@add_rms_norm.register_kernel("cuda")
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        return _triton().add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@custom_op("radixkv::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up output ``[T, 2I]`` -> ``[T, I]``."""
    return silu_mul_ref(gate_up)


@silu_mul.register_kernel("cuda")
def _(gate_up: torch.Tensor) -> torch.Tensor:
    if _use_triton(gate_up):
        return _triton().silu_mul(gate_up)
    return silu_mul_ref(gate_up)


@silu_mul.register_fake
def _(gate_up: torch.Tensor) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@custom_op("radixkv::rope_write_kv", mutates_args=("k_cache", "v_cache"))
def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, has_pad: bool) -> torch.Tensor:
    """Rotary embedding of q and k fused with the K/V write (one launch on CUDA).

    q:            [T, Hq, D]; k, v: [T, Hkv, D]; each token's heads contiguous (a token
                  stride is allowed: views of a fused q/k/v GEMM output are passed as they are).
    cos, sin:     [T, D] in q's dtype (transformers' rotary output for the tokens' positions).
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous, q's dtype (written).
    slot_mapping: int64 [T]; PAD_SLOT (-1) rows are skipped (``has_pad`` must then be True on
                  the torch path; the Triton kernel checks every row).
    Returns the rotated q, [T, Hq, D] contiguous.
    """
    return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, has_pad)


@rope_write_kv.register_kernel("cuda")
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
      has_pad: bool) -> torch.Tensor:
    d = q.shape[-1]
    if _use_triton(q) and d >= 2 and d & (d - 1) == 0:   # tl.arange needs a power of two
        return _triton().rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, has_pad)


@rope_write_kv.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
      has_pad: bool) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@custom_op("radixkv::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 host_seq_lens: list[int]) -> torch.Tensor:
    """Paged decode attention as one op (``kernels.paged_decode_attention``'s contract, values
    validated once per step by ``ForwardBatch.build``).

    ``host_seq_lens`` are ``seq_lens`` as host ints: the CPU paths plan from them (split
    count, length groups) instead of reading the tensor back; the Triton kernel reads only the
    tensors (its grid depends on ``block_tables``' width alone, so a CUDA graph can replay it
    with other lengths).
    """
    from . import ops

    return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      check=False,
                                      plan={"host_seq_lens": list(host_seq_lens)})


@paged_decode.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
      seq_lens: torch.Tensor, scale: float, host_seq_lens: list[int]) -> torch.Tensor:
    return torch.empty_like(q)
