"""Replay through the real BlockManager/RadixTree on tiny synthetic traces.

Checks that the real tree's LRU gives exactly the block-level LRU model of bounds.py (so the two
bounds apply to the replay), that no replay beats Belady or the infinite cache, and that tiers
only add hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from radixkv.benchmarks.bounds import infinite, prepare, simulate
from radixkv.benchmarks.replay import ReplayConfig, replay

from hitrate_strategies import traces


@dataclass
class R:
    t: float
    prompt: list[int]
    reply: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def timed(reqs):
    return [R(float(j), r.prompt, r.reply) for j, r in enumerate(reqs)]


def test_chat_turns_hit_history():
    p1, a1 = list(range(1, 9)), list(range(20, 28))
    reqs = [R(0.0, p1, a1), R(1.0, p1 + a1 + [40, 41, 42])]
    res = replay(reqs, ReplayConfig(4, 16), check_every=1)
    assert res.hit_tokens == 16 and res.prompt_tokens == 8 + 19


@given(traces(max_requests=16, max_len=20), st.sampled_from([1, 2, 4]), st.integers(0, 12))
def test_real_lru_equals_model_and_respects_bounds(reqs, block_size, extra):
    reqs = timed(reqs)
    bt = prepare(reqs, block_size)
    cap = 2 * bt.min_capacity + extra  # the real manager may briefly hold a duplicate block
    real = replay(reqs, ReplayConfig(block_size, cap, "lru"), check_every=1)
    assert real.hit_tokens == simulate(bt, cap, "lru").hit_tokens
    assert real.hit_tokens <= simulate(bt, cap, "belady").hit_tokens
    for pol in ("lfu", "ttl", "priority"):
        other = replay(reqs, ReplayConfig(block_size, cap, pol, ttl_s=3.0),
                       priority_tokens=lambda r: 2)
        assert other.hit_tokens <= simulate(bt, cap, "belady").hit_tokens
    tiered = replay(reqs, ReplayConfig(block_size, cap, "lru", host_blocks=4,
                                       disk_blocks=bt.num_blocks), check_every=1)
    assert real.hit_tokens <= tiered.hit_tokens <= infinite(bt).hit_tokens
    assert sum(tiered.hit_tokens_per_tier) == tiered.hit_tokens


def test_hits_digest_is_per_request():
    """Equal digests: the same prompt tokens hit request by request; the same total hit by
    other requests gives another digest."""
    p, q = list(range(1, 10)), list(range(30, 39))
    first = [R(0.0, p), R(1.0, p), R(2.0, q)]
    last = [R(0.0, q), R(1.0, p), R(2.0, p)]
    one, two = replay(first, ReplayConfig(4, 16)), replay(first, ReplayConfig(4, 16))
    assert one.hits_digest == two.hits_digest and len(one.hits_digest) == 16
    other = replay(last, ReplayConfig(4, 16))
    assert other.hit_tokens == one.hit_tokens > 0 and other.hits_digest != one.hits_digest
