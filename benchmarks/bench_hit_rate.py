"""Cache hit rate on real traces: every policy of the real radix tree against the two bounds.

Question: on this trace, what fraction of prompt tokens does radixkv serve from cache, per
eviction policy, capacity, block size and tier set-up, and how far is that from the most any
cache could serve (infinite cache) and the most any eviction policy could serve at the same
capacity (Belady's offline optimum, ``benchmarks/bounds.py``)?

Capacities are fractions of the trace's working set (distinct full blocks of all prompts and
replies at that block size), never below the largest single request. Each replay goes through
``BlockManager``/``RadixTree``/``BlockPool`` (``benchmarks/replay.py``).

    radixkv bench hit-rate [--trace chat|chat-rr|rag|agent|system|sampling] [--quick] [--jobs N]
    radixkv bench hit-rate --plot-only          # redraw docs/img from the committed JSON
    radixkv bench hit-rate --workloads [--quick] # issue 15: every policy on the four workloads
                                                # (benchmarks/hit_rate_workloads.py)
    radixkv bench hit-rate --capacity-bytes 1GiB,2GiB [--kv-dtypes bfloat16,int8]
                                                # issue 16: hit rate at equal device bytes per
                                                # KV dtype (benchmarks/hit_rate_bytes.py)

Writes ``benchmarks/results/hit_rate_<trace>[_quick].json`` and, for full runs (unless
--no-plots), PNGs under ``docs/img/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import (
    REPO_ROOT, plain_doc, print_table, results_dir, run_header, write_results,
)
from radixkv.benchmarks.bounds import infinite, prepare, simulate
from radixkv.benchmarks.replay import ReplayConfig, replay, system_prefix_tokens
from radixkv.benchmarks.traces import KINDS, load_trace

FRACTIONS = [0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0]
QUICK_FRACTIONS = [0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
BS_FRACTIONS = [0.01, 0.02, 0.05, 0.1, 0.5]
TIER_FRACTIONS = [0.005, 0.01, 0.02, 0.05, 0.1]
HOST_FRACTION, DISK_FRACTION = 0.25, 1.0
DEFAULT_POLICY = "lru"
IMG_DIR = REPO_ROOT / "docs" / "img"


def _policies(kind: str, requested: list[str] | None) -> list[str]:
    if requested:
        return requested
    # "priority" without hints orders exactly like LRU: only the system trace gives it hints.
    return ["lru", "lfu", "ttl"] + (["priority"] if kind == "system" else [])


def plan(kind: str, quick: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The replays to run: (block size, fraction, policy, tiers)."""
    fr = QUICK_FRACTIONS if quick else FRACTIONS
    runs = [dict(block_size=16, fraction=f, policy=p, tiers=False)
            for p in _policies(kind, args.policies) for f in fr]
    for bs in args.block_sizes:
        if bs != 16:
            runs += [dict(block_size=bs, fraction=f, policy=DEFAULT_POLICY, tiers=False)
                     for f in (fr if quick else BS_FRACTIONS)]
    if not args.no_tiers:
        runs += [dict(block_size=16, fraction=f, policy=DEFAULT_POLICY, tiers=True)
                 for f in (fr[:3] if quick else TIER_FRACTIONS)]
    return runs


# Worker state: one trace and its block traces per process.
_W: dict[str, Any] = {}


def _init(kind: str, quick: bool, seed: int) -> None:
    _W["trace"] = load_trace(kind, quick, seed=seed, progress=False)
    _W["bt"] = {}


def _bt(bs: int):
    if bs not in _W["bt"]:
        _W["bt"][bs] = prepare(_W["trace"], bs)
    return _W["bt"][bs]


def capacity(bt, fraction: float) -> int:
    """Device blocks for a fraction of the working set, at least the largest request + 2."""
    return max(int(fraction * bt.num_blocks), bt.min_capacity + 2)


def _run(run: dict[str, Any]) -> dict[str, Any]:
    tr = _W["trace"]
    bt = _bt(run["block_size"])
    cap = capacity(bt, run["fraction"])
    host = int(HOST_FRACTION * bt.num_blocks) if run["tiers"] else 0
    disk = int(DISK_FRACTION * bt.num_blocks) if run["tiers"] else 0
    cfg = ReplayConfig(run["block_size"], cap, run["policy"], host, disk)
    res = replay(tr, cfg, priority_tokens=system_prefix_tokens(tr.header))
    out = res.as_dict()
    out["fraction"] = run["fraction"]
    return out


def _bounds(bs: int, fractions: list[float]) -> dict[str, Any]:
    bt = _bt(bs)
    t0 = time.perf_counter()
    inf = infinite(bt)
    rows = []
    for f in fractions:
        cap = capacity(bt, f)
        bel = simulate(bt, cap, "belady")
        lru = simulate(bt, cap, "lru")
        rows.append({"fraction": f, "device_blocks": cap, "belady": bel.hit_rate,
                     "lru_model": lru.hit_rate, "belady_evictions": bel.evictions})
    return {"block_size": bs, "working_set_blocks": bt.num_blocks,
            "min_capacity_blocks": bt.min_capacity, "infinite": inf.hit_rate,
            "per_capacity": rows, "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if "--workloads" in args_in:
        from radixkv.benchmarks.hit_rate_workloads import main as workloads_main

        return workloads_main(argv)
    if any(a.split("=")[0] in ("--capacity-bytes", "--kv-dtypes") for a in args_in):
        from radixkv.benchmarks.hit_rate_bytes import main as bytes_main

        return bytes_main(argv)
    ap = argparse.ArgumentParser(prog="radixkv bench hit-rate", description=plain_doc(__doc__))
    ap.add_argument("--trace", choices=KINDS, default="chat")
    ap.add_argument("--quick", action="store_true", help="small trace and sweep (CI, seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[8, 16, 32, 64])
    ap.add_argument("--policies", type=lambda s: s.split(","), default=None)
    ap.add_argument("--no-tiers", action="store_true")
    ap.add_argument("--no-plots", action="store_true",
                    help="skip the PNGs (a --quick run never draws them)")
    ap.add_argument("--plot-only", action="store_true",
                    help="only redraw the PNGs from the JSON results")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--workloads", action="store_true",
                    help="the policy suite instead: every policy on the four workloads")
    ap.add_argument("--capacity-bytes", default=None,
                    help="instead: hit rate at equal device bytes per KV dtype "
                         "(see radixkv bench hit-rate --capacity-bytes X --help)")
    args = ap.parse_args(argv)
    name = f"hit_rate_{args.trace}" + ("_quick" if args.quick else "")
    if args.plot_only:
        return plot(results_dir() / f"{name}.json")

    t_start = time.perf_counter()
    t0 = time.perf_counter()
    _init(args.trace, args.quick, args.seed)
    tr = _W["trace"]
    header = run_header(seed=args.seed, trace=args.trace, quick=args.quick,
                        trace_params=tr.header.get("params"), trace_stats=tr.header.get("stats"))
    print(json.dumps(header))
    print(f"trace {args.trace}: {len(tr)} requests, {tr.prompt_tokens} prompt tokens "
          f"(loaded in {time.perf_counter() - t0:.1f} s)")

    fr = QUICK_FRACTIONS if args.quick else FRACTIONS
    bounds = {}
    for bs in sorted(set(args.block_sizes) | {16}):
        bounds[bs] = _bounds(bs, sorted(set(fr) | set(BS_FRACTIONS) | set(TIER_FRACTIONS)))
        b = bounds[bs]
        print(f"block size {bs}: working set {b['working_set_blocks']} blocks, infinite "
              f"{b['infinite']:.4f}, bounds in {b['seconds']:.1f} s")

    runs = plan(args.trace, args.quick, args)
    results: list[dict[str, Any]] = []
    from tqdm import tqdm

    bar = tqdm(total=len(runs), desc="replays", unit="run", file=sys.stderr)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, initializer=_init,
                                 initargs=(args.trace, args.quick, args.seed)) as ex:
            for out in ex.map(_run, runs):
                results.append(out)
                bar.update(1)
    else:
        for run in runs:
            results.append(_run(run))
            bar.update(1)
    bar.close()

    for r in results:
        b = bounds[r["block_size"]]
        bel = next(x["belady"] for x in b["per_capacity"] if x["fraction"] == r["fraction"])
        r["infinite"], r["belady"] = b["infinite"], bel
        r["of_infinite"] = r["hit_rate"] / b["infinite"] if b["infinite"] else float("nan")
        r["of_belady"] = r["hit_rate"] / bel if bel else float("nan")
    cols = ["policy", "block_size", "tiers", "fraction", "device_blocks", "hit_rate", "belady",
            "infinite", "of_belady", "of_infinite", "us_per_request"]
    print_table([r for r in results if r["tiers"] == "device" and r["block_size"] == 16], cols,
                title=f"{args.trace}: block size 16, device only")
    other = [r for r in results if r["tiers"] == "device" and r["block_size"] != 16]
    if other:
        print_table(other, cols, title=f"{args.trace}: default policy at other block sizes")
    tiered = [r for r in results if r["tiers"] != "device"]
    if tiered:
        for r in tiered:
            r["device/host/disk"] = "/".join(f"{x:.3f}" for x in r["hit_rate_per_tier"])
        print_table(tiered, ["policy", "tiers", "fraction", "device_blocks", "host_blocks",
                             "disk_blocks", "hit_rate", "device/host/disk", "of_infinite",
                             "promotions_per_tier"],
                    title=f"{args.trace}: device + host ({HOST_FRACTION:.0%} of working set) "
                          f"+ disk ({DISK_FRACTION:.0%})")
    summary = targets(results)
    print("\n" + json.dumps(summary, indent=1))
    header["wall_s"] = round(time.perf_counter() - t_start, 1)
    path = write_results(name, header, {"bounds": list(bounds.values()), "replays": results,
                                        "targets": summary})
    if not (args.no_plots or args.quick):
        plot(path)
    return 0


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 6 targets, at block size 16 and capacities >= 10% of the working set."""
    dev = [r for r in results if r["tiers"] == "device" and r["block_size"] == 16]
    big = [r for r in dev if r["fraction"] >= 0.1]
    out: dict[str, Any] = {}
    if big:
        per_pol: dict[str, float] = {}
        for r in big:
            per_pol[r["policy"]] = min(per_pol.get(r["policy"], 1e9), r["of_belady"])
        out["min_of_belady_at_10pct_up"] = per_pol
        out["default_policy_ge_90pct_of_belady"] = per_pol.get(DEFAULT_POLICY, 0) >= 0.90
        out["best_policy_ge_95pct_of_belady"] = max(per_pol.values()) >= 0.95
    if dev:
        out["min_of_belady_all_capacities"] = {
            p: min(r["of_belady"] for r in dev if r["policy"] == p)
            for p in sorted({r["policy"] for r in dev})}
    tiered = [r for r in results if r["tiers"] == "device+host+disk"]
    if tiered:
        out["three_tier_min_of_infinite"] = min(r["of_infinite"] for r in tiered)
        out["three_tier_ge_98pct_of_infinite"] = out["three_tier_min_of_infinite"] >= 0.98
    return out


def plot(path: Path) -> int:
    """Draw hit rate vs capacity (policies + bounds), per block size, and per tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())
    res, hdr = data["results"], data["header"]
    trace = hdr.get("trace", "?") + (" (quick)" if hdr.get("quick") else "")
    stem = Path(path).stem
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    bounds = {b["block_size"]: b for b in res["bounds"]}
    reps = res["replays"]

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    b16 = bounds[16]
    xs = [x["fraction"] for x in b16["per_capacity"]]
    for ax in axes:
        ax.plot(xs, [b16["infinite"]] * len(xs), "k--", label="infinite cache")
        ax.plot(xs, [x["belady"] for x in b16["per_capacity"]], "k-", lw=2,
                label="Belady (offline optimum)")
        styles = iter([("o", "-"), ("^", "--"), ("v", "-."), ("D", ":"), ("x", "-")])
        for pol in sorted({r["policy"] for r in reps if r["tiers"] == "device"}):
            pts = sorted((r["fraction"], r["hit_rate"]) for r in reps
                         if r["policy"] == pol and r["tiers"] == "device"
                         and r["block_size"] == 16)
            if not pts:
                continue
            marker, ls = next(styles, ("o", "-"))
            ax.plot(*zip(*pts), marker=marker, ls=ls, label=f"radixkv {pol}")
        tiered = sorted((r["fraction"], r["hit_rate"]) for r in reps
                        if r["tiers"] == "device+host+disk")
        if tiered:
            ax.plot(*zip(*tiered), marker="s", ls=":", label="lru + host + disk tiers")
        ax.set_xlabel("device capacity (fraction of the working set)")
        ax.set_ylabel("hit rate (prompt tokens from cache)")
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    axes[0].set_title(f"{trace}: block size 16 (log x)")
    axes[1].set_xlim(0, 0.2)
    axes[1].set_title("zoom: capacities up to 20%")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out1 = IMG_DIR / f"{stem}.png"
    fig.savefig(out1, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for bs, b in sorted(bounds.items()):
        pts = sorted((r["fraction"], r["hit_rate"]) for r in reps if r["block_size"] == bs
                     and r["policy"] == DEFAULT_POLICY and r["tiers"] == "device")
        if not pts:
            continue
        line, = ax.plot(*zip(*pts), marker="o", label=f"B={bs} lru")
        ax.plot([x["fraction"] for x in b["per_capacity"]],
                [x["belady"] for x in b["per_capacity"]], color=line.get_color(), ls="--",
                label=f"B={bs} Belady")
        ax.axhline(b["infinite"], color=line.get_color(), ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("device capacity (fraction of the working set at that block size)")
    ax.set_ylabel("hit rate")
    ax.set_title(f"{trace}: block sizes (dotted: infinite)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    tiered = sorted((r for r in reps if r["tiers"] == "device+host+disk"),
                    key=lambda r: r["fraction"])
    if tiered:
        labels = [f"{r['fraction']:.1%}" for r in tiered]
        bottom = [0.0] * len(tiered)
        for t, name in enumerate(["device", "host", "disk"]):
            vals = [r["hit_rate_per_tier"][t] for r in tiered]
            ax.bar(labels, vals, bottom=bottom, label=name)
            bottom = [a + v for a, v in zip(bottom, vals)]
        ax.axhline(bounds[16]["infinite"], color="k", ls="--", label="infinite cache")
        ax.set_xlabel("device capacity (fraction of the working set); host 25%, disk 100%")
        ax.set_ylabel("hit rate by tier served from")
        ax.set_title(f"{trace}: three tiers, lru, B=16")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out2 = IMG_DIR / f"{stem}_blocks_tiers.png"
    fig.savefig(out2, dpi=110)
    plt.close(fig)
    print(f"wrote {out1} and {out2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
