"""Plain torch references: loops over sequences and tokens, written to be obviously correct.

Tests compare the Triton kernels and the efficient torch path against these. They are slow on
purpose: every token's slot is computed from the block table with the formula of the contract,

    slot = block_tables[seq, pos // block_size] * block_size + pos % block_size

and attention is computed in float32 with an explicit softmax. Nothing here reads a block-table
entry or a cache slot that the contract says is garbage. Shapes are those of the public launchers
in :mod:`radixkv.kernels.ops`; the functions here assume the inputs were already checked.
"""

from __future__ import annotations

import torch

PAD_SLOT = -1  # kernel skips; defined once for the package (re-exported by radixkv.kernels)


def _slots(block_row: torch.Tensor, num_tokens: int, block_size: int) -> torch.Tensor:
    """Slots of positions [0, num_tokens) of one sequence, from its block-table row."""
    return torch.tensor(
        [int(block_row[pos // block_size]) * block_size + pos % block_size
         for pos in range(num_tokens)],
        dtype=torch.long, device=block_row.device)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v in float32, one query head against one KV head.

    q: [num_q, head_dim]; k, v: [num_k, head_dim]; allowed: bool [num_q, num_k].
    """
    scores = (q.float() @ k.float().T) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float()


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Token by token: cache[slot // bs, slot % bs] = key[t] unless slot is PAD_SLOT."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot == PAD_SLOT:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per sequence attends to all of its seq_len cached tokens."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_flat = k_cache.reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for s in range(num_seqs):
        seq_len = int(seq_lens[s])
        slots = _slots(block_tables[s], seq_len, block_size)
        allowed = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        for h in range(num_q_heads):
            kv_h = h // group
            out[s, h] = _attend(q[s, h][None], k_flat[slots, kv_h], v_flat[slots, kv_h],
                                allowed, scale)[0].to(q.dtype)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Query i of a chunk attends to keys [0, cached_len + i] of its sequence."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_flat = k_cache.reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for s in range(seq_lens.shape[0]):
        start, end = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        seq_len = int(seq_lens[s])
        cached_len = seq_len - (end - start)
        slots = _slots(block_tables[s], seq_len, block_size)
        q_pos = torch.arange(end - start, device=q.device)[:, None] + cached_len
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos
        for h in range(num_q_heads):
            kv_h = h // group
            out[start:end, h] = _attend(q[start:end, h], k_flat[slots, kv_h],
                                        v_flat[slots, kv_h], allowed, scale).to(q.dtype)
    return out


def copy_blocks(kv_cache: torch.Tensor, src_block_ids: torch.Tensor,
                dst_block_ids: torch.Tensor) -> None:
    """Pair by pair: every layer's K and V of block src[i] onto block dst[i]."""
    for src, dst in zip(src_block_ids.tolist(), dst_block_ids.tolist()):
        kv_cache[:, :, dst] = kv_cache[:, :, src].clone()


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Stack block by block: result[i] = kv_cache[:, :, block_ids[i]]."""
    return torch.stack([kv_cache[:, :, b] for b in block_ids.tolist()]) if len(block_ids) else \
        kv_cache.new_empty((0, kv_cache.shape[0], 2, *kv_cache.shape[3:]))


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   blocks: torch.Tensor) -> None:
    """Block by block: kv_cache[:, :, block_ids[i]] = blocks[i]."""
    for i, b in enumerate(block_ids.tolist()):
        kv_cache[:, :, b] = blocks[i]
