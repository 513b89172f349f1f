"""Cutting and merging runs: the ``RadixTree``'s structural edits.

``RunOps`` is a mixin of ``RadixTree``. A node is a run of alike blocks (``node.py``); these
methods cut one in two where blocks stop being alike (``_split``, ``_cut``,
``_node_ending_at``), merge a node back into its only child where they are alike again
(``_coalesce``), and keep the intrusive child lists and the packed per-tier child counts right
(``_link``, ``_unlink``, ``_take_place``, ``_add_child_count``). None of them moves a block
between tiers or changes a key.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from radixkv.core.node import _CBITS, _CMASK, Node, TreeStats

_new_node = object.__new__


class RunOps:
    """Structural edits of ``RadixTree`` (a mixin; see the module docstring)."""

    stats: TreeStats
    block_bytes: int
    heads: dict[bytes, Node]
    tails: dict[bytes, Node]
    slot_nodes: list[list[Node | None]]
    ttl_heap: list[tuple[float, bytes]]

    if TYPE_CHECKING:  # RadixTree's own helpers, used here
        def find(self, block_hash: bytes, near: Node | None = None) -> Node | None: ...

    def split(self, node: Node, k: int) -> tuple[Node, Node]:
        """Cut ``node`` into its blocks ``[0, k)`` and ``[k, n)`` (``0 < k < n``), the second
        the only child of the first; both keep the node's tier, holders, key and hints. One of
        them is ``node`` itself: whichever side has fewer slots (and, for the tail, children)
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
            self._take_place(node, head)
            head.children, head.child = 1 << (_CBITS * t), node
            node.parent, node.prev, node.next = head, None, None
            moved = head
        heads, tails = self.heads, self.tails
        heads[head.hashes[0]] = head
        tails[head.hashes[-1]] = head
        heads[tail.hashes[0]] = tail
        tails[tail.hashes[-1]] = tail
        sn = self.slot_nodes[t]
        for b in moved.slots:
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

    def node_ending_at(self, block_hash: bytes, near: Node | None = None) -> Node:
        """The node whose *last* block is ``block_hash`` (cached), splitting after it if it
        sits inside its node: the parent to hang a new node from. ``near``: a guess of the
        node holding it (see ``_find``)."""
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
        sn = self.slot_nodes[child.tier]
        hits = max(parent.hits, child.hits)
        del tails[parent.hashes[-1]]
        del heads[child.hashes[0]]
        if len(parent.hashes) <= len(child.hashes):   # child absorbs parent at its front
            heads[parent.hashes[0]] = child
            for b in parent.slots:
                sn[b] = child
            child.hashes[0:0] = parent.hashes
            child.tokens[0:0] = parent.tokens
            child.slots[0:0] = parent.slots
            self._take_place(parent, child)
            merged = child
        else:                                          # parent absorbs child at its end
            tails[child.hashes[-1]] = parent
            for b in child.slots:
                sn[b] = parent
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
                self.evictable[parent.tier].unfile(parent)
                parent.children += delta << shift
                self.evictable[parent.tier].file(parent)
                return
        parent.children += delta << shift
        assert parent.children >= 0 and (parent.children >> shift) & _CMASK <= _CMASK, parent
