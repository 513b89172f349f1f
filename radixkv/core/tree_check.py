"""``RadixTree.check_invariants``: every structural invariant of the tree, checked from scratch.

Kept apart from ``tree.py`` because it is long and only tests call it. Each assertion names the
numbers that disagree. Runtime complexity: O(n log n) in cached blocks; for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.core.hashing import chain_hash
from radixkv.core.node import _CBITS, _CMASK, DEVICE, MAX_TIERS, Node

if TYPE_CHECKING:
    from radixkv.core.block_manager import BlockManager
    from radixkv.core.tree import RadixTree


def check_tree(tree: RadixTree) -> None:
    """Checks, in order: every node is well formed (aligned hashes/tokens/slots, non-empty,
    chain hashes inside it and across its parent link); each node is filed under its first
    and last block, no block is cached twice, and the slot maps name exactly the nodes'
    blocks; slots are allocated and never shared between residencies; the device map and pool
    refcounts (0 for cached blocks: references live in nodes); holders (a child's holders are
    a subset of its parent's: ``parent.ref >= child.ref``); per-tier prefix closure; child
    lists and packed child counts; residency and unheld counters; copies; the evictable sets
    (exactly the evictable nodes under their current entries, plus every copy); pool usage and
    capacity; TTL hints."""
    w = tree.block_bytes
    heads, tails = tree.heads, tree.tails
    nodes: dict[int, Node] = {id(x): x for x in heads.values()}
    assert len(nodes) == len(heads) == len(tails), (
        f"{len(heads)} head entries, {len(tails)} tail entries, {len(nodes)} distinct nodes")
    index: dict[bytes, Node] = {}
    total = 0
    resident = [0] * tree.num_tiers
    unref = 0
    taken: set[tuple[int, int]] = set()
    pools = tree.pools
    for node in nodes.values():
        n = len(node.hashes)
        t = node.tier
        assert n > 0, f"{node}: empty node"
        assert len(node.slots) == n and len(node.tokens) == n * w, (
            f"{node}: {n} hashes, {len(node.slots)} slots, {len(node.tokens)} token bytes")
        assert type(node.tokens) is bytearray, f"{node}: tokens are {type(node.tokens).__name__}"
        assert 0 <= t < tree.num_tiers, f"{node}: tier {t}"
        total += n
        resident[t] += n
        assert heads.get(node.hashes[0]) is node and tails.get(node.hashes[-1]) is node, (
            f"{node}: not filed under its first and last blocks")
        for i, (h, s) in enumerate(zip(node.hashes, node.slots)):
            assert index.setdefault(h, node) is node, (
                f"{node}: block {i} ({h.hex()[:8]}) cached twice")
            assert tree.slot_nodes[t][s] is node, f"slot {s} of tier {t} not mapped to {node}"
            assert not pools[t].is_free(s), f"{node}: block {i} in free slot {s} of tier {t}"
            assert (t, s) not in taken, f"{node}: slot {s} of tier {t} shared"
            taken.add((t, s))
            if i:
                assert chain_hash(node.hashes[i - 1], bytes(node.tokens[i * w:(i + 1) * w])) == h, (
                    f"{node}: block {i}'s hash is not chain(block {i - 1}, tokens)")
            if t == DEVICE:
                assert pools[DEVICE].ref_counts[s] == 0, (
                    f"cached device block {s} has pool refcount {pools[DEVICE].ref_counts[s]}")
        if t == DEVICE:
            assert node.ref >= 0, f"{node}: negative holders"
            if node.ref == 0:
                unref += n
        else:
            assert node.ref == 0, f"{node}: held in tier {t}"
        assert node.hints is None or node.hints != type(node.hints)(), f"{node}: default hints kept"
        p = node.parent
        if p is not None:
            assert nodes.get(id(p)) is p, f"parent of {node} is not cached"
            assert p.tier <= t, f"{node} in tier {t} under parent in slower tier {p.tier}"
            assert chain_hash(p.hashes[-1], bytes(node.tokens[:w])) == node.hashes[0], (
                f"{node}: first hash is not chain(parent's last block, tokens)")
            if t == DEVICE:
                assert p.ref >= node.ref, f"parent holders {p.ref} < child holders {node.ref}"
        _check_children(node)
    assert total == len(index) == len(tree), (
        f"nodes hold {total} blocks, {len(index)} distinct, the tree counts {len(tree)}")
    counted = [tree.num_resident(t) for t in range(tree.num_tiers)]
    assert resident == counted, f"resident per tier {counted} != actual {resident}"
    assert unref == tree.num_evictable(DEVICE), (
        f"unreferenced {tree.num_evictable(DEVICE)} != actual {unref}")
    for t, sn in enumerate(tree.slot_nodes):
        assert len(sn) == pools[t].num_blocks, f"tier {t}: slot map of {len(sn)} slots"
        for b, node in enumerate(sn):
            assert node is None or (node.tier == t and nodes.get(id(node)) is node
                                    and b in node.slots), f"tier {t} slot map {b} -> {node}"
    writes = tree.writes
    copies_in = [writes.copies(u) for u in range(tree.num_tiers)]
    for u, copies in enumerate(copies_in):
        assert not copies or u in writes.tiers, (
            f"tier {u} holds {len(copies)} copies, not write-through")
        for h, slot in copies.items():
            node = index.get(h)
            assert node is not None, f"tier {u}: copy of uncached block {h.hex()}"
            assert node.tier < u, f"{node}: copy in tier {u}, not slower than its primary"
            assert not pools[u].is_free(slot), f"{node}: copy in free slot {slot} of tier {u}"
            assert (u, slot) not in taken, f"{node}: copy slot {slot} of tier {u} shared"
            taken.add((u, slot))
    for t, entries in enumerate(tree.evictable):
        entries.check_invariants()   # the index's own order
        want = sorted([entries.entry(x) for x in nodes.values()
                       if x.tier == t and entries.qualifies(x)]
                      + [(*entries.key(index[h]), h) for h in copies_in[t]])
        got = list(entries)
        assert got == want, (f"tier {t}: evictable set has {len(got)} entries, expected "
                             f"{len(want)}; first difference "
                             f"{next(((a, b) for a, b in zip(got, want) if a != b), None)}")
        pool = pools[t]
        held = resident[t] + len(copies_in[t])
        if t > DEVICE:
            used = pool.num_blocks - pool.num_free
            assert used == held, (f"tier {t}: {used} slots used, {resident[t]} resident + "
                                  f"{len(copies_in[t])} copies")
        assert held <= pool.num_blocks, f"tier {t} over capacity"
    for due, h in tree.ttl_heap:
        assert isinstance(due, float) or isinstance(due, int), f"TTL heap entry {due!r}"


def _check_children(node: Node) -> None:
    counts = [0] * MAX_TIERS
    prev = None
    c = node.child
    seen = 0
    while c is not None:
        assert c.parent is node, f"{c} is in the child list of {node} but its parent is {c.parent}"
        assert c.prev is prev, f"{c}: prev link broken"
        counts[c.tier] += 1
        prev = c
        c = c.next
        seen += 1
        assert seen <= 1 << _CBITS, f"{node}: child list loops"
    got = [(node.children >> (_CBITS * t)) & _CMASK for t in range(MAX_TIERS)]
    assert got == counts, f"{node}: packed child counts {got} != actual {counts}"


def check_manager(bm: BlockManager) -> None:
    """``BlockManager.check_invariants``: pool, tree and block tables agree. Every device
    block is exactly one of free, cached (its holders counted by its node), or held privately
    (counted by the pool); a block's count equals the number of tables holding it; each table's
    cached blocks are a prefix of it made of whole nodes, a chain from a root whose tokens are
    the sequence's own and whose first hash is its namespace's; ``last_hash`` names its block
    ``num_cached - 1``; tables cover their tokens."""
    pool, tree = bm.pool, bm.tree
    pool.check_invariants()
    tree.check_invariants()
    bs = bm.block_size
    w = tree.block_bytes
    dn = tree.device_nodes
    held = [0] * pool.num_blocks
    for sid, s in bm.sequences():
        blocks = s.blocks
        assert len(blocks) == -(-len(s.tokens) // bs), (
            f"seq {sid!r}: {len(blocks)} blocks for {len(s.tokens)} tokens")
        assert len(set(blocks)) == len(blocks), f"seq {sid!r} holds a block twice"
        assert s.num_computed <= len(s.tokens)
        assert s.num_cached <= s.num_computed // bs, (
            f"seq {sid!r}: {s.num_cached} cached blocks, {s.num_computed} computed tokens")
        c = 0
        while c < len(blocks) and dn[blocks[c]] is not None:
            c += 1
        assert all(dn[b] is None for b in blocks[c:]), f"seq {sid!r}: cached blocks not a prefix"
        assert c >= s.num_cached, f"seq {sid!r}: {s.num_cached} cached, table has {c}"
        if s.num_cached:
            node = dn[blocks[s.num_cached - 1]]
            assert node is not None and node.tier == DEVICE, f"seq {sid!r}: last hash uncached"
            assert s.last_hash in node.hashes and \
                node.slots[node.hashes.index(s.last_hash)] == blocks[s.num_cached - 1], (
                f"seq {sid!r}: last hash is not block {s.num_cached - 1}")
        else:
            assert s.last_hash is None, f"seq {sid!r}: last hash without cached blocks"
        if c:
            chain: list[Node] = []
            node = dn[blocks[c - 1]]
            assert node.slots[-1] == blocks[c - 1], f"seq {sid!r} holds part of {node}"
            while node is not None:
                chain.append(node)
                node = node.parent
            chain.reverse()
            assert [b for x in chain for b in x.slots] == blocks[:c], (
                f"seq {sid!r}: its cached blocks are not the chain of whole nodes above them")
            assert b"".join(bytes(x.tokens) for x in chain) == s.tokens[:c * bs].tobytes(), (
                f"seq {sid!r}: cached tokens differ from its own")
            assert chain_hash(s.seed, bytes(chain[0].tokens[:w])) == chain[0].hashes[0], (
                f"seq {sid!r}: its root block is not of its namespace")
        for b in blocks:
            held[b] += 1
    for b in range(pool.num_blocks):
        node = dn[b]
        refs = node.ref if node is not None else pool.ref_counts[b]
        assert refs == held[b], f"block {b}: refcount {refs} but held by {held[b]} sequences"
        free = pool.is_free(b)
        assert not (free and (node is not None or pool.ref_counts[b])), (
            f"block {b} is free but cached={node is not None} refs={pool.ref_counts[b]}")
        assert free or node is not None or pool.ref_counts[b], (
            f"block {b} leaked: not free, not cached, no references")
