"""The per-block models the tree machine (``test_tree_state.py``) runs beside the real tree:
``MBlock`` (one cached block as the model sees it), ``GhostTableModel`` (lfu-ghost's count table,
slot by slot) and ``ForecastModel`` (the next-use forecast's per-block state). They know nothing
of runs: every block is its own entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixkv.core.policy_ghost import ghost_slot


@dataclass
class MBlock:
    parent: bytes | None
    tier: int
    refs: int = 0
    last_access: float = 0.0
    hits: int = 0
    priority: int = 0
    copies: set[int] = field(default_factory=set)
    born: float = 0.0            # fifo: when its run was cached
    kda: float = 0.0             # lfu-da: L + hits at its last hit (or when cached)
    gap: float = 0.0             # forecast: reuse interval (moving average), 0: none yet
    owner: object = None         # forecast: session of its last use
    fkey: tuple = (0.0, 0.0)     # forecast: (due, -far), snapshotted when it became unheld
    gbase: int = 0               # lfu-ghost: the count its run restored from the ghost table


class GhostTableModel:
    """lfu-ghost's table of dropped blocks' counts (policy_ghost's module docstring): a slot
    per hash (the policy's own ``ghost_slot``), holding a fingerprint and a count."""

    def __init__(self, capacity: int, factor: float = 4.0) -> None:
        n = 1
        while n < factor * capacity:
            n <<= 1
        self.mask = n - 1
        self.slots: dict[int, tuple[int, int]] = {}

    def take(self, h: bytes) -> int | None:
        """The count remembered for ``h`` (None: none), which leaves the table."""
        s, f = ghost_slot(h, self.mask)
        got = self.slots.get(s)
        if got is None or got[0] != f:
            return None
        del self.slots[s]
        return got[1]

    def dropped(self, h: bytes, b: MBlock) -> None:
        self.slots[ghost_slot(h, self.mask)[0]] = (ghost_slot(h, self.mask)[1],
                                                   min(255, b.gbase + b.hits))


class ForecastModel:
    """The forecast policy's statistics, written again from its definition (policy_forecast's
    module docstring), per block: sessions' turn gaps, the follow-up fraction, the learned
    overdue factor, and each block's key."""

    NEVER = 1e12

    def __init__(self) -> None:
        self.overdue, self.mean_gap = 2.0, 0.0
        self.requests = self.followups = 0
        self.sessions = self.announced = 0
        self.ratios: list[float] = []
        self.last: dict = {}
        self.gapof: dict = {}
        self.ended: set = set()
        self.anon = 0
        self.current = None

    def start(self, session, end: bool, now: float) -> None:
        if session is None:
            conv = ("anon", self.anon)
            self.anon += 1
        else:
            conv = session
        self.current = conv
        self.requests += 1
        if end:
            if session is not None and conv not in self.ended:
                self.announced += 1
            self.ended.add(conv)
        if session is None:
            return
        if conv not in self.last:
            self.sessions += 1
        if conv in self.last:
            self.followups += 1
            g = now - self.last[conv]
            forecast = self.gapof.get(conv, self.mean_gap)
            if forecast > 0:
                self.ratios.append(g / forecast)
                r = self.ratios
                if len(r) >= 64 and len(r) % 32 == 0:
                    self.overdue = sorted(r[-2048:])[int(0.5 * (len(r[-2048:]) - 1))]
            self.gapof[conv] = g
            self.mean_gap = g if self.mean_gap == 0 else 0.9 * self.mean_gap + 0.1 * g
        self.last[conv] = now

    def expected(self, b: MBlock) -> float:
        if b.gap > 0:
            return b.gap
        if not self.mean_gap:
            return self.NEVER
        return self.gapof.get(b.owner, self.mean_gap) / max(
            self.followups / max(self.requests, 1), 0.02)

    def snapshot(self, b: MBlock) -> None:
        if b.gap == 0 and not self.mean_gap:     # nothing known: first, LRU among themselves
            b.fkey = (float("-inf") if b.owner in self.ended else float("inf"), -self.NEVER)
            return
        g = self.expected(b)
        # overdue is judged against the gap the session keeps if it goes on, not against g
        plain = b.gap if b.gap > 0 else (self.gapof.get(b.owner, self.mean_gap) or self.NEVER)
        # given 1 / (share of sessions not announced as ended) times longer, at most 16
        patience = 1.0 / max(1.0 - self.announced / max(self.sessions, 1), 1.0 / 16)
        due = (float("-inf") if b.owner in self.ended
               else b.last_access + self.overdue * patience * plain)
        b.fkey = (due, -(b.last_access + g))

    def hit(self, b: MBlock, prev: float, now: float) -> None:
        g = now - prev
        if g > 0:
            b.gap = g if b.gap == 0 else 0.5 * g + 0.5 * b.gap
        b.owner = self.current

    def new_head(self, h: bytes, b: MBlock, now: float) -> None:
        """``b`` starts a new run: no reuse interval yet (nothing is kept of dropped blocks),
        owned by the request's session."""
        b.gap = 0.0
        b.owner = self.current
        self.snapshot(b)
