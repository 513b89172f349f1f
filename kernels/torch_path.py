"""The efficient torch path: batched block gather + ``scaled_dot_product_attention``.

This is what the engine runs on machines without a GPU, so it is written for speed: no Python loop
over tokens or blocks, one gather per group of sequences of similar length, and attention through
SDPA (which on the CPU runs a fused flash kernel).

How a group of sequences is attended (decode and prefill alike)::

    block_tables[g, :nb]  --where(col < used_blocks, entry, first entry)-->  ids [n, nb]
    k_cache.index_select(0, ids)  ->  k [n, nb * block_size, kv_heads, head_dim]
    rows at positions >= seq_len  ->  zeroed (they hold garbage, maybe NaN; a masked score times
                                      a NaN value would still be NaN)
    SDPA(q, k^T-view, v^T-view, attn_mask = allowed)

Block-table entries past a sequence's used blocks are garbage and are never used as indices (they
are replaced by the sequence's first entry, which is valid since seq_len >= 1). Sequences are
grouped by length so that the padding to the longest sequence of a group costs at most
``_MAX_PADDING`` of the real work (or a few thousand tokens, below which one more SDPA call costs
more than the padding).

GQA in decode: the G = num_q_heads // num_kv_heads query heads that share one KV head become G
query rows of that KV head (q viewed as [n, kv_heads, G, head_dim]), so K/V are never repeated.
In prefill, SDPA's ``enable_gqa`` does the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .reference import PAD_SLOT

_MAX_PADDING = 1.25       # padded work / real work allowed within one group
_MIN_WASTE = 2048         # padded-away tokens (or token pairs / 64 in prefill) always tolerated


def _group_by_cost(costs: list[int], padded_cost) -> list[list[int]]:
    """Split sequence indices (sorted by decreasing cost) into groups of bounded padding.

    ``padded_cost(group)`` is the work of the group once padded to its largest member.
    """
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        if current:
            padded = padded_cost(current + [i])
            if padded > _MAX_PADDING * (real + costs[i]) and padded - real - costs[i] > _MIN_WASTE:
                groups.append(current)
                current, real = [], 0
        current.append(i)
        real += costs[i]
    if current:
        groups.append(current)
    return groups


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               lens: torch.Tensor, lens_list: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor | None]:
    """Gather K/V of n sequences, padded to the longest rounded up to whole blocks.

    block_tables: [n, >= nb]; lens: int64 [n] (>= 1, on the cache's device), lens_list the same
    on the host (decisions below are taken on host ints, not by syncing on tensors).
    Returns k, v: [n, nb * block_size, kv_heads, head_dim] (rows >= lens zeroed) and
    valid: bool [n, nb * block_size] (None when no row is padding).
    """
    n = block_tables.shape[0]
    block_size = k_cache.shape[1]
    nb = -(-max(lens_list) // block_size)
    padded_len = nb * block_size
    ids = block_tables[:, :nb].long()
    if min(lens_list) <= (nb - 1) * block_size:   # some row has garbage entries within nb
        used_blocks = (lens + block_size - 1) // block_size
        cols = torch.arange(nb, device=ids.device)
        ids = torch.where(cols[None, :] < used_blocks[:, None], ids, ids[:, :1])
    ids = ids.reshape(-1)
    k = k_cache.index_select(0, ids).view(n, padded_len, *k_cache.shape[2:])
    v = v_cache.index_select(0, ids).view(n, padded_len, *v_cache.shape[2:])
    valid = None
    if min(lens_list) != padded_len:
        valid = torch.arange(padded_len, device=ids.device)[None, :] < lens[:, None]
        pad_rows = (~valid).reshape(-1).nonzero().squeeze(1)
        k.view(n * padded_len, -1).index_fill_(0, pad_rows, 0)
        v.view(n * padded_len, -1).index_fill_(0, pad_rows, 0)
    return k, v, valid


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache.view(-1, H, D)[slot] = key[t] for every non-PAD slot, as one index_copy_."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping != PAD_SLOT
    if bool(keep.all()):
        k_flat.index_copy_(0, slot_mapping, key)
        v_flat.index_copy_(0, slot_mapping, value)
    else:
        k_flat.index_copy_(0, slot_mapping[keep], key[keep])
        v_flat.index_copy_(0, slot_mapping[keep], value[keep])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor) -> torch.Tensor:
    """Decode through SDPA; q: [num_seqs, num_q_heads, head_dim] -> out (same shape)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    lens_list = seq_lens.tolist()
    groups = _group_by_cost(lens_list, lambda g: len(g) * lens_list[g[0]])
    lens = seq_lens.to(torch.long)
    for members in groups:
        whole = len(groups) == 1
        idx = None if whole else torch.tensor(members, device=q.device)
        sel = (lambda t: t) if idx is None else (lambda t: t.index_select(0, idx))
        k, v, valid = _gather_kv(k_cache, v_cache, sel(block_tables), sel(lens),
                                 [lens_list[s] for s in members])
        n = k.shape[0]
        qg = sel(q).view(n, num_kv_heads, group, head_dim)
        mask = None if valid is None else valid[:, None, None, :]
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale)
        o = o.reshape(n, num_q_heads, head_dim)
        if idx is None:
            out.copy_(o)
        else:
            out.index_copy_(0, idx, o)
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            out: torch.Tensor) -> torch.Tensor:
    """Extend-case prefill through SDPA; q packed [total_q, num_q_heads, head_dim] -> out.

    Per group of n sequences, queries are padded to the longest chunk (padding rows repeat the
    chunk's last query and are dropped afterwards) and keys to the longest sequence:

        qg [n, Lq_pad, Hq, D]       row i of sequence s = packed row cu[s] + min(i, q_len_s - 1)
        allowed[s, i, j] = j < seq_len_s and j <= cached_len_s + i
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    cu = cu_seqlens_q.tolist()
    lens_list = seq_lens.tolist()
    q_lens = [cu[s + 1] - cu[s] for s in range(len(lens_list))]
    live = [s for s in range(len(lens_list)) if q_lens[s] > 0]
    costs = [max(1, q_lens[s] * lens_list[s] // 64) for s in live]
    groups = _group_by_cost(costs, lambda g: len(g) * max(q_lens[live[i]] for i in g)
                            * max(lens_list[live[i]] for i in g) // 64)
    dev = q.device
    for group in groups:
        members = [live[i] for i in group]
        # Members are sorted by decreasing cost, not length: take the maxima explicitly.
        max_q = max(q_lens[s] for s in members)
        m = torch.tensor(members, device=dev)
        lens = seq_lens.index_select(0, m).long()
        qlen = torch.tensor([q_lens[s] for s in members], device=dev)
        start = torch.tensor([cu[s] for s in members], device=dev)
        rows = torch.arange(max_q, device=dev)
        src = start[:, None] + torch.minimum(rows[None, :], (qlen - 1)[:, None])
        qg = q.index_select(0, src.reshape(-1)).view(len(members), max_q, num_q_heads, head_dim)
        k, v, _ = _gather_kv(k_cache, v_cache, block_tables.index_select(0, m), lens,
                             [lens_list[s] for s in members])
        key_pos = torch.arange(k.shape[1], device=dev)
        cached = (lens - qlen)[:, None, None]
        allowed = (key_pos[None, None, :] <= cached + rows[None, :, None]) & \
                  (key_pos[None, None, :] < lens[:, None, None])
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=allowed[:, None], scale=scale, enable_gqa=True)
        o = o.transpose(1, 2)  # [n, max_q, Hq, D]
        keep = (rows[None, :] < qlen[:, None]).reshape(-1)
        dst = (start[:, None] + rows[None, :]).reshape(-1)[keep]
        out.index_copy_(0, dst, o.reshape(-1, num_q_heads, head_dim)[keep])
    return out


def copy_blocks(kv_cache: torch.Tensor, src_block_ids: torch.Tensor,
                dst_block_ids: torch.Tensor) -> None:
    """kv_cache[:, :, dst] = kv_cache[:, :, src] (all sources read before any write)."""
    kv_cache.index_copy_(2, dst_block_ids, kv_cache.index_select(2, src_block_ids))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """-> [n, num_layers, 2, block_size, kv_heads, head_dim], contiguous."""
    return kv_cache.index_select(2, block_ids).permute(2, 0, 1, 3, 4, 5).contiguous()


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   blocks: torch.Tensor) -> None:
    """Inverse of gather_blocks: kv_cache[:, :, block_ids[i]] = blocks[i]."""
    kv_cache.index_copy_(2, block_ids, blocks.permute(1, 2, 0, 3, 4, 5))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
