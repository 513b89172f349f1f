"""``radixkv bench core``: cost of the pure-Python bookkeeping, on a real trace and synthetic ones.

Every figure is reported against a floor measured in the same run, and (issue 14) beside the
same figure for the core of an earlier commit (``--baseline``, default: the last commit before
issue 14), loaded from git into the same process: before/after on the same machine and load.
  * the whole bookkeeping per request of the ShareGPT chat trace (hash, match, allocate, commit
    the prompt, append + commit the reply, evictions, free) at device capacities of 10, 25, 50
    and 100% of the working set, prompts only and with replies, against the floor: token ids ->
    bytes, xxh3-128 of every full block and one dict lookup per block (target: <= 2x);
  * match / insert throughput in tokens/s at block size 16 (floor: xxh3-128 + dict lookup alone);
  * append_slot cost per sequence per decode step, fork and free cost;
  * eviction cost per block at 10^3 .. 10^6 cached blocks (target: <= 1 us, flat);
  * metadata bytes per cached block (tracemalloc; target: <= 200 B);
  * the pause of a full ``gc.collect()`` with 10^6 blocks cached.
Times are CPU time of this process (``time.process_time``): on a shared machine the wall clock
swings with other tenants, CPU time much less.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import xxhash

from radixkv.benchmarks._common import (
    plain_doc, print_table, run_header, write_results,
)
from radixkv.benchmarks._core_baseline import BEFORE_ISSUE_14, load_core
from radixkv.benchmarks.core_sizes import (
    BS, NS, _chains, bench_gc_pause_vs, bench_memory_sizes,
)
from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import hash_blocks, token_bytes
from radixkv.core.tree import DEVICE



def cpu_median(fn, repeat: int = 3) -> float:
    """Median CPU seconds (``time.process_time``) of ``repeat`` calls of ``fn`` after one warm-up:
    on a shared machine the wall clock swings with other tenants, this process's CPU time much
    less (``time_median`` of ``_common`` is wall time)."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return sorted(samples)[len(samples) // 2]


def synthetic_requests(num_convs: int, turns: int, seed: int = 0) -> list[list[int]]:
    """Multi-turn chats: each turn re-sends the history plus ~120 new tokens (vocab 49k)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_convs):
        hist: list[int] = [1] + [rng.randrange(49152) for _ in range(rng.randrange(20, 200))]
        for _ in range(turns):
            hist = hist + [rng.randrange(49152) for _ in range(rng.randrange(40, 200))]
            out.append(list(hist))
    return out


def floor_ns_per_block(prompts: list[list[int]]) -> float:
    """xxh3-128 of (16-byte parent + 64 token bytes) + one dict lookup per block: the floor.

    The dict holds every block hash of the trace (as the tree's index does), so lookups pay the
    same cache misses a real index of that size pays.
    """
    blobs = [token_bytes(p) for p in prompts]
    table: dict[bytes, int] = {h: 0 for tok in blobs for h in hash_blocks(tok, BS, NS.seed)}
    width = BS * 4

    def run() -> int:
        n = 0
        for tok in blobs:
            h = NS.seed
            for i in range(len(tok) // width):
                h = xxhash.xxh3_128_digest(h + tok[i * width:(i + 1) * width])
                table.get(h)
                n += 1
        return n

    nblocks = run()
    return cpu_median(run, repeat=3) / nblocks * 1e9


def build_tree(prompts: list[list[int]], num_blocks: int, bm_cls=BlockManager) -> tuple:
    bm = bm_cls.create(num_blocks, BS)
    for i, p in enumerate(prompts):
        bm.allocate(i, p, NS)
        bm.commit(i, len(p))
        bm.free(i)
    return bm, len(bm.tree)


def bench_match_insert(prompts: list[list[int]]) -> dict:
    total_blocks = sum(len(p) // BS + 1 for p in prompts)
    bm, _ = build_tree(prompts, total_blocks + 16)
    tree = bm.tree
    blobs = [token_bytes(p) for p in prompts]
    matched_tokens = 0

    def match_all() -> None:
        nonlocal matched_tokens
        matched_tokens = 0
        for tok in blobs:
            nodes = tree.match_hashes(tok, NS.seed)
            matched_tokens += len(nodes) * BS

    t_match = cpu_median(match_all, repeat=3)
    match_tok_s = matched_tokens / t_match

    # insert = BlockManager.commit of freshly computed prompts (hash + dedupe + tree insert), the
    # path the engine uses; allocation and free are done outside the timed region.
    def insert_all() -> float:
        bm2 = BlockManager.create(total_blocks + 16, BS)
        spent = 0.0
        for i, p in enumerate(prompts):
            bm2.allocate(i, p, NS)
            t0 = time.process_time()
            bm2.commit(i, len(p))
            spent += time.process_time() - t0
            bm2.free(i)
        return spent

    inserted = sum(len(p) // BS * BS for p in prompts)
    t_insert = min(insert_all() for _ in range(3))
    return {"match_tok_per_s": match_tok_s, "insert_tok_per_s": inserted / t_insert,
            "matched_tokens": matched_tokens, "cached_blocks": len(tree)}


def bench_append_fork_free(num_seqs: int = 64, steps: int = 512) -> dict:
    bm = BlockManager.create(num_seqs * (steps // BS + 8) * 2, BS)
    rng = random.Random(1)
    for s in range(num_seqs):
        bm.allocate(s, [rng.randrange(1000) for _ in range(100)], NS)
        bm.commit(s, 100)
    toks = [rng.randrange(1000) for _ in range(steps)]
    t0 = time.process_time()
    for t in toks:
        for s in range(num_seqs):
            bm.append_slot(s, t)
    t_append = (time.process_time() - t0) / (steps * num_seqs)
    t0 = time.process_time()
    for s in range(num_seqs):
        bm.commit(s, bm.num_tokens(s) - 1)
    t_commit = (time.process_time() - t0) / (steps * num_seqs)
    blocks_per_seq = len(bm.block_table(0))
    t0 = time.process_time()
    for s in range(num_seqs):
        bm.fork(s, ("f", s))
    t_fork = (time.process_time() - t0) / num_seqs
    t0 = time.process_time()
    for s in range(num_seqs):
        bm.free(("f", s))
    t_free = (time.process_time() - t0) / num_seqs
    bm.check_invariants()
    return {"append_slot_us": t_append * 1e6, "commit_us_per_token": t_commit * 1e6,
            "fork_us": t_fork * 1e6, "free_us": t_free * 1e6, "blocks_per_seq": blocks_per_seq}


def bench_eviction(sizes: list[int], evict_n: int = 2000, bm_cls=BlockManager,
                   baseline=None, rounds: int = 9) -> list[dict]:
    """CPU us per evicted block at each tree size: the median of ``rounds`` rounds of
    ``evict_n / rounds`` evictions; with ``baseline`` (a BlockManager class) its tree of the
    same size is evicted in alternate rounds, so both see the same load (before/after)."""
    rows = []
    for n in sizes:
        prompts = _chains(n)
        impls = {"after": bm_cls, **({"before": baseline} if baseline else {})}
        trees = {}
        for name, cls in impls.items():
            bm, cached = build_tree([p + [0] for p in prompts], n + 64, cls)
            trees[name] = bm
        k = min(evict_n, cached // 2)
        per = max(1, k // rounds)
        gc.collect()
        samples: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(rounds):  # median of interleaved rounds: single timings swing on a shared VM
            for name, bm in trees.items():
                t0 = time.process_time()
                bm.tree.evict(DEVICE, per)
                samples[name].append((time.process_time() - t0) / per)
        # Floor: what every eviction must do at least, in an index of this size: pop the
        # victim's entry from a dict of every cached block and free its slot (a list append).
        index = trees["after"].tree.block_index()
        table = {h: None for h in list(index)[:per * rounds]}
        big = dict.fromkeys(index, None)
        free: list[int] = []
        keys = list(table)
        t0 = time.process_time()
        for h in keys:
            big.pop(h)
            free.append(0)
        floor = (time.process_time() - t0) / len(keys)
        after = sorted(samples["after"])
        med = after[rounds // 2]
        row = {"cached_blocks": cached, "evicted": per * rounds, "us_per_block": med * 1e6,
               "min_us": after[0] * 1e6, "max_us": after[-1] * 1e6,
               "floor_us": floor * 1e6, "x_floor": med / floor}
        if baseline:
            old = sorted(samples["before"])[rounds // 2]
            row.update(before_us_per_block=old * 1e6, before_x_floor=old / floor,
                       after_over_before=med / old)
        rows.append(row)
        del table, big, free, keys, index, trees
        gc.collect()
    return rows


def bench_demotion(sizes: list[int], evict_n: int = 1800, baseline=None,
                   rounds: int = 9) -> list[dict]:
    """CPU us per device eviction of a 3-tier LRU tree (device -> host demotion; host and disk
    as large as the device, so nothing cascades), median of ``rounds`` interleaved rounds, with
    ``baseline``'s tree of the same size evicted in alternate rounds."""
    rows = []
    for n in sizes:
        prompts = [p + [0] for p in _chains(n)]
        impls = {"after": BlockManager, **({"before": baseline} if baseline else {})}
        trees = {}
        for name, cls in impls.items():
            bm = cls.create(n + 64, BS, lower_tier_blocks=(n + 64, n + 64))
            for i, p in enumerate(prompts):
                bm.allocate(i, p, NS)
                bm.commit(i, len(p))
                bm.free(i)
            trees[name] = bm
        cached = len(trees["after"].tree)
        per = max(1, min(evict_n, cached // 2) // rounds)
        gc.collect()
        samples: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(rounds):
            for name, bm in trees.items():
                t0 = time.process_time()
                bm.tree.evict(DEVICE, per)
                samples[name].append((time.process_time() - t0) / per)
        med = sorted(samples["after"])[rounds // 2]
        row = {"cached_blocks": cached, "demoted": per * rounds, "us_per_block": med * 1e6}
        if baseline:
            old = sorted(samples["before"])[rounds // 2]
            row.update(before_us_per_block=old * 1e6, after_over_before=med / old)
        rows.append(row)
        del trees
        gc.collect()
    return rows


FRACTIONS = (0.1, 0.25, 0.5, 1.0)


def _replay(bm_cls, requests, cap: int, replies: bool) -> tuple[float, int, int]:
    """CPU seconds of the whole bookkeeping of ``requests``, prompt tokens served, evictions."""
    bm = bm_cls.create(cap, BS)
    served = 0
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    for i, r in enumerate(requests):
        a = bm.allocate(i, r.prompt, NS)
        served += a.num_cached_tokens
        bm.commit(i, len(r.prompt))
        if replies and r.reply:
            bm.append_slots(i, r.reply)
            bm.commit(i, bm.num_tokens(i))
        bm.free(i)
    dt = time.process_time() - t0
    gc.enable()
    bm.check_invariants()
    return dt, served, bm.tree.stats.evicted[0]


def _floor(requests, table: dict, replies: bool) -> float:
    """token ids -> bytes, xxh3 of every full block, one lookup each in a dict of the working
    set's size: the least any per-block hashed cache pays per request (CPU seconds, all)."""
    t0 = time.process_time()
    for r in requests:
        for h in hash_blocks(token_bytes(r.prompt + r.reply if replies else r.prompt), BS, NS.seed):
            table.get(h)
    return time.process_time() - t0


def bench_trace(requests, baseline=None, fractions=FRACTIONS, repeat: int = 2) -> list[dict]:
    """The whole loop per request at each capacity, prompts only and with replies, against the
    floor and (if given) the baseline core; best of ``repeat`` runs of each, interleaved."""
    rows = []
    for replies in (False, True):
        distinct: set[bytes] = set()
        for r in requests:
            tok = token_bytes(r.prompt + r.reply if replies else r.prompt)
            distinct.update(hash_blocks(tok, BS, NS.seed))
        ws = len(distinct)
        table = dict.fromkeys(distinct, 0)
        longest = max(len(r.prompt) + (len(r.reply) if replies else 0) for r in requests)
        for f in fractions:
            cap = max(int(ws * f), longest // BS + 2)
            best: dict[str, float] = {}
            out: dict[str, tuple] = {}
            impls = [("after", BlockManager)] + ([("before", baseline)] if baseline else [])
            for _ in range(repeat):
                best["floor"] = min(best.get("floor", 1e9), _floor(requests, table, replies))
                for name, cls in impls:
                    dt, served, ev = _replay(cls, requests, cap, replies)
                    best[name] = min(best.get(name, 1e9), dt)
                    out[name] = (served, ev)
            n = len(requests)
            row = {"replies": replies, "capacity": f, "device_blocks": cap, "working_set": ws,
                   "floor_us": best["floor"] / n * 1e6, "after_us": best["after"] / n * 1e6,
                   "after_x_floor": best["after"] / best["floor"],
                   "hit_rate": out["after"][0] / sum(len(r.prompt) for r in requests),
                   "evictions": out["after"][1]}
            if baseline:
                row.update(before_us=best["before"] / n * 1e6,
                           before_x_floor=best["before"] / best["floor"],
                           same_hits=out["before"] == out["after"])
            rows.append(row)
            print_table([row], title=None)
    return rows


HIT_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def _lru_replay(bm_cls, requests, device_blocks: int, lower: tuple[int, ...]) -> tuple:
    """Per-request cached tokens per tier and the tree's final counters of one LRU replay with
    the trace's arrival times as the clock (as ``radixkv bench hit-rate`` replays it)."""
    clock = _TraceClock()
    bm = bm_cls.create(device_blocks, BS, "lru", lower_tier_blocks=lower, clock=clock)
    per_request = []
    for j, r in enumerate(requests):
        clock.now = r.t
        per_request.append(bm.allocate(j, r.prompt, NS).cached_tokens_per_tier)
        bm.commit(j, len(r.prompt))
        if r.reply:
            bm.append_slots(j, r.reply)
            bm.commit(j, len(r.prompt) + len(r.reply))
        bm.free(j)
    bm.check_invariants()
    st = bm.tree.stats
    return per_request, (list(st.evicted), list(st.promoted), st.dropped, st.inserted)


class _TraceClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def check_same_hits(requests, baseline, fractions=HIT_FRACTIONS) -> list[dict]:
    """LRU hit identity, request by request, between this core and ``baseline`` (a BlockManager
    class): at each device capacity (a fraction of the working set of prompts + replies),
    device only and with a host (2x) and disk (4x) tier, every request's cached tokens per tier
    and the final evictions, promotions, drops and inserts per tier must be equal."""
    distinct: set[bytes] = set()
    for r in requests:
        distinct.update(hash_blocks(token_bytes(r.prompt + r.reply), BS, NS.seed))
    longest = max(len(r.prompt) + len(r.reply) for r in requests) // BS + 2
    prompt_tokens = sum(len(r.prompt) for r in requests)
    rows = []
    for f in fractions:
        dev = max(int(len(distinct) * f), longest)
        for lower in ((), (2 * dev, 4 * dev)):
            after, after_stats = _lru_replay(BlockManager, requests, dev, lower)
            before, before_stats = _lru_replay(baseline, requests, dev, lower)
            rows.append({"capacity": f, "device_blocks": dev, "tiers": 1 + len(lower),
                         "hit_rate": sum(sum(x) for x in after) / prompt_tokens,
                         "device_hit_rate": sum(x[0] for x in after) / prompt_tokens,
                         "evictions": after_stats[0][0],
                         "same_per_request": after == before,
                         "same_counters": after_stats == before_stats})
            print_table([rows[-1]], title=None)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench core", description=plain_doc(__doc__))
    ap.add_argument("--quick", action="store_true",
                    help="small sizes (CI smoke run); results go to a temporary folder")
    ap.add_argument("--synthetic-only", action="store_true", help="skip the ShareGPT trace")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each whole-loop replay, interleaved with the baseline's; the "
                         "best is kept (default 3; 1 with --quick)")
    ap.add_argument("--check-hits", action="store_true",
                    help="also replay the chat trace with LRU at 8 capacities, device only and "
                         "with host+disk tiers, and check every request's hits against the "
                         "baseline core (a few minutes)")
    ap.add_argument("--name", default="core",
                    help="results file name under benchmarks/results/ (default core; e.g. "
                         "core_vs_2947032 for a run against another baseline)")
    ap.add_argument("--baseline", default=BEFORE_ISSUE_14,
                    help="commit whose radixkv/core is timed beside this one ('' for none)")
    args = ap.parse_args(argv)
    random.seed(0)
    header = run_header(seed=0, block_size=BS, quick=args.quick, baseline=args.baseline or None)
    print("radixkv bench core", {k: header[k] for k in ("commit", "python", "cpu_count")})
    loaded = load_core(args.baseline) if args.baseline else None
    before = loaded[0] if loaded else None
    results: dict = {"baseline_commit": args.baseline if before else None}

    synth = synthetic_requests(60 if args.quick else 400, 5)
    floor = floor_ns_per_block(synth)
    mi = bench_match_insert(synth)
    results["synthetic"] = {**mi, "floor_ns_per_block": floor,
                            "floor_tok_per_s": BS / floor * 1e9}
    results["decode"] = bench_append_fork_free(16 if args.quick else 64, 128 if args.quick else 512)
    sizes = [10**3, 10**4] if args.quick else [10**3, 10**4, 10**5, 10**6]
    results["eviction"] = bench_eviction(sizes, baseline=before)
    results["demotion"] = bench_demotion(sizes[:3], baseline=before)
    results["memory"] = bench_memory_sizes([10_000] if args.quick
                                           else [10_000, 100_000, 1_000_000], before)
    if not args.quick:
        results["gc_pause"] = [bench_gc_pause_vs(before)]

    trace = None
    if not args.synthetic_only:
        try:
            from radixkv.benchmarks.traces import load_trace
            trace = load_trace("chat", quick=args.quick)
        except Exception as exc:  # noqa: BLE001 - the trace needs optional packages; say why
            print(f"(skipping the ShareGPT trace: {type(exc).__name__}: {exc})")
    if trace is not None:
        prompts = [r.prompt for r in trace]
        floor_real = floor_ns_per_block(prompts)
        mi_real = bench_match_insert(prompts)
        print("\nShareGPT chat trace, whole bookkeeping per request (CPU us) against the floor")
        results["sharegpt"] = {**mi_real, "floor_ns_per_block": floor_real,
                               "floor_tok_per_s": BS / floor_real * 1e9,
                               "trace": bench_trace(trace, before,
                                                    repeat=1 if args.quick else args.repeat)}
        if args.check_hits and before:
            print("\nLRU hits request by request against the baseline core")
            results["same_hits"] = check_same_hits(
                trace, before, HIT_FRACTIONS[3:5] if args.quick else HIT_FRACTIONS)

    rows = []
    for name in ("synthetic", "sharegpt"):
        if name in results:
            r = results[name]
            rows.append({"trace": name, "match Mtok/s": r["match_tok_per_s"] / 1e6,
                         "insert Mtok/s": r["insert_tok_per_s"] / 1e6,
                         "floor Mtok/s (xxh3+dict)": r["floor_tok_per_s"] / 1e6,
                         "match/floor": r["match_tok_per_s"] / r["floor_tok_per_s"]})
    print_table(rows, title="match / insert throughput, block size 16")
    d = results["decode"]
    print_table([{k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}],
                title="decode bookkeeping per sequence per step")
    print_table(results["eviction"], title="eviction cost per block (target <= 1 us at 10^6, flat)")
    print_table(results["demotion"], title="device -> host demotion per block, 3 tiers (LRU)")
    print_table(results["memory"], title="metadata per cached block, pool arrays included "
                "(target <= 200 B; floor: 16-byte hash + 16 int32 token ids)")
    if "gc_pause" in results:
        print_table(results["gc_pause"], title="a full gc.collect() with the blocks cached (ms)")
    if "sharegpt" in results:
        print_table(results["sharegpt"]["trace"],
                    title="ShareGPT chat trace, whole loop per request, CPU us "
                          "(target <= 2x floor)")
    if "same_hits" in results:
        print_table(results["same_hits"], title="LRU hits request by request vs the baseline core")
    write_results("core_quick" if args.quick else args.name, header, results)
    if not args.quick:
        from radixkv.benchmarks.core_plot import DEFAULT_OUT, plot_core
        print("plot:", plot_core(results, DEFAULT_OUT, f"radixkv bench core at {header['commit']}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
