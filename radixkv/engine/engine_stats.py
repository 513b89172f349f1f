"""``LLMEngine.stats()``: cache, scheduling and tier figures since construction (docs/api.md).
Kept apart from the step loop; reads the engine's parts, changes nothing."""

from __future__ import annotations

from typing import Any

from radixkv.engine.tiering import tier_stats


def engine_stats(engine: Any) -> dict[str, Any]:
    """Cache and scheduling figures since construction (see docs/api.md)."""
    c = engine.scheduler.counters
    tree_stats = engine.tree.stats
    tiers = engine.tree.num_tiers
    stored, slots = _kv_utilization(engine)
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
        "kv_tokens_stored": stored,
        "kv_slots_allocated": slots,
        "kv_utilization": stored / slots if slots else None,
        "num_running": engine.scheduler.num_running_seqs,
        "num_running_requests": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "steps": c.steps,
        "forwards": engine._num_forwards,
        **tier_stats(engine),
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
