"""Finding single blocks in a tree that indexes nodes, not blocks (issue 14).

The tree keeps a node's first and last block hashes and every tier's slot -> node map, nothing
per block. These properties check each way the layers above find a block against the
per-block view ``block_index()`` builds: by hash (``get``, with and without the scan of inner
blocks), by place (``block_at``, ``block_of``), by chain (``locate_chain``, ``refs_of``,
``chain_hints``), on trees grown by random shared prefixes, forks, hints and evictions into
host and disk tiers.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks
from radixkv.core.policy import DEFAULT_HINTS

NS = Namespace("lookup")
BS = 2

prompts = st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=14), min_size=1, max_size=10)


def grow(bm: BlockManager, seqs: list[list[int]], evict: int, hint: int) -> None:
    for i, toks in enumerate(seqs):
        bm.allocate(i, toks + [9], NS)
        bm.commit(i, len(toks) + 1)
        if i % 3 == 1:                       # a fork shares every block until it writes
            bm.fork(i, ("fork", i))
            bm.free(("fork", i))
        bm.free(i)
    tree = bm.tree
    if hint and seqs:
        chain = hash_token_blocks(seqs[0], BS, NS)[:hint]
        cached = [h for h in chain if tree.get(h) is not None]
        if cached == chain[:len(cached)] and cached:
            tree.set_hints(cached, ttl=60.0)
    for _ in range(evict):
        if tree.num_evictable(0):
            tree.evict(0, 1)
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(prompts, st.integers(0, 12), st.integers(0, 4))
def test_every_way_to_find_a_block_agrees_with_the_per_block_view(seqs, evict, hint) -> None:
    bm = BlockManager.create(12, block_size=BS, lower_tier_blocks=(6, 40))
    grow(bm, seqs, evict, hint)
    tree = bm.tree
    index = tree.block_index()
    assert len(index) == len(tree)
    assert tree.num_nodes() == len({id(n) for n in index.values()})
    for h, node in index.items():
        i = node.hashes.index(h)
        ref = tree.get(h)
        assert ref is not None and ref.block_hash == h and ref.tier == node.tier
        assert ref.block_id == node.block_ids[i]
        assert tree.block_at(ref.tier, ref.block_id) == ref
        assert tree.block_of(h, (ref.tier, ref.block_id)) == ref
        assert tree.block_of(h, (None, None)) == ref          # no place: by hash
        at_end = i in (0, len(node.hashes) - 1)
        assert (tree.get(h, scan=False) is not None) == at_end
        hints = DEFAULT_HINTS if node.hints is None else node.hints
        assert tree.hints(h) == hints
    for toks in seqs:
        chain = hash_token_blocks(toks, BS, NS)
        where = tree.locate_chain(chain)
        k = 0
        while k < len(chain) and chain[k] in index:
            k += 1
        # the cached prefix of a chain is what locate_chain finds, block by block
        assert [node.hashes[i] for node, i in where] == chain[:k]
        assert tree.refs_of(chain) == [tree.get(h) for h in chain]
        assert tree.chain_hints(chain) == [tree.hints(h) for h in chain]
    assert tree.get(b"\0" * 16) is None and tree.locate_chain([b"\0" * 16]) == []


def test_a_slot_that_holds_no_primary_names_no_block() -> None:
    bm = BlockManager.create(8, block_size=BS, lower_tier_blocks=(4,))
    tree = bm.tree
    bm.allocate("a", [1, 2, 3, 4, 5], NS)            # 2 full blocks + a private partial one
    blocks = bm._seqs["a"].blocks
    assert tree.block_at(0, blocks[0]) is None       # not committed yet: private
    bm.commit("a", 5)
    chain = hash_token_blocks([1, 2, 3, 4], BS, NS)
    assert [tree.block_at(0, b).block_hash for b in blocks[:2]] == chain
    assert tree.block_at(0, blocks[2]) is None       # the partial tail stays private
    bm.free("a")
    moves = tree.evict(0, 2)                         # both demoted into the host tier
    assert [m.dst_tier for m in moves] == [1, 1]
    assert all(tree.block_at(0, b) is None for b in blocks[:2])
    assert {tree.block_at(1, m.dst_block_id).block_hash for m in moves} == set(chain)
    # a MoveOp's source place is stale now: block_of finds the block where it is
    assert tree.block_of(moves[0].block_hash, (0, moves[0].src_block_id)).tier == 1
