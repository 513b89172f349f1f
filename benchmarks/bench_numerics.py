"""``radixkv bench numerics``: is radixkv's bf16 as good as transformers' own bf16?

Question (issue 17, goal 1): over real chat prompts and greedy decoding on the embedded
SmolLM2-135M, does radixkv in bfloat16 agree with the float32 reference at least as often as
transformers in bfloat16 does, and do radixkv's cached and uncached bf16 runs agree with each other
as often as transformers' bf16 agrees with itself across batch shapes?

Greedy continuations are chaotic: one flipped argmax changes everything after it, so a low-
precision run that is merely *as good as* another still disagrees with the reference on some
prompts. The fair bar is therefore transformers' own bf16, measured on the same prompts in the
same run, never 100%.

Runs, all on the same prompts (first user turns of ShareGPT conversations through the chat
template with a system prompt, ``--min-len``..``--max-len`` tokens) and greedy ``--tokens`` new
tokens (a sequence ends at ``<|im_end|>``; compared up to and including it):

* ``hf_fp32``: ``transformers`` ``generate`` (sdpa), float32, one prompt at a time: the reference.
* ``hf_bf16``: the same in bfloat16, one prompt at a time.
* ``hf_bf16_batched``: bfloat16, all prompts in one left-padded batch (another batch shape).
* ``rkv_fp32``: radixkv float32, all prompts submitted together (continuous batching), cold.
* ``rkv_bf16``: radixkv bfloat16, the same, cold (fresh cache).
* ``rkv_bf16_cached``: the same engine again: every prompt's full blocks come from the cache.

Reported per pair: the share of prompts whose continuations are identical and the mean number of
leading tokens that agree. Writes ``numerics.json`` (``--quick``: a temp folder).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

from radixkv.benchmarks._common import (plain_doc, print_table, run_header,
                                        temp_results_unless_set, write_results)

SYSTEM = "You are a helpful assistant."
PAIRS = [
    # (candidate, reference, what it answers)
    ("hf_bf16", "hf_fp32", "HF bf16 vs fp32 (the bar)"),
    ("rkv_bf16", "hf_fp32", "radixkv bf16 cold vs fp32"),
    ("rkv_bf16_cached", "hf_fp32", "radixkv bf16 cached vs fp32"),
    ("hf_bf16_batched", "hf_bf16", "HF bf16 across batch shapes (the bar)"),
    ("rkv_bf16_cached", "rkv_bf16", "radixkv bf16 cached vs cold"),
    ("rkv_bf16", "hf_bf16", "radixkv bf16 vs HF bf16"),
    ("rkv_fp32", "hf_fp32", "radixkv fp32 vs HF fp32"),
]


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else list(ids)


def chat_prompts(tokenizer: Any, n: int, min_len: int, max_len: int) -> list[list[int]]:
    """First user turns of ShareGPT conversations, in file order, whose prompt fits the range."""
    from radixkv.benchmarks.traces import ChatTokenizer, iter_sharegpt, clean_conversation

    tk = ChatTokenizer(tokenizer)
    out: list[list[int]] = []
    for obj in iter_sharegpt():
        pairs = clean_conversation(obj.get("conversations", []))
        if not pairs:
            continue
        ids = tk.template_ids([{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": pairs[0][0]}])
        if min_len <= len(ids) <= max_len:
            out.append(ids)
            if len(out) == n:
                break
    return out


def hf_greedy(model: Any, prompts: list[list[int]], tokens: int, eos: int,
              batched: bool) -> list[list[int]]:
    import torch

    kw = dict(do_sample=False, max_new_tokens=tokens, pad_token_id=eos)
    outs: list[list[int]] = []
    with torch.inference_mode():
        if not batched:
            for p in prompts:
                ids = torch.tensor([p])
                g = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                outs.append(until_eos(g[0, len(p):].tolist(), eos))
            return outs
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):   # left padding, as generate expects
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        g = model.generate(ids, attention_mask=mask, **kw)
        return [until_eos(row[width:].tolist(), eos) for row in g]


def radixkv_runs(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int, eos: int,
                 cached_too: bool) -> tuple[list[list[int]], list[list[int]] | None]:
    from radixkv import CacheConfig, SamplingParams
    from radixkv.api.engine import Engine
    from radixkv.config import EngineConfig

    cc = CacheConfig(num_device_blocks=len(prompts) * (-(-(max(map(len, prompts)) + tokens)
                                                        // 16) + 1) + 8)
    ec = EngineConfig(device="cpu", max_num_seqs=len(prompts),
                      max_num_batched_tokens=max(2048, len(prompts)))
    engine = Engine(model, tokenizer, cc, ec, model_id="numerics")
    sp = SamplingParams(max_tokens=tokens, temperature=0.0)

    def run() -> list[list[int]]:
        return [until_eos(list(o.outputs[0].token_ids), eos)
                for o in engine.generate(prompts, sp)]

    cold = run()
    cached = run() if cached_too else None
    if cached_too:
        hits = engine.stats().get("hit_rate")
        print(f"  cached run: hit rate {hits}", flush=True)
    return cold, cached


def summarize(runs: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    rows = []
    for cand, ref, what in PAIRS:
        if cand not in runs or ref not in runs:
            continue
        a, b = runs[cand], runs[ref]
        same = sum(x == y for x, y in zip(a, b))
        rows.append({
            "pair": what, "candidate": cand, "reference": ref,
            "identical": f"{same}/{len(a)}", "identical_share": same / len(a),
            "mean_agreeing_tokens": statistics.mean(lcp(x, y) for x, y in zip(a, b)),
            "mean_ref_tokens": statistics.mean(len(y) for y in b),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv bench numerics", description=plain_doc(__doc__))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=40)
    parser.add_argument("--max-len", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true",
                        help="4 prompts x 16 tokens; results to a temp folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens = 4, 16
        temp_results_unless_set("radixkv-quick-")

    import torch

    from radixkv.models import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    header = run_header(seed=None, threads=args.threads, prompts=args.prompts,
                        tokens=args.tokens, model="embedded SmolLM2-135M-Instruct (Q4_1 GGUF)")
    print(header)
    tok = load_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = chat_prompts(tok, args.prompts, args.min_len, args.max_len)
    print(f"{len(prompts)} prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    fp32 = load_model(dtype=torch.float32)
    runs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        print(f"{name} ...", flush=True)
        runs[name] = fn()
        seconds[name] = time.perf_counter() - t0

    timed("hf_fp32", lambda: hf_greedy(fp32, prompts, args.tokens, eos, batched=False))
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    timed("hf_bf16", lambda: hf_greedy(bf16, prompts, args.tokens, eos, batched=False))
    timed("hf_bf16_batched", lambda: hf_greedy(bf16, prompts, args.tokens, eos, batched=True))
    cold, cached = radixkv_runs(bf16, tok, prompts, args.tokens, eos, cached_too=True)
    runs["rkv_bf16"], runs["rkv_bf16_cached"] = cold, cached
    runs["rkv_fp32"], _ = radixkv_runs(fp32, tok, prompts, args.tokens, eos, cached_too=False)
    rows = summarize(runs)
    print_table(rows, ["pair", "identical", "mean_agreeing_tokens", "mean_ref_tokens"],
                title="greedy agreement (identical continuations / mean agreeing leading tokens)")
    write_results("numerics", header, {"rows": rows, "seconds": seconds,
                                       "prompt_lens": [len(p) for p in prompts], "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
