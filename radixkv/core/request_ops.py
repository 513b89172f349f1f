"""The block manager's per-request paths through the ``RadixTree``: one pass per request.

``RequestOps`` is a mixin of ``RadixTree`` (like ``TierOps``): ``lock_nodes`` (allocate, fork),
``release_path`` (free), ``insert_run`` / ``_attach`` (commit) and the device-only LRU
eviction loop. Their cost is per *node*, not per block, except for what every block needs
anyway (its hash and its slot; the tree indexes nodes, not blocks): a request that holds a conversation of
hundreds of blocks locks and releases a handful of nodes, and its commit appends to the node
it already holds (``_attach``: a run grows where its only holder writes on).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

from radixkv.core.evict_index import RecencyIndex
from radixkv.core.evictable import EvictableSet
from radixkv.core.node import _CMASK, DEVICE, BlockRef, MoveOp, Node, TreeStats
from radixkv.core.pool import BlockPool

if TYPE_CHECKING:
    from radixkv.core.policy import EvictionPolicy
    from radixkv.core.writes import TreeWrites

_xxh3_128 = xxhash.xxh3_128_digest
_tuple_new = tuple.__new__
_new_node = object.__new__


class RequestOps:
    """Per-request operations of ``RadixTree`` (a mixin; see the module docstring)."""

    block_size: int
    num_tiers: int
    clock: Callable[[], float]
    stats: TreeStats
    writes: TreeWrites
    block_bytes: int
    _lru: bool
    hooks: bool
    policy: EvictionPolicy
    pools: list[BlockPool]
    heads: dict[bytes, Node]
    tails: dict[bytes, Node]
    evictable: list[EvictableSet]
    _resident: list[int]
    _unreferenced: int
    device_nodes: list[Node | None]
    drop_listener: Callable[[list[BlockRef]], None] | None
    insert_listener: Callable[[list[bytes], list[int] | None], None] | None

    if TYPE_CHECKING:  # RadixTree's own helpers, used here
        def _link(self, parent: Node, node: Node) -> None: ...

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
                self._unreferenced -= len(node.hashes)
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
        self._unreferenced += unref

    # ------------------------------------------------------------------ insertion
    def insert_run(self, parent: Node | None, prev_hash: bytes, tok_bytes: bytes,
                   block_ids: Sequence[int], now: float, first_hash: bytes | None = None
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
        hashes: list[bytes] = []
        append = hashes.append
        h = prev_hash
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
            node, _ = self._attach(parent, hashes, tokens, ids, r0, now)
            return node, n
        i = 0
        node = parent
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

    def _attach(self, parent: Node | None, hashes: list[bytes], tokens: bytes,
                block_ids: Sequence[int], ref: int, now: float, copies: bool = True
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
        slots = block_ids
        assert refs[slots[0]] == ref == refs[slots[-1]] and self.device_nodes[slots[-1]] is None, (
            f"attach of blocks {slots[0]}..{slots[-1]} held by {ref}")
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
            node.slots.extend(slots)
            if self.hooks:
                self.policy.on_insert(node, start, now)
        else:
            node = _new_node(Node)
            node.hashes = hashes if type(hashes) is list else list(hashes)
            node.tokens = bytearray(tokens)
            node.slots = array("i", slots)
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
                self._link(parent, node)
            if ref == 0:
                self._unreferenced += n
                self.evictable[node.tier].file(node)
        dn = self.device_nodes
        for b in slots:
            dn[b] = node
            refs[b] = 0
        self._resident[DEVICE] += n
        self.stats.inserted += n
        if copies:
            self.writes.after_insert(node, start)
        if self.insert_listener is not None:
            self.insert_listener(list(hashes), list(slots))
        return node, start

    # ------------------------------------------------------------------ eviction
    def _evict_device_fast(self, num: int, moves: list[MoveOp]) -> bool:
        """``evict_from(DEVICE, num)`` in one loop where there is one (a device-only tree
        under LRU); False (nothing done): take the generic path.

        A device-only tree reports no per-block drops: a block dropped from the device needs
        no storage work (its id is simply allocated again), so no ``MoveOp`` is built for it."""
        entries = self.evictable[DEVICE]
        if self.num_tiers != 1 or not self._lru or type(entries.index) is not RecencyIndex or \
                self.drop_listener is not None:
            return False
        self._drop_device_lru(entries, num)
        return True

    def _drop_device_lru(self, entries: EvictableSet, num: int) -> None:
        """Device-only LRU eviction, victim node by victim node, through the evictable set's
        ``pop_min`` / ``take`` / ``add`` (the same steps and order as the generic loop). A
        victim node's blocks leave together: one pass over their hashes and slots, no call per
        block. A node only partly taken is cut in place (its head stays, filed under its new
        last block)."""
        heads, tails, dn = self.heads, self.tails, self.device_nodes
        free_run = self.pools[DEVICE].free_run
        pop_min_peek = entries.index.pop_min_peek   # type: ignore[union-attr]
        add, take_of = entries.add, entries.take
        w = self.block_bytes
        dropped = 0
        try:
            while num > 0:
                e, nxt = pop_min_peek()
                node = tails[e[1]]
                hashes, slots = node.hashes, node.slots
                n = len(hashes)
                assert not node.children and node.ref == 0, f"evicting a non-leaf or held {node}"
                take = n if num >= n else num
                if take > 1 and nxt is not None and nxt[0] == e[0]:
                    take = take_of(node, num, e)   # a tie: per-block (hash) order decides
                cut = n - take
                gone_s = slots[:cut - 1:-1] if cut else slots[::-1]   # deepest first
                del tails[hashes[-1]]
                free_run(gone_s, dn)
                if cut:                        # the head stays, filed under its new tail
                    tails[hashes[cut - 1]] = node
                    del hashes[cut:]
                    del node.tokens[cut * w:]
                    del slots[cut:]
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
                    add((p.last_access, p.hashes[-1]))   # its LRU entry
                    hints = p.hints
                    if cut and hints is not None and hints.ttl is not None:
                        self._rearm_ttl(p)
                num -= take
                dropped += take
        finally:
            self._resident[DEVICE] -= dropped
            self._unreferenced -= dropped
            self.stats.evicted[DEVICE] += dropped
            self.stats.dropped += dropped

    def _rearm_ttl(self, node: Node) -> None:
        import heapq

        heapq.heappush(self.ttl_heap,   # type: ignore[attr-defined]
                       (node.last_access + node.hints.ttl, node.hashes[-1]))
