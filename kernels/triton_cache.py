"""Triton kernels that move K/V: write_kv (scatter through a slot mapping), copy_blocks (CoW).

The launchers here assume arguments checked by :mod:`radixkv.kernels.ops`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_mode import check_mode


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_key, stride_value,
                     ROW: tl.constexpr,      # num_kv_heads * head_dim: elements of one token
                     BLOCK: tl.constexpr):   # next power of two >= ROW
    # One program per token t: cache row `slot` (= block_id * block_size + offset) <- key[t].
    # PAD_SLOT (-1) rows are masked out entirely (nothing loaded, nothing stored).
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, BLOCK)
    mask = offs < (slot >= 0).to(tl.int32) * ROW      # all False for PAD_SLOT
    k = tl.load(key_ptr + t * stride_key + offs, mask=mask)
    v = tl.load(value_ptr + t * stride_value + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(kv_ptr, src_ptr, dst_ptr, num_blocks, block_numel,
                        BLOCK: tl.constexpr):   # elements per program
    # Grid (pair i, plane p = layer * 2 + {0: K, 1: V}, chunk c). The pool viewed as
    # [num_layers * 2, num_blocks, block_numel]; program copies elements
    # [c * BLOCK, (c + 1) * BLOCK) of plane p, block src[i] onto block dst[i].
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    x = tl.load(kv_ptr + (plane * num_blocks + src) * block_numel + offs, mask=mask)
    tl.store(kv_ptr + (plane * num_blocks + dst) * block_numel + offs, x, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [T, H, D] (token stride free); caches [N, bs, H, D]; slot_mapping int64 [T]."""
    check_mode(_write_kv_kernel, key.device)
    row = key.shape[1] * key.shape[2]
    _write_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, BLOCK=triton.next_power_of_2(row))


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache [L, 2, N, bs, H, D]; src, dst int64 [n] (dst distinct, disjoint from src)."""
    check_mode(_copy_blocks_kernel, kv_cache.device)
    num_layers, _, num_blocks = kv_cache.shape[:3]
    block_numel = kv_cache[0, 0, 0].numel()
    block = min(4096, triton.next_power_of_2(block_numel))
    grid = (src.shape[0], num_layers * 2, triton.cdiv(block_numel, block))
    _copy_blocks_kernel[grid](
        kv_cache, src, dst, num_blocks, block_numel, BLOCK=block)
