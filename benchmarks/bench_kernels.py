"""How fast are the paged KV kernels compared with dense attention on the same K/V?

On the CPU (the engine's torch path): paged decode / prefill time vs
``scaled_dot_product_attention``
on the same K/V laid out densely (baseline measured in the same run: causal SDPA without a mask
when nothing is cached, a boolean mask otherwise), and vs the plain reference.
On CUDA (Triton): decode achieved bandwidth (K/V bytes read / time) against a device-to-device
copy measured in the same run, and against dense SDPA; prefill TFLOP/s against dense SDPA of the
same shape; copy_blocks GB/s.

Formulas (in the code below): decode bytes = sum(seq_len) * kv_heads * head_dim * 2 (K and V) *
element size; attention FLOPs = 4 * q_heads * head_dim * (number of (query, key) pairs attended);
copy GB/s = bytes read + bytes written, over time.

On CUDA the cases run for two attention shapes (SmolLM2's 9/3 heads x 64 and Llama-3.1-8B's
32/8 x 128), int8 / fp8 decode is timed against bf16 KV of the same shape, and every row names
the card.

On the CPU also attention **as a step meets it** (``cold decode``, ``cold prefill``: a chat
turn's 32 new tokens over its cached history): one call per layer of the embedded model (30),
each layer with its own cache, so that K and V come from memory as they do after a step's
GEMMs have streamed the weights through every cache level (the other rows reuse one cache,
which then sits in L2/L3); with ``pool Nx``, the sequences' blocks are scattered over a pool N
times larger, as in a server whose pool has churned. Its baseline, measured in the same run: a plain
streaming read (``sum`` of a 256 MiB tensor) on the same threads; the row gives the decode's
K/V GB/s and its fraction of that read.

``--sweep`` (CUDA) times every launch shape in SWEEP_DECODE / SWEEP_PREFILL instead, fastest
first, to tune ``triton_attention.DECODE_CONFIG`` / ``PREFILL_CONFIG`` on the card at hand.

Usage: ``radixkv bench kernels [--quick] [--sweep] [--threads N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch
import torch.nn.functional as F

from radixkv.kernels import copy_blocks, paged_decode_attention, paged_prefill_attention, write_kv

from ._common import plain_doc, print_table, run_header, time_median, write_results

# The embedded model's attention shape (SmolLM2: 9 query heads, 3 KV heads, head_dim 64).
MODEL = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
# On CUDA also the Llama-3.1-8B attention shape (32 / 8 heads, head_dim 128): both head dims.
MODEL_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def _paged(lens: list[int], dtype, device, gen, *, num_q_heads, num_kv_heads, head_dim,
           block_size):
    """Random K/V for sequences of the given lengths, scattered over shuffled blocks, plus the
    same K/V as dense padded [num_seqs, kv_heads, max_len, head_dim] tensors."""
    nbs = [-(-n // block_size) for n in lens]
    num_blocks = sum(nbs) + 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Drawn on the device (seeded from gen): a GPU case holds up to 2 x 268M values, which
    # would take seconds to draw on the CPU and copy over.
    dev_gen = torch.Generator(device=device).manual_seed(
        int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    k_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    v_cache = torch.randn(shape, generator=dev_gen, device=device).to(dtype)
    bt = _block_table(nbs, num_blocks, gen).to(device)
    max_len = max(lens)
    dense_k = torch.zeros(len(lens), num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
    dense_v = torch.zeros_like(dense_k)
    for s, n in enumerate(lens):
        ids = bt[s, :nbs[s]].long()
        dense_k[s, :, :n] = k_cache[ids].reshape(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
        dense_v[s, :, :n] = v_cache[ids].reshape(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, bt, seq_lens, dense_k, dense_v


def _block_table(nbs: list[int], num_blocks: int, gen) -> torch.Tensor:
    """Block tables for sequences of ``nbs`` blocks each, drawn from a shuffled pool of
    ``num_blocks`` (so no sequence's blocks are contiguous, as in a pool that has churned)."""
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(len(nbs), max(nbs), dtype=torch.int32)
    pos = 0
    for s, nb in enumerate(nbs):
        bt[s, :nb] = perm[pos:pos + nb].int()
        pos += nb
    return bt


def _timer(device: torch.device, quick: bool):
    repeat = 3 if quick else 7

    def run(fn) -> float:
        if device.type == "cuda":
            def synced():
                fn()
                torch.cuda.synchronize()
            return time_median(synced, repeat=repeat * 3, warmup=3)
        return time_median(fn, repeat=repeat, warmup=1)
    return run


def bench_decode(cases, dtypes, device, gen, timer, with_reference: bool,
                 shape: dict | None = None) -> list[dict]:
    shape = shape or MODEL
    rows = []
    for name, lens in cases:
        for dtype in dtypes:
            k_cache, v_cache, bt, seq_lens, dk, dv = _paged(lens, dtype, device, gen, **shape)
            n, hq, hkv, d = len(lens), shape["num_q_heads"], shape["num_kv_heads"], \
                shape["head_dim"]
            q = torch.randn(n, hq, d, generator=gen).to(dtype).to(device)
            out = torch.empty_like(q)
            ragged = len(set(lens)) > 1
            mask = (torch.arange(max(lens), device=device)[None, :] <
                    seq_lens[:, None].long())[:, None, None, :] if ragged else None
            qg = q.view(n, hkv, hq // hkv, d)
            t_dense = timer(lambda: F.scaled_dot_product_attention(qg, dk, dv, attn_mask=mask))
            t_paged = timer(lambda: paged_decode_attention(q, k_cache, v_cache, bt, seq_lens,
                                                           out=out))
            kv_bytes = sum(lens) * hkv * d * 2 * q.element_size()
            row: dict[str, Any] = dict(
                op="decode", case=name, heads=f"{hq}/{hkv} x {d}",
                dtype=str(dtype).replace("torch.", ""),
                dense_ms=t_dense * 1e3, paged_ms=t_paged * 1e3, paged_over_dense=t_paged / t_dense,
                paged_GBps=kv_bytes / t_paged / 1e9)
            if with_reference:
                t_ref = timer(lambda: paged_decode_attention(q, k_cache, v_cache, bt, seq_lens,
                                                             backend="reference"))
                row["reference_ms"] = t_ref * 1e3
                row["reference_over_paged"] = t_ref / t_paged
            rows.append(row)
    return rows


def _read_bandwidth(timer) -> float:
    """Bytes per second of a plain streaming read on this thread count (the cold decode's
    baseline): the sum of a 256 MiB float32 tensor, far larger than any cache."""
    big = torch.ones(64 * 1024 * 1024)
    t = timer(lambda: big.sum())
    return big.numel() * big.element_size() / t


def bench_cold_decode(cases, dtypes, gen, timer, layers: int) -> list[dict]:
    """CPU attention over ``layers`` caches in turn, each cache its own memory, as a step's
    layers read theirs; against a streaming read. ``cases``: (name, sequence lengths, new
    tokens a sequence[, pool]): 1 is a decode step, more a prefill of that many over the rest
    cached (a chat turn extending its history). ``pool`` (default 1): the cache holds that many
    times the blocks the sequences use, theirs drawn at random from all of it, as in a
    long-running server's pool after evictions (measured: 48 chats through a 400-block pool
    left 0.31 of a running sequence's consecutive blocks adjacent, against 0.79 after 4); at 1
    the shuffled blocks lie in a pool just large enough, which the caches and TLBs cover."""
    read_bw = _read_bandwidth(timer)
    hq, hkv, d, bs = (MODEL[k] for k in ("num_q_heads", "num_kv_heads", "head_dim",
                                            "block_size"))
    rows = []
    for name, lens, new, *rest in cases:
        pool = rest[0] if rest else 1
        nbs = [-(-n // bs) for n in lens]
        num_blocks = pool * sum(nbs) + 8
        bt = _block_table(nbs, num_blocks, gen)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        for dtype in dtypes:
            caches = [tuple(torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
                            for _ in range(2)) for _ in range(layers)]
            q = torch.randn(len(lens) * new, hq, d, generator=gen).to(dtype)
            t = timer(functools.partial(_decode_layers, caches, q, bt, seq_lens, new))
            kv_bytes = sum(lens) * hkv * d * 2 * q.element_size() * layers
            rows.append(dict(op="cold decode" if new == 1 else "cold prefill",
                             case=f"{name} x {layers} layers"
                             + (f", pool {pool}x" if pool > 1 else ""), pool=pool,
                             dtype=str(dtype).replace("torch.", ""), step_ms=t * 1e3,
                             kv_GBps=kv_bytes / t / 1e9, read_GBps=read_bw / 1e9,
                             fraction_of_read=kv_bytes / t / read_bw))
    return rows


def _decode_layers(caches, q, bt, seq_lens, new: int) -> None:
    """One step's attention calls: every layer's cache in turn, as the engine calls the
    kernels (no argument checks); ``new`` query tokens a sequence (1: decode)."""
    out = torch.empty_like(q)
    if new == 1:
        for k_cache, v_cache in caches:
            paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, out=out, check=False)
        return
    cu = torch.arange(0, new * (len(seq_lens) + 1), new, dtype=torch.int32)
    for k_cache, v_cache in caches:
        paged_prefill_attention(q, k_cache, v_cache, bt, cu, seq_lens, out=out, check=False,
                                max_q_len=new)


def bench_prefill(cases, dtypes, device, gen, timer, with_reference: bool,
                  shape: dict | None = None) -> list[dict]:
    shape = shape or MODEL
    rows = []
    for name, cached, chunk, num_seqs in cases:
        for dtype in dtypes:
            lens = [cached + chunk] * num_seqs
            k_cache, v_cache, bt, seq_lens, dk, dv = _paged(lens, dtype, device, gen, **shape)
            hq, d = shape["num_q_heads"], shape["head_dim"]
            q = torch.randn(num_seqs * chunk, hq, d, generator=gen).to(dtype).to(device)
            cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=device) * chunk
            out = torch.empty_like(q)
            qd = q.view(num_seqs, chunk, hq, d).transpose(1, 2)
            key_pos = torch.arange(cached + chunk, device=device)
            allowed = key_pos[None, :] <= cached + torch.arange(chunk, device=device)[:, None]
            if cached == 0:   # what a dense model runs: causal, no mask (the fast CPU kernel)
                t_dense = timer(lambda: F.scaled_dot_product_attention(
                    qd, dk, dv, is_causal=True, enable_gqa=True))
            else:
                t_dense = timer(lambda: F.scaled_dot_product_attention(
                    qd, dk, dv, attn_mask=allowed, enable_gqa=True))
            t_paged = timer(lambda: paged_prefill_attention(q, k_cache, v_cache, bt, cu,
                                                            seq_lens, out=out))
            pairs = num_seqs * (chunk * cached + chunk * (chunk + 1) // 2)
            flops = 4 * hq * d * pairs
            row: dict[str, Any] = dict(
                op="prefill", case=name, heads=f"{hq}/{shape['num_kv_heads']} x {d}",
                dtype=str(dtype).replace("torch.", ""),
                dense_ms=t_dense * 1e3, paged_ms=t_paged * 1e3, paged_over_dense=t_paged / t_dense,
                paged_TFLOPs=flops / t_paged / 1e12, dense_TFLOPs=flops / t_dense / 1e12)
            if with_reference:
                t_ref = timer(lambda: paged_prefill_attention(q, k_cache, v_cache, bt, cu,
                                                              seq_lens, backend="reference"))
                row["reference_ms"] = t_ref * 1e3
                row["reference_over_paged"] = t_ref / t_paged
            rows.append(row)
    return rows


def bench_quantized_decode(lens: list[int], device, gen, timer) -> list[dict]:
    """int8 / fp8 caches read in place by the decode kernel vs the same shape in bf16 (the
    quantized rows hold head_dim bytes + an fp16 scale: about half the bytes)."""
    shape = MODEL
    k_cache, v_cache, bt, seq_lens, _, _ = _paged(lens, torch.bfloat16, device, gen, **shape)
    n, hq, d = len(lens), shape["num_q_heads"], shape["head_dim"]
    q = torch.randn(n, hq, d, generator=gen).to(torch.bfloat16).to(device)
    out = torch.empty_like(q)
    t_bf16 = timer(lambda: paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, out=out))
    rows = []
    for storage in (torch.int8, torch.float8_e4m3fn):
        qk, qv = (torch.randint(-100, 100, (*c.shape[:3], d + 2), generator=gen,
                                dtype=torch.int8).to(device) for c in (k_cache, v_cache))
        for c in (qk, qv):   # a valid scale in every row (the bytes after the values)
            c[..., d:] = torch.tensor([0.01], dtype=torch.float16).view(torch.int8).to(device)
        qk, qv = qk.view(storage), qv.view(storage)
        t = timer(lambda: paged_decode_attention(q, qk, qv, bt, seq_lens, out=out))
        rows.append(dict(op="decode quantized", case=f"{n} x {lens[0]}",
                         dtype=str(storage).replace("torch.", ""), paged_ms=t * 1e3,
                         bf16_ms=t_bf16 * 1e3, over_bf16=t / t_bf16,
                         paged_GBps=sum(lens) * shape["num_kv_heads"] * (d + 2) * 2 / t / 1e9))
    return rows


def bench_copies(device, gen, timer, quick: bool) -> list[dict]:
    """write_kv and copy_blocks GB/s, and a plain tensor copy of the same bytes as baseline."""
    layers, blocks, bs, hkv, d = (4 if quick else 30), 512, 16, 3, 64
    dtype = torch.bfloat16
    pool = torch.randn(layers, 2, blocks, bs, hkv, d, generator=gen).to(dtype).to(device)
    n = 64
    # Host ids, as a block manager has them: checked on the host, one transfer, no sync.
    src = torch.arange(0, n)
    dst = torch.arange(blocks - n, blocks)
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    t_copy = timer(lambda: copy_blocks(pool, src, dst))
    flat = pool[:, :, :n].contiguous()
    flat_dst = torch.empty_like(flat)
    t_base = timer(lambda: flat_dst.copy_(flat))
    tokens = 2048
    key = torch.randn(tokens, hkv, d, generator=gen).to(dtype).to(device)
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens].to(device)
    t_write = timer(lambda: write_kv(key, key, pool[0, 0], pool[0, 1], slots))
    moved = 2 * n * block_bytes
    written = 2 * 2 * tokens * hkv * d * pool.element_size()
    return [
        dict(op="copy_blocks", case=f"{n} blocks x {layers} layers", GBps=moved / t_copy / 1e9,
             baseline_GBps=moved / t_base / 1e9, ms=t_copy * 1e3),
        dict(op="write_kv", case=f"{tokens} tokens", GBps=written / t_write / 1e9,
             ms=t_write * 1e3),
    ]


#: Launch shapes ``--sweep`` times on CUDA (the defaults are in triton_attention.*_CONFIG).
SWEEP_DECODE = [dict(BLOCK_N=n, num_warps=w, num_stages=st)
                for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
SWEEP_PREFILL = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)
                 for m in (64, 128) for n in (32, 64) for w in (4, 8) for st in (2, 3)]


def sweep(device, gen, timer, copy_bw: float) -> list[dict]:
    """Time each launch shape of decode (64 x 4096 and 1 x 131072) and prefill
    (8 x (2048 cached + 512 new)) for both head dims; rows sorted fastest first per case, the
    defaults marked. For tuning DECODE_CONFIG / PREFILL_CONFIG on the card at hand."""
    from radixkv.kernels import triton_attention as ta

    rows: list[dict] = []
    for shape in (MODEL, MODEL_8B):
        hq, hkv, d = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"]
        default = ta.DECODE_CONFIG[64 if d <= 64 else 128]
        for name, lens in (("64 x 4096", [4096] * 64), ("1 x 131072", [131072])):
            k, v, bt, sl, _, _ = _paged(lens, torch.bfloat16, device, gen, **shape)
            q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16).to(device)
            out = torch.empty_like(q)
            kv_bytes = sum(lens) * hkv * d * 2 * 2
            case = []
            for cfg in SWEEP_DECODE:
                try:
                    t = timer(lambda: ta.paged_decode_attention(
                        q, k, v, bt, sl, d ** -0.5, out, None, config=cfg))
                except Exception as e:  # noqa: BLE001 - a shape the card cannot run
                    case.append(dict(op="decode", case=name, heads=f"{hq}/{hkv} x {d}",
                                     config=str(cfg), error=type(e).__name__))
                    continue
                case.append(dict(op="decode", case=name, heads=f"{hq}/{hkv} x {d}",
                                 config=str(cfg), default=cfg == default, ms=t * 1e3,
                                 fraction_of_copy_bw=kv_bytes / t / 1e9 / copy_bw))
                print(case[-1], flush=True)   # a sweep stopped by a time limit keeps its rows
            rows += sorted(case, key=lambda r: r.get("ms", float("inf")))
            del k, v
        default = ta.PREFILL_CONFIG[64 if d <= 64 else 128]
        lens = [2048 + 512] * 8
        k, v, bt, sl, _, _ = _paged(lens, torch.bfloat16, device, gen, **shape)
        q = torch.randn(8 * 512, hq, d, generator=gen).to(torch.bfloat16).to(device)
        cu = torch.arange(0, 9, dtype=torch.int32, device=device) * 512
        out = torch.empty_like(q)
        flops = 4 * hq * d * 8 * (512 * 2048 + 512 * 513 // 2)
        case = []
        for cfg in SWEEP_PREFILL:
            try:
                t = timer(lambda: ta.paged_prefill_attention(q, k, v, bt, cu, sl, d ** -0.5,
                                                             out, 512, config=cfg))
            except Exception as e:  # noqa: BLE001
                case.append(dict(op="prefill", case="8 x (2048 + 512)",
                                 heads=f"{hq}/{hkv} x {d}", config=str(cfg),
                                 error=type(e).__name__))
                continue
            case.append(dict(op="prefill", case="8 x (2048 + 512)", heads=f"{hq}/{hkv} x {d}",
                             config=str(cfg), default=cfg == default, ms=t * 1e3,
                             TFLOPs=flops / t / 1e12))
            print(case[-1], flush=True)
        rows += sorted(case, key=lambda r: r.get("ms", float("inf")))
    return rows


def bench_device_copy(device, timer) -> float:
    """Device-to-device copy bandwidth (read + write bytes / time) of a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / t / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv bench kernels", description=plain_doc(__doc__))
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true",
                        help="CUDA: time the Triton launch shapes (tile, warps, stages) of decode "
                             "and prefill instead, for tuning (writes kernels_sweep.json)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    header = run_header(seed=args.seed, quick=args.quick, torch_threads=torch.get_num_threads(),
                        backend="triton" if device.type == "cuda" else "torch", model_shape=MODEL)
    print(header)
    timer = _timer(device, args.quick)
    results: dict[str, Any] = {}
    if args.sweep:
        if device.type != "cuda":
            print("--sweep times compiled Triton launch shapes: it needs CUDA")
            return 2
        copy_bw = bench_device_copy(device, timer)
        rows = sweep(device, gen, timer, copy_bw)
        for r in rows:
            r["device"] = torch.cuda.get_device_name(device)
        print_table(rows, title=f"launch shapes, fastest first per case (copy {copy_bw:.0f} GB/s)")
        write_results("kernels_sweep", header, {"copy_GBps": copy_bw, "rows": rows})
        return 0
    if device.type == "cuda":
        copy_bw = bench_device_copy(device, timer)
        decode_cases = [("64 x 4096", [4096] * 64), ("8 x 32768", [32768] * 8),
                        ("1 x 131072", [131072])]
        prefill_cases = [("1 x (8192 cached + 2048 new)", 8192, 2048, 1),
                         ("8 x (2048 cached + 512 new)", 2048, 512, 8)]
        if args.quick:
            decode_cases, prefill_cases = decode_cases[:1], prefill_cases[1:]
        dtypes = [torch.bfloat16]
        decode = bench_decode(decode_cases, dtypes, device, gen, timer, False)
        decode += bench_decode(decode_cases, dtypes, device, gen, timer, False, MODEL_8B)
        decode += bench_quantized_decode([4096] * 64, device, gen, timer)
        for r in decode:
            r["device"] = torch.cuda.get_device_name(device)
            r["copy_GBps"] = copy_bw
            r["fraction_of_copy_bw"] = r["paged_GBps"] / copy_bw
        prefill = bench_prefill(prefill_cases, dtypes, device, gen, timer, False)
        prefill += bench_prefill(prefill_cases, dtypes, device, gen, timer, False, MODEL_8B)
    else:
        rng = torch.Generator().manual_seed(args.seed + 1)
        ragged = [int(x) for x in torch.randint(128, 1024, (16,), generator=rng)]
        decode_cases = [("4 x 64", [64] * 4), ("8 x 1024", [1024] * 8),
                        ("1 x 4096", [4096]), ("16 ragged 128..1024", ragged)]
        prefill_cases = [("1 x (1536 cached + 512 new)", 1536, 512, 1),
                         ("1 x (0 cached + 1024 new)", 0, 1024, 1),
                         ("1 x (0 cached + 2048 new)", 0, 2048, 1),
                         ("4 x (1024 cached + 64 new)", 1024, 64, 4)]
        if args.quick:
            decode_cases = [("4 x 64", [64] * 4), ("4 x 512", [512] * 4)]
            prefill_cases = [("1 x (256 cached + 128 new)", 256, 128, 1)]
        dtypes = [torch.float32, torch.bfloat16]
        decode = bench_decode(decode_cases, dtypes, device, gen, timer, True)
        prefill = bench_prefill(prefill_cases, dtypes, device, gen, timer, args.quick)
        cold_cases = ([("4 x 256", [256] * 4, 1), ("1 x (224 + 32 new)", [256], 32),
                       ("4 x 256", [256] * 4, 1, 8)]
                      if args.quick else
                      [("4 x 600", [600] * 4, 1), ("4 x 600", [600] * 4, 1, 25),
                       ("16 x 300", [300] * 16, 1),
                       ("4 x 2000", [2000] * 4, 1), ("1 x (600 + 32 new)", [632], 32),
                       ("1 x (600 + 32 new)", [632], 32, 25),
                       ("1 x (1500 + 32 new)", [1532], 32)])
        results["cold_decode"] = bench_cold_decode(cold_cases, dtypes, gen, timer,
                                                   4 if args.quick else 30)
    copies = bench_copies(device, gen, timer, args.quick)
    if device.type == "cuda":
        for r in prefill + copies:
            r["device"] = torch.cuda.get_device_name(device)
    print_table(decode, title="decode: paged vs dense SDPA on the same K/V")
    print_table(prefill, title="prefill over a cached prefix: paged vs dense SDPA (same shape)")
    print_table(copies, title="block copies and KV writes")
    if "cold_decode" in results:
        print_table(results["cold_decode"], title="attention as a step meets it (each layer's "
                                                  "K/V from memory) vs a streaming read")
    results.update(decode=decode, prefill=prefill, copies=copies)
    write_results("kernels", header, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
