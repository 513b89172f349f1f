"""``radixkv bench sampling``: what the sampler's filters cost per step on the CPU, top-p from
the ``TOP_P_CANDIDATES`` most likely tokens against sorting the whole vocabulary, in one run.

Question: a sampled decode step of the embedded model (49,152-token vocabulary) filters every
sampled row with temperature / top-p; sorting a row for top-p costs about half a one-thread
decode step. How much of that does ``engine/sampling.py``'s candidates path save on the
model's real next-token distributions, and how often does a row's nucleus fit the candidates?

Rows: the embedded SmolLM2-135M's next-token logits after varied short prompts (prose, code,
a letter, arithmetic), ``--rows`` of them; for each (temperature, top-p) setting the paired
medians of ``--repeat`` alternating timings of ``filtered_probs_rows`` with the candidates path
and with it turned off (every row sorted), the share of rows whose nucleus fit, and a check
that both kept the same tokens. JSON: ``benchmarks/results/sampling.json``.

Usage: ``radixkv bench sampling [--quick] [--threads N] [--repeat K] [--rows R]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "To install the package, run",
           "The main causes of the French Revolution were", "Q: What is 17 times 23?\nA:",
           "Dear Sir or Madam,", "import numpy as np\nx ="]
SETTINGS = [(0.7, 0.95), (1.0, 0.9), (1.0, 0.95), (1.0, 0.99)]


def next_token_logits(rows: int) -> Any:
    """``[rows, vocab]`` float32 next-token logits of the embedded model after PROMPTS (cycled
    with a growing suffix so that more rows than prompts still differ)."""
    import torch

    from radixkv.models import load_model, load_tokenizer

    tok = load_tokenizer()
    model = load_model(dtype=torch.float32, device="cpu", progress=False)
    out = []
    with torch.inference_mode():
        for i in range(rows):
            text = PROMPTS[i % len(PROMPTS)] + " the" * (i // len(PROMPTS))
            ids = tok(text, return_tensors="pt")["input_ids"]
            out.append(model(ids).logits[0, -1].float())
    return torch.stack(out)


def time_setting(logits: Any, temperature: float, top_p: float, repeat: int
                 ) -> dict[str, Any]:
    """Paired medians of the candidates path and the whole-row sort on the same rows."""
    import torch

    from radixkv.engine import sampling
    from radixkv.engine.sampling import SamplingParams, filtered_probs_rows

    params = [SamplingParams(temperature=temperature, top_p=top_p)] * logits.shape[0]

    def candidates() -> Any:
        return filtered_probs_rows(logits, params)

    def sorted_rows() -> Any:
        saved = sampling.TOP_P_CANDIDATES
        sampling.TOP_P_CANDIDATES = 1 << 30   # every row takes the sort
        try:
            return filtered_probs_rows(logits, params)
        finally:
            sampling.TOP_P_CANDIDATES = saved

    same = bool(torch.equal(candidates() > 0, sorted_rows() > 0))
    times: dict[str, list[float]] = {"candidates": [], "sort": []}
    for _ in range(repeat):
        for name, fn in (("candidates", candidates), ("sort", sorted_rows)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    mass = torch.softmax(logits / temperature, -1).topk(sampling.TOP_P_CANDIDATES, -1).values
    inside = int((mass.sum(-1) >= top_p).sum())
    c, s = statistics.median(times["candidates"]) * 1e3, statistics.median(times["sort"]) * 1e3
    return {"temperature": temperature, "top_p": top_p, "rows": logits.shape[0],
            "vocab": logits.shape[1], "rows_inside": inside, "sort_ms": s,
            "candidates_ms": c, "candidates_over_sort": c / s, "same_tokens_kept": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench sampling", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true", help="4 rows, 3 repeats (a smoke run)")
    ap.add_argument("--rows", type=int, default=8, help="sampled rows per step")
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.repeat = 4, 3
    import torch

    torch.set_num_threads(args.threads)
    header = run_header(None, quick=args.quick, threads=args.threads, rows=args.rows,
                        repeat=args.repeat)
    print(header)
    logits = next_token_logits(args.rows)
    rows = [time_setting(logits, t, p, args.repeat) for t, p in SETTINGS]
    print_table(rows, ["temperature", "top_p", "rows", "vocab", "rows_inside", "sort_ms",
                       "candidates_ms", "candidates_over_sort", "same_tokens_kept"],
                title="top-p filter per step on the CPU: candidates vs whole-row sort "
                      "(paired medians, same run)")
    write_results("sampling_quick" if args.quick else "sampling", header, {"rows": rows})
    ok = all(r["same_tokens_kept"] for r in rows)
    print("same tokens kept by both paths:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
