"""Eviction hints and expiry of the ``RadixTree``: priorities and TTLs set by callers, policy
state changed outside a node event, and the lazy TTL clock.

``HintOps`` is a mixin of ``RadixTree``. ``set_hints`` cuts nodes so that hints cover exactly the
given blocks (a cache breakpoint's prefix); ``touch`` marks a prefix used now; ``rekey`` gives a
node new policy state (a hooked policy's decision, e.g. a session ended); ``evict_expired`` lets
blocks whose TTL ran out leave their tier without memory pressure (the TTL policy's own keys, and
per-block TTL hints under any policy, kept in a heap checked lazily).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from radixkv.core.evictable import EvictableSet
from radixkv.core.node import MoveOp, Node, TreeStats
from radixkv.core.policy import DEFAULT_HINTS, EvictionPolicy, NodeHints
from radixkv.errors import ConfigError, InvalidBlockError

if TYPE_CHECKING:
    from radixkv.core.writes import TreeWrites


class HintOps:
    """Hints, re-keying and TTL expiry of ``RadixTree`` (a mixin; see the module docstring)."""

    clock: Callable[[], float]
    num_tiers: int
    stats: TreeStats
    writes: TreeWrites
    policy: EvictionPolicy
    heads: dict[bytes, Node]
    tails: dict[bytes, Node]
    ttl_heap: list[tuple[float, bytes]]
    evictable: list[EvictableSet]
    pending_moves: list[MoveOp]

    if TYPE_CHECKING:  # RadixTree's own helpers, used here
        def find(self, block_hash: bytes, near: Node | None = None) -> Node | None: ...
        def locate_chain(self, hashes: list[bytes]) -> list[tuple[Node, int]]: ...
        def split(self, node: Node, k: int) -> tuple[Node, Node]: ...
        def node_ending_at(self, block_hash: bytes, near: Node | None = None) -> Node: ...
        def _move_tail_out(self, node: Node, take: int, moves: list[MoveOp]) -> int: ...

    # ------------------------------------------------------------------ hints
    def set_hints(self, block_hashes: Iterable[bytes], priority: int | None = None,
                  ttl: float | None = None) -> None:
        """Set the priority and/or TTL hints of cached blocks (e.g. a system prompt's chain).

        ``priority``: an int (higher survives longer under the priority policy); ``ttl``:
        finite seconds >= 0 after the block's last use (under any policy, see
        ``evict_expired``). Nodes are cut so that hints cover exactly the given blocks.
        All-or-nothing (all validated first). Runtime complexity: O(blocks + nodes * log n).
        """
        if priority is not None and type(priority) is not int:
            raise ConfigError(f"priority must be an int, got {priority!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                                or not math.isfinite(ttl) or ttl < 0):
            raise ConfigError(f"ttl must be a finite number of seconds >= 0, got {ttl!r}")
        hashes = list(block_hashes)
        for h in hashes:
            if not isinstance(h, bytes):
                raise InvalidBlockError(f"{h!r} is not a cached block of this tree")
        # A chain (a prompt's prefix, the common case) is located in one walk; anything else
        # block by block (``_find``). ``loc`` follows the cuts below.
        where = self.locate_chain(hashes)
        loc = {h: x[0] for h, x in zip(hashes, where)}
        for h in hashes[len(where):]:
            if h not in loc:
                node = self.find(h)
                if node is None:
                    raise InvalidBlockError(f"{h!r} is not a cached block of this tree")
                loc[h] = node
        wanted = set(hashes)
        done: set[int] = set()
        for h in hashes:
            node = loc[h]
            if id(node) in done:
                continue
            i = node.hashes.index(h)
            j = i + 1
            while j < len(node.hashes) and node.hashes[j] in wanted:
                j += 1
            if j < len(node.hashes):
                node, rest = self.split(node, j)
                self._relocate(rest, wanted, loc)
            if i:
                before, node = self.split(node, i)
                self._relocate(before, wanted, loc)
            self._relocate(node, wanted, loc)
            done.add(id(node))
            old = DEFAULT_HINTS if node.hints is None else node.hints
            new = NodeHints(old.priority if priority is None else priority,
                            old.ttl if ttl is None else float(ttl))
            self.evictable[node.tier].unfile(node)
            refile = self.writes.unfile(node)
            node.hints = None if new == DEFAULT_HINTS else new
            if new.ttl is not None:
                heapq.heappush(self.ttl_heap, (node.last_access + new.ttl, node.hashes[-1]))
            self.evictable[node.tier].file(node)
            if refile is not None:
                self.writes.refile(node, refile)

    @staticmethod
    def _relocate(node: Node, wanted: set[bytes], loc: dict[bytes, Node]) -> None:
        for h in node.hashes:
            if h in wanted:
                loc[h] = node

    def rekey(self, node: Node, aux) -> None:
        """Give ``node`` new policy state ``aux`` (the policy's decision outside any node event,
        e.g. its session ended), re-filing it (and its copies) where it is filed.
        Runtime complexity: O(log n)."""
        self.evictable[node.tier].unfile(node)
        refile = self.writes.unfile(node)
        node.aux = aux
        self.evictable[node.tier].file(node)
        if refile is not None:
            self.writes.refile(node, refile)

    def touch(self, block_hash: bytes, now: float | None = None, near: Node | None = None
              ) -> None:
        """Mark cached block ``block_hash`` and everything before it as used now (their policy
        keys move, as a hit's would): e.g. the parent of blocks about to be installed below
        it from the remote tier, so that making room for them does not evict it first.
        ``near``: the node holding it, if the caller located it (``locate_chain``).
        Runtime complexity: O(depth in nodes) (+ a cut of its node)."""
        now = self.clock() if now is None else now
        n: Node | None = self.node_ending_at(block_hash, near)
        while n is not None:
            self.evictable[n.tier].unfile(n)
            refile = self.writes.unfile(n)
            n.last_access = now
            self.evictable[n.tier].file(n)
            if refile is not None:
                self.writes.refile(n, refile)
            n = n.parent

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
        moves = self.pending_moves
        self.pending_moves = []
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
