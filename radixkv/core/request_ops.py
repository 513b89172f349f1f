"""The block manager's per-request paths through the ``RadixTree``: one pass per request.

``RequestOps`` is a mixin of ``RadixTree`` (like ``TierOps``): ``lock_blocks`` / ``lock_nodes``
(allocate, fork), ``release_blocks`` (free), ``insert_run`` (commit), and the device eviction
loops ``_drop_device`` (a device-only tree) and ``_demote_device_lru`` (a tiered LRU tree). Each
does, for a whole request, what the per-node methods (``lock``, ``release``, ``insert``,
``_evict_one``) do one block at a time, with the same result, but each block costs a few list
and attribute operations and no method-call chain. A node enters or leaves its tier's eviction
index only where its refcount crosses zero *and* it is a leaf in its tier; in a sequence's chain
that is at most its deepest node, so the index is touched O(1) times per request. This is what
path compression would buy (lock, release and touch O(1) per request), kept with one node per
block, which the tiers need (architecture.md). Write-through trees take the per-node methods
(their copies are re-filed around each change).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import xxhash

from radixkv.core.evict_index import EvictionIndex, RecencyIndex
from radixkv.core.hashing import TOKEN_BYTES
from radixkv.core.node import _CBITS, _CMASK, DEVICE, MoveOp, Node, TreeStats
from radixkv.core.pool import BlockPool

_xxh3_128 = xxhash.xxh3_128_digest
_tuple_new = tuple.__new__


class RequestOps:
    """Batched per-request operations of ``RadixTree`` (a mixin; see the module docstring)."""

    block_size: int
    num_tiers: int
    clock: Callable[[], float]
    stats: TreeStats
    _pools: list[BlockPool]
    _refs: list[int]
    _index: dict[bytes, Node]
    _evictable: list[EvictionIndex]
    _resident: list[int]
    _unreferenced: int
    _device_nodes: list[Node | None]
    _hints: dict
    _wt: tuple[int, ...]
    _lru: bool
    drop_listener: Callable[[Node], None] | None
    insert_listener: Callable[[list[Node]], None] | None
    #: Device evictions of a tiered write-back LRU tree take ``_demote_device_lru``; a tree
    #: with this set to False takes the generic per-node path (for the differential test).
    _inline_demotion = True

    if TYPE_CHECKING:  # RadixTree's own helpers, used here
        def _entry(self, node: Node) -> tuple: ...
        def _insert(self, parent: Node | None, block_hash: bytes, tokens: bytes, block_id: int,
                    now: float) -> Node: ...
        def lock(self, node: Node, now: float | None = None) -> None: ...
        def release(self, node: Node, now: float | None = None) -> None: ...
        def _drop(self, node: Node) -> None: ...

    def lock_blocks(self, block_ids: Iterable[int], now: float | None = None) -> None:
        """Take one reference on each device block: ``lock`` for cached ones, a plain refcount
        for private ones (a fork sharing a sequence's blocks). Every block must be allocated.
        Runtime complexity: O(blocks), plus O(1) index work per block whose node was evictable
        (O(log n) under a ``SortedIndex`` policy)."""
        now = self.clock() if now is None else now
        refs, nodes = self._refs, self._device_nodes
        if self._wt:
            for b in block_ids:
                node = nodes[b]
                if node is None:
                    refs[b] += 1
                else:
                    self.lock(node, now)
            return
        index, entry = self._evictable[DEVICE], self._entry
        unref = 0
        for b in block_ids:
            node = nodes[b]
            r = refs[b]
            if node is not None:
                if r == 0:
                    unref += 1
                    if not node.children & _CMASK:
                        index.remove(entry(node))   # leaves the index before its key changes
                node.last_access = now
                node.hits += 1
            refs[b] = r + 1
        self._unreferenced -= unref

    def lock_nodes(self, nodes: Iterable[Node], now: float | None = None) -> None:
        """``lock`` every node of ``nodes`` (all on the device) in one pass. O(nodes)."""
        self.lock_blocks([x.slot for x in nodes], now)

    def release_blocks(self, block_ids: Iterable[int], now: float | None = None) -> None:
        """Drop one reference on each device block: ``release`` for cached ones; a private
        block is freed into the device pool when its count reaches 0. Pass a sequence's blocks
        deepest first. Runtime complexity: O(blocks), plus O(1) index work per node that
        becomes evictable (O(log n) under a ``SortedIndex`` policy)."""
        now = self.clock() if now is None else now
        refs, nodes, pool = self._refs, self._device_nodes, self._pools[DEVICE]
        wt = self._wt
        index, entry = self._evictable[DEVICE], self._entry
        unref = 0
        for b in block_ids:
            node = nodes[b]
            r = refs[b] - 1
            assert r >= 0, f"release of unreferenced device block {b}"
            if node is None:
                refs[b] = r
                if r == 0:
                    pool.free_one(b)
            elif wt:
                self.release(node, now)
            else:
                refs[b] = r
                if r == 0:
                    unref += 1
                    node.last_access = now
                    if not node.children & _CMASK:
                        index.add(entry(node))
        self._unreferenced += unref

    def insert_run(self, parent: Node | None, prev_hash: bytes, tok_bytes: bytes,
                   block_ids: Sequence[int], now: float,
                   first_hash: bytes | None = None) -> list[Node]:
        """Cache consecutive computed device blocks as a chain under ``parent`` in one pass.

        ``tok_bytes`` holds the blocks' tokens (``len(block_ids)`` full blocks) and
        ``prev_hash`` is the chain hash of ``parent`` (the namespace seed at the root). Each
        block is hashed and inserted as the child of the previous one, as ``insert`` would,
        until one whose hash is already cached: the nodes inserted before it are returned
        (the caller decides what to do with that block). The blocks must be held by the caller
        (refcount > 0) and uncached; the parent must be on the device (the block manager's
        commit guarantees both, so they are not re-checked here). ``first_hash``: the first
        block's chain hash, if the caller has it already (it is not hashed again).
        Runtime complexity: O(blocks) (+ the write-through copies' evictions).
        """
        if self._wt:
            out = []
            width = self.block_size * TOKEN_BYTES
            h = prev_hash
            for k, b in enumerate(block_ids):
                chunk = tok_bytes[k * width:(k + 1) * width]
                h = _xxh3_128(h + chunk)
                if h in self._index:
                    break
                parent = self._insert(parent, h, chunk, b, now)
                out.append(parent)
            if out and self.insert_listener is not None:
                self.insert_listener(out)
            return out
        width = self.block_size * TOKEN_BYTES
        index, device_nodes, refs = self._index, self._device_nodes, self._refs
        canonical = self._pools[DEVICE]._ids
        xxh = _xxh3_128
        new_node = object.__new__
        out: list[Node] = []
        append = out.append
        h = prev_hash
        start = 0
        for b in block_ids:
            chunk = tok_bytes[start:start + width]
            start += width
            if first_hash is None:
                h = xxh(h + chunk)
            else:
                h, first_hash = first_hash, None
            if h in index:
                break
            assert refs[b] > 0 and device_nodes[b] is None, f"insert_run of block {b}"
            # Node(h, parent, chunk, DEVICE, slot, now) field by field: no __init__ frame
            # (248 -> 168 ns a node here); the same fields as Node.__init__ sets.
            node = new_node(Node)
            node.block_hash = h
            node.parent = parent
            node.tokens = chunk
            node.tier = DEVICE
            node.slot = canonical[b]
            node.children = 0
            node.last_access = now
            node.hits = 0
            node.child = None
            if parent is not None:
                parent.child = node
            index[h] = node
            device_nodes[b] = node
            append(node)
            parent = node
        n = len(out)
        if n:
            first_parent = out[0].parent
            if first_parent is not None:
                c = first_parent.children
                if not c & _CMASK and refs[first_parent.slot] == 0:
                    self._evictable[DEVICE].remove(self._entry(first_parent))
                first_parent.children = c + 1
            for node in out[:-1]:
                node.children = 1        # its child in the run, on the device
            self._resident[DEVICE] += n
            self.stats.inserted += n
            if self.insert_listener is not None:
                self.insert_listener(out)
        return out

    def _evict_device(self, num_blocks: int, moves: list[MoveOp]) -> bool:
        """``evict(DEVICE, n)`` in one loop where there is one: a device-only tree drops its
        victims (``_drop_device``), a tiered write-back LRU tree demotes them into tier 1
        (``_demote_device_lru``). False (nothing done): take the per-node path."""
        if self.num_tiers == 1:
            self._drop_device(num_blocks, moves)
            return True
        if self._inline_demotion and not self._wt and self._lru and \
                type(self._evictable[DEVICE]) is RecencyIndex:
            self._demote_device_lru(num_blocks, moves)
            return True
        return False

    def _drop_device(self, num_blocks: int, moves: list[MoveOp]) -> None:
        """``evict`` of a device-only tree in one loop: each victim leaves the cache.

        The same steps as ``_evict_one`` -> ``_move_out`` -> ``_drop`` for this case, without
        the calls: pop the policy's minimum, unmap it, re-file its parent if that became an
        unreferenced leaf, free the block. O(1) per block with a ``RecencyIndex``, whose pop
        and add are inlined for LRU (``_drop_device_lru``).
        """
        entries = self._evictable[DEVICE]
        if self._lru and type(entries) is RecencyIndex and self.drop_listener is None:
            self._drop_device_lru(entries, num_blocks, moves)
            return
        index, hints = self._index, self._hints
        device_nodes, refs, entry = self._device_nodes, self._refs, self._entry
        lru = self._lru
        pop_min, add = entries.pop_min, entries.add
        pool = self._pools[DEVICE]
        is_free, free_append, ids = pool._is_free, pool._free.append, pool._ids
        append = moves.append
        listener = self.drop_listener
        for _ in range(num_blocks):
            h = pop_min()[-1]
            if listener is not None:
                listener(index[h])
            node = index.pop(h)
            slot = node.slot
            assert not node.children and refs[slot] == 0, f"evicting a non-leaf or held {node}"
            device_nodes[slot] = None
            if hints:
                hints.pop(h, None)
            p = node.parent
            if p is not None:
                if p.child is node:
                    p.child = None
                c = p.children - 1
                p.children = c
                if not c and refs[p.slot] == 0:  # the parent is now an evictable leaf
                    add((p.last_access, p.block_hash) if lru else entry(p))
            is_free[slot] = 1                    # BlockPool.free_one, inlined
            free_append(ids[slot])
            append(_tuple_new(MoveOp, (h, DEVICE, slot, None, None, False)))
        self._count_drops(num_blocks)

    def _demote_device_lru(self, num_blocks: int, moves: list[MoveOp]) -> None:
        """``evict(DEVICE, n)`` of a tiered write-back LRU tree in one loop: each victim moves
        into tier 1, as ``_evict_one`` -> ``_move_out`` -> ``_set_tier`` -> ``_consider`` do it
        (same steps, same order, same moves), with the device index's pop and add inlined.

        Making room in tier 1 (``_make_room_lru``) touches tier 1 and slower tiers only (a
        parent is re-filed in its own tier, and a demoted node's parent is on the device), never
        the device index or the device counters this loop keeps in locals.
        ``_inline_demotion = False`` on a tree sends it through the generic path (the
        differential test does). O(1) per block, plus the cascade's own cost.
        """
        entries = self._evictable[DEVICE]
        assert type(entries) is RecencyIndex
        host_index = self._evictable[1]
        host_add = host_index.add
        index, device_nodes, refs = self._index, self._device_nodes, self._refs
        host_pool, dev_pool = self._pools[1], self._pools[DEVICE]
        host_free, host_is_free = host_pool._free, host_pool._is_free
        is_free, free_append = dev_pool._is_free, dev_pool._free.append
        append = moves.append
        q, live, side = entries._q, entries._live, entries._side
        popleft, qappend, qappendleft = q.popleft, q.append, q.appendleft
        dead, nside = entries._dead, entries._nside
        host_shift = _CBITS
        try:
            for _ in range(num_blocks):
                # -- RecencyIndex.pop_min of the device index
                while q:
                    e = q[0]
                    h = e[1]
                    if live.get(h) is e:
                        if nside and side[0] < e:
                            h = side.pop(0)[1]
                            nside -= 1
                        else:
                            popleft()
                            del live[h]
                        break
                    popleft()
                    dead -= 1
                else:
                    h = side.pop(0)[1]
                    nside -= 1
                node = index[h]
                slot = node.slot
                assert node.tier == DEVICE and not node.children & _CMASK and refs[slot] == 0, (
                    f"demoting a held or non-leaf {node}")
                device_nodes[slot] = None
                if not host_free:
                    self._make_room_lru(1, moves)   # make room in tier 1 (cascades)
                new_slot = host_free.pop()        # BlockPool.allocate_one, inlined
                host_is_free[new_slot] = 0
                append(_tuple_new(MoveOp, (h, DEVICE, slot, 1, new_slot, False)))
                p = node.parent
                if p is not None:                 # on the device, as its child was
                    c = p.children - 1            # one device child fewer, one host child more
                    p.children = c + (1 << host_shift)
                    if not c & _CMASK and refs[p.slot] == 0:
                        # -- the parent is now an evictable device leaf: RecencyIndex.add
                        e = (p.last_access, p.block_hash)
                        if not q or e > q[-1]:
                            live[e[1]] = e
                            qappend(e)
                        elif e < q[0]:
                            live[e[1]] = e
                            qappendleft(e)
                        else:
                            side.add(e)
                            nside += 1
                node.tier = 1
                node.slot = new_slot
                if not (node.children >> host_shift) & _CMASK:   # a leaf of tier 1 too
                    host_add((node.last_access, h))
                is_free[slot] = 1                 # BlockPool.free_one, inlined
                free_append(slot)
        finally:
            entries._dead, entries._nside = dead, nside
        self._resident[DEVICE] -= num_blocks
        self._resident[1] += num_blocks
        self._unreferenced -= num_blocks
        self.stats.evicted[DEVICE] += num_blocks
        self.stats.demoted_in[1] += num_blocks

    def _make_room_lru(self, t: int, moves: list[MoveOp]) -> None:
        """Evict tier ``t``'s LRU victim (``t >= 1``, write-back: no copies anywhere), as
        ``_evict_one(t)`` -> ``_move_out`` -> ``_set_tier`` -> ``_consider`` do it, without the
        call chain: demote it into tier t+1 (making room there first, recursively) or, from
        the last tier, drop it (``_drop``, with the drop listener). Same steps, same order,
        same moves. O(1) per tier of the cascade with a ``RecencyIndex``."""
        node = self._index[self._evictable[t].pop_min()[1]]
        h, old_slot = node.block_hash, node.slot
        assert node.tier == t and not (node.children >> (_CBITS * t)) & _CMASK, (
            f"tier {t}: evicting a non-leaf {node}")
        stats = self.stats
        stats.evicted[t] += 1
        u = t + 1
        if u < self.num_tiers:
            dst = self._pools[u]
            free = dst._free
            if not free:
                self._make_room_lru(u, moves)
            new_slot = free.pop()                 # BlockPool.allocate_one, inlined
            dst._is_free[new_slot] = 0
            moves.append(_tuple_new(MoveOp, (h, t, old_slot, u, new_slot, False)))
            p = node.parent
            if p is not None:                     # one child fewer in tier t, one more in u
                shift = _CBITS * t
                c = p.children - (1 << shift)
                p.children = c + (1 << (_CBITS * u))
                if p.tier == t and not (c >> shift) & _CMASK:
                    self._evictable[t].add((p.last_access, p.block_hash))   # a leaf of t now
            self._resident[t] -= 1
            self._resident[u] += 1
            node.tier = u
            node.slot = new_slot
            if not (node.children >> (_CBITS * u)) & _CMASK:
                self._evictable[u].add((node.last_access, h))
            stats.demoted_in[u] += 1
        else:
            assert node.children == 0, f"dropping {node} would orphan its children"
            self._drop(node)
            moves.append(_tuple_new(MoveOp, (h, t, old_slot, None, None, False)))
        self._pools[t].free_one(old_slot)

    def _count_drops(self, num_blocks: int) -> None:
        self._resident[DEVICE] -= num_blocks
        self._unreferenced -= num_blocks
        self.stats.evicted[DEVICE] += num_blocks
        self.stats.dropped += num_blocks

    def _drop_device_lru(self, entries: RecencyIndex, num_blocks: int, moves: list[MoveOp]) -> None:
        """``_drop_device`` for LRU with no drop listener: ``RecencyIndex.pop_min`` and ``add``
        inlined (same steps, same order; the index's counters are written back at the end), so
        a victim costs no Python call. This is the eviction path of every device-only engine."""
        index, hints = self._index, self._hints
        device_nodes, refs = self._device_nodes, self._refs
        pool = self._pools[DEVICE]
        is_free, free_append = pool._is_free, pool._free.append
        append = moves.append
        q, live, side = entries._q, entries._live, entries._side
        popleft, qappend, qappendleft = q.popleft, q.append, q.appendleft
        dead, nside = entries._dead, entries._nside
        try:
            for _ in range(num_blocks):
                # -- RecencyIndex.pop_min: drop dead pairs at the head, then the smaller head
                while q:
                    e = q[0]
                    h = e[1]
                    if live.get(h) is e:
                        if nside and side[0] < e:
                            h = side.pop(0)[1]
                            nside -= 1
                        else:
                            popleft()
                            del live[h]
                        break
                    popleft()
                    dead -= 1
                else:
                    h = side.pop(0)[1]
                    nside -= 1
                node = index.pop(h)
                slot = node.slot
                assert not node.children and refs[slot] == 0, f"evicting a non-leaf or held {node}"
                device_nodes[slot] = None
                if hints:
                    hints.pop(h, None)
                p = node.parent
                if p is not None:
                    if p.child is node:
                        p.child = None
                    c = p.children - 1
                    p.children = c
                    if not c and refs[p.slot] == 0:  # the parent is now an evictable leaf
                        # -- RecencyIndex.add of its LRU entry
                        e = (p.last_access, p.block_hash)
                        if not q or e > q[-1]:
                            live[e[1]] = e
                            qappend(e)
                        elif e < q[0]:
                            live[e[1]] = e
                            qappendleft(e)
                        else:
                            side.add(e)
                            nside += 1
                is_free[slot] = 1      # BlockPool.free_one, inlined (slot is the pool's int)
                free_append(slot)
                append(_tuple_new(MoveOp, (h, DEVICE, slot, None, None, False)))
        finally:
            entries._dead, entries._nside = dead, nside
        self._count_drops(num_blocks)
