"""Minimal reproductions of bugs found in radixkv/core by the property tests and by review.

Each test states the correct behaviour. While a bug is open its test is marked
``xfail(strict=True)`` (the suite stays green; the day it is fixed the test XPASSes, which fails
the run and tells whoever fixed it to drop the marker). Fixed bugs stay as regression tests:
BUG 1 fixed in 053618a, BUGs 2 and 3 in 2028b62, BUG 5 (issue 14) with the batched commit.
"""

from __future__ import annotations

import math

import pytest
from core_helpers import FakeClock, assert_unchanged, snapshot_tree

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks
from radixkv.errors import InvalidBlockError, OutOfBlocks, RadixKVError

NS = Namespace("m")


def _bug1_state() -> BlockManager:
    # BUG 1 (found in review; fixed in 053618a):
    # commit()'s dedupe switches only the committing sequence to the cached copy of block 0,
    # while its fork sibling keeps the private duplicate of block 0 *and* the shared block 1,
    # which the commit has just cached as a child of the cached copy. The sibling then holds a
    # cached node without holding its parent.
    bm = BlockManager.create(8, block_size=2, clock=FakeClock())
    toks = [1, 1, 2, 2, 3]
    bm.allocate("s", toks, NS)                          # s computes toks, not committed yet
    bm.allocate("q", toks, NS)
    bm.commit("q", 2)                                   # q caches block 0 (its own copy)
    bm.free("q")
    bm.fork("s", "f")                                   # f shares all of s's blocks
    bm.commit("f", 4)                                   # dedupe block 0; cache shared block 1
    bm.free("f")
    return bm


def test_bug1_fork_commit_dedupe_keeps_invariants() -> None:
    """Regression (fixed in 053618a): the sibling's chain stops caching at the shared duplicate."""
    bm = _bug1_state()
    bm.check_invariants()   # was: "parent refs 0 < child refs 1"


def test_bug1_allocate_everything_available() -> None:
    """Regression: every block counted available can really be obtained (no AssertionError)."""
    bm = _bug1_state()
    n = bm.num_available_blocks
    a = bm.allocate("x", [5] * (2 * n - 1), NS)        # needs exactly n blocks
    assert len(a.block_ids) == n
    bm.check_invariants()
    with pytest.raises(OutOfBlocks):
        bm.allocate("y", [6], NS)


def _cached_chain(bm: BlockManager, toks, sid):
    bm.allocate(sid, toks, NS)
    bm.commit(sid, len(toks))
    refs = [bm.tree.device_block(b) for b in bm.block_table(sid)[: len(toks) // 2]]
    bm.free(sid)
    return [r.block_hash for r in refs]


def test_bug2_set_hints_partial() -> None:
    bm = BlockManager.create(8, block_size=2, clock=FakeClock())
    a, b = _cached_chain(bm, [1, 1, 2, 2, 3], "a")
    bm.tree.evict(0, 1)                                 # drops the leaf b
    assert bm.tree.get(b) is None
    before = snapshot_tree(bm.tree)
    with pytest.raises(InvalidBlockError):
        bm.tree.set_hints([a, b], priority=7)
    assert_unchanged(before, snapshot_tree(bm.tree), "set_hints([cached, dropped])")


@pytest.mark.parametrize("ttl", [math.nan, -5.0, math.inf * 0])
def test_bug3_set_hints_rejects_bad_ttl(ttl) -> None:
    bm = BlockManager.create(8, block_size=2, policy="ttl", clock=FakeClock())
    nodes = _cached_chain(bm, [1, 1, 2], "a")
    with pytest.raises(RadixKVError):
        bm.tree.set_hints(nodes, ttl=ttl)
    bm.check_invariants()


def test_bug3_set_hints_rejects_bad_priority() -> None:
    bm = BlockManager.create(8, block_size=2, policy="priority", clock=FakeClock())
    nodes = _cached_chain(bm, [1, 1, 2], "a")
    with pytest.raises(RadixKVError):
        bm.tree.set_hints(nodes, priority="high")


def test_bug5_fork_siblings_keep_reuse_on_dedupe() -> None:
    """BUG 5 (issue 14 review): when a fork sibling committed a block that was cached elsewhere
    while the other sibling shared its duplicate, commit() stopped caching the chain there, so
    the rest of the conversation was never reused. Now every holder switches to the cached copy
    and the chain goes on under it."""
    bm = _bug1_state()
    assert bm._seqs["s"].num_cached == 0                    # s itself never committed
    table = bm.block_table("s")
    node0 = bm.tree.device_block(table[0])
    assert node0 is not None, "the sibling's duplicate of block 0 was not switched to the copy"
    bm.free("s")
    a = bm.allocate("x", [1, 1, 2, 2, 3], NS)
    assert a.num_cached_tokens == 4                         # was 2: block 1 never cached
    bm.check_invariants()


def test_hooked_policy_demotion_into_a_full_tier_goes_block_by_block() -> None:
    """Regression (found by the tree machine after merging the policy hooks): demoting into a
    full host, the core evicted there in bulk while the host's smallest key was below the
    victim's, assuming a demoted block keeps its key. The forecast policy re-keys what leaves
    the device (``on_leave``), so the first demoted block was itself the host's next victim (it
    passes through), and the bulk path kept an older host block instead. The exact steps the
    machine found, replayed through its rules against its per-block model."""
    import test_tree_state as machines

    class _Data:
        def __init__(self, values):
            self.values = list(values)

        def draw(self, strategy, label=None):
            return self.values.pop(0)

    m = type("Tree2FORECAST", (machines.TreeMachine,),
             {"num_tiers": 2, "policy": "forecast", "write_through": ()})()
    m.setup(caps=(4, 2, 1))
    ns = Namespace("m")
    m.request(dt=0.0, end=False, hold=False, ns=ns, session=None, tokens=[0, 1, 0, 1])
    m.request(dt=1.0, end=False, hold=False, ns=ns, session=None, tokens=[2, 2, 2, 2, 1, 1, 0, 0])
    m.same_as_the_model()
    last = hash_token_blocks([2, 2, 2, 2, 1, 1, 0, 0], 2, ns)[3]   # that chain's last block
    m.invalidate(_Data([last]))
    m.same_as_the_model()
    m.evict(k=2, tier=0)
    m.same_as_the_model()
