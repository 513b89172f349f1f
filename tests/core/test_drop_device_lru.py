"""The device-only eviction loop (``MovePlanner._drop_device_lru``) against the generic one.

A device-only tree whose index pops and peeks at once (LRU, TTL, FIFO: ``RecencyIndex``; the
forecast: ``ForecastIndex``) evicts through ``_drop_device_lru``, one loop over victim nodes (the
index's ``pop_min_peek`` and ``add``); with a KV event reader it takes the generic loop. Two
managers fed the same requests, one with an event reader, must return the same moves and end in
the same state (policy state included) after every eviction, including when parents land in
the index's side list (equal access times make the hash decide the order) and when dead pairs
sit at the head of its queue.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from core_helpers import FakeClock, snapshot_manager
from hypothesis import given

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.core.tree import DEVICE

NS = Namespace("lru-inline")
B = 2

# A request: a prefix id (shared first blocks) and a tail; the clock advances 0 or 1 between
# requests (0: equal access times, ordered by hash); then an eviction of some blocks.
REQUESTS = st.lists(st.tuples(st.integers(0, 3),
                              st.lists(st.integers(0, 5), min_size=1, max_size=9),
                              st.integers(0, 1), st.integers(0, 6), st.booleans()),
                    min_size=1, max_size=40)


def _managers(policy: str = "lru") -> tuple[BlockManager, BlockManager, FakeClock]:
    clock = FakeClock()
    inline = BlockManager.create(24, B, clock=clock, policy=policy)
    generic = BlockManager.create(24, B, clock=clock, policy=policy)
    generic.event_queue().subscribe()   # an event reader forces the generic loop
    return inline, generic, clock


def _aux(bm: BlockManager) -> list:
    """Every node's policy state (the forecast's ``(due, -far, gap, owner)``), by first hash."""
    return sorted((n.hashes[0], repr(n.aux)) for n in set(bm.tree.block_index().values()))


# The same loop serves every policy whose index pops and peeks at once: LRU, TTL and FIFO
# (``RecencyIndex``) and the forecast (``ForecastIndex``, hooked: it hears ``on_leave``).
@given(requests=REQUESTS)
@pytest.mark.parametrize("policy", ["lru", "ttl", "fifo", "forecast"])
def test_inlined_lru_eviction_equals_the_generic_loop(policy, requests) -> None:
    inline, generic, clock = _managers(policy)
    live: list[int] = []
    for i, (prefix, tail, tick, evict, keep) in enumerate(requests):
        clock.advance(tick)
        prompt = [7, prefix, prefix + 1, 9] + tail
        for bm in (inline, generic):
            if not bm.can_allocate(prompt, NS):
                break
            # sessions (one per prefix) and their ends feed the forecast's statistics
            bm.allocate(i, prompt, NS, session=prefix, end_session=tail[0] == 0)
            bm.commit(i, len(prompt))
        else:
            if keep:
                live.append(i)       # held: its blocks are not evictable while it lives
            else:
                for bm in (inline, generic):
                    bm.free(i)
        if len(live) > 2:
            for bm in (inline, generic):
                bm.free(live[0])
            live.pop(0)
        n = min(evict, inline.tree.num_evictable(DEVICE))
        assert generic.tree.num_evictable(DEVICE) >= n
        assert inline.tree.evict(DEVICE, n) == generic.tree.evict(DEVICE, n)
        assert snapshot_manager(inline) == snapshot_manager(generic)
        assert _aux(inline) == _aux(generic)
        inline.check_invariants()
    generic.check_invariants()


def test_parent_filed_in_the_side_list_is_evicted_in_order() -> None:
    """Two chains released at the same time: after the first leaf goes, its parent's entry
    belongs between the queued ones (same time, hash order), i.e. in the side list."""
    inline, generic, clock = _managers()
    for bm in (inline, generic):
        for i, prompt in enumerate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]):
            bm.allocate(i, prompt, NS)
            bm.commit(i, len(prompt))
        for i in range(3):
            bm.free(i)
    index = inline.tree.evictable[DEVICE].index
    side_max = index.num_side
    for _ in range(6):
        assert inline.tree.evict(DEVICE, 1) == generic.tree.evict(DEVICE, 1)
        side_max = max(side_max, index.num_side)
        assert snapshot_manager(inline) == snapshot_manager(generic)
    assert side_max >= 1 and len(inline.tree) == 0   # the side list was used
    inline.check_invariants()
