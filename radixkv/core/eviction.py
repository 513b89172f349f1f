"""Eviction and demotion: how blocks leave a tier of the ``RadixTree``.

``EvictionOps`` is a mixin of ``RadixTree``. ``evict(tier, n)`` takes ``n`` blocks out of a tier
in the policy's order, leaves first, block by block from the tail of each victim run, exactly as
a per-block cache would (``EvictableSet.take`` breaks equal keys by block hash): from the last tier they are
dropped, from the others demoted into the next tier, making room there first. Where no choice
between the next tier's blocks and the victim's can arise (its smallest key is strictly below the
victim's, ``_evict_below``, or it has free slots) a victim's blocks move together; otherwise one
at a time, straight onto the run below them (``_demote_tail_block``). Every change of residency is
a ``MoveOp`` appended in execution order (a device-only tree reports no drops: they need no
storage work). The device-only LRU loop with the index inlined is ``request_ops._drop_device_lru``.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from radixkv.core.evictable import EvictableSet
from radixkv.core.node import DEVICE, BlockRef, MoveOp, Node, TreeStats
from radixkv.core.pool import BlockPool
from radixkv.errors import InvalidBlockError, OutOfBlocks

if TYPE_CHECKING:
    from radixkv.core.policy import EvictionPolicy
    from radixkv.core.writes import TreeWrites

_tuple_new = tuple.__new__


class EvictionOps:
    """Eviction of ``RadixTree`` (a mixin; see the module docstring)."""

    num_tiers: int
    stats: TreeStats
    writes: TreeWrites
    policy: EvictionPolicy
    hooks: bool
    block_bytes: int
    pools: list[BlockPool]
    heads: dict[bytes, Node]
    tails: dict[bytes, Node]
    slot_nodes: list[list[Node | None]]
    evictable: list[EvictableSet]
    _resident: list[int]
    _unreferenced: int
    device_nodes: list[Node | None]
    ttl_heap: list[tuple[float, bytes]]
    pending_moves: list[MoveOp]
    drop_listener: Callable[[list[BlockRef]], None] | None

    if TYPE_CHECKING:  # RadixTree's own helpers, used here
        def _ref(self, node: Node, i: int) -> BlockRef: ...
        def split(self, node: Node, k: int) -> tuple[Node, Node]: ...
        def _unlink(self, node: Node) -> None: ...
        def coalesce(self, parent: Node | None, child: Node) -> Node: ...
        def _add_child_count(self, parent: Node, tier: int, delta: int) -> None: ...
        def num_evictable(self, tier: int = DEVICE) -> int: ...
        def _evict_device_fast(self, num: int, moves: list[MoveOp]) -> bool: ...

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
            raise OutOfBlocks(num_blocks, self.pools[tier].num_free, available,
                              "every cached block of this tier is in use by a live sequence")
        moves = self.pending_moves    # queued write-through moves run first
        self.pending_moves = []
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

        Drops, and demotions into a tier with a free slot for each block, move all ``take``
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
                free += self._evict_below(u, take - free, self.evictable[node.tier].key(node), moves)
                need = take
            elif self.writes.tiers:
                copy_slot = self.writes.copy_slot
                need = take - sum(1 for h in node.hashes[n - take:]
                                  if copy_slot(h, u) is not None)
            else:
                need = take
            if need > free:
                take = max(1, free)
        if self.hooks:
            self.policy.on_leave(node, take)
        if take == 1 and n > 1 and write_back and self._demote_tail_block(node, u, moves):
            return 1
        if take < n:
            node = self.split(node, n - take)[1]
        self._demote(node, u, moves)
        return take

    def _evict_below(self, tier: int, num: int, bound: tuple, moves: list[MoveOp]) -> int:
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
        steps, moves and state as ``_split`` + ``_demote`` + ``_coalesce``. False (after
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
        old = node.slots.pop()
        w = self.block_bytes
        tok = node.tokens[-w:]
        del node.tokens[-w:]
        new = dst.allocate_one()
        moves.append(_tuple_new(MoveOp, (h, t, old, u, new, False)))
        self.pools[t].free_one(old)
        self.slot_nodes[t][old] = None
        if t == DEVICE:
            self._unreferenced -= 1
        del heads[c.hashes[0]]
        c.hashes.insert(0, h)
        c.tokens[0:0] = tok
        c.slots.insert(0, new)
        heads[h] = c
        self.slot_nodes[u][new] = c
        self._resident[t] -= 1
        self._resident[u] += 1
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
        hashes, old = node.hashes, node.slots
        n = len(hashes)
        reuse = self.writes.take_for_demotion(node, u)
        need = n if reuse is None else sum(1 for s in reuse if s is None)
        dst = self.pools[u]
        short = need - dst.num_free
        if short > 0:
            self.evict_from(u, short, moves)
        old_ids = old.tolist()   # one int per block, made once (slots are packed)
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
        self.pools[t].free_run(old[::-1], self.slot_nodes[t])
        if t == DEVICE:
            self._unreferenced -= n
        sn = self.slot_nodes[u]
        for s in new:
            sn[s] = node
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
        self.evictable[node.tier].file(node)
        kid = node.child
        if kid is not None and kid.next is None and kid.tier == u:
            self.coalesce(node, kid)   # back onto its own tail demoted before

    def _drop_tail(self, node: Node, take: int, moves: list[MoveOp]) -> None:
        """The last ``take`` blocks of ``node`` (an evictable leaf of the last tier, out of its
        index, with no children) leave the cache; the rest stays, filed under its new tail."""
        t = node.tier
        cut = len(node.hashes) - take
        if self.drop_listener is not None:
            self.drop_listener([self._ref(node, i) for i in range(len(node.hashes) - 1, cut - 1, -1)])
        self._free_blocks(node, cut, moves)
        del self.tails[node.hashes[-1]]
        self.tails[node.hashes[cut - 1]] = node
        del node.hashes[cut:]
        del node.tokens[cut * self.block_bytes:]
        del node.slots[cut:]
        self.stats.evicted[t] += take
        self.evictable[node.tier].file(node)
        hints = node.hints
        if hints is not None and hints.ttl is not None:
            heapq.heappush(self.ttl_heap, (node.last_access + hints.ttl, node.hashes[-1]))

    def _drop_node(self, node: Node, moves: list[MoveOp]) -> None:
        """``node`` (out of its index, with no children) leaves the cache."""
        assert node.children == 0 and node.child is None, f"dropping {node} would orphan children"
        if self.drop_listener is not None:
            self.drop_listener([self._ref(node, i) for i in range(len(node.hashes) - 1, -1, -1)])
        self._free_blocks(node, 0, moves)
        del self.heads[node.hashes[0]]
        del self.tails[node.hashes[-1]]
        if node.parent is not None:
            self._unlink(node)
        self.stats.evicted[node.tier] += len(node.hashes)

    def _free_blocks(self, node: Node, cut: int, moves: list[MoveOp]) -> None:
        """Free blocks ``[cut, n)`` of ``node`` (deepest first), emitting drops (none for a
        device-only tree: see ``_evict_device_fast``). The node's lists and its head and tail
        entries are left to the caller."""
        t = node.tier
        hashes, slots = node.hashes, node.slots
        pool = self.pools[t]
        sn = self.slot_nodes[t]
        report = self.num_tiers > 1
        for i in range(len(hashes) - 1, cut - 1, -1):
            h, s = hashes[i], slots[i]
            pool.free_one(s)
            sn[s] = None
            if report:
                moves.append(_tuple_new(MoveOp, (h, t, s, None, None, False)))
        k = len(hashes) - cut
        self._resident[t] -= k
        if t == DEVICE:
            self._unreferenced -= k
        self.stats.dropped += k
