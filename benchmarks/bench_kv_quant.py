"""``radixkv bench kv-quant``: what int8 KV blocks cost in quality, and what they save in bytes.

Question: with ``CacheConfig(kv_dtype="int8")``, how often does the embedded SmolLM2 produce
the same greedy continuation as with its own float32 KV, how far do the two agree, and how many
bytes does a block take?

Workload: the first user message of the first ``--prompts`` ShareGPT conversations (cut to
``--max-chars``), rendered with the chat template, ``--tokens`` greedy tokens each, batched, on
one thread; the same engine configuration except ``kv_dtype``. Both runs happen in this
process, one after the other (ratios, not absolute times, carry over between machines).
Reports: continuations identical, mean leading tokens in agreement, mean |logprob| difference
of the tokens both chose identically up to the first divergence, bytes per block, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results


def _run(kv: str, prompts: list[list[int]] | None, texts: list[str], tokens: int
         ) -> dict[str, Any]:
    import radixkv
    from radixkv.config import CacheConfig, EngineConfig

    eng = radixkv.Engine.from_pretrained(
        cache_config=CacheConfig(num_device_blocks=2048, kv_dtype=kv),
        engine_config=EngineConfig(device="cpu"))
    try:
        ids = [eng.chat_template.prompt_ids([{"role": "user", "content": t}]) for t in texts]
        t0 = time.perf_counter()
        outs = eng.generate(ids, radixkv.SamplingParams(max_tokens=tokens, logprobs=0,
                                                        ignore_eos=True))
        wall = time.perf_counter() - t0
        return {"tokens": [o.outputs[0].token_ids for o in outs],
                "logprobs": [[t.logprob for t in o.outputs[0].logprobs] for o in outs],
                "wall_s": wall, "bytes_per_block": eng.core.layout.bytes_per_block,
                "prompt_tokens": sum(map(len, ids))}
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench kv-quant", description=plain_doc(__doc__))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-chars", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 prompts x 16 tokens; temp results")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.tokens = 4, 16
        os.environ.setdefault("RADIXKV_RESULTS_DIR", tempfile.mkdtemp(prefix="radixkv-bench-"))
    import torch

    from radixkv.benchmarks.bench_serve import conversations

    torch.set_num_threads(args.threads)
    texts = [c[0] for c in conversations(args.prompts, 2, args.max_chars)]
    header = run_header(None, benchmark="kv-quant", **vars(args))
    print(json.dumps(header))
    ref = _run("auto", None, texts, args.tokens)
    q = _run("int8", None, texts, args.tokens)
    lead, dlp = [], []
    for a, b, la, lb in zip(ref["tokens"], q["tokens"], ref["logprobs"], q["logprobs"]):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lead.append(k)
        dlp += [abs(x - y) for x, y in zip(la[:k], lb[:k])]
    n = len(lead)
    rows = [{"kv_dtype": "auto (float32)", "bytes_per_block": ref["bytes_per_block"],
             "of_float32": 1.0, "identical": f"{n}/{n}", "mean_leading_agree": args.tokens,
             "mean_abs_dlogprob": 0.0, "wall_s": ref["wall_s"]},
            {"kv_dtype": "int8", "bytes_per_block": q["bytes_per_block"],
             "of_float32": q["bytes_per_block"] / ref["bytes_per_block"],
             "identical": f"{sum(x == args.tokens for x in lead)}/{n}",
             "mean_leading_agree": sum(lead) / n,
             "mean_abs_dlogprob": sum(dlp) / max(1, len(dlp)), "wall_s": q["wall_s"]}]
    print_table(rows, title=f"int8 KV vs float32 KV: {n} prompts x {args.tokens} greedy tokens")
    write_results("kv_quant" + ("_quick" if args.quick else ""), header,
                  {"rows": rows, "leading_agree": lead})
    return 0


if __name__ == "__main__":
    sys.exit(main())
