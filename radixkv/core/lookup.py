"""Finding single blocks in a ``RadixTree`` that indexes nodes, not blocks.

``LookupOps`` is a mixin of ``RadixTree``. The tree keeps, per node, its first block's hash
(``_heads``) and its last block's (``_tails``), and per tier a slot -> node map
(``_slot_nodes``); nothing per block (issue 14: no dict entry and no index upkeep per cached
block). A single block is therefore found

* by its **place**, ``(tier, slot)``: ``block_at``, ``block_of`` (a ``MoveOp``'s ends, a block
  table's device block ids);
* by its **chain** from a root: ``locate_chain``, ``refs_of``, ``chain_hints`` (a prompt's
  blocks, cache points, the remote tier's persisted prefixes), one step per block;
* by its **hash** when it starts or ends its node (``get(h, scan=False)``, ``_find``: O(1));
* by its hash alone when it is inside a node: ``get``/``_find`` scan the nodes, O(cached
  blocks). Only rare paths do (fault filing, a session's end after its leaf was extended, disk
  restore at a branch point, tests); ``near`` lets a caller that has located the node skip it.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixkv.core.node import BlockRef, Node
from radixkv.core.policy import DEFAULT_HINTS, NodeHints


class LookupOps:
    """Block lookups of ``RadixTree`` (a mixin; see the module docstring)."""

    heads: dict[bytes, Node]
    tails: dict[bytes, Node]
    slot_nodes: list[list[Node | None]]

    if TYPE_CHECKING:  # RadixTree's own helper, used here
        def _ref(self, node: Node, i: int) -> BlockRef: ...

    def block_index(self) -> dict[bytes, Node]:
        """A snapshot ``{block hash: node}`` of every cached block: O(cached blocks), built on
        each call, for tests and checks (the tree itself keeps no per-block index)."""
        return {h: node for node in self.heads.values() for h in node.hashes}

    def get(self, block_hash: bytes, scan: bool = True) -> BlockRef | None:
        """The cached block ``block_hash`` (a snapshot), or None. O(node length) for the first
        or last block of a node; O(cached blocks) for an inner one (``_find``), or None at
        once with ``scan=False``: callers on a hot path address a block by ``(tier, slot)``
        (``block_at``), by its chain (``locate_chain``, ``refs_of``), or know it ends or
        starts a node."""
        if scan:
            node = self.find(block_hash)
        else:
            node = self.tails.get(block_hash) or self.heads.get(block_hash)
        if node is None:
            return None
        return self._ref(node, node.hashes.index(block_hash))

    def find(self, block_hash: bytes, near: Node | None = None) -> Node | None:
        """The node holding cached block ``block_hash``, or None: ``near`` if it holds it
        (a caller's guess, e.g. from ``locate_chain``; O(its length)), else O(1) for a node's
        first or last block, else a scan of the nodes (an inner block)."""
        if near is not None and near.hashes and self.heads.get(near.hashes[0]) is near \
                and block_hash in near.hashes:
            return near
        node = self.tails.get(block_hash)
        if node is None:
            node = self.heads.get(block_hash)
            if node is None:
                for x in self.heads.values():
                    if block_hash in x.hashes:
                        return x
        return node

    def block_at(self, tier: int, slot: int) -> BlockRef | None:
        """The cached block whose primary is slot ``slot`` of ``tier`` (None: the slot is
        free, a write-through copy, or a private device block). O(node length)."""
        node = self.slot_nodes[tier][slot]
        return None if node is None else self._ref(node, node.slots.index(slot))

    def block_of(self, block_hash: bytes, *places: tuple[int | None, int | None]
                 ) -> BlockRef | None:
        """The cached block ``block_hash``, looked for first at the ``(tier, slot)`` places
        given (e.g. a ``MoveOp``'s destination and source: O(node length) each), then by its
        hash (``get``, which may scan for an inner block)."""
        for tier, slot in places:
            if tier is None or slot is None:
                continue
            node = self.slot_nodes[tier][slot]
            if node is not None:
                i = node.slots.index(slot)
                if node.hashes[i] == block_hash:
                    return self._ref(node, i)
        return self.get(block_hash)

    def refs_of(self, hashes: Sequence[bytes]) -> list[BlockRef | None]:
        """``get`` of each hash, walking runs of consecutive blocks (the next block of the
        previous one's node, or the first block of one of its children) so that a chain costs
        O(its length) and only the first block of each run is looked up by hash."""
        out: list[BlockRef | None] = []
        node, i = None, -1
        heads = self.heads
        for h in hashes:
            if node is not None:
                if i + 1 < len(node.hashes) and node.hashes[i + 1] == h:
                    i += 1
                    out.append(self._ref(node, i))
                    continue
                c = heads.get(h)
                if c is not None and c.parent is node and i + 1 == len(node.hashes):
                    node, i = c, 0
                    out.append(self._ref(node, 0))
                    continue
            node = self.find(h)
            if node is None:
                out.append(None)
                continue
            i = node.hashes.index(h)
            out.append(self._ref(node, i))
        return out

    def chain_hints(self, hashes: Sequence[bytes]) -> list[NodeHints]:
        """The hints of each block of a chain from a root (``locate_chain``); defaults past
        its cached prefix. O(len(hashes))."""
        where = self.locate_chain(hashes)
        out = [DEFAULT_HINTS if node.hints is None else node.hints for node, _ in where]
        out += [DEFAULT_HINTS] * (len(hashes) - len(where))
        return out

    def locate_chain(self, hashes: Sequence[bytes]) -> list[tuple[Node, int]]:
        """``(node, offset)`` of each block of the chain ``hashes`` (consecutive blocks, the
        first one a root or any block ``_find`` locates), for its longest cached prefix.
        A pure read. Runtime complexity: O(len(hashes)) (+ ``_find`` of the first)."""
        out: list[tuple[Node, int]] = []
        if not hashes:
            return out
        node = self.find(hashes[0])
        if node is None:
            return out
        i = node.hashes.index(hashes[0])
        for h in hashes:
            if i == len(node.hashes):
                c = self.heads.get(h)
                if c is None or c.parent is not node:
                    return out
                node, i = c, 0
            elif node.hashes[i] != h:
                return out
            out.append((node, i))
            i += 1
        return out

    def hints(self, block_hash: bytes) -> NodeHints:
        """The eviction hints of a cached block (defaults if none were set). O(1) for a node's
        first or last block, O(cached blocks) otherwise (``_find``)."""
        node = self.find(block_hash)
        return DEFAULT_HINTS if node is None or node.hints is None else node.hints
