"""RadixTree: cached KV blocks keyed by chain hash, with per-tier residency and eviction.

One node per cached full block. A node is reached through a hash index (``dict``), not by
walking children: block ``i`` of a request is looked up by ``h[i]``, and the match checks that
its parent is the node matched for block ``i-1`` and that its stored tokens equal the request's
(so a hash collision is a miss, never a wrong block).

Tiers: tier 0 is the device (slots are device block ids from a ``BlockPool`` whose refcounts are
the sequences' references), tiers 1.. are slower stores (host RAM, disk) with slots from their own
pools. Each node has one *primary* residency (its tier and slot), where ``match`` finds it.
Residency is *prefix-closed per tier prefix*: the parent of a node in tier t is in a tier <= t.
So the device set is a subtree, the device+host set is a subtree, and the whole tree is
prefix-closed. By default that is all (write-back: a block moves down only when evicted). With
``write_through`` tiers a node may also hold *copies* in slower tiers (an inclusive hierarchy;
KV blocks are immutable, so a copy stays valid): every block inserted on the device is copied
into each write-through tier, a promotion out of such a tier keeps its source as a copy, and a
demotion onto an existing copy moves no bytes. Copies take slots of their tier's pool, compete
with the primaries for them by the same policy key, are always evictable (dropping one loses
nothing) and do not count for prefix closure. The tier-side operations and the copy machinery
live in ``tiers.py``.

Eviction is leaf-first per tier: a node is *evictable in its tier* when it is unreferenced
(device: refcount 0) and has no child in its own tier (children can only live in the same or
slower tiers). Each tier keeps its evictable nodes in an eviction index ordered by the eviction
policy (``evict_index.py``): O(1) per operation for LRU and TTL, O(log n) for the others,
independent of how many blocks are cached. The per-request paths (lock, release, insert a run,
the inlined LRU eviction loops) live in ``request_ops.py``: one pass per request.
Evicting from tier t demotes the node into tier t+1 (making room there first, recursively) or,
from the last tier, drops it. Every change of residency is returned as a ``MoveOp`` for the
storage layer to execute *in order* before the freed slots are reused. The MoveOps of
write-through copies are made inside ``insert`` (which returns a node) and queued: take them
with ``take_moves()``; ``evict``, ``evict_expired``, ``invalidate`` and a successful
``promote_lower`` return any queued ones first, so concatenating what the tree returns always
gives the execution order.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence

import xxhash
from radixkv.core.evict_index import EvictionIndex, SortedIndex
from radixkv.core.hashing import TOKEN_BYTES
from radixkv.core.node import _CBITS, _CMASK, DEVICE, MAX_TIERS, MoveOp, Node, TreeStats
from radixkv.core.policy import DEFAULT_HINTS, EvictionPolicy, LRUPolicy, NodeHints, make_policy
from radixkv.core.pool import BlockPool
from radixkv.core.request_ops import RequestOps
from radixkv.core.tiers import TierOps
from radixkv.errors import ConfigError, InvalidBlockError, OutOfBlocks

__all__ = ["DEVICE", "MAX_TIERS", "MoveOp", "Node", "RadixTree", "TreeStats"]

_xxh3_128 = xxhash.xxh3_128_digest
_tuple_new = tuple.__new__


class RadixTree(RequestOps, TierOps):
    """Hash-indexed tree of cached blocks over one device pool and optional slower tiers.

    Args:
        block_size: tokens per block.
        device_pool: the device tier's BlockPool; its refcounts are the sequences' references.
        lower_pools: pools of the slower tiers, fastest first (host, then disk), each sized
            to that tier's capacity in blocks.
        policy: eviction policy name or instance (``lru`` default, ``lfu``, ``priority``, ``ttl``).
        clock: seconds, monotonic; injected so tests can pin the eviction order.
        write_through: slower tiers (each in ``1 .. num_tiers-1``) that receive a copy of every
            block inserted on the device; empty (default) is write-back. See ``tiers.py``.
    """

    def __init__(self, block_size: int, device_pool: BlockPool,
                 lower_pools: Sequence[BlockPool] = (), policy: str | EvictionPolicy = "lru",
                 clock: Callable[[], float] = time.monotonic,
                 write_through: Sequence[int] = ()) -> None:
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if len(lower_pools) + 1 > MAX_TIERS:
            raise ConfigError(f"at most {MAX_TIERS} tiers (device, host, disk)")
        try:
            wt = tuple(write_through)
        except TypeError:
            raise ConfigError(f"write_through must be a sequence of tiers, got {write_through!r}") from None
        if any(type(u) is not int or not 1 <= u <= len(lower_pools) for u in wt) or \
                len(set(wt)) != len(wt):
            raise ConfigError(f"write_through must list distinct slower tiers in "
                              f"1..{len(lower_pools)}, got {write_through!r}")
        self.block_size = block_size
        self.policy = make_policy(policy)
        self._lru = type(self.policy) is LRUPolicy  # fast path: entry = (last_access, hash)
        self.clock = clock
        self._pools: list[BlockPool] = [device_pool, *lower_pools]
        self.num_tiers = len(self._pools)
        self._refs = device_pool.ref_counts
        self._index: dict[bytes, Node] = {}
        new_index = getattr(self.policy, "new_index", SortedIndex)  # optional policy hook
        self._evictable: list[EvictionIndex] = [new_index() for _ in self._pools]
        self._resident = [0] * self.num_tiers
        self._unreferenced = 0                      # device nodes with refcount 0
        self._device_nodes: list[Node | None] = [None] * device_pool.num_blocks
        self._hints: dict[bytes, NodeHints] = {}
        self._ttl_heap: list[tuple[float, bytes]] = []   # (due, hash) of per-block TTL hints
        self.stats = TreeStats(self.num_tiers)
        #: Listeners (must not touch the tree; the remote tier, a fleet replica's events): a node
        #: about to leave the cache (still linked), and blocks that entered it.
        self.drop_listener: Callable[[Node], None] | None = None
        self.insert_listener: Callable[[list[Node]], None] | None = None
        self.write_through: tuple[int, ...] = tuple(sorted(wt))
        self._wt = self.write_through               # falsy: write-back, no copy bookkeeping
        self._copy_slots: list[dict[bytes, int]] = [{} for _ in self._pools]  # tier: hash -> slot
        self._pending: list[MoveOp] = []            # write-through moves of inserts, not taken yet
        if self._wt:
            # Copies are filed under their node's policy key, which lock/release change: use
            # the variants that re-file them (tiers.py). Write-back trees keep the plain
            # methods, so the per-block hot path pays nothing for the option.
            self.lock = self._lock_refiling         # type: ignore[method-assign]
            self.release = self._release_refiling   # type: ignore[method-assign]

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._index)

    def get(self, block_hash: bytes) -> Node | None:
        """The node cached under ``block_hash``, if any. Runtime complexity: O(1)."""
        return self._index.get(block_hash)

    def device_node(self, block_id: int) -> Node | None:
        """The node whose KV lives in device block ``block_id`` (None: uncached block)."""
        return self._device_nodes[block_id]

    def num_resident(self, tier: int = DEVICE) -> int:
        """Cached blocks resident in ``tier``. Runtime complexity: O(1)."""
        return self._resident[tier]

    def num_evictable(self, tier: int = DEVICE) -> int:
        """Blocks of ``tier`` that eviction can free (now or after their children go).

        On the device these are the unreferenced cached blocks (their descendants are
        unreferenced too, since a sequence holds a whole prefix); slower tiers hold no
        references, so all their blocks are evictable, primaries and copies.
        Runtime complexity: O(1).
        """
        if tier == DEVICE:
            return self._unreferenced
        return self._resident[tier] + len(self._copy_slots[tier])

    def take_moves(self) -> list[MoveOp]:
        """The queued MoveOps of write-through copies made by ``insert`` (and of the evictions
        that made room for them), in execution order; clears the queue. Run them before any
        later move. Always ``[]`` without write-through. Runtime complexity: O(1)."""
        moves = self._pending
        self._pending = []
        return moves

    def match(self, block_hashes: Sequence[bytes], tok_bytes: bytes) -> list[Node]:
        """Longest cached chain of full blocks for a request, in any tier. A pure read: it
        changes nothing (not the policy's keys, not a counter); use the block manager's
        ``allocate`` (``lock_nodes``) to take and touch what it returns.

        ``block_hashes[i]`` is the chain hash of block i of the request and ``tok_bytes`` its
        token ids (``hashing.token_bytes``). Matching stops at the first block that is absent,
        whose parent is not the previous match, or whose stored tokens differ (a hash collision:
        a miss, never a wrong block; the commit that meets it counts it in ``stats.collisions``).
        The nodes returned may live in different tiers, in
        non-decreasing tier order along the chain.
        Runtime complexity: O(number of matched blocks).
        """
        width = self.block_size * TOKEN_BYTES
        index = self._index
        out: list[Node] = []
        prev: Node | None = None
        start = 0
        for h in block_hashes:
            node = index.get(h)
            if node is None or node.parent is not prev:
                break
            end = start + width
            if node.tokens != tok_bytes[start:end]:
                break
            out.append(node)
            prev = node
            start = end
        return out

    def match_tokens(self, tok_bytes: bytes, seed: bytes, max_blocks: int | None = None
                     ) -> tuple[list[Node], list[bytes]]:
        """Hash and match in one pass: ``(nodes, their hashes)`` for the longest cached chain.

        Same result as ``match(hash_blocks(...), tok_bytes)`` (a pure read too) but hashes only
        where it must: block i+1 is first compared with the child that block i's node followed
        last (``Node.child``); only if their tokens differ is the chain hash computed and looked
        up. So a request that continues the way the previous one went pays one hash for its
        whole matched prefix. ``seed`` is the namespace seed. Runtime complexity: O(matched
        tokens), the hashing only for blocks off the followed path.
        """
        width = self.block_size * TOKEN_BYTES
        n = len(tok_bytes) // width
        if max_blocks is not None and max_blocks < n:
            n = max_blocks
        index_get = self._index.get
        xxh = _xxh3_128
        nodes: list[Node] = []
        append = nodes.append
        prev: Node | None = None
        end = n * width
        start = 0
        chunk = tok_bytes[:width]
        if n:   # the first block has no parent node to follow: hash it
            node = index_get(xxh(seed + chunk))
            if node is not None and node.parent is None and node.tokens == chunk:
                append(node)
                prev = node
                start = width
            else:
                end = 0
        while start < end:
            chunk = tok_bytes[start:start + width]
            node = prev.child   # type: ignore[union-attr]
            if node is None or node.tokens != chunk:
                node = index_get(xxh(prev.block_hash + chunk))   # type: ignore[union-attr]
                if node is None or node.parent is not prev or node.tokens != chunk:
                    break
            append(node)
            prev = node
            start += width
        return nodes, [x.block_hash for x in nodes]

    def hints(self, node: Node) -> NodeHints:
        return self._hints.get(node.block_hash, DEFAULT_HINTS)

    # ------------------------------------------------------------------ evictable set
    def _is_evictable(self, node: Node) -> bool:
        t = node.tier
        if (node.children >> (_CBITS * t)) & _CMASK:
            return False
        return t != DEVICE or self._refs[node.slot] == 0

    def _entry(self, node: Node) -> tuple:
        """Sorted-set entry: the policy key plus the hash (unique, deterministic tie-break)."""
        if self._lru:
            return (node.last_access, node.block_hash)
        return (*self.policy.key(node, self._hints.get(node.block_hash, DEFAULT_HINTS)),
                node.block_hash)

    def _discard(self, node: Node) -> None:
        """Take ``node`` out of its tier's evictable set if it is there (before a mutation)."""
        if self._is_evictable(node):
            self._evictable[node.tier].remove(self._entry(node))

    def _consider(self, node: Node) -> None:
        """Put ``node`` into its tier's evictable set if it qualifies (after a mutation)."""
        if self._is_evictable(node):
            self._evictable[node.tier].add(self._entry(node))

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

    # ------------------------------------------------------------------ mutations
    def insert(self, parent: Node | None, block_hash: bytes, tokens: bytes, block_id: int,
               now: float | None = None) -> Node:
        """Cache device block ``block_id`` (whose KV is computed) as the child of ``parent``.

        The caller keeps its references; the block becomes evictable once they drop to 0.
        With write-through, the block is also copied into each write-through tier (making room
        there by eviction; skipped if none can be made): those MoveOps are queued for
        ``take_moves``. Raises InvalidBlockError (changing nothing) if the hash is already
        cached, the block is already cached, or the parent is not on the device.
        Runtime complexity: O(log n) (+ O(tiers * log n) per write-through tier).
        """
        if block_hash in self._index:
            raise InvalidBlockError(f"block {block_hash.hex()[:16]} is already cached")
        if self._device_nodes[block_id] is not None:
            raise InvalidBlockError(f"device block {block_id} already caches another hash")
        if self._pools[DEVICE].is_free(block_id):
            raise InvalidBlockError(f"device block {block_id} is free; allocate it first")
        if parent is not None and (parent.tier != DEVICE or self._index.get(parent.block_hash) is not parent):
            raise InvalidBlockError("the parent of a new block must be cached on the device")
        if len(tokens) != self.block_size * TOKEN_BYTES:
            raise InvalidBlockError(f"a block holds {self.block_size} tokens, got {len(tokens) // TOKEN_BYTES}")
        return self._insert(parent, block_hash, tokens, block_id, self.clock() if now is None else now)

    def _insert(self, parent: Node | None, block_hash: bytes, tokens: bytes, block_id: int,
                now: float) -> Node:
        """``insert`` without argument checks, for the block manager's commit path."""
        node = Node(block_hash, parent, tokens, DEVICE, self._pools[DEVICE].canonical(block_id), now)
        if parent is not None:
            c = parent.children
            if not c & _CMASK and self._refs[parent.slot] == 0:
                self._evictable[DEVICE].remove(self._entry(parent))  # no longer a leaf
            parent.children = c + 1
            parent.child = node
        self._index[block_hash] = node
        self._device_nodes[block_id] = node
        self._resident[DEVICE] += 1
        if self._refs[block_id] == 0:
            self._unreferenced += 1
            self._consider(node)
        self.stats.inserted += 1
        if self._wt:
            self._write_through(node)
        return node

    def lock(self, node: Node, now: float | None = None) -> None:
        """Take one reference on a device node (a sequence now uses it). O(log n)."""
        assert node.tier == DEVICE, f"lock() of a node in tier {node.tier}: promote it first"
        self._discard(node)
        refs = self._refs
        if refs[node.slot] == 0:
            self._unreferenced -= 1
        refs[node.slot] += 1
        node.last_access = self.clock() if now is None else now
        node.hits += 1

    def release(self, node: Node, now: float | None = None) -> None:
        """Drop one reference; at zero the node becomes evictable (if a leaf). O(log n).

        ``now`` lets a caller releasing a whole chain share one timestamp object.
        """
        refs = self._refs
        assert node.tier == DEVICE and refs[node.slot] > 0, f"release() of unreferenced {node}"
        refs[node.slot] -= 1
        if refs[node.slot] == 0:
            self._unreferenced += 1
            node.last_access = self.clock() if now is None else now
            self._consider(node)

    def promote(self, node: Node, block_id: int, copy: bool = True) -> MoveOp | None:
        """Move a slower-tier node onto device block ``block_id`` (allocated by the caller).

        With ``copy`` the returned MoveOp tells the storage layer to load the bytes; without
        it the block already holds the same KV (recomputed) and nothing moves ("adoption"); the
        old residency's release is then queued as a drop (``take_moves``), so that a disk file
        does not outlive the tier's claim on it.
        If the node's tier is a write-through tier, its old slot stays as a copy (``keep_src``;
        adoption keeps it too). The parent must already be on the device; with write-through,
        take the queued moves (``take_moves``) first. Runtime complexity: O(log n).
        """
        t = node.tier
        assert t != DEVICE, f"promote() of a device node {node}"
        parent = node.parent
        assert parent is None or parent.tier == DEVICE, f"promote() under a non-device parent {parent}"
        assert self._device_nodes[block_id] is None, f"device block {block_id} caches another node"
        assert not (copy and self._pending), "promote() with write-through moves queued: take_moves() first"
        old_slot = node.slot
        self._discard(node)
        self._set_tier(node, DEVICE, self._pools[DEVICE].canonical(block_id))
        keep = t in self._wt
        if keep:
            self._copy_slots[t][node.block_hash] = old_slot
            self._evictable[t].add(self._entry(node))
            self.stats.copies_made += 1
        else:
            self._pools[t].free_one(old_slot)
        self._device_nodes[block_id] = node
        if self._refs[block_id] == 0:
            self._unreferenced += 1
        self._consider(node)
        self.stats.promoted[t] += 1
        if not copy:
            self.stats.adopted += 1
            if not keep:   # the old residency is released: a disk file must go (queued)
                self._pending.append(MoveOp(node.block_hash, t, old_slot, None, None, False))
            return None
        return MoveOp(node.block_hash, t, old_slot, DEVICE, block_id, keep)

    def _set_tier(self, node: Node, tier: int, slot: int) -> None:
        """Re-home ``node`` (already out of every evictable set) and fix its parent's counts."""
        old = node.tier
        parent = node.parent
        if parent is not None:
            self._add_child_count(parent, old, -1)
            self._add_child_count(parent, tier, 1)
        self._resident[old] -= 1
        self._resident[tier] += 1
        node.tier = tier
        node.slot = slot

    def evict(self, tier: int, num_blocks: int) -> list[MoveOp]:
        """Evict ``num_blocks`` blocks from ``tier`` in policy order, leaves first.

        Device evictions free device blocks into the device pool. Each victim is demoted into
        the next tier (room is made there first, recursively; onto its copy there, if it has
        one, moving nothing) or, from the last tier, dropped; a victim that is a copy is
        dropped. Queued write-through moves come first in the result.
        All-or-nothing: raises OutOfBlocks, changing nothing, if fewer blocks are evictable.
        Runtime complexity: O(num_blocks * tiers * log n).
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
        if tier == DEVICE and self._evict_device(num_blocks, moves):
            return moves
        for _ in range(num_blocks):
            self._evict_one(tier, moves)
        return moves

    def _evict_one(self, tier: int, moves: list[MoveOp]) -> None:
        entries = self._evictable[tier]
        assert entries, (f"tier {tier}: nothing evictable with {self._resident[tier]} resident, "
                         f"{self.num_evictable(tier)} counted evictable")
        node = self._index[entries.pop_min()[-1]]
        if node.tier == tier:
            self._move_out(node, moves)
        else:
            self._drop_popped_copy(node, tier, moves)

    def _move_out(self, node: Node, moves: list[MoveOp]) -> None:
        """Demote or drop an evictable node (already popped from its tier's set)."""
        t, old_slot = node.tier, node.slot
        self.stats.evicted[t] += 1
        if t == DEVICE:
            self._unreferenced -= 1
            self._device_nodes[old_slot] = None
        u = t + 1
        if u < self.num_tiers:
            copies = self._copy_slots[u]
            new_slot = copies.pop(node.block_hash, None) if copies else None
            if new_slot is not None:
                # its copy in tier u becomes the primary: no bytes move (a free demotion)
                self._evictable[u].remove(self._entry(node))
                self.stats.free_demotions += 1
            else:
                dst = self._pools[u]
                if dst.num_free == 0:
                    self._evict_one(u, moves)
                new_slot = dst.allocate_one()
                moves.append(_tuple_new(MoveOp, (node.block_hash, t, old_slot, u, new_slot, False)))
            self._set_tier(node, u, new_slot)
            self._consider(node)
            self.stats.demoted_in[u] += 1
        else:
            assert node.children == 0, f"dropping {node} would orphan its children"
            self._drop(node)
            moves.append(_tuple_new(MoveOp, (node.block_hash, t, old_slot, None, None, False)))
        self._pools[t].free_one(old_slot)

    def _drop(self, node: Node) -> None:
        if self.drop_listener is not None:
            self.drop_listener(node)
        del self._index[node.block_hash]
        self._hints.pop(node.block_hash, None)
        self._resident[node.tier] -= 1
        if node.parent is not None:
            if node.parent.child is node:
                node.parent.child = None
            self._add_child_count(node.parent, node.tier, -1)
        self.stats.dropped += 1

    def set_hints(self, nodes: Iterable[Node], priority: int | None = None,
                  ttl: float | None = None) -> None:
        """Set the priority and/or TTL hints of cached nodes (e.g. a system prompt's chain).

        ``priority``: an int (higher survives longer under the priority policy); ``ttl``: finite
        seconds >= 0. All-or-nothing (all validated first). O(len(nodes) * log n).
        """
        if priority is not None and (type(priority) is not int):
            raise ConfigError(f"priority must be an int, got {priority!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                or not math.isfinite(ttl) or ttl < 0):
            raise ConfigError(f"ttl must be a finite number of seconds >= 0, got {ttl!r}")
        nodes = list(nodes)
        for node in nodes:
            if not isinstance(node, Node) or self._index.get(node.block_hash) is not node:
                raise InvalidBlockError(f"{node!r} is not a cached node of this tree")
        for node in nodes:
            old = self.hints(node)
            new = NodeHints(old.priority if priority is None else priority,
                            old.ttl if ttl is None else float(ttl))
            self._discard(node)
            copies = self._unfile_copies(node) if self._wt else None
            if new == DEFAULT_HINTS:
                self._hints.pop(node.block_hash, None)
            else:
                self._hints[node.block_hash] = new
                if new.ttl is not None:
                    heapq.heappush(self._ttl_heap, (node.last_access + new.ttl, node.block_hash))
            self._consider(node)
            if copies:
                self._file_copies(node, copies)
