"""Triton kernels that move K/V: write_kv (scatter through a slot mapping), copy_blocks (CoW).

The launchers here assume arguments checked by :mod:`radixkv.kernels.ops`.

* ``write_kv``: one program per tile of BLOCK_T tokens x one token's row (num_kv_heads *
  head_dim elements), K and V together; a decode step of 256 sequences is a handful of
  programs, not 256 one-row programs.
* ``copy_blocks``: one launch for every pair, layer and K/V plane, over the pool viewed as the
  widest integer word that divides a block's bytes (8 bytes for every real shape), so each
  thread moves 16-byte vectors; the grid is (pair, plane, chunk of a block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_mode import check_mode

#: Elements one program moves at most (per K and per V for write_kv).
_TILE_ELEMS = 4096


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                     stride_key, stride_value,
                     ROW: tl.constexpr,       # num_kv_heads * head_dim: elements of one token
                     BLOCK: tl.constexpr,     # next power of two >= ROW
                     BLOCK_T: tl.constexpr):  # tokens per program
    # Program p: tokens [p * BLOCK_T, (p + 1) * BLOCK_T); cache row `slot` (= block_id *
    # block_size + offset) <- key[t]. PAD_SLOT (-1) rows and tokens past num_tokens are masked
    # out entirely (nothing loaded, nothing stored).
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=t_ok, other=-1)
    offs = tl.arange(0, BLOCK)
    mask = ((slot >= 0) & t_ok)[:, None] & (offs < ROW)[None, :]
    k = tl.load(key_ptr + t[:, None] * stride_key + offs[None, :], mask=mask)
    v = tl.load(value_ptr + t[:, None] * stride_value + offs[None, :], mask=mask)
    dst = slot[:, None] * ROW + offs[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(kv_ptr, src_ptr, dst_ptr, num_blocks, block_words,
                        BLOCK: tl.constexpr):   # words per program
    # Grid (pair i, plane p = layer * 2 + {0: K, 1: V}, chunk c). The pool viewed as
    # [num_layers * 2, num_blocks, block_words] words; program copies words
    # [c * BLOCK, (c + 1) * BLOCK) of plane p, block src[i] onto block dst[i].
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_words
    x = tl.load(kv_ptr + (plane * num_blocks + src) * block_words + offs, mask=mask)
    tl.store(kv_ptr + (plane * num_blocks + dst) * block_words + offs, x, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [T, H, D] (token stride free); caches [N, bs, H, D]; slot_mapping int64 [T]."""
    check_mode(_write_kv_kernel, key.device)
    num_tokens = key.shape[0]
    row = key.shape[1] * key.shape[2]
    block = triton.next_power_of_2(row)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), _TILE_ELEMS // block))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens, key.stride(0),
        value.stride(0), ROW=row, BLOCK=block, BLOCK_T=block_t)


def _words(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool viewed as [L * 2, num_blocks, words] of the widest integer type (8, 4, 2 or 1
    bytes) that divides one block's bytes."""
    planes, num_blocks = kv_cache.shape[0] * 2, kv_cache.shape[2]
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    flat = kv_cache.view(torch.uint8).view(planes, num_blocks, block_bytes)
    for word in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=word).element_size()
        if block_bytes % size == 0:
            return flat.view(word)
    return flat


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache [L, 2, N, bs, H, D]; src, dst int64 [n] (dst distinct, disjoint from src)."""
    check_mode(_copy_blocks_kernel, kv_cache.device)
    words = _words(kv_cache)
    planes, num_blocks, block_words = words.shape
    block = min(2048, triton.next_power_of_2(block_words))
    grid = (src.shape[0], planes, triton.cdiv(block_words, block))
    _copy_blocks_kernel[grid](words, src, dst, num_blocks, block_words, BLOCK=block)
