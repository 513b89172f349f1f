"""``LLMEngine.stats()``: cache, scheduling and tier figures since construction (docs/api.md).
Kept apart from the step loop; reads the engine's parts, changes nothing."""

from __future__ import annotations

from typing import Any

from radixkv.tiers.mover import TieredKVMover


def engine_stats(engine: Any) -> dict[str, Any]:
    """Cache and scheduling figures since construction (see docs/api.md)."""
    c = engine.scheduler.counters
    tree_stats = engine.tree.stats
    tiers = engine.tree.num_tiers
    stored, slots = _kv_utilization(engine)
    counts = engine.kv_event_counts
    events = {} if counts is None else {"kv_blocks_stored": list(counts.stored),
                                        "kv_blocks_removed": list(counts.removed)}
    return {
        "prompt_tokens": c.prompt_tokens,
        "cached_prompt_tokens": c.cached_prompt_tokens,
        "cached_prompt_tokens_per_tier": list(c.cached_tokens_per_tier),
        "hit_rate": c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        "hit_rate_per_tier": [n / c.prompt_tokens if c.prompt_tokens else 0.0
                              for n in c.cached_tokens_per_tier],
        "prompt_tokens_saved": c.cached_prompt_tokens,
        "prefill_tokens_computed": c.prefill_tokens,
        "tokens_computed": c.computed_tokens,
        "recomputed_tokens": c.recomputed_tokens,
        "preemptions": c.preemptions,
        "unschedulable": c.unschedulable, "held_admissions": c.held_admissions,
        "evictions": list(tree_stats.evicted),
        "promotions": list(tree_stats.promoted),
        "demotions": list(tree_stats.demoted_in),
        "dropped": tree_stats.dropped,
        "cached_blocks_per_tier": [engine.tree.num_resident(t) for t in range(tiers)],
        "device_blocks": engine.block_manager.pool.num_blocks,
        "device_blocks_free": engine.block_manager.num_free_blocks,
        # partial last blocks kept for the next turn (core/tails.py): kept now, taken, and
        # the prompt tokens they served (part of cached_prompt_tokens)
        "tail_blocks": len(engine.block_manager.tails),
        "tail_hits": engine.block_manager.tails.hits,
        "tail_hit_tokens": engine.block_manager.tails.hit_tokens,
        "kv_tokens_stored": stored,
        "kv_slots_allocated": slots,
        "kv_utilization": stored / slots if slots else None,
        "num_running": engine.scheduler.num_running_seqs,
        "num_running_requests": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "session_ends": engine.session_ends,
        "steps": c.steps,
        "forwards": engine.num_forwards,
        **tier_stats(engine),
        **events,
    }


def _kv_utilization(engine: Any) -> tuple[int, int]:
    """(tokens stored, slots allocated) over the blocks live sequences hold; a block shared
    by forks counts once."""
    bm, bs = engine.block_manager, engine.block_manager.block_size
    fill: dict[int, int] = {}
    for req in engine.scheduler.running:
        for seq in (s for s in req.seqs if s.seq_id in bm):   # staged ones hold nothing
            n = bm.num_computed_tokens(seq.seq_id)
            for j, b in enumerate(bm.block_table(seq.seq_id)):
                fill[b] = max(fill.get(b, 0), min(bs, max(0, n - j * bs)))
    return sum(fill.values()), len(fill) * bs


__all__ = ["engine_stats"]


def tier_stats(engine: Any) -> dict[str, Any]:
    """Per-tier figures: names, capacities, residency; mover traffic and faults."""
    c = engine.scheduler.counters
    out: dict[str, Any] = {
        "tiers": list(engine.tier_names),
        "tier_capacity_blocks": list(engine.tier_capacity_blocks),
        "write_through": list(engine.cache_config.write_through),
        "load_failures": c.load_failures,
        "load_retries": c.load_retries,
        "loading_request_steps": c.loading_steps,
        "load_waits": c.load_waits,
    }
    tree = engine.tree
    if tree.write_through:
        ts = tree.stats
        out.update(copies_per_tier=[tree.num_copies(t) if t else 0
                                    for t in range(tree.num_tiers)],
                   copies_made=ts.copies_made, copies_skipped=ts.copies_skipped,
                   copies_dropped=ts.copies_dropped, free_demotions=ts.free_demotions)
    m = engine.kv_mover.counters()
    if m is not None:
        out.update(bytes_moved=m["bytes_moved"], blocks_moved=m["moves"],
                   write_failures=m["write_failures"],
                   mover_load_failures=m["load_failures"],
                   write_failure_drops=m["invalidated_blocks"],
                   skipped_writes=m["skipped_writes"],
                   async_batches=m["async_batches"],
                   async_load_batches=m["async_loads"],
                   failed_copy_writes=m["dropped_copies"],
                   prefetched_blocks=m["prefetched_blocks"],
                   prefetch_hits=m["prefetch_hits"],
                   prefetch_failures=m["prefetch_failures"])
    remote = engine.remote_tier
    if remote is not None:
        out["remote"] = remote.stats()
    disk = engine.kv_mover.disk if isinstance(engine.kv_mover, TieredKVMover) else None
    if disk is not None:
        d = disk.stats()
        out["disk"] = {"files": len(disk), "bytes_used": disk.bytes_used,
                       "corrupt": d.corrupt, "foreign": d.foreign, "forged": d.forged,
                       "read_errors": d.read_errors, "put_failures": d.put_failures,
                       "failures_by_errno": dict(d.failures_by_errno),
                       **(engine.restore_report or {})}
    return out
