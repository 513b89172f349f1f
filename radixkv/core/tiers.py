"""The ``RadixTree``'s moves between tiers beyond plain eviction: promotions to the device,
adoption of a recomputed block, disk -> host prefetch, blocks found on disk at start,
invalidation of bad blocks.

``TierOps`` is a mixin of ``RadixTree`` (``eviction.py`` has eviction and demotion, ``hints.py``
hints and TTL expiry). Every operation here works on whole nodes (runs), cutting one first where it must
apply to only part of it; each returns the ``MoveOp``\\ s the storage layer must run, in order.
Copies (write-through) are the write policy's (``writes.py``): these operations tell it when a
node's key changes (``unfile``/``refile``), when a promotion may keep its source as a copy
(``keep_sources``) and when a block leaves with its copies (``drop_block_copies``).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from radixkv.core.evictable import EvictableSet
from radixkv.core.node import DEVICE, BlockRef, MoveOp, Node, TreeStats
from radixkv.core.policy import EvictionPolicy
from radixkv.core.pool import BlockPool
from radixkv.errors import InvalidBlockError

if TYPE_CHECKING:
    from radixkv.core.writes import TreeWrites

_tuple_new = tuple.__new__


class TierOps:
    """Slower-tier operations of ``RadixTree`` (a mixin; see the module docstring)."""

    num_tiers: int
    clock: Callable[[], float]
    stats: TreeStats
    writes: TreeWrites
    policy: EvictionPolicy
    hooks: bool
    block_bytes: int
    pools: list[BlockPool]
    heads: dict[bytes, Node]
    tails: dict[bytes, Node]
    slot_nodes: list[list[Node | None]]
    ttl_heap: list[tuple[float, bytes]]
    evictable: list[EvictableSet]
    _resident: list[int]
    _unreferenced: int
    device_nodes: list[Node | None]
    pending_moves: list[MoveOp]
    drop_listener: Callable[[list[BlockRef]], None] | None

    if TYPE_CHECKING:  # RadixTree's own helpers, used here
        def find(self, block_hash: bytes, near: Node | None = None) -> Node | None: ...
        def coalesce(self, parent: Node | None, child: Node) -> Node: ...
        def split(self, node: Node, k: int) -> tuple[Node, Node]: ...
        def node_ending_at(self, block_hash: bytes, near: Node | None = None) -> Node: ...
        def _link(self, parent: Node, node: Node) -> None: ...
        def _unlink(self, node: Node) -> None: ...
        def _add_child_count(self, parent: Node, tier: int, delta: int) -> None: ...
        def _ref(self, node: Node, i: int) -> BlockRef: ...
        def evict_from(self, tier: int, num: int, moves: list[MoveOp]) -> None: ...
        def _move_tail_out(self, node: Node, take: int, moves: list[MoveOp]) -> int: ...
        def num_evictable(self, tier: int = DEVICE) -> int: ...

    # ------------------------------------------------------------------ to the device
    def promote_nodes(self, nodes: list[Node], block_ids: list[int], now: float) -> list[MoveOp]:
        """Load slower-tier ``nodes`` (whole nodes of one chain, root first, whose first
        parent is on the device) into device blocks ``block_ids`` (allocated by the caller,
        in chain order) and lock each for one holder. A source in a write-through tier stays
        as a copy (``keep_src``). Run queued write-through moves (``take_moves``) first.
        Returns the loads. Runtime complexity: O(blocks)."""
        moves: list[MoveOp] = []
        j = 0
        for node in nodes:
            n = len(node.hashes)
            ids = block_ids[j:j + n]
            j += n
            t, old, refile = self._rehome_on_device(node, ids)
            node.ref = 1
            prev = node.last_access
            node.last_access = now
            node.hits += 1
            if self.hooks:
                self.policy.on_hit(node, prev, now)
            sn = self.slot_nodes[t]
            for s in old:
                sn[s] = None
            keep = self.writes.keep_sources(node, t, old)
            if not keep:
                src = self.pools[t]
                for s in old:
                    src.free_one(s)
            for h, s, b in zip(node.hashes, old, ids):
                moves.append(_tuple_new(MoveOp, (h, t, s, DEVICE, b, keep)))
            if refile is not None:
                self.writes.refile(node, refile)
            self.coalesce(node.parent, node)
        return moves

    def _rehome_on_device(self, node: Node, block_ids: list[int]) -> tuple[int, list[int],
                                                                            list[int] | None]:
        """Move slower-tier ``node`` (whose parent is on the device) onto device blocks
        ``block_ids``: out of its tier's index, child counts, device map, residency counts.
        Returns ``(old tier, old slots, copies to re-file)``; the caller sets holders and key
        and decides what becomes of the old slots."""
        t = node.tier
        assert t != DEVICE and (node.parent is None or node.parent.tier == DEVICE), node
        self.evictable[node.tier].unfile(node)
        refile = self.writes.unfile(node)
        old = node.slots
        parent = node.parent
        if parent is not None:
            self._add_child_count(parent, t, -1)
            self._add_child_count(parent, DEVICE, 1)
        dn = self.device_nodes
        node.tier = DEVICE
        node.slots = array("i", block_ids)
        for b in block_ids:
            dn[b] = node
        n = len(block_ids)
        self._resident[t] -= n
        self._resident[DEVICE] += n
        self.stats.promoted[t] += n
        return t, old, refile

    def promote_head_block(self, node: Node, parent: Node, block_id: int, now: float
                           ) -> MoveOp | None:
        """Promote the first block of slower-tier ``node`` (2+ blocks, child of the held
        device node ``parent``) into device block ``block_id`` and lock it, onto the end of
        ``parent``'s run, without a transient node: the same steps, move and state as a cut
        after the block + ``promote_nodes`` + coalescing into ``parent``. Only where the
        block would coalesce (a write-back tree, ``parent`` held by one sequence with
        ``node`` its only child, the same hints, and the same key once touched); None,
        changing nothing, otherwise."""
        if (self.writes.tiers or self.hooks or parent.ref != 1 or parent.child is not node
                or node.next is not None or parent.hints != node.hints
                or parent.aux != node.aux):
            return None
        last, hits = node.last_access, node.hits   # the block's key once promoted
        node.last_access, node.hits = now, hits + 1
        same = self.evictable[node.tier].key(node) == self.evictable[node.tier].key(parent)
        node.last_access, node.hits = last, hits
        if not same:
            return None
        t = node.tier
        heads, tails = self.heads, self.tails
        h = node.hashes.pop(0)
        del heads[h]
        heads[node.hashes[0]] = node
        old = node.slots.pop(0)
        w = self.block_bytes
        tok = node.tokens[:w]
        del node.tokens[:w]
        b = block_id
        del tails[parent.hashes[-1]]
        tails[h] = parent
        parent.hashes.append(h)
        parent.tokens += tok
        parent.slots.append(b)
        self.slot_nodes[t][old] = None
        self.device_nodes[b] = parent
        self.pools[t].free_one(old)
        self._resident[t] -= 1
        self._resident[DEVICE] += 1
        self.stats.promoted[t] += 1
        return _tuple_new(MoveOp, (h, t, old, DEVICE, b, False))

    def adopt(self, node: Node, block_ids: list[int]) -> Node:
        """The first ``len(block_ids)`` blocks of slower-tier ``node`` were recomputed into
        device blocks ``block_ids`` (held; their pool refcounts move into the node): they
        become those blocks, and nothing is loaded. Their old residency is released (a drop
        is queued for ``take_moves``, so that a disk file does not outlive the tier's claim on
        it) or kept as a copy in a write-through tier. Returns the adopted node."""
        k = len(block_ids)
        if k < len(node.hashes):
            node = self.split(node, k)[0]
        refs, dn = self.pools[DEVICE].ref_counts, self.device_nodes
        ref = refs[block_ids[0]]
        for b in block_ids:
            assert refs[b] == ref and dn[b] is None, f"adopt into block {b}"
            refs[b] = 0
        t, old, refile = self._rehome_on_device(node, block_ids)
        node.ref = ref
        sn = self.slot_nodes[t]
        for s in old:
            sn[s] = None
        if not self.writes.keep_sources(node, t, old):
            src = self.pools[t]
            for h, s in zip(node.hashes, old):
                src.free_one(s)
                self.pending_moves.append(_tuple_new(MoveOp, (h, t, s, None, None, False)))
        self.stats.adopted += k
        if ref == 0:
            self._unreferenced += k
        self.evictable[node.tier].file(node)
        if refile is not None:
            self.writes.refile(node, refile)
        return node

    # ------------------------------------------------------------------ slower tiers
    def promote_lower(self, block_hash: bytes, tier: int, max_blocks: int | None = None
                      ) -> list[MoveOp]:
        """Move the slower-tier node that starts with ``block_hash`` (at most ``max_blocks``
        of its blocks) up into the faster non-device ``tier``: a prefetch (disk -> host),
        making room there by evicting leaf-first like any eviction. The node's parent must be
        in a tier <= ``tier`` (prefix closure); it is kept out of the victims. The node's old
        slots are freed before room is made, so victims demoted into its old tier take them
        (the node's bytes are still read from its old slots: run the moves in order). If the
        old tier is a write-through tier and no victim took them, they stay as copies
        (``keep_src``). The node is touched, so the policy keeps it for the request that is
        about to use it.

        Returns the MoveOps (queued write-through moves, then evictions, then the node's
        loads); ``[]`` (changing nothing) if no room can be made in ``tier``.
        Runtime complexity: O(blocks) per tier of the cascade.
        """
        node = self.heads.get(block_hash)
        assert node is not None and node.hashes[0] == block_hash, \
            f"promote_lower() of {block_hash.hex()[:16]}: not the first block of a cached node"
        t = node.tier
        assert DEVICE < tier < t, f"promote_lower() of a tier-{t} node into tier {tier}"
        parent = node.parent
        assert parent is None or parent.tier <= tier, \
            f"promote_lower() into tier {tier} under a parent in tier {parent.tier}"
        dst = self.pools[tier]
        pinned = 0   # blocks of the parent and its same-tier ancestors: not victims now
        guard = parent if parent is not None and parent.tier == tier and \
            self.evictable[parent.tier].qualifies(parent) else None
        a = parent
        while a is not None and a.tier == tier:
            pinned += len(a.hashes)
            a = a.parent
        k = len(node.hashes) if max_blocks is None else min(max_blocks, len(node.hashes))
        k = min(k, dst.num_free + self.num_evictable(tier) - pinned)
        if k <= 0:
            return []
        if k < len(node.hashes):
            node = self.split(node, k)[0]
        moves = self.pending_moves
        self.pending_moves = []
        self.evictable[node.tier].unfile(node)
        refile = self.writes.unfile(node)
        if guard is not None:
            self.evictable[guard.tier].unfile(guard)
        old = node.slots
        src = self.pools[t]
        sn = self.slot_nodes[t]
        for s in reversed(old):
            src.free_one(s)   # a victim demoted into tier t may take these
            sn[s] = None
        short = k - dst.num_free
        if short > 0:
            self.evict_from(tier, short, moves)
        if guard is not None:
            self.evictable[guard.tier].file(guard)
        new = array("i", [dst.allocate_one() for _ in range(k)])
        sn = self.slot_nodes[tier]
        for s in new:
            sn[s] = node
        if parent is not None:
            self._add_child_count(parent, t, -1)
            self._add_child_count(parent, tier, 1)
        node.tier = tier
        node.slots = new
        node.last_access = self.clock()
        self._resident[t] -= k
        self._resident[tier] += k
        keep = False
        if t in self.writes.tiers and all(src.is_free(s) for s in old):
            # Nothing was allocated in tier t since the frees (else LIFO gave them away).
            took = array("i", [src.allocate_one() for _ in old])
            assert took == old, f"tier {t}: re-took slots {took}, expected {old}"
            keep = self.writes.keep_sources(node, t, old)
        self.evictable[node.tier].file(node)
        if refile is not None:
            self.writes.refile(node, refile)
        for h, s, d in zip(node.hashes, old, new):
            moves.append(_tuple_new(MoveOp, (h, t, s, tier, d, keep)))
        return moves

    def insert_lower(self, parent_hash: bytes | None, block_hash: bytes, tokens: bytes,
                     tier: int) -> BlockRef | None:
        """Cache a block that already lives in slower tier ``tier`` (found on disk at start,
        fetched from the remote tier) after cached block ``parent_hash`` (None: a root).

        Returns its ``BlockRef`` (its slot is where the caller puts the bytes), or None
        (changing nothing) if the tier is full (primaries and copies), the hash is cached or
        the parent is not. The parent must be in a tier <= ``tier``; a parent that is a same-
        tier run's last block with nothing after it is extended (one node per restored chain).
        Runtime complexity: O(1) when the parent ends its node (a chain restored or installed
        in order); a parent inside a node is found by a scan of the nodes (``_find``) and the
        node cut after it.
        """
        assert 0 < tier < self.num_tiers, f"insert_lower into tier {tier}"
        pool = self.pools[tier]
        if pool.num_free == 0 or len(tokens) != self.block_bytes or block_hash in self.heads \
                or block_hash in self.tails:
            return None
        parent = None
        if parent_hash is not None:
            parent = self.find(parent_hash)
            if parent is None:
                return None
            i = parent.hashes.index(parent_hash)
            if i + 1 < len(parent.hashes):
                if parent.hashes[i + 1] == block_hash:
                    return None   # cached inside the parent's run
                parent = self.split(parent, i + 1)[0]
        assert parent is None or parent.tier <= tier, "parent must be in a faster or equal tier"
        slot = pool.allocate_one()
        now = self.clock()
        if parent is not None and parent.tier == tier and parent.child is None and \
                parent.hints is None:
            self.evictable[parent.tier].unfile(parent)
            node = parent
            del self.tails[node.hashes[-1]]
            self.tails[block_hash] = node
            node.hashes.append(block_hash)
            node.tokens += tokens
            node.slots.append(slot)
            node.last_access = now
            if self.hooks:
                self.policy.on_insert(node, len(node.hashes) - 1, now)
        else:
            node = Node([block_hash], bytearray(tokens), [slot], tier, None, now)
            self.heads[block_hash] = node
            self.tails[block_hash] = node
            if self.hooks:
                self.policy.on_insert(node, 0, now)
            if parent is not None:
                self._link(parent, node)
        self.slot_nodes[tier][slot] = node
        self._resident[tier] += 1
        self.evictable[node.tier].file(node)
        return self._ref(node, len(node.hashes) - 1)

    def invalidate(self, block_hash: bytes) -> list[MoveOp]:
        """Drop cached block ``block_hash`` and everything after it (the rest of its node and
        every descendant), in any tier, with all their copies (its bytes proved bad, e.g. a
        disk block that failed its checksum on load). Returns drop MoveOps (dst None): queued
        write-through moves first, then deepest node first, each node's copies before its own
        blocks, each node's blocks last first. Everything dropped must be unheld (raises
        InvalidBlockError, changing nothing, otherwise). Runtime complexity: O(dropped blocks).
        """
        node = self.find(block_hash)
        if node is None:
            raise InvalidBlockError(f"block {block_hash.hex()[:16]} is not cached")
        order: list[Node] = []
        stack = [node]
        while stack:   # the subtree, parents before children (reversed below)
            n = stack.pop()
            order.append(n)
            stack.extend(n.iter_children())
        held = sum(1 for n in order if n.tier == DEVICE and n.ref > 0)
        if held:
            raise InvalidBlockError(f"cannot invalidate: {held} of its nodes are in use")
        i = node.hashes.index(block_hash)
        if i:
            order[0] = self.split(node, i)[1]
        moves = self.pending_moves
        self.pending_moves = []
        writes = self.writes
        for n in reversed(order):
            self.evictable[n.tier].unfile(n)   # (not an eviction: the policy's hooks do not hear of it)
            if self.drop_listener is not None:
                self.drop_listener([self._ref(n, j) for j in range(len(n.hashes) - 1, -1, -1)])
            t = n.tier
            pool = self.pools[t]
            sn = self.slot_nodes[t]
            del self.heads[n.hashes[0]]
            del self.tails[n.hashes[-1]]
            for h, s in zip(reversed(n.hashes), reversed(n.slots)):
                writes.drop_block_copies(n, h, moves)   # each block's copies, then itself
                pool.free_one(s)
                sn[s] = None
                moves.append(_tuple_new(MoveOp, (h, t, s, None, None, False)))
            k = len(n.hashes)
            self._resident[t] -= k
            if t == DEVICE:
                self._unreferenced -= k
            self.stats.dropped += k
            if n.parent is not None:
                self._unlink(n)
        return moves
