"""The policy interface of ``policy_sim.py``: hooks the simulator calls, lazily invalidated heaps.

Kept apart so the candidate policies (``policy_sim_candidates.py``) and the simulator can each
stay one idea per module.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.benchmarks.policy_sim import Simulator


class SimPolicy:
    """Base: per-block versions for lazily invalidated heap entries, and the hooks.

    ``sim`` is the simulator (read ``resident``, ``locked``, ``nchild``, ``depth``); a heap
    entry ``(*key, block, version)`` is valid while ``version[block]`` is unchanged and the
    block is an evictable leaf.
    """

    name = "base"

    def bind(self, sim: Simulator) -> None:
        self.sim = sim
        self.version = [0] * sim.n

    def valid(self, b: int, v: int) -> bool:
        s = self.sim
        return v == self.version[b] and s.resident[b] and not s.locked[b] and not s.nchild[b]

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        """Block ``b`` is part of request ``req``'s sequence (``hit``: it was cached before)."""

    def insert(self, b: int, now: float, req: int) -> None:
        """Block ``b`` was just computed and cached."""

    def leaf(self, b: int, now: float) -> None:
        """``b`` became an evictable leaf (or is one again after a request)."""

    def victim(self, now: float) -> int:
        raise NotImplementedError

    def evicted(self, b: int) -> None:
        """``b`` left the cache."""

    def request(self, req: int, now: float, conv: int, turn: int, last: bool = False) -> None:
        """A request arrives (before its blocks are matched); ``last``: the client says it is
        its session's final turn (only ``end_hint`` policies read it)."""


class _KeyHeap(SimPolicy):
    """A policy whose order is a key computed when the block becomes an evictable leaf."""

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.heap: list[tuple] = []

    def key(self, b: int, now: float) -> tuple:
        raise NotImplementedError

    def leaf(self, b: int, now: float) -> None:
        self.version[b] += 1
        heapq.heappush(self.heap, (*self.key(b, now), -self.sim.depth[b], b, self.version[b]))

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        self.version[b] += 1  # its key changes: earlier entries are stale

    def pop(self) -> tuple:
        while True:
            e = heapq.heappop(self.heap)
            if self.valid(e[-2], e[-1]):
                return e

    def victim(self, now: float) -> int:
        return self.pop()[-2]
