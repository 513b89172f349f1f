"""Write-through copies, as exact-order scenarios (documentation of the MoveOps the storage layer
runs). Block size 2; ``FakeClock`` gives every event a distinct, known time.

A node's *primary* residency is its ``tier``/``slot``; with ``write_through`` tiers it may also
hold a *copy* in slower tiers. ``MoveOp(..., keep_src=True)`` copies without releasing the source.
"""

from __future__ import annotations

import pytest
from core_helpers import FakeClock

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks
from radixkv.core.pool import BlockPool
from radixkv.core.tree import MoveOp, RadixTree
from radixkv.errors import ConfigError

NS = Namespace("m")


def make(device=4, lower=(2,), write_through=(1,), policy="lru"):
    clock = FakeClock()
    bm = BlockManager.create(device, block_size=2, policy=policy, lower_tier_blocks=lower,
                             write_through=write_through, clock=clock)
    return bm, clock


def run(bm, clock, sid, tokens):
    """One request: allocate, compute, commit, take the write-through moves, free."""
    clock.advance()
    a = bm.allocate(sid, tokens, NS)
    bm.commit(sid, len(tokens))
    wt = bm.take_moves()
    clock.advance()
    bm.free(sid)
    bm.check_invariants()
    return a, wt


def h(tokens):
    return hash_token_blocks(tokens, 2, NS)


def loc(tree, block_hash):
    """Where a cached block's primary lives now: (tier, slot)."""
    ref = tree.get(block_hash)
    return (ref.tier, ref.block_id)


def test_commit_copies_to_the_host_then_the_demotion_is_free() -> None:
    bm, clock = make()
    tree = bm.tree
    [A] = h([1, 1])
    a, wt = run(bm, clock, "a", [1, 1, 9])
    assert a.moves == ()
    assert wt == [MoveOp(A, 0, 0, 1, 0, keep_src=True)]   # device block 0 -> host slot 0, kept
    assert loc(tree, A) == (0, 0) and tree.copy_block_id(A, 1) == 0
    assert tree.num_copies(1) == 1 and tree.num_resident(1) == 0 and tree.num_evictable(1) == 1
    assert bm.take_moves() == []                          # taken once
    # evicting it from the device moves no bytes: the host copy becomes the primary
    assert tree.evict(0, 1) == []
    assert loc(tree, A) == (1, 0) and tree.copy_block_id(A, 1) is None
    assert tree.num_copies(1) == 0 and tree.num_resident(1) == 1
    assert tree.stats.free_demotions == 1 and tree.stats.copies_made == 1
    tree.check_invariants()


def test_promotion_out_of_a_write_through_tier_keeps_the_source() -> None:
    bm, clock = make()
    tree = bm.tree
    [A] = h([1, 1])
    run(bm, clock, "a", [1, 1, 9])
    tree.evict(0, 1)                                      # free demotion: A primary on the host
    a, _ = run(bm, clock, "b", [1, 1, 7])
    assert a.cached_tokens_per_tier == (0, 2)
    assert a.moves == (MoveOp(A, 1, 0, 0, 0, keep_src=True),)   # load, host slot stays a copy
    assert loc(tree, A) == (0, 0) and tree.copy_block_id(A, 1) == 0
    assert tree.evict(0, 1) == []                         # and the next demotion is free again
    assert tree.stats.free_demotions == 2


def test_copies_and_primaries_compete_by_policy_and_lock_refreshes_a_copy() -> None:
    """Host of 2 slots, LRU. Each commit copies to the host; a third copy evicts the least
    recently used host entry. A hit (lock/release) on B re-files B's copy with its new time, so
    the next victim is C's copy, not B's."""
    bm, clock = make(device=8, lower=(2,))
    A, B, C, D = (h([x, x])[0] for x in (1, 2, 3, 4))
    run(bm, clock, "a", [1, 1, 9])
    _, wt_b = run(bm, clock, "b", [2, 2, 9])
    tree = bm.tree
    dev = lambda x: tree.get(x).block_id                     # noqa: E731 - device block of x
    assert wt_b == [MoveOp(B, 0, dev(B), 1, 1, keep_src=True)]
    _, wt = run(bm, clock, "c", [3, 3, 9])
    assert wt == [MoveOp(A, 1, 0, None, None),            # A's copy is the LRU host entry
                  MoveOp(C, 0, dev(C), 1, 0, keep_src=True)]   # C's copy takes its slot
    run(bm, clock, "b2", [2, 2, 8])                       # hit on B: B's copy refreshed
    _, wt = run(bm, clock, "d", [4, 4, 9])
    assert wt == [MoveOp(C, 1, 0, None, None), MoveOp(D, 0, dev(D), 1, 0, keep_src=True)]
    assert tree.copy_block_id(B, 1) == 1 and tree.copy_block_id(A, 1) is None
    assert tree.stats.copies_dropped == 2
    # A (no copy any more) is demoted for real; B (copy kept) for free
    assert tree.evict(0, 1) == [MoveOp(B, 1, 1, None, None),  # room: LRU host entry is B's copy
                                MoveOp(A, 0, 0, 1, 1)]
    tree.check_invariants()


def test_a_host_primary_is_demoted_to_make_room_for_a_copy() -> None:
    """3 tiers, write-through to the host only. The host's LRU entry is a primary: it is
    demoted to disk (a real move) before the new copy is written into its slot."""
    bm, clock = make(device=8, lower=(1, 2), write_through=(1,))
    A, B = (h([x, x])[0] for x in (1, 2))
    run(bm, clock, "a", [1, 1, 9])
    tree = bm.tree
    assert tree.evict(0, 1) == []                         # A: device -> host, free
    _, wt = run(bm, clock, "b", [2, 2, 9])
    assert wt == [MoveOp(A, 1, 0, 2, 0), MoveOp(B, 0, tree.get(B).block_id, 1, 0, keep_src=True)]
    assert tree.get(A).tier == 2


def test_write_through_to_host_and_disk() -> None:
    bm, clock = make(device=4, lower=(2, 2), write_through=(1, 2))
    [A] = h([1, 1])
    _, wt = run(bm, clock, "a", [1, 1, 9])
    assert wt == [MoveOp(A, 0, 0, 1, 0, keep_src=True), MoveOp(A, 0, 0, 2, 0, keep_src=True)]
    tree = bm.tree
    assert tree.evict(0, 1) == [] and loc(tree, A) == (1, 0)     # onto the host copy
    assert tree.copy_block_id(A, 2) == 0                                    # disk copy stays
    assert tree.evict(1, 1) == [] and loc(tree, A) == (2, 0)     # onto the disk copy
    assert tree.num_copies(1) == tree.num_copies(2) == 0
    assert tree.stats.free_demotions == 2
    assert tree.evict(2, 1) == [MoveOp(A, 2, 0, None, None)]
    tree.check_invariants()


def test_failed_write_drops_the_copy() -> None:
    """The storage layer could not write a copy: ``drop_copy`` frees the slot, once."""
    bm, clock = make()
    [A] = h([1, 1])
    run(bm, clock, "a", [1, 1, 9])
    tree = bm.tree
    assert bm.drop_copy(A, 1) == MoveOp(A, 1, 0, None, None)
    assert tree.copy_block_id(A, 1) is None and tree.num_copies(1) == 0
    assert tree.pools[1].num_free == 2 and tree.stats.copies_dropped == 1
    assert bm.drop_copy(A, 1) is None
    assert tree.evict(0, 1) == [MoveOp(A, 0, 0, 1, 0)]   # a real demotion now
    assert bm.drop_copy(A, 1) is None                # the primary is not a copy
    tree.check_invariants()


def test_invalidate_drops_copies_before_each_node() -> None:
    bm, clock = make(device=4, lower=(2, 2), write_through=(1, 2))
    A, C = h([1, 1, 2, 2])
    run(bm, clock, "a", [1, 1, 2, 2, 9])
    tree = bm.tree
    moves = tree.invalidate(A)
    assert moves == [MoveOp(C, 1, 1, None, None), MoveOp(C, 2, 1, None, None),
                     MoveOp(C, 0, 1, None, None),
                     MoveOp(A, 1, 0, None, None), MoveOp(A, 2, 0, None, None),
                     MoveOp(A, 0, 0, None, None)]
    assert len(tree) == 0 and tree.num_copies(1) == tree.num_copies(2) == 0
    tree.check_invariants()


def test_prefetch_keeps_the_disk_copy() -> None:
    """Write-through to disk only: a host primary keeps its disk copy; a prefetch disk -> host
    keeps the file (keep_src) when no victim needs that disk slot."""
    bm, clock = make(device=4, lower=(2, 2), write_through=(2,))
    [A] = h([1, 1])
    _, wt = run(bm, clock, "a", [1, 1, 9])
    assert wt == [MoveOp(A, 0, 0, 2, 0, keep_src=True)]
    tree = bm.tree
    assert tree.evict(0, 1) == [MoveOp(A, 0, 0, 1, 0)]   # no host copy: a real move
    assert tree.copy_block_id(A, 2) == 0
    assert tree.evict(1, 1) == []                         # onto the disk copy
    assert tree.promote_lower(A, 1) == [MoveOp(A, 2, 0, 1, 0, keep_src=True)]
    assert loc(tree, A) == (1, 0) and tree.copy_block_id(A, 2) == 0
    tree.check_invariants()


def test_prefetch_gives_up_the_copy_when_a_victim_takes_its_slot() -> None:
    """Host 1 slot (holding B), disk 1 slot (holding A): B must go to disk to make room, into
    the slot A leaves, so A keeps no copy (keep_src False: the file is removed)."""
    bm, clock = make(device=4, lower=(1, 1), write_through=(2,))
    A, B = (h([x, x])[0] for x in (1, 2))
    run(bm, clock, "a", [1, 1, 9])                        # A: copy on disk slot 0
    run(bm, clock, "b", [2, 2, 9])                        # disk full: A's copy gives way to B's
    tree = bm.tree
    b = tree.get(B).block_id
    bm.drop_copy(B, 2)                        # (B's write failed)
    assert tree.evict(0, 2) == [MoveOp(A, 0, 0, 1, 0), MoveOp(A, 1, 0, 2, 0),
                                MoveOp(B, 0, b, 1, 0)]
    moves = tree.promote_lower(A, 1)
    assert moves == [MoveOp(B, 1, 0, 2, 0), MoveOp(A, 2, 0, 1, 0, keep_src=False)]
    assert tree.copy_block_id(A, 2) is None
    tree.check_invariants()


def test_recompute_adopts_and_keeps_the_host_copy() -> None:
    """A block recomputed while its twin sat on the host becomes the device primary on commit;
    the host slot stays as its copy (no bytes move)."""
    bm, clock = make(device=4, lower=(2,))
    bm.allocate("s", [1, 1, 2], NS)                      # s computes [1,1] (not committed)
    run(bm, clock, "q", [1, 1, 3])                       # q caches it, with a host copy
    A = h([1, 1])[0]
    assert bm.tree.evict(0, 1) == [] and loc(bm.tree, A)[0] == 1   # onto the copy
    assert bm.commit("s", 3) == 1
    assert bm.take_moves() == []
    assert loc(bm.tree, A) == (0, bm.block_table("s")[0])
    assert bm.tree.copy_block_id(A, 1) == 0 and bm.tree.stats.adopted == 1
    bm.check_invariants()


def test_untaken_moves_come_first_in_the_next_allocation() -> None:
    """The engine takes the write-through moves after the commits; if it did not, the next
    allocation returns them first, so running every returned list in order stays right."""
    bm, clock = make(device=2, lower=(1,))
    A, B = (h([x, x])[0] for x in (1, 2))
    bm.allocate("a", [1, 1], NS)
    bm.commit("a", 2)                                     # copy of A queued, not taken
    bm.free("a")
    a = bm.allocate("b", [2, 2], NS)
    assert a.moves == (MoveOp(A, 0, 0, 1, 0, keep_src=True),)
    bm.commit("b", 2)
    bm.free("b")
    a = bm.allocate("c", [3, 3], NS)                      # evicts A (free) to fit
    assert a.moves == (MoveOp(A, 1, 0, None, None),       # queued: B's copy needs the slot
                       MoveOp(B, 0, 1, 1, 0, keep_src=True))
    bm.check_invariants()


def test_write_back_is_unchanged() -> None:
    bm, clock = make(write_through=())
    _, wt = run(bm, clock, "a", [1, 1, 9])
    assert wt == [] and bm.tree.evict(0, 1) == [MoveOp(h([1, 1])[0], 0, 0, 1, 0)]
    assert MoveOp(b"x", 0, 0, 1, 0) == MoveOp(b"x", 0, 0, 1, 0, False)


@pytest.mark.parametrize("wt", [(0,), (2,), (1, 1), ("1",), 1, (True,)])
def test_bad_write_through_tiers(wt) -> None:
    with pytest.raises(ConfigError):
        RadixTree(2, BlockPool(2), [BlockPool(2)], write_through=wt)
