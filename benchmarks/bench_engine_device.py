"""``radixkv bench engine --device cuda``: the engine on a GPU, next to transformers and the
hardware's limit, on random-weight models of named shapes (no download).

Per model shape and decode batch size B (default 1, 64, 256), in one run on one device:

* ``radixkv_ms``: radixkv's decode ms per step: ``Engine.generate`` of B fresh random prompts
  of ``--prompt`` tokens with ``max_tokens = T + 1`` minus the same with ``max_tokens = 1``
  (prefill and start-up cancel), over T steps; the fastest of ``--repeat`` runs of each. One
  engine per B, ``max_num_seqs = B``, a pool sized to hold every sequence (no preemption).
* ``transformers_ms``: the same difference for ``model.generate`` (greedy, eager: no
  ``torch.compile``, the model's default attention), batch B of the same length.
* ``limit_ms``: the hardware limit of one step, max(bytes read / device-copy bandwidth,
  FLOPs / matmul peak). Bytes: every weight read once (the input embedding only when tied to
  the output head) + the K/V of B sequences at the mean context (prompt + T / 2). FLOPs:
  2 x B x (parameters less the untied input embedding) + 4 x B x layers x q_heads x head_dim x
  context. Copy bandwidth is (read + write bytes) / time of a 1 GiB device copy and the peak
  is a bf16 8192^3 matmul, both measured in the same run (on the CPU: a 256 MiB copy and a
  1024^3 fp32 matmul).
* prefill: ``--prefill-batch`` x ``--prefill-len`` new tokens, radixkv ``generate``
  (``max_tokens = 1``) tok/s vs transformers' plain forward of the same batch
  (``logits_to_keep = 1``, no cache) tok/s.
* TTFT: a ``--ttft-prefix``-token prefix cached, then prefix + 64 new tokens: TTFT cached vs
  a cold prompt of the same length (``ttft_gain`` = cold / cached, medians of 3).

Every row carries the device's name. ``--shapes tiny`` on ``--device cpu`` is the CPU
self-check of ``scripts/gpu_check.sh``: the same code on a 2-layer model in seconds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

#: Named model shapes (random weights): Llama-3.2-1B, Llama-3.1-8B and a tiny one for CPUs.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                         max_position_embeddings=131072),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                 tie_word_embeddings=True, max_position_embeddings=4096),
}
#: Share of the free device memory kept for KV pools, activations and transformers' own cache
#: when deciding whether a shape's bf16 weights fit ("8B if memory allows").
_WORKSPACE_FRACTION = 0.35


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: Any) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def device_limits(device: Any) -> dict[str, float]:
    """Device-copy bandwidth (GB/s, read + write) and matmul peak (TFLOP/s), measured now."""
    import torch

    cuda = device.type == "cuda"
    n = (1 << 30) if cuda else (256 << 20)

    def copy_time() -> float:
        # The two buffers live only in this frame: freed before the matmuls allocate.
        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        return min(_timed(lambda: dst.copy_(src), device) for _ in range(5))

    copy_t = copy_time()
    size, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    mm_t = min(_timed(lambda: a @ b, device) for _ in range(5))
    return {"copy_GBps": 2 * n / copy_t / 1e9, "matmul_TFLOPs": 2 * size ** 3 / mm_t / 1e12}


def build_model(shape: str, dtype: Any, device: Any) -> Any:
    """A random-weight LlamaForCausalLM of the named shape, built directly on ``device``."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _weights(model: Any) -> tuple[int, int]:
    """(bytes one decode step reads, parameters multiplied per token): every parameter once,
    less the input embedding when the output head is not tied to it (a few rows are read)."""
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    nbytes = sum(p.numel() * p.element_size() for p in params)
    count = sum(p.numel() for p in params)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not emb:
        nbytes -= emb.numel() * emb.element_size()
        count -= emb.numel()
    return nbytes, count


def step_limit_ms(model: Any, batch: int, context: float, limits: dict) -> dict[str, float]:
    """Hardware limit of one decode step of ``batch`` sequences at mean length ``context``."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    kv_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem
    w_bytes, w_params = _weights(model)
    nbytes = w_bytes + batch * context * kv_token
    flops = 2 * batch * w_params + \
        4 * batch * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * context
    bw_ms = nbytes / (limits["copy_GBps"] * 1e9) * 1e3
    fl_ms = flops / (limits["matmul_TFLOPs"] * 1e12) * 1e3
    return {"limit_ms": max(bw_ms, fl_ms), "limit_bytes_ms": bw_ms, "limit_flops_ms": fl_ms,
            "bytes_per_step": nbytes}


def _prompts(rng: Any, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[int(x) for x in rng.integers(0, vocab, length)] for _ in range(n)]


def _engine(model: Any, device: Any, dtype: str, max_seqs: int, tokens: int,
            batched: int, cuda_graphs: bool = False) -> Any:
    """An engine whose device pool holds ``tokens`` tokens (plus a margin of 4 blocks per
    sequence) and that schedules up to ``max_seqs`` sequences / ``batched`` tokens a step
    (``cuda_graphs``: decode steps replayed from graphs captured at start-up)."""
    from radixkv.api.engine import Engine
    from radixkv.config import CacheConfig, EngineConfig

    block = 16
    blocks = math.ceil(tokens / block) + 4 * max_seqs + 16
    return Engine(model, None, CacheConfig(num_device_blocks=blocks, block_size=block),
                  EngineConfig(device=str(device), dtype=dtype, max_num_seqs=max_seqs,
                               max_num_batched_tokens=batched, cuda_graphs=cuda_graphs),
                  model_id=f"bench-device-{max_seqs}")


def _release(engine: Any) -> None:
    """Close an engine and give its pool back to the device before the next one is made."""
    import gc

    import torch

    engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _generate_s(engine: Any, prompts: list[list[int]], max_tokens: int, device: Any,
                **sampling: Any) -> float:
    from radixkv import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    outs: list = []
    t = _timed(lambda: outs.extend(engine.generate(prompts, sp)), device)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "a request ended early"
    engine.preemptions = getattr(engine, "preemptions", 0) + \
        sum(o.num_preemptions for o in outs)
    return t


def _hf_generate_s(model: Any, prompts: list[list[int]], new: int, device: Any) -> float:
    import torch

    from .bench_ttft import hf_attention

    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode(), hf_attention(model):
        return _timed(lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0), device)


def decode_rows(model: Any, shape: str, args: Any, limits: dict, device: Any, rng: Any,
                dtype: str) -> list[dict]:
    rows = []
    vocab = model.config.vocab_size
    steps = args.decode_tokens
    for batch in args.batches:
        ctx = args.prompt + steps / 2
        row: dict[str, Any] = {"device": args.device_name, "shape": shape, "batch": batch,
                               "prompt": args.prompt, "steps": steps}
        # transformers as a plain model (sdpa): an engine switches the model's attention.
        _hf_generate_s(model, _prompts(rng, batch, args.prompt, vocab), 2, device)   # warm-up
        hf_full = min(_hf_generate_s(model, _prompts(rng, batch, args.prompt, vocab),
                                     steps + 1, device) for _ in range(args.repeat))
        hf_one = min(_hf_generate_s(model, _prompts(rng, batch, args.prompt, vocab), 1, device)
                     for _ in range(args.repeat))
        row["transformers_ms"] = (hf_full - hf_one) / steps * 1e3
        engine = _decode_engine(model, args, device, dtype, batch)
        try:
            _generate_s(engine, _prompts(rng, batch, args.prompt, vocab), 2, device)   # warm-up
            row["radixkv_ms"] = _decode_ms(engine, args, device, rng, batch, steps, vocab)
        finally:
            _release(engine)
        row["preemptions"] = engine.preemptions   # 0 unless the pool was too small
        if getattr(args, "cuda_graphs", False) and device.type == "cuda":
            row.update(_graphs_row(model, args, device, rng, dtype, batch, steps, vocab,
                                   row["radixkv_ms"]))
        row.update(step_limit_ms(model, batch, ctx, limits))
        row["radixkv_over_limit"] = row["radixkv_ms"] / row["limit_ms"]
        row["transformers_over_radixkv"] = row["transformers_ms"] / row["radixkv_ms"]
        _report(rows, row)
    return rows


def _decode_engine(model: Any, args: Any, device: Any, dtype: str, batch: int,
                   cuda_graphs: bool = False) -> Any:
    """An engine sized for ``batch`` decodes of ``--prompt`` + ``--decode-tokens`` tokens."""
    steps = args.decode_tokens
    return _engine(model, device, dtype, batch, batch * (args.prompt + steps + 1),
                   max(2048, min(8192, batch * args.prompt)), cuda_graphs=cuda_graphs)


def _report(rows: list[dict], row: dict[str, Any]) -> None:
    rows.append(row)
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def _decode_ms(engine: Any, args: Any, device: Any, rng: Any, batch: int, steps: int,
               vocab: int, **sampling: Any) -> float:
    """Decode ms per step of a warmed engine: ``generate`` of ``batch`` fresh prompts with
    ``steps + 1`` tokens minus the same with 1 (prefill and start-up cancel), the fastest of
    ``--repeat`` runs of each (``sampling``: SamplingParams fields; default greedy)."""
    def run(n: int) -> float:
        return _generate_s(engine, _prompts(rng, batch, args.prompt, vocab), n, device,
                           **sampling)

    full = min(run(steps + 1) for _ in range(args.repeat))
    one = min(run(1) for _ in range(args.repeat))
    return (full - one) / steps * 1e3


def _graphs_row(model: Any, args: Any, device: Any, rng: Any, dtype: str, batch: int,
                steps: int, vocab: int, eager_ms: float) -> dict[str, Any]:
    """The same decode measurement with ``EngineConfig(cuda_graphs=True)``: ms/step, the
    start-up that includes the captures, and whether greedy tokens match the eager engine's
    on the same prompts (``graphs_token_match``: share of sequences identical; bf16 GEMMs of a
    padded bucket may round differently, so this is reported, not asserted)."""
    prompts = _prompts(rng, batch, args.prompt, vocab)
    from radixkv import SamplingParams

    sp = SamplingParams(max_tokens=steps, ignore_eos=True)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    engine = _decode_engine(model, args, device, dtype, batch, cuda_graphs=True)
    out["graphs_startup_s"] = round(time.perf_counter() - t0, 2)
    try:
        graphed = [o.outputs[0].token_ids for o in engine.generate(prompts, sp)]
        out["radixkv_graphs_ms"] = _decode_ms(engine, args, device, rng, batch, steps, vocab)
    finally:
        _release(engine)
    eager = _decode_engine(model, args, device, dtype, batch)
    try:
        plain = [o.outputs[0].token_ids for o in eager.generate(prompts, sp)]
    finally:
        _release(eager)
    out["graphs_speedup"] = eager_ms / out["radixkv_graphs_ms"]
    out["graphs_token_match"] = sum(a == b for a, b in zip(graphed, plain)) / len(plain)
    return out


#: The sampling modes ``--sampling`` times against greedy decoding, in one engine.
SAMPLING_MODES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "sampled": {"temperature": 1.0, "top_p": 0.9, "seed": 1},
    "penalized": {"temperature": 1.0, "top_p": 0.9, "seed": 1, "frequency_penalty": 0.3,
                  "presence_penalty": 0.1, "logit_bias": {7: 1.5}},
}


def sampling_rows(model: Any, shape: str, args: Any, device: Any, rng: Any,
                  dtype: str) -> list[dict]:
    """Decode ms/step of greedy, sampled (temperature 1, top-p 0.9, seeded) and penalized
    (plus frequency / presence penalties and a logit bias) requests in one engine (with CUDA
    graphs where ``--cuda-graphs``), batches of ``--sampling-batches``: what sampling adds to
    a step, as a ratio to greedy in the same run. On a GPU this is the host's share: filters,
    draws and penalties are a few small kernels, and every read of the device a stream sync
    (the step reads once: ``sampling.StepReads``)."""
    rows: list[dict] = []
    vocab, steps = model.config.vocab_size, args.decode_tokens
    graphs = bool(getattr(args, "cuda_graphs", False)) and device.type == "cuda"
    for batch in args.sampling_batches:
        engine = _decode_engine(model, args, device, dtype, batch, cuda_graphs=graphs)
        row: dict[str, Any] = {"device": args.device_name, "shape": shape, "batch": batch,
                               "steps": steps, "cuda_graphs": graphs}
        try:
            for mode, kw in SAMPLING_MODES.items():
                _generate_s(engine, _prompts(rng, batch, args.prompt, vocab), 2, device,
                            **kw)   # warm-up
                row[f"{mode}_ms"] = _decode_ms(engine, args, device, rng, batch, steps, vocab,
                                               **kw)
        finally:
            _release(engine)
        row["sampled_over_greedy"] = row["sampled_ms"] / row["greedy_ms"]
        row["penalized_over_greedy"] = row["penalized_ms"] / row["greedy_ms"]
        _report(rows, row)
    return rows


def prefill_row(model: Any, shape: str, args: Any, device: Any, rng: Any, dtype: str) -> dict:
    import torch

    vocab, n, length = model.config.vocab_size, args.prefill_batch, args.prefill_len
    from .bench_ttft import hf_attention

    def hf_time() -> float:
        # The prompt tensor lives only in this frame: freed before the engine allocates its pool.
        ids = torch.tensor(_prompts(rng, n, length, vocab), device=device)
        with torch.inference_mode(), hf_attention(model):
            model(ids[:1, :16], use_cache=False, logits_to_keep=1)   # warm-up
            return min(_timed(lambda: model(ids, use_cache=False, logits_to_keep=1), device)
                       for _ in range(args.repeat))

    hf_t = hf_time()
    engine = _engine(model, device, dtype, n, n * (length + 2), max(2048, 4 * length))
    try:
        _generate_s(engine, _prompts(rng, 2, length, vocab), 1, device)   # warm-up
        t = statistics.median(_generate_s(engine, _prompts(rng, n, length, vocab), 1, device)
                              for _ in range(args.repeat))
    finally:
        _release(engine)
    tokens = n * length
    return {"device": args.device_name, "shape": shape, "batch": n, "new_tokens": length,
            "radixkv_tok_s": tokens / t, "transformers_forward_tok_s": tokens / hf_t,
            "radixkv_over_transformers": hf_t / t}


def ttft_row(model: Any, shape: str, args: Any, device: Any, rng: Any, dtype: str) -> dict:
    from radixkv import SamplingParams

    vocab, prefix_len, new = model.config.vocab_size, args.ttft_prefix, 64
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine = _engine(model, device, dtype, 4, 8 * (prefix_len + new), 8192)
    cold, cached, hit = [], [], []
    try:
        engine.generate(_prompts(rng, 1, prefix_len + new, vocab), one)   # warm-up
        for _ in range(3):
            cold.append(engine.generate(_prompts(rng, 1, prefix_len + new, vocab), one)[0].ttft)
            prefix = _prompts(rng, 1, prefix_len, vocab)[0]
            engine.generate([prefix], one)
            out = engine.generate([prefix + _prompts(rng, 1, new, vocab)[0]], one)[0]
            cached.append(out.ttft)
            hit.append(out.num_cached_tokens)
    finally:
        _release(engine)
    med = statistics.median
    return {"device": args.device_name, "shape": shape, "prefix": prefix_len, "new_tokens": new,
            "cold_ttft_ms": med(cold) * 1e3, "cached_ttft_ms": med(cached) * 1e3,
            "ttft_gain": med(cold) / med(cached), "cached_tokens": min(hit)}


def _fits(shape: str, device: Any) -> bool:
    """Whether a shape's bf16 weights fit the device with room for KV and activations."""
    import torch

    if device.type != "cuda":
        return shape == "tiny"
    cfg = SHAPES[shape]
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * cfg["intermediate_size"]) + \
        cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    free, _ = torch.cuda.mem_get_info(device)
    return 2 * params < free * (1 - _WORKSPACE_FRACTION)


def run(args: Any, checkpoint: Any = None) -> dict:
    """Measure every shape that fits; return the results (rows per table). ``checkpoint``
    (results -> None) is called after each shape, so a run stopped by a time limit keeps the
    shapes it finished."""
    import numpy as np
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        args.device_name = torch.cuda.get_device_name(device)
    else:
        import platform
        args.device_name = f"cpu ({platform.processor() or platform.machine()})"
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    limits = device_limits(device)
    print(f"{args.device_name}: device copy {limits['copy_GBps']:.0f} GB/s (read + write), "
          f"matmul {limits['matmul_TFLOPs']:.3g} TFLOP/s", flush=True)
    rng = np.random.default_rng(args.seed)
    results: dict[str, Any] = {"device": args.device_name, "dtype": dtype, **limits,
                               "decode": [], "sampling": [], "prefill": [], "ttft": [],
                               "skipped": []}
    for shape in args.shapes:
        if not _fits(shape, device):
            results["skipped"].append(shape)
            print(f"{shape}: skipped (does not fit {args.device_name})", flush=True)
            continue
        model = build_model(shape, getattr(torch, dtype), device)
        results["decode"] += decode_rows(model, shape, args, limits, device, rng, dtype)
        if getattr(args, "sampling", False):
            results["sampling"] += sampling_rows(model, shape, args, device, rng, dtype)
        results["prefill"].append(prefill_row(model, shape, args, device, rng, dtype))
        results["ttft"].append(ttft_row(model, shape, args, device, rng, dtype))
        if checkpoint is not None:
            checkpoint(results)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def print_tables(results: dict) -> None:
    from ._common import print_table

    dev = results["device"]
    print_table(results["decode"], ["device", "shape", "batch", "radixkv_ms", "transformers_ms",
                                    "limit_ms", "radixkv_over_limit",
                                    "transformers_over_radixkv"] +
                (["radixkv_graphs_ms", "graphs_speedup", "graphs_token_match"]
                 if any("radixkv_graphs_ms" in r for r in results["decode"]) else []),
                title=f"decode ms/step on {dev} ({results['dtype']}; limit = max(bytes / "
                      f"{results['copy_GBps']:.0f} GB/s, FLOPs / "
                      f"{results['matmul_TFLOPs']:.3g} TFLOP/s), same run)")
    if results.get("sampling"):
        print_table(results["sampling"], ["device", "shape", "batch", "cuda_graphs", "greedy_ms",
                                          "sampled_ms", "penalized_ms", "sampled_over_greedy",
                                          "penalized_over_greedy"],
                    title=f"decode ms/step by sampling mode on {dev} (one engine each row)")
    print_table(results["prefill"], ["device", "shape", "batch", "new_tokens", "radixkv_tok_s",
                                     "transformers_forward_tok_s", "radixkv_over_transformers"],
                title=f"prefill tok/s on {dev}")
    print_table(results["ttft"], ["device", "shape", "prefix", "new_tokens", "cold_ttft_ms",
                                  "cached_ttft_ms", "ttft_gain", "cached_tokens"],
                title=f"TTFT of a cached prefix vs cold on {dev}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES),
                    default=["llama-3.2-1b", "llama-3.1-8b"],
                    help="--device: random-weight model shapes (8B only where it fits)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256],
                    help="--device: decode batch sizes")
    ap.add_argument("--prompt", type=int, default=128, help="--device: decode prompt tokens")
    ap.add_argument("--prefill-batch", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--ttft-prefix", type=int, default=4096)
    ap.add_argument("--dtype", default=None, help="--device: default bfloat16 on CUDA, "
                                                  "float32 on the CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="--device cuda: also time decode with EngineConfig(cuda_graphs=True) "
                         "(graphs_speedup = eager ms / graphs ms, same run) and compare its "
                         "greedy tokens with the eager engine's")
    ap.add_argument("--sampling", action="store_true",
                    help="--device: also time greedy vs sampled vs penalized decode steps in "
                         "one engine (with graphs where --cuda-graphs)")
    ap.add_argument("--sampling-batches", type=int, nargs="+", default=[1, 64],
                    help="--device --sampling: batch sizes")


def main_device(args: Any) -> int:
    """Entry of ``radixkv bench engine --device D`` (``args`` from bench_engine's parser)."""
    from ._common import run_header, write_results

    if args.quick:
        args.batches, args.prompt, args.decode_tokens = args.batches[:2], 32, 8
        args.sampling_batches = args.sampling_batches[:1]
        args.prefill_batch, args.prefill_len, args.ttft_prefix, args.repeat = 4, 64, 256, 1
    header = run_header(seed=args.seed, benchmark="engine-device", args=vars(args),
                        quick=args.quick)
    def checkpoint(partial: dict) -> None:
        header["device_name"] = partial["device"]
        write_results(args.name, header, partial)

    results = run(args, checkpoint)
    header["device_name"] = results["device"]
    print_tables(results)
    path = write_results(args.name, header, results)
    print(f"results: {path}")
    return 0
