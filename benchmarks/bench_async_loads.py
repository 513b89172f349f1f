"""``radixkv bench async-loads``: do promotions from the disk tier stall other requests' decode?

Question: when a request's cached prefix has to come back from the disk tier, how much does
loading it delay the requests that are already decoding, with promotions waited for inside the
scheduler (``EngineConfig(async_loads=False)``, the baseline) and with promotions left running
while the others compute (``async_loads=True``)? And what does the loading request pay in time
to first token?

Workload, on the embedded model (no tokenizer needed, token ids only): ``--docs`` documents of
``--doc-tokens`` tokens are computed once and persisted to the disk tier (write-back: after
``persist()`` they live only on disk). Then ``--decoders`` short requests start decoding
(``--decode-tokens`` each), and every ``--every`` steps one request "document i + a question"
arrives, whose prefix is a disk hit. Per mode, a fresh engine over the same weights and the
same disk directory (the documents are persisted again between modes). Page cache: warm (the
files were just written); ``--cold`` drops them with ``posix_fadvise(DONTNEED)`` before each
mode.

Reported per mode: the decoders' inter-token latency (median, p90, max over every decode step
of every decoder), the arrivals' TTFT (median), wall time; the ratios async / sync are the
result. Each mode runs ``--rounds`` times, alternating, and the median round is reported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def _drop_page_cache(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _engine(model: Any, disk_dir: str, args: argparse.Namespace, async_loads: bool) -> Any:
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    return LLMEngine(model, None,
                     CacheConfig(block_size=16, device_memory=args.device_memory,
                                 disk_dir=disk_dir, disk_memory="8GiB"),
                     EngineConfig(max_num_seqs=16, max_num_batched_tokens=args.budget,
                                  prefetch_requests=0, async_loads=async_loads),
                     model_id="bench-async-loads")


def _one_mode(model: Any, disk_dir: str, docs: list[list[int]], args: argparse.Namespace,
              async_loads: bool, vocab: int, rnd: int) -> dict[str, Any]:
    from radixkv.engine.sampling import SamplingParams

    if args.cold:
        _drop_page_cache(disk_dir)
    eng = _engine(model, disk_dir, args, async_loads)
    assert eng.restore_report["restored_blocks"] >= len(docs) * (args.doc_tokens // 16) - 1
    for i in range(args.decoders):
        eng.add_request(f"d{i}", _tokens(8, 1000 + i, vocab),
                        SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True))
    last_tok: dict[str, float] = {}
    itl: list[float] = []
    ttft: list[float] = []
    arrivals = 0
    step = 0
    t_start = time.perf_counter()
    while eng.has_unfinished_requests():
        if step >= 2 and step % args.every == 0 and arrivals < len(docs):
            q = docs[arrivals] + _tokens(12, 5000 + 100 * rnd + arrivals, vocab)
            eng.add_request(f"q{arrivals}", q, SamplingParams(max_tokens=1))
            arrivals += 1
        outs = eng.step()
        now = time.perf_counter()
        step += 1
        for out in outs:
            rid = out.request_id
            if rid.startswith("d"):
                if rid in last_tok:
                    itl.append(now - last_tok[rid])
                last_tok[rid] = now
            elif out.finished and out.ttft is not None:
                ttft.append(out.ttft)
    wall = time.perf_counter() - t_start
    st = eng.stats()
    assert st["cached_prompt_tokens_per_tier"][-1] > 0, "arrivals did not hit the disk tier"
    eng.persist()      # the documents back to disk for the next mode
    eng.close()
    itl.sort()
    return {"mode": "async" if async_loads else "sync", "wall_s": wall,
            "itl_p50_ms": 1e3 * statistics.median(itl),
            "itl_p90_ms": 1e3 * itl[int(0.9 * (len(itl) - 1))],
            "itl_max_ms": 1e3 * itl[-1],
            "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else float("nan"),
            "disk_hit_tokens": st["cached_prompt_tokens_per_tier"][-1],
            "loading_request_steps": st["loading_request_steps"],
            "load_waits": st["load_waits"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench async-loads",
                                 description=plain_doc(__doc__))
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=40)
    ap.add_argument("--every", type=int, default=5, help="steps between arrivals")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--device-memory", default="1GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the files from the page cache")
    ap.add_argument("--quick", action="store_true", help="3 docs of 512 tokens, 1 round")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.doc_tokens, args.rounds, args.decode_tokens = 3, 512, 1, 24

    import torch

    from radixkv.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model()
    vocab = model.get_input_embeddings().num_embeddings
    root = args.dir or tempfile.mkdtemp(prefix="radixkv-async-")
    disk_dir = os.path.join(root, "kv")
    header = run_header(seed=0, benchmark="async-loads", docs=args.docs,
                        doc_tokens=args.doc_tokens, decoders=args.decoders, every=args.every,
                        cold=args.cold, quick=args.quick,
                        torch_threads=torch.get_num_threads())
    print(header)
    try:
        docs = [_tokens(args.doc_tokens, i, vocab) for i in range(args.docs)]
        eng = _engine(model, disk_dir, args, True)
        from radixkv.engine.sampling import SamplingParams
        for i, d in enumerate(docs):
            eng.add_request(f"w{i}", d, SamplingParams(max_tokens=1))
            while eng.has_unfinished_requests():
                eng.step()
        eng.persist()
        eng.close()
        rows: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
        for rnd in range(args.rounds):
            for a in ((False, True) if rnd % 2 == 0 else (True, False)):
                r = _one_mode(model, disk_dir, docs, args, a, vocab, rnd)
                rows[r["mode"]].append(r)
                print(f"round {rnd} {r['mode']}: itl p50 {r['itl_p50_ms']:.1f} ms, "
                      f"max {r['itl_max_ms']:.1f} ms, ttft {r['ttft_p50_ms']:.1f} ms")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    def med(mode: str) -> dict[str, Any]:
        rs = rows[mode]
        out = {"mode": mode}
        for k in rs[0]:
            if k != "mode":
                out[k] = statistics.median(r[k] for r in rs)
        return out

    table = [med("sync"), med("async")]
    ratios = {k: table[1][k] / table[0][k] for k in
              ("wall_s", "itl_p50_ms", "itl_p90_ms", "itl_max_ms", "ttft_p50_ms")
              if table[0][k]}
    print_table(table, ["mode", "wall_s", "itl_p50_ms", "itl_p90_ms", "itl_max_ms",
                        "ttft_p50_ms", "disk_hit_tokens", "loading_request_steps",
                        "load_waits"],
                title="decoders' inter-token latency while disk-hit requests arrive "
                      "(median of rounds)")
    print("async / sync: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    write_results("async_loads" + ("_cold" if args.cold else ""), header,
                  {"rounds": rows, "median": table, "ratios_async_over_sync": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
