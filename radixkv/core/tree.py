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

**Lookup: one index entry per node, not per block.** ``_heads`` maps each node's first block's
chain hash to the node, ``_tails`` its last block's; ``_slot_nodes[t][slot]`` maps a slot of tier
``t`` to the node whose primary block it holds. That is all ``match`` (a root's first block, a
child's first block), eviction (a victim is filed under its last block), TTL expiry (the same)
and the tier layer (a ``MoveOp``'s ``(tier, slot)``) need, so a cached block costs no dict entry
and no Python object of its own, and evicting one deletes nothing from a hash table. A block
inside a node is found by its chain (``locate_chain``: from a root, node by node) or, for the
rare caller that has only its hash (``get`` of an inner block: fault handling, tests), by a scan
of the nodes (``_find``, O(cached blocks)). ``match`` hashes only the first block of a request
and where it crosses from a node into a child: inside a node it compares the request's token
bytes with the node's in one ``memcmp`` (a hash collision is a miss, never a wrong block), and at
a node's end it tries the most recently linked child's first block before hashing.

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
tiers' operations in ``tiers.py``, cutting and merging runs in ``runs.py``, eviction in
``eviction.py``, hints and TTL expiry in ``hints.py``, the consistency check in
``tree_check.py``, finding single blocks in ``lookup.py``.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import xxhash
from radixkv.core.evict_index import EvictionIndex
from radixkv.core.hashing import TOKEN_BYTES
from radixkv.core.node import _CBITS, _CMASK, DEVICE, MAX_TIERS, BlockRef, MoveOp, Node, TreeStats
from radixkv.core.policy import (
    DEFAULT_HINTS, DEFAULT_POLICY, EvictionPolicy, LRUPolicy, make_policy,
)
from radixkv.core.pool import BlockPool
from radixkv.core.eviction import EvictionOps
from radixkv.core.hints import HintOps
from radixkv.core.lookup import LookupOps
from radixkv.core.request_ops import RequestOps
from radixkv.core.runs import RunOps
from radixkv.core.tiers import TierOps
from radixkv.core.writes import TreeWrites, make_writes
from radixkv.errors import ConfigError, InvalidBlockError

__all__ = ["DEVICE", "MAX_TIERS", "BlockRef", "MoveOp", "Node", "RadixTree", "TreeStats"]

_xxh3_128 = xxhash.xxh3_128_digest
_tuple_new = tuple.__new__
_new_node = object.__new__


class RadixTree(LookupOps, RunOps, EvictionOps, RequestOps, TierOps, HintOps):
    """Path-compressed tree of cached blocks over one device pool and optional slower tiers.

    Args:
        block_size: tokens per block.
        device_pool: the device tier's BlockPool.
        lower_pools: pools of the slower tiers, fastest first (host, then disk), each sized
            to that tier's capacity in blocks.
        policy: eviction policy name or instance (``radixkv.core.policy.POLICIES``; default
            ``auto``: LRU until a client sends a session-end hint, then ``forecast``).
        clock: seconds, monotonic; injected so tests can pin the eviction order.
        write_through: the tree's write policy: a ``TreeWrites`` object, or the slower tiers
            (each in ``1 .. num_tiers-1``) that get a copy of every block inserted on the
            device; empty (default) is write-back. See ``writes.py``.
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
        self._width = block_size * TOKEN_BYTES
        self.policy = make_policy(policy)
        self._lru = type(self.policy) is LRUPolicy  # fast path: key = (last_access,)
        #: whether the policy hears node and request events (policy.py's seam); False for
        #: LRU and the other plain key policies, which then cost nothing for it
        self._hooks = self.policy.hooks
        self.clock = clock
        self._pools: list[BlockPool] = [device_pool, *lower_pools]
        self.num_tiers = len(self._pools)
        self._heads: dict[bytes, Node] = {}         # first block's hash -> node
        self._tails: dict[bytes, Node] = {}         # last block's hash -> node
        self._evictable: list[EvictionIndex] = [self.policy.new_index() for _ in self._pools]
        self._resident = [0] * self.num_tiers      # blocks (primaries) per tier
        self._unreferenced = 0                      # device blocks of unheld nodes
        #: per tier, slot -> the node whose primary block it holds (None: free, a copy, or
        #: a private device block); the device's is ``_device_nodes``
        self._slot_nodes: list[list[Node | None]] = [[None] * p.num_blocks for p in self._pools]
        self._device_nodes: list[Node | None] = self._slot_nodes[DEVICE]
        self._ttl_heap: list[tuple[float, bytes]] = []   # (due, tail hash) of TTL-hinted nodes
        self._pending: list[MoveOp] = []            # write-through moves of inserts, not taken yet
        self.stats = TreeStats(self.num_tiers)
        #: Listeners (must not touch the tree; the remote tier, a fleet replica's events):
        #: blocks about to leave the cache (``BlockRef``\ s, still linked), and the hashes of
        #: blocks that entered it with their device block ids (None: placed in a slower tier).
        self.drop_listener: Callable[[list[BlockRef]], None] | None = None
        self.insert_listener: Callable[[list[bytes], list[int] | None], None] | None = None
        self.writes: TreeWrites = make_writes(write_through).bind(self)
        self.write_through: tuple[int, ...] = self.writes.tiers
        if self._hooks:
            self.policy.bind(self)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Cached blocks (in any tier; each has one primary). Runtime complexity: O(tiers)."""
        return sum(self._resident)

    def num_nodes(self) -> int:
        """Nodes (runs) in the tree. Runtime complexity: O(1)."""
        return len(self._heads)

    def nodes(self):
        """Every node (an iterator; the tree must not change meanwhile). O(nodes)."""
        return iter(self._heads.values())

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
        return self.writes.copy_slot(block_hash, tier)

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
        node = self._heads.get(h)
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
                c = self._heads.get(h)
                if c is None or c.parent is not node or c.hashes[0] != h:
                    return path, L
            path.append(c)
            node = c

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
        holders, or the tokens are not one block. Runtime complexity: O(1) when the parent
        ends its node (+ write-through copies); a parent inside a node is found by a scan of
        the nodes and its node cut.
        """
        pool = self._pools[DEVICE]
        if block_hash in self._heads or block_hash in self._tails:
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
            parent = self._find(parent_hash)
            if parent is None or parent.tier != DEVICE:
                raise InvalidBlockError("the parent of a new block must be cached on the device")
            i = parent.hashes.index(parent_hash)
            if i + 1 < len(parent.hashes) and parent.hashes[i + 1] == block_hash:
                raise InvalidBlockError(f"block {block_hash.hex()[:16]} is already cached")
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

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers that disagree, if any tree invariant fails
        (see ``tree_check.py``). Runtime complexity: O(n log n); for tests."""
        from radixkv.core.tree_check import check_tree

        check_tree(self)

    # ------------------------------------------------------------------ policy hand-over
    def switch_policy(self, policy: str | EvictionPolicy) -> None:
        """Hand eviction to ``policy`` from now on (``auto``'s switch on the first session-end
        hint): every node's policy state starts afresh (``on_insert`` as if it had just been
        cached, at its last access) and every evictable node, and write-through copy, is
        filed again under the new key, once. Raises ConfigError, changing nothing, for a
        policy that cuts runs differently from the current one (``insert_key`` or
        ``fresh_counts``). Runtime complexity: O(nodes) + one filing per evictable node."""
        new = make_policy(policy)
        if new.insert_key is not None or new.fresh_counts != self.policy.fresh_counts:
            raise ConfigError(f"cannot switch a {self.policy.name!r} tree to {new.name!r}: "
                              "it cuts runs differently; select it when building the tree")
        if new.hooks:
            new.bind(self)
        self.policy = new
        self._lru = type(new) is LRUPolicy
        self._hooks = new.hooks
        nodes = list(self._heads.values())
        for node in nodes:
            node.aux = None
        if new.hooks:
            for node in nodes:
                new.on_insert(node, 0, node.last_access)
        self._evictable = [new.new_index() for _ in self._pools]
        copies = list(self.writes.tiers)
        for node in nodes:
            self._consider(node)
            if copies:
                self.writes.refile(node, copies)
