"""RadixTree: cached KV blocks as a path-compressed radix tree, with per-tier residency and
per-block eviction in policy order.

**Nodes are runs** (``node.py``): one node holds consecutive blocks of a chain that are alike in
everything the cache tracks (tier, holders, policy key, hints), so a conversation that goes on
turn after turn is one node that grows at its end, and locking, releasing or filing it costs
O(1) however long it is. Where blocks stop being alike, a node is cut in two (``_split``): at a
divergence (another chain branches off inside it), at the end of a request's match (it holds
only a prefix), at the start of an eviction (only the tail leaves its tier), at the end of a
hinted prefix. A split re-points the index entries of the smaller side (the side that becomes
a new object), so it costs O(min(k, n - k) + children).

**Lookup.** Every cached block's chain hash maps to its node (``_index``), so the tier layer
can address any block by hash (``get``). ``match`` hashes only the first block of a request and
where it crosses from a node into a child: inside a node it compares the request's token bytes
with the node's in one ``memcmp`` (a hash collision is a miss, never a wrong block), and at a
node's end it tries the most recently linked child's first block before hashing.

**Tiers.** Tier 0 is the device (block ids from a ``BlockPool``), tiers 1.. are slower stores
(host RAM, disk) with slots from their own pools. Residency is *prefix-closed per tier
prefix*: the parent of a node in tier t is in a tier <= t, so the device set is a subtree, the
device+host set is a subtree, and the whole tree is prefix-closed. The tree's write policy
(``writes.py``: write-back, or write-through copies in chosen tiers) is a strategy object.

**References.** A device node's ``ref`` counts the live sequences holding it; each holds every
block of it (the block manager splits a node before a sequence takes part of it). A cached
device block's pool refcount is 0: its references live in its node.

**Eviction** is per block, leaf-first per tier, in the policy's order. A node is *evictable in
its tier* when it has no child node in that tier and (on the device) no holder. Each tier files
its evictable nodes in an eviction index (``evict_index.py``) under ``(*policy key, hash of the
node's last block)``: every block of a node has the node's key, so the node's tail is the
smallest of them, and evicting from it block by block (``_take``, which breaks exact ties by
block hash as a per-block cache would) is exactly per-block LRU (or LFU, ...) over the whole
tree. Evicting from tier t demotes the node's tail into tier t+1 (making room there first,
recursively) or, from the last tier, drops it. Every change of residency is a ``MoveOp`` for the
storage layer to execute *in order* before the freed slots are reused. The per-request paths
(lock, release, insert, the device-only eviction loop) live in ``request_ops.py``, the slower
tiers' operations in ``tiers.py``, the consistency check in ``tree_check.py``.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import xxhash
from radixkv.core.evict_index import EvictionIndex
from radixkv.core.hashing import TOKEN_BYTES
from radixkv.core.node import _CBITS, _CMASK, DEVICE, MAX_TIERS, BlockRef, MoveOp, Node, TreeStats
from radixkv.core.policy import DEFAULT_HINTS, EvictionPolicy, LRUPolicy, NodeHints, make_policy
from radixkv.core.pool import BlockPool
from radixkv.core.request_ops import RequestOps
from radixkv.core.tiers import TierOps
from radixkv.core.writes import TreeWrites, make_writes
from radixkv.errors import ConfigError, InvalidBlockError, OutOfBlocks

__all__ = ["DEVICE", "MAX_TIERS", "BlockRef", "MoveOp", "Node", "RadixTree", "TreeStats"]

_xxh3_128 = xxhash.xxh3_128_digest
_tuple_new = tuple.__new__
_new_node = object.__new__


class RadixTree(RequestOps, TierOps):
    """Path-compressed tree of cached blocks over one device pool and optional slower tiers.

    Args:
        block_size: tokens per block.
        device_pool: the device tier's BlockPool.
        lower_pools: pools of the slower tiers, fastest first (host, then disk), each sized
            to that tier's capacity in blocks.
        policy: eviction policy name or instance (``lru`` default, ``lfu``, ``mru``,
            ``priority``, ``ttl``).
        clock: seconds, monotonic; injected so tests can pin the eviction order.
        write_through: the tree's write policy: a ``TreeWrites`` object, or the slower tiers
            (each in ``1 .. num_tiers-1``) that get a copy of every block inserted on the
            device; empty (default) is write-back. See ``writes.py``.
    """

    def __init__(self, block_size: int, device_pool: BlockPool,
                 lower_pools: Sequence[BlockPool] = (), policy: str | EvictionPolicy = "lru",
                 clock: Callable[[], float] = time.monotonic,
                 write_through: Sequence[int] | TreeWrites = ()) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if len(lower_pools) + 1 > MAX_TIERS:
            raise ConfigError(f"at most {MAX_TIERS} tiers (device, host, disk)")
        self.block_size = block_size
        self._width = block_size * TOKEN_BYTES
        self.policy = make_policy(policy)
        self._lru = type(self.policy) is LRUPolicy  # fast path: key = (last_access,)
        #: whether the policy hears node and request events (policy.py's seam); False for
        #: LRU and the other plain key policies, which then cost nothing for it
        self._hooks = self.policy.hooks
        self.clock = clock
        self._pools: list[BlockPool] = [device_pool, *lower_pools]
        self.num_tiers = len(self._pools)
        self._index: dict[bytes, Node] = {}
        self._evictable: list[EvictionIndex] = [self.policy.new_index() for _ in self._pools]
        self._resident = [0] * self.num_tiers      # blocks (primaries) per tier
        self._unreferenced = 0                      # device blocks of unheld nodes
        self._device_nodes: list[Node | None] = [None] * device_pool.num_blocks
        self._ttl_heap: list[tuple[float, bytes]] = []   # (due, tail hash) of TTL-hinted nodes
        self._pending: list[MoveOp] = []            # write-through moves of inserts, not taken yet
        self.stats = TreeStats(self.num_tiers)
        #: Listeners (must not touch the tree; the remote tier, a fleet replica's events):
        #: blocks about to leave the cache (``BlockRef``\ s, still linked), and the hashes of
        #: blocks that entered it.
        self.drop_listener: Callable[[list[BlockRef]], None] | None = None
        self.insert_listener: Callable[[list[bytes]], None] | None = None
        self.writes: TreeWrites = make_writes(write_through).bind(self)
        self.write_through: tuple[int, ...] = self.writes.tiers
        if self._hooks:
            self.policy.bind(self)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Cached blocks (in any tier). Runtime complexity: O(1)."""
        return len(self._index)

    def num_nodes(self) -> int:
        """Nodes (runs) in the tree. Runtime complexity: O(n); for statistics."""
        return len({id(n) for n in self._index.values()})

    def get(self, block_hash: bytes) -> BlockRef | None:
        """The cached block ``block_hash`` (a snapshot), or None. O(node length)."""
        node = self._index.get(block_hash)
        if node is None:
            return None
        return self._ref(node, node.hashes.index(block_hash))

    def _ref(self, node: Node, i: int) -> BlockRef:
        w = self._width
        if i:
            parent_hash = node.hashes[i - 1]
        else:
            parent_hash = None if node.parent is None else node.parent.hashes[-1]
        return BlockRef(node.hashes[i], node.tier, node.slots[i], parent_hash,
                        bytes(node.tokens[i * w:(i + 1) * w]))

    def device_block(self, block_id: int) -> BlockRef | None:
        """The cached block in device block ``block_id`` (None: free or private)."""
        node = self._device_nodes[block_id]
        return None if node is None else self._ref(node, node.slots.index(block_id))

    def num_resident(self, tier: int = DEVICE) -> int:
        """Cached blocks resident in ``tier`` (primaries). Runtime complexity: O(1)."""
        return self._resident[tier]

    def num_evictable(self, tier: int = DEVICE) -> int:
        """Blocks of ``tier`` that eviction can free (now or after their children go).

        On the device these are the blocks of unheld nodes (their descendants are unheld too,
        since a sequence holds a whole prefix); slower tiers hold no references, so all their
        blocks are evictable, primaries and copies. Runtime complexity: O(1).
        """
        if tier == DEVICE:
            return self._unreferenced
        return self._resident[tier] + self.writes.num_copies(tier)

    def num_copies(self, tier: int) -> int:
        """Write-through copies held in ``tier``. O(1)."""
        return self.writes.num_copies(tier)

    def copy_slot(self, block_hash: bytes, tier: int) -> int | None:
        """The slot of ``block_hash``'s copy in ``tier``, or None (no copy there). O(1)."""
        if type(tier) is not int or not 0 <= tier < self.num_tiers:
            raise InvalidBlockError(f"tier must be an int in [0, {self.num_tiers}), got {tier!r}")
        return self.writes.copy_slot(block_hash, tier) if block_hash in self._index else None

    def hints(self, block_hash: bytes) -> NodeHints:
        """The eviction hints of a cached block (defaults if none were set)."""
        node = self._index.get(block_hash)
        return DEFAULT_HINTS if node is None or node.hints is None else node.hints

    def take_moves(self) -> list[MoveOp]:
        """The queued MoveOps of write-through copies made by inserts (and of the evictions
        that made room for them), in execution order; clears the queue. Run them before any
        later move. Always ``[]`` under write-back. Runtime complexity: O(1)."""
        moves = self._pending
        self._pending = []
        return moves

    def match_tokens(self, tok_bytes: bytes, seed: bytes, max_blocks: int | None = None
                     ) -> list[BlockRef]:
        """The longest cached chain of full blocks of a request, one ``BlockRef`` per block, in
        non-decreasing tier order. A pure read (changes nothing). ``tok_bytes``: the request's
        token ids (``hashing.token_bytes``); ``seed``: its namespace seed.
        Runtime complexity: O(matched blocks)."""
        path, k = self._match_path(tok_bytes, seed, max_blocks)
        out = []
        for j, node in enumerate(path):
            for i in range(k if j == len(path) - 1 else len(node.hashes)):
                out.append(self._ref(node, i))
        return out

    def match_hashes(self, tok_bytes: bytes, seed: bytes, max_blocks: int | None = None
                     ) -> list[bytes]:
        """The chain hashes of the blocks ``match_tokens`` would return (cheaper: no
        snapshot per block). A pure read. Runtime complexity: O(matched blocks)."""
        path, k = self._match_path(tok_bytes, seed, max_blocks)
        out: list[bytes] = []
        for node in path[:-1]:
            out.extend(node.hashes)
        if path:
            out.extend(path[-1].hashes[:k])
        return out

    def _match_path(self, tok: bytes, seed: bytes, max_blocks: int | None
                    ) -> tuple[list[Node], int]:
        """``(path, k)``: the nodes the request's longest cached chain crosses, root first, and
        how many blocks of the last one it uses (``1 <= k <= len``); ``([], 0)`` if none.

        A pure read. Hashes only the first block and each block that starts a child node not
        found by its tokens; inside a node, compares the node's token bytes with the request's.
        Runtime complexity: O(matched blocks) byte comparisons, O(nodes crossed) hashes.
        """
        w = self._width
        n = len(tok) // w
        if max_blocks is not None and max_blocks < n:
            n = max_blocks
        if n <= 0:
            return [], 0
        h = _xxh3_128(seed + tok[:w])
        node = self._index.get(h)
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
                while k < avail and tokens[k * w:(k + 1) * w] == tok[start + k * w:start + (k + 1) * w]:
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
                c = self._index.get(h)
                if c is None or c.parent is not node or c.hashes[0] != h:
                    return path, L
            path.append(c)
            node = c

    # ------------------------------------------------------------------ structure
    def _split(self, node: Node, k: int) -> tuple[Node, Node]:
        """Cut ``node`` into its blocks ``[0, k)`` and ``[k, n)`` (``0 < k < n``), the second
        the only child of the first; both keep the node's tier, holders, key and hints. One of
        them is ``node`` itself: whichever side has fewer index entries (and, for the tail,
        children) to re-point stays, the other is a new object. Returns ``(head, tail)``.

        The evictable sets need no change: the tail keeps the node's last block (so its entry,
        if it has one, names it), and the head has a child in its own tier (not a leaf).
        Runtime complexity: O(min(k, n - k) + children).
        """
        n = len(node.hashes)
        assert 0 < k < n, f"split of {node} at {k}"
        w, t = self._width, node.tier
        c = node.children
        nkids = (c & _CMASK) + ((c >> _CBITS) & _CMASK) + ((c >> 2 * _CBITS) & _CMASK)
        new = _new_node(Node)
        new.tier, new.ref, new.last_access, new.hits, new.hints, new.aux = (
            t, node.ref, node.last_access, node.hits, node.hints, node.aux)
        index = self._index
        if n - k + nkids <= k:        # the tail becomes the new object
            head, tail = node, new
            tail.hashes = node.hashes[k:]
            del node.hashes[k:]
            tail.tokens = node.tokens[k * w:]
            del node.tokens[k * w:]
            tail.slots = node.slots[k:]
            del node.slots[k:]
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
            head.slots = node.slots[:k]
            del node.slots[:k]
            p = node.parent
            head.parent, head.prev, head.next = p, node.prev, node.next
            if head.prev is not None:
                head.prev.next = head
            elif p is not None:
                p.child = head
            if head.next is not None:
                head.next.prev = head
            head.children, head.child = 1 << (_CBITS * t), node
            node.parent, node.prev, node.next = head, None, None
            moved = head
        for h in moved.hashes:
            index[h] = moved
        if t == DEVICE:
            dn = self._device_nodes
            for b in moved.slots:
                dn[b] = moved
        self.stats.splits += 1
        hints = head.hints
        if hints is not None and hints.ttl is not None:
            heapq.heappush(self._ttl_heap, (head.last_access + hints.ttl, head.hashes[-1]))
        return head, tail

    def _cut(self, path: list[Node], k: int) -> list[Node]:
        """``path`` with its last node cut after its first ``k`` blocks (the rest becomes its
        child): the nodes a request's match covers exactly."""
        last = path[-1]
        if k < len(last.hashes):
            path = path[:-1]
            path.append(self._split(last, k)[0])
        return path

    def _node_ending_at(self, block_hash: bytes) -> Node:
        """The node whose *last* block is ``block_hash`` (cached), splitting after it if it
        sits inside its node: the parent to hang a new node from."""
        node = self._index[block_hash]
        i = node.hashes.index(block_hash)
        if i + 1 < len(node.hashes):
            node = self._split(node, i + 1)[0]
        return node

    def _coalesce(self, parent: Node | None, child: Node) -> Node:
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
                or self._key(parent) != self._key(child)):
            return child
        index = self._index
        dn = self._device_nodes if child.tier == DEVICE else None
        hits = max(parent.hits, child.hits)
        if len(parent.hashes) <= len(child.hashes):   # child absorbs parent at its front
            for h in parent.hashes:
                index[h] = child
            if dn is not None:
                for b in parent.slots:
                    dn[b] = child
            child.hashes[0:0] = parent.hashes
            child.tokens[0:0] = parent.tokens
            child.slots[0:0] = parent.slots
            g = parent.parent
            child.parent, child.prev, child.next = g, parent.prev, parent.next
            if child.prev is not None:
                child.prev.next = child
            elif g is not None:
                g.child = child
            if child.next is not None:
                child.next.prev = child
            merged = child
        else:                                          # parent absorbs child at its end
            for h in child.hashes:
                index[h] = parent
            if dn is not None:
                for b in child.slots:
                    dn[b] = parent
            parent.hashes.extend(child.hashes)
            parent.tokens += child.tokens
            parent.slots.extend(child.slots)
            parent.children, parent.child = child.children, child.child
            kid = child.child
            while kid is not None:
                kid.parent = parent
                kid = kid.next
            merged = parent
        merged.hits = hits
        return merged

    def _link(self, parent: Node, node: Node) -> None:
        """Make ``node`` the first child of ``parent`` (counts and the parent's filing kept)."""
        node.parent, node.prev = parent, None
        first = parent.child
        node.next = first
        if first is not None:
            first.prev = node
        parent.child = node
        self._add_child_count(parent, node.tier, 1)

    def _unlink(self, node: Node) -> None:
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
        self._add_child_count(parent, node.tier, -1)   # type: ignore[arg-type]

    def _add_child_count(self, parent: Node, tier: int, delta: int) -> None:
        shift = _CBITS * tier
        if parent.tier == tier:
            before = (parent.children >> shift) & _CMASK
            if (before == 0) != (before + delta == 0):
                # the parent's own-tier count crosses zero: re-file it around the change
                self._discard(parent)
                parent.children += delta << shift
                self._consider(parent)
                return
        parent.children += delta << shift
        assert parent.children >= 0 and (parent.children >> shift) & _CMASK <= _CMASK, parent

    # ------------------------------------------------------------------ evictable sets
    def _key(self, node: Node) -> tuple:
        """The policy key of every block of ``node``."""
        if self._lru:
            return (node.last_access,)
        return self.policy.key(node, DEFAULT_HINTS if node.hints is None else node.hints)

    def _entry(self, node: Node) -> tuple:
        """Index entry of an evictable node: its key plus its last block's hash (unique)."""
        if self._lru:
            return (node.last_access, node.hashes[-1])
        return (*self.policy.key(node, DEFAULT_HINTS if node.hints is None else node.hints),
                node.hashes[-1])

    def _is_evictable(self, node: Node) -> bool:
        t = node.tier
        if (node.children >> (_CBITS * t)) & _CMASK:
            return False
        return t != DEVICE or node.ref == 0

    def _discard(self, node: Node) -> None:
        """Take ``node`` out of its tier's evictable set if it is there (before a mutation)."""
        if self._is_evictable(node):
            self._evictable[node.tier].remove(self._entry(node))

    def _consider(self, node: Node) -> None:
        """Put ``node`` into its tier's evictable set if it qualifies (after a mutation)."""
        if self._is_evictable(node):
            self._evictable[node.tier].add(self._entry(node))

    # ------------------------------------------------------------------ insertion
    def insert(self, parent_hash: bytes | None, block_hash: bytes, tokens: bytes,
               block_id: int, now: float | None = None) -> BlockRef:
        """Cache device block ``block_id`` (whose KV is computed) right after cached block
        ``parent_hash`` (None: a root). One block at a time: the block manager's commit path
        is ``insert_run``.

        The block's holders (its pool refcount) move into the tree; they must hold the parent
        too. Raises InvalidBlockError (changing nothing) if the hash or the block is already
        cached, the block is free, the parent is not cached on the device or has fewer
        holders, or the tokens are not one block. Runtime complexity: O(1) (+ a cut of the
        parent's node, + write-through copies).
        """
        pool = self._pools[DEVICE]
        if block_hash in self._index:
            raise InvalidBlockError(f"block {block_hash.hex()[:16]} is already cached")
        if type(block_id) is not int or not 0 <= block_id < pool.num_blocks:
            raise InvalidBlockError(f"block id {block_id!r} is outside [0, {pool.num_blocks})")
        if self._device_nodes[block_id] is not None:
            raise InvalidBlockError(f"device block {block_id} already caches another hash")
        if pool.is_free(block_id):
            raise InvalidBlockError(f"device block {block_id} is free; allocate it first")
        parent = None
        ref = pool.ref_counts[block_id]
        if parent_hash is not None:
            parent = self._index.get(parent_hash)
            if parent is None or parent.tier != DEVICE:
                raise InvalidBlockError("the parent of a new block must be cached on the device")
            if parent.ref < ref:
                raise InvalidBlockError(f"block {block_id} has {ref} holders, its parent only "
                                        f"{parent.ref}: a block's holders hold its parent")
        if len(tokens) != self._width:
            raise InvalidBlockError(f"a block holds {self.block_size} tokens, got "
                                    f"{len(tokens) // TOKEN_BYTES}")
        if parent is not None:
            parent = self._node_ending_at(parent_hash)   # type: ignore[arg-type]
        node, i = self._attach(parent, [block_hash], bytes(tokens), [block_id], ref,
                               self.clock() if now is None else now)
        return self._ref(node, i)

    # ------------------------------------------------------------------ eviction
    def evict(self, tier: int, num_blocks: int) -> list[MoveOp]:
        """Evict ``num_blocks`` blocks from ``tier`` in policy order, leaves first.

        Device evictions free device blocks into the device pool. Each victim is demoted into
        the next tier (room is made there first, recursively; onto its copy there, if it has
        one, moving nothing) or, from the last tier, dropped; a victim that is a copy is
        dropped. Queued write-through moves come first in the result.
        All-or-nothing: raises OutOfBlocks, changing nothing, if fewer blocks are evictable.
        Runtime complexity: O(num_blocks) per tier of the cascade (+ O(log n) per victim node
        for index types other than LRU's).
        """
        if type(tier) is not int or not 0 <= tier < self.num_tiers:
            raise InvalidBlockError(f"tier must be an int in [0, {self.num_tiers}), got {tier!r}")
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidBlockError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        available = self.num_evictable(tier)
        if num_blocks > available:
            raise OutOfBlocks(num_blocks, self._pools[tier].num_free, available,
                              "every cached block of this tier is in use by a live sequence")
        moves = self._pending    # queued write-through moves run first
        self._pending = []
        if num_blocks:
            self._evict_from(tier, num_blocks, moves)
        return moves

    def _evict_from(self, tier: int, num: int, moves: list[MoveOp]) -> None:
        """Evict ``num`` blocks of ``tier`` (they are evictable), victim by victim."""
        if tier == DEVICE and self._evict_device_fast(num, moves):
            return
        entries = self._evictable[tier]
        index = self._index
        while num > 0:
            e = entries.pop_min()
            h = e[-1]
            node = index[h]
            if node.tier != tier:       # a write-through copy of a faster block
                self.writes.drop_popped_copy(h, tier, moves)
                num -= 1
                continue
            take = self._take(node, num, e, entries)
            num -= self._move_tail_out(node, take, moves)

    @staticmethod
    def _take(node: Node, num: int, e: tuple, entries: EvictionIndex) -> int:
        """How many blocks of the victim ``node`` (popped as entry ``e``) go now: all of them,
        or the ``num`` still wanted; where another entry has exactly the same key, only those
        that a per-block cache would take before it (block hash order breaks the tie)."""
        n = len(node.hashes)
        take = n if num >= n else num
        if take > 1 and entries:
            m = entries.min()
            if m[:-1] == e[:-1]:
                key, hashes = e[:-1], node.hashes
                j = 1
                while j < take and (*key, hashes[n - 1 - j]) < m:
                    j += 1
                return j
        return take

    def _move_tail_out(self, node: Node, take: int, moves: list[MoveOp]) -> int:
        """The last ``take`` blocks of ``node`` (an evictable node already out of its index)
        leave its tier: demoted into the next one, or dropped from the last. Returns how many
        left.

        Drops, and demotions into a tier with a free slot for each block, move all ``take``
        blocks at once. A demotion into a tier that must evict to make room moves one block:
        a per-block cache would make room for each block in turn, and the block demoted just
        before may then be that tier's next victim (a chain whose key is below everything
        there passes through it), so batching would change which blocks stay. The caller's
        loop comes back for the next block, in policy order; the blocks coalesce into one run
        again as they arrive."""
        t = node.tier
        n = len(node.hashes)
        if t + 1 == self.num_tiers:
            if self._hooks:
                self.policy.on_leave(node, take)
            if take == n:
                self._drop_node(node, moves)
            else:
                self._drop_tail(node, take, moves)
            return take
        u = t + 1
        free = self._pools[u].num_free
        if take > free:
            copy_slot = self.writes.copy_slot
            need = take - sum(1 for h in node.hashes[n - take:] if copy_slot(h, u) is not None)
            if need > free:
                take = 1
        if self._hooks:
            self.policy.on_leave(node, take)
        if take < n:
            node = self._split(node, n - take)[1]
        self._demote(node, u, moves)
        return take

    def _demote(self, node: Node, u: int, moves: list[MoveOp]) -> None:
        """Move every block of ``node`` (out of its index) one tier down into ``u``, onto its
        copies there if it has any (free demotions), making room in ``u`` first."""
        t = node.tier
        hashes, old = node.hashes, node.slots
        n = len(hashes)
        reuse = self.writes.take_for_demotion(node, u)
        need = n if reuse is None else sum(1 for s in reuse if s is None)
        dst = self._pools[u]
        short = need - dst.num_free
        if short > 0:
            self._evict_from(u, short, moves)
        new: list[int] = [0] * n
        for i in range(n - 1, -1, -1):
            s = None if reuse is None else reuse[i]
            if s is None:
                s = dst.allocate_one()
                moves.append(_tuple_new(MoveOp, (hashes[i], t, old[i], u, s, False)))
            else:
                self.stats.free_demotions += 1
            new[i] = s
        src = self._pools[t]
        for s in reversed(old):
            src.free_one(s)
        if t == DEVICE:
            dn = self._device_nodes
            for s in old:
                dn[s] = None
            self._unreferenced -= n
        node.slots = new
        node.tier = u
        parent = node.parent
        if parent is not None:
            self._add_child_count(parent, t, -1)
            self._add_child_count(parent, u, 1)
        self._resident[t] -= n
        self._resident[u] += n
        self.stats.evicted[t] += n
        self.stats.demoted_in[u] += n
        self._consider(node)
        kid = node.child
        if kid is not None and kid.next is None and kid.tier == u:
            self._coalesce(node, kid)   # back onto its own tail demoted before

    def _drop_tail(self, node: Node, take: int, moves: list[MoveOp]) -> None:
        """The last ``take`` blocks of ``node`` (an evictable leaf of the last tier, out of its
        index, with no children) leave the cache; the rest stays, filed under its new tail."""
        t = node.tier
        cut = len(node.hashes) - take
        if self.drop_listener is not None:
            self.drop_listener([self._ref(node, i) for i in range(len(node.hashes) - 1, cut - 1, -1)])
        self._free_blocks(node, cut, moves)
        del node.hashes[cut:]
        del node.tokens[cut * self._width:]
        del node.slots[cut:]
        self.stats.evicted[t] += take
        self._consider(node)
        hints = node.hints
        if hints is not None and hints.ttl is not None:
            heapq.heappush(self._ttl_heap, (node.last_access + hints.ttl, node.hashes[-1]))

    def _drop_node(self, node: Node, moves: list[MoveOp]) -> None:
        """``node`` (out of its index, with no children) leaves the cache."""
        assert node.children == 0 and node.child is None, f"dropping {node} would orphan children"
        if self.drop_listener is not None:
            self.drop_listener([self._ref(node, i) for i in range(len(node.hashes) - 1, -1, -1)])
        self._free_blocks(node, 0, moves)
        if node.parent is not None:
            self._unlink(node)
        self.stats.evicted[node.tier] += len(node.hashes)

    def _free_blocks(self, node: Node, cut: int, moves: list[MoveOp]) -> None:
        """Unindex and free blocks ``[cut, n)`` of ``node`` (deepest first), emitting drops
        (none for a device-only tree: see ``_evict_device_fast``). The node's lists are left
        to the caller."""
        t = node.tier
        hashes, slots = node.hashes, node.slots
        index, pool = self._index, self._pools[t]
        dn = self._device_nodes if t == DEVICE else None
        report = self.num_tiers > 1
        for i in range(len(hashes) - 1, cut - 1, -1):
            h, s = hashes[i], slots[i]
            del index[h]
            pool.free_one(s)
            if dn is not None:
                dn[s] = None
            if report:
                moves.append(_tuple_new(MoveOp, (h, t, s, None, None, False)))
        k = len(hashes) - cut
        self._resident[t] -= k
        if t == DEVICE:
            self._unreferenced -= k
        self.stats.dropped += k

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers that disagree, if any tree invariant fails
        (see ``tree_check.py``). Runtime complexity: O(n log n); for tests."""
        from radixkv.core.tree_check import check_tree

        check_tree(self)
