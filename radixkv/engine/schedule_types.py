"""The scheduler's small types: what one step computes (``ScheduledChunk``,
``SchedulerOutput``), its counters, the two executors (``RunOps``, ``Loads``), and the plan
protocol: the scheduler's step is a generator (``Plan``) that *yields* the KV work it needs done
before it can decide further (``IORequest``) and receives the failures back; :func:`drive`, run
by the engine, executes them. Kept apart so ``scheduler.py`` holds only the policy.

Pure Python: imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from radixkv.core.block_manager import CopyOp
from radixkv.core.tree import MoveOp
from radixkv.engine.sequence import Request, Sequence

T = TypeVar("T")


class ScheduledChunk(NamedTuple):
    """Compute KV of ``seq.token_ids[start : start + num_tokens]``; logits for the last one
    iff ``wants_logits`` (that is, iff the chunk reaches the end of the sequence).

    A NamedTuple (immutable) rather than a frozen dataclass: one is made per sequence per
    step, and a frozen dataclass's ``__init__`` costs twice as much."""

    request: Request
    seq: Sequence
    start: int
    num_tokens: int
    wants_logits: bool


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    kv_ops: list[MoveOp | CopyOp] = field(default_factory=list)   # run in order, before forward
    preempted: list[Request] = field(default_factory=list)
    unschedulable: list[Request] = field(default_factory=list)  # can never fit the pool

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerCounters:
    """Counters since construction (read by ``LLMEngine.stats``)."""

    prompt_tokens: int = 0                    # prompt tokens of admitted requests (first time)
    cached_prompt_tokens: int = 0
    cached_tokens_per_tier: list[int] = field(default_factory=list)
    computed_tokens: int = 0                  # every token whose KV a forward computed
    prefill_tokens: int = 0                   # of which in prefill chunks (incl. recompute)
    recomputed_tokens: int = 0                # re-prefilled after preemption
    preemptions: int = 0
    steps: int = 0
    load_failures: int = 0                    # blocks whose promotion failed (recomputed)
    load_retries: int = 0                     # allocations redone after a failed promotion
    loading_steps: int = 0                    # request-steps spent waiting for a promotion
    load_waits: int = 0                       # steps that blocked on promotions (nothing else)
    unschedulable: int = 0                    # requests finished: cannot fit an empty pool
    held_admissions: int = 0                  # admissions deferred to share a prefix being computed
    staged_joins: int = 0                     # sequences allocated after their leader's prefix


#: Executes KV ops now, in order; returns the hashes of blocks whose promotion failed.
RunOps = Callable[[Seq["MoveOp | CopyOp"]], Seq[bytes]]


class Loads(Protocol):
    """Promotions in flight (the engine adapts its mover). Each call that settles loads
    returns the hashes of the blocks whose promotion failed since the last call."""

    def poll(self) -> Seq[bytes]:
        """Settle the promotions that finished, without blocking."""
        ...

    def wait(self) -> Seq[bytes]:
        """Block until every promotion in flight is settled."""
        ...

    def inflight(self) -> frozenset[int]:
        """Device blocks still being written by a promotion."""
        ...


@dataclass(frozen=True)
class IORequest:
    """What a scheduler plan asks its driver to do, and get back the hashes of failed
    promotions for: ``run`` the ops now (in order), ``poll`` the loads in flight, ``wait`` for
    every load in flight."""

    kind: str
    ops: tuple = ()


POLL = IORequest("poll")
WAIT = IORequest("wait")

#: A scheduler plan: a generator that yields I/O requests, receives each one's failed hashes,
#: and returns its result (a ``SchedulerOutput`` for a step).
Plan = Generator[IORequest, Seq[bytes], T]


def drive(plan: Plan[T], run_ops: RunOps | None, loads: Loads | None) -> T:
    """Run ``plan`` to its result, executing each request it yields with ``run_ops`` /
    ``loads`` (the engine's mover) and sending back the failed hashes. The scheduler itself
    never executes anything: this loop, owned by its caller, does."""
    try:
        req = next(plan)
        while True:
            if req.kind == "run":
                failed = list(run_ops(req.ops)) if run_ops is not None else []
            elif req.kind == "poll":
                failed = list(loads.poll()) if loads is not None else []
            else:
                failed = list(loads.wait()) if loads is not None else []
            req = plan.send(failed)
    except StopIteration as stop:
        return stop.value


__all__ = ["ScheduledChunk", "SchedulerOutput", "SchedulerCounters", "RunOps", "Loads",
           "IORequest", "Plan", "drive", "POLL", "WAIT"]
