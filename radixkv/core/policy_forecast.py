"""The next-use forecast: evict what will be needed last, as Belady would, with a guess of "when".

A conversation (an agent session, ...) comes back turn after turn; LRU evicts the one that has
waited longest, which in a loop bigger than the cache is exactly the one coming back next. This
policy forecasts each node's next use and evicts the farthest forecast, but first any node that
is *overdue*: silent for longer than its forecast times a learned factor, so its session has
probably ended. A session the client *said* has ended (``end_session``) goes first of all.

Per node (``aux``, set by the hooks; ``policy.py`` describes the seam):

- ``gap``: the node's reuse interval, an exponential moving average (``alpha``) of the time
  between its hits; 0 until it is reused (a block cached again after it was dropped starts
  afresh: the ghost of dropped blocks that gave it its old interval cost 7-10% of LRU's
  bookkeeping per request, and RAG, the one workload where it paid, does better without it
  by ordering never-forecast blocks LRU among themselves: docs/eviction.md).
- ``owner``: the session of its last use.
- ``(due, -far)``, its key (then ``last_access``), snapshotted when the node becomes evictable
  (its last holder
  releases it, or it is cached unheld): expected gap ``g`` = its own ``gap`` if known, else
  its session's last turn gap (else the mean turn gap) divided by the fraction of requests
  that had a follow-up (a new block is only reused if its session goes on); ``far`` = last
  access + g; ``due`` = last access + ``overdue`` x ``patience`` x the same gap *not*
  divided by that fraction (the gap the session keeps if it goes on, against which
  ``overdue`` is learned; ``patience``: 1 / the share of sessions not announced as ended, at
  most 16, so 1 where clients never announce ends; ``-inf``: its session has ended).
  Nothing known (no reuse yet and no session has come back yet, e.g. anonymous requests):
  ``(+inf, -NEVER)``, so such nodes go before every forecast one, LRU among themselves
  (``due`` ``-inf`` if the session ended).

Per policy: per session, the time and gap of its last request; the mean turn gap; the fraction
of requests that are follow-ups; ``overdue``: the ``quantile`` (median) of observed
gap / forecast gap of returning sessions, x ``slack`` (learned every 32 follow-ups once 64 are
seen; 2 before). Sessions come from the client (``allocate(..., session=)``, a chat session,
the server's ``session_id``); a request without one is its own session.

The index (``ForecastIndex``) keeps two orders of the evictable entries, by ``due`` and by
``-far``; the victim is the smallest ``due`` if it is past, else the smallest ``-far``
(farthest forecast). Entries are whole keys plus the block hash, and each order sorts by its
field and then the whole entry, so blocks with equal keys tie exactly as in a per-block cache.

Measured in the simulator (docs/eviction.md) as ``next-use``: alone it gains up to 51 points over
LRU on round-robin chat but loses up to 4 on open-loop chat; ``policy_duel.py`` keeps the gains
and drops the losses. Runtime complexity: O(1) per node event, amortised O(log n) per filing
(two heaps); learning ``overdue`` keeps the last 2,048 ratios sorted by insertion (O(log n)
search and an O(n) C-level move of at most 2,048 floats per follow-up).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from heapq import heapify, heappop, heappush
from itertools import count
from typing import TYPE_CHECKING

from radixkv.core.evict_index import Entry
from radixkv.core.policy import EvictionPolicy, Key, NodeHints, PolicyHost
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.core.hashing import BlockHash, Namespace
    from radixkv.core.node import Node

#: A node's ``aux`` under this policy: ``(due, -far, gap, owner)`` (module docstring). Set by
#: the hooks; their reads of it are marked ``type: ignore`` (``node.aux`` is ``object`` to the
#: tree; policy.py says why no ``cast``).
ForecastAux = tuple[float, float, float, Hashable]

NEVER = 1e12           # the forecast gap of a block nothing suggests will come back (seconds)
MAX_SESSIONS = 1 << 16  # sessions remembered (oldest forgotten first)
_NEG_INF = float("-inf")
_INF = float("inf")
_NEG_NEVER = -NEVER


class ForecastPolicy(EvictionPolicy):
    """Overdue first, then the farthest forecast next use. Key: ``(due, -far, last_access)``; see
    the module
    docstring. ``quantile``/``slack``: how late a session may come back before it counts as
    ended; ``alpha``: weight of the newest reuse interval."""

    name = "forecast"
    hooks = True
    key_size = 3
    #: the bound tree's clock (``bind``), read by ``ForecastIndex`` (None before ``bind``,
    #: when no index of this policy holds anything yet)
    clock: Callable[[], float]

    def __init__(self, quantile: float = 0.5, slack: float = 1.0, alpha: float = 0.5) -> None:
        for what, v, lo, hi in (("quantile", quantile, 0.0, 1.0), ("alpha", alpha, 0.0, 1.0),
                                ("slack", slack, 0.0, 1e6)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v <= hi:
                raise ConfigError(f"forecast {what} must be in ({lo}, {hi}], got {v!r}")
        self.quantile, self.slack, self.alpha = float(quantile), float(slack), float(alpha)
        self.overdue = 2.0          # gaps of silence after which a session has ended (learned)
        self.mean_gap = 0.0         # seconds between a session's requests (moving average)
        self.requests = 0
        self.followups = 0
        self.sessions = 0           # sessions seen (their first request)
        self.announced = 0          # sessions the client said had ended (end_session)
        self.patience = 1.0         # see _count
        self._ratios: deque[float] = deque()   # the last 2,048 ratios, oldest first
        self._sorted: list[float] = []          # the same, sorted (kept by insort)
        self._observed = 0                      # ratios observed in all
        self._last: OrderedDict[Hashable, float] = OrderedDict()   # session -> last request
        self._gap: dict[Hashable, float] = {}                       # session -> last turn gap
        self._ended: OrderedDict[Hashable, None] = OrderedDict()
        self._seqs: dict[Hashable, Hashable] = {}                   # live sequence -> session
        self._leaf: dict[Hashable, BlockHash] = {}   # session -> last block of its last leaf
        self._releasing = False
        self._anon = count()
        # sequence -> the one-off session made up for it, kept so that a resumed request (no
        # session of its own) stays the same one-off session
        self._anon_of: OrderedDict[Hashable, Hashable] = OrderedDict()
        self.current: Hashable = None                                # session of the request
        self.clock = None  # type: ignore[assignment]  # set by bind, before any index use

    # ------------------------------------------------------------------ the key
    def key(self, node: Node, hints: NodeHints) -> Key:
        """``(due, -far, last_access)``: the access time only breaks ties (and keeps runs with
        different access times from coalescing, as every other policy's key does). (The hot
        hooks read ``node.aux`` inline, not through ``_aux``: once per node event.)"""
        i = self.aux_slot
        a: ForecastAux = node.aux if i is None else node.aux[i]  # type: ignore[index, assignment]
        return (a[0], a[1], node.last_access)

    def new_index(self) -> ForecastIndex:
        return ForecastIndex(self)

    def bind(self, tree: PolicyHost) -> None:
        super().bind(tree)
        self.clock = tree.clock

    def expected_gap(self, gap: float, owner: Hashable) -> float:
        """Seconds until a node with reuse interval ``gap`` (0: none yet) of session ``owner``
        is forecast to be used again."""
        if gap > 0:
            return gap
        if not self.mean_gap:
            return NEVER
        return self._gap.get(owner, self.mean_gap) / self._followup_share()

    def _followup_share(self) -> float:
        return max(self.followups / max(self.requests, 1), 0.02)

    def _snapshot(self, last: float, gap: float, owner: Hashable) -> ForecastAux:
        if gap > 0:
            g = plain = gap
        elif self.mean_gap:
            plain = self._gap.get(owner, self.mean_gap)
            g = plain / max(self.followups / max(self.requests, 1), 0.02)   # _followup_share
        else:   # nothing known (no reuse yet, no session statistics): among such, LRU
            return (_NEG_INF if owner in self._ended else _INF, _NEG_NEVER, gap, owner)
        if owner in self._ended:
            return (_NEG_INF, -(last + g), gap, owner)
        # overdue: late against the gap the session would keep *if* it goes on (the factor
        # was learned against that gap), not against the forecast g, which also prices in the
        # chance that it does not
        return (last + self.overdue * self.patience * (plain or NEVER), -(last + g), gap, owner)

    def _count(self, sessions: int = 0, announced: int = 0) -> None:
        """A new session, or one announced as ended: ``patience`` follows. How many times
        longer than ``overdue`` gaps a silent session is given because clients announce their
        ends: 1 / (the share of sessions *not* announced as ended), at most 16. Where clients
        say when a session is over, silence is weak evidence that one is; where none do, it
        is 1. (A session forgotten after MAX_SESSIONS others counts again when it returns.)"""
        self.sessions += sessions
        self.announced += announced
        self.patience = 1.0 / max(1.0 - self.announced / max(self.sessions, 1), 1.0 / 16)

    # ------------------------------------------------------------------ request events
    def on_start(self, seq_id: Hashable, num_tokens: int, namespace: Namespace,
                 session: Hashable | None, end_session: bool, now: float,
                 resumed: bool = False) -> None:
        """A sequence starts. A request is one turn of its session, however many times its
        sequences are allocated (``resumed``: preempted and resumed, its other samples, a
        retry): only its first allocation is a turn to learn the session's gap from."""
        self._releasing = False
        if session is not None:
            conv = session
        elif resumed and seq_id in self._anon_of:
            conv = self._anon_of[seq_id]
        else:
            conv = self._anon_of[seq_id] = ("anon", next(self._anon))
            if len(self._anon_of) > MAX_SESSIONS:
                self._anon_of.popitem(last=False)
        self._seqs[seq_id] = conv
        self.current = conv
        if end_session:
            if session is not None and conv not in self._ended:
                self._count(announced=1)
            self._ended[conv] = None
            if len(self._ended) > MAX_SESSIONS:
                self._ended.popitem(last=False)
        if resumed:
            return
        self.requests += 1
        if session is None:
            return          # a request on its own: no follow-up to learn from
        last = self._last.get(conv)
        if last is None:
            self._count(sessions=1)
        if last is not None:
            self.followups += 1
            g = now - last
            forecast = self._gap.get(conv, self.mean_gap)
            if forecast > 0:
                self._observe(g / forecast)
            self._gap[conv] = g
            self.mean_gap = g if self.mean_gap == 0 else 0.9 * self.mean_gap + 0.1 * g
            self._last.move_to_end(conv)
        self._last[conv] = now
        if len(self._last) > MAX_SESSIONS:
            old, _ = self._last.popitem(last=False)
            self._gap.pop(old, None)

    def _observe(self, ratio: float) -> None:
        """Learn how late a session may come back: the ``quantile`` of observed gap / forecast
        (1.0 for a strict round robin, about 0.7 for exponential think times at the median),
        x ``slack``. The median beat the 0.9 quantile on every workload but agents in the
        simulator (docs/eviction.md): a session is written off early, and the LRU member of
        the duel takes over where that is wrong."""
        r, srt = self._ratios, self._sorted
        r.append(ratio)
        insort(srt, ratio)
        if len(r) > 2048:       # the window: the last 2,048 ratios
            del srt[bisect_left(srt, r.popleft())]
        n = self._observed = self._observed + 1
        if n >= 64 and n % 32 == 0:
            self.overdue = self.slack * srt[int(self.quantile * (len(srt) - 1))]

    def on_fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        self._seqs[child_id] = self._seqs.get(parent_id)

    def enter(self, seq_id: Hashable) -> None:
        self.current = self._seqs.get(seq_id)
        self._releasing = True

    def end_session(self, session: Hashable) -> None:
        """Mark ``session`` ended and re-key the nodes it was the last to use, from the last
        leaf it released up to the first node another session used since: they go first."""
        if session not in self._ended:
            self._count(announced=1)
        self._ended[session] = None
        if len(self._ended) > MAX_SESSIONS:
            self._ended.popitem(last=False)
        tree = self._tree
        h = self._leaf.pop(session, None)
        node = None if h is None else tree.find(h)
        while node is not None:
            a: ForecastAux | None = self._aux(node)  # type: ignore[assignment]  # aux: ours
            if a is None or a[3] != session:
                break
            tree.rekey(node, self._aux_with(node, (float("-inf"), *a[1:])))
            node = node.parent

    def on_finish(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        self._seqs.pop(seq_id, None)

    # ------------------------------------------------------------------ node events
    def on_insert(self, node: Node, start: int, now: float) -> None:
        """A new node: no reuse yet, owned by the request's session. Blocks appended to a run
        share the run's state."""
        if not start:
            self._set_aux(node, self._snapshot(node.last_access, 0.0, self.current))

    def on_hit(self, node: Node, prev_access: float, now: float) -> None:
        i = self.aux_slot
        a: ForecastAux = node.aux if i is None else node.aux[i]  # type: ignore[index, assignment]
        gap = a[2]
        g = now - prev_access
        if g > 0:
            gap = g if gap == 0 else self.alpha * g + (1 - self.alpha) * gap
        if i is None:
            node.aux = (a[0], a[1], gap, self.current)
        else:
            node.aux = self._aux_with(node, (a[0], a[1], gap, self.current))

    def on_release(self, node: Node, now: float) -> None:
        i = self.aux_slot
        a: ForecastAux
        if i is None:
            a = node.aux  # type: ignore[assignment]  # aux: ours (ForecastAux)
            node.aux = self._snapshot(now, a[2], a[3])
        else:
            a = node.aux[i]  # type: ignore[index]  # aux: the composite's tuple
            node.aux = self._aux_with(node, self._snapshot(now, a[2], a[3]))
        if self._releasing:        # the deepest node a finished sequence let go of
            self._releasing = False
            if a[3] is not None and not (type(a[3]) is tuple and a[3][:1] == ("anon",)):
                self._leaf[a[3]] = node.hashes[-1]
                if len(self._leaf) > MAX_SESSIONS:
                    del self._leaf[next(iter(self._leaf))]


class ForecastIndex:
    """The forecast's evictable entries ``(due, -far, ..., hash)`` in two orders: by ``due``
    and by ``-far`` (each then by the whole entry). ``min``/``pop_min``: the smallest ``due``
    if it is before the policy's clock, else the smallest ``-far``.

    Both orders are ``heapq`` heaps (C) with lazy deletion, as in ``RecencyIndex``: a dict from
    block hash (unique in an index) to the live entry object says which heap items are live
    (``live.get(e[-1]) is e``; every add brings a new tuple, so a dead copy of an equal entry is
    never taken for it); ``remove`` only forgets the entry, dead items are dropped when they
    reach a heap's top, and both heaps are rebuilt when dead items outnumber live ones. The
    same order as two ``SortedList``s (heaps of the same tuples), without their Python-level
    add and remove: in the duel every node of the real tree is filed here too (1-3% of the
    default duel's bookkeeping, measured on the four workloads).
    Runtime complexity: amortised O(log n) per operation."""

    __slots__ = ("_due", "_far", "_live", "_policy")

    def __init__(self, policy: ForecastPolicy) -> None:
        self._due: list[Entry] = []                   # entries
        self._far: list[tuple[float, Entry]] = []     # (-far, entry)
        self._live: dict[BlockHash, Entry] = {}       # block hash -> its live entry
        self._policy = policy

    def add(self, entry: Entry) -> None:
        """Add ``entry`` (a new tuple, not in the index, ending with its unique block hash)."""
        live = self._live
        live[entry[-1]] = entry
        due, far = self._due, self._far
        heappush(due, entry)
        heappush(far, (entry[1], entry))
        if len(due) + len(far) > 4 * len(live) + 128:
            self._compact()

    def _compact(self) -> None:
        """Drop the dead items of both heaps (O(n), after at least about n removals)."""
        live = self._live
        self._due = [e for e in self._due if live.get(e[-1]) is e]
        self._far = [x for x in self._far if live.get(x[1][-1]) is x[1]]
        heapify(self._due)
        heapify(self._far)

    def remove(self, entry: Entry) -> None:
        """Remove ``entry`` (must be present; ValueError otherwise)."""
        live = self._live
        if live.get(entry[-1]) != entry:
            raise ValueError(f"{entry!r} is not in the index")
        del live[entry[-1]]

    def min(self) -> Entry:
        live, due = self._live, self._due
        while due and live.get(due[0][-1]) is not due[0]:
            heappop(due)
        if not due:
            raise IndexError("min() of an empty index")
        d = due[0]
        if d[0] < self._policy.clock():
            return d
        far = self._far
        while live.get(far[0][1][-1]) is not far[0][1]:
            heappop(far)
        return far[0][1]

    def pop_min(self) -> Entry:
        e = self.min()
        del self._live[e[-1]]
        if self._due[0] is e:       # else it is the far heap's top
            heappop(self._due)
        else:
            heappop(self._far)
        return e

    def pop_min_peek(self) -> tuple[Entry, Entry | None]:
        """``(pop_min(), min() after it or None)`` in one call, with one read of the clock (the
        device-only eviction loop, ``MovePlanner._drop_device_lru``, reads the next entry for
        the per-block tie rule). Runtime complexity: as ``pop_min``."""
        live, due, far = self._live, self._due, self._far
        while due and live.get(due[0][-1]) is not due[0]:
            heappop(due)
        if not due:
            raise IndexError("pop_min() of an empty index")
        now = self._policy.clock()
        if due[0][0] < now:
            e = heappop(due)
        else:
            while live.get(far[0][1][-1]) is not far[0][1]:
                heappop(far)
            e = heappop(far)[1]
        del live[e[-1]]
        if not live:
            return e, None
        while live.get(due[0][-1]) is not due[0]:
            heappop(due)
        d = due[0]
        if d[0] < now:
            return e, d
        while live.get(far[0][1][-1]) is not far[0][1]:
            heappop(far)
        return e, far[0][1]

    def __contains__(self, entry: Entry) -> bool:
        return self._live.get(entry[-1]) == entry

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Entry]:
        """In ``due`` order (for checks)."""
        return iter(sorted(self._live.values()))

    def check_invariants(self) -> None:
        live = self._live
        due = [e for e in self._due if live.get(e[-1]) is e]
        far = [x[1] for x in self._far if live.get(x[1][-1]) is x[1]]
        assert len(due) == len(live), f"{len(live)} live entries, {len(due)} in the due heap"
        assert len(far) == len(live), f"{len(live)} live entries, {len(far)} in the far heap"
        assert all(x[0] == x[1][1] for x in self._far), "a far item keyed wrong"
        for h in (self._due, self._far):
            assert all(h[(i - 1) // 2] <= h[i] for i in range(1, len(h))), "not a heap"
