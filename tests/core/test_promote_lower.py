"""``RadixTree.promote_lower``: a prefetch moves a disk node into the host tier.

Block size 2, device/host/disk tiers; ``FakeClock`` gives every event a distinct time. Every
scenario checks the exact MoveOps (the order the storage layer runs them) and the invariants.
"""

from __future__ import annotations

import pytest
from core_helpers import FakeClock

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks
from radixkv.core.tree import MoveOp

NS = Namespace("m")


def make(device, host, disk):
    clock = FakeClock()
    bm = BlockManager.create(device, block_size=2, lower_tier_blocks=(host, disk), clock=clock)
    return bm, clock


def run(bm, clock, sid, tokens):
    clock.advance()
    a = bm.allocate(sid, tokens, NS)
    bm.commit(sid, len(tokens))
    clock.advance()
    bm.free(sid)
    bm.check_invariants()
    return a


def h(tokens):
    return hash_token_blocks(tokens, 2, NS)


def sink(bm, tier):
    """Demote every cached block down to ``tier``."""
    tree = bm.tree
    for t in range(tier):
        tree.evict(t, tree.num_evictable(t))
    bm.check_invariants()


def test_free_host_slot_one_load_and_lru_touch() -> None:
    bm, clock = make(4, 2, 4)
    run(bm, clock, "a", [1, 1, 9])
    sink(bm, 2)
    tree = bm.tree
    [A] = h([1, 1])
    node = tree.get(A)
    assert (node.tier, node.block_id) == (2, 0)
    before = tree.block_index()[A].last_access
    clock.advance()
    assert tree.promote_lower(A, 1) == [MoveOp(A, 2, 0, 1, 0)]
    node = tree.get(A)
    assert (node.tier, node.block_id) == (1, 0) and tree.block_index()[A].last_access > before
    assert tree.num_resident(1) == 1 and tree.num_resident(2) == 0
    tree.check_invariants()
    # the allocation then promotes it host -> device, counted as a host hit
    a = bm.allocate("b", [1, 1, 7], NS)
    assert a.cached_tokens_per_tier == (0, 2, 0) and a.moves == (MoveOp(A, 1, 0, 0, 0),)
    bm.check_invariants()


def test_full_host_victim_takes_the_disk_slot_the_node_leaves() -> None:
    """Host full (1 slot) and disk full (1 slot): the host victim is demoted into the very
    disk slot the prefetched node leaves; nothing is dropped. Demotion first, then the load."""
    bm, clock = make(4, 1, 1)
    run(bm, clock, "a", [1, 1, 9])
    run(bm, clock, "b", [2, 2, 9])
    tree = bm.tree
    A, B = h([1, 1])[0], h([2, 2])[0]
    tree.evict(0, 2)            # A -> host -> disk, then B -> host
    assert [tree.get(x).tier for x in (A, B)] == [2, 1]
    moves = tree.promote_lower(A, 1, 1)
    assert moves == [MoveOp(B, 1, 0, 2, 0), MoveOp(A, 2, 0, 1, 0)]
    assert [tree.get(x).tier for x in (A, B)] == [1, 2]
    assert len(tree) == 2 and tree.stats.dropped == 0
    tree.check_invariants()


def test_parent_on_host_is_never_the_victim() -> None:
    """Chain P (host) -> C (disk); host full with P and an older leaf Q. Prefetching C must
    evict Q, not its own parent P, even if P is the policy's first choice."""
    bm, clock = make(4, 2, 4)
    run(bm, clock, "p", [1, 1, 2, 2, 9])     # P = [1,1], C = [1,1][2,2]
    run(bm, clock, "q", [5, 5, 9])           # Q, newer than P
    tree = bm.tree
    P, C = h([1, 1, 2, 2])
    [Q] = h([5, 5])
    sink(bm, 2)                              # all three on disk
    # bring P then Q up to the host (host now full; P is the LRU host leaf)
    assert [(m.block_hash, m.dst_tier) for m in tree.promote_lower(P, 1, 1)] == [(P, 1)]
    clock.advance()
    q_moves = tree.promote_lower(Q, 1, 1)
    assert [m.block_hash for m in q_moves] == [Q]
    clock.advance()
    moves = tree.promote_lower(C, 1, 1)
    assert [(m.block_hash, m.src_tier, m.dst_tier) for m in moves] == [(Q, 1, 2), (C, 2, 1)]
    assert [tree.get(x).tier for x in (P, C, Q)] == [1, 1, 2]
    tree.check_invariants()


def test_no_room_changes_nothing() -> None:
    """Host of 1 slot holding the parent: no victim may be taken -> [] and nothing moved."""
    bm, clock = make(4, 1, 4)
    run(bm, clock, "p", [1, 1, 2, 2, 9])
    tree = bm.tree
    P, C = h([1, 1, 2, 2])
    sink(bm, 2)
    assert [(m.block_hash, m.dst_tier) for m in tree.promote_lower(P, 1, 1)] == [(P, 1)]
    tree.check_invariants()
    free_before = [tree.pools[t].num_free for t in range(3)]
    assert tree.promote_lower(C, 1, 1) == []
    assert tree.get(C).tier == 2 and tree.get(P).tier == 1
    assert [tree.pools[t].num_free for t in range(3)] == free_before
    tree.check_invariants()


def test_prefetch_then_everything_still_promotes_and_evicts() -> None:
    """After prefetching a whole chain to the host, a request hits it from the host; the tree
    stays consistent through further eviction pressure."""
    bm, clock = make(4, 3, 6)
    prompt = [1, 1, 2, 2, 3, 3, 9]
    run(bm, clock, "a", prompt)
    sink(bm, 2)
    tree = bm.tree
    hashes = h(prompt[:6])
    for x in hashes:                         # parents first: closure holds at every step
        assert tree.promote_lower(x, 1, 1)
        tree.check_invariants()
    a = bm.allocate("b", prompt, NS)
    assert a.cached_tokens_per_tier == (0, 6, 0)
    bm.commit("b", len(prompt))
    bm.free("b")
    for sid, t in (("c", [4, 4, 5, 5, 9]), ("d", [6, 6, 7, 7, 9])):
        run(bm, clock, sid, t)


@pytest.mark.parametrize("bad", ["device node", "into device", "parent on disk"])
def test_preconditions_are_asserted(bad) -> None:
    bm, clock = make(4, 2, 4)
    run(bm, clock, "p", [1, 1, 2, 2, 9])
    tree = bm.tree
    P, C = h([1, 1, 2, 2])
    if bad == "device node":
        with pytest.raises(AssertionError):
            tree.promote_lower(P, 1, 1)
        return
    sink(bm, 2)
    with pytest.raises(AssertionError):
        if bad == "into device":
            tree.promote_lower(P, 0, 1)
        else:
            tree.promote_lower(C, 1, 1)
    tree.check_invariants()
