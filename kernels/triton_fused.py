"""Triton kernels of the fused per-layer ops (:mod:`radixkv.kernels.fused`): one launch each.

Rounding follows the torch references op for op where the reference rounds to the tensor's
dtype between ops (bf16/fp16: the residual sum, the normalised row before the weight, the
silu before the product, each rope product), so low-precision results agree with transformers'
modules to the last bit wherever the compiler keeps the order; statistics are float32 as in the
reference. In float32 the compiler may contract a product and a sum into one FMA, which
changes the last bit: tests/kernels/test_fused.py compares float32 within 1e-5, low precision
within one unit of the dtype.

The launchers assume arguments the engine built (shapes, dtypes and devices as documented in
:mod:`radixkv.kernels.fused`); they check the Triton mode against the tensors' device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_mode import check_mode


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_res, n_cols,
                     eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # One program per row r: s = x[r] (+ res[r], rounded to the dtype); out[r] = w * rms(s),
    # the statistics in float32, the normalised row rounded to the dtype before the weight.
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + r * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + r * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + r * n_cols + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = (h * (1.0 / tl.sqrt(var + eps))).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + r * n_cols + offs, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype),
             mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, inter, BLOCK: tl.constexpr):
    # Grid (row r, column chunk c): out[r, j] = silu(gate[r, j]) * up[r, j] for j in the chunk;
    # gate = gu[r, :inter], up = gu[r, inter:]; silu rounded to the dtype before the product.
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + r * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + r * stride_gu + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + r * inter + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
             mask=mask)


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, t, HALF: tl.constexpr):
    # transformers' rope of one head row: [x1*c1 - x2*s1, x2*c2 + x1*s2], each product and the
    # difference/sum rounded to the dtype (as the reference's separate ops do).
    offs = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + offs)
    x2 = tl.load(x_ptr + HALF + offs)
    c1 = tl.load(cos_ptr + t * 2 * HALF + offs).to(tl.float32)
    c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + offs).to(tl.float32)
    s1 = tl.load(sin_ptr + t * 2 * HALF + offs).to(tl.float32)
    s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + offs).to(tl.float32)
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1).to(dt).to(tl.float32)
    b1 = (x2.to(tl.float32) * s1).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(dt).to(tl.float32)
    return (a1 - b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr,
                          slot_ptr, q_out_ptr, stride_qt, stride_kt, stride_vt,
                          NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                          HALF: tl.constexpr):
    # Grid (token t, head h in [0, Hq + Hkv)):
    #   h <  Hq: q_out[t, h] = rope(q[t, h])
    #   h >= Hq: j = h - Hq; cache row slot[t], head j <- rope(k[t, j]) and v[t, j]
    #            (nothing is stored for PAD_SLOT = -1 rows)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    D: tl.constexpr = 2 * HALF
    offs = tl.arange(0, HALF)
    if h < NUM_Q_HEADS:
        o1, o2 = _rotate(q_ptr + t * stride_qt + h * D, cos_ptr, sin_ptr, t, HALF)
        base = q_out_ptr + (t * NUM_Q_HEADS + h) * D
        tl.store(base + offs, o1)
        tl.store(base + HALF + offs, o2)
    else:
        j = h - NUM_Q_HEADS
        slot = tl.load(slot_ptr + t)
        live = (offs * 0 + slot) >= 0
        o1, o2 = _rotate(k_ptr + t * stride_kt + j * D, cos_ptr, sin_ptr, t, HALF)
        row = (slot * NUM_KV_HEADS + j) * D
        tl.store(k_cache_ptr + row + offs, o1, mask=live)
        tl.store(k_cache_ptr + row + HALF + offs, o2, mask=live)
        v1 = tl.load(v_ptr + t * stride_vt + j * D + offs)
        v2 = tl.load(v_ptr + t * stride_vt + j * D + HALF + offs)
        tl.store(v_cache_ptr + row + offs, v1, mask=live)
        tl.store(v_cache_ptr + row + HALF + offs, v2, mask=live)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` as ``[rows, cols]`` with unit column stride, and its row stride."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.stride(0)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_mode(_rms_norm_kernel, x.device)
    x2, sx = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        res2, sr, total = x2, sx, None
    else:
        res2, sr = _rows(residual)
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        # one row per program: more warps for wide rows (hidden 4096-8192) keep the row in
        # registers without spilling
        _rms_norm_kernel[(n_rows,)](x2, res2, weight, out, x2 if total is None else total,
                                    sx, sr, n_cols, float(eps),
                                    HAS_RESIDUAL=residual is not None, BLOCK=block,
                                    num_warps=max(1, min(16, block // 512)))
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm of the last axis of ``x`` (``[..., H]``, weight ``[H]``)."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``(rms_norm(x + residual), x + residual)`` for ``[T, H]`` inputs."""
    out, total = _norm(x, residual, weight, eps)
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton ``silu(gate) * up`` of ``[T, 2I]`` -> ``[T, I]``."""
    check_mode(_silu_mul_kernel, gate_up.device)
    gu, stride = _rows(gate_up)
    inter = gu.shape[1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if gu.shape[0]:
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](gu, out, stride, inter,
                                                                   BLOCK=block)
    return out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """Triton rope of q and k with the K/V write, one launch (contract in
    :func:`radixkv.kernels.fused.rope_write_kv`); ``head_dim`` must be even and a power of
    two (every model the lean forward runs: 64, 128, 256)."""
    check_mode(_rope_write_kv_kernel, q.device)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim {d}: the Triton rope kernel needs a power of two")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or (x.shape[1] > 1 and x.stride(1) != d):
            raise ValueError(f"{name}: each token's heads must be contiguous, got strides "
                             f"{x.stride()}")
    cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if t:
        _rope_write_kv_kernel[(t, hq + hkv)](
            q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_out,
            q.stride(0), k.stride(0), v.stride(0),
            NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HALF=d // 2)
    return q_out
