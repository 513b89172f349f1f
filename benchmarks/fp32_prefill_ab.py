"""Paired A/B of the engine's float32 prefill with and without the native float32 prefill
kernel (kernels/native.py), in one process, alternating per prompt: tokens/s of each and the
paired speed-up (torch flash time / native time). The KV pool is pre-faulted so that page
faults of fresh blocks enter neither side. Prints a table, writes
``benchmarks/results/fp32_prefill_ab.json``; figures in docs/kernels.md.

Run: ``.venv/bin/python benchmarks/fp32_prefill_ab.py [--pairs 4]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import print_table, run_header, write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from radixkv import CacheConfig, SamplingParams
    from radixkv.config import EngineConfig
    from radixkv.engine.llm_engine import LLMEngine
    from radixkv.kernels import native
    from radixkv.models import load_model

    torch.set_num_threads(1)
    header = run_header(seed=0, benchmark="fp32_prefill_ab", args=vars(args),
                        load_average=os.getloadavg())
    model = load_model(dtype=torch.float32, model_impl="auto")
    core = LLMEngine(model, None, CacheConfig(device_memory="1GiB", enable_prefix_caching=False),
                     EngineConfig(max_num_batched_tokens=2048, dtype="float32"), model_id="ab")
    core._runner.kv_cache.view(torch.int32).fill_(0)     # pre-fault the pool
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1)
    ids = iter(range(10**9))
    entries = dict(native._PREFILL_ENTRIES)

    def run(n: int, use_native: bool) -> float:
        native._PREFILL_ENTRIES.clear()
        native._PREFILL_ENTRIES.update(entries if use_native else
                                       {k: v for k, v in entries.items()
                                        if k is not torch.float32})
        core.add_request(f"r{next(ids)}", [int(x) for x in rng.integers(100, 49000, n)], one)
        t0 = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
        return time.perf_counter() - t0

    run(256, True)
    run(256, False)
    rows = []
    for n in args.lengths:
        pairs = [(run(n, True), run(n, False)) for _ in range(args.pairs)]
        rows.append({"tokens": n,
                     "native_tps": n / statistics.median(a for a, _ in pairs),
                     "flash_tps": n / statistics.median(b for _, b in pairs),
                     "speedup": statistics.median(b / a for a, b in pairs),
                     "speedups": [b / a for a, b in pairs]})
    native._PREFILL_ENTRIES.update(entries)
    header["load_average_end"] = os.getloadavg()
    print_table(rows, ["tokens", "native_tps", "flash_tps", "speedup"],
                title="float32 prefill, 1 thread: native kernel vs torch's flash kernel "
                      f"(paired medians of {args.pairs})")
    write_results("fp32_prefill_ab", header, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
