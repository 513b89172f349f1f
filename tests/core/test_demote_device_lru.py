"""The inlined device -> host demotion loop (``RequestOps._demote_device_lru``) against the
generic per-node path (``_evict_one`` -> ``_move_out``), on tiered write-back LRU trees.

Two managers with the same tiers are fed the same requests; one has ``_inline_demotion`` off.
Every device eviction (by ``allocate`` making room, or called directly) must return the same
moves and leave the same manager and tree state, including when tier 1 is full (the generic
cascade into the disk tier, or out of a 2-tier cache, runs in the middle of the loop), when a
demoted block has children in the host tier already, and when slow-tier hits are promoted back.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from core_helpers import FakeClock, snapshot_manager
from hypothesis import given

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.core.tree import DEVICE

NS = Namespace("lru-demote")
B = 2

REQUESTS = st.lists(st.tuples(st.integers(0, 3),
                              st.lists(st.integers(0, 5), min_size=1, max_size=9),
                              st.integers(0, 1), st.integers(0, 6), st.booleans()),
                    min_size=1, max_size=40)


def _managers(lower: tuple[int, ...]) -> tuple[BlockManager, BlockManager, FakeClock]:
    clock = FakeClock()
    inline = BlockManager.create(12, B, lower_tier_blocks=lower, clock=clock)
    generic = BlockManager.create(12, B, lower_tier_blocks=lower, clock=clock)
    generic.tree._inline_demotion = False
    return inline, generic, clock


@pytest.mark.parametrize("lower", [(4,), (6, 5), (3, 20)], ids=["host", "host+disk", "small host"])
@given(requests=REQUESTS)
def test_inlined_demotion_equals_the_generic_path(lower, requests) -> None:
    inline, generic, clock = _managers(lower)
    live: list[int] = []
    for i, (prefix, tail, tick, evict, keep) in enumerate(requests):
        clock.advance(tick)
        prompt = [7, prefix, prefix + 1, 9] + tail
        if not inline.can_allocate(prompt, NS):
            assert not generic.can_allocate(prompt, NS)
        else:
            got = [bm.allocate(i, prompt, NS) for bm in (inline, generic)]
            assert got[0] == got[1]
            for bm in (inline, generic):
                bm.commit(i, len(prompt))
            if keep:
                live.append(i)
            else:
                for bm in (inline, generic):
                    bm.free(i)
        if len(live) > 2:
            for bm in (inline, generic):
                bm.free(live[0])
            live.pop(0)
        n = min(evict, inline.tree.num_evictable(DEVICE))
        assert inline.tree.evict(DEVICE, n) == generic.tree.evict(DEVICE, n)
        assert snapshot_manager(inline) == snapshot_manager(generic)
        inline.check_invariants()
    generic.check_invariants()
