"""The core's figures that depend on how much is cached (``radixkv bench core``): metadata bytes
per cached block and the pause of a full garbage collection, measured on the same synthetic
chains as eviction (32-block chains of random token ids), each beside a baseline core.

A module of its own because these runs build caches of up to a million blocks, twice (this core
and the baseline), and own their memory tracing (``tracemalloc``) and collector calls.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace

BS = 16
NS = Namespace("bench-core")


def _chains(num_blocks: int, chain_blocks: int = 32, seed: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    n_chains = max(1, num_blocks // chain_blocks)
    return [[rng.randrange(49152) for _ in range(chain_blocks * BS)] for _ in range(n_chains)]


def bench_memory(num_blocks: int = 100_000, bm_cls=BlockManager) -> dict:
    """Bytes traced per cached block when chains are cached through the real commit path."""
    prompts = [p + [0] for p in _chains(num_blocks)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    bm = bm_cls.create(num_blocks + 64, BS)
    after_pool = tracemalloc.get_traced_memory()[0]
    for i, p in enumerate(prompts):
        bm.allocate(i, p, NS)
        bm.commit(i, len(p))
        bm.free(i)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    n = len(bm.tree)
    return {"cached_blocks": n, "bytes_per_block": (used - base) / n,
            "tree_bytes_per_block": (used - after_pool) / n,
            "floor_bytes_per_block": 16 + 64,
            "note": "bytes_per_block includes the pool's per-block arrays; the floor is the "
                    "16-byte hash plus 16 int32 token ids that every cached block must keep"}


def bench_gc_pause(num_blocks: int = 1_000_000, bm_cls=BlockManager, rounds: int = 5) -> dict:
    """Wall time of a full ``gc.collect()`` while ``num_blocks`` blocks are cached: the pause a
    serving process takes whenever the collector's oldest generation runs (median of
    ``rounds``). What the collector walks is what the core keeps in GC-tracked containers."""
    prompts = [p + [0] for p in _chains(num_blocks)]
    bm = bm_cls.create(num_blocks + 64, BS)
    for i, p in enumerate(prompts):
        bm.allocate(i, p, NS)
        bm.commit(i, len(p))
        bm.free(i)
    del prompts
    gc.collect()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    out = {"cached_blocks": len(bm.tree), "full_gc_ms": sorted(times)[rounds // 2] * 1e3,
           "tracked_objects": len(gc.get_objects())}
    del bm
    gc.collect()
    return out


def bench_memory_sizes(sizes: list[int], before=None) -> list[dict]:
    """``bench_memory`` at each size, beside ``before`` (a baseline ``BlockManager`` class).
    Several sizes: the hash index's share swings with where a dict sits between two resizes
    (just past one, at 10^5 here, it is a third fuller than just before the next)."""
    rows = []
    for n in sizes:
        row = bench_memory(n)
        row.pop("note")
        if before:
            old = bench_memory(n, bm_cls=before)
            row["before_bytes_per_block"] = old["bytes_per_block"]
            row["before_tree_bytes_per_block"] = old["tree_bytes_per_block"]
        rows.append(row)
        gc.collect()
    return rows


def bench_gc_pause_vs(before=None) -> dict:
    """``bench_gc_pause`` at 10^6 blocks, beside ``before`` if given."""
    row = bench_gc_pause()
    if before:
        old = bench_gc_pause(bm_cls=before)
        row["before_full_gc_ms"] = old["full_gc_ms"]
        row["before_tracked_objects"] = old["tracked_objects"]
    return row
