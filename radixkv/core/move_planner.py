"""The tree's moves between tiers: how blocks leave a tier, come back, and expire.

``MovePlanner`` is a part of ``RadixTree`` (``tree.planner``), with the tree's structure as its
only state (it holds references to the tree's maps, pools, evictable sets and counters: the same
objects) and public methods that return the ``MoveOp``\\ s the storage layer must run, in order.
It plans; it does no I/O. The tree re-exports its public methods (``tree.evict`` is
``tree.planner.evict``).

**Eviction.** ``evict(tier, n)`` takes ``n`` blocks out of a tier in the policy's order, leaves
first, block by block from the tail of each victim run, exactly as a per-block cache would
(``EvictableSet.take`` breaks equal keys by block hash): from the last tier they are dropped,
from the others demoted into the next tier, making room there first. Where no choice between the
next tier's blocks and the victim's can arise (its smallest key is strictly below the victim's,
``_evict_below``, or it has free blocks) a victim's blocks move together; otherwise one at a time,
straight onto the run below them (``_demote_tail_block``). A device-only tree reports no drops
(they need no storage work) and, where its index pops and peeks at once (LRU, TTL, FIFO, the
forecast), evicts in one loop (``_drop_device_lru``).

**Back up and across.** Promotions to the device (``promote_nodes``, ``promote_head_block``),
adoption of a recomputed block (``adopt``), disk -> host prefetch (``promote_lower``), blocks
found on disk at start or fetched from the remote tier (``insert_lower``), invalidation of bad
blocks (``invalidate``). Each works on whole nodes (runs), cutting one first where it must apply
to only part of it. Copies (write-through) are the write policy's (``writes.py``): these
operations tell it when a node's key changes (``unfile``/``refile``), when a promotion may keep
its source as a copy (``keep_sources``) and when a block leaves with its copies.

**Expiry.** ``evict_expired`` lets blocks whose TTL ran out leave their tier without memory
pressure (the TTL policy's own keys, and per-block TTL hints under any policy, kept in the tree's
``ttl_heap`` and checked lazily).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
from array import array
from typing import TYPE_CHECKING, Protocol

from radixkv.core.events import BlockStored
from radixkv.core.evict_index import Entry, RecencyIndex
from radixkv.core.evictable import EvictableSet
from radixkv.core.hashing import BlockHash
from radixkv.core.node import DEVICE, BlockRef, MoveOp, Node
from radixkv.core.policy import EvictionPolicy, LRUPolicy
from radixkv.core.pool import BlockId
from radixkv.errors import InvalidBlockError, OutOfBlocks

if TYPE_CHECKING:
    from collections.abc import Callable

    from radixkv.core.events import BlockRemoved, KVEventQueue
    from radixkv.core.node import TreeStats
    from radixkv.core.pool import BlockPool
    from radixkv.core.writes import TreeWrites

_tuple_new = tuple.__new__

__all__ = ["MovePlanner", "PlannerHost"]


class PlannerHost(Protocol):
    """The tree as its planner sees it (``RadixTree`` is one; ``RadixTree``'s docstring says
    what each map is): the structure the planner reads and rewires through the tree's own
    structural edits (split, coalesce, link, unlink, child counts), and the counters it keeps
    with the tree. Declared here so that this module imports no tree (the tree builds it)."""

    num_tiers: int
    block_bytes: int
    clock: Callable[[], float]
    pools: list[BlockPool]
    heads: dict[bytes, Node]
    tails: dict[bytes, Node]
    block_nodes: list[list[Node | None]]
    device_nodes: list[Node | None]
    evictable: list[EvictableSet]
    resident: list[int]
    unreferenced: int
    ttl_heap: list[tuple[float, bytes]]
    pending_moves: list[MoveOp]
    stats: TreeStats
    events: KVEventQueue | None
    writes: TreeWrites
    policy: EvictionPolicy

    def num_evictable(self, tier: int = DEVICE) -> int: ...

    def take_moves(self) -> list[MoveOp]: ...

    def block_ref(self, node: Node, i: int) -> BlockRef: ...

    def removed_event(self, node: Node, cut: int) -> BlockRemoved: ...

    def find(self, block_hash: BlockHash, near: Node | None = None) -> Node | None: ...

    def split(self, node: Node, k: int) -> tuple[Node, Node]: ...

    def coalesce(self, parent: Node | None, child: Node) -> Node: ...

    def link(self, parent: Node, node: Node) -> None: ...

    def unlink(self, node: Node) -> None: ...

    def add_child_count(self, parent: Node, tier: int, delta: int) -> None: ...

    def rearm_ttl(self, node: Node) -> None: ...


class MovePlanner:
    """Plans every change of residency of one ``RadixTree`` (see the module docstring).

    Args:
        tree: the tree whose structure it moves (the planner is built by the tree).
    """

    def __init__(self, tree: PlannerHost) -> None:
        self.tree = tree
        # the tree's structure: the same objects (``RadixTree``'s docstring says what each is)
        self.heads = tree.heads
        self.tails = tree.tails
        self.block_nodes = tree.block_nodes
        self.device_nodes = tree.device_nodes
        self.pools = tree.pools
        self.evictable = tree.evictable
        self.resident = tree.resident
        self.ttl_heap = tree.ttl_heap
        self.stats = tree.stats
        self.writes = tree.writes
        self.use_policy(tree.policy)
        self.clock = tree.clock
        self.num_tiers = tree.num_tiers
        self.block_bytes = tree.block_bytes

    def use_policy(self, policy: EvictionPolicy) -> None:
        """Plan with ``policy`` from now on (the tree's ``switch_policy``). O(1)."""
        self.policy = policy
        self.hooks = policy.hooks
        self._lru = type(policy) is LRUPolicy

    # ------------------------------------------------------------------ eviction and demotion
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
        available = self.tree.num_evictable(tier)
        if num_blocks > available:
            raise OutOfBlocks(num_blocks, self.pools[tier].num_free, available,
                              "every cached block of this tier is in use by a live sequence")
        moves = self.tree.take_moves()    # queued write-through moves run first
        if num_blocks:
            self.evict_from(tier, num_blocks, moves)
        return moves

    def evict_from(self, tier: int, num: int, moves: list[MoveOp]) -> None:
        """Evict ``num`` blocks of ``tier`` (they are evictable), victim by victim."""
        if tier == DEVICE and self._evict_device_fast(num, moves):
            return
        entries = self.evictable[tier]
        tails = self.tails
        while num > 0:
            e = entries.pop_min()
            h = e[-1]
            node = tails.get(h)         # a node is filed under its last block
            if node is None or node.tier != tier:   # a write-through copy of a faster block
                self.writes.drop_popped_copy(h, tier, moves)
                num -= 1
                continue
            take = entries.take(node, num, e)
            num -= self._move_tail_out(node, take, moves)

    def _move_tail_out(self, node: Node, take: int, moves: list[MoveOp]) -> int:
        """The last ``take`` blocks of ``node`` (an evictable node already out of its index)
        leave its tier: demoted into the next one, or dropped from the last. Returns how many
        left.

        Drops, and demotions into a tier with a free block_id for each block, move all ``take``
        blocks at once. A demotion into a tier that must evict first evicts there while that
        tier's smallest key is strictly below the victim's (``_evict_below``: a per-block cache
        would take exactly those too), then moves as many blocks as there is room for. Past
        that it moves one block: a per-block cache makes room for each block in turn, and the
        block demoted just before may then be that tier's next victim (a chain whose key is
        not above everything there passes through it). The caller's loop comes back for the
        next block, in policy order; the blocks coalesce into one run again as they arrive.
        Under a write-through policy or a hooked eviction policy (whose ``on_leave`` may re-key
        what leaves) only the per-block rule applies."""
        t = node.tier
        n = len(node.hashes)
        if t + 1 == self.num_tiers:
            if self.hooks:
                self.policy.on_leave(node, take)
            if take == n:
                self._drop_node(node, moves)
            else:
                self._drop_tail(node, take, moves)
            return take
        u = t + 1
        # The shortcuts below rely on a block keeping its key as it moves down: true of the key
        # policies, not of a hooked one (its on_leave may re-key what leaves): they stand aside.
        write_back = not self.writes.tiers and not self.hooks
        free = self.pools[u].num_free
        if take > free:
            if write_back:
                # Room first, for as many blocks as it can be made without a choice between a
                # block of tier u and one of this chain: while u's smallest key is strictly
                # below the victim's, a per-block cache would evict exactly that entry too.
                bound = self.evictable[t].key(node)
                free += self._evict_below(u, take - free, bound, moves)
                need = take
            elif self.writes.tiers:
                copy_block_id = self.writes.copy_block_id
                need = take - sum(1 for h in node.hashes[n - take:]
                                  if copy_block_id(h, u) is not None)
            else:
                need = take
            if need > free:
                take = max(1, free)
        if self.hooks:
            self.policy.on_leave(node, take)
        if take == 1 and n > 1 and write_back and self._demote_tail_block(node, u, moves):
            return 1
        if take < n:
            node = self.tree.split(node, n - take)[1]
        self._demote(node, u, moves)
        return take

    def _evict_below(self, tier: int, num: int, bound: Entry, moves: list[MoveOp]) -> int:
        """Evict up to ``num`` blocks of ``tier`` in policy order, stopping at the first entry
        whose key is not strictly below ``bound``. Returns how many left."""
        entries = self.evictable[tier]
        tails = self.tails
        done = 0
        while done < num and entries:
            e = entries.min()
            if e[:-1] >= bound:
                break
            entries.pop_min()
            node = tails.get(e[-1])
            if node is None or node.tier != tier:
                self.writes.drop_popped_copy(e[-1], tier, moves)
                done += 1
                continue
            done += self._move_tail_out(node, entries.take(node, num - done, e), moves)
        return done

    def _demote_tail_block(self, node: Node, u: int, moves: list[MoveOp]) -> bool:
        """The per-block demotion of ``node``'s last block into tier ``u`` without a transient
        node (a write-back tree; ``node`` has 2+ blocks, is out of its index): make room in
        ``u`` for one block, then, if ``node``'s only child is a run in ``u`` it would coalesce
        with (same holders, hints and key), move the block onto that run's front. The same
        steps, moves and state as ``split`` + ``_demote`` + ``coalesce``. False (after
        making room, changing nothing else): take the generic path."""
        dst = self.pools[u]
        if dst.num_free == 0:
            self.evict_from(u, 1, moves)
        c = node.child
        if (c is None or c.next is not None or c.tier != u or c.ref != node.ref
                or c.hints != node.hints or c.aux != node.aux
                or self.evictable[u].key(c) != self.evictable[u].key(node)):
            return False
        t = node.tier
        heads, tails = self.heads, self.tails
        h = node.hashes.pop()
        del tails[h]
        tails[node.hashes[-1]] = node
        old = node.block_ids.pop()
        w = self.block_bytes
        tok = node.tokens[-w:]
        del node.tokens[-w:]
        new = dst.allocate_one()
        moves.append(_tuple_new(MoveOp, (h, t, old, u, new, False)))
        self.pools[t].free_one(old)
        self.block_nodes[t][old] = None
        if t == DEVICE:
            self.tree.unreferenced -= 1
        del heads[c.hashes[0]]
        c.hashes.insert(0, h)
        c.tokens[0:0] = tok
        c.block_ids.insert(0, new)
        heads[h] = c
        self.block_nodes[u][new] = c
        self.resident[t] -= 1
        self.resident[u] += 1
        self.stats.evicted[t] += 1
        self.stats.demoted_in[u] += 1
        self.evictable[node.tier].file(node)   # still a leaf of its tier, under its new last block
        hints = node.hints
        if hints is not None and hints.ttl is not None:
            heapq.heappush(self.ttl_heap, (node.last_access + hints.ttl, node.hashes[-1]))
        return True

    def _demote(self, node: Node, u: int, moves: list[MoveOp]) -> None:
        """Move every block of ``node`` (out of its index) one tier down into ``u``, onto its
        copies there if it has any (free demotions), making room in ``u`` first."""
        t = node.tier
        hashes, old = node.hashes, node.block_ids
        n = len(hashes)
        reuse = self.writes.take_for_demotion(node, u)
        need = n if reuse is None else sum(1 for s in reuse if s is None)
        dst = self.pools[u]
        short = need - dst.num_free
        if short > 0:
            self.evict_from(u, short, moves)
        old_ids = old.tolist()   # one int per block, made once (block_ids are packed)
        if reuse is None:
            # BlockPool.allocate_one for each block, tail first: the tail takes the top of
            # the free list
            new = dst.take_top(n)
            new_ids = new.tolist()
            moves += [_tuple_new(MoveOp, (hashes[i], t, old_ids[i], u, new_ids[i], False))
                      for i in range(n - 1, -1, -1)]
        else:
            new = array("i", bytes(4 * n))
            for i in range(n - 1, -1, -1):
                s = reuse[i]
                if s is None:
                    s = dst.allocate_one()
                    moves.append(_tuple_new(MoveOp, (hashes[i], t, old[i], u, s, False)))
                else:
                    self.stats.free_demotions += 1
                new[i] = s
        # BlockPool.free_one for each block, deepest first (an evictable node's device blocks
        # have no pool references: its holders are counted in ``node.ref``, now 0)
        self.pools[t].free_run(old[::-1], self.block_nodes[t])
        if t == DEVICE:
            self.tree.unreferenced -= n
        sn = self.block_nodes[u]
        for s in new:
            sn[s] = node
        node.block_ids = new
        node.tier = u
        parent = node.parent
        if parent is not None:
            self.tree.add_child_count(parent, t, -1)
            self.tree.add_child_count(parent, u, 1)
        self.resident[t] -= n
        self.resident[u] += n
        self.stats.evicted[t] += n
        self.stats.demoted_in[u] += n
        self.evictable[node.tier].file(node)
        kid = node.child
        if kid is not None and kid.next is None and kid.tier == u:
            self.tree.coalesce(node, kid)   # back onto its own tail demoted before

    def _drop_tail(self, node: Node, take: int, moves: list[MoveOp]) -> None:
        """The last ``take`` blocks of ``node`` (an evictable leaf of the last tier, out of its
        index, with no children) leave the cache; the rest stays, filed under its new tail."""
        t = node.tier
        cut = len(node.hashes) - take
        events = self.tree.events
        if events is not None:
            events.append(self.tree.removed_event(node, cut))
        self._free_blocks(node, cut, moves)
        del self.tails[node.hashes[-1]]
        self.tails[node.hashes[cut - 1]] = node
        del node.hashes[cut:]
        del node.tokens[cut * self.block_bytes:]
        del node.block_ids[cut:]
        self.stats.evicted[t] += take
        self.evictable[node.tier].file(node)
        hints = node.hints
        if hints is not None and hints.ttl is not None:
            heapq.heappush(self.ttl_heap, (node.last_access + hints.ttl, node.hashes[-1]))

    def _drop_node(self, node: Node, moves: list[MoveOp]) -> None:
        """``node`` (out of its index, with no children) leaves the cache."""
        assert node.children == 0 and node.child is None, f"dropping {node} would orphan children"
        events = self.tree.events
        if events is not None:
            events.append(self.tree.removed_event(node, 0))
        self._free_blocks(node, 0, moves)
        del self.heads[node.hashes[0]]
        del self.tails[node.hashes[-1]]
        if node.parent is not None:
            self.tree.unlink(node)
        self.stats.evicted[node.tier] += len(node.hashes)

    def _free_blocks(self, node: Node, cut: int, moves: list[MoveOp]) -> None:
        """Free blocks ``[cut, n)`` of ``node`` (deepest first), emitting drops (none for a
        device-only tree: see ``_evict_device_fast``). The node's lists and its head and tail
        entries are left to the caller."""
        t = node.tier
        hashes, block_ids = node.hashes, node.block_ids
        pool = self.pools[t]
        sn = self.block_nodes[t]
        if self.num_tiers > 1:
            for i in range(len(hashes) - 1, cut - 1, -1):
                h, s = hashes[i], block_ids[i]
                pool.free_one(s)
                sn[s] = None
                moves.append(_tuple_new(MoveOp, (h, t, s, None, None, False)))
        else:       # no drops to report: the blocks go back in one pass, deepest first
            pool.free_run(block_ids[:cut - 1:-1] if cut else block_ids[::-1], sn)
        k = len(hashes) - cut
        self.resident[t] -= k
        if t == DEVICE:
            self.tree.unreferenced -= k
        self.stats.dropped += k


    # ------------------------------------------------------------------ the device-only LRU loop
    def _evict_device_fast(self, num: int, moves: list[MoveOp]) -> bool:
        """``evict_from(DEVICE, num)`` in one loop where there is one (a device-only tree
        whose index can pop and peek at once: LRU's ``RecencyIndex``, the forecast's
        ``ForecastIndex``); False (nothing done): take the generic path.

        A device-only tree reports no per-block drops: a block dropped from the device needs
        no storage work (its id is simply allocated again), so no ``MoveOp`` is built for it."""
        entries = self.evictable[DEVICE]
        if self.num_tiers != 1 or self.tree.events is not None or \
                not hasattr(entries.index, "pop_min_peek"):
            return False
        self._drop_device_lru(entries, num,
                              not (self._lru and type(entries.index) is RecencyIndex))
        return True

    def _drop_device_lru(self, entries: EvictableSet, num: int, keyed: bool = False) -> None:
        """Device-only eviction, victim node by victim node, through the evictable set's
        ``pop_min`` / ``take`` / ``add`` (the same steps and order as the generic loop). A
        victim node's blocks leave together: one pass over their hashes and block_ids, no call per
        block. A node only partly taken is cut in place (its head stays, filed under its new
        last block). ``keyed``: the policy is not LRU (entries are ``entries.entry(node)``,
        ties compare whole keys, and a hooked policy hears ``on_leave`` as in the generic
        loop)."""
        heads, tails, dn = self.heads, self.tails, self.device_nodes
        free_run = self.pools[DEVICE].free_run
        # not in the EvictionIndex protocol: _evict_device_fast checked hasattr first
        pop_min_peek = entries.index.pop_min_peek   # type: ignore[attr-defined]
        add, take_of, entry = entries.add, entries.take, entries.entry
        on_leave = (self.policy.on_leave if keyed and self.hooks
                    and type(self.policy).on_leave is not EvictionPolicy.on_leave else None)
        w = self.block_bytes
        dropped = 0
        p: Node | None
        try:
            while num > 0:
                e, nxt = pop_min_peek()
                node = tails[e[-1]]
                hashes, block_ids = node.hashes, node.block_ids
                n = len(hashes)
                assert not node.children and node.ref == 0, f"evicting a non-leaf or held {node}"
                take = n if num >= n else num
                if take > 1 and nxt is not None and (nxt[:-1] == e[:-1] if keyed
                                                     else nxt[0] == e[0]):
                    take = take_of(node, num, e)   # a tie: per-block (hash) order decides
                if on_leave is not None:
                    on_leave(node, take)
                cut = n - take
                gone_s = block_ids[:cut - 1:-1] if cut else block_ids[::-1]   # deepest first
                del tails[hashes[-1]]
                free_run(gone_s, dn)
                if cut:                        # the head stays, filed under its new tail
                    tails[hashes[cut - 1]] = node
                    del hashes[cut:]
                    del node.tokens[cut * w:]
                    del block_ids[cut:]
                    p = node
                else:                          # the whole node leaves: unlink it
                    del heads[hashes[0]]
                    p = node.parent
                    if p is not None:
                        a, b = node.prev, node.next
                        if a is None:
                            p.child = b
                        else:
                            a.next = b
                        if b is not None:
                            b.prev = a
                        c = p.children - 1
                        p.children = c
                        if c or p.ref:
                            p = None           # not an evictable leaf
                if p is not None:
                    add(entry(p) if keyed else (p.last_access, p.hashes[-1]))
                    hints = p.hints
                    if cut and hints is not None and hints.ttl is not None:
                        self.tree.rearm_ttl(p)
                num -= take
                dropped += take
        finally:
            self.resident[DEVICE] -= dropped
            self.tree.unreferenced -= dropped
            self.stats.evicted[DEVICE] += dropped
            self.stats.dropped += dropped

    # ------------------------------------------------------------------ to the device
    def promote_nodes(self, nodes: list[Node], block_ids: list[BlockId], now: float
                      ) -> list[MoveOp]:
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
            sn = self.block_nodes[t]
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
            self.tree.coalesce(node.parent, node)
        return moves

    def _rehome_on_device(self, node: Node, block_ids: list[BlockId]
                          ) -> tuple[int, array[int], list[int] | None]:
        """Move slower-tier ``node`` (whose parent is on the device) onto device blocks
        ``block_ids``: out of its tier's index, child counts, device map, residency counts.
        Returns ``(old tier, old block_ids, copies to re-file)``; the caller sets holders and key
        and decides what becomes of the old block_ids."""
        t = node.tier
        assert t != DEVICE and (node.parent is None or node.parent.tier == DEVICE), node
        self.evictable[node.tier].unfile(node)
        refile = self.writes.unfile(node)
        old = node.block_ids
        parent = node.parent
        if parent is not None:
            self.tree.add_child_count(parent, t, -1)
            self.tree.add_child_count(parent, DEVICE, 1)
        dn = self.device_nodes
        node.tier = DEVICE
        node.block_ids = array("i", block_ids)
        for b in block_ids:
            dn[b] = node
        n = len(block_ids)
        self.resident[t] -= n
        self.resident[DEVICE] += n
        self.stats.promoted[t] += n
        return t, old, refile

    def promote_head_block(self, node: Node, parent: Node, block_id: BlockId, now: float
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
        old = node.block_ids.pop(0)
        w = self.block_bytes
        tok = node.tokens[:w]
        del node.tokens[:w]
        b = block_id
        del tails[parent.hashes[-1]]
        tails[h] = parent
        parent.hashes.append(h)
        parent.tokens += tok
        parent.block_ids.append(b)
        self.block_nodes[t][old] = None
        self.device_nodes[b] = parent
        self.pools[t].free_one(old)
        self.resident[t] -= 1
        self.resident[DEVICE] += 1
        self.stats.promoted[t] += 1
        return _tuple_new(MoveOp, (h, t, old, DEVICE, b, False))

    def adopt(self, node: Node, block_ids: list[BlockId]) -> Node:
        """The first ``len(block_ids)`` blocks of slower-tier ``node`` were recomputed into
        device blocks ``block_ids`` (held; their pool refcounts move into the node): they
        become those blocks, and nothing is loaded. Their old residency is released (a drop
        is queued for ``take_moves``, so that a disk file does not outlive the tier's claim on
        it) or kept as a copy in a write-through tier. Returns the adopted node."""
        k = len(block_ids)
        if k < len(node.hashes):
            node = self.tree.split(node, k)[0]
        refs, dn = self.pools[DEVICE].ref_counts, self.device_nodes
        ref = refs[block_ids[0]]
        for b in block_ids:
            assert refs[b] == ref and dn[b] is None, f"adopt into block {b}"
            refs[b] = 0
        t, old, refile = self._rehome_on_device(node, block_ids)
        node.ref = ref
        sn = self.block_nodes[t]
        for s in old:
            sn[s] = None
        if not self.writes.keep_sources(node, t, old):
            src = self.pools[t]
            for h, s in zip(node.hashes, old):
                src.free_one(s)
                self.tree.pending_moves.append(_tuple_new(MoveOp, (h, t, s, None, None, False)))
        self.stats.adopted += k
        if ref == 0:
            self.tree.unreferenced += k
        self.evictable[node.tier].file(node)
        if refile is not None:
            self.writes.refile(node, refile)
        return node

    # ------------------------------------------------------------------ slower tiers
    def promote_lower(self, block_hash: BlockHash, tier: int, max_blocks: int | None = None
                      ) -> list[MoveOp]:
        """Move the slower-tier node that starts with ``block_hash`` (at most ``max_blocks``
        of its blocks) up into the faster non-device ``tier``: a prefetch (disk -> host),
        making room there by evicting leaf-first like any eviction. The node's parent must be
        in a tier <= ``tier`` (prefix closure); it is kept out of the victims. The node's old
        block_ids are freed before room is made, so victims demoted into its old tier take them
        (the node's bytes are still read from its old block_ids: run the moves in order). If the
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
        k = min(k, dst.num_free + self.tree.num_evictable(tier) - pinned)
        if k <= 0:
            return []
        if k < len(node.hashes):
            node = self.tree.split(node, k)[0]
        moves = self.tree.take_moves()
        self.evictable[node.tier].unfile(node)
        refile = self.writes.unfile(node)
        if guard is not None:
            self.evictable[guard.tier].unfile(guard)
        old = node.block_ids
        src = self.pools[t]
        sn = self.block_nodes[t]
        for s in reversed(old):
            src.free_one(s)   # a victim demoted into tier t may take these
            sn[s] = None
        short = k - dst.num_free
        if short > 0:
            self.evict_from(tier, short, moves)
        if guard is not None:
            self.evictable[guard.tier].file(guard)
        new = array("i", [dst.allocate_one() for _ in range(k)])
        sn = self.block_nodes[tier]
        for s in new:
            sn[s] = node
        if parent is not None:
            self.tree.add_child_count(parent, t, -1)
            self.tree.add_child_count(parent, tier, 1)
        node.tier = tier
        node.block_ids = new
        node.last_access = self.clock()
        self.resident[t] -= k
        self.resident[tier] += k
        keep = False
        if t in self.writes.tiers and all(src.is_free(s) for s in old):
            # Nothing was allocated in tier t since the frees (else LIFO gave them away).
            took = array("i", [src.allocate_one() for _ in old])
            assert took == old, f"tier {t}: re-took block_ids {took}, expected {old}"
            keep = self.writes.keep_sources(node, t, old)
        self.evictable[node.tier].file(node)
        if refile is not None:
            self.writes.refile(node, refile)
        for h, s, d in zip(node.hashes, old, new):
            moves.append(_tuple_new(MoveOp, (h, t, s, tier, d, keep)))
        return moves

    def insert_lower(self, parent_hash: BlockHash | None, block_hash: BlockHash, tokens: bytes,
                     tier: int) -> BlockRef | None:
        """Cache a block that already lives in slower tier ``tier`` (found on disk at start,
        fetched from the remote tier) after cached block ``parent_hash`` (None: a root).

        Returns its ``BlockRef`` (its block_id is where the caller puts the bytes), or None
        (changing nothing) if the tier is full (primaries and copies), the hash is cached or
        the parent is not. The parent must be in a tier <= ``tier``; a parent that is a same-
        tier run's last block with nothing after it is extended (one node per restored chain).
        Runtime complexity: O(1) when the parent ends its node (a chain restored or installed
        in order); a parent inside a node is found by a scan of the nodes (``find``) and the
        node cut after it.
        """
        assert 0 < tier < self.num_tiers, f"insert_lower into tier {tier}"
        pool = self.pools[tier]
        if pool.num_free == 0 or len(tokens) != self.block_bytes or block_hash in self.heads \
                or block_hash in self.tails:
            return None
        parent = None
        if parent_hash is not None:
            parent = self.tree.find(parent_hash)
            if parent is None:
                return None
            i = parent.hashes.index(parent_hash)
            if i + 1 < len(parent.hashes):
                if parent.hashes[i + 1] == block_hash:
                    return None   # cached inside the parent's run
                parent = self.tree.split(parent, i + 1)[0]
        assert parent is None or parent.tier <= tier, "parent must be in a faster or equal tier"
        block_id = pool.allocate_one()
        now = self.clock()
        if parent is not None and parent.tier == tier and parent.child is None and \
                parent.hints is None:
            self.evictable[parent.tier].unfile(parent)
            node = parent
            del self.tails[node.hashes[-1]]
            self.tails[block_hash] = node
            node.hashes.append(block_hash)
            node.tokens += tokens
            node.block_ids.append(block_id)
            node.last_access = now
            if self.hooks:
                self.policy.on_insert(node, len(node.hashes) - 1, now)
        else:
            node = Node([block_hash], bytearray(tokens), [block_id], tier, None, now)
            self.heads[block_hash] = node
            self.tails[block_hash] = node
            if self.hooks:
                self.policy.on_insert(node, 0, now)
            if parent is not None:
                self.tree.link(parent, node)
        self.block_nodes[tier][block_id] = node
        self.resident[tier] += 1
        self.evictable[node.tier].file(node)
        events = self.tree.events
        if events is not None:
            events.append(BlockStored((block_hash,), parent_hash, bytes(tokens), tier, (block_id,)))
        return self.tree.block_ref(node, len(node.hashes) - 1)

    def invalidate(self, block_hash: BlockHash) -> list[MoveOp]:
        """Drop cached block ``block_hash`` and everything after it (the rest of its node and
        every descendant), in any tier, with all their copies (its bytes proved bad, e.g. a
        disk block that failed its checksum on load). Returns drop MoveOps (dst None): queued
        write-through moves first, then deepest node first, each node's copies before its own
        blocks, each node's blocks last first. Everything dropped must be unheld (raises
        InvalidBlockError, changing nothing, otherwise). Runtime complexity: O(dropped blocks).
        """
        node = self.tree.find(block_hash)
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
            order[0] = self.tree.split(node, i)[1]
        moves = self.tree.take_moves()
        writes = self.writes
        for n in reversed(order):
            # (not an eviction: the policy's hooks do not hear of it)
            self.evictable[n.tier].unfile(n)
            if self.tree.events is not None:
                self.tree.events.append(self.tree.removed_event(n, 0))
            t = n.tier
            pool = self.pools[t]
            sn = self.block_nodes[t]
            del self.heads[n.hashes[0]]
            del self.tails[n.hashes[-1]]
            for h, s in zip(reversed(n.hashes), reversed(n.block_ids)):
                writes.drop_block_copies(n, h, moves)   # each block's copies, then itself
                pool.free_one(s)
                sn[s] = None
                moves.append(_tuple_new(MoveOp, (h, t, s, None, None, False)))
            k = len(n.hashes)
            self.resident[t] -= k
            if t == DEVICE:
                self.tree.unreferenced -= k
            self.stats.dropped += k
            if n.parent is not None:
                self.tree.unlink(n)
        return moves


    # ------------------------------------------------------------------ expiry
    def evict_expired(self, now: float | None = None) -> list[MoveOp]:
        """Evict every block whose TTL has run out at ``now``, fastest tier first.

        Two sources of TTLs: the policy's own (``TTLPolicy``: every block, in key order) and,
        under *any* policy, a per-block ``ttl`` hint (``set_hints``, e.g. a request's cache
        breakpoint "5m"): those are kept in a heap of due times, checked lazily here (a block
        used since is re-armed, one still held or with children in its tier is re-checked
        later). Expired blocks are demoted like any victim, so they leave the cache through
        the slower tiers, where they are expired in turn; expired copies are dropped.
        Returns the moves (queued write-through moves first). O(expired blocks + nodes log n).
        """
        now = self.clock() if now is None else now
        moves = self.tree.take_moves()
        expired = self.policy.expired
        for tier in range(self.num_tiers):
            entries = self.evictable[tier]
            while entries and expired(entries.min(), now):
                h = entries.pop_min()[-1]
                node = self.tails.get(h)   # a node is filed under its last block
                if node is not None and node.tier == tier:
                    self.stats.expired += self._move_tail_out(node, len(node.hashes), moves)
                else:
                    self.stats.expired += 1
                    self.writes.drop_popped_copy(h, tier, moves)
        self._expire_hinted(now, moves)
        return moves

    def next_expiry(self) -> float | None:
        """The earliest due time of a per-block TTL hint (None: none set): when calling
        ``evict_expired`` can next do something for hinted blocks."""
        return self.ttl_heap[0][0] if self.ttl_heap else None

    def _expire_hinted(self, now: float, moves: list[MoveOp]) -> None:
        """Hinted nodes whose TTL ran out move out of their tier, at most once each per call,
        in ``(due, hash)`` order, in passes until one moves nothing: an expired leaf's going
        can make its expired parent evictable, which the next pass takes, so a whole expired
        chain leaves in one call. A node that is held (or keeps an unexpired child) stays due
        and is tried again at the next call. A demoted node leaves its next tier at a later
        call."""
        heap = self.ttl_heap
        moved: set[int] = set()
        while True:
            progressed = False
            later: list[tuple[float, bytes]] = []
            popped: set[int] = set()
            while heap and heap[0][0] <= now:
                armed, h = heapq.heappop(heap)
                node = self.tails.get(h)
                if node is None or node.hints is None or node.hints.ttl is None or \
                        node.hashes[-1] != h or id(node) in popped:
                    continue   # gone, TTL lifted, no longer a node's end, or a duplicate
                due = node.last_access + node.hints.ttl
                if due != armed:
                    heapq.heappush(heap, (due, h))   # used (or re-hinted) since: its real turn
                    continue
                popped.add(id(node))
                if id(node) not in moved and self.evictable[node.tier].qualifies(node):
                    ev = self.evictable[node.tier]
                    ev.remove(ev.entry(node))
                    moved.add(id(node))
                    n = len(node.hashes)
                    self.stats.expired += self._move_tail_out(node, n, moves)
                    progressed = True
                if self.tails.get(h) is not None:   # still a node's end (held, or demoted)
                    later.append((due, h))
            for item in later:
                heapq.heappush(heap, item)
            if not progressed:
                return
