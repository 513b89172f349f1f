"""Triton paged attention: decode (split-K + log-sum-exp merge) and extend-case prefill.

Both kernels read K/V token tiles through the block table: token ``pos`` of sequence ``s`` is row
``block_tables[s, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE`` of the cache viewed as
[num_blocks * block_size, num_kv_heads, head_dim]. A tile of BLOCK_N tokens may span several
cache blocks (block sizes 8..64 all work with the same tile). Table entries and cache rows of
positions >= seq_len are masked out of every load, so garbage there is never read.

Softmax runs online in base 2 (scores pre-multiplied by scale * log2(e)), accumulating in fp32.
The launchers assume arguments checked by :mod:`radixkv.kernels.ops` (or
:mod:`radixkv.kernels.quantized`).

Quantized caches (``QUANT=1``: int8, ``QUANT=2``: fp8 e4m3): caches whose rows are
``ROW = HEAD_DIM + 2`` bytes, the 1-byte values followed by the row's fp16 scale
(radixkv/engine/kv_quant.py). The kernels read them in place: the byte tile and the tile's scales
(through a float16 view of the same cache, element ``row * ROW / 2 + HEAD_DIM / 2``) are loaded,
converted and multiplied in registers, so no dequantized copy of the cache is ever written.
e4m3 bytes are decoded with integer operations (:func:`_e4m3_to_f32`, exact for all 256 codes),
not a cast to Triton's fp8 type, so the same kernel runs on any GPU and under the interpreter.
Whatever domain the rows are in (kv_quant stores them rotated) is the caller's business: the
kernels compute plain attention over ``value * scale``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .triton_mode import check_mode

LOG2E = 1.4426950408889634


@triton.jit
def _e4m3_to_f32(b):
    # float8_e4m3fn bytes (uint8, any shape) -> their fp32 values, exactly, for all 256 codes.
    #   byte  s eeee mmm   normal (e >= 1): (1 + m/8) 2^(e-7)   subnormal (e = 0): m 2^-9
    #   0x7f / 0xff: NaN (e4m3fn has no infinities).
    # Moving e and m into fp32's exponent/mantissa fields and adding 120 to the exponent
    # (fp32 bias 127 - e4m3 bias 7) gives the normal values; a subnormal then reads
    # (1 + m/8) 2^-7 and is mapped to m 2^-9 = 2 (x - 2^-7). No fp32 denormal is formed, so
    # flush-to-zero arithmetic cannot change the result.
    b = b.to(tl.int32)
    mag = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    mag = tl.where((b & 0x78) == 0, 2.0 * (mag - 0.0078125), mag)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _load_rows(ptr, scale_ptr, row, d, live, HEAD_DIM: tl.constexpr, ROW: tl.constexpr,
               QUANT: tl.constexpr):
    # [N, HEAD_DIM] fp32 (QUANT) or cache-dtype values of cache rows ``row``; dead rows read 0.
    # QUANT = 1: int8 values; 2: e4m3 bytes (``ptr`` is a uint8 view); both times the row's
    # fp16 scale, read through ``scale_ptr`` (a float16 view of the same cache).
    x = tl.load(ptr + row[:, None] * ROW + d[None, :], mask=live[:, None], other=0)
    if QUANT:
        if QUANT == 2:
            x = _e4m3_to_f32(x)
        sc = tl.load(scale_ptr + row * (ROW // 2) + HEAD_DIM // 2, mask=live, other=0.0)
        x = x.to(tl.float32) * sc.to(tl.float32)[:, None]
    return x


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr,
                   part_out_ptr, part_lse_ptr,
                   scale_log2, stride_bt, num_kv_heads, tokens_per_split,
                   BLOCK_SIZE: tl.constexpr,   # tokens per cache block
                   HEAD_DIM: tl.constexpr,
                   ROW: tl.constexpr,          # cache elements per (token, head) row
                   QUANT: tl.constexpr,        # 1: int8 / 2: e4m3 rows + fp16 scale (ks_ptr)
                   GROUP: tl.constexpr,        # query heads per KV head
                   BLOCK_G: tl.constexpr,      # GROUP padded to a tl.dot-able power of two
                   BLOCK_N: tl.constexpr,      # tokens per tile
                   NUM_SPLITS: tl.constexpr,   # 1: write out directly; else partials
                   DOT_TY: tl.constexpr,       # operand dtype of tl.dot (see _dot_config)
                   PRECISION: tl.constexpr):   # tl.dot input precision ("ieee" for fp32)
    # Grid (seq, kv_head, split). Split j covers token positions
    #     [j * tokens_per_split, min(seq_len, (j + 1) * tokens_per_split))
    # for the GROUP query heads that share this KV head (K/V read once for all of them).
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + g                                       # query heads of this program
    q_rows = seq.to(tl.int64) * num_kv_heads * GROUP + head      # rows of q viewed [S*Hq, D]
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=(g < GROUP)[:, None],
                other=0.0).to(DOT_TY)

    # Phase 1: online softmax over this split's tokens.
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        live = pos < end
        block_id = tl.load(bt_row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        row = (block_id * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kvh
        k = _load_rows(k_ptr, ks_ptr, row, d, live, HEAD_DIM, ROW, QUANT).to(DOT_TY)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2   # [BLOCK_G, N]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))      # finite: a tile has >= 1 live token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_ptr, vs_ptr, row, d, live, HEAD_DIM, ROW, QUANT).to(DOT_TY)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v, input_precision=PRECISION)
        m_i = m_new

    # Phase 2: normalise; an empty split (start >= seq_len) has l_i == 0 and lse == -inf.
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    g_ok = (g < GROUP)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok)
    else:
        part = q_rows * NUM_SPLITS + split                        # [S, Hq, NUM_SPLITS] index
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=g_ok)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr,
                  HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    # Grid (seq * num_q_heads,). out = sum_j w_j o_j / sum_j w_j, w_j = 2^(lse_j - max lse).
    # Split 0 always holds >= 1 token, so max lse is finite; empty splits get weight 0.
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    ok = j < NUM_SPLITS
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + j, mask=ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_out_ptr + (row * NUM_SPLITS + j)[:, None] * HEAD_DIM + d[None, :],
                mask=ok[:, None], other=0.0)
    merged = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * HEAD_DIM + d, merged.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, lens_ptr, out_ptr,
                    scale_log2, stride_bt, num_q_heads, num_kv_heads,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    ROW: tl.constexpr, QUANT: tl.constexpr,   # as in _decode_kernel
                    GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr,     # queries per tile
                    BLOCK_N: tl.constexpr,     # keys per tile
                    DOT_TY: tl.constexpr, PRECISION: tl.constexpr):
    # Grid (query tile, seq, q_head). With q_len = cu[s+1] - cu[s], cached = seq_len - q_len:
    #   query row i of the chunk (i in [tile * BLOCK_M, tile * BLOCK_M + BLOCK_M)) sees keys
    #   [0, cached + i]; the tile as a whole needs keys [0, min(seq_len, cached + last + 1)).
    # Rows i >= q_len are padding: they see keys [0, seq_len) (never an all -inf row) and are
    # not stored. A tile past q_len runs zero key iterations.
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    seq_len = tl.load(lens_ptr + seq)
    cached = seq_len - q_len

    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    i_ok = i < q_len
    q_rows = (q_start + i).to(tl.int64) * num_q_heads + head
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=i_ok[:, None],
                other=0.0).to(DOT_TY)

    kv_end = tl.minimum(seq_len, cached + tile * BLOCK_M + BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for key0 in range(0, kv_end, BLOCK_N):
        pos = key0 + n
        live = pos < kv_end
        block_id = tl.load(bt_row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        row = (block_id * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kvh
        k = _load_rows(k_ptr, ks_ptr, row, d, live, HEAD_DIM, ROW, QUANT).to(DOT_TY)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2   # [M, N]
        allowed = live[None, :] & (pos[None, :] <= cached + i[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))      # finite: key 0 is in the first tile
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_ptr, vs_ptr, row, d, live, HEAD_DIM, ROW, QUANT).to(DOT_TY)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=i_ok[:, None])


def _dot_config(dtype: torch.dtype, device: torch.device) -> dict:
    """tl.dot operand dtype and precision: the cache dtype, fp32 at full ("ieee") precision.

    Triton 3.9's interpreter computes bf16 tl.dot wrongly (it hands numpy the raw bits), so on
    the CPU bf16 operands are widened to fp32 first; on CUDA bf16 stays bf16.
    """
    ty = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]
    if dtype == torch.bfloat16 and device.type != "cuda":
        ty = tl.float32
    return dict(DOT_TY=ty, PRECISION="ieee" if ty == tl.float32 else None)


def _num_programs_target(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: keep split-K exercised but the grid small


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int,
                      device: torch.device) -> int:
    """Splits per (sequence, KV head) so that the grid fills the device.

    Uses the block-table capacity as the context bound (no host sync on seq_lens) and keeps at
    least 4 tiles of work per split.
    """
    want = math.ceil(_num_programs_target(device) / max(1, num_seqs * num_kv_heads))
    most = max(1, math.ceil(max_context / (4 * block_n)))
    return max(1, min(want, most, 64))


#: QUANT code of each quantized cache dtype (rows of head_dim bytes + an fp16 scale).
_QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}


def _rows(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> dict:
    """Kernel arguments that describe the cache rows: plain, or int8 / e4m3 bytes + fp16 scale
    (the scale pointers are float16 views of the same caches; e4m3 values are read through
    uint8 views and decoded in the kernel)."""
    quant = _QUANT_CODES.get(k_cache.dtype, 0)
    if quant == 2:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return dict(k_ptr=k_cache, v_ptr=v_cache,
                ks_ptr=k_cache.view(torch.float16) if quant else k_cache,
                vs_ptr=v_cache.view(torch.float16) if quant else v_cache,
                ROW=head_dim + 2 if quant else head_dim, QUANT=quant)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                           out: torch.Tensor, num_splits: int | None) -> torch.Tensor:
    """q [S, Hq, D]; caches [N, bs, Hkv, D] (or int8 / float8_e4m3fn [N, bs, Hkv, D + 2]:
    values + fp16 scale); block_tables int32 [S, M]; seq_lens int32 [S]."""
    check_mode(_decode_kernel, q.device)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_n = 64 if head_dim <= 64 else 32
    capacity = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, block_n, q.device)
    num_splits = max(1, min(num_splits, triton.cdiv(capacity, block_n)))
    tokens_per_split = triton.cdiv(triton.cdiv(capacity, num_splits), block_n) * block_n
    num_splits = triton.cdiv(capacity, tokens_per_split)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, device=q.device,
                               dtype=torch.float32)
        part_lse = torch.empty(num_seqs, num_q_heads, num_splits, device=q.device,
                               dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    rows = _rows(k_cache, v_cache, head_dim)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, rows.pop("k_ptr"), rows.pop("v_ptr"), rows.pop("ks_ptr"), rows.pop("vs_ptr"),
        block_tables, seq_lens,
        out, part_out, part_lse,
        scale * LOG2E, block_tables.stride(0), num_kv_heads, tokens_per_split,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, **rows, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        NUM_SPLITS=num_splits, **_dot_config(q.dtype, q.device))
    if num_splits > 1:
        _merge_kernel[(num_seqs * num_q_heads,)](
            part_out, part_lse, out, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)))
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                            scale: float, out: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D] packed by cu_seqlens_q int32 [S+1]; seq_lens int32 [S] include the chunk;
    caches as in :func:`paged_decode_attention`.

    Reads max(q_len) on the host to size the grid (one sync on CUDA).
    """
    check_mode(_prefill_kernel, q.device)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_q == 0:
        return out
    block_m = 64 if max_q >= 64 else max(16, triton.next_power_of_2(max_q))
    block_n = 64 if head_dim <= 64 else 32
    grid = (triton.cdiv(max_q, block_m), num_seqs, num_q_heads)
    rows = _rows(k_cache, v_cache, head_dim)
    _prefill_kernel[grid](
        q, rows.pop("k_ptr"), rows.pop("v_ptr"), rows.pop("ks_ptr"), rows.pop("vs_ptr"),
        block_tables, cu_seqlens_q,
        seq_lens, out, scale * LOG2E, block_tables.stride(0), num_q_heads, num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, **rows, GROUP=num_q_heads // num_kv_heads,
        BLOCK_M=block_m, BLOCK_N=block_n, **_dot_config(q.dtype, q.device))
    return out
