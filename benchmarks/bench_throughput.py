"""``radixkv bench throughput``: decode throughput with continuous batching, and KV utilization.

Questions:

1. For one batch of real prompts (first user turns of ShareGPT conversations through the chat
   template), how many tokens/s does the engine decode with continuous batching, against
   ``transformers`` ``model.generate`` on the same batch (left-padded, greedy, same token count)?
2. How much of the KV memory the engine holds is actually used (tokens stored / slots allocated,
   sampled after every step), against a naive contiguous allocation that reserves the maximum
   sequence length per request (the pre-PagedAttention baseline)?

Decode throughput excludes prefill on both sides: engine = generated tokens after each request's
first, divided by the time from the step where every request had its first token to the end;
HF = the same count divided by ``t(generate n tokens) - t(generate 1 token)``. Each side is run
``--repeat`` times after a warm-up; medians are reported. Prompts never share a prefix here
(distinct conversations), so the figure is about batching, not caching.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results


def pick_prompts(trace: Any, n: int, max_prompt: int) -> list[list[int]]:
    out = [r.prompt for r in trace if r.turn == 0 and len(r.prompt) <= max_prompt]
    if len(out) < n:
        raise SystemExit(f"only {len(out)} first turns with <= {max_prompt} prompt tokens")
    return out[:n]


def run_engine(engine: Any, prompts: list[list[int]], max_tokens: int,
               salt: str) -> dict[str, Any]:
    """Submit all prompts, step to completion; decode rate and KV utilization per step."""
    from radixkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [engine.submit(p, params, cache_salt=f"{salt}-{i}") for i, p in enumerate(prompts)]
    have_first: set[str] = set()
    t_all_first = None
    final: dict[str, Any] = {}
    util: list[tuple[int, int]] = []
    while len(final) < len(rids):
        engine._step()
        for rid in rids:
            q = engine._queues.get(rid)
            while q:
                out = q.popleft()
                if out.outputs and out.outputs[0].token_ids:
                    have_first.add(rid)
                if out.finished:
                    final[rid] = out
        if t_all_first is None and len(have_first) == len(rids):
            t_all_first = time.perf_counter()
        st = engine.stats()
        if st["kv_slots_allocated"]:
            util.append((st["kv_tokens_stored"], st["kv_slots_allocated"]))
    t_end = time.perf_counter()
    for rid in rids:
        engine._queues.pop(rid, None)
        engine._submitted.pop(rid, None)
    n_gen = sum(len(final[r].outputs[0].token_ids) for r in rids)
    assert n_gen == len(rids) * max_tokens, (n_gen, len(rids), max_tokens)
    decode_tokens = n_gen - len(rids)
    return {"total_s": t_end - t0, "decode_s": t_end - (t_all_first or t0),
            "decode_tokens": decode_tokens, "util": util,
            "tokens": [final[r].outputs[0].token_ids for r in rids]}


def run_hf(model: Any, prompts: list[list[int]], max_tokens: int, pad_id: int) -> dict[str, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=model.device)

    def gen(n: int) -> tuple[float, Any]:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=pad_id)
            return time.perf_counter() - t0, out

    t1, _ = gen(1)
    tn, out = gen(max_tokens)
    return {"total_s": tn, "decode_s": tn - t1, "decode_tokens": len(prompts) * (max_tokens - 1),
            "tokens": out[:, width:].tolist()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench throughput",
                                 description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true", help="batch 8, 32 new tokens, 1 repeat")
    ap.add_argument("--batch", type=int, default=None, help="requests (default 16)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens each (default 64)")
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=None, help="runs per side (default 3)")
    ap.add_argument("--naive-max-len", type=int, default=None,
                    help="reserved tokens per request in the naive allocation "
                         "(default: the model's context length)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)")
    args = ap.parse_args(argv)
    batch = args.batch or (8 if args.quick else 16)
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    repeat = args.repeat or (1 if args.quick else 3)

    import torch

    from radixkv.api.engine import Engine
    from radixkv.benchmarks.bench_ttft import hf_attention
    from radixkv.benchmarks.traces import load_trace
    from radixkv.config import CacheConfig, EngineConfig

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = pick_prompts(load_trace("chat", quick=True, progress=False), batch, args.max_prompt)
    engine = Engine.from_pretrained(
        cache_config=CacheConfig(device_memory="2GiB"),
        engine_config=EngineConfig(max_num_seqs=max(batch, 1), max_num_batched_tokens=4096,
                                   device="auto"),
        model_impl="transformers")   # the transformers baseline runs the same model object
    context = int(engine.core.max_model_len)
    naive_len = args.naive_max_len or context
    header = run_header(seed=0, benchmark="throughput", model=engine.model_id, batch=batch,
                        max_tokens=max_tokens, repeat=repeat, naive_max_len=naive_len,
                        prompt_tokens=[len(p) for p in prompts],
                        torch_threads=torch.get_num_threads())
    print(header)
    pad = engine.tokenizer.pad_token_id
    pad = pad if pad is not None else 0

    # warm-up both paths
    run_engine(engine, prompts[:2], 4, "warm-up")
    with hf_attention(engine.model) as m:
        run_hf(m, prompts[:2], 4, pad)

    eng_runs, hf_runs = [], []
    for r in range(repeat):
        eng_runs.append(run_engine(engine, prompts, max_tokens, f"run{r}"))
        with hf_attention(engine.model) as m:
            hf_runs.append(run_hf(m, prompts, max_tokens, pad))
        print(f"run {r}: engine {eng_runs[-1]['decode_tokens'] / eng_runs[-1]['decode_s']:.1f} "
              f"tok/s, HF {hf_runs[-1]['decode_tokens'] / hf_runs[-1]['decode_s']:.1f} tok/s",
              flush=True)

    med = statistics.median
    eng_tps = med(x["decode_tokens"] / x["decode_s"] for x in eng_runs)
    hf_tps = med(x["decode_tokens"] / x["decode_s"] for x in hf_runs)
    eng_e2e = med(batch * max_tokens / x["total_s"] for x in eng_runs)
    hf_e2e = med(batch * max_tokens / x["total_s"] for x in hf_runs)
    same = sum(a == b for a, b in zip(eng_runs[0]["tokens"], hf_runs[0]["tokens"]))

    # KV utilization: every step of the first run (stored / allocated, summed over steps), and
    # the naive contiguous reservation of naive_len tokens per live request at the same steps.
    util = eng_runs[0]["util"]
    stored = sum(s for s, _ in util)
    slots = sum(a for _, a in util)
    final_tokens = sum(len(p) + max_tokens for p in prompts)
    rows = [
        {"system": "radixkv (continuous batching)", "decode_tok_s": eng_tps,
         "e2e_tok_s": eng_e2e, "kv_utilization": stored / slots if slots else float("nan")},
        {"system": "transformers generate (padded batch)", "decode_tok_s": hf_tps,
         "e2e_tok_s": hf_e2e,
         "kv_utilization": final_tokens / (batch * (max(len(p) for p in prompts) + max_tokens))},
        {"system": f"naive contiguous, {naive_len} tok/request", "decode_tok_s": "",
         "e2e_tok_s": "", "kv_utilization": final_tokens / (batch * naive_len)},
    ]
    print_table(rows, title=f"batch {batch} x {max_tokens} new tokens (median of {repeat})")
    summary = {
        "engine_decode_tok_s": eng_tps, "hf_decode_tok_s": hf_tps,
        "decode_speedup_vs_hf": eng_tps / hf_tps,
        "engine_e2e_tok_s": eng_e2e, "hf_e2e_tok_s": hf_e2e,
        "kv_utilization_engine_mean_over_steps": stored / slots if slots else None,
        "kv_utilization_engine_min_step": min((s / a for s, a in util), default=None),
        "kv_utilization_engine_final_step": util[-1][0] / util[-1][1] if util else None,
        "kv_utilization_hf_padded_at_end": rows[1]["kv_utilization"],
        "kv_utilization_naive_at_end": rows[2]["kv_utilization"],
        "greedy_outputs_identical_to_hf": f"{same}/{batch}",
    }
    print_table([{"metric": k, "value": v} for k, v in summary.items()], title="summary")
    name = "throughput" + ("-quick" if args.quick else "")
    if args.batch or args.max_tokens:          # non-default shapes get their own file
        name += f"-b{batch}-t{max_tokens}"
    write_results(name, header,
                  {"summary": summary, "rows": rows,
                   "engine_runs": [{k: v for k, v in x.items() if k not in ("tokens", "util")}
                                   for x in eng_runs],
                   "hf_runs": [{k: v for k, v in x.items() if k != "tokens"} for x in hf_runs]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
