"""Paged attention with a sliding window and/or logit soft-capping (torch, any device).

Mistral attends within a sliding window; Gemma-2/3 alternate windowed ("local") and global layers
and Gemma-2 soft-caps the attention logits (``softcap * tanh(scores / softcap)``). Neither fits
``scaled_dot_product_attention`` (no softcap, and a window needs a mask), so these layers take
this path: per sequence, only the blocks that hold keys inside the window are gathered, scores
are computed in float32, capped, masked, soft-maxed in float32 and applied to V, and the result
is rounded once to the query's dtype.

Which keys query ``i`` of a sequence sees (positions, 0-based; ``cached = seq_len - q_len``;
transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - window``)::

    p = cached + i                        the query's position
    keys j with  max(0, p - window + 1) <= j <= p      (window None: 0 <= j <= p)

A sequence's gather starts at the block holding ``max(0, cached - window + 1)``, the first key
any of its queries can see, so decode reads at most ``window + block_size`` keys however long the
sequence is. The Python loop runs over sequences, not tokens or blocks.

Quantized caches (int8 / float8_e4m3fn rows of ``head_dim`` values and an fp16 scale,
engine/kv_quant.py) are read in place: only the blocks a sequence's window reaches are gathered
as bytes and widened (values times scale, in float32, the values the dequantizing scratch would
hold), so a windowed layer over a long context touches ``window + block_size`` rows per
sequence instead of dequantizing every block the batch reads first. The query is expected in
the rows' (rotated) domain, as for every kernel reading a quantized cache.
"""

from __future__ import annotations

import torch


def paged_attention_windowed(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: list[int],
                             seq_lens: list[int], scale: float, out: torch.Tensor, *,
                             window: int | None, softcap: float | None) -> torch.Tensor:
    """Causal attention of packed chunks against their paged K/V, windowed and/or capped.

    q:            [total_q, num_q_heads, head_dim], packed as in ``paged_prefill_attention``.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], holding the chunks' K/V,
                  or int8 / float8_e4m3fn rows of head_dim + 2 bytes (quantized, read in place).
    block_tables: int32 [num_seqs, max_blocks] (on q's device).
    cu_seqlens_q: host ints [num_seqs + 1]; seq_lens: host ints [num_seqs] (chunk included).
    window:       keys a query sees, itself included (None: all earlier keys).
    softcap:      scores become ``softcap * tanh(scores / softcap)`` before the mask (None: off).
    out:          [total_q, num_q_heads, head_dim], written and returned.
    """
    from radixkv.engine.kv_quant import dequantize_rows, format_of

    quantized = format_of(k_cache.dtype) is not None
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    dev = q.device
    for s, length in enumerate(seq_lens):
        r0, r1 = cu_seqlens_q[s], cu_seqlens_q[s + 1]
        q_len = r1 - r0
        if q_len == 0:
            continue
        cached = length - q_len
        first_key = 0 if window is None else max(0, cached - window + 1)
        b0, b1 = first_key // block_size, -(-length // block_size)
        ids = block_tables[s, b0:b1].long()
        n_keys = length - b0 * block_size
        if quantized:   # the window's blocks only, widened as the scratch would hold them
            k, v = (dequantize_rows(
                c.view(torch.int8).index_select(0, ids).flatten(0, 1)[:n_keys].view(c.dtype),
                q.dtype, rotated=True) for c in (k_cache, v_cache))
        else:
            k = k_cache.index_select(0, ids).flatten(0, 1)[:n_keys]
            v = v_cache.index_select(0, ids).flatten(0, 1)[:n_keys]
        # [Hkv, G * q_len, D] x [Hkv, D, nk]: the G query heads of a KV head share its keys.
        qs = q[r0:r1].float().view(q_len, num_kv_heads, group, head_dim)
        qs = qs.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)   # [Hkv, nk, D]
        scores = torch.matmul(qs, kf.transpose(1, 2)) * scale           # [Hkv, G*q, nk]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = cached + torch.arange(q_len, device=dev)
        k_pos = b0 * block_size + torch.arange(kf.shape[1], device=dev)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.view(num_kv_heads, group, q_len, -1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, -1)
        o = torch.matmul(probs, vf).view(num_kv_heads, group, q_len, head_dim)
        out[r0:r1] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out
