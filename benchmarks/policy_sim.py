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

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from radixkv.benchmarks.bounds import BlockTrace, SimResult, prompt_cost
from radixkv.benchmarks.prefill_cost import SMOLLM2_L0, block_cost, prefix_cost


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


class LRU(_KeyHeap):
    name = "lru"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.last = [0] * sim.n

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        super().access(b, now, req, hit)
        self.last[b] = req

    def key(self, b: int, now: float) -> tuple:
        return (self.last[b],)


class LFUDA(_KeyHeap):
    """Key L + count (GDSF with unit cost); ``cost=True`` weighs the count by block cost."""

    name = "lfu-da"

    def __init__(self, cost: bool = False) -> None:
        self.cost = cost
        if cost:
            self.name = "gdsf"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        self.count = [0] * sim.n
        self.last = [0] * sim.n
        self.base = [0.0] * sim.n  # L when the block was last accessed
        self.L = 0.0
        bs = sim.bt.block_size
        self.w = ([block_cost(d, bs, sim.l0) / bs for d in sim.depth] if self.cost
                  else None)

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        super().access(b, now, req, hit)
        self.count[b] = self.count[b] + 1 if hit else 1
        self.last[b] = req
        self.base[b] = self.L

    def key(self, b: int, now: float) -> tuple:
        c = self.count[b] * (self.w[b] if self.w else 1.0)
        return (self.base[b] + c, self.last[b])

    def victim(self, now: float) -> int:
        e = self.pop()
        self.L = max(self.L, e[0])
        return e[-2]


class S3FIFO(SimPolicy):
    name = "s3fifo"
    SMALL, MAIN = 1, 2

    def __init__(self, small: float = 0.1, max_freq: int = 3) -> None:
        self.small_frac, self.max_freq = small, max_freq

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        n = sim.n
        self.queue = bytearray(n)
        self.freq = bytearray(n)
        self.seq = [0] * n
        self.clock = 0
        self.heaps = {self.SMALL: [], self.MAIN: []}
        self.size = {self.SMALL: 0, self.MAIN: 0}
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.small_target = max(1, int(self.small_frac * sim.capacity))
        self.ghost_cap = sim.capacity

    def _enqueue(self, b: int, q: int) -> None:
        if self.queue[b]:
            self.size[self.queue[b]] -= 1
        self.queue[b] = q
        self.size[q] += 1
        self.clock += 1
        self.seq[b] = self.clock

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        self.version[b] += 1
        if hit:
            self.freq[b] = min(self.max_freq, self.freq[b] + 1)

    def insert(self, b: int, now: float, req: int) -> None:
        self.freq[b] = 0
        if b in self.ghost:
            del self.ghost[b]
            self._enqueue(b, self.MAIN)
        else:
            self._enqueue(b, self.SMALL)

    def leaf(self, b: int, now: float) -> None:
        self.version[b] += 1
        heapq.heappush(self.heaps[self.queue[b]], (self.seq[b], b, self.version[b]))

    def _pop(self, q: int) -> int | None:
        h = self.heaps[q]
        while h:
            _, b, v = heapq.heappop(h)
            if self.valid(b, v) and self.queue[b] == q:
                return b
        return None

    def victim(self, now: float) -> int:
        while True:
            q = self.SMALL if self.size[self.SMALL] >= self.small_target else self.MAIN
            b = self._pop(q)
            if b is None:
                q = self.MAIN if q == self.SMALL else self.SMALL
                b = self._pop(q)
            if b is None:
                raise RuntimeError("no evictable leaf in either queue")
            if q == self.SMALL:
                if self.freq[b] > 0:  # reused while on probation: promote
                    self.freq[b] = 0
                    self._enqueue(b, self.MAIN)
                    self.leaf(b, now)
                    continue
                self.ghost[b] = None
                if len(self.ghost) > self.ghost_cap:
                    self.ghost.popitem(last=False)
                return b
            if self.freq[b] > 0:  # main: one more round
                self.freq[b] -= 1
                self._enqueue(b, self.MAIN)
                self.leaf(b, now)
                continue
            return b

    def evicted(self, b: int) -> None:
        self.size[self.queue[b]] -= 1
        self.queue[b] = 0


class ARC(SimPolicy):
    name = "arc"
    T1, T2 = 1, 2

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        n = sim.n
        self.list = bytearray(n)
        self.last = [0] * n
        self.heaps = {self.T1: [], self.T2: []}
        self.size = {self.T1: 0, self.T2: 0}
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0
        self.c = sim.capacity

    def _move(self, b: int, lst: int) -> None:
        if self.list[b]:
            self.size[self.list[b]] -= 1
        self.list[b] = lst
        self.size[lst] += 1

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        self.version[b] += 1
        self.last[b] = req
        if hit:
            self._move(b, self.T2)

    def insert(self, b: int, now: float, req: int) -> None:
        if b in self.b1:
            self.p = min(self.c, self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[b]
            self._move(b, self.T2)
        elif b in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[b]
            self._move(b, self.T2)
        else:
            self._move(b, self.T1)

    def leaf(self, b: int, now: float) -> None:
        self.version[b] += 1
        heapq.heappush(self.heaps[self.list[b]], (self.last[b], b, self.version[b]))

    def _pop(self, lst: int) -> int | None:
        h = self.heaps[lst]
        while h:
            _, b, v = heapq.heappop(h)
            if self.valid(b, v) and self.list[b] == lst:
                return b
        return None

    def victim(self, now: float) -> int:
        first = self.T1 if self.size[self.T1] > max(self.p, 0) else self.T2
        b = self._pop(first)
        lst = first
        if b is None:
            lst = self.T2 if first == self.T1 else self.T1
            b = self._pop(lst)
        if b is None:
            raise RuntimeError("no evictable leaf in T1 or T2")
        ghost = self.b1 if lst == self.T1 else self.b2
        ghost[b] = None
        if len(ghost) > self.c:
            ghost.popitem(last=False)
        return b

    def evicted(self, b: int) -> None:
        self.size[self.list[b]] -= 1
        self.list[b] = 0


class NextUse(SimPolicy):
    """Forecast each block's next use; evict overdue blocks, then the farthest forecast."""

    name = "next-use"

    def __init__(self, quantile: float = 0.5, slack: float = 1.0, alpha: float = 0.5,
                 cost: bool = False, sample: int = 8, end_hint: bool = False) -> None:
        self.quantile, self.slack, self.alpha = quantile, slack, alpha
        self.cost, self.sample, self.end_hint = cost, sample, end_hint
        if cost:
            self.name = "next-use-cost"
        if end_hint:
            self.name += "+end-hint"

    def bind(self, sim: Simulator) -> None:
        super().bind(sim)
        n = sim.n
        self.last_t = [0.0] * n
        self.gap = [0.0] * n  # 0: never reused yet
        self.owner = [-1] * n  # session of the block's last use
        self.far: list[tuple] = []  # (-predicted next use, -depth, b, v)
        self.due: list[tuple] = []  # (overdue time, -depth, b, v)
        self.conv_last: dict[int, float] = {}
        self.conv_gap: dict[int, float] = {}
        self.mean_gap = 0.0
        self.ghost: OrderedDict[int, tuple[float, float]] = OrderedDict()  # b -> (last_t, gap)
        self.ghost_cap = sim.capacity
        self.ratios: list[float] = []  # observed gap / forecast gap of returning sessions
        self.overdue = 2.0  # gaps of silence after which a session has ended (learned)
        self.requests = self.followups = 0
        self.cur_conv = -1
        self.ended: set[int] = set()  # sessions whose client said they are over
        bs = sim.bt.block_size
        self.w = [block_cost(d, bs, sim.l0) for d in sim.depth] if self.cost else None

    def request(self, req: int, now: float, conv: int, turn: int, last: bool = False) -> None:
        self.requests += 1
        self.cur_conv = conv
        if last and self.end_hint:
            self.ended.add(conv)
        if conv in self.conv_last:
            self.followups += 1
            g = now - self.conv_last[conv]
            forecast = self.conv_gap.get(conv, self.mean_gap)
            if forecast > 0:
                self._observe(g / forecast)
            self.conv_gap[conv] = g
            self.mean_gap = g if self.mean_gap == 0 else 0.9 * self.mean_gap + 0.1 * g
        self.conv_last[conv] = now

    def _observe(self, ratio: float) -> None:
        """Learn how late a session may come back: the ``quantile`` of observed gap / forecast
        (1.0 for a strict round robin, about 0.7 for exponential think times at the median),
        x ``slack``. The median beat the 0.9 quantile on every workload but agents (measured:
        docs/eviction.md): a session is written off early, and LRU order takes over."""
        r = self.ratios
        r.append(ratio)
        if len(r) >= 64 and len(r) % 32 == 0:
            if len(r) > 2048:
                del r[:len(r) - 2048]
            self.overdue = self.slack * sorted(r)[int(self.quantile * (len(r) - 1))]

    def _expected_gap(self, b: int) -> float:
        if self.gap[b] > 0:
            return self.gap[b]
        if not self.mean_gap:  # no session has come back yet: expect no reuse
            return 1e12
        g = self.conv_gap.get(self.owner[b], self.mean_gap)
        p = max(self.followups / max(self.requests, 1), 0.02)
        return g / p

    def access(self, b: int, now: float, req: int, hit: bool) -> None:
        self.version[b] += 1
        if hit:
            g = now - self.last_t[b]
            if g > 0:
                self.gap[b] = g if self.gap[b] == 0 else (
                    self.alpha * g + (1 - self.alpha) * self.gap[b])
        self.last_t[b] = now
        self.owner[b] = self.cur_conv

    def insert(self, b: int, now: float, req: int) -> None:
        old = self.ghost.pop(b, None)  # evicted before: its reuse interval is known
        if old is None:
            self.gap[b] = 0.0
        else:
            g = now - old[0]
            self.gap[b] = g if old[1] == 0 else self.alpha * g + (1 - self.alpha) * old[1]
        self.last_t[b] = now

    def evicted(self, b: int) -> None:
        self.ghost[b] = (self.last_t[b], self.gap[b])
        if len(self.ghost) > self.ghost_cap:
            self.ghost.popitem(last=False)

    def leaf(self, b: int, now: float) -> None:
        self.version[b] += 1
        d, v = -self.sim.depth[b], self.version[b]
        if self.owner[b] in self.ended:  # its session is over: first to go
            heapq.heappush(self.due, (float("-inf"), d, b, v))
            return
        g = self._expected_gap(b)
        heapq.heappush(self.far, (-(self.last_t[b] + g), d, b, v))
        heapq.heappush(self.due, (self.last_t[b] + self.overdue * g, d, b, v))

    def victim(self, now: float) -> int:
        due = self.due
        while due and not self.valid(due[0][2], due[0][3]):
            heapq.heappop(due)
        if due and due[0][0] < now:
            return heapq.heappop(due)[2]
        far = self.far
        while True:
            e = heapq.heappop(far)
            if self.valid(e[2], e[3]):
                break
        if not self.cost:
            return e[2]
        cands = [e]
        while far and len(cands) < self.sample:
            x = heapq.heappop(far)
            if self.valid(x[2], x[3]):
                cands.append(x)

        def value(x: tuple) -> float:  # cost per second of predicted idleness
            return self.w[x[2]] / max(-x[0] - now, 1e-9)

        best = min(cands, key=value)
        for x in cands:
            if x is not best:
                heapq.heappush(far, x)
        return best[2]


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
