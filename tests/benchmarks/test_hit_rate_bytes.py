"""Hit rate at equal bytes (issue 16, ``benchmarks/hit_rate_bytes.py``).

The byte-budget benchmark drives ``BlockManager`` only through its public methods; on small
traces its replay must give exactly the block-level LRU model of ``bounds.py`` (as the internal
replay of ``replay.py`` does), and a byte budget must become the block count of each dtype's
layout.
"""

from __future__ import annotations

import doctest

from hypothesis import given
from hypothesis import strategies as st

from radixkv.benchmarks import hit_rate_bytes
from radixkv.benchmarks.bounds import prepare, simulate
from radixkv.benchmarks.hit_rate_bytes import layout_of, replay_blocks
from radixkv.benchmarks.replay import ReplayConfig, replay

from hitrate_strategies import traces
from test_replay import timed


@given(traces(max_requests=16, max_len=20), st.sampled_from([1, 2, 4]), st.integers(0, 12))
def test_public_api_replay_equals_the_lru_model_and_the_internal_replay(reqs, block_size, extra):
    bt = prepare(reqs, block_size)
    cap = 2 * bt.min_capacity + extra
    got = replay_blocks(reqs, cap, block_size)
    assert got["hit_tokens"] == simulate(bt, cap, "lru").hit_tokens
    assert got["hit_tokens"] == replay(timed(reqs), ReplayConfig(block_size, cap)).hit_tokens
    assert got["prompt_tokens"] == bt.total_prompt_tokens


def test_a_byte_budget_holds_about_twice_the_quantized_blocks():
    budget = 1 << 30
    bf16, int8, fp8 = (layout_of(kv).blocks_in(budget) for kv in ("bfloat16", "int8",
                                                                   "fp8_e4m3"))
    assert (bf16, int8) == (2912, 5648) and fp8 == int8
    assert layout_of("float32").blocks_in(budget) == bf16 // 2
    assert 1.9 < int8 / bf16 < 2.0     # (2 d) / (d + 2) at head_dim 64


def test_module_doctests():
    assert doctest.testmod(hit_rate_bytes).failed == 0
