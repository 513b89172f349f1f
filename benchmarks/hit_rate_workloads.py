"""``radixkv bench hit-rate --workloads``: every eviction policy on the four workloads of issue 15.

Question: on each workload (round-robin chat, open-loop chat, RAG, agent loops; built by
``benchmarks/traces.py``), how close does each policy that radixkv can select by name come to
Belady's hit rate, and to the prefill compute an offline policy could save, at device capacities
from the smallest possible cache up to where Belady reaches 99% of the infinite cache?

Issue 15's target, checked per policy and workload: hit rate >= 0.8 x Belady at every capacity
where Belady keeps at least half of the infinite cache's hit rate (the *target zone*, marked in
the tables), and never more than 1 point below LRU at any capacity.

Method. Block size 16, device tier only. Capacities: ``n`` points spaced geometrically between
the largest request + 2 blocks and the smallest capacity at which Belady reaches 0.99 and LRU
0.95 of the infinite cache (found by bisection; hit rates grow with capacity on these traces).
Policies: every name in ``radixkv.core.policy_registry.POLICIES``, replayed through the real
``BlockManager``/``RadixTree`` (``benchmarks/replay.py``; ``priority`` gets a priority-1 hint on the
shared system prompt where the trace has one, ``ttl`` keeps blocks 300 s after their last use).
(The block-level simulator of candidate policies that chose which ones to build,
``policy_sim.py``, was removed after commit 9a8ebbf; its findings are in docs/eviction.md.)
References (``benchmarks/bounds.py``): infinite cache, Belady, cost-aware Belady, and
``end-blind`` Belady (every return time known, a session's end learned only from its silence:
where it stays below 0.8 of Belady, no policy that is not told of ends can meet the target
without predicting them). Prefill
saved is cost-weighted (``benchmarks/prefill_cost.py``) and set against the better of the two
Belady variants on that measure (neither is a proven bound for it).

    radixkv bench hit-rate --workloads [--quick] [--jobs 2] [--only chat-rr,...]
        [--policies lru,duel] [--baseline COMMIT --name NAME]

``--baseline COMMIT`` replays every policy also through ``radixkv/core`` as of ``COMMIT``
(``_core_baseline.py``), right beside this checkout's replay at each capacity (which of the two
goes first alternates): each row then has the baseline's hit rate and CPU per request and
whether the two hit the same prompt tokens request by request (``hits_digest``), and the
verdicts the median CPU ratio to the baseline and to each one's own LRU.

Writes ``benchmarks/results/hit_rate_workloads[_quick].json`` (or ``--name``) and, for a full
run, ``docs/img/hit_rate_workloads.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from radixkv.benchmarks._common import (
    REPO_ROOT, plain_doc, print_table, results_dir, run_header, write_results,
)
from radixkv.benchmarks.bounds import BlockTrace, infinite, prepare, session_phantoms, simulate
from radixkv.benchmarks.replay import THIS_CORE, ReplayConfig, replay, system_prefix_tokens

BLOCK_SIZE = 16
N_CAPACITIES, QUICK_CAPACITIES = 10, 6
ZONE_FRACTION = 0.5  # Belady >= this x infinite: the capacities where the 0.8 target applies
TARGET_OF_BELADY = 0.8
MAX_POINTS_BELOW_LRU = 1.0
#: Issue 30's bounds for the default policy: at most this many points below LRU at any
#: capacity of any workload (held-out traces included), at most this many times LRU's
#: bookkeeping CPU per request (median over capacities, same run).
DEFAULT_MAX_POINTS_BELOW_LRU = 0.2
DEFAULT_MAX_CPU_VS_LRU = 1.3
#: A row's fields that depend only on the trace and the capacity (``--reuse`` copies them).
REFERENCE_FIELDS = ("capacity_blocks", "capacity_tokens", "of_working_set", "infinite", "belady",
                    "belady_cost", "cost_belady", "cost_belady_cost", "cost_ref", "end_blind",
                    "zone")
IMG = REPO_ROOT / "docs" / "img" / "hit_rate_workloads.png"
#: Lines drawn (when measured): priority and ttl replay as LRU here, the other candidates sit
#: between these; the JSON and the tables have them all.
PLOT_POLICIES = ("lru", "lfu", "mru", "fifo", "lfu-da", "forecast", "duel", "duel+end-hint",
                 "forecast+end-hint", "auto+end-hint")
#: Policies that read the session-end hint, replayed with it too.
END_HINT_POLICIES = ("forecast", "duel", "auto")


def core_policies() -> list[str]:
    """Every eviction policy radixkv selects by name (read, not hard-coded: the core may add),
    and, for those that read request hints (``hooks``), the same told each session's last
    request (``+end-hint``)."""
    from radixkv.core.policy_registry import POLICIES

    names = list(POLICIES)
    return names + [f"{n}+end-hint" for n in names if n in END_HINT_POLICIES]


def reach_capacity(bt: BlockTrace, policy: str, target: float) -> int:
    """Smallest capacity (to 2%) at which ``policy``'s block-model hit rate reaches ``target``
    (bisection: the hit rate grows with capacity on these traces)."""
    a = bt.min_capacity + 2
    b = max(a, bt.num_blocks + 2)
    if simulate(bt, a, policy).hit_rate >= target:
        return a
    while b - a > max(1, a // 50):
        mid = (a + b) // 2
        if simulate(bt, mid, policy).hit_rate >= target:
            b = mid
        else:
            a = mid
    return b


def capacity_grid(bt: BlockTrace, n: int) -> list[int]:
    """``n`` capacities (blocks), geometric from the smallest cache (largest request + 2) to
    where both Belady reaches 0.99 and LRU 0.95 of the infinite cache's hit rate (so the
    grid also covers the capacities where LRU has caught up, for the 'never below LRU' part)."""
    lo = bt.min_capacity + 2
    inf = infinite(bt).hit_rate
    hi = max(reach_capacity(bt, "belady", 0.99 * inf), reach_capacity(bt, "lru", 0.95 * inf),
             lo + n)
    return sorted({round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)})


def evaluate(requests: Sequence[Any], header: dict[str, Any], capacities: Sequence[int] | None,
             policies: Sequence[str], n: int = N_CAPACITIES,
             ttl_s: float = 300.0, baseline: Any = None,
             references: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """All references and policies on one trace; returns ``{"rows": [...], ...}``.

    One row per (capacity, policy) with ``hit_rate``, ``cost_rate``, ``of_belady``,
    ``cost_of_ref`` (cost_rate / the better Belady's), ``points_vs_lru`` and ``zone``; with
    ``baseline`` (``_core_baseline.load_core_parts``) also ``baseline_hit_rate``,
    ``baseline_cpu_us_per_request`` and ``same_hits_as_baseline``. ``references``: capacity ->
    the reference fields of an earlier run's row on the same trace (``--reuse``): those
    capacities are not simulated again (the references depend only on trace and capacity).
    """
    t0 = time.perf_counter()
    bt = prepare(requests, BLOCK_SIZE)
    inf = infinite(bt)
    phantoms = session_phantoms(requests)
    caps = list(capacities) if capacities else (sorted(references) if references
                                                else capacity_grid(bt, n))
    prio = system_prefix_tokens(header)
    rows: list[dict[str, Any]] = []
    for ci, cap in enumerate(caps):
        if references and cap in references:
            base = {k: references[cap][k] for k in REFERENCE_FIELDS}
        else:
            refs = {p: simulate(bt, cap, p) for p in ("belady", "cost-belady")}
            bel = refs["belady"]
            blind = simulate(bt, cap, "end-blind", phantoms=phantoms)
            base = {"capacity_blocks": cap, "capacity_tokens": cap * BLOCK_SIZE,
                    "of_working_set": cap / bt.num_blocks, "infinite": inf.hit_rate,
                    "belady": bel.hit_rate, "belady_cost": bel.cost_rate,
                    "cost_belady": refs["cost-belady"].hit_rate,
                    "cost_belady_cost": refs["cost-belady"].cost_rate,
                    "cost_ref": max(bel.cost_rate, refs["cost-belady"].cost_rate),
                    "end_blind": blind.hit_rate,
                    "zone": bel.hit_rate >= ZONE_FRACTION * inf.hit_rate}
        belady, cost_ref = base["belady"], base["cost_ref"]
        out: list[dict[str, Any]] = []
        for i, pol in enumerate(policies):
            cfg = ReplayConfig(BLOCK_SIZE, cap, pol, ttl_s=ttl_s)
            cores = [THIS_CORE] + ([baseline] if baseline is not None else [])
            if (ci + i) % 2:
                cores.reverse()          # who goes first alternates (load drifts)
            got = {}
            for core in cores:
                t1 = time.perf_counter()
                got[core.commit] = (replay(requests, cfg, priority_tokens=prio, core=core),
                                    time.perf_counter() - t1)
            res, secs = got[None]
            row = {**base, "policy": pol, "kind": "radixkv", "hit_rate": res.hit_rate,
                   "cost_rate": res.cost_rate, "seconds": secs,
                   "cpu_us_per_request": 1e6 * res.cpu_s / max(res.requests, 1),
                   "hits_digest": res.hits_digest}
            if baseline is not None:
                old = got[baseline.commit][0]
                row.update(baseline_hit_rate=old.hit_rate,
                           baseline_cpu_us_per_request=1e6 * old.cpu_s / max(old.requests, 1),
                           same_hits_as_baseline=old.hits_digest == res.hits_digest)
            out.append(row)
        lru = next((r["hit_rate"] for r in out if r["policy"] == "lru"), None)
        if lru is None:
            lru = simulate(bt, cap, "lru").hit_rate     # the block model's LRU, equal to the tree's
        for r in out:
            r["of_belady"] = r["hit_rate"] / belady if belady else 1.0
            r["cost_of_ref"] = r["cost_rate"] / cost_ref if cost_ref else 1.0
            r["points_vs_lru"] = 100.0 * (r["hit_rate"] - lru)
        rows += out
    blind_zone = [r["end_blind"] / r["belady"] for r in rows
                  if r["zone"] and r["policy"] == rows[0]["policy"]]
    return {"working_set_blocks": bt.num_blocks, "min_capacity_blocks": bt.min_capacity,
            "infinite": inf.hit_rate, "infinite_cost": inf.cost_rate, "capacities": caps,
            "end_blind_min_of_belady_in_zone": min(blind_zone) if blind_zone else None,
            "rows": rows, "seconds": time.perf_counter() - t0}


def verdicts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy: the worst ratio to Belady inside the zone, the worst points vs LRU anywhere,
    whether issue 15's target holds (an empty zone counts as met for the 0.8 part), and
    whether issue 30's bounds for a default hold (``within_default_bounds``: never more than
    0.2 points below LRU, at most 1.3x its bookkeeping CPU at the median)."""
    out: dict[str, dict[str, Any]] = {}
    for pol in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == pol]
        zone = [r["of_belady"] for r in mine if r["zone"]]
        v = {"min_of_belady_in_zone": min(zone) if zone else None,
             "min_points_vs_lru": min(r["points_vs_lru"] for r in mine),
             "min_cost_of_ref": min(r["cost_of_ref"] for r in mine),
             "zone_capacities": len(zone)}
        v["meets_target"] = ((not zone or min(zone) >= TARGET_OF_BELADY)
                             and v["min_points_vs_lru"] >= -MAX_POINTS_BELOW_LRU)
        # bookkeeping CPU per request against LRU's at the same capacity (same run): median
        for pre in ("", "baseline_"):
            field = pre + "cpu_us_per_request"
            lru_cpu = {r["capacity_blocks"]: r.get(field) for r in rows if r["policy"] == "lru"}
            ratios = sorted(r[field] / lru_cpu[r["capacity_blocks"]] for r in mine
                            if r.get(field) and lru_cpu.get(r["capacity_blocks"]))
            if ratios:
                v["cpu_vs_lru_median" + ("_baseline" if pre else "")] = ratios[len(ratios) // 2]
        cpu = v.get("cpu_vs_lru_median")
        v["within_default_bounds"] = (v["min_points_vs_lru"] >= -DEFAULT_MAX_POINTS_BELOW_LRU
                                      and cpu is not None and cpu <= DEFAULT_MAX_CPU_VS_LRU)
        if any("same_hits_as_baseline" in r for r in mine):
            ratios = sorted(r["cpu_us_per_request"] / r["baseline_cpu_us_per_request"]
                            for r in mine)
            v["cpu_vs_baseline_median"] = ratios[len(ratios) // 2]
            v["same_hits_as_baseline"] = all(r["same_hits_as_baseline"] for r in mine)
        out[pol] = v
    return out


# Worker: one workload per process.
def _work(task: dict[str, Any]) -> dict[str, Any]:
    from radixkv.benchmarks.traces import load_trace

    t0 = time.perf_counter()
    tr = load_trace(task["workload"], task["quick"], seed=task["seed"], progress=False)
    load_s = time.perf_counter() - t0
    baseline = None
    if task.get("baseline"):
        from radixkv.benchmarks._core_baseline import load_core_parts

        baseline = load_core_parts(task["baseline"])
        if baseline is None:
            raise SystemExit(f"--baseline {task['baseline']}: cannot load that commit's core")
    refs = None
    if task.get("reuse"):
        old = json.loads(Path(task["reuse"]).read_text())["results"]["workloads"]
        mine = [w for w in old if w["workload"] == task["workload"]
                and w.get("trace_params") == tr.header.get("params")]
        if mine:
            refs = {r["capacity_blocks"]: r for r in mine[0]["rows"]}
    res = evaluate(tr, tr.header, task.get("capacities"), task["policies"], task["n"],
                   baseline=baseline, references=refs)
    res.update(workload=task["workload"], load_s=load_s, trace_params=tr.header.get("params"),
               trace_stats=tr.header.get("stats"), requests=len(tr),
               prompt_tokens=tr.prompt_tokens)
    res["verdicts"] = verdicts(res["rows"])
    return res


def wide(res: dict[str, Any], field: str) -> list[dict[str, Any]]:
    """One row per capacity, one column per policy: ``field`` (and the ratio in brackets)."""
    out = []
    for cap in res["capacities"]:
        rows = [r for r in res["rows"] if r["capacity_blocks"] == cap]
        r0 = rows[0]
        row = {"blocks": cap, "of ws": f"{r0['of_working_set']:.2%}",
               "zone": "*" if r0["zone"] else "", "belady": round(r0["belady"], 3)}
        if field == "hit_rate" and "end_blind" in r0:
            row["end-blind"] = f"{r0['end_blind']:.3f} ({r0['end_blind'] / r0['belady']:.2f})"
        if field == "cost_rate":
            row = {**row, "belady": round(r0["belady_cost"], 3),
                   "cost-belady": round(r0["cost_belady_cost"], 3)}
        for r in rows:
            ratio = r["of_belady"] if field == "hit_rate" else r["cost_of_ref"]
            row[r["policy"]] = f"{r[field]:.3f} ({ratio:.2f})"
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    from radixkv.benchmarks.traces import HELD_OUT, WORKLOADS

    ap = argparse.ArgumentParser(prog="radixkv bench hit-rate --workloads",
                                 description=plain_doc(__doc__))
    ap.add_argument("--workloads", action="store_true", help="(selects this benchmark)")
    ap.add_argument("--only", type=lambda s: s.split(","), default=[*WORKLOADS, *HELD_OUT],
                    help="comma-separated subset of " + ",".join((*WORKLOADS, *HELD_OUT))
                         + " (the last: held out, no policy was tuned on it)")
    ap.add_argument("--quick", action="store_true", help="small traces, 6 capacities (CI)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", type=lambda s: s.split(","), default=None,
                    help="radixkv policy names "
                         "(default: all of radixkv.core.policy_registry.POLICIES)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--name", default=None,
                    help="results file name under benchmarks/results/ (default "
                         "hit_rate_workloads[_quick]); a run of a few policies should not "
                         "overwrite the full run")
    ap.add_argument("--baseline", default=None, metavar="COMMIT",
                    help="also replay every policy through radixkv/core as of COMMIT, beside "
                         "this checkout's (CPU ratios, hit identity request by request)")
    ap.add_argument("--reuse", default=None, metavar="NAME",
                    help="take capacities and references (Belady, end-blind, infinite) from an "
                         "earlier run's JSON under benchmarks/results/ for the workloads it has "
                         "with the same trace parameters (only the policies are replayed)")
    ap.add_argument("--capacities", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="device capacities in blocks (default: the geometric grid, found by "
                         "bisection; with --reuse, the earlier run's)")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--markdown", type=lambda s: s.split(","), default=None, metavar="COLS",
                    help="print the JSON's tables as markdown with these policy columns")
    args = ap.parse_args(argv)
    name = args.name or "hit_rate_workloads" + ("_quick" if args.quick else "")
    if args.plot_only:      # a named run's plot goes beside the full run's, named after it
        img = IMG if name == "hit_rate_workloads" else IMG.with_name(f"{name}.png")
        return plot(results_dir() / f"{name}.json", img)
    if args.markdown:
        print(markdown(results_dir() / f"{name}.json", args.markdown))
        return 0
    t_start = time.perf_counter()
    header = run_header(seed=args.seed, quick=args.quick, block_size=BLOCK_SIZE,
                        workloads=args.only, baseline=args.baseline, reuse=args.reuse)
    print(json.dumps(header))
    reuse = str(results_dir() / f"{args.reuse}.json") if args.reuse else None
    tasks = [dict(workload=w, quick=args.quick, seed=args.seed, baseline=args.baseline,
                  reuse=reuse, capacities=args.capacities,
                  policies=args.policies or core_policies(),
                  n=QUICK_CAPACITIES if args.quick else N_CAPACITIES) for w in args.only]
    if args.jobs > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(tasks))) as ex:
            results = list(ex.map(_work, tasks))
    else:
        results = [_work(t) for t in tasks]
    for res in results:
        print(f"\n== {res['workload']}: {res['requests']} requests, {res['prompt_tokens']:,} "
              f"prompt tokens, working set {res['working_set_blocks']:,} blocks, infinite "
              f"{res['infinite']:.3f} (cost {res['infinite_cost']:.3f}); {res['seconds']:.0f} s")
        print_table(wide(res, "hit_rate"),
                    title="hit rate (ratio to Belady); zone *: Belady >= half the infinite cache")
        print_table(wide(res, "cost_rate"),
                    title="prefill compute saved (ratio to the better Belady on this measure)")
        print_table([{"policy": p, **v} for p, v in res["verdicts"].items()],
                    title="issue 15 target: >= 0.8 of Belady in the zone, >= LRU - 1 point")
        z = res["end_blind_min_of_belady_in_zone"]
        if z is not None:
            print(f"end-blind Belady (every return time known, no session end): {z:.2f} of "
                  "Belady at worst in the zone")
    header["wall_s"] = round(time.perf_counter() - t_start, 1)
    path = write_results(name, header, {"workloads": results})
    if not (args.no_plots or args.quick or args.name or args.baseline):   # the full run's
        plot(path)
    return 0


def markdown(path: Path, columns: Sequence[str]) -> str:
    """Hit rate per capacity (ratio to Belady) and the verdicts, as markdown, per workload."""
    data = json.loads(Path(path).read_text())["results"]["workloads"]
    out = []
    for res in data:
        out.append(f"\n**{res['workload']}** ({res['requests']:,} requests, working set "
                   f"{res['working_set_blocks']:,} blocks, infinite cache "
                   f"{res['infinite']:.3f})\n")
        blind = "end_blind" in res["rows"][0]
        out.append("| blocks (of working set) | Belady | " + ("end-blind | " if blind else "")
                   + " | ".join(columns) + " |")
        out.append("|---" * (len(columns) + 2 + blind) + "|")
        for cap in res["capacities"]:
            rows: dict[str, dict[str, Any]] = {}
            for r in res["rows"]:
                if r["capacity_blocks"] == cap:
                    rows.setdefault(r["policy"], r)
            r0 = next(iter(rows.values()))
            zone = "**" if r0["zone"] else ""
            cells = [f"{zone}{cap:,} ({r0['of_working_set']:.2%}){zone}", f"{r0['belady']:.3f}"]
            if blind:
                cells.append(f"{r0['end_blind']:.3f} ({r0['end_blind'] / r0['belady']:.2f})")
            cells += [f"{rows[c]['hit_rate']:.3f} ({rows[c]['of_belady']:.2f})" if c in rows
                      else "-" for c in columns]
            out.append("| " + " | ".join(cells) + " |")
    out.append("\n| policy | " + " | ".join(r["workload"] for r in data) + " |")
    out.append("|---" * (len(data) + 1) + "|")
    for pol in dict.fromkeys(p for r in data for p in r["verdicts"]):
        cells = []
        for res in data:
            v = res["verdicts"].get(pol)
            if v is None:
                cells.append("-")
                continue
            z = v["min_of_belady_in_zone"]
            cells.append(f"{'**yes**' if v['meets_target'] else 'no'}: "
                         f"{'-' if z is None else f'{z:.2f}'} / {v['min_points_vs_lru']:+.1f}")
        out.append(f"| {pol} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(path: Path, img: Path = IMG) -> int:
    """Hit rate against capacity per workload: policies, Belady (and end-blind Belady where
    measured), infinite; the zone shaded. Written to ``img``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())["results"]["workloads"]
    cols = 2
    rows_n = (len(data) + 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(12, 4.2 * rows_n), squeeze=False)
    for ax, res in zip(axes.flat, data):
        caps = res["capacities"]
        by: dict[str, dict[int, dict[str, Any]]] = {}
        for r in res["rows"]:  # a real replay wins over a simulated candidate of that name
            by.setdefault(r["policy"], {}).setdefault(r["capacity_blocks"], r)
        first = next(iter(by.values()))
        ax.plot(caps, [res["infinite"]] * len(caps), "k:", label="infinite cache")
        ax.plot(caps, [first[c]["belady"] for c in caps], "k-", lw=2, label="Belady")
        if "end_blind" in first[caps[0]]:
            ax.plot(caps, [first[c]["end_blind"] for c in caps], "k--", lw=1,
                    label="Belady blind to session ends")
        zone = [c for c in caps if first[c]["zone"]]
        if zone:
            ax.axvspan(min(zone), max(zone), color="0.9", zorder=0, label="target zone")
        colors = iter(plt.get_cmap("tab10").colors)
        for pol in [p for p in PLOT_POLICIES if p in by]:
            pts = by[pol]
            ls = "--" if pts[caps[0]]["kind"] == "candidate" else "-"
            ax.plot(caps, [pts[c]["hit_rate"] for c in caps], ls, marker="o", ms=3,
                    color=next(colors), label=pol + (" (sim)" if ls == "--" else ""))
        ax.set_xscale("log")
        ax.set_title(f"{res['workload']} (working set {res['working_set_blocks']:,} blocks)")
        ax.set_xlabel("device capacity (blocks of 16 tokens)")
        ax.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    fig.tight_layout()
    img.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(img, dpi=100)
    plt.close(fig)
    print(f"wrote {img}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
