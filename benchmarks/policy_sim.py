"""A block-level cache simulator for prototyping eviction policies before they go into the core.

Same model as ``benchmarks/bounds.py`` (requests one at a time; every full block of prompt +
reply resident and locked while served; a hit is the cached leading blocks of the prompt; only an
unlocked **leaf**, a cached block with no cached child, may be evicted, so the cache stays a
prefix-closed tree as ``RadixTree`` keeps it). What differs is who picks the victim: a
:class:`SimPolicy` that sees every access and insertion and is asked for an evictable leaf. The
simulator owns residency and locking and checks that every victim is an evictable leaf.

Candidates (``CANDIDATES``; each is O(log n) per block, as issue 14's budget asks):

``lru``
    Oldest last access first (equals ``bounds.simulate(..., "lru")``: a test checks it).
``lfu-da``
    LFU with dynamic aging (Arlitt et al.): key = L + accesses, L = the key of the last victim.
``gdsf``
    GreedyDual-Size-Frequency, cost-aware: key = L + accesses x cost(block) (depth-weighted
    prefill cost of ``prefill_cost.py``, in tokens), so deep blocks of a live history outlive
    shallow ones of equal popularity.
``s3fifo``
    S3-FIFO (Yang et al., SOSP 2023): new blocks enter a small FIFO (10% of the capacity); a
    block accessed again while there moves to the main FIFO, the others leave and are
    remembered in a ghost FIFO; a block re-inserted from the ghost goes straight to main; main
    re-queues a block with accesses left instead of evicting it (CLOCK-like, at most 3).
``arc``
    ARC (Megiddo and Modha): recency list T1, frequency list T2, their ghosts B1/B2, and a target
    size for T1 that a ghost hit moves towards the list that would have kept the block.
``next-use``
    Per-session next-turn prediction. A block's next use is predicted as its last use + its
    expected gap: its own reuse interval (moving average) once it has been reused, else its
    session's last turn gap (the tree knows which leaf a session extends), else the mean turn
    gap, divided by the measured fraction of requests that have a next turn. Evict the farthest
    predicted next use (Belady with a forecast), but first any block that is ``overdue``
    (silent for longer than its forecast gap x the median of the observed return delays /
    forecast, learned online: the session has probably ended), oldest deadline first.
``next-use-cost``
    ``next-use`` whose victim is, of the 8 farthest predicted next uses, the one of least
    cost per second of predicted idleness (cost-aware Belady with a forecast).
``duel-...``
    Set dueling: each named policy also runs on a shadow cache (block ids only) and the real
    cache follows the one with the most recent shadow hits (:class:`Duel`).
``...+end-hint``
    Told which request is its session's last turn (a client closing a chat, an agent
    finishing its task: an API signal such as a cache breakpoint with no TTL left), the blocks of
    an ended session go first. Not an online policy: it measures what such a hint is worth.

Run them side by side with radixkv's policies: ``radixkv bench hit-rate --workloads
--candidates all`` (``benchmarks/hit_rate_workloads.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.benchmarks.bounds import BlockTrace, SimResult, prompt_cost
from radixkv.benchmarks.policy_sim_base import SimPolicy, _KeyHeap
from radixkv.benchmarks.policy_sim_candidates import ARC, LFUDA, LRU, S3FIFO, NextUse
from radixkv.benchmarks.prefill_cost import SMOLLM2_L0, prefix_cost

__all__ = ["ARC", "CANDIDATES", "Duel", "LFUDA", "LRU", "NextUse", "S3FIFO", "SimPolicy",
           "Simulator", "_KeyHeap", "make_candidate", "run_policy"]


class Duel(SimPolicy):
    """Follow whichever of several policies is winning: each also runs on a shadow cache of
    the same capacity (block ids only, no KV), and the real cache evicts by the one whose
    shadow hit the most prompt blocks lately (hits decayed by ``decay`` per request). Set
    dueling as in adaptive processor caches: metadata costs one more index per policy, every
    step stays O(log n) per block."""

    def __init__(self, names: Sequence[str], decay: float = 0.99) -> None:
        self.names, self.decay = list(names), decay
        self.name = "duel(" + ",".join(self.names) + ")"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.real = [make_candidate(n) for n in self.names]
        for p in self.real:
            p.bind(sim)
        self.shadows = [Simulator(sim.bt, sim.capacity, make_candidate(n), sim.l0)
                        for n in self.names]
        for sh in self.shadows:
            sh.reset_counters()
        self.score = [0.0] * len(self.names)
        self.lead = 0
        self.led = [0] * len(self.names)  # requests each policy led (reported)

    def request(self, req: int, now: float, conv: int, turn: int, last: bool = False) -> None:
        for i, sh in enumerate(self.shadows):
            self.score[i] = self.decay * self.score[i] + sh.step(req, now, conv, turn, last)
        best = max(range(len(self.score)), key=lambda i: (self.score[i], -i))
        if self.score[best] > self.score[self.lead]:
            self.lead = best
        self.led[self.lead] += 1
        for p in self.real:
            p.request(req, now, conv, turn, last)

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        for p in self.real:
            p.access(b, now, req, hit)

    def insert(self, b: int, now: float, req: int) -> None:
        for p in self.real:
            p.insert(b, now, req)

    def leaf(self, b: int, now: float) -> None:
        for p in self.real:
            p.leaf(b, now)

    def evicted(self, b: int) -> None:
        for p in self.real:
            p.evicted(b)

    def victim(self, now: float) -> int:
        return self.real[self.lead].victim(now)


CANDIDATES = {
    "lru": LRU, "lfu-da": LFUDA, "gdsf": lambda: LFUDA(cost=True), "s3fifo": S3FIFO,
    "arc": ARC, "next-use": NextUse, "next-use-cost": lambda: NextUse(cost=True),
    "duel-lru-next": lambda: Duel(["lru", "next-use"]),
    "duel-arc-next": lambda: Duel(["arc", "next-use"]),
    "duel-lru-arc-next": lambda: Duel(["lru", "arc", "next-use"]),
    # With a client hint on each session's last turn (an API signal, not an online guess):
    "next-use+end-hint": lambda: NextUse(end_hint=True),
    "duel-lru-arc-next+end-hint": lambda: Duel(["lru", "arc", "next-use+end-hint"]),
}


class Simulator:
    """Residency, locking and hit counting of a leaves-only block cache (``bounds.py``'s model)."""

    def __init__(self, bt: BlockTrace, capacity: int, policy: SimPolicy,
                 l0: float = SMOLLM2_L0) -> None:
        if capacity < bt.min_capacity:
            raise ValueError(f"capacity {capacity} blocks < largest request "
                             f"({bt.min_capacity} blocks at block size {bt.block_size})")
        self.bt, self.capacity, self.l0 = bt, capacity, l0
        self.n = bt.num_blocks
        self.depth = bt.depth
        self.resident = bytearray(self.n)
        self.locked = bytearray(self.n)
        self.nchild = [0] * self.n
        self.policy = policy
        policy.bind(self)

    def reset_counters(self) -> None:
        self.used = self.hit = self.evictions = self.inserted = 0
        self.hit_cost = 0.0

    def step(self, j: int, now: float, conv: int, turn: int, last: bool = False) -> int:
        """Serve request ``j``: match, make room, insert; returns the prompt blocks hit."""
        bt, pol = self.bt, self.policy
        resident, locked, nchild, parent = self.resident, self.locked, self.nchild, bt.parent
        chain = bt.chains[j]
        pol.request(j, now, conv, turn, last)
        npb = bt.n_prompt_blocks[j]
        r = 0
        while r < len(chain) and resident[chain[r]]:
            r += 1
        h = min(r, npb)
        self.hit += h
        self.hit_cost += prefix_cost(h * bt.block_size, self.l0)
        for b in chain:
            locked[b] = 1
        over = self.used + (len(chain) - r) + bt.tails[j] - self.capacity
        while over > 0:
            b = pol.victim(now)
            if not resident[b] or locked[b] or nchild[b]:
                raise AssertionError(f"{pol.name} chose block {b}, not an evictable leaf")
            resident[b] = 0
            pol.evicted(b)
            self.used -= 1
            over -= 1
            self.evictions += 1
            p = parent[b]
            if p >= 0:
                nchild[p] -= 1
                if nchild[p] == 0 and not locked[p]:
                    pol.leaf(p, now)
        for i, b in enumerate(chain):
            if i < r:
                pol.access(b, now, j, True)
            else:
                resident[b] = 1
                if parent[b] >= 0:
                    nchild[parent[b]] += 1
                pol.insert(b, now, j)
                pol.access(b, now, j, False)
        self.used += len(chain) - r
        self.inserted += len(chain) - r
        for b in chain:
            locked[b] = 0
        if chain and nchild[chain[-1]] == 0:
            pol.leaf(chain[-1], now)
        return h

    def run(self, times: Sequence[float], convs: Sequence[int], turns: Sequence[int],
            check: bool = False, lasts: Sequence[bool] | None = None) -> SimResult:
        bt = self.bt
        self.reset_counters()
        for j in range(len(bt.chains)):
            self.step(j, times[j], convs[j], turns[j], bool(lasts and lasts[j]))
            if check:
                from radixkv.benchmarks.bounds import _check

                _check(bt, self.resident, self.nchild, self.used, self.capacity)
        return SimResult(self.policy.name, bt.block_size, self.capacity,
                         self.hit * bt.block_size, bt.total_prompt_tokens, self.evictions,
                         self.inserted, self.hit_cost, prompt_cost(bt, self.l0))


def make_candidate(name: str) -> SimPolicy:
    if name not in CANDIDATES:
        raise ValueError(f"unknown candidate {name!r}; choose one of {', '.join(CANDIDATES)}")
    return CANDIDATES[name]()


def run_policy(bt: BlockTrace, capacity: int, name: str, requests: Sequence[Any],
               check: bool = False) -> SimResult:
    """Simulate candidate ``name`` on a prepared trace; ``requests`` give times and sessions
    (objects with ``t`` and optionally ``conv``/``turn``; without them each request is its
    own session)."""
    times = [float(getattr(r, "t", j)) for j, r in enumerate(requests)]
    convs = [getattr(r, "conv", j) for j, r in enumerate(requests)]
    turns = [getattr(r, "turn", 0) for r in requests]
    final = {c: j for j, c in enumerate(convs)}
    lasts = [final[c] == j for j, c in enumerate(convs)]
    return Simulator(bt, capacity, make_candidate(name)).run(times, convs, turns, check, lasts)
