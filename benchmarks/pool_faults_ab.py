"""Cold prefill and resident memory of the CPU KV pool, paired across source trees.

Question (issue 17): what do first-touch page faults in the lazily committed CPU device pool
(``storage/device.py``) cost a cold prefill, and how large does the process get? Answered by
running the same measurement in fresh processes on two or more source trees of radixkv (e.g.
``git archive <commit> | tar -x -C /tmp/base``), alternating them round by round, so a load
change on a shared machine hits both sides alike; the figure to quote is the median over
rounds of the per-round ratio (arm / first arm).

One child process per (round, dtype, arm), on the tree's ``radixkv`` (``PYTHONPATH``; the
top-level ``kernels`` package comes from the installed checkout), one thread:

* ``prefill_tps_<n>``: as ``radixkv bench engine``: an Engine with a 1 GiB pool, one 32-token
  warm-up, then ``--repeat`` fresh ``n``-token prompts per length (nothing cached, so every
  prompt writes into blocks never written before); n / median wall time. ``minflt_<n>``:
  minor page faults of those runs (median).
* ``rss_*_MiB``: resident memory before and after constructing the engine and at the end;
  ``anon_huge_MiB``: AnonHugePages at the end (``/proc/self/smaps_rollup``).
* ``--pool-rss``: also, per arm and round, a bare ``DevicePool`` of SmolLM2's layout (bf16,
  16-token blocks, ``--pool-gib``): RSS growth after construction and after writing one block,
  then the wall time and minor faults of writing 16 and then 112 never-written blocks layer by
  layer as a prefill does (``cold_write_*``), medians over rounds.
* ``--env NAME:KEY=VALUE``: an environment variable for one arm (e.g. a malloc tunable on the
  same tree).

Usage: ``python benchmarks/pool_faults_ab.py --arm before=/tmp/base --arm after=. --rounds 4``.
Writes ``benchmarks/results/pool_faults.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _minflt() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _anon_huge_mib() -> float:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def child_engine(dtype: str, lengths: list[int], repeat: int, seed: int) -> dict:
    import numpy as np
    import torch

    from radixkv import CacheConfig, SamplingParams
    from radixkv.api.engine import Engine
    from radixkv.config import EngineConfig
    from radixkv.models import load_model, load_tokenizer

    torch.set_num_threads(1)
    tok, model = load_tokenizer(), load_model()
    rng = np.random.default_rng(seed)

    def prompt(n: int) -> list[int]:
        return [int(x) for x in rng.integers(100, len(tok) - 100, n)]

    row: dict = {"dtype": dtype, "rss_before_engine_MiB": _rss_mib()}
    engine = Engine(model, tok, CacheConfig(device_memory="1GiB"),
                    EngineConfig(device="cpu", dtype=dtype, max_num_seqs=16,
                                 max_num_batched_tokens=2048), model_id=f"ab-{dtype}")
    row["rss_engine_MiB"] = _rss_mib()
    one = SamplingParams(max_tokens=1)
    engine.generate([prompt(32)], one)
    row["rss_warm_MiB"] = _rss_mib()
    for n in lengths:
        times, faults = [], []
        for _ in range(repeat):
            p = prompt(n)
            f0, t0 = _minflt(), time.perf_counter()
            engine.generate([p], one)
            times.append(time.perf_counter() - t0)
            faults.append(_minflt() - f0)
        row[f"prefill_tps_{n}"] = n / statistics.median(times)
        row[f"minflt_{n}"] = statistics.median(faults)
    row["rss_end_MiB"] = _rss_mib()
    row["anon_huge_MiB"] = _anon_huge_mib()
    engine.close()
    return row


def child_pool(gib: float) -> dict:
    import torch

    from radixkv.storage.device import DevicePool
    from radixkv.storage.layout import KVLayout

    torch.set_num_threads(1)
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                      dtype="bfloat16")
    n = int(gib * 2**30) // layout.bytes_per_block
    shape = layout.cache_shape(1)
    blocks = torch.ones(129, shape[0], shape[1], *shape[3:], dtype=torch.bfloat16)
    r0 = _rss_mib()
    pool = DevicePool(layout, n, device="cpu")
    row = {"pool_MiB": pool.num_bytes / 2**20, "rss_construct_MiB": _rss_mib() - r0}
    pool.write_blocks([0], blocks[:1])
    row["rss_one_block_MiB"] = _rss_mib() - r0
    # Cold writes as a prefill makes them: layer by layer, K then V, a run of new blocks.
    for first, count in ((1, 16), (17, 112)):
        f0, t0 = _minflt(), time.perf_counter()
        for layer in range(shape[0]):
            for kv in range(2):
                pool.kv_cache[layer, kv, first:first + count].copy_(blocks[:count, layer, kv])
        row[f"cold_write_{count}_ms"] = 1e3 * (time.perf_counter() - t0)
        row[f"cold_write_{count}_minflt"] = _minflt() - f0
    row["rss_end_MiB"] = _rss_mib() - r0
    row["anon_huge_MiB"] = _anon_huge_mib()
    return row


def run_child(tree: str, argv: list[str], extra_env: dict[str, str] | None = None) -> dict:
    tree = str(Path(tree).resolve())
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", **(extra_env or {}))
    out = subprocess.run([sys.executable, str(HERE), "--child", tree, *argv], env=env,
                         cwd="/", capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=TREE",
                    help="a source tree to measure (the first is the baseline); 2 or more")
    ap.add_argument("--env", action="append", default=[], metavar="NAME:KEY=VALUE",
                    help="an environment variable for arm NAME's processes (repeatable)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prefill", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pool-rss", action="store_true")
    ap.add_argument("--pool-gib", type=float, default=1.4)
    ap.add_argument("--out", default=str(HERE.parent / "results" / "pool_faults.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-pool", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import radixkv.storage.device as dev
        assert Path(dev.__file__).resolve().is_relative_to(args.child), dev.__file__
        row = (child_pool(args.pool_gib) if args.child_pool
               else child_engine(args.dtypes[0], args.prefill, args.repeat, seed=0))
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    arms = dict(a.split("=", 1) for a in args.arm)
    if len(arms) < 2:
        ap.error("give two or more --arm NAME=TREE")
    names = list(arms)
    envs: dict[str, dict[str, str]] = {name: {} for name in names}
    for e in args.env:
        name, kv = e.split(":", 1)
        envs[name][kv.split("=", 1)[0]] = kv.split("=", 1)[1]
    header = {"arms": arms, "args": vars(args), "load_average_start": os.getloadavg(),
              "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(header, flush=True)
    rows: list[dict] = []
    prefill = [f"prefill_tps_{n}" for n in args.prefill]
    common = ["--prefill", *map(str, args.prefill), "--repeat", str(args.repeat)]
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order if args.pool_rss else []:
            rows.append({"arm": name, "kind": "pool", "round": r, **run_child(
                arms[name], ["--child-pool", "--pool-gib", str(args.pool_gib)], envs[name])})
            print(rows[-1], flush=True)
        for dtype in args.dtypes:
            for name in order:
                row = {"arm": name, "kind": "engine", "round": r, "load": os.getloadavg()[0],
                       **run_child(arms[name], ["--dtypes", dtype, *common], envs[name])}
                rows.append(row)
                print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()},
                      flush=True)
    summary: dict = {}
    base = names[0]
    for name in names if args.pool_rss else []:
        mine = [x for x in rows if x["kind"] == "pool" and x["arm"] == name]
        summary[f"{name} pool"] = {k: round(statistics.median(x[k] for x in mine), 1)
                                   for k in mine[0] if k not in ("arm", "kind", "round")}
        print(f"{name} pool: {summary[f'{name} pool']}", flush=True)
    for dtype in args.dtypes:
        eng = [x for x in rows if x["kind"] == "engine" and x["dtype"] == dtype]
        by = {(x["arm"], x["round"]): x for x in eng}
        for name in names:
            mine = [x for x in eng if x["arm"] == name]
            s = {m: round(statistics.median(x[m] for x in mine), 1)
                 for m in [*prefill, *(f"minflt_{n}" for n in args.prefill),
                           "rss_engine_MiB", "rss_warm_MiB", "rss_end_MiB", "anon_huge_MiB"]}
            if name != base:
                s["ratio_vs_" + base] = {
                    m: round(statistics.median(by[name, r][m] / by[base, r][m]
                                               for r in range(args.rounds)), 3)
                    for m in prefill}
                s["ratios_per_round"] = {m: [round(by[name, r][m] / by[base, r][m], 3)
                                             for r in range(args.rounds)] for m in prefill}
            summary[f"{name} {dtype}"] = s
            print(f"{name} {dtype}: {s}", flush=True)
    header["load_average_end"] = os.getloadavg()
    print("load average start / end:", header["load_average_start"],
          header["load_average_end"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"header": header, "summary": summary, "rows": rows},
                                         indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
