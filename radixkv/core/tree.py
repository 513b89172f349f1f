"""RadixTree: cached KV blocks as a path-compressed radix tree, with per-tier residency and
per-block eviction in policy order.

**Nodes are runs** (``node.py``): one node holds consecutive blocks of a chain that are alike in
everything the cache tracks (tier, holders, policy key, hints), so a conversation that goes on
turn after turn is one node that grows at its end, and locking, releasing or filing it costs
O(1) however long it is. Where blocks stop being alike, a node is cut in two (``split``): at a
divergence (another chain branches off inside it), at the end of a request's match (it holds
only a prefix), at the start of an eviction (only the tail leaves its tier), at the end of a
hinted prefix. A split re-points the index entries of the smaller side (the side that becomes
a new object), so it costs O(min(k, n - k) + children).

**Lookup: one index entry per node, not per block.** ``heads`` maps each node's first block's chain
hash to the node, ``tails`` its last block's; ``block_nodes[t][block_id]`` maps a block id of tier
``t`` to the node whose primary block it holds. That is all ``match`` (a root's first block, a
child's first block), eviction (a victim is filed under its last block), TTL expiry (the same) and
the tier layer (a ``MoveOp``'s ``(tier, block_id)``) need, so a cached block costs no dict entry
and no Python object of its own, and evicting one deletes nothing from a hash table. A block inside
a node is found by its chain (``locate_chain``: from a root, node by node) or, for the rare caller
that has only its hash (``get`` of an inner block: fault handling, tests), by a scan of the nodes
(``find``, O(cached blocks)). ``match`` hashes only the first block of a request and where it
crosses from a node into a child: inside a node it compares the request's token bytes with the
node's in one ``memcmp`` (a hash collision is a miss, never a wrong block), and at a node's end it
tries the most recently linked child's first block before hashing.

**Tiers.** Tier 0 is the device (block ids from a ``BlockPool``), tiers 1.. are slower stores
(host RAM, disk) with block_ids from their own pools. Residency is *prefix-closed per tier
prefix*: the parent of a node in tier t is in a tier <= t, so the device set is a subtree, the
device+host set is a subtree, and the whole tree is prefix-closed. The tree's write policy
(``writes.py``: write-back, or write-through copies in chosen tiers) is a strategy object.

**References.** A device node's ``ref`` counts the live sequences holding it; each holds every
block of it (the block manager splits a node before a sequence takes part of it). A cached
device block's pool refcount is 0: its references live in its node.

**Eviction** is per block, leaf-first per tier, in the policy's order. A node is *evictable in
its tier* when it has no child node in that tier and (on the device) no holder. Each tier files
its evictable nodes in its ``EvictableSet`` (``evictable.py``: an eviction index under
``(*policy key, hash of the node's last block)``): every block of a node has the node's key, so
the node's tail is the smallest of them, and evicting from it block by block
(``EvictableSet.take``, which breaks exact ties by block hash as a per-block cache would) is
exactly per-block LRU (or LFU, ...) over the whole tree. Evicting from tier t demotes the node's
tail into tier t+1 (making room there first,
recursively) or, from the last tier, drops it. Every change of residency is a ``MoveOp`` for the
storage layer to execute *in order* before the freed block_ids are reused; the tree's
``MovePlanner`` (``move_planner.py``, ``tree.planner``) plans them all: eviction, demotion,
promotion, prefetch, invalidation, TTL expiry. This class keeps the structure: nodes and their
maps, match and insert, cutting and merging runs, the per-request paths (lock, release, insert),
single-block lookups, hints, and the KV event queue (``events.py``). The consistency check is
``RadixTree.check_invariants``.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import cast

import xxhash
from radixkv.core.evictable import EvictableSet
from radixkv.core.events import BlockRemoved, BlockStored, KVEventQueue
from radixkv.core.hashing import TOKEN_BYTES, BlockHash, chain_hash
from radixkv.core.node import (
    _CBITS, _CMASK, DEVICE, MAX_TIERS, BlockRef, MoveOp, Node, TreeStats,
)
from radixkv.core.policy import DEFAULT_HINTS, EvictionPolicy, LRUPolicy, NodeHints
from radixkv.core.policy_registry import DEFAULT_POLICY, make_policy
from radixkv.core.pool import BlockId, BlockPool
from radixkv.core.move_planner import MovePlanner
from radixkv.core.writes import TreeWrites, make_writes
from radixkv.errors import ConfigError, InvalidBlockError

__all__ = ["DEVICE", "MAX_TIERS", "BlockRef", "MoveOp", "Node", "RadixTree", "TreeStats"]

#: xxh3-128 of bytes, typed as what it makes here: a chain hash (``hashing.chain_hash``'s
#: arithmetic, inlined on the hot paths)
_xxh3_128 = cast("Callable[[bytes], BlockHash]", xxhash.xxh3_128_digest)
_tuple_new = tuple.__new__
_new_node = object.__new__


class RadixTree:
    """Path-compressed tree of cached blocks over one device pool and optional slower tiers.

    Args:
        block_size: tokens per block.
        device_pool: the device tier's BlockPool.
        lower_pools: pools of the slower tiers, fastest first (host, then disk), each sized
            to that tier's capacity in blocks.
        policy: eviction policy name or instance (``radixkv.core.policy_registry.POLICIES``; default
            ``auto``: LRU until a client sends a session-end hint, then ``forecast``).
        clock: seconds, monotonic; injected so tests can pin the eviction order.
        write_through: the tree's write policy: a ``TreeWrites`` object, or the slower tiers
            (each in ``1 .. num_tiers-1``) that get a copy of every block inserted on the
            device; empty (default) is write-back. See ``writes.py``.

    Structure the other core parts read (the block manager's hot paths, the write and
    eviction policies, ``check_invariants``); only the tree's own methods change them:
    ``pools[t]`` (tier t's ``BlockPool``), ``heads`` / ``tails`` (a node's first / last
    block's hash -> node), ``block_nodes[t][block_id]`` (the node whose primary block is in that
    block_id; ``device_nodes`` is tier 0's), ``evictable[t]`` (tier t's ``EvictableSet``),
    ``pending_moves`` (write-through moves queued by inserts; the write policy appends),
    ``block_bytes`` (token bytes per block), ``hooks`` (the policy hears events),
    ``ttl_heap`` (``(due, tail hash)`` of TTL-hinted nodes).
    """

    def __init__(self, block_size: int, device_pool: BlockPool,
                 lower_pools: Sequence[BlockPool] = (),
                 policy: str | EvictionPolicy = DEFAULT_POLICY,
                 clock: Callable[[], float] = time.monotonic,
                 write_through: Sequence[int] | TreeWrites = ()) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if len(lower_pools) + 1 > MAX_TIERS:
            raise ConfigError(f"at most {MAX_TIERS} tiers (device, host, disk)")
        self.block_size = block_size
        self.block_bytes = block_size * TOKEN_BYTES
        self.policy = make_policy(policy)
        self._lru = type(self.policy) is LRUPolicy  # fast path: key = (last_access,)
        #: whether the policy hears node and request events (policy.py's seam); False for
        #: LRU and the other plain key policies, which then cost nothing for it
        self.hooks = self.policy.hooks
        self.clock = clock
        self.pools: list[BlockPool] = [device_pool, *lower_pools]
        self.num_tiers = len(self.pools)
        self.heads: dict[bytes, Node] = {}         # first block's hash -> node
        self.tails: dict[bytes, Node] = {}         # last block's hash -> node
        #: per tier, its evictable blocks in policy order (``evictable.py``)
        self.evictable = [EvictableSet(t, self.policy) for t in range(self.num_tiers)]
        #: counters the tree and its planner keep: cached blocks (primaries) per tier, and
        #: device blocks of unheld nodes (``num_resident``, ``num_evictable(DEVICE)``)
        self.resident = [0] * self.num_tiers
        self.unreferenced = 0
        #: per tier, block_id -> the node whose primary block it holds (None: free, a copy, or
        #: a private device block); the device's is ``_device_nodes``
        self.block_nodes: list[list[Node | None]] = [[None] * p.num_blocks for p in self.pools]
        self.device_nodes: list[Node | None] = self.block_nodes[DEVICE]
        self.ttl_heap: list[tuple[float, bytes]] = []   # (due, tail hash) of TTL-hinted nodes
        self.pending_moves: list[MoveOp] = []            # write-through moves of inserts, not
                                                         # taken yet
        self.stats = TreeStats(self.num_tiers)
        #: KV events (``events.py``): None until someone subscribes (``event_queue()``), and
        #: then every block entering or leaving the cache is appended as a typed event
        self.events: KVEventQueue | None = None
        self.writes: TreeWrites = make_writes(write_through).bind(self)
        self.write_through: tuple[int, ...] = self.writes.tiers
        #: the tier moves (``move_planner.py``); its public methods are the tree's
        self.planner = MovePlanner(self)
        planner = self.planner
        self.evict = planner.evict
        self.evict_from = planner.evict_from
        self.evict_expired = planner.evict_expired
        self.next_expiry = planner.next_expiry
        self.promote_nodes = planner.promote_nodes
        self.promote_head_block = planner.promote_head_block
        self.adopt = planner.adopt
        self.promote_lower = planner.promote_lower
        self.insert_lower = planner.insert_lower
        self.invalidate = planner.invalidate
        if self.hooks:
            self.policy.bind(self)

    # ------------------------------------------------------------------ events
    def event_queue(self) -> KVEventQueue:
        """The tree's KV event queue (made on the first call; from then on the tree appends an
        event for every block entering or leaving the cache). Readers ``subscribe()`` to it,
        with ``snapshot=tree.snapshot_events()`` to start from the cache as it is.
        Runtime complexity: O(1)."""
        if self.events is None:
            self.events = KVEventQueue()
        return self.events

    def snapshot_events(self) -> list[BlockStored]:
        """One ``BlockStored`` per node, parents before children: the cache as it is now
        (for a reader that starts late). Runtime complexity: O(cached blocks)."""
        out: list[BlockStored] = []
        stack = [x for x in self.heads.values() if x.parent is None]
        while stack:
            node = stack.pop()
            out.append(BlockStored(tuple(node.hashes), None if node.parent is None else
                                   node.parent.hashes[-1], bytes(node.tokens), node.tier,
                                   _block_ids(node.block_ids)))
            stack.extend(node.iter_children())
        return out

    def removed_event(self, node: Node, cut: int) -> BlockRemoved:
        """The ``BlockRemoved`` of blocks ``[cut, n)`` of ``node`` (before they go)."""
        if cut:
            parent_hash: BlockHash | None = node.hashes[cut - 1]
        else:
            parent_hash = None if node.parent is None else node.parent.hashes[-1]
        return BlockRemoved(tuple(node.hashes[cut:]), parent_hash,
                            bytes(node.tokens[cut * self.block_bytes:]), node.tier)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Cached blocks (in any tier; each has one primary). Runtime complexity: O(tiers)."""
        return sum(self.resident)

    def num_nodes(self) -> int:
        """Nodes (runs) in the tree. Runtime complexity: O(1)."""
        return len(self.heads)

    def nodes(self) -> Iterator[Node]:
        """Every node (an iterator; the tree must not change meanwhile). O(nodes)."""
        return iter(self.heads.values())

    def block_ref(self, node: Node, i: int) -> BlockRef:
        w = self.block_bytes
        parent_hash: BlockHash | None
        if i:
            parent_hash = node.hashes[i - 1]
        else:
            parent_hash = None if node.parent is None else node.parent.hashes[-1]
        return BlockRef(node.hashes[i], node.tier, BlockId(node.block_ids[i]), parent_hash,
                        bytes(node.tokens[i * w:(i + 1) * w]))

    def device_block(self, block_id: BlockId) -> BlockRef | None:
        """The cached block in device block ``block_id`` (None: free or private)."""
        node = self.device_nodes[block_id]
        return None if node is None else self.block_ref(node, node.block_ids.index(block_id))

    def num_resident(self, tier: int = DEVICE) -> int:
        """Cached blocks resident in ``tier`` (primaries). Runtime complexity: O(1)."""
        return self.resident[tier]

    def num_evictable(self, tier: int = DEVICE) -> int:
        """Blocks of ``tier`` that eviction can free (now or after their children go).

        On the device these are the blocks of unheld nodes (their descendants are unheld too,
        since a sequence holds a whole prefix); slower tiers hold no references, so all their
        blocks are evictable, primaries and copies. Runtime complexity: O(1).
        """
        if tier == DEVICE:
            return self.unreferenced
        return self.resident[tier] + self.writes.num_copies(tier)

    def num_copies(self, tier: int) -> int:
        """Write-through copies held in ``tier``. O(1)."""
        return self.writes.num_copies(tier)

    def copy_block_id(self, block_hash: BlockHash, tier: int) -> int | None:
        """The block_id of ``block_hash``'s copy in ``tier``, or None (no copy there). O(1)."""
        if type(tier) is not int or not 0 <= tier < self.num_tiers:
            raise InvalidBlockError(f"tier must be an int in [0, {self.num_tiers}), got {tier!r}")
        return self.writes.copy_block_id(block_hash, tier)

    def take_moves(self) -> list[MoveOp]:
        """The queued MoveOps of write-through copies made by inserts (and of the evictions
        that made room for them), in execution order; clears the queue. Run them before any
        later move. Always ``[]`` under write-back. Runtime complexity: O(1)."""
        moves = self.pending_moves
        self.pending_moves = []
        return moves

    def match_tokens(self, tok_bytes: bytes, seed: bytes, max_blocks: int | None = None
                     ) -> list[BlockRef]:
        """The longest cached chain of full blocks of a request, one ``BlockRef`` per block, in
        non-decreasing tier order. A pure read (changes nothing). ``tok_bytes``: the request's
        token ids (``hashing.token_bytes``); ``seed``: its namespace seed.
        Runtime complexity: O(matched blocks)."""
        path, k = self.match_path(tok_bytes, seed, max_blocks)
        out = []
        for j, node in enumerate(path):
            for i in range(k if j == len(path) - 1 else len(node.hashes)):
                out.append(self.block_ref(node, i))
        return out

    def match_hashes(self, tok_bytes: bytes, seed: bytes, max_blocks: int | None = None
                     ) -> list[bytes]:
        """The chain hashes of the blocks ``match_tokens`` would return (cheaper: no
        snapshot per block). A pure read. Runtime complexity: O(matched blocks)."""
        path, k = self.match_path(tok_bytes, seed, max_blocks)
        out: list[bytes] = []
        for node in path[:-1]:
            out.extend(node.hashes)
        if path:
            out.extend(path[-1].hashes[:k])
        return out

    def match_path(self, tok: bytes, seed: bytes, max_blocks: int | None
                    ) -> tuple[list[Node], int]:
        """``(path, k)``: the nodes the request's longest cached chain crosses, root first, and
        how many blocks of the last one it uses (``1 <= k <= len``); ``([], 0)`` if none.

        A pure read. Hashes only the first block and each block that starts a child node not
        found by its tokens; inside a node, compares the node's token bytes with the request's.
        Runtime complexity: O(matched blocks) byte comparisons, O(nodes crossed) hashes.
        """
        w = self.block_bytes
        n = len(tok) // w
        if max_blocks is not None and max_blocks < n:
            n = max_blocks
        if n <= 0:
            return [], 0
        h = _xxh3_128(seed + tok[:w])
        node = self.heads.get(h)
        if node is None or node.parent is not None or node.hashes[0] != h:
            return [], 0
        path = [node]
        pos = 0
        while True:
            L = len(node.hashes)
            avail = n - pos if n - pos < L else L
            start = pos * w
            if avail == L:
                same = node.tokens == tok[start:start + L * w]
            else:
                same = node.tokens[:avail * w] == tok[start:start + avail * w]
            if same:
                k = avail
            else:   # a divergence inside the node (or a hash collision at its first block)
                k = 0
                tokens = node.tokens
                while (k < avail
                       and tokens[k * w:(k + 1) * w] == tok[start + k * w:start + (k + 1) * w]):
                    k += 1
                if k == 0:
                    path.pop()
                    return path, (len(path[-1].hashes) if path else 0)
            pos += k
            if k < L or pos == n:
                return path, k
            chunk = tok[pos * w:pos * w + w]
            c = node.child
            if c is None or c.tokens[:w] != chunk:
                h = _xxh3_128(node.hashes[-1] + chunk)
                c = self.heads.get(h)
                if c is None or c.parent is not node or c.hashes[0] != h:
                    return path, L
            path.append(c)
            node = c

    # ------------------------------------------------------------------ insertion
    def insert(self, parent_hash: BlockHash | None, block_hash: BlockHash, tokens: bytes,
               block_id: BlockId, now: float | None = None) -> BlockRef:
        """Cache device block ``block_id`` (whose KV is computed) right after cached block
        ``parent_hash`` (None: a root). One block at a time: the block manager's commit path
        is ``insert_run``.

        The block's holders (its pool refcount) move into the tree; they must hold the parent
        too. Raises InvalidBlockError (changing nothing) if the hash or the block is already
        cached, the block is free, the parent is not cached on the device or has fewer
        holders, or the tokens are not one block. Runtime complexity: O(1) when the parent
        ends its node (+ write-through copies); a parent inside a node is found by a scan of
        the nodes and its node cut.
        """
        pool = self.pools[DEVICE]
        if block_hash in self.heads or block_hash in self.tails:
            raise InvalidBlockError(f"block {block_hash.hex()[:16]} is already cached")
        if type(block_id) is not int or not 0 <= block_id < pool.num_blocks:
            raise InvalidBlockError(f"block id {block_id!r} is outside [0, {pool.num_blocks})")
        if self.device_nodes[block_id] is not None:
            raise InvalidBlockError(f"device block {block_id} already caches another hash")
        if pool.is_free(block_id):
            raise InvalidBlockError(f"device block {block_id} is free; allocate it first")
        parent = None
        ref = pool.ref_counts[block_id]
        if parent_hash is not None:
            parent = self.find(parent_hash)
            if parent is None or parent.tier != DEVICE:
                raise InvalidBlockError("the parent of a new block must be cached on the device")
            i = parent.hashes.index(parent_hash)
            if i + 1 < len(parent.hashes) and parent.hashes[i + 1] == block_hash:
                raise InvalidBlockError(f"block {block_hash.hex()[:16]} is already cached")
            if parent.ref < ref:
                raise InvalidBlockError(f"block {block_id} has {ref} holders, its parent only "
                                        f"{parent.ref}: a block's holders hold its parent")
        if len(tokens) != self.block_bytes:
            raise InvalidBlockError(f"a block holds {self.block_size} tokens, got "
                                    f"{len(tokens) // TOKEN_BYTES}")
        if parent is not None:
            parent = self.node_ending_at(parent_hash)   # type: ignore[arg-type]
        node, i = self._attach(parent, [block_hash], bytes(tokens), [block_id], ref,
                               self.clock() if now is None else now)
        return self.block_ref(node, i)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers that disagree, if any tree invariant fails.
        Runtime complexity: O(n log n) in cached blocks; for tests (property tests call it
        after every step).

        Checks, in order: every node is well formed (aligned hashes/tokens/block ids,
        non-empty, chain hashes inside it and across its parent link); each node is filed under
        its first and last block, no block is cached twice, and the block-id maps name exactly
        the nodes' blocks; block ids are allocated and never shared between residencies; the
        device map and pool refcounts (0 for cached blocks: references live in nodes); holders
        (a child's holders are a subset of its parent's: ``parent.ref >= child.ref``); per-tier
        prefix closure; child lists and packed child counts; residency and unheld counters;
        copies; the evictable sets (exactly the evictable nodes under their current entries,
        plus every copy); pool usage and capacity; TTL hints."""
        tree = self
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
            assert len(node.block_ids) == n and len(node.tokens) == n * w, (
                f"{node}: {n} hashes, {len(node.block_ids)} block ids, "
                f"{len(node.tokens)} token bytes")
            assert type(node.tokens) is bytearray, (
                f"{node}: tokens are {type(node.tokens).__name__}")
            assert 0 <= t < tree.num_tiers, f"{node}: tier {t}"
            total += n
            resident[t] += n
            assert heads.get(node.hashes[0]) is node and tails.get(node.hashes[-1]) is node, (
                f"{node}: not filed under its first and last blocks")
            for i, (h, s) in enumerate(zip(node.hashes, node.block_ids)):
                assert index.setdefault(h, node) is node, (
                    f"{node}: block {i} ({h.hex()[:8]}) cached twice")
                assert tree.block_nodes[t][s] is node, (
                    f"block id {s} of tier {t} not mapped to {node}")
                assert not pools[t].is_free(s), f"{node}: block {i} in free block {s} of tier {t}"
                assert (t, s) not in taken, f"{node}: block id {s} of tier {t} shared"
                taken.add((t, s))
                if i:
                    tok = bytes(node.tokens[i * w:(i + 1) * w])
                    assert chain_hash(node.hashes[i - 1], tok) == h, (
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
            assert node.hints is None or node.hints != type(node.hints)(), (
                f"{node}: default hints kept")
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
        for t, sn in enumerate(tree.block_nodes):
            assert len(sn) == pools[t].num_blocks, f"tier {t}: block-id map of {len(sn)} block_ids"
            for b, owner in enumerate(sn):
                assert owner is None or (owner.tier == t and nodes.get(id(owner)) is owner
                                         and b in owner.block_ids), (
                    f"tier {t} block-id map {b} -> {owner}")
        writes = tree.writes
        copies_in = [writes.copies(u) for u in range(tree.num_tiers)]
        for u, copies in enumerate(copies_in):
            assert not copies or u in writes.tiers, (
                f"tier {u} holds {len(copies)} copies, not write-through")
            for h, block_id in copies.items():
                primary = index.get(h)
                assert primary is not None, f"tier {u}: copy of uncached block {h.hex()}"
                node = primary
                assert node.tier < u, f"{node}: copy in tier {u}, not slower than its primary"
                assert not pools[u].is_free(block_id), (
                    f"{node}: copy in free block {block_id} of tier {u}")
                assert (u, block_id) not in taken, (
                    f"{node}: copy block id {block_id} of tier {u} shared")
                taken.add((u, block_id))
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
                assert used == held, (f"tier {t}: {used} block_ids used, {resident[t]} resident + "
                                      f"{len(copies_in[t])} copies")
            assert held <= pool.num_blocks, f"tier {t} over capacity"
        for due, _ in tree.ttl_heap:
            assert isinstance(due, float) or isinstance(due, int), f"TTL heap entry {due!r}"

    # ================================================================== cutting and merging runs
    # Cutting and merging runs: the ``RadixTree``'s structural edits.
    def split(self, node: Node, k: int) -> tuple[Node, Node]:
        """Cut ``node`` into its blocks ``[0, k)`` and ``[k, n)`` (``0 < k < n``), the second
        the only child of the first; both keep the node's tier, holders, key and hints. One of
        them is ``node`` itself: whichever side has fewer block_ids (and, for the tail, children)
        to re-point stays, the other is a new object. Returns ``(head, tail)``.

        The evictable sets need no change: the tail keeps the node's last block (so its entry,
        if it has one, names it), and the head has a child in its own tier (not a leaf).
        Runtime complexity: O(min(k, n - k) + children).
        """
        n = len(node.hashes)
        assert 0 < k < n, f"split of {node} at {k}"
        w, t = self.block_bytes, node.tier
        c = node.children
        nkids = (c & _CMASK) + ((c >> _CBITS) & _CMASK) + ((c >> 2 * _CBITS) & _CMASK)
        new = _new_node(Node)
        new.tier, new.ref, new.last_access, new.hits, new.hints, new.aux = (
            t, node.ref, node.last_access, node.hits, node.hints, node.aux)
        if n - k + nkids <= k:        # the tail becomes the new object
            head, tail = node, new
            tail.hashes = node.hashes[k:]
            del node.hashes[k:]
            tail.tokens = node.tokens[k * w:]
            del node.tokens[k * w:]
            tail.block_ids = node.block_ids[k:]
            del node.block_ids[k:]
            tail.children, tail.child = c, node.child
            kid = node.child
            while kid is not None:
                kid.parent = tail
                kid = kid.next
            tail.parent, tail.next, tail.prev = node, None, None
            node.children, node.child = 1 << (_CBITS * t), tail
            moved = tail
        else:                          # the head becomes the new object
            head, tail = new, node
            head.hashes = node.hashes[:k]
            del node.hashes[:k]
            head.tokens = node.tokens[:k * w]
            del node.tokens[:k * w]
            head.block_ids = node.block_ids[:k]
            del node.block_ids[:k]
            self._take_place(node, head)
            head.children, head.child = 1 << (_CBITS * t), node
            node.parent, node.prev, node.next = head, None, None
            moved = head
        heads, tails = self.heads, self.tails
        heads[head.hashes[0]] = head
        tails[head.hashes[-1]] = head
        heads[tail.hashes[0]] = tail
        tails[tail.hashes[-1]] = tail
        sn = self.block_nodes[t]
        for b in moved.block_ids:
            sn[b] = moved
        self.stats.splits += 1
        hints = head.hints
        if hints is not None and hints.ttl is not None:
            heapq.heappush(self.ttl_heap, (head.last_access + hints.ttl, head.hashes[-1]))
        return head, tail

    def cut(self, path: list[Node], k: int) -> list[Node]:
        """``path`` with its last node cut after its first ``k`` blocks (the rest becomes its
        child): the nodes a request's match covers exactly."""
        last = path[-1]
        if k < len(last.hashes):
            path = path[:-1]
            path.append(self.split(last, k)[0])
        return path

    def node_ending_at(self, block_hash: BlockHash, near: Node | None = None) -> Node:
        """The node whose *last* block is ``block_hash`` (cached), splitting after it if it
        sits inside its node: the parent to hang a new node from. ``near``: a guess of the
        node holding it (see ``find``)."""
        node = self.tails.get(block_hash)
        if node is not None:
            return node
        node = self.find(block_hash, near)
        assert node is not None, f"block {block_hash.hex()[:16]} is not cached"
        i = node.hashes.index(block_hash)
        if i + 1 < len(node.hashes):
            node = self.split(node, i + 1)[0]
        return node

    def coalesce(self, parent: Node | None, child: Node) -> Node:
        """Merge ``child`` into ``parent`` if they are one run again: ``child`` is the only
        child, and tier, holders, hints and policy key agree (a split whose reason went away,
        e.g. a tail demoted block by block onto its own earlier part, or blocks promoted one by
        one under their parent). The side with fewer blocks is re-pointed. The eviction sets
        need no change: the merged node's last block is ``child``'s, and ``parent`` was no leaf
        of its tier. Returns the merged node (``child`` unchanged if they differ).
        Runtime complexity: O(min(len(parent), len(child))) (+ the child's children)."""
        if (parent is None or parent.child is not child or child.next is not None
                or parent.tier != child.tier or parent.ref != child.ref
                or parent.hints != child.hints or parent.aux != child.aux
                or self.evictable[0].key(parent) != self.evictable[0].key(child)):
            return child
        heads, tails = self.heads, self.tails
        sn = self.block_nodes[child.tier]
        hits = max(parent.hits, child.hits)
        del tails[parent.hashes[-1]]
        del heads[child.hashes[0]]
        if len(parent.hashes) <= len(child.hashes):   # child absorbs parent at its front
            heads[parent.hashes[0]] = child
            for b in parent.block_ids:
                sn[b] = child
            child.hashes[0:0] = parent.hashes
            child.tokens[0:0] = parent.tokens
            child.block_ids[0:0] = parent.block_ids
            self._take_place(parent, child)
            merged = child
        else:                                          # parent absorbs child at its end
            tails[child.hashes[-1]] = parent
            for b in child.block_ids:
                sn[b] = parent
            parent.hashes.extend(child.hashes)
            parent.tokens += child.tokens
            parent.block_ids.extend(child.block_ids)
            parent.children, parent.child = child.children, child.child
            kid = child.child
            while kid is not None:
                kid.parent = parent
                kid = kid.next
            merged = parent
        merged.hits = hits
        return merged

    @staticmethod
    def _take_place(old: Node, new: Node) -> None:
        """``new`` takes ``old``'s place under ``old``'s parent (same position among its
        siblings; counts unchanged: the caller keeps the tier). ``old``'s own links are left
        to the caller."""
        p = old.parent
        new.parent, new.prev, new.next = p, old.prev, old.next
        if new.prev is not None:
            new.prev.next = new
        elif p is not None:
            p.child = new
        if new.next is not None:
            new.next.prev = new

    def link(self, parent: Node, node: Node) -> None:
        """Make ``node`` the first child of ``parent`` (counts and the parent's filing kept)."""
        node.parent, node.prev = parent, None
        first = parent.child
        node.next = first
        if first is not None:
            first.prev = node
        parent.child = node
        self.add_child_count(parent, node.tier, 1)

    def unlink(self, node: Node) -> None:
        """Take ``node`` out of its parent's child list (counts and the parent's filing kept)."""
        parent = node.parent
        p, q = node.prev, node.next
        if p is None:
            parent.child = q   # type: ignore[union-attr]
        else:
            p.next = q
        if q is not None:
            q.prev = p
        node.prev = node.next = None
        self.add_child_count(parent, node.tier, -1)   # type: ignore[arg-type]

    def add_child_count(self, parent: Node, tier: int, delta: int) -> None:
        shift = _CBITS * tier
        if parent.tier == tier:
            before = (parent.children >> shift) & _CMASK
            if (before == 0) != (before + delta == 0):
                # the parent's own-tier count crosses zero: re-file it around the change
                self.evictable[parent.tier].unfile(parent)
                parent.children += delta << shift
                self.evictable[parent.tier].file(parent)
                return
        parent.children += delta << shift
        assert parent.children >= 0 and (parent.children >> shift) & _CMASK <= _CMASK, parent


    # ================================================================== finding single blocks
    # Finding single blocks in a ``RadixTree`` that indexes nodes, not blocks.
    #
    # * by its **place**, ``(tier, block_id)``: ``block_at``, ``block_of`` (a ``MoveOp``'s ends,
    # a block table's device block ids);
    # * by its **chain** from a root: ``locate_chain``, ``refs_of``, ``chain_hints`` (a prompt's
    # blocks, cache points, the remote tier's persisted prefixes), one step per block;
    # * by its **hash** when it starts or ends its node (``get(h, scan=False)``, ``find``: O(1));
    # * by its hash alone when it is inside a node: ``get``/``find`` scan the nodes, O(cached
    # blocks). Only rare paths do (fault filing, a session's end after its leaf was extended, disk
    # restore at a branch point, tests); ``near`` lets a caller that has located the node skip it.
    def block_index(self) -> dict[bytes, Node]:
        """A snapshot ``{block hash: node}`` of every cached block: O(cached blocks), built on
        each call, for tests and checks (the tree itself keeps no per-block index)."""
        return {h: node for node in self.heads.values() for h in node.hashes}

    def get(self, block_hash: BlockHash, scan: bool = True) -> BlockRef | None:
        """The cached block ``block_hash`` (a snapshot), or None. O(node length) for the first
        or last block of a node; O(cached blocks) for an inner one (``find``), or None at
        once with ``scan=False``: callers on a hot path address a block by ``(tier, block_id)``
        (``block_at``), by its chain (``locate_chain``, ``refs_of``), or know it ends or
        starts a node."""
        if scan:
            node = self.find(block_hash)
        else:
            node = self.tails.get(block_hash) or self.heads.get(block_hash)
        if node is None:
            return None
        return self.block_ref(node, node.hashes.index(block_hash))

    def find(self, block_hash: BlockHash, near: Node | None = None) -> Node | None:
        """The node holding cached block ``block_hash``, or None: ``near`` if it holds it
        (a caller's guess, e.g. from ``locate_chain``; O(its length)), else O(1) for a node's
        first or last block, else a scan of the nodes (an inner block)."""
        if near is not None and near.hashes and self.heads.get(near.hashes[0]) is near \
                and block_hash in near.hashes:
            return near
        node = self.tails.get(block_hash)
        if node is None:
            node = self.heads.get(block_hash)
            if node is None:
                for x in self.heads.values():
                    if block_hash in x.hashes:
                        return x
        return node

    def block_at(self, tier: int, block_id: BlockId) -> BlockRef | None:
        """The cached block whose primary is block ``block_id`` of ``tier`` (None: the block is
        free, a write-through copy, or a private device block). O(node length)."""
        node = self.block_nodes[tier][block_id]
        return None if node is None else self.block_ref(node, node.block_ids.index(block_id))

    def block_of(self, block_hash: BlockHash, *places: tuple[int | None, int | None]
                 ) -> BlockRef | None:
        """The cached block ``block_hash``, looked for first at the ``(tier, block_id)`` places
        given (e.g. a ``MoveOp``'s destination and source: O(node length) each), then by its
        hash (``get``, which may scan for an inner block)."""
        for tier, block_id in places:
            if tier is None or block_id is None:
                continue
            node = self.block_nodes[tier][block_id]
            if node is not None:
                i = node.block_ids.index(block_id)
                if node.hashes[i] == block_hash:
                    return self.block_ref(node, i)
        return self.get(block_hash)

    def refs_of(self, hashes: Sequence[BlockHash]) -> list[BlockRef | None]:
        """``get`` of each hash, walking runs of consecutive blocks (the next block of the
        previous one's node, or the first block of one of its children) so that a chain costs
        O(its length) and only the first block of each run is looked up by hash."""
        out: list[BlockRef | None] = []
        node, i = None, -1
        heads = self.heads
        for h in hashes:
            if node is not None:
                if i + 1 < len(node.hashes) and node.hashes[i + 1] == h:
                    i += 1
                    out.append(self.block_ref(node, i))
                    continue
                c = heads.get(h)
                if c is not None and c.parent is node and i + 1 == len(node.hashes):
                    node, i = c, 0
                    out.append(self.block_ref(node, 0))
                    continue
            node = self.find(h)
            if node is None:
                out.append(None)
                continue
            i = node.hashes.index(h)
            out.append(self.block_ref(node, i))
        return out

    def chain_hints(self, hashes: Sequence[BlockHash]) -> list[NodeHints]:
        """The hints of each block of a chain from a root (``locate_chain``); defaults past
        its cached prefix. O(len(hashes))."""
        where = self.locate_chain(hashes)
        out: list[NodeHints] = [DEFAULT_HINTS if node.hints is None else node.hints
                            for node, _ in where]
        out += [DEFAULT_HINTS] * (len(hashes) - len(where))
        return out

    def locate_chain(self, hashes: Sequence[BlockHash]) -> list[tuple[Node, int]]:
        """``(node, offset)`` of each block of the chain ``hashes`` (consecutive blocks, the
        first one a root or any block ``find`` locates), for its longest cached prefix.
        A pure read. Runtime complexity: O(len(hashes)) (+ ``find`` of the first)."""
        out: list[tuple[Node, int]] = []
        if not hashes:
            return out
        node = self.find(hashes[0])
        if node is None:
            return out
        i = node.hashes.index(hashes[0])
        for h in hashes:
            if i == len(node.hashes):
                c = self.heads.get(h)
                if c is None or c.parent is not node:
                    return out
                node, i = c, 0
            elif node.hashes[i] != h:
                return out
            out.append((node, i))
            i += 1
        return out

    def hints(self, block_hash: BlockHash) -> NodeHints:
        """The eviction hints of a cached block (defaults if none were set). O(1) for a node's
        first or last block, O(cached blocks) otherwise (``find``)."""
        node = self.find(block_hash)
        return DEFAULT_HINTS if node is None or node.hints is None else node.hints


    # ================================================================== per-request paths
    # The block manager's per-request paths through the ``RadixTree``: one pass per request.
    # ------------------------------------------------------------------ references
    def lock_nodes(self, nodes: Sequence[Node], now: float | None = None) -> None:
        """Take one reference on each (whole) device node: a sequence now holds every block
        of them. Touches them (``last_access``, ``hits``).
        Runtime complexity: O(nodes) (+ O(log n) index work per node under a ``SortedIndex``)."""
        now = self.clock() if now is None else now
        idx, writes = self.evictable[DEVICE], self.writes
        on_hit = self.policy.on_hit if self.hooks else None
        for node in nodes:
            assert node.tier == DEVICE, f"lock of {node}: promote it first"
            if node.ref == 0:
                self.unreferenced -= len(node.hashes)
                if not node.children & _CMASK:
                    idx.remove(idx.entry(node))   # leaves the index before its key changes
            refile = writes.unfile(node)
            node.ref += 1
            prev = node.last_access
            node.last_access = now
            node.hits += 1
            if on_hit is not None:
                on_hit(node, prev, now)
            if refile is not None:
                writes.refile(node, refile)

    def lock_path(self, node: Node, now: float | None = None) -> None:
        """``lock_nodes`` of ``node`` and all its ancestors (a fork's shared chain)."""
        path = []
        while node is not None:
            path.append(node)
            node = node.parent   # type: ignore[assignment]
        self.lock_nodes(path, now)

    def release_path(self, node: Node, now: float | None = None) -> None:
        """Drop one reference on ``node`` and each of its ancestors (a sequence ends): a node
        nobody holds any more is touched and becomes evictable (if a leaf).
        Runtime complexity: O(depth in nodes)."""
        now = self.clock() if now is None else now
        idx, writes = self.evictable[DEVICE], self.writes
        on_release = self.policy.on_release if self.hooks else None
        unref = 0
        while node is not None:
            r = node.ref - 1
            assert r >= 0 and node.tier == DEVICE, f"release of unheld {node}"
            if r == 0:
                refile = writes.unfile(node)
                node.ref = 0
                node.last_access = now
                if on_release is not None:
                    on_release(node, now)
                unref += len(node.hashes)
                if not node.children & _CMASK:
                    idx.add(idx.entry(node))
                if refile is not None:
                    writes.refile(node, refile)
            else:
                node.ref = r
            node = node.parent   # type: ignore[assignment]
        self.unreferenced += unref

    # ------------------------------------------------------------------ insertion
    def insert_run(self, parent: Node | None, prev_hash: bytes, tok_bytes: bytes,
                   block_ids: Sequence[BlockId], now: float, first_hash: BlockHash | None = None
                   ) -> tuple[Node | None, int]:
        """Cache consecutive computed device blocks as the continuation of ``parent``.

        ``tok_bytes`` holds the blocks' tokens (``len(block_ids)`` full blocks) and
        ``prev_hash`` is the chain hash of ``parent``'s last block (the namespace seed at the
        root). Blocks are hashed until one is already cached; those before it are inserted
        (the caller decides what to do with that one). The blocks must be uncached and held
        (pool refcount > 0: the holders' references move into the tree); the parent's last
        block must precede them and be on the device. Holders of a later block are a subset of
        an earlier one's, so blocks are grouped into nodes by refcount. ``first_hash``: the
        first block's chain hash, if the caller has it already.
        Returns ``(node holding the last inserted block, number inserted)``.
        Runtime complexity: O(blocks) (+ the write-through copies' evictions).
        """
        w = self.block_bytes
        heads = self.heads
        xxh = _xxh3_128
        hashes: list[BlockHash] = []
        append = hashes.append
        h: bytes = prev_hash
        start = 0
        if first_hash is not None:
            h = first_hash
            append(h)
            start = w
        for start in range(start, len(block_ids) * w, w):
            h = xxh(h + tok_bytes[start:start + w])
            append(h)
        if not heads.keys().isdisjoint(hashes):
            # One is cached already: a cached block's parent is cached, so only the first can
            # be (as the first block of a child of ``parent``), or a hash collides with the
            # first block of another node. Keep the ones before it.
            hashes = hashes[:next(i for i, x in enumerate(hashes) if x in heads)]
        n = len(hashes)
        if not n:
            return parent, 0
        refs = self.pools[DEVICE].ref_counts
        ids = block_ids if n == len(block_ids) else block_ids[:n]
        r0, r1 = refs[ids[0]], refs[ids[-1]]
        keys = None
        if self.policy.insert_key is not None:
            # the policy tells new blocks apart (lfu-ghost: counts restored per block)
            keys = list(map(self.policy.insert_key, hashes))
            if keys.count(keys[0]) == n:
                keys = None
        if r0 == r1 and keys is None:
            tokens = tok_bytes if len(tok_bytes) == n * w else tok_bytes[:n * w]
            attached, _ = self._attach(parent, hashes, tokens, ids, r0, now)
            return attached, n
        i = 0
        node: Node | None = parent
        made: list[tuple[Node, int]] = []
        while i < n:    # one node per holder set (fork siblings share a prefix of the blocks)
            r = refs[ids[i]]   # and per policy insert key
            j = i + 1
            while j < n and refs[ids[j]] == r and (keys is None or keys[j] == keys[i]):
                j += 1
            node, start = self._attach(node, hashes[i:j], tok_bytes[i * w:j * w], ids[i:j], r,
                                       now, False)
            made.append((node, start))
            i = j
        for x, start in made:   # write-through copies once the whole run is in (as one run's)
            self.writes.after_insert(x, start)
        return node, n

    def _attach(self, parent: Node | None, hashes: list[BlockHash], tokens: bytes,
                block_ids: Sequence[BlockId], ref: int, now: float, copies: bool = True
                ) -> tuple[Node, int]:
        """Cache uncached computed device blocks held by ``ref`` sequences (their pool
        refcounts move into the node) right after ``parent``'s last block. The blocks join
        ``parent``'s run when it is the same run (on the device, no child, held by the same
        sequences, no hints, alike for the policy); otherwise they form a new child node.
        ``copies``: make the write-through copies now (False: the caller does, once its whole
        run is in). Returns ``(node, index of the first new block in it)``.
        Runtime complexity: O(blocks)."""
        n = len(hashes)
        refs = self.pools[DEVICE].ref_counts
        assert refs[block_ids[0]] == ref == refs[block_ids[-1]] and \
            self.device_nodes[block_ids[-1]] is None, (
            f"attach of blocks {block_ids[0]}..{block_ids[-1]} held by {ref}")
        if (parent is not None and parent.child is None and parent.ref == ref and ref > 0
                and parent.hints is None and parent.tier == DEVICE
                and not (parent.hits and self.policy.fresh_counts)
                and (self.policy.insert_key is None
                     or self.policy.can_extend(parent, hashes[0]))):
            node = parent
            start = len(node.hashes)
            tails = self.tails
            del tails[node.hashes[-1]]
            tails[hashes[-1]] = node
            node.hashes.extend(hashes)
            node.tokens += tokens
            node.block_ids.extend(block_ids)
            if self.hooks:
                self.policy.on_insert(node, start, now)
        else:
            node = _new_node(Node)
            node.hashes = hashes
            node.tokens = bytearray(tokens)
            node.block_ids = array("i", block_ids)
            node.tier = DEVICE
            node.ref = ref
            node.parent = node.child = node.next = node.prev = None
            node.children = 0
            node.last_access = now
            node.hits = 0
            node.hints = None
            node.aux = None
            start = 0
            self.heads[node.hashes[0]] = node
            self.tails[node.hashes[-1]] = node
            if self.hooks:
                self.policy.on_insert(node, 0, now)
            if parent is not None:
                self.link(parent, node)
            if ref == 0:
                self.unreferenced += n
                self.evictable[node.tier].file(node)
        dn = self.device_nodes
        for b in block_ids:
            dn[b] = node
            refs[b] = 0
        self.resident[DEVICE] += n
        self.stats.inserted += n
        if copies:
            self.writes.after_insert(node, start)
        events = self.events
        if events is not None:
            events.append(BlockStored(
                tuple(hashes), node.hashes[start - 1] if start else
                (None if node.parent is None else node.parent.hashes[-1]),
                bytes(tokens), DEVICE, tuple(block_ids)))
        return node, start

    # ------------------------------------------------------------------ eviction
    def rearm_ttl(self, node: Node) -> None:
        """File ``node`` (TTL-hinted) again under its current last block and due time."""
        hints = node.hints
        assert hints is not None and hints.ttl is not None, f"{node} has no TTL hint"
        heapq.heappush(self.ttl_heap, (node.last_access + hints.ttl, node.hashes[-1]))

    # ================================================================== hints
    # Hints set by callers (priorities, TTLs), policy state changed outside a node event, and
    # marks of use: each re-files what it changes.
    # ------------------------------------------------------------------ hints
    def set_hints(self, block_hashes: Iterable[BlockHash], priority: int | None = None,
                  ttl: float | None = None) -> None:
        """Set the priority and/or TTL hints of cached blocks (e.g. a system prompt's chain).

        ``priority``: an int (higher survives longer under the priority policy); ``ttl``:
        finite seconds >= 0 after the block's last use (under any policy, see
        ``evict_expired``). Nodes are cut so that hints cover exactly the given blocks.
        All-or-nothing (all validated first). Runtime complexity: O(blocks + nodes * log n).
        """
        if priority is not None and type(priority) is not int:
            raise ConfigError(f"priority must be an int, got {priority!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                or not math.isfinite(ttl) or ttl < 0):
            raise ConfigError(f"ttl must be a finite number of seconds >= 0, got {ttl!r}")
        hashes = list(block_hashes)
        for h in hashes:
            if not isinstance(h, bytes):
                raise InvalidBlockError(f"{h!r} is not a cached block of this tree")
        # A chain (a prompt's prefix, the common case) is located in one walk; anything else
        # block by block (``find``). ``loc`` follows the cuts below.
        where = self.locate_chain(hashes)
        loc = {h: x[0] for h, x in zip(hashes, where)}
        for h in hashes[len(where):]:
            if h not in loc:
                node = self.find(h)
                if node is None:
                    raise InvalidBlockError(f"{h!r} is not a cached block of this tree")
                loc[h] = node
        wanted = set(hashes)
        done: set[int] = set()
        for h in hashes:
            node = loc[h]
            if id(node) in done:
                continue
            i = node.hashes.index(h)
            j = i + 1
            while j < len(node.hashes) and node.hashes[j] in wanted:
                j += 1
            if j < len(node.hashes):
                node, rest = self.split(node, j)
                self._relocate(rest, wanted, loc)
            if i:
                before, node = self.split(node, i)
                self._relocate(before, wanted, loc)
            self._relocate(node, wanted, loc)
            done.add(id(node))
            old = DEFAULT_HINTS if node.hints is None else node.hints
            new = NodeHints(old.priority if priority is None else priority,
                            old.ttl if ttl is None else float(ttl))
            self.evictable[node.tier].unfile(node)
            refile = self.writes.unfile(node)
            node.hints = None if new == DEFAULT_HINTS else new
            if new.ttl is not None:
                heapq.heappush(self.ttl_heap, (node.last_access + new.ttl, node.hashes[-1]))
            self.evictable[node.tier].file(node)
            if refile is not None:
                self.writes.refile(node, refile)

    @staticmethod
    def _relocate(node: Node, wanted: set[BlockHash], loc: dict[BlockHash, Node]) -> None:
        for h in node.hashes:
            if h in wanted:
                loc[h] = node

    def rekey(self, node: Node, aux: object) -> None:
        """Give ``node`` new policy state ``aux`` (the policy's decision outside any node event,
        e.g. its session ended), re-filing it (and its copies) where it is filed.
        Runtime complexity: O(log n)."""
        self.evictable[node.tier].unfile(node)
        refile = self.writes.unfile(node)
        node.aux = aux
        self.evictable[node.tier].file(node)
        if refile is not None:
            self.writes.refile(node, refile)

    def touch(self, block_hash: BlockHash, now: float | None = None, near: Node | None = None
              ) -> None:
        """Mark cached block ``block_hash`` and everything before it as used now (their policy
        keys move, as a hit's would): e.g. the parent of blocks about to be installed below
        it from the remote tier, so that making room for them does not evict it first.
        ``near``: the node holding it, if the caller located it (``locate_chain``).
        Runtime complexity: O(depth in nodes) (+ a cut of its node)."""
        now = self.clock() if now is None else now
        n: Node | None = self.node_ending_at(block_hash, near)
        while n is not None:
            self.evictable[n.tier].unfile(n)
            refile = self.writes.unfile(n)
            n.last_access = now
            self.evictable[n.tier].file(n)
            if refile is not None:
                self.writes.refile(n, refile)
            n = n.parent

    # ================================================================== policy hand-over
    def switch_policy(self, policy: str | EvictionPolicy) -> None:
        """Hand eviction to ``policy`` from now on (``auto``'s switch on the first session-end
        hint): every node's policy state starts afresh (``on_insert`` as if it had just been
        cached, at its last access) and every evictable node, and write-through copy, is
        filed again under the new key, once. Raises ConfigError, changing nothing, for a
        policy that cuts runs differently from the current one (``insert_key`` or
        ``fresh_counts``). The parts that cache the policy (each tier's ``EvictableSet``, the
        ``MovePlanner``) are told in place, so references to them stay valid.
        Runtime complexity: O(nodes) + one filing per evictable node."""
        new = make_policy(policy)
        if new.insert_key is not None or new.fresh_counts != self.policy.fresh_counts:
            raise ConfigError(f"cannot switch a {self.policy.name!r} tree to {new.name!r}: "
                              "it cuts runs differently; select it when building the tree")
        if new.hooks:
            new.bind(self)
        self.policy = new
        self._lru = type(new) is LRUPolicy
        self.hooks = new.hooks
        self.planner.use_policy(new)
        nodes = list(self.heads.values())
        for node in nodes:
            node.aux = None
        if new.hooks:
            for node in nodes:
                new.on_insert(node, 0, node.last_access)
        for ev in self.evictable:
            ev.use_policy(new)
        copies = list(self.writes.tiers)
        for node in nodes:
            self.evictable[node.tier].file(node)
            if copies:
                self.writes.refile(node, copies)


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


def _block_ids(ids: array[int] | Sequence[int]) -> tuple[BlockId, ...]:
    """A run's block ids as an event carries them (one tuple; the ids are the pool's)."""
    return cast("tuple[BlockId, ...]", tuple(ids))
