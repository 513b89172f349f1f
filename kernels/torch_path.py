"""The efficient torch path: batched block gather + ``scaled_dot_product_attention``.

This is what the engine runs on machines without a GPU, so it is written for speed: no Python loop
over tokens or blocks, no mask wherever the shapes make one unnecessary (a mask sends CPU SDPA to a
kernel that computes every (query, key) pair), and GQA without repeating K/V.

Gathering the K/V of n sequences that all hold L tokens (decode and prefill alike)::

    block_tables[:, :nb]  (nb = ceil(L / block_size))  ->  ids [n * nb]
    k_cache.index_select(0, ids).view(n, nb * block_size, kv_heads, head_dim)[:, :L]

The slice is a view: the unread tail of a ragged last block (garbage, maybe NaN) is simply not part
of the result, so no mask and no zeroing. Sequences of different lengths are grouped by length
(padding to the longest of a group costs at most ``_MAX_PADDING`` of the real work, or a few
thousand tokens); a group whose lengths differ is padded, its padding rows zeroed (a masked score
times a NaN value would still be NaN) and attended with a boolean mask. Block-table entries past a
sequence's used blocks are garbage and are never used as indices (they are replaced by the
sequence's first entry, which is valid since seq_len >= 1).

Decode: the G = num_q_heads // num_kv_heads query heads that share one KV head become G query rows
of that KV head (q viewed as [n, kv_heads, G, head_dim]), so K/V are never repeated.

Prefill: sequences with the same (cached_len, q_len) are attended together, without any mask:

* no cached prefix (cached_len == 0): ``SDPA(is_causal=True, enable_gqa=True)`` (CPU flash kernel,
  which also skips the key tiles above the diagonal);
* with a cached prefix, split in two and merged by log-sum-exp::

      prefix part: q vs keys [0, cached_len), no mask; GQA folded into rows
                   (q as [n, kv_heads, G * q_len, head_dim]: K/V read once per KV head)
      self part:   q vs keys [cached_len, seq_len), causal (top-left = bottom-right, square)
      out = (o1 * e^(l1 - m) + o2 * e^(l2 - m)) / (e^(l1 - m) + e^(l2 - m)),  m = max(l1, l2)

  Both parts come from ``aten._scaled_dot_product_flash_attention_for_cpu``, which returns each
  row's log-sum-exp with the output (``_flash_with_lse``); where it is missing the masked path
  below is used instead.

Many small sequences of distinct shapes would cost several SDPA calls each; they go (as all
sequences did before) through the masked path: padded to the group's longest, one SDPA per group
with ``allowed[s, i, j] = j < seq_len_s and j <= cached_len_s + i``. The split is taken for a
shape when there are at most ``_MAX_EXACT_SHAPES`` shapes in the batch or the shape's
q_len * seq_len is at least ``_MIN_EXACT_PAIRS``.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from .reference import PAD_SLOT

_MAX_PADDING = 1.25       # padded work / real work allowed within one group
_MIN_WASTE = 2048         # padded-away tokens (or token pairs / 64 in prefill) always tolerated
_MAX_EXACT_SHAPES = 8     # prefill: distinct (cached_len, q_len) shapes always attended unmasked
_MIN_EXACT_PAIRS = 1 << 16  # prefill: q_len * seq_len from which a shape is attended unmasked


_WORKSPACE_MAX_BYTES = 256 << 20  # larger gathers get a fresh tensor instead of the workspace
_workspace = threading.local()


def _gather_rows(cache: torch.Tensor, ids: torch.Tensor, which: int) -> torch.Tensor:
    """cache.index_select(0, ids) written into a per-thread, reused CPU workspace.

    A fresh multi-megabyte tensor per call is returned to the OS when freed (glibc trims the heap)
    and page-faulted back in on the next call, which costs more than the copy itself. The result
    is only valid until the next gather of the same ``which`` (0: K, 1: V) on this thread.
    """
    shape = (ids.shape[0], *cache.shape[1:])
    numel = math.prod(shape)
    if cache.device.type != "cpu" or numel * cache.element_size() > _WORKSPACE_MAX_BYTES:
        return cache.index_select(0, ids)
    bufs = getattr(_workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = {}
    key = (which, cache.dtype)
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=cache.dtype)
    return torch.index_select(cache, 0, ids, out=buf[:numel].view(shape))


def _flash_with_lse():
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (returns (out, logsumexp)) or None."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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


def _gather_uniform(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of n sequences that all hold ``length`` tokens: [n, length, kv_heads, head_dim].

    One index_select per cache; the result is cut at ``length`` by a view (no mask needed).
    """
    n = block_tables.shape[0]
    block_size = k_cache.shape[1]
    nb = -(-length // block_size)
    ids = block_tables[:, :nb].reshape(-1).long()
    shape = (n, nb * block_size, *k_cache.shape[2:])
    k = _gather_rows(k_cache, ids, 0).view(shape)
    v = _gather_rows(v_cache, ids, 1).view(shape)
    if nb * block_size != length:
        k, v = k[:, :length], v[:, :length]
    return k, v


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
    k = _gather_rows(k_cache, ids, 0).view(n, padded_len, *k_cache.shape[2:])
    v = _gather_rows(v_cache, ids, 1).view(n, padded_len, *v_cache.shape[2:])
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
    if min(lens_list) == max(lens_list):   # the common case: no grouping, no mask
        k, v = _gather_uniform(k_cache, v_cache, block_tables, lens_list[0])
        o = F.scaled_dot_product_attention(q.view(num_seqs, num_kv_heads, group, head_dim),
                                           k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        out.view(num_seqs, num_kv_heads, group, head_dim).copy_(o)
        return out
    groups = _group_by_cost(lens_list, lambda g: len(g) * lens_list[g[0]])
    lens = seq_lens.to(torch.long)
    for members in groups:
        whole = len(groups) == 1
        idx = None if whole else torch.tensor(members, device=q.device)
        sel = (lambda t: t) if idx is None else (lambda t: t.index_select(0, idx))
        member_lens = [lens_list[s] for s in members]
        n = len(members)
        qg = sel(q).view(n, num_kv_heads, group, head_dim)
        if min(member_lens) == max(member_lens):
            k, v = _gather_uniform(k_cache, v_cache, sel(block_tables), member_lens[0])
            mask = None
        else:
            k, v, valid = _gather_kv(k_cache, v_cache, sel(block_tables), sel(lens), member_lens)
            mask = None if valid is None else valid[:, None, None, :]
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=scale)
        o = o.reshape(n, num_q_heads, head_dim)
        if idx is None:
            out.copy_(o)
        else:
            out.index_copy_(0, idx, o)
    return out


def _prefill_exact(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_tables: torch.Tensor, members: list[int], starts: list[int],
                   cached: int, q_len: int, scale: float, out: torch.Tensor, flash) -> None:
    """Sequences that all have ``cached`` cached tokens and a chunk of ``q_len``: no mask."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    n = len(members)
    dev = q.device
    if n == 1:
        rows = None
        qs = q[starts[0]:starts[0] + q_len].unsqueeze(0)               # [1, m, Hq, D] view
        bt = block_tables[members[0]:members[0] + 1]
    else:
        rows = (torch.tensor(starts, device=dev)[:, None]
                + torch.arange(q_len, device=dev)[None, :]).reshape(-1)
        qs = q.index_select(0, rows).view(n, q_len, num_q_heads, head_dim)
        bt = block_tables.index_select(0, torch.tensor(members, device=dev))
    k, v = _gather_uniform(k_cache, v_cache, bt, cached + q_len)       # [n, L, Hkv, D]
    k, v = k.transpose(1, 2), v.transpose(1, 2)                        # [n, Hkv, L, D] views
    if cached == 0:
        o = F.scaled_dot_product_attention(qs.transpose(1, 2), k, v, is_causal=True,
                                           scale=scale, enable_gqa=True)  # [n, Hq, m, D]
    else:
        # Prefix part: the G query heads of a KV head are G * q_len rows of one attention.
        # Half precision: the two parts are computed and merged in float32 and rounded once,
        # as one fused kernel (transformers' sdpa path) rounds once. Rounding o1 and o2 to
        # bf16 before the merge doubled the rounding error of every cached-prefix chunk (the
        # bf16 "cached vs uncached" divergences of issue 17; bench numerics measures it).
        if qs.dtype in (torch.bfloat16, torch.float16):
            qs, k, v = qs.float(), k.float(), v.float()
        qf = qs.view(n, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4) \
            .reshape(n, num_kv_heads, group * q_len, head_dim)
        o1, l1 = flash(qf, k[:, :, :cached], v[:, :, :cached], 0.0, False, scale=scale)
        o1 = o1.reshape(n, num_q_heads, q_len, head_dim)
        l1 = l1.reshape(n, num_q_heads, q_len, 1)
        o2, l2 = flash(qs.transpose(1, 2), k[:, :, cached:], v[:, :, cached:], 0.0, True,
                       scale=scale)
        l2 = l2.reshape(n, num_q_heads, q_len, 1)
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
        o = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    o = o.transpose(1, 2)                                              # [n, m, Hq, D]
    if rows is None:
        out[starts[0]:starts[0] + q_len].copy_(o[0])
    else:
        out.index_copy_(0, rows, o.reshape(-1, num_q_heads, head_dim).to(out.dtype))


def _prefill_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, members: list[int],
                    cu: list[int], q_lens: list[int], lens_list: list[int], scale: float,
                    out: torch.Tensor) -> None:
    """One padded, masked SDPA over a group of sequences of different shapes.

    Queries are padded to the longest chunk (padding rows repeat the chunk's last query and are
    dropped afterwards) and keys to the longest sequence:

        qg [n, Lq_pad, Hq, D]       row i of sequence s = packed row cu[s] + min(i, q_len_s - 1)
        allowed[s, i, j] = j < seq_len_s and j <= cached_len_s + i
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    dev = q.device
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


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            out: torch.Tensor) -> torch.Tensor:
    """Extend-case prefill; q packed [total_q, num_q_heads, head_dim] -> out (see module doc)."""
    cu = cu_seqlens_q.tolist()
    lens_list = seq_lens.tolist()
    q_lens = [cu[s + 1] - cu[s] for s in range(len(lens_list))]
    live = [s for s in range(len(lens_list)) if q_lens[s] > 0]
    flash = _flash_with_lse()
    shapes: dict[tuple[int, int], list[int]] = {}
    for s in live:
        shapes.setdefault((lens_list[s] - q_lens[s], q_lens[s]), []).append(s)
    masked: list[int] = []
    for (cached, q_len), members in shapes.items():
        if (cached > 0 and flash is None) or (
                len(shapes) > _MAX_EXACT_SHAPES and q_len * (cached + q_len) < _MIN_EXACT_PAIRS):
            masked.extend(members)
            continue
        _prefill_exact(q, k_cache, v_cache, block_tables, members, [cu[s] for s in members],
                       cached, q_len, scale, out, flash)
    if not masked:
        return out
    masked.sort()
    costs = [max(1, q_lens[s] * lens_list[s] // 64) for s in masked]
    groups = _group_by_cost(costs, lambda g: len(g) * max(q_lens[masked[i]] for i in g)
                            * max(lens_list[masked[i]] for i in g) // 64)
    for group in groups:
        _prefill_masked(q, k_cache, v_cache, block_tables, seq_lens, [masked[i] for i in group],
                        cu, q_lens, lens_list, scale, out)
    return out


def copy_blocks(kv_cache: torch.Tensor, src_block_ids: torch.Tensor,
                dst_block_ids: torch.Tensor) -> None:
    """kv_cache[:, :, dst] = kv_cache[:, :, src] (all sources read before any write)."""
    kv_cache.index_copy_(2, dst_block_ids, kv_cache.index_select(2, src_block_ids))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """-> [n, num_layers, 2, block_size, kv_heads, head_dim], contiguous.

    One index_select over the block axis of a block-major *view*, written straight into the
    contiguous output: ~2.7x faster on CPU than selecting on axis 2 and then permuting+copying
    (which makes a second full pass over the bytes).
    """
    src = kv_cache.permute(2, 0, 1, 3, 4, 5)
    out = torch.empty((block_ids.numel(), *src.shape[1:]), dtype=kv_cache.dtype,
                      device=kv_cache.device)
    return torch.index_select(src, 0, block_ids, out=out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   blocks: torch.Tensor) -> None:
    """Inverse of gather_blocks: kv_cache[:, :, block_ids[i]] = blocks[i]."""
    kv_cache.index_copy_(2, block_ids, blocks.permute(1, 2, 0, 3, 4, 5))


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
