"""lfu-ghost: LFU whose counts survive a drop in a table of fingerprints (policy_ghost.py).

The per-block model of the tree state machines (test_tree_state.py) checks every key and
victim; these are the behaviours the policy is for, each one that plain LFU gets wrong."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
from core_helpers import FakeClock
from hypothesis import given, settings

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.core.policy_registry import make_policy
from radixkv.errors import ConfigError

NS = Namespace("ghost")
B = 2


def _serve(bm: BlockManager, clock: FakeClock, sid: int, tokens: list[int]) -> int:
    clock.now += 1.0
    a = bm.allocate(sid, tokens, NS)
    bm.commit(sid, len(tokens))
    bm.free(sid)
    return a.num_cached_tokens


def test_a_dropped_block_comes_back_with_its_count() -> None:
    clock = FakeClock(0.0)
    bm = BlockManager.create(4, B, policy="lfu-ghost", clock=clock)
    pol, tree = bm.tree.policy, bm.tree
    doc = [7, 7, 8, 8, 1]                       # two full blocks + a private last token
    for sid in range(3):                        # cached, then hit twice
        _serve(bm, clock, sid, doc)
    hashes = [h for h, n in tree.block_index().items()]
    assert {tree.block_index()[h].hits for h in hashes} == {2}
    _serve(bm, clock, 10, [1, 2, 3, 4, 5, 6, 0])   # three new blocks push the doc out
    assert not set(hashes) & set(tree.block_index())
    assert [pol.remembered(h) for h in hashes] == [2, 2]
    _serve(bm, clock, 11, doc)                  # recomputed: it starts at 2 + 1, not at 0
    node = tree.block_index()[hashes[0]]
    assert (node.aux, node.hits) == (3, 0) and pol.restored == 1
    assert [pol.remembered(h) for h in hashes] == [None, None]   # it left the table


def test_a_popular_block_outlives_one_offs_after_a_drop() -> None:
    """Plain LFU evicts a popular document first once it had to recompute it (count 0); with
    the ghost it keeps it and evicts the one-off that came after."""
    def run(policy: str) -> int:
        clock = FakeClock(0.0)
        bm = BlockManager.create(4, B, policy=policy, clock=clock)
        doc = [5, 5, 9]                                       # one full block, hit twice
        for sid in range(3):
            _serve(bm, clock, sid, doc)
        _serve(bm, clock, 10, [1, 1, 2, 2, 3, 3, 0])          # a long one-off drops the doc
        _serve(bm, clock, 11, doc)                            # the doc is recomputed
        for sid, one_off in enumerate(([8, 8, 0], [9, 9, 0], [6, 6, 0]), 12):
            _serve(bm, clock, sid, one_off)                   # each needs one block freed
        return _serve(bm, clock, 20, doc)                     # is the doc still there?
    assert run("lfu-ghost") == 2
    assert run("lfu") == 0


def test_a_run_is_cut_where_remembered_counts_differ() -> None:
    """Counts are per block: a new run whose blocks come back with different counts is cached
    as one node per count, and a new block joins its parent's run only with the same count."""
    clock = FakeClock(0.0)
    bm = BlockManager.create(5, B, policy="lfu-ghost", clock=clock)
    tree, pol = bm.tree, bm.tree.policy
    _serve(bm, clock, 0, [1, 1, 0])
    _serve(bm, clock, 1, [1, 1, 0])             # block [1, 1] hit once
    _serve(bm, clock, 2, [1, 1, 2, 2, 0])       # [2, 2] new after it (count 0, its own node)
    hashes = [h for h in tree.block_index()]
    _serve(bm, clock, 3, [3, 3, 4, 4, 5, 5, 6, 6, 0])     # pushes both out
    assert not set(hashes) & set(tree.block_index())
    want = {h: pol.remembered(h) for h in hashes}
    assert sorted(want.values()) == [0, 2]
    _serve(bm, clock, 4, [1, 1, 2, 2, 0])       # both recomputed in one run: two nodes
    nodes = [tree.block_index()[h] for h in hashes]
    assert nodes[0] is not nodes[1]
    assert sorted(n.aux for n in nodes) == [1, 3]
    bm.check_invariants()


def test_options_and_the_duel() -> None:
    with pytest.raises(ConfigError, match="ghost_factor"):
        make_policy("lfu-ghost", ghost_factor=-1)
    with pytest.raises(ConfigError, match="ghost_factor"):
        make_policy("lfu-ghost", ghost_factor=True)
    bm = BlockManager.create(8, B, policy=make_policy("lfu-ghost", ghost_factor=0))
    assert bm.tree.policy.insert_key is None     # no table: plain per-block LFU
    bm = BlockManager.create(8, B, lower_tier_blocks=[8, 16], policy="duel")
    pol = bm.tree.policy
    assert pol.member_names == ("lru", "lfu-ghost", "forecast")   # the default duel
    ghost = pol.members[1]
    assert ghost._mask + 1 == 128                # 4 x (8 + 8 + 16) slots, a power of two


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 40), min_size=1,
                                                         max_size=6),
                                 st.integers(0, 300)), max_size=40),
       mask_bits=st.integers(1, 5))
def test_the_table_is_ghost_slot_block_by_block(events, mask_bits) -> None:
    """The policy reads a hash's slot and fingerprint with one ``struct`` unpack (not
    ``ghost_slot``'s slices): drops and inserts of runs of blocks in a tiny table (many blocks
    per slot) leave exactly the table a block-by-block loop over ``ghost_slot`` would, and
    ``insert_key``/``can_extend`` read it the same way."""
    import hashlib

    from radixkv.core.policy_ghost import ghost_slot

    def h(i: int) -> bytes:
        return hashlib.blake2b(bytes([i]), digest_size=16).digest()

    pol = make_policy("lfu-ghost")
    pol._mask = mask = (1 << mask_bits) - 1
    pol._fp = array("H", bytes(2 * (mask + 1)))
    pol._count = bytearray(mask + 1)
    model: dict[int, tuple[int, int]] = {}     # slot -> (fingerprint, count)

    def want_key(x: bytes) -> int:
        s, f = ghost_slot(x, mask)
        return model[s][1] + 1 if s in model and model[s][0] == f else 0

    for drop, ids, count in events:
        node = SimpleNamespace(hashes=[h(i) for i in ids], aux=count, hits=count % 7, tier=0)
        if drop:
            k = 1 + count % len(ids)
            pol.on_leave(node, k)
            for x in reversed(node.hashes[len(ids) - k:]):   # deepest first
                s, f = ghost_slot(x, mask)
                model[s] = (f, min(255, count + count % 7))
        else:
            keys = [pol.insert_key(x) for x in node.hashes]
            assert keys == [want_key(x) for x in node.hashes]
            assert pol.can_extend(node, node.hashes[0]) == (count == keys[0])
            start = count % len(ids)
            node.aux = None
            pol.on_insert(node, start, 0.0)
            if start == 0:
                assert node.aux == keys[0]
            for x in node.hashes[start:]:
                s, f = ghost_slot(x, mask)
                if s in model and model[s][0] == f:
                    del model[s]
        assert {s: (pol._fp[s], pol._count[s]) for s in range(mask + 1) if pol._fp[s]} == model
