"""``radixkv bench ttft``: time to first token of later chat turns, cache vs no cache vs HF.

Question: on real multi-turn conversations, how much of a turn's time to first token does the
prefix cache remove, and how close does a cached turn get to the ideal, the time to prefill only
its new tokens?

Workload: ShareGPT conversations from ``benchmarks.traces`` (chat trace: each turn's prompt is the
whole history through the SmolLM2 chat template; the ShareGPT answer stands for the reply). For
every turn k >= 2 (1-based) of the selected conversations, in one run on the embedded model:

* ``cached``: the engine first processes turn k-1's prompt + reply (as serving it would have
  cached them), then turn k's prompt with ``max_tokens=1``; TTFT as the engine reports it.
* ``nocache``: the same prompt on a second engine over the same weights with
  ``enable_prefix_caching=False``.
* ``hf_full``: ``transformers`` ``model.generate(max_new_tokens=1)`` on the full prompt (sdpa).
* ``hf_new``: the ideal: ``transformers`` forward of only the tokens the cached engine computed
  (prompt minus its cached prefix), given the prefix's K/V in a ``DynamicCache`` (built untimed).

Each figure is one measurement per turn (a repeat would hit its own cached prompt); the summary
reports medians over turns of per-turn ratios. Target: ``cached / hf_new <= 1.2``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results


def select_turns(trace: Any, max_prompt: int, max_turns: int) -> list[tuple[Any, Any]]:
    """(previous request, request) pairs for turns >= 2 with prompts <= max_prompt tokens,
    whole conversations in trace order, at most ``max_turns`` pairs."""
    by_conv: dict[int, list[Any]] = {}
    for r in trace:
        by_conv.setdefault(r.conv, []).append(r)
    pairs: list[tuple[Any, Any]] = []
    for conv in sorted(by_conv):
        turns = sorted(by_conv[conv], key=lambda r: r.turn)
        for prev, cur in zip(turns, turns[1:]):
            if len(cur.prompt) > max_prompt or len(pairs) >= max_turns:
                break
            pairs.append((prev, cur))
        if len(pairs) >= max_turns:
            break
    return pairs


@contextmanager
def hf_attention(model: Any):
    """Run ``model`` as a plain transformers model (sdpa) inside the block, then restore the
    engine's attention implementation (the engine shares the model object)."""
    prev = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(prev)


def hf_full_ttft(model: Any, prompt: list[int]) -> float:
    import torch

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0


def hf_new_tokens_ttft(model: Any, prompt: list[int], num_cached: int) -> float:
    """Seconds to prefill ``prompt[num_cached:]`` on top of a ready DynamicCache of the prefix
    and pick the first token (greedy)."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        cache = DynamicCache()
        if num_cached:
            model(ids[:, :num_cached], past_key_values=cache, use_cache=True)
        t0 = time.perf_counter()
        out = model(ids[:, num_cached:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench ttft", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true", help="8 turns of prompts <= 1024 tokens")
    ap.add_argument("--turns", type=int, default=None, help="turns to measure (default 24)")
    ap.add_argument("--max-prompt", type=int, default=None,
                    help="skip turns with longer prompts (default 2048 tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)")
    args = ap.parse_args(argv)
    n_turns = args.turns or (8 if args.quick else 24)
    max_prompt = args.max_prompt or (1024 if args.quick else 2048)

    import torch

    from radixkv.api.engine import Engine
    from radixkv.benchmarks.traces import load_trace
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.sampling import SamplingParams

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    trace = load_trace("chat", quick=True, progress=False)
    pairs = select_turns(trace, max_prompt, n_turns)
    ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=4096, device="auto")
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(
        cache_config=CacheConfig(block_size=args.block_size, device_memory="2GiB"),
        engine_config=ec, model_impl="transformers")   # baselines run the same model object
    base = Engine(engine.model, engine.tokenizer,
                  CacheConfig(block_size=args.block_size, device_memory="2GiB",
                              enable_prefix_caching=False), ec, model_id=engine.model_id)
    load_s = time.perf_counter() - t0
    header = run_header(seed=0, benchmark="ttft", model=engine.model_id, load_s=round(load_s, 1),
                        trace=trace.header.get("params"), turns=len(pairs),
                        max_prompt=max_prompt, block_size=args.block_size,
                        torch_threads=torch.get_num_threads())
    print(header)
    one = SamplingParams(max_tokens=1)

    # Warm-up: one request through every path (allocator, kernels, generate's set-up).
    warm = pairs[0][0].prompt
    engine.generate([warm], one, cache_salt="warm-up")
    base.generate([warm], one)
    with hf_attention(engine.model) as m:
        hf_full_ttft(m, warm)
        hf_new_tokens_ttft(m, warm, len(warm) // 2)

    rows: list[dict[str, Any]] = []
    for prev, cur in pairs:
        salt = f"conv-{cur.conv}"
        # What serving turn k-1 would have left in the cache: its prompt and its reply.
        engine.generate([prev.prompt + prev.reply], one, cache_salt=salt)
        [out] = engine.generate([cur.prompt], one, cache_salt=salt)
        cached_s, num_cached = float(out.ttft), int(out.num_cached_tokens)
        [bout] = base.generate([cur.prompt], one)
        with hf_attention(engine.model) as m:
            hf_full = hf_full_ttft(m, cur.prompt)
            hf_new = hf_new_tokens_ttft(m, cur.prompt, num_cached)
        rows.append({
            "conv": cur.conv, "turn": cur.turn + 1, "prompt_tok": len(cur.prompt),
            "cached_tok": num_cached, "new_tok": len(cur.prompt) - num_cached,
            "cached_ms": cached_s * 1e3, "nocache_ms": float(bout.ttft) * 1e3,
            "hf_full_ms": hf_full * 1e3, "hf_new_ms": hf_new * 1e3,
            "speedup_vs_nocache": float(bout.ttft) / cached_s,
            "speedup_vs_hf": hf_full / cached_s,
            "cached_over_ideal": cached_s / hf_new,
        })
        print(f"conv {cur.conv} turn {cur.turn + 1}: prompt {len(cur.prompt)}, cached "
              f"{num_cached}, {rows[-1]['cached_ms']:.0f} ms vs {rows[-1]['nocache_ms']:.0f} ms "
              f"no-cache, {hf_full * 1e3:.0f} ms HF, ideal {hf_new * 1e3:.0f} ms", flush=True)

    print_table(rows, title="TTFT per turn (one measurement each; ms)")
    med = statistics.median
    summary = {
        "turns": len(rows),
        "prompt_tokens_total": sum(r["prompt_tok"] for r in rows),
        "cached_tokens_total": sum(r["cached_tok"] for r in rows),
        "hit_rate": sum(r["cached_tok"] for r in rows) / max(sum(r["prompt_tok"] for r in rows), 1),
        "median_prompt_tok": med(r["prompt_tok"] for r in rows),
        "median_new_tok": med(r["new_tok"] for r in rows),
        "median_cached_ms": med(r["cached_ms"] for r in rows),
        "median_nocache_ms": med(r["nocache_ms"] for r in rows),
        "median_hf_full_ms": med(r["hf_full_ms"] for r in rows),
        "median_hf_new_ms": med(r["hf_new_ms"] for r in rows),
        "median_speedup_vs_nocache": med(r["speedup_vs_nocache"] for r in rows),
        "median_speedup_vs_hf": med(r["speedup_vs_hf"] for r in rows),
        "median_cached_over_ideal": med(r["cached_over_ideal"] for r in rows),
        "turns_within_1.2x_of_ideal": sum(r["cached_over_ideal"] <= 1.2 for r in rows),
    }
    print_table([{"metric": k, "value": v} for k, v in summary.items()],
                title="summary (medians over turns of per-turn figures)")
    write_results("ttft" + ("-quick" if args.quick else ""), header,
                  {"summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
