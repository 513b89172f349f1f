"""``radixkv bench kv-pool``: what committing the CPU device pool at start-up buys a prefill into
fresh blocks, paired against the lazy pool in the same process.

Question: the CPU device pool is a mapping whose pages the kernel commits on first write
(``storage.device.lazy_cpu_zeros``), so the first prefill into a never-written block pays the
page faults of its K/V rows: a block of the embedded model spans two 4 KiB pages in each of
its 60 layer planes (K and V of 30 layers). A profile put the rope + K/V write of a 250-token
prefill at 5.6-6.7 ms with a fresh pool against 2.5-3.5 ms with one written beforehand. How
much of a whole prefill's time is that, and what does committing the pool at start-up cost?

Method: two ``Engine``s of the embedded model in one process, one with
``CacheConfig.commit_device_pool`` (what ``radixkv serve`` sets), one without; each pair sends
the same new random prompt (``--tokens`` ids, a single token of output, so the time is the
prefill's) to both, in an order that alternates, until ``--pairs`` pairs: every prompt lands
in blocks neither engine wrote before (the pools hold ~22,000 tokens; the default run uses
12,000). Per arm the median prefill; the median of the per-pair ratios (committed / lazy) and
in how many pairs the committed one was faster; the start-up cost is the time of the commit
itself (a third pool of the same size built with and without it) and the pool's resident memory
once built (its mapping's Rss in ``/proc/self/smaps``). JSON:
``benchmarks/results/kv_pool.json``.

Usage: ``radixkv bench kv-pool [--quick] [--threads N] [--tokens T] [--pairs P]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results


def _prefill_s(engine: Any, ids: list[int], tag: int) -> float:
    """Seconds from submitting ``ids`` (one output token) to its end, stepping the core."""
    from radixkv.engine.sampling import SamplingParams

    core = engine.core
    core.add_request(f"p{tag}", ids, SamplingParams(max_tokens=1, temperature=0))
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench kv-pool", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true", help="5 pairs (a smoke run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=250, help="new tokens per prompt")
    ap.add_argument("--pairs", type=int, default=24)
    args = ap.parse_args(argv)
    if args.quick:
        args.pairs = 5
    import torch

    torch.set_num_threads(args.threads)
    import radixkv
    from radixkv.config import CacheConfig
    from radixkv.storage.device import DevicePool, resident_bytes

    header = run_header(0, quick=args.quick, threads=args.threads, tokens=args.tokens,
                        pairs=args.pairs)
    print(header)
    engines: dict[str, Any] = {}
    startup: dict[str, dict[str, float]] = {}
    for arm in ("lazy", "committed"):   # (lazy first: the kernel may merge the next mapping
        t0 = time.perf_counter()        # with this one, and a resident one would then count)
        engines[arm] = radixkv.Engine.from_pretrained(
            cache_config=CacheConfig(commit_device_pool=arm == "committed"), progress=False)
        resident = resident_bytes(engines[arm].core.model_runner.kv_cache)
        startup[arm] = {"build_s": time.perf_counter() - t0,
                        "pool_resident_mib": float("nan") if resident is None
                        else resident / 2**20}

    runner = engines["committed"].core.model_runner
    pool = runner.kv_cache
    pool_mib = pool.numel() * pool.element_size() / 2**20
    layout = engines["committed"].core.layout
    commit_s = {}
    for commit in (False, True):   # the commit's own cost: a third pool, built and dropped
        t0 = time.perf_counter()
        extra = DevicePool(layout, runner.num_blocks, device="cpu", commit=commit)
        commit_s[commit] = time.perf_counter() - t0
        del extra
    rewrite_s = commit_s[True] - commit_s[False]
    rng = random.Random(0)
    vocab = engines["lazy"].tokenizer.vocab_size
    for arm in engines:   # the first forward's one-time costs, in blocks both then hold
        _prefill_s(engines[arm], [rng.randrange(100, vocab) for _ in range(64)], -1)
    times: dict[str, list[float]] = {"lazy": [], "committed": []}
    try:
        for i in range(args.pairs):
            ids = [rng.randrange(100, vocab) for _ in range(args.tokens)]
            order = ("lazy", "committed") if i % 2 == 0 else ("committed", "lazy")
            for arm in order:
                times[arm].append(_prefill_s(engines[arm], ids, i))
    finally:
        for e in engines.values():
            e.close()
    ratios = [c / lz for lz, c in zip(times["lazy"], times["committed"])]
    rows = [{"arm": arm, "prefill_ms_median": statistics.median(times[arm]) * 1e3,
             "prefill_ms_min": min(times[arm]) * 1e3, "build_s": startup[arm]["build_s"],
             "pool_resident_mib": startup[arm]["pool_resident_mib"]}
            for arm in ("lazy", "committed")]
    print_table(rows, title=f"{args.tokens}-token prefills into fresh blocks, {args.pairs} "
                            f"pairs, {args.threads} thread(s)")
    summary = {"pair_ratio_median": statistics.median(ratios),
               "committed_faster_in": sum(r < 1 for r in ratios), "pairs": len(ratios),
               "pool_mib": pool_mib, "commit_s": rewrite_s}
    print(f"committed / lazy, median of the pair ratios: {summary['pair_ratio_median']:.3f} "
          f"(committed faster in {summary['committed_faster_in']} of {len(ratios)}); "
          f"committing the {pool_mib:.0f} MiB pool at start-up: {rewrite_s * 1e3:.0f} ms")
    write_results("kv_pool_quick" if args.quick else "kv_pool", header,
                  {"rows": rows, "summary": summary, "lazy_s": times["lazy"],
                   "committed_s": times["committed"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
