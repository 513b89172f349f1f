"""Exact-order scenarios, written as documentation of the cache's behaviour (vLLM style).

Block size 2 throughout; ``FakeClock`` gives every event a distinct, known time.
"""

from __future__ import annotations

import pytest
from core_helpers import FakeClock, removed_in_order

from radixkv.core.block_manager import BlockManager, CopyOp
from radixkv.core.hashing import Namespace, hash_token_blocks
from radixkv.core.tree import MoveOp

NS = Namespace("m")


def make(num_blocks=8, lower=(), policy="lru"):
    clock = FakeClock()
    bm = BlockManager.create(num_blocks, block_size=2, policy=policy, lower_tier_blocks=lower,
                             clock=clock)
    return bm, clock


def run(bm, clock, sid, tokens, ns=NS, advance=True):
    """One request: allocate, compute, commit everything, free; returns the allocation.
    The clock moves a second before and after (``advance``; False: it stands still)."""
    clock.advance(1.0 if advance else 0.0)
    a = bm.allocate(sid, tokens, ns)
    bm.commit(sid, len(tokens))
    clock.advance(1.0 if advance else 0.0)
    bm.free(sid)
    bm.check_invariants()
    return a


def h(tokens, ns=NS):
    return hash_token_blocks(tokens, 2, ns)


def test_lru_evicts_in_release_order_and_a_hit_refreshes() -> None:
    bm, clock = make(8)
    run(bm, clock, "a", [1, 1, 9])       # caches block [1,1]
    run(bm, clock, "b", [2, 2, 9])
    run(bm, clock, "c", [3, 3, 9])
    a = run(bm, clock, "a2", [1, 1, 8])  # hit on [1,1]: now the most recently used
    assert a.num_cached_tokens == 2
    events = bm.event_queue().subscribe()
    assert bm.tree.evict(0, 3) == []     # one tier: drops need no storage work, no MoveOps
    assert removed_in_order(events) == [h([2, 2])[0], h([3, 3])[0], h([1, 1])[0]]


def test_leaf_first_even_when_the_parent_ranks_lower() -> None:
    bm, clock = make(8, policy="priority")
    run(bm, clock, "a", [1, 1, 2, 2, 3, 3, 0])           # chain of 3 cached blocks
    root, mid, leaf = (bm.tree.get(x) for x in h([1, 1, 2, 2, 3, 3]))
    bm.tree.set_hints([root.block_hash], priority=-10)   # the root ranks lowest...
    bm.tree.set_hints([leaf.block_hash], priority=5)
    events = bm.event_queue().subscribe()
    bm.tree.evict(0, 3)
    order = removed_in_order(events)
    assert order == [leaf.block_hash, mid.block_hash, root.block_hash]  # ...but goes last


def test_priority_keeps_the_system_prompt() -> None:
    bm, clock = make(6, policy="priority")
    system = [7, 7, 7, 7]
    run(bm, clock, "sys", system + [1])
    bm.tree.set_hints(h(system), priority=10)
    for i in range(6):                                   # other traffic under pressure
        run(bm, clock, f"u{i}", [i, i, i, i, 5])
    a = run(bm, clock, "again", system + [2])
    assert a.num_cached_tokens == 4                      # both system blocks survived
    assert bm.tree.stats.evicted[0] > 0


def test_lru_without_priority_loses_the_system_prompt() -> None:
    bm, clock = make(6, policy="lru")
    system = [7, 7, 7, 7]
    run(bm, clock, "sys", system + [1])
    for i in range(6):
        run(bm, clock, f"u{i}", [i, i, i, i, 5])
    assert run(bm, clock, "again", system + [2]).num_cached_tokens == 0


def test_ttl_expiry_with_a_fake_clock() -> None:
    clock = FakeClock(0.0)
    bm = BlockManager.create(8, block_size=2, policy="ttl", clock=clock)
    run(bm, clock, "a", [1, 1, 9], advance=False)                       # released at t=0
    run(bm, clock, "b", [2, 2, 9], advance=False)
    bm.tree.set_hints([h([2, 2])[0]], ttl=3600.0)                       # the 1-hour tier
    assert bm.tree.evict_expired(299.0) == []                           # default TTL 300 s
    events = bm.event_queue().subscribe()
    assert bm.tree.evict_expired(300.0) == []                           # device only: no MoveOps
    assert removed_in_order(events) == [h([1, 1])[0]]
    assert bm.tree.get(h([2, 2])[0]) is not None
    bm.tree.evict_expired(3600.0)
    assert removed_in_order(events) == [h([2, 2])[0]]
    assert len(bm.tree) == 0 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_ttl_expired_blocks_leave_through_the_slow_tiers() -> None:
    clock = FakeClock(0.0)
    bm = BlockManager.create(4, block_size=2, policy="ttl", lower_tier_blocks=[2], clock=clock)
    run(bm, clock, "a", [1, 1, 9], advance=False)
    moves = bm.tree.evict_expired(1000.0)
    x = h([1, 1])[0]
    assert moves == [MoveOp(x, 0, 0, 1, 0), MoveOp(x, 1, 0, None, None)]
    assert len(bm.tree) == 0


def test_demotion_chain_and_promotion_order() -> None:
    """device (2 blocks) -> host (1 slot) -> disk (2 slots) -> dropped; then a disk hit is
    promoted. Every MoveOp, in the order the storage layer must run them."""
    bm, clock = make(2, lower=(1, 2))
    A, B_, C, D, E = (h([x, x])[0] for x in (1, 2, 3, 4, 5))
    assert run(bm, clock, "a", [1, 1]).moves == ()       # a full 1-block prompt is cached
    assert run(bm, clock, "b", [2, 2]).moves == ()
    assert run(bm, clock, "c", [3, 3]).moves == (MoveOp(A, 0, 0, 1, 0),)   # LRU A -> host
    # B -> host needs host room: A moves on to disk first
    assert run(bm, clock, "d", [4, 4]).moves == (MoveOp(A, 1, 0, 2, 0), MoveOp(B_, 0, 1, 1, 0))
    assert run(bm, clock, "e", [5, 5]).moves == (MoveOp(B_, 1, 0, 2, 1), MoveOp(C, 0, 0, 1, 0))
    assert [bm.tree.get(x).tier for x in (A, B_, C, D, E)] == [2, 2, 1, 0, 0]
    # A hit on B (on disk): one block to promote B into, one for the private tail.
    alloc = bm.allocate("f", [2, 2, 9], NS)
    assert alloc.num_cached_tokens == 2 and alloc.cached_tokens_per_tier == (0, 0, 2)
    assert alloc.moves == (
        MoveOp(A, 2, 0, None, None),   # disk full: its LRU block A is dropped
        MoveOp(C, 1, 0, 2, 0),         # host full: C -> disk
        MoveOp(D, 0, 1, 1, 0),         # device LRU D -> host; frees device block 1
        MoveOp(B_, 2, 1, 0, 1),        # B loaded from disk into device block 1
        MoveOp(D, 1, 0, 2, 1),         # room for the tail: host D -> disk slot B left
        MoveOp(E, 0, 0, 1, 0),         # device E -> host; frees device block 0
    )
    assert alloc.block_ids == (1, 0)
    bm.check_invariants()


def test_promotion_target_dropped_while_making_room() -> None:
    """With a 1-slot disk, making room for B's promotion pushes B itself out of the cache:
    the allocation falls back to recomputing it (a miss, never a wrong block)."""
    bm, clock = make(2, lower=(1, 1))
    for x in (1, 2, 3, 4, 5):
        run(bm, clock, str(x), [x, x])
    B_ = h([2, 2])[0]
    assert bm.tree.get(B_).tier == 2
    alloc = bm.allocate("f", [2, 2, 9], NS)
    assert alloc.num_cached_tokens == 0
    assert MoveOp(B_, 2, 0, None, None) in alloc.moves
    assert all(m.dst_tier != 0 for m in alloc.moves)
    bm.check_invariants()


def test_cow_on_fork_then_append() -> None:
    bm, _ = make(8)
    a = bm.allocate("p", [1, 1, 2], NS)                  # blocks [0, 1], block 1 partial
    assert a.block_ids == (0, 1)
    bm.fork("p", "c")
    assert bm.block_refcount(1) == 2
    s = bm.append_slot("p", 3)                           # shared partial tail: copy first
    assert s.copy == CopyOp(1, 2) and s.slot == 2 * 2 + 1 and s.moves == ()
    assert bm.block_table("p") == [0, 2] and bm.block_table("c") == [0, 1]
    s2 = bm.append_slot("c", 4)                          # now private: write in place
    assert s2.copy is None and s2.slot == 1 * 2 + 1
    s3 = bm.append_slot("c", 5)                          # block boundary: a new block
    assert s3.copy is None and s3.slot == 3 * 2 + 0 and bm.block_table("c") == [0, 1, 3]
    assert [bm.block_refcount(b) for b in range(4)] == [2, 1, 1, 1]
    bm.check_invariants()


def test_commit_dedupe_switches_to_the_cached_block() -> None:
    bm, _ = make(8)
    bm.allocate("x", [1, 1, 2], NS)                      # x and y compute block [1,1] twice
    bm.allocate("y", [1, 1, 3], NS)
    assert bm.block_table("x") == [0, 1] and bm.block_table("y") == [2, 3]
    assert bm.commit("x", 3) == 1                        # x caches block 0
    free_before = bm.num_free_blocks
    assert bm.commit("y", 3) == 0                        # y switches to it...
    assert bm.block_table("y") == [0, 3]
    assert bm.num_free_blocks == free_before + 1         # ...and frees its duplicate (2)
    assert bm.pool.is_free(2) and bm.block_refcount(0) == 2
    bm.check_invariants()


def test_recompute_adopts_a_host_copy() -> None:
    """A block computed by a live sequence while its cached twin was demoted to the host becomes
    that node's device copy on commit: no copy, the host slot is released."""
    bm, clock = make(4, lower=(2,))
    bm.allocate("s", [1, 1, 2], NS)                      # s computes [1,1] (not committed)
    run(bm, clock, "q", [1, 1, 3])                       # q caches [1,1] in its own block
    bm.tree.evict(0, 1)
    assert bm.tree.get(h([1, 1])[0]).tier == 1
    assert bm.commit("s", 3) == 1
    node = bm.tree.get(h([1, 1])[0])
    assert node.tier == 0 and node.block_id == bm.block_table("s")[0]
    assert bm.tree.stats.adopted == 1 and bm.tree.num_resident(1) == 0
    bm.check_invariants()


def test_beam_search_step() -> None:
    """Fork the survivors, free the losers: blocks stay shared until a beam writes."""
    bm, _ = make(16)
    bm.allocate("b0", [1, 1, 2], NS)
    bm.commit("b0", 3)
    for step in range(3):
        for sid in sorted(bm._seqs):                     # each beam forks two candidates
            for k in range(2):
                bm.fork(sid, f"{sid}.{k}")
            bm.free(sid)
        for i, sid in enumerate(sorted(bm._seqs)):
            bm.append_slot(sid, 5 + i)
            bm.commit(sid, bm.num_tokens(sid))
        for sid in sorted(bm._seqs)[2:]:                 # keep the best two, free the losers
            bm.free(sid)
        bm.check_invariants()
    live = sorted(bm._seqs)
    assert len(live) == 2
    assert all(bm.block_table(s)[0] == bm.block_table(live[0])[0] for s in live)  # shared prompt
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks + bm.tree.num_resident(0) == 16
    bm.check_invariants()


def test_namespaces_never_share() -> None:
    bm, clock = make(16)
    run(bm, clock, "a", [1, 1, 2, 2, 0])
    for other in (Namespace("m", cache_salt="t2"), Namespace("m", adapter_id="lora"),
                  Namespace("m2")):
        assert run(bm, clock, "b", [1, 1, 2, 2, 0], other).num_cached_tokens == 0
    assert run(bm, clock, "c", [1, 1, 2, 2, 0]).num_cached_tokens == 4


@pytest.mark.parametrize("n", [1, 2, 3])
def test_last_prompt_token_is_always_computed(n) -> None:
    """A prompt of n full blocks, all n cached, reuses n - 1: its last token must be computed
    (for the logits) in a private block. The warm-up caches every block of the prompt, the
    last one included, so a manager that reused it would fail here."""
    bm, clock = make(8)
    prompt = [1, 1, 2, 2, 3, 3][: 2 * n]
    run(bm, clock, "a", prompt + [0])                   # caches the prompt's n full blocks
    assert set(h(prompt)) <= set(bm.tree.block_index())  # the block the rule is about
    a = bm.allocate("b", prompt, NS)
    assert a.num_cached_tokens == 2 * (n - 1)   # the prompt's last block is recomputed
    assert bm.block_table("b")[-1] not in bm.block_table("b")[:-1]
    bm.commit("b", len(prompt))
    bm.free("b")
    bm.check_invariants()
