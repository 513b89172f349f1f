"""Hit rate at equal bytes of device memory, per KV dtype (issue 16).

Question: given the same bytes of device memory for the KV cache, how much more of the chat
trace does a quantized cache serve from cache than a bf16 (or float32) one? A block's bytes
decide how many blocks a budget holds (``KVLayout.blocks_in``): for SmolLM2 (30 layers, 3 KV
heads, head_dim 64, 16-token blocks) a bf16 block is 368,640 B, an int8 or fp8_e4m3 block
(rows of 64 values + a 2-byte fp16 scale) 190,080 B, so a budget holds 1.94x the int8 blocks.

    radixkv bench hit-rate --capacity-bytes 256MiB,512MiB,1GiB,2GiB,4GiB
                           [--kv-dtypes float32,bfloat16,int8,fp8_e4m3] [--quick]

Each (dtype, budget) becomes a device capacity in blocks; every distinct capacity is replayed
once through the real bookkeeping, driven only through ``BlockManager``'s public methods
(``create``, ``allocate``, ``commit``, ``append_slots``, ``free``, ``tree.stats``: what an
engine that generated the trace's replies would call, one request at a time, LRU). The same
capacity also runs through the block-level models of ``benchmarks/bounds.py`` (LRU, a cross-check
that must agree with the replay; Belady, the most any eviction policy could hit) and the
infinite cache. Dtypes of equal bytes per block (int8, fp8_e4m3) share one replay.

Hit rate is a property of the bookkeeping only: it does not depend on what the bytes hold, so
this measures capacity, not quality (``radixkv bench kv-quant`` measures quality).
Writes ``benchmarks/results/hit_rate_bytes_<trace>[_quick].json`` and, for full runs,
``docs/img/hit_rate_bytes_<trace>.png``.
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
from radixkv.benchmarks.bounds import NAMESPACE, infinite, prepare, simulate
from radixkv.benchmarks.traces import KINDS, load_trace
from radixkv.core.block_manager import BlockManager
from radixkv.storage.layout import KVLayout, parse_size

#: The embedded SmolLM2-135M's KV geometry (layers, KV heads, head_dim).
SMOLLM2_GEOMETRY = (30, 3, 64)
DEFAULT_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")
DEFAULT_BUDGETS = "256MiB,512MiB,768MiB,1GiB,1536MiB,2GiB,3GiB,4GiB,8GiB"
QUICK_BUDGETS = "64MiB,128MiB,256MiB,512MiB"
#: The dtype every other is compared with (the ordinary half-precision KV).
BASELINE = "bfloat16"
IMG_DIR = REPO_ROOT / "docs" / "img"


def layout_of(kv_dtype: str, block_size: int = 16,
              geometry: tuple[int, int, int] = SMOLLM2_GEOMETRY) -> KVLayout:
    """The block layout of ``kv_dtype`` at ``geometry`` (layers, KV heads, head_dim).

    >>> layout_of("bfloat16").bytes_per_block, layout_of("int8").bytes_per_block
    (368640, 190080)
    """
    layers, heads, dim = geometry
    return KVLayout(layers, heads, dim, block_size, kv_dtype)


def replay_blocks(requests: Any, num_blocks: int, block_size: int = 16) -> dict[str, Any]:
    """Replay ``requests`` (objects with ``prompt`` and ``reply`` token lists) through
    ``BlockManager.create(num_blocks, block_size, policy="lru")`` using only its public
    methods; return hit and prompt tokens, evictions and the wall time.

    Per request: ``allocate`` (match the cached prefix, lock it, allocate the rest), ``commit``
    the prompt, ``append_slots`` the reply and ``commit`` it (an engine that generated it),
    ``free`` (full blocks stay cached). Hits are ``Allocation.num_cached_tokens``.

    Raises OutOfBlocks when one request does not fit in ``num_blocks``.
    """
    bm = BlockManager.create(num_blocks, block_size, policy="lru")
    hit = prompt = 0
    t0 = time.perf_counter()
    for j, r in enumerate(requests):
        alloc = bm.allocate(j, r.prompt, NAMESPACE)
        hit += alloc.num_cached_tokens
        prompt += len(r.prompt)
        bm.commit(j, len(r.prompt))
        if r.reply:
            bm.append_slots(j, r.reply)
            bm.commit(j, len(r.prompt) + len(r.reply))
        bm.free(j)
    st = bm.tree.stats
    return {"device_blocks": num_blocks, "hit_tokens": hit, "prompt_tokens": prompt,
            "hit_rate": hit / prompt if prompt else 0.0, "evictions": st.evicted[0],
            "inserted": st.inserted, "replay_s": time.perf_counter() - t0,
            "requests": j + 1 if requests else 0}


# Worker state: the trace and its block trace, loaded once per process.
_W: dict[str, Any] = {}


def _init(kind: str, quick: bool, seed: int, block_size: int) -> None:
    _W["trace"] = load_trace(kind, quick, seed=seed, progress=False)
    _W["bt"] = prepare(_W["trace"], block_size)
    _W["block_size"] = block_size


def _one(num_blocks: int) -> dict[str, Any]:
    """The replay and both block-level models at one capacity (run in a worker)."""
    bt = _W["bt"]
    out = replay_blocks(_W["trace"], num_blocks, _W["block_size"])
    out["lru_model"] = simulate(bt, num_blocks, "lru").hit_rate
    out["belady"] = simulate(bt, num_blocks, "belady").hit_rate
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench hit-rate --capacity-bytes",
                                 description=plain_doc(__doc__))
    ap.add_argument("--capacity-bytes", default=None,
                    help=f"device budgets, comma-separated sizes (default {DEFAULT_BUDGETS}; "
                         f"--quick: {QUICK_BUDGETS})")
    ap.add_argument("--kv-dtypes", type=lambda s: [x.strip() for x in s.split(",") if x],
                    default=list(DEFAULT_DTYPES))
    ap.add_argument("--trace", choices=KINDS, default="chat")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="small trace and budgets (seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--plot-only", action="store_true",
                    help="only redraw the PNG from the JSON result")
    args = ap.parse_args(argv)
    name = f"hit_rate_bytes_{args.trace}" + ("_quick" if args.quick else "")
    if args.plot_only:
        return plot(results_dir() / f"{name}.json")
    if BASELINE not in args.kv_dtypes:
        ap.error(f"--kv-dtypes must include the baseline {BASELINE}")
    spec = args.capacity_bytes or (QUICK_BUDGETS if args.quick else DEFAULT_BUDGETS)
    budgets = sorted({parse_size(s) for s in spec.split(",") if s.strip()})
    layouts = {kv: layout_of(kv, args.block_size) for kv in args.kv_dtypes}

    t_start = time.perf_counter()
    _init(args.trace, args.quick, args.seed, args.block_size)
    tr, bt = _W["trace"], _W["bt"]
    inf = infinite(bt).hit_rate
    header = run_header(seed=args.seed, trace=args.trace, quick=args.quick,
                        block_size=args.block_size, geometry=SMOLLM2_GEOMETRY,
                        bytes_per_block={kv: lay.bytes_per_block for kv, lay in layouts.items()},
                        trace_params=tr.header.get("params"))
    print(json.dumps(header))
    print(f"trace {args.trace}: {len(tr)} requests, {bt.total_prompt_tokens} prompt tokens, "
          f"working set {bt.num_blocks} blocks, largest request {bt.min_capacity} blocks, "
          f"infinite cache {inf:.4f}")

    need = bt.min_capacity + 2   # the largest request, its tail slot, one spare (replay.py)
    cells = {(kv, b): lay.blocks_in(b) for kv, lay in layouts.items() for b in budgets}
    capacities = sorted({n for n in cells.values() if n >= need})
    if args.jobs > 1 and len(capacities) > 1:
        with ProcessPoolExecutor(args.jobs, initializer=_init,
                                 initargs=(args.trace, args.quick, args.seed,
                                           args.block_size)) as ex:
            by_cap = dict(zip(capacities, ex.map(_one, capacities)))
    else:
        by_cap = {n: _one(n) for n in capacities}
    for n, r in by_cap.items():
        if abs(r["hit_rate"] - r["lru_model"]) > 1e-9:
            print(f"WARNING: at {n} blocks the replay ({r['hit_rate']:.6f}) and the LRU model "
                  f"({r['lru_model']:.6f}) disagree")

    rows: list[dict[str, Any]] = []
    for b in budgets:
        base = by_cap.get(cells[(BASELINE, b)])
        for kv, lay in layouts.items():
            n = cells[(kv, b)]
            r = by_cap.get(n)
            row: dict[str, Any] = {
                "budget": _fmt_bytes(b), "budget_bytes": b, "kv_dtype": kv,
                "bytes_per_block": lay.bytes_per_block, "device_blocks": n,
                "of_working_set": n / bt.num_blocks, "fits": r is not None}
            if r is not None:
                row.update(hit_rate=r["hit_rate"], belady=r["belady"],
                           of_infinite=r["hit_rate"] / inf, lru_model=r["lru_model"],
                           evictions=r["evictions"], replay_s=r["replay_s"])
                if base is not None:
                    row["vs_bf16_hit_rate"] = r["hit_rate"] / base["hit_rate"]
                    # prompt tokens still to prefill, relative to bf16 at the same bytes
                    row["prefill_vs_bf16"] = (1 - r["hit_rate"]) / (1 - base["hit_rate"])
            rows.append(row)
    print_table(rows, ["budget", "kv_dtype", "device_blocks", "of_working_set", "hit_rate",
                       "belady", "of_infinite", "vs_bf16_hit_rate", "prefill_vs_bf16"],
                title=f"{args.trace}: hit rate at equal device bytes (LRU, block size "
                      f"{args.block_size}; '' = the budget does not hold the largest request)")
    header["wall_s"] = round(time.perf_counter() - t_start, 1)
    path = write_results(name, header, {
        "infinite": inf, "working_set_blocks": bt.num_blocks,
        "min_capacity_blocks": bt.min_capacity, "prompt_tokens": bt.total_prompt_tokens,
        "requests": len(tr), "rows": rows,
        "replays": [by_cap[n] for n in capacities]})
    if not (args.no_plots or args.quick):
        plot(path)
    return 0


def _fmt_bytes(n: int) -> str:
    """A budget as people write it.

    >>> _fmt_bytes(1536 << 20), _fmt_bytes(256 << 20)
    ('1.5 GiB', '256 MiB')
    """
    if n >= 1 << 30:
        return f"{n / (1 << 30):g} GiB"
    return f"{n / (1 << 20):g} MiB"


def plot(path: Path) -> int:
    """Hit rate against device bytes, one line per dtype (int8 and fp8 coincide)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())
    res, hdr = data["results"], data["header"]
    rows = res["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"float32": ("s", "-"), "bfloat16": ("o", "-"), "int8": ("^", "-"),
              "fp8_e4m3": ("x", "--"), "int4": ("v", "-.")}
    dtypes = list(dict.fromkeys(r["kv_dtype"] for r in rows))
    for kv in dtypes:
        pts = [(r["budget_bytes"] / (1 << 30), r) for r in rows
               if r["kv_dtype"] == kv and r["fits"]]
        if not pts:
            continue
        marker, ls = styles.get(kv, ("o", "-"))
        bpb = pts[0][1]["bytes_per_block"]
        xs = [x for x, _ in pts]
        line, = axes[0].plot(xs, [r["hit_rate"] for _, r in pts], marker=marker, ls=ls,
                             label=f"{kv} ({bpb:,} B/block) LRU")
        axes[0].plot(xs, [r["belady"] for _, r in pts], color=line.get_color(), ls=":", lw=1)
        pre = [(x, r["prefill_vs_bf16"]) for x, r in pts if "prefill_vs_bf16" in r]
        if pre:
            axes[1].plot(*zip(*pre), marker=marker, ls=ls, color=line.get_color(), label=kv)
    axes[0].axhline(res["infinite"], color="k", ls="--", lw=1, label="infinite cache")
    ticks = sorted({r["budget_bytes"] / (1 << 30) for r in rows})
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("device memory for KV (GiB)")
        ax.grid(alpha=0.3)
    trace = hdr.get("trace", "?")
    axes[0].set_ylabel("hit rate (prompt tokens from cache)")
    axes[0].set_title(f"{trace}: hit rate at equal bytes (dotted: Belady)")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("prompt tokens to prefill / bf16's")
    axes[1].set_title("prefill work relative to bf16 KV at the same bytes")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    out = IMG_DIR / f"{Path(path).stem}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
