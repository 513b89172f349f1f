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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_mode import check_mode, is_interpreted

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
    # The sign bit is moved into fp32's, not applied as ``-mag``: Triton 3.6 lowers float
    # negation to ``0 - x``, which turns the code 0x80 (-0.0) into +0.0.
    return (mag.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _mask2d(rows_ok, d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    # [N, BLOCK_D] (or [N, 1] when nothing is padded) mask of live rows x real head dims.
    # A head_dim that is not a power of two (Phi-3: 96) is padded to BLOCK_D lanes that are
    # never loaded or stored; a power of two gets no per-lane mask (loads stay vectorized).
    if BLOCK_D == HEAD_DIM:
        return rows_ok[:, None]
    else:
        return rows_ok[:, None] & (d < HEAD_DIM)[None, :]


@triton.jit
def _load_rows(ptr, scale_ptr, row, d, live, HEAD_DIM: tl.constexpr, ROW: tl.constexpr,
               QUANT: tl.constexpr, BLOCK_D: tl.constexpr):
    # [N, BLOCK_D] fp32 (QUANT) or cache-dtype values of cache rows ``row``; dead rows and
    # padding lanes read 0.
    # QUANT = 1: int8 values; 2: e4m3 bytes (``ptr`` is a uint8 view); both times the row's
    # fp16 scale, read through ``scale_ptr`` (a float16 view of the same cache).
    x = tl.load(ptr + row[:, None] * ROW + d[None, :], mask=_mask2d(live, d, HEAD_DIM, BLOCK_D),
                other=0)
    if QUANT:
        if QUANT == 2:
            x = _e4m3_to_f32(x)
        sc = tl.load(scale_ptr + row * (ROW // 2) + HEAD_DIM // 2, mask=live, other=0.0)
        x = x.to(tl.float32) * sc.to(tl.float32)[:, None]
    return x


@triton.jit
def _decode_tile(q, m_i, l_i, acc, tile, end, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh,
                 num_kv_heads, scale_log2, n, d,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROW: tl.constexpr,
                 QUANT: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    # One online-softmax step of decode over token positions [tile, tile + BLOCK_N) < end.
    pos = tile + n
    live = pos < end
    block_id = tl.load(bt_row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    row = (block_id * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kvh
    k = _load_rows(k_ptr, ks_ptr, row, d, live, HEAD_DIM, ROW, QUANT, BLOCK_D).to(DOT_TY)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2   # [BLOCK_G, N]
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))      # finite: a tile has >= 1 live token
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_ptr, vs_ptr, row, d, live, HEAD_DIM, ROW, QUANT, BLOCK_D).to(DOT_TY)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr,
                   part_out_ptr, part_lse_ptr,
                   scale_log2, stride_bt, num_kv_heads, tokens_per_split, num_splits,
                   BLOCK_SIZE: tl.constexpr,   # tokens per cache block
                   HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr,      # HEAD_DIM padded to a power of two >= 16
                   ROW: tl.constexpr,          # cache elements per (token, head) row
                   QUANT: tl.constexpr,        # 1: int8 / 2: e4m3 rows + fp16 scale (ks_ptr)
                   GROUP: tl.constexpr,        # query heads per KV head
                   BLOCK_G: tl.constexpr,      # GROUP padded to a tl.dot-able power of two
                   BLOCK_N: tl.constexpr,      # tokens per tile
                   SPLIT: tl.constexpr,        # False: write out directly; True: partials
                   WHILE_LOOP: tl.constexpr,   # interpreter: see _loop_form
                   DOT_TY: tl.constexpr,       # operand dtype of tl.dot (see _dot_config)
                   PRECISION: tl.constexpr):   # tl.dot input precision ("ieee" for fp32)
    # Grid (seq, kv_head, split). Split j covers token positions
    #     [j * tokens_per_split, min(seq_len, (j + 1) * tokens_per_split))
    # for the GROUP query heads that share this KV head (K/V read once for all of them).
    # tokens_per_split is a multiple of BLOCK_N but not of BLOCK_SIZE: a split may start and
    # end inside a cache block. A split past the sequence's end is empty (zero iterations);
    # the merge kernel never reads it.
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    head = kvh * GROUP + g                                       # query heads of this program
    q_rows = seq.to(tl.int64) * num_kv_heads * GROUP + head      # rows of q viewed [S*Hq, D]
    g_ok = _mask2d(g < GROUP, d, HEAD_DIM, BLOCK_D)
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=g_ok,
                other=0.0).to(DOT_TY)

    # Phase 1: online softmax over this split's tokens.
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if WHILE_LOOP:
        tile = start
        while tile < end:
            m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, tile, end, k_ptr, v_ptr, ks_ptr,
                                         vs_ptr, bt_row, kvh, num_kv_heads, scale_log2, n, d,
                                         BLOCK_SIZE, HEAD_DIM, ROW, QUANT, DOT_TY, PRECISION,
                                         BLOCK_D)
            tile += BLOCK_N
    else:
        for tile in range(start, end, BLOCK_N):
            m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, tile, end, k_ptr, v_ptr, ks_ptr,
                                         vs_ptr, bt_row, kvh, num_kv_heads, scale_log2, n, d,
                                         BLOCK_SIZE, HEAD_DIM, ROW, QUANT, DOT_TY, PRECISION,
                                         BLOCK_D)

    # Phase 2: normalise; an empty split (start >= seq_len) has l_i == 0 and lse == -inf.
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if SPLIT:
        part = q_rows * num_splits + split                        # [S, Hq, num_splits] index
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=g_ok)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g < GROUP)
    else:
        tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok)


@triton.jit
def _merge_chunk(part_out_ptr, part_lse_ptr, row, j0, used, m, w_sum, acc, num_splits,
                 HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # Fold partials [j0, j0 + BLOCK_S) (those < used) into the running (max, weight sum, acc).
    j = j0 + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok = j < used
    lse = tl.load(part_lse_ptr + row * num_splits + j, mask=ok, other=float("-inf"))
    o = tl.load(part_out_ptr + (row * num_splits + j)[:, None] * HEAD_DIM + d[None, :],
                mask=_mask2d(ok, d, HEAD_DIM, BLOCK_D), other=0.0)
    m_new = tl.maximum(m, tl.max(lse, 0))      # finite: split j0 < used holds >= 1 token
    alpha = tl.exp2(m - m_new)
    w = tl.exp2(lse - m_new)                   # 0 for masked entries
    return m_new, w_sum * alpha + tl.sum(w, 0), acc * alpha + tl.sum(w[:, None] * o, 0)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, lens_ptr, out_ptr, num_q_heads, tokens_per_split,
                  num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_D: tl.constexpr, WHILE_LOOP: tl.constexpr):
    # Grid (seq * num_q_heads,). out = sum_j w_j o_j / sum_j w_j, w_j = 2^(lse_j - max lse),
    # over the splits that hold tokens of this sequence: j < ceil(seq_len / tokens_per_split)
    # (split 0 always does: seq_len >= 1). Partials of the other splits are never read, so
    # a short sequence in a batch of long ones costs one chunk here, not num_splits.
    row = tl.program_id(0).to(tl.int64)
    seq_len = tl.load(lens_ptr + row // num_q_heads)
    used = tl.minimum(tl.cdiv(seq_len, tokens_per_split), num_splits)
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    w_sum = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    if WHILE_LOOP:
        j0 = used * 0
        while j0 < used:
            m, w_sum, acc = _merge_chunk(part_out_ptr, part_lse_ptr, row, j0, used, m, w_sum,
                                         acc, num_splits, HEAD_DIM, BLOCK_S, BLOCK_D)
            j0 += BLOCK_S
    else:
        for j0 in range(0, used, BLOCK_S):
            m, w_sum, acc = _merge_chunk(part_out_ptr, part_lse_ptr, row, j0, used, m, w_sum,
                                         acc, num_splits, HEAD_DIM, BLOCK_S, BLOCK_D)
    d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + row * HEAD_DIM + d, (acc / w_sum).to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _prefill_tile(q, m_i, l_i, acc, key0, kv_end, cached, i, k_ptr, v_ptr, ks_ptr, vs_ptr,
                  bt_row, kvh, num_kv_heads, scale_log2, n, d,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROW: tl.constexpr,
                  QUANT: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    # One online-softmax step of prefill: query rows i against keys [key0, key0 + BLOCK_N).
    pos = key0 + n
    live = pos < kv_end
    block_id = tl.load(bt_row + pos // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    row = (block_id * BLOCK_SIZE + pos % BLOCK_SIZE) * num_kv_heads + kvh
    k = _load_rows(k_ptr, ks_ptr, row, d, live, HEAD_DIM, ROW, QUANT, BLOCK_D).to(DOT_TY)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2   # [M, N]
    allowed = live[None, :] & (pos[None, :] <= cached + i[:, None])
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))      # finite: key 0 is in the first tile
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_rows(v_ptr, vs_ptr, row, d, live, HEAD_DIM, ROW, QUANT, BLOCK_D).to(DOT_TY)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_q_ptr, lens_ptr, out_ptr,
                    scale_log2, stride_bt, num_q_heads, num_kv_heads,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    ROW: tl.constexpr, QUANT: tl.constexpr,   # as in _decode_kernel
                    GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr,     # queries per tile
                    BLOCK_N: tl.constexpr,     # keys per tile
                    WHILE_LOOP: tl.constexpr,  # interpreter: see _loop_form
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
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    i_ok = i < q_len
    q_rows = (q_start + i).to(tl.int64) * num_q_heads + head
    io_mask = _mask2d(i_ok, d, HEAD_DIM, BLOCK_D)
    q = tl.load(q_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], mask=io_mask,
                other=0.0).to(DOT_TY)

    kv_end = tl.minimum(seq_len, cached + tile * BLOCK_M + BLOCK_M)
    kv_end = tl.where(tile * BLOCK_M < q_len, kv_end, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    if WHILE_LOOP:
        key0 = kv_end * 0
        while key0 < kv_end:
            m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, key0, kv_end, cached, i, k_ptr,
                                          v_ptr, ks_ptr, vs_ptr, bt_row, kvh, num_kv_heads,
                                          scale_log2, n, d, BLOCK_SIZE, HEAD_DIM, ROW, QUANT,
                                          DOT_TY, PRECISION, BLOCK_D)
            key0 += BLOCK_N
    else:
        for key0 in range(0, kv_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(q, m_i, l_i, acc, key0, kv_end, cached, i, k_ptr,
                                          v_ptr, ks_ptr, vs_ptr, bt_row, kvh, num_kv_heads,
                                          scale_log2, n, d, BLOCK_SIZE, HEAD_DIM, ROW, QUANT,
                                          DOT_TY, PRECISION, BLOCK_D)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=io_mask)


def _dot_config(dtype: torch.dtype, device: torch.device) -> dict:
    """tl.dot operand dtype and precision: the cache dtype, fp32 at full ("ieee") precision.

    Triton 3.9's interpreter computes bf16 tl.dot wrongly (it hands numpy the raw bits), so on
    the CPU bf16 operands are widened to fp32 first; on CUDA bf16 stays bf16.
    """
    ty = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]
    if dtype == torch.bfloat16 and device.type != "cuda":
        ty = tl.float32
    return dict(DOT_TY=ty, PRECISION="ieee" if ty == tl.float32 else None)


def _loop_form(kernel: object) -> dict:
    """``WHILE_LOOP``: True under the interpreter, False compiled.

    The kernels' token loops have bounds read from memory. Compiled, they are ``for`` loops
    (``scf.for``, which Triton software-pipelines: the next tile's loads overlap this tile's
    math). Triton 3.6's interpreter cannot run such a ``for``: it turns the bound into a Python
    int with ``int(array)`` on a one-element 1-d numpy array, which recent numpy (2.4) rejects
    (``TypeError: only 0-dimensional arrays can be converted to Python scalars``; 3.9 squeezes
    first). A ``while`` loop only needs ``bool()`` of the condition, which both versions handle,
    so under the interpreter the same loop body (a shared ``@triton.jit`` helper) runs in a
    ``while``. Only the two-line loop header differs between what the CPU tests run and what
    the GPU runs.
    """
    return dict(WHILE_LOOP=is_interpreted(kernel))


#: Launch shape of each kernel on CUDA, by head_dim: tokens per tile, warps, pipeline stages.
#: The fastest shapes of ``radixkv bench kernels --sweep`` on an H200 (docs/kernels.md has the
#: before/after times). Overridable per call (``config=``), which the sweep uses to time the
#: alternatives on the GPU at hand. The interpreter ignores warps and stages.
DECODE_CONFIG = {64: dict(BLOCK_N=64, num_warps=4, num_stages=3),
                 128: dict(BLOCK_N=64, num_warps=4, num_stages=3)}
PREFILL_CONFIG = {64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
                  128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)}

#: Programs per SM the split plan aims for: enough resident warps per SM for the tiles' loads
#: to overlap (a decode program is a bandwidth stream; 1-2 per SM cannot fill HBM). Compiled
#: for sm_90 (tests/kernels/triton_aot.py), a decode program takes 64 (head_dim 64) to 80
#: (128) registers x 128 threads and 21 KB (head_dim 64) to 39 KB (128, BLOCK_N 64) of shared
#: memory, so 5-8 are resident on a Hopper SM: about one full wave.
PROGRAMS_PER_SM = 8
#: Upper bound of splits per (sequence, KV head); the merge kernel loops over them in chunks.
#: 1 x 131072 tokens with 3 KV heads needs ~350 splits to fill 132 SMs.
MAX_SPLITS = 512
#: Least tiles of work per split: below that, writing and merging partials costs more than the
#: extra parallelism gives.
MIN_TILES_PER_SPLIT = 4


def _block_d(head_dim: int) -> int:
    """Lanes of a row in the kernels: head_dim padded to a power of two (tl.arange) >= 16
    (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))


def _launch_config(table: dict, head_dim: int, device: torch.device,
                   override: dict | None) -> dict:
    cfg = dict(table[64 if _block_d(head_dim) <= 64 else 128])
    if override:
        cfg.update(override)
    if device.type != "cuda":   # the interpreter: no warps or stages
        cfg.pop("num_warps", None)
        cfg.pop("num_stages", None)
    return cfg


def _num_programs_target(device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return PROGRAMS_PER_SM * sms
    return 8  # interpreter: keep split-K exercised but the grid small


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int,
                      device: torch.device) -> int:
    """Splits per (sequence, KV head) so that the grid fills the device.

    ``max_context`` is a host-side bound of the sequences' lengths (the block-table capacity:
    no host sync on seq_lens). Keeps at least MIN_TILES_PER_SPLIT tiles of work per split and
    at most MAX_SPLITS splits.
    """
    want = math.ceil(_num_programs_target(device) / max(1, num_seqs * num_kv_heads))
    most = max(1, math.ceil(max_context / (MIN_TILES_PER_SPLIT * block_n)))
    return max(1, min(want, most, MAX_SPLITS))


@dataclass
class DecodePlan:
    """What one decode step's launches share across layers: the split of the context and the
    partials' buffers. Computed on the host from shapes alone (no device readback), once per
    step when the caller keeps a ``plan`` dict for the step (the engine does)."""
    key: tuple                 # (num_seqs, num_q_heads, head_dim, capacity, device, request)
    num_splits: int            # programs per (sequence, KV head) along the context
    tokens_per_split: int      # a multiple of BLOCK_N; num_splits * this >= capacity
    part_out: torch.Tensor | None   # fp32 [S, Hq, num_splits, D] when num_splits > 1
    part_lse: torch.Tensor | None   # fp32 [S, Hq, num_splits] (log2-sum-exp of each split)


def plan_decode(num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                capacity: int, block_n: int, device: torch.device,
                num_splits: int | None) -> DecodePlan:
    """Split the context [0, capacity) into equal BLOCK_N-aligned ranges, one per program.

    capacity: block-table columns x block size (>= every seq_len). A sequence shorter than
    capacity leaves its last splits empty; those programs exit at once and the merge reads only
    the splits that hold its tokens.
    """
    key = (num_seqs, num_q_heads, head_dim, capacity, device, num_splits)
    want = num_splits
    if want is None:
        want = choose_num_splits(num_seqs, num_kv_heads, capacity, block_n, device)
    want = max(1, min(want, triton.cdiv(capacity, block_n)))
    tokens_per_split = triton.cdiv(triton.cdiv(capacity, want), block_n) * block_n
    splits = triton.cdiv(capacity, tokens_per_split)
    part_out = part_lse = None
    if splits > 1:
        part_out = torch.empty(num_seqs, num_q_heads, splits, head_dim, device=device,
                               dtype=torch.float32)
        part_lse = torch.empty(num_seqs, num_q_heads, splits, device=device,
                               dtype=torch.float32)
    return DecodePlan(key, splits, tokens_per_split, part_out, part_lse)


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
                           out: torch.Tensor, num_splits: int | None, plan: dict | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """q [S, Hq, D]; caches [N, bs, Hkv, D] (or int8 / float8_e4m3fn [N, bs, Hkv, D + 2]:
    values + fp16 scale); block_tables int32 [S, M]; seq_lens int32 [S].

    plan: a dict kept for one step (same q shape and block-table width on every layer): the
    split plan and the partials' buffers are made on the first layer and reused (key
    ``"triton_decode"``). config: launch-shape override (:data:`DECODE_CONFIG`).
    Launches: the decode kernel, plus the merge kernel when the context is split.
    """
    check_mode(_decode_kernel, q.device)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    cfg = _launch_config(DECODE_CONFIG, head_dim, q.device, config)
    capacity = block_tables.shape[1] * block_size
    key = (num_seqs, num_q_heads, head_dim, capacity, q.device, num_splits)
    split = plan.get("triton_decode") if plan is not None else None
    if split is None or split.key != key or config:
        split = plan_decode(num_seqs, num_q_heads, num_kv_heads, head_dim, capacity,
                            cfg["BLOCK_N"], q.device, num_splits)
        if plan is not None and not config:
            plan["triton_decode"] = split
    rows = _rows(k_cache, v_cache, head_dim)
    many = split.num_splits > 1
    _decode_kernel[(num_seqs, num_kv_heads, split.num_splits)](
        q, rows.pop("k_ptr"), rows.pop("v_ptr"), rows.pop("ks_ptr"), rows.pop("vs_ptr"),
        block_tables, seq_lens, out,
        split.part_out if many else out, split.part_lse if many else out,
        scale * LOG2E, block_tables.stride(0), num_kv_heads, split.tokens_per_split,
        split.num_splits,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), **rows,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), SPLIT=many,
        **_loop_form(_decode_kernel), **_dot_config(q.dtype, q.device), **cfg)
    if many:
        _merge_kernel[(num_seqs * num_q_heads,)](
            split.part_out, split.part_lse, seq_lens, out, num_q_heads,
            split.tokens_per_split, split.num_splits, HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            BLOCK_S=min(32, max(2, triton.next_power_of_2(split.num_splits))),
            **_loop_form(_merge_kernel))
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                            scale: float, out: torch.Tensor, max_q: int | None = None,
                            config: dict | None = None, plan: dict | None = None
                            ) -> torch.Tensor:
    """q [T, Hq, D] packed by cu_seqlens_q int32 [S+1]; seq_lens int32 [S] include the chunk;
    caches as in :func:`paged_decode_attention`.

    max_q: the longest chunk, when the caller knows it on the host; else it is read from
    cu_seqlens_q to size the grid (one sync on CUDA), once per step when a ``plan`` dict is
    kept for the step (key ``"triton_max_q"``). config: launch-shape override
    (:data:`PREFILL_CONFIG`).
    """
    check_mode(_prefill_kernel, q.device)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if max_q is None and plan is not None:
        max_q = plan.get("triton_max_q")
    if max_q is None:
        max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
        if plan is not None:
            plan["triton_max_q"] = max_q
    if max_q == 0:
        return out
    cfg = _launch_config(PREFILL_CONFIG, head_dim, q.device, config)
    if max_q < cfg["BLOCK_M"]:
        cfg["BLOCK_M"] = max(16, triton.next_power_of_2(max_q))
    grid = (triton.cdiv(max_q, cfg["BLOCK_M"]), num_seqs, num_q_heads)
    rows = _rows(k_cache, v_cache, head_dim)
    _prefill_kernel[grid](
        q, rows.pop("k_ptr"), rows.pop("v_ptr"), rows.pop("ks_ptr"), rows.pop("vs_ptr"),
        block_tables, cu_seqlens_q,
        seq_lens, out, scale * LOG2E, block_tables.stride(0), num_q_heads, num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), **rows,
        GROUP=num_q_heads // num_kv_heads,
        **_loop_form(_prefill_kernel), **_dot_config(q.dtype, q.device), **cfg)
    return out
