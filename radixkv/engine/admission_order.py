"""In which order the scheduler tries to admit waiting requests (FCFS, cached prefix first, or
by the caller's priority), and which running request it preempts first.

The scheduler admits waiting requests in queue order while blocks, ``max_num_seqs`` and the
token budget allow (see :mod:`radixkv.engine.scheduler`). When requests queue up, that order
decides how much of the queue's work the cache saves: a request whose prefix is cached now may
find it evicted by the time its turn comes, and a request whose prefix is cached costs a small
share of a cold one's prefill, so running it first shortens every wait behind it. An
:class:`AdmissionOrder` reorders the waiting queue once per step, just before admission:

* :class:`FCFSOrder` (``scheduling_policy="fcfs"``): arrival order (the queue as it is).
* :class:`LongestPrefixFirst` (``"lpm"``, SGLang's longest-prefix-match policy): the first
  ``window`` waiting requests (in arrival order) are ranked by how many of their prompt's
  blocks are cached (any tier), longest first. Requests that share a prefix nobody has cached
  yet form a *group*: one of them (the *leader*, the first in arrival order) is ranked like the
  others, by its cached blocks and then by its group's size (a leader whose prefix many others
  wait for goes first among equally cached requests); its *followers* come right behind it.
  Once the leader is admitted, the scheduler holds its followers until it has computed and
  committed the shared blocks (:mod:`radixkv.engine.shared_prefix`), after which they match
  them and rank among the longest prefixes: the shared prefix is computed once.
* :class:`PriorityOrder` (``"priority"``, vLLM's ``--scheduling-policy priority``): by the
  request's ``priority`` (lower first; ``LLMEngine.add_request(priority=...)``), then arrival
  time. When the pool runs short, the running request with the highest ``(priority,
  arrival_time)`` is preempted first (the others preempt the most recently admitted), so a
  batch job is recomputed later rather than an interactive turn. Like vLLM's v1 scheduler it
  does not preempt running requests to admit a more urgent waiting one: urgency decides who
  goes next and who goes first when memory runs out, not who stops now.

**Preemption victim.** :meth:`AdmissionOrder.victim` picks the running request to preempt when
the running sequences' next tokens do not fit the pool (``Scheduler``, step 1): the most
recently admitted one for FCFS and lpm (the request that has had least time to make progress
loses least), the least urgent one for ``priority``.

**Age limit.** A request that has waited ``max_wait_s`` seconds or more (since its
``arrival_time``) is *over age*: every over-age request is placed before the ranked window,
in arrival order. Admission stops at the first request that does not fit, so no younger
request overtakes an over-age one except when the scheduler holds it for a leader computing
its prefix (which ends once the leader commits those blocks). When capacity allows, an
over-age request is therefore admitted at the first step after it turns over age that has room
for it and for the over-age requests older than it: nothing starves.

**Cost per step.** Matching a request is a pure read of the tree
(:meth:`~radixkv.core.tree.RadixTree.match_hashes`, O(matched blocks) byte comparisons) plus
one block hash for its group key, and only the ``window`` oldest non-over-age requests are
matched. Results are kept per request, keyed by the tree's *version*
(``(blocks inserted, blocks dropped)`` since construction: a match can change only when a
block enters or leaves the cache; moves between tiers do not change it), so a step after one
that changed nothing in the tree matches nothing. Sorting the queue by arrival time is
O(queue) for a queue that is already nearly in order.

Pure Python (no torch): the scheduler imports this module.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from radixkv.core.hashing import TOKEN_BYTES, chain_hash, token_bytes
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.core.block_manager import BlockManager
    from radixkv.engine.sequence import Request

#: ``scheduling_policy`` values.
POLICIES = ("fcfs", "lpm", "priority")
#: Defaults of :class:`LongestPrefixFirst` (``EngineConfig`` carries the same).
DEFAULT_WINDOW = 32
DEFAULT_MAX_WAIT_S = 2.0


class AdmissionOrder(Protocol):
    """Reorders the waiting queue before each step's admissions (in place)."""

    name: str

    def reorder(self, waiting: deque[Request]) -> None:
        """Put ``waiting`` in the order admission should try it. Must keep exactly the same
        requests (a permutation) and must not touch the block manager."""
        ...

    def victim(self, running: Sequence[Request]) -> int:
        """The index in ``running`` (admission order, not empty) of the request to preempt
        first when the running sequences' next tokens do not fit the pool."""
        ...


class FCFSOrder:
    """First come, first served: the queue as it is (the null object: reorders nothing)."""

    name = "fcfs"

    def reorder(self, waiting: deque[Request]) -> None:
        return None

    def victim(self, running: Sequence[Request]) -> int:
        return len(running) - 1


class PriorityOrder:
    """vLLM's priority scheduling: waiting requests by ``(priority, arrival_time)``, lower
    first, and the running request with the highest ``(priority, arrival_time)`` preempted
    first (ties: the most recently admitted). See the module docstring. O(queue log queue)
    per step, O(queue) for a queue that is already in order (Timsort)."""

    name = "priority"

    def reorder(self, waiting: deque[Request]) -> None:
        if len(waiting) < 2:
            return
        order = sorted(waiting, key=_urgency)   # stable: equal keys keep queue order
        waiting.clear()
        waiting.extend(order)

    def victim(self, running: Sequence[Request]) -> int:
        best = len(running) - 1
        key = _urgency(running[best])
        for i in range(best - 1, -1, -1):
            k = _urgency(running[i])
            if k > key:
                best, key = i, k
        return best


class _Match(NamedTuple):
    """What a request's match found, valid for one tree version and one token count."""

    version: tuple[int, int]
    num_tokens: int          # len(token ids) matched (a preempted request's grow while running)
    cached_blocks: int       # full blocks of its prompt cached in some tier
    group: bytes | None      # chain hash of its first uncached shareable block (None: none)


class LongestPrefixFirst:
    """SGLang's longest-prefix-match order over a bounded window, with groups and an age limit
    (see the module docstring).

    Args:
        block_manager: the scheduler's block manager; only its public ``tree`` and
            ``block_size`` are read, and the tree only through ``match_hashes`` and ``stats``.
        window: how many of the oldest waiting requests (after the over-age ones) are matched
            and ranked each step; the rest keep arrival order behind them.
        max_wait_s: the age limit in seconds (of ``clock``, the clock of the requests'
            ``arrival_time``).
        clock: seconds; ``time.perf_counter`` like ``Request.arrival_time``. Tests inject one.
    """

    name = "lpm"

    def __init__(self, block_manager: BlockManager, window: int = DEFAULT_WINDOW,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        check_lpm_options(window, max_wait_s)
        self.tree = block_manager.tree
        self.block_size = block_manager.block_size
        self.window = window
        self.max_wait_s = float(max_wait_s)
        self.clock = clock
        # request id -> (id(), tokens, match)
        self._memo: dict[str, tuple[int, bytes, _Match]] = {}
        #: counters since construction: steps reordered, requests matched (tree read) and
        #: taken from the memo, over-age requests placed first (per step, so one request
        #: counts once per step it is over age)
        self.reorders = 0
        self.matches = 0
        self.memo_hits = 0
        self.over_age = 0

    def _version(self) -> tuple[int, int]:
        st = self.tree.stats
        return st.inserted, st.dropped

    def _match(self, req: Request, version: tuple[int, int], memo: dict) -> _Match:
        """Cached blocks and group key of ``req`` (its first sequence, as ``allocate`` sees it:
        at most ``(n-1)//B`` blocks, the block of its last token is private)."""
        toks = req.seqs[0].token_ids if req.seqs else req.prompt_token_ids
        n = len(toks)
        old = self._memo.get(req.request_id)
        if old is not None and old[0] == id(req) and old[2].num_tokens == n:
            if old[2].version == version:
                self.memo_hits += 1
                memo[req.request_id] = old
                return old[2]
            tok = old[1]
        else:
            tok = token_bytes(toks)
        self.matches += 1
        limit = (n - 1) // self.block_size
        seed = req.namespace.seed
        hashes = self.tree.match_hashes(tok, seed, limit)
        m = len(hashes)
        group = None
        if m < limit:
            w = self.block_size * TOKEN_BYTES
            group = chain_hash(hashes[-1] if m else seed, tok[m * w:(m + 1) * w])
        got = _Match(version, n, m, group)
        memo[req.request_id] = (id(req), tok, got)
        return got

    def order(self, waiting: Sequence[Request]) -> list[Request]:
        """The admission order of ``waiting`` (a permutation of it): over-age requests in
        arrival order, the ranked window, the rest in arrival order.
        O(queue) + O(window log window) + the window's matches (see the module docstring)."""
        self.reorders += 1
        fcfs = sorted(waiting, key=_arrival)   # stable: equal times keep queue order
        due = self.clock() - self.max_wait_s
        cut = 0
        while cut < len(fcfs) and fcfs[cut].arrival_time <= due:
            cut += 1
        self.over_age += cut
        window = fcfs[cut:cut + self.window]
        if len(window) < 2:
            return fcfs
        version = self._version()
        memo: dict[str, tuple[int, bytes, _Match]] = {}
        matches = [self._match(r, version, memo) for r in window]
        self._memo = memo   # only the window's entries survive: O(window) memory
        members: dict[bytes, list[int]] = {}
        for i, mt in enumerate(matches):
            if mt.group is not None:
                members.setdefault(mt.group, []).append(i)
        leaders = []
        for i, mt in enumerate(matches):
            group = members.get(mt.group) if mt.group is not None else None
            if group is None:
                leaders.append((-mt.cached_blocks, -1, i))
            elif group[0] == i:
                leaders.append((-mt.cached_blocks, -len(group), i))
        leaders.sort()
        ranked: list[Request] = []
        for _, _, i in leaders:
            mt = matches[i]
            group = members.get(mt.group) if mt.group is not None else None
            ranked.extend(window[j] for j in (group if group is not None else (i,)))
        return fcfs[:cut] + ranked + fcfs[cut + self.window:]

    def reorder(self, waiting: deque[Request]) -> None:
        if len(waiting) < 2:
            return
        order = self.order(waiting)
        waiting.clear()
        waiting.extend(order)

    def victim(self, running: Sequence[Request]) -> int:
        return len(running) - 1

    def stats(self) -> dict[str, int]:
        return {"reorders": self.reorders, "matches": self.matches,
                "memo_hits": self.memo_hits, "over_age": self.over_age}


def _arrival(req: Request) -> float:
    return req.arrival_time


def _urgency(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


def check_lpm_options(window: object, max_wait_s: object) -> None:
    """Raise ``ConfigError`` unless ``window`` is an int >= 1 and ``max_wait_s`` a number >= 0."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"scheduling window must be an int >= 1, got {window!r}")
    if (not isinstance(max_wait_s, (int, float)) or isinstance(max_wait_s, bool)
            or not max_wait_s >= 0 or max_wait_s == float("inf")):
        raise ConfigError(f"scheduling max_wait_s must be a finite number of seconds >= 0, "
                          f"got {max_wait_s!r}: it bounds how long lpm may pass a request over")


def make_admission_order(policy: str, block_manager: BlockManager,
                         window: int = DEFAULT_WINDOW, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                         clock: Callable[[], float] = time.perf_counter) -> AdmissionOrder:
    """The ``AdmissionOrder`` for a ``scheduling_policy`` name (``ConfigError`` otherwise)."""
    if policy == "fcfs":
        return FCFSOrder()
    if policy == "lpm":
        return LongestPrefixFirst(block_manager, window, max_wait_s, clock)
    if policy == "priority":
        return PriorityOrder()
    raise ConfigError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {policy!r}")


__all__ = [
    "DEFAULT_MAX_WAIT_S",
    "DEFAULT_WINDOW",
    "POLICIES",
    "AdmissionOrder",
    "FCFSOrder",
    "LongestPrefixFirst",
    "PriorityOrder",
    "check_lpm_options",
    "make_admission_order",
]
