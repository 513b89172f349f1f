"""The slower tiers of the ``RadixTree``: prefetch, fault handling, and write-through copies.

``TierOps`` is a mixin of ``RadixTree`` (``tree.py`` keeps the structure, matching, insertion,
locking and eviction); it holds what concerns the host/disk tiers beyond plain demotion:
``promote_lower`` (disk -> host prefetch), ``invalidate`` (a block whose bytes proved bad),
``insert_lower`` (a block found on disk at start), the copy machinery and ``check_invariants``.

**Copies (write-through).** A node's *primary* residency is its ``tier``/``slot``, the fastest
place that holds it; ``match`` reaches it there and prefix closure is about primaries only. With
``write_through`` tiers a node may also hold a *copy* in any slower write-through tier u
(``tier < u``): ``_copy_slots[u]`` maps its hash to a slot of tier u's pool. KV blocks are
immutable, so a copy stays valid for as long as the node is cached. Copies are made in two ways:

* **write-through**: ``insert`` (the commit path) copies the new device block into each
  write-through tier, fastest first: ``MoveOp(h, 0, block_id, u, copy_slot, keep_src=True)``,
  after the evictions that made room in u (queued for ``take_moves``). If nothing in u is
  evictable the copy is skipped (best effort, ``stats.copies_skipped``);
* **kept sources**: ``promote`` / ``promote_lower`` out of a write-through tier keep the old slot
  as a copy (``keep_src=True`` on the load: the storage layer must not remove the source).

A copy sits in its tier's eviction index under the node's own policy key (so copies
and primaries compete for the tier by the same order) and is *always* evictable: evicting it is
a drop op ``MoveOp(h, u, copy_slot, None, None)``. When the node's key changes (lock, release,
hints, a prefetch's touch) its copy entries are re-filed around the change (a write-through
tree's ``lock``/``release`` are the ``_refiling`` variants, bound at construction); a node
without copies pays two dict lookups, and a write-back tree (``write_through=()``) nothing. Demoting a primary
from t onto its copy in t+1 turns the copy into the primary and moves no bytes
(``stats.free_demotions``). ``invalidate`` drops copies with their node; ``drop_copy`` drops one
copy (a write-through write that failed).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixkv.core.evict_index import EvictionIndex
from radixkv.core.hashing import chain_hash
from radixkv.core.node import DEVICE, MAX_TIERS, MoveOp, Node, TreeStats
from radixkv.core.pool import BlockPool
from radixkv.errors import InvalidBlockError

_tuple_new = tuple.__new__


class TierOps:
    """Slower-tier operations and copies of ``RadixTree`` (a mixin; see the module docstring).

    The attributes below are created by ``RadixTree.__init__``; the helpers declared under
    ``TYPE_CHECKING`` are ``RadixTree``'s.
    """

    num_tiers: int
    clock: Callable[[], float]
    stats: TreeStats
    _pools: list[BlockPool]
    _refs: list[int]
    _index: dict[bytes, Node]
    _ttl_heap: list[tuple[float, bytes]]
    _evictable: list[EvictionIndex]
    _resident: list[int]
    _unreferenced: int
    _device_nodes: list[Node | None]
    _hints: dict
    _wt: tuple[int, ...]
    _copy_slots: list[dict[bytes, int]]
    _pending: list[MoveOp]
    policy: Any

    if TYPE_CHECKING:  # RadixTree's own helpers, used here
        def _entry(self, node: Node) -> tuple: ...
        def _is_evictable(self, node: Node) -> bool: ...
        def _discard(self, node: Node) -> None: ...
        def _consider(self, node: Node) -> None: ...
        def _evict_one(self, tier: int, moves: list[MoveOp]) -> None: ...
        def _set_tier(self, node: Node, tier: int, slot: int) -> None: ...
        def _add_child_count(self, parent: Node, tier: int, delta: int) -> None: ...
        def _drop(self, node: Node) -> None: ...
        def lock(self, node: Node, now: float | None = None) -> None: ...
        def release(self, node: Node, now: float | None = None) -> None: ...
        def _move_out(self, node: Node, moves: list[MoveOp]) -> None: ...

    # ------------------------------------------------------------------ copies: queries
    def copy_slot(self, node: Node, tier: int) -> int | None:
        """The slot of ``node``'s copy in ``tier``, or None (no copy there). O(1)."""
        if type(tier) is not int or not 0 <= tier < self.num_tiers:
            raise InvalidBlockError(f"tier must be an int in [0, {self.num_tiers}), got {tier!r}")
        slot = self._copy_slots[tier].get(node.block_hash)
        return slot if slot is not None and self._index.get(node.block_hash) is node else None

    def num_copies(self, tier: int) -> int:
        """Copies held in ``tier`` (slots of its pool beyond its primaries). O(1)."""
        return len(self._copy_slots[tier])

    def drop_copy(self, node: Node, tier: int) -> MoveOp | None:
        """Drop ``node``'s copy in ``tier`` (e.g. its write-through write failed): free the slot.
        Call it after the moves that were returned or queued before it have run.

        Returns the drop op ``MoveOp(h, tier, slot, None, None)``, or None (changing nothing) if
        the node has no copy there (never made, evicted since, or become the primary).
        Runtime complexity: O(log n).
        """
        slot = self.copy_slot(node, tier)
        if slot is None:
            return None
        self._evictable[tier].remove(self._entry(node))
        moves: list[MoveOp] = []
        self._drop_popped_copy(node, tier, moves)
        return moves[0]

    # ------------------------------------------------------------------ copies: machinery
    def _unfile_copies(self, node: Node) -> list[int] | None:
        """Take ``node``'s copy entries out of their tiers' sets (before its key changes).
        Returns the tiers to re-file with ``_file_copies``; None if it has no copy."""
        h = node.block_hash
        tiers = None
        for u in self._wt:
            if h in self._copy_slots[u]:
                if tiers is None:
                    tiers = [u]
                    entry = self._entry(node)
                else:
                    tiers.append(u)
                self._evictable[u].remove(entry)
        return tiers

    def _file_copies(self, node: Node, tiers: list[int]) -> None:
        entry = self._entry(node)
        for u in tiers:
            self._evictable[u].add(entry)

    def _lock_refiling(self, node: Node, now: float | None = None) -> None:
        """``lock`` of a write-through tree: re-files the node's copies around the change."""
        copies = self._unfile_copies(node)
        type(self).lock(self, node, now)
        if copies:
            self._file_copies(node, copies)

    def _release_refiling(self, node: Node, now: float | None = None) -> None:
        """``release`` of a write-through tree: the key changes only when the last reference
        goes, so only then are the node's copies re-filed."""
        if self._refs[node.slot] != 1:
            type(self).release(self, node, now)
            return
        copies = self._unfile_copies(node)
        type(self).release(self, node, now)
        if copies:
            self._file_copies(node, copies)

    def _drop_popped_copy(self, node: Node, tier: int, moves: list[MoveOp]) -> None:
        """Free ``node``'s copy in ``tier`` (its entry already out of the set); emit the drop."""
        slot = self._copy_slots[tier].pop(node.block_hash)
        self._pools[tier].free_one(slot)
        self.stats.copies_dropped += 1
        moves.append(_tuple_new(MoveOp, (node.block_hash, tier, slot, None, None, False)))

    def _write_through(self, node: Node) -> None:
        """Copy a newly inserted device node into each write-through tier, fastest first.

        Room is made by evicting the tier's policy victim (a copy is dropped, a primary demoted,
        cascading down as usual); the new node has no copy in that tier or below yet, so the
        cascade can never take one of its own copies, and its parent chain is on the device.
        The moves go to the queue (``take_moves``).
        """
        h = node.block_hash
        pending = self._pending
        entry = None
        for u in self._wt:
            pool = self._pools[u]
            if pool.num_free == 0:
                if not self._evictable[u]:
                    self.stats.copies_skipped += 1   # best effort: nothing to give way
                    continue
                self._evict_one(u, pending)
            slot = pool.allocate_one()
            self._copy_slots[u][h] = slot
            if entry is None:
                entry = self._entry(node)
            self._evictable[u].add(entry)
            self.stats.copies_made += 1
            pending.append(_tuple_new(MoveOp, (h, DEVICE, node.slot, u, slot, True)))

    # ------------------------------------------------------------------ slower tiers
    def promote_lower(self, node: Node, tier: int) -> list[MoveOp]:
        """Move a node from a slower tier into the faster *non-device* ``tier`` (a prefetch:
        disk -> host), making room there by evicting leaf-first like any eviction.

        The node's parent must already be in a tier <= ``tier`` (prefix closure); it is kept
        out of the victims, and so are the node itself and its copies. The node's old slot is
        freed before room is made, so a victim demoted into the node's tier takes that slot
        instead of evicting further (the node's bytes are still read from its old slot: the
        storage layer must run the returned moves in order). If the old tier is a write-through
        tier and no victim took the slot, it stays as the node's copy (``keep_src``).
        ``last_access`` is touched, so the policy keeps the node for the request that is about
        to use it.

        Returns the MoveOps (queued write-through moves, then demotions, then the node's own
        load); ``[]`` (changing nothing) if no room can be made in ``tier``.
        Runtime complexity: O(tiers * log n).
        """
        t = node.tier
        assert self._index.get(node.block_hash) is node, f"promote_lower() of uncached {node}"
        assert DEVICE < tier < t, f"promote_lower() of a tier-{t} node into tier {tier}"
        parent = node.parent
        assert parent is None or parent.tier <= tier, \
            f"promote_lower() into tier {tier} under a parent in tier {parent.tier}"
        dst = self._pools[tier]
        guard = parent if parent is not None and parent.tier == tier and \
            self._is_evictable(parent) else None
        if dst.num_free == 0 and len(self._evictable[tier]) - (guard is not None) <= 0:
            return []
        moves = self._pending
        self._pending = []
        old_slot = node.slot
        self._discard(node)
        copies = self._unfile_copies(node) if self._wt else None
        if guard is not None:
            self._discard(guard)
        src_pool = self._pools[t]
        src_pool.free_one(old_slot)   # a victim demoted into tier t may take this slot
        if dst.num_free == 0:
            self._evict_one(tier, moves)
        if guard is not None:
            self._consider(guard)
        new_slot = dst.allocate_one()
        self._set_tier(node, tier, new_slot)
        node.last_access = self.clock()
        self._consider(node)
        keep = t in self._wt and src_pool.is_free(old_slot)
        if keep:
            # Nothing was allocated in tier t since the free (else the LIFO list gave it away).
            took = src_pool.allocate_one()
            assert took == old_slot, f"tier {t}: re-took slot {took}, expected {old_slot}"
            self._copy_slots[t][node.block_hash] = old_slot
            copies = [*(copies or ()), t]
            self.stats.copies_made += 1
        if copies:
            self._file_copies(node, copies)
        moves.append(_tuple_new(MoveOp, (node.block_hash, t, old_slot, tier, new_slot, keep)))
        return moves

    def invalidate(self, node: Node) -> list[MoveOp]:
        """Drop ``node`` and every descendant, in any tier, with all their copies (its bytes
        proved bad, e.g. a disk block that failed its checksum on load). Returns drop MoveOps
        (dst None): queued write-through moves first, then deepest node first, each node's
        copies just before its primary.

        Everything dropped must be unreferenced (raises InvalidBlockError, changing nothing,
        otherwise). Descendants are found by scanning the index: O(n), for the rare fault path.
        """
        if self._index.get(node.block_hash) is not node:
            raise InvalidBlockError(f"{node!r} is not a cached node of this tree")
        doomed = {id(node): node}
        changed = True
        while changed:  # fixed point over parent links (the index has no child lists)
            changed = False
            for other in self._index.values():
                if id(other) not in doomed and other.parent is not None and id(other.parent) in doomed:
                    doomed[id(other)] = other
                    changed = True
        refs = self._refs
        held = [n for n in doomed.values() if n.tier == DEVICE and refs[n.slot] > 0]
        if held:
            raise InvalidBlockError(f"cannot invalidate: {len(held)} of its blocks are in use")

        def depth(n: Node) -> int:
            d = 0
            while n.parent is not None:
                n, d = n.parent, d + 1
            return d

        moves = self._pending
        self._pending = []
        for n in sorted(doomed.values(), key=depth, reverse=True):
            self._discard(n)
            for u in (self._unfile_copies(n) if self._wt else None) or ():
                self._drop_popped_copy(n, u, moves)
            t, slot = n.tier, n.slot
            if t == DEVICE:
                self._unreferenced -= 1
                self._device_nodes[slot] = None
            self._drop(n)
            self._pools[t].free_one(slot)
            moves.append(_tuple_new(MoveOp, (n.block_hash, t, slot, None, None, False)))
        return moves

    def insert_lower(self, parent: Node | None, block_hash: bytes, tokens: bytes, tier: int) -> Node | None:
        """Cache a block that already lives in slower tier ``tier`` (e.g. found on disk at start).

        Returns None (changing nothing) if the tier is full (primaries and copies) or the hash
        is cached. The parent must be in a tier <= ``tier``. Runtime complexity: O(log n).
        """
        assert 0 < tier < self.num_tiers, f"insert_lower into tier {tier}"
        if block_hash in self._index or self._pools[tier].num_free == 0:
            return None
        assert parent is None or parent.tier <= tier, "parent must be in a faster or equal tier"
        node = Node(block_hash, parent, tokens, tier, self._pools[tier].allocate_one(), self.clock())
        if parent is not None:
            self._add_child_count(parent, tier, 1)
            parent.child = node
        self._index[block_hash] = node
        self._resident[tier] += 1
        self._consider(node)
        return node

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers that disagree, if any tree invariant fails.

        Checks: index/slot consistency, per-tier prefix closure (of primaries), packed child
        counts, chain hashes of non-root nodes, refcount monotonicity along chains, copies
        (only in write-through tiers slower than the node's primary, in allocated slots that no
        other residency shares), the evictable sets (exactly the qualifying primaries plus every
        copy, with their current keys), pool usage = primaries + copies, and capacity.
        Runtime complexity: O(n log n); for tests.
        """
        entry = self._entry
        is_evictable = self._is_evictable
        counts: dict[int, list[int]] = {}
        resident = [0] * self.num_tiers
        unref = 0
        taken: set[tuple[int, int]] = set()
        for h, node in self._index.items():
            assert node.block_hash == h, f"index key {h.hex()} maps to {node}"
            t = node.tier
            resident[t] += 1
            pool = self._pools[t]
            assert not pool.is_free(node.slot), f"{node} sits in free slot {node.slot} of tier {t}"
            assert (t, node.slot) not in taken, f"{node}: slot {node.slot} of tier {t} shared"
            taken.add((t, node.slot))
            if t == DEVICE:
                assert self._device_nodes[node.slot] is node, f"device block {node.slot} not mapped to {node}"
                if self._refs[node.slot] == 0:
                    unref += 1
            c = node.child
            assert c is None or (c.parent is node and self._index.get(c.block_hash) is c), (
                f"{node}: followed child {c} is not a cached child of it")
            p = node.parent
            if p is not None:
                assert self._index.get(p.block_hash) is p, f"parent of {node} is not cached"
                assert p.tier <= t, f"{node} in tier {t} under parent in slower tier {p.tier}"
                assert chain_hash(p.block_hash, node.tokens) == h, f"{node}: hash is not chain(parent, tokens)"
                counts.setdefault(id(p), [0] * MAX_TIERS)[t] += 1
                if t == DEVICE:
                    assert self._refs[p.slot] >= self._refs[node.slot], (
                        f"parent refs {self._refs[p.slot]} < child refs {self._refs[node.slot]}")
        for u, copies in enumerate(self._copy_slots):
            assert not copies or u in self._wt, f"tier {u} holds {len(copies)} copies, not write-through"
            for h, slot in copies.items():
                node = self._index.get(h)
                assert node is not None, f"tier {u}: copy of uncached block {h.hex()}"
                assert node.tier < u, f"{node}: copy in tier {u}, not slower than its primary"
                assert not self._pools[u].is_free(slot), f"{node}: copy in free slot {slot} of tier {u}"
                assert (u, slot) not in taken, f"{node}: copy slot {slot} of tier {u} shared"
                taken.add((u, slot))
        for node in self._index.values():
            want = counts.get(id(node), [0] * MAX_TIERS)
            got = [node.num_children(t) for t in range(MAX_TIERS)]
            assert got == want, f"{node}: packed child counts {got} != actual {want}"
        assert resident == self._resident, f"resident per tier {self._resident} != actual {resident}"
        assert unref == self._unreferenced, f"unreferenced {self._unreferenced} != actual {unref}"
        for b, node in enumerate(self._device_nodes):
            assert node is None or (node.tier == DEVICE and node.slot == b), f"device map {b} -> {node}"
        for t, entries in enumerate(self._evictable):
            own_check = getattr(entries, "check_invariants", None)   # an index's own order
            if own_check is not None:
                own_check()
            want_entries = sorted([entry(n) for n in self._index.values()
                                   if n.tier == t and is_evictable(n)]
                                  + [entry(self._index[h]) for h in self._copy_slots[t]])
            assert list(entries) == want_entries, (
                f"tier {t}: evictable set has {len(entries)} entries, expected {len(want_entries)}")
            pool = self._pools[t]
            held = resident[t] + len(self._copy_slots[t])
            if t > DEVICE:
                used = pool.num_blocks - pool.num_free
                assert used == held, (f"tier {t}: {used} slots used, {resident[t]} resident + "
                                      f"{len(self._copy_slots[t])} copies")
            assert held <= pool.num_blocks, f"tier {t} over capacity"
        for h in self._hints:
            assert h in self._index, f"hints kept for uncached block {h.hex()}"

    def touch(self, node: Node, now: float | None = None) -> None:
        """Mark ``node`` and its ancestors as used now (their policy keys move, as a hit's
        would): e.g. the parent of blocks about to be installed below it from the remote tier,
        so that making room for them does not evict it first. O(depth * log n)."""
        now = self.clock() if now is None else now
        n: Node | None = node
        while n is not None:
            self._discard(n)
            n.last_access = now
            self._consider(n)
            n = n.parent

    def evict_expired(self, now: float | None = None) -> list[MoveOp]:
        """Evict every block whose TTL has run out at ``now``, fastest tier first.

        Two sources of TTLs: the policy's own (``TTLPolicy``: every block, in key order) and,
        under *any* policy, a per-block ``ttl`` hint (``set_hints``, e.g. a request's cache
        breakpoint "5m"): those are kept in a heap of due times, checked lazily here (a block
        used since is re-armed, one still referenced or with children in its tier is
        re-checked later). Expired blocks are demoted like any victim, so they leave the cache
        through the slower tiers, where they are expired in turn; expired copies are dropped.
        Returns the moves (queued write-through moves first). O(expired * log n).
        """
        now = self.clock() if now is None else now
        moves = self._pending
        self._pending = []
        for tier in range(self.num_tiers):
            entries = self._evictable[tier]
            while entries and self.policy.expired(entries.min(), now):
                self.stats.expired += 1
                node = self._index[entries.pop_min()[-1]]
                if node.tier == tier:
                    self._move_out(node, moves)
                else:
                    self._drop_popped_copy(node, tier, moves)
        self._expire_hinted(now, moves)
        return moves

    def next_expiry(self) -> float | None:
        """The earliest due time of a per-block TTL hint (None: none set): when calling
        ``evict_expired`` can next do something for hinted blocks."""
        return self._ttl_heap[0][0] if self._ttl_heap else None

    def _expire_hinted(self, now: float, moves: list[MoveOp]) -> None:
        """Hinted blocks whose TTL ran out move out of their tier, at most once each per call,
        in ``(due, hash)`` order, in passes until one moves nothing: an expired leaf's going
        can make its expired parent evictable, which the next pass takes, so a whole expired
        chain leaves in one call. A block that is held (or keeps an unexpired child) stays
        due and is tried again at the next call. A demoted block leaves its next tier at a
        later call."""
        heap = self._ttl_heap
        moved: set[bytes] = set()
        while True:
            progressed = False
            later: list[tuple[float, bytes]] = []
            popped: set[bytes] = set()
            while heap and heap[0][0] <= now:
                armed, h = heapq.heappop(heap)
                node = self._index.get(h)
                hint = self._hints.get(h)
                if node is None or hint is None or hint.ttl is None or h in popped:
                    continue   # gone, TTL lifted, or a duplicate entry: lazy deletion
                due = node.last_access + hint.ttl
                if due != armed:
                    heapq.heappush(heap, (due, h))   # used (or re-hinted) since: its real turn
                    continue
                popped.add(h)
                if h not in moved and self._is_evictable(node):
                    self.stats.expired += 1
                    self._evictable[node.tier].remove(self._entry(node))
                    self._move_out(node, moves)   # as _evict_one: demote (onto a copy) or drop
                    moved.add(h)
                    progressed = True
                if self._index.get(h) is node:   # still cached (held, inner, or demoted)
                    later.append((due, h))
            for item in later:
                heapq.heappush(heap, item)
            if not progressed:
                return
