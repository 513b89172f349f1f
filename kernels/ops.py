"""Public, checked launchers of the paged KV-cache operations. See docs/kernels.md.

Layout (one device pool for all layers)::

    kv_cache  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (contiguous)
    k_cache = kv_cache[layer, 0]   v_cache = kv_cache[layer, 1]
              [num_blocks, block_size, num_kv_heads, head_dim]                   (contiguous)
    slot = block_id * block_size + offset          PAD_SLOT = -1: skipped by write_kv

Block table of a sequence of ``seq_len`` tokens: position ``pos`` lives in block
``block_tables[seq, pos // block_size]`` at offset ``pos % block_size``. Entries at columns
``>= ceil(seq_len / block_size)`` are garbage and are never read.

Every launcher checks its arguments (raising ``InvalidRequestError``) before it touches data, then
dispatches to a backend (see :mod:`radixkv.kernels.backend`).
"""

from __future__ import annotations

import torch

from . import checks, reference, torch_path
from .backend import resolve_backend
from .checks import fail
from .reference import PAD_SLOT

_INT = (torch.int32, torch.int64)


def _triton_attention():
    from . import triton_attention  # imported on first use: importing triton takes seconds
    return triton_attention


def _triton_cache():
    from . import triton_cache
    return triton_cache


def _scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if not isinstance(scale, (int, float)) or not scale > 0:
        fail(f"scale must be a positive number, got {scale!r}")
    return float(scale)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
             backend: str | None = None, check: bool = True, plan: dict | None = None) -> None:
    """Scatter new K/V rows into their cache slots.

    key, value:   [num_tokens, num_kv_heads, head_dim], cache dtype; each token's
                  [num_kv_heads, head_dim] must be contiguous (a token stride is allowed, so
                  slices of a fused QKV projection can be passed as they are). Strides of
                  size-1 axes are ignored (one KV head: any stride on that axis).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    slot_mapping: int64 [num_tokens]; slot = block_id * block_size + offset, or PAD_SLOT (-1)
                  to skip the token. Non-PAD slots must be distinct and < num_blocks * block_size.
    check:        False skips the value checks of slot_mapping (range, distinct), for a caller
                  that validated it already (the engine's ForwardBatch, once per step, not once
                  per layer); shapes, dtypes, devices and strides are always checked.
    plan:         torch backend: a dict kept for one batch (every layer of a forward), in which
                  what derives from slot_mapping alone is computed once (torch_path module doc).

    Example: block_size 16, a token at position 37 of a sequence whose block table is
    [7, 2, 9] goes to slot 9 * 16 + 37 % 16 = 149.
    """
    num_blocks, block_size, num_kv_heads, head_dim = checks.check_caches(k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        checks.check_tensor(name, t, ndim=3, dtypes=(k_cache.dtype,), contiguous=False)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            fail(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got "
                 f"{tuple(t.shape)}")
        if (head_dim > 1 and t.stride(2) != 1) or (num_kv_heads > 1 and t.stride(1) != head_dim):
            fail(f"{name}: each token's [num_kv_heads, head_dim] must be contiguous, got "
                 f"strides {t.stride()}")
    checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    if not (key.shape[0] == value.shape[0] == slot_mapping.shape[0]):
        fail(f"key ({key.shape[0]}), value ({value.shape[0]}) and slot_mapping "
             f"({slot_mapping.shape[0]}) must have the same number of tokens")
    device = checks.check_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                                      slot_mapping=slot_mapping)
    if check and device.type == "cpu" and slot_mapping.numel():
        live = slot_mapping[slot_mapping != PAD_SLOT]
        if live.numel():
            lo, hi = (int(x) for x in torch.aminmax(live))
            if lo < 0 or hi >= num_blocks * block_size:
                fail(f"slot_mapping entries must be PAD_SLOT ({PAD_SLOT}) or lie in "
                     f"[0, {num_blocks * block_size}), got min {lo} max {hi}")
        if live.numel() > 1 and live.unique().numel() != live.numel():
            fail("slot_mapping has duplicate non-PAD slots: two tokens cannot share a slot")
    if slot_mapping.numel() == 0:
        return
    name = resolve_backend(backend, device)
    if name == "triton":
        _triton_cache().write_kv(key, value, k_cache, v_cache, slot_mapping)
    elif name == "torch":
        torch_path.write_kv(key, value, k_cache, v_cache, slot_mapping, plan)
    else:
        reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                           scale: float | None = None, out: torch.Tensor | None = None,
                           backend: str | None = None,
                           num_splits: int | None = None, check: bool = True,
                           plan: dict | None = None) -> torch.Tensor:
    """One new query token per sequence attends to the sequence's cached tokens.

    q:            [num_seqs, num_q_heads, head_dim], dtype of the cache (any float dtype for
                  a quantized cache; the output's dtype), contiguous;
                  num_q_heads = G * num_kv_heads (query head h reads KV head h // G).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; or int8 /
                  float8_e4m3fn [..., head_dim + 2]: each row's values then its fp16 scale
                  (kv_quant's rows), read in place by Triton, dequantized by the other
                  backends.
    block_tables: int32 [num_seqs, max_blocks_per_seq]; only the first
                  ceil(seq_len / block_size) entries of a row are read.
    seq_lens:     int32 [num_seqs], in [1, max_blocks_per_seq * block_size]: tokens to attend
                  to, the current token included (its K/V written with write_kv first).
    scale:        softmax scale, default head_dim ** -0.5.
    out:          optional [num_seqs, num_q_heads, head_dim] (q's dtype) to write into.
    num_splits:   Triton only: programs per (sequence, KV head) along the context (split-K);
                  None picks one that fills the GPU.
    check:        False skips the value checks (seq_lens range, used table entries in the pool)
                  for a caller that validated the batch already; structure is always checked.
    plan:         a dict kept for one batch (same block_tables and seq_lens, e.g. every layer
                  of a forward): the torch backend derives grouping, gather ids and masks once;
                  Triton its split plan and partials' buffers (host-side, no device readback).
    Returns out:  [num_seqs, num_q_heads, head_dim].

    out[s, h] = softmax(scale * q[s, h] . K[s, :, h // G]) @ V[s, :, h // G], where K[s, t] is the
    token at position t < seq_lens[s] read through block_tables[s].
    """
    num_blocks, block_size, num_kv_heads, head_dim = checks.check_caches(k_cache, v_cache, True)
    q = checks.check_query(q, k_cache.dtype, num_kv_heads, head_dim, "num_seqs")
    checks.check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    num_seqs = q.shape[0]
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        fail(f"q ({num_seqs}), block_tables ({block_tables.shape[0]}) and seq_lens "
             f"({seq_lens.shape[0]}) must have one row per sequence")
    if block_tables.shape[1] < 1:
        fail("block_tables must have at least one column")
    device = checks.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache,
                                      block_tables=block_tables, seq_lens=seq_lens)
    checks.check_out(out, q)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        fail(f"num_splits must be a positive int or None, got {num_splits!r}")
    if check and device.type == "cpu":
        _check_tables(block_tables, seq_lens.tolist(), block_size, num_blocks, min_len=1)
    sc = _scale(scale, head_dim)
    name = resolve_backend(backend, device)
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if name == "triton":
        return _triton_attention().paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, sc, out, num_splits, plan)
    k_cache, v_cache = _dequantized(k_cache, q.dtype), _dequantized(v_cache, q.dtype)
    if name == "torch":
        return torch_path.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                                 sc, out, plan)
    out.copy_(reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, sc))
    return out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, *, scale: float | None = None,
                            out: torch.Tensor | None = None,
                            backend: str | None = None, check: bool = True,
                            plan: dict | None = None,
                            max_q_len: int | None = None) -> torch.Tensor:
    """A chunk of new tokens per sequence attends causally to its cached prefix and itself.

    q:            [total_q_tokens, num_q_heads, head_dim], packed: the chunk of sequence s is
                  rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]); dtype of the cache, contiguous.
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, already
                  holding the chunk's K/V (written with write_kv before the call); or int8 /
                  float8_e4m3fn rows with their scale, as in :func:`paged_decode_attention`.
    block_tables: int32 [num_seqs, max_blocks_per_seq].
    cu_seqlens_q: int32 [num_seqs + 1], non-decreasing, cu[0] = 0, cu[-1] = total_q_tokens.
    seq_lens:     int32 [num_seqs]: tokens of each sequence INCLUDING the chunk, so
                  cached_len = seq_len - q_len >= 0.
    check:        False skips the value checks (cu_seqlens_q, seq_lens, used table entries)
                  for a caller that validated the batch already; structure is always checked.
    plan:         a per-batch dict, as in :func:`paged_decode_attention` (Triton keeps the
                  longest chunk there: one device read per step, not per layer).
    max_q_len:    Triton: the longest chunk (max of cu_seqlens_q's differences) when the caller
                  has it on the host; otherwise it is read from the device (one sync on CUDA).
                  Not checked against cu_seqlens_q: a smaller value leaves rows unwritten.
    Returns out:  [total_q_tokens, num_q_heads, head_dim].

    Query i (0-based within its chunk) attends to keys [0, cached_len + i]. Example: a sequence
    with 5 cached tokens and a chunk of 3 has seq_len 8; its queries see keys [0, 5], [0, 6],
    [0, 7].
    """
    num_blocks, block_size, num_kv_heads, head_dim = checks.check_caches(k_cache, v_cache, True)
    q = checks.check_query(q, k_cache.dtype, num_kv_heads, head_dim, "total_q_tokens")
    checks.check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    checks.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,))
    checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        fail(f"block_tables ({block_tables.shape[0]} rows) and seq_lens ({num_seqs}) need one "
             f"row per sequence and cu_seqlens_q num_seqs + 1 entries "
             f"(got {cu_seqlens_q.shape[0]})")
    if block_tables.shape[1] < 1:
        fail("block_tables must have at least one column")
    device = checks.check_same_device(q=q, k_cache=k_cache, v_cache=v_cache,
                                      block_tables=block_tables, cu_seqlens_q=cu_seqlens_q,
                                      seq_lens=seq_lens)
    checks.check_out(out, q)
    if max_q_len is not None and (not isinstance(max_q_len, int) or max_q_len < 0):
        fail(f"max_q_len must be a non-negative int or None, got {max_q_len!r}")
    if check and device.type == "cpu":
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in zip(cu, cu[1:])]
        if cu[0] != 0 or cu[-1] != q.shape[0] or (num_seqs and min(q_lens) < 0):
            fail(f"cu_seqlens_q must rise from 0 to total_q_tokens ({q.shape[0]}), got "
                 f"{cu[:8]}{'...' if num_seqs > 7 else ''}")
        lens = seq_lens.tolist()
        if any(n < m for n, m in zip(lens, q_lens)):
            fail("seq_lens must include the chunk: seq_len >= q_len for every sequence")
        _check_tables(block_tables, lens, block_size, num_blocks, min_len=0)
        if max_q_len is not None and num_seqs and max_q_len != max(q_lens):
            fail(f"max_q_len ({max_q_len}) must be the longest chunk ({max(q_lens)})")
    sc = _scale(scale, head_dim)
    name = resolve_backend(backend, device)
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if name == "triton":
        return _triton_attention().paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sc, out, max_q_len,
            plan=plan)
    k_cache, v_cache = _dequantized(k_cache, q.dtype), _dequantized(v_cache, q.dtype)
    if name == "torch":
        return torch_path.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                  cu_seqlens_q, seq_lens, sc, out, plan)
    out.copy_(reference.paged_prefill_attention(q, k_cache, v_cache, block_tables,
                                                cu_seqlens_q, seq_lens, sc))
    return out


def dequantize_int8_rows(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[..., d + 2]`` int8 or float8_e4m3fn rows (values, then the fp16 scale's bytes) ->
    ``[..., d]`` values times scale in ``dtype``: what the Triton kernels compute in registers
    (the name is historical: fp8 rows are read the same way)."""
    n = checks.QUANT_SCALE_ELEMS
    scale = cache[..., -n:].contiguous().view(torch.int8).view(torch.float16).float()
    return (cache[..., :-n].float() * scale).to(dtype)


def _dequantized(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float cache as it is; a quantized cache dequantized whole (the torch and reference
    backends' reading of them: simple, not fast; the engine gathers the used blocks)."""
    return dequantize_int8_rows(cache, dtype) if cache.dtype in checks.QUANT_DTYPES else cache


def _check_tables(block_tables: torch.Tensor, lens: list[int], block_size: int,
                  num_blocks: int, *, min_len: int) -> None:
    """Value checks (CPU): min_len <= lens <= table capacity; used table entries in the pool.

    Same errors as ``checks.check_seq_lens`` / ``checks.check_used_block_tables``, with the
    lengths read once as host ints and one ``aminmax`` over the used columns.
    """
    if not lens:
        return
    capacity = block_tables.shape[1] * block_size
    lo, hi = min(lens), max(lens)
    if lo < min_len or hi > capacity:
        fail(f"seq_lens must lie in [{min_len}, {capacity}] (max_blocks_per_seq "
             f"{block_tables.shape[1]} x block_size {block_size}), got min {lo} max {hi}")
    nb = -(-hi // block_size)
    if nb == 0:
        return
    used = block_tables[:, :nb]
    if -(-lo // block_size) < nb:   # ragged: entries past a row's used blocks are garbage
        used_blocks = torch.tensor([-(-n // block_size) for n in lens])
        keep = torch.arange(nb)[None, :] < used_blocks[:, None]
        used = used[keep]
    if used.numel():
        b_lo, b_hi = (int(x) for x in torch.aminmax(used))
        if b_lo < 0 or b_hi >= num_blocks:
            fail(f"block_tables (entries within seq_lens) must lie in [0, {num_blocks}), got "
                 f"min {b_lo} max {b_hi}")


def _check_pool(kv_cache: object) -> torch.Tensor:
    """kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], contiguous;
    a float cache, or a quantized one (int8 / float8_e4m3fn rows of head_dim + 2 with their
    scales): the block ops below move bytes and never look inside a row."""
    t = checks.check_tensor("kv_cache", kv_cache, ndim=6,
                            dtypes=checks.FLOAT_DTYPES + checks.QUANT_DTYPES)
    if t.shape[1] != 2:
        fail(f"kv_cache dim 1 must be 2 (K and V), got shape {tuple(t.shape)}")
    return t


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as int8 (same bytes): index_copy_ and friends, and Triton's loads, are
    not implemented for float8 everywhere; every other dtype as it is."""
    return t.view(torch.int8) if t.dtype == torch.float8_e4m3fn else t


def _check_block_ids(name: str, ids: object, kv_cache: torch.Tensor, *,
                     host_ok: bool = False) -> torch.Tensor:
    """int64 [n] ids in [0, num_blocks), on kv_cache's device (or, with host_ok, the CPU)."""
    t = checks.check_tensor(name, ids, ndim=1, dtypes=(torch.int64,))
    if not (host_ok and t.device.type == "cpu"):
        checks.check_same_device(kv_cache=kv_cache, **{name: t})
    checks.check_block_ids_in_range(name, t, kv_cache.shape[2])
    return t


def copy_blocks(kv_cache: torch.Tensor, src_block_ids: torch.Tensor,
                dst_block_ids: torch.Tensor, *, backend: str | None = None) -> None:
    """Copy every layer's K and V of block src[i] onto block dst[i] (copy-on-write).

    kv_cache:      [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    src_block_ids, dst_block_ids: int64 [n], in [0, num_blocks). Destinations must be distinct
                   and must not also be sources (the copies run in parallel). The ids are read
                   to check that: ids on kv_cache's device cost host syncs on CUDA; CPU ids
                   (what a block manager has) are checked on the host and moved to the device
                   in one transfer, with no sync.

    One launch on Triton, for every pair, layer, K and V.
    """
    kv = _check_pool(kv_cache)
    src = _check_block_ids("src_block_ids", src_block_ids, kv, host_ok=True)
    dst = _check_block_ids("dst_block_ids", dst_block_ids, kv, host_ok=True)
    checks.check_same_device(src_block_ids=src, dst_block_ids=dst)
    if src.shape != dst.shape:
        fail(f"src_block_ids ({src.shape[0]}) and dst_block_ids ({dst.shape[0]}) must pair up")
    if dst.numel() == 0:
        return
    if dst.unique().numel() != dst.numel():
        fail("dst_block_ids must be distinct")
    if bool(torch.isin(dst, src).any()):
        fail("a block cannot be both a source and a destination of one copy_blocks call")
    name = resolve_backend(backend, kv.device)
    kv = _as_bytes(kv)
    if src.device != kv.device:
        ids = torch.stack([src, dst]).to(kv.device, non_blocking=True)
        src, dst = ids[0], ids[1]
    if name == "triton":
        _triton_cache().copy_blocks(kv, src, dst)
    elif name == "torch":
        torch_path.copy_blocks(kv, src, dst)
    else:
        reference.copy_blocks(kv, src, dst)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Stage blocks for a tier move: one contiguous buffer, block-major.

    kv_cache:  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    block_ids: int64 [n], in [0, num_blocks), on kv_cache's device.
    Returns:   [n, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous, with
               result[i] == kv_cache[:, :, block_ids[i]] (so result[i] is one block's bytes).
    """
    kv = _check_pool(kv_cache)
    ids = _check_block_ids("block_ids", block_ids, kv)
    return torch_path.gather_blocks(_as_bytes(kv), ids).view(kv.dtype)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                   blocks: torch.Tensor) -> None:
    """Inverse of gather_blocks: kv_cache[:, :, block_ids[i]] = blocks[i].

    blocks:    [n, num_layers, 2, block_size, num_kv_heads, head_dim], kv_cache's dtype and
               device (any strides); block_ids: int64 [n], distinct, in [0, num_blocks).
    """
    kv = _check_pool(kv_cache)
    ids = _check_block_ids("block_ids", block_ids, kv)
    checks.check_tensor("blocks", blocks, ndim=6, dtypes=(kv.dtype,), contiguous=False)
    expected = (ids.shape[0], kv.shape[0], 2, *kv.shape[3:])
    if tuple(blocks.shape) != expected:
        fail(f"blocks must be {expected}, got {tuple(blocks.shape)}")
    checks.check_same_device(kv_cache=kv, blocks=blocks)
    if ids.unique().numel() != ids.numel():
        fail("block_ids must be distinct")
    torch_path.scatter_blocks(_as_bytes(kv), ids, _as_bytes(blocks))
