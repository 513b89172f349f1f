"""Candidate eviction policies for ``policy_sim.py`` (what each one is for: its docstring).

Each keeps O(log n) work per block touched: lazily invalidated heaps of evictable leaves.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING

from radixkv.benchmarks.policy_sim_base import SimPolicy, _KeyHeap
from radixkv.benchmarks.prefill_cost import block_cost

if TYPE_CHECKING:
    from radixkv.benchmarks.policy_sim import Simulator


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
