"""Continuous batching: which sequences compute which tokens in the next forward.

Every step the scheduler, in this order,

1. reserves KV slots for the running sequences' pending tokens (the token sampled last step).
   If the pool (free + evictable blocks) is short, it *preempts* the most recently admitted
   request: frees its sequences (their committed full blocks stay in the prefix cache) and puts
   it back at the FRONT of the waiting queue. Resuming re-prefills the sequence's tokens, mostly
   from the cache; greedy output is unchanged (recompute-preemption, as in vLLM).
2. gives running requests, oldest first, their tokens to compute within
   ``max_num_batched_tokens``: a decode is one token per live sequence, a prefill the uncached
   suffix of the prompt. A prefill that does not fit is *chunked*: it computes up to all but its
   last token now, and the rest in later steps (only the last token produces logits).
3. admits waiting requests first-come-first-served while blocks, ``max_num_seqs`` and the token
   budget allow. Admission stops at the first request that does not fit (no overtaking, so the
   head of the queue is never starved), and is skipped in a step that had to preempt (else the
   victim would be re-admitted at once and thrash).

Group rule: all live sequences of a request (n samples, beams) get their logits in the same
step, so a request is sampled as a whole; when a group does not fit the budget entirely, each
sequence advances by at most ``remaining - 1`` tokens.

KV operations (tier moves from allocation/eviction and copy-on-write copies) are returned in the
order the block manager produced them; the engine runs them before the forward. With a
``run_ops`` executor (the engine passes one) they run *during* scheduling instead, in the same
order: the pending ops before each allocation, and each allocation's moves right after it. That
is what makes a failed promotion safe: when loading a block from a slower tier fails
(``run_ops`` returns its hash), the request's sequences are freed, the node and its subtree are
invalidated, and the request is allocated again (its match now stops before the bad block, so
it recomputes) -- before any later request of the same step can match and lock that node.

Pure Python: imports no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

from radixkv.core.block_manager import BlockManager, CopyOp
from radixkv.core.tree import MoveOp
from radixkv.engine.sequence import Request, RequestStatus, Sequence
from radixkv.errors import OutOfBlocks


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute KV of ``seq.token_ids[start : start + num_tokens]``; logits for the last one
    iff ``wants_logits`` (that is, iff the chunk reaches the end of the sequence)."""

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


#: Executes KV ops now, in order; returns the hashes of blocks whose promotion failed.
RunOps = Callable[[Seq["MoveOp | CopyOp"]], Seq[bytes]]

_MAX_LOAD_RETRIES = 64


class Scheduler:
    """FCFS continuous batching over a :class:`BlockManager` (see module docstring)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, run_ops: RunOps | None = None) -> None:
        self.bm = block_manager
        self.run_ops = run_ops
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # in admission order; the last is preempted first
        self.counters = SchedulerCounters(cached_tokens_per_tier=[0] * block_manager.tree.num_tiers)

    # ------------------------------------------------------------------ queue management
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.seqs) for r in self.running)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and free its live sequences (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
            for seq in req.seqs:
                self.bm.free(seq.seq_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    def free_seq(self, req: Request, seq: Sequence) -> None:
        """A sequence of a running request ended (finished sample, losing beam)."""
        req.seqs.remove(seq)
        self.bm.free(seq.seq_id)

    def fork(self, req: Request, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (no new blocks until it appends)."""
        self.bm.fork(parent.seq_id, child.seq_id)
        req.seqs.append(child)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.counters.steps += 1
        self._reserve_appends(out)
        for req in self.running:
            for seq in req.seqs:
                if self.bm.num_tokens(seq.seq_id) < len(seq.token_ids):
                    s = self.bm.append_slot(seq.seq_id, seq.token_ids[-1])
                    out.kv_ops.extend(s.moves)
                    if s.copy is not None:
                        out.kv_ops.append(s.copy)
        self._flush(out)
        budget = self.max_num_batched_tokens
        for req in self.running:
            budget -= self._schedule_tokens(req, budget, out)
        if not out.preempted:
            self._admit(budget, out)
        self._flush(out)
        return out

    def _flush(self, out: SchedulerOutput) -> list[bytes]:
        """Run the pending KV ops now (with an executor); hashes of failed promotions."""
        if self.run_ops is None or not out.kv_ops:
            return []
        ops, out.kv_ops = out.kv_ops, []
        return list(self.run_ops(ops))

    def _invalidate(self, failed: Seq[bytes], out: SchedulerOutput) -> None:
        """Drop blocks whose promotion failed (and their subtrees) from the cache."""
        tree = self.bm.tree
        for h in failed:
            node = tree.get(h)
            if node is not None:
                out.kv_ops.extend(tree.invalidate(node))
        self.counters.load_failures += len(failed)
        more = self._flush(out)
        assert not more, "dropping blocks cannot load any"

    def _pending(self, seq: Sequence) -> bool:
        return self.bm.num_tokens(seq.seq_id) < len(seq.token_ids)

    def _reserve_appends(self, out: SchedulerOutput) -> None:
        """Preempt newest-first until every running sequence's pending token has a slot."""
        bm = self.bm
        while self.running:
            need = sum(bm.blocks_needed_to_append(s.seq_id)
                       for r in self.running for s in r.seqs if self._pending(s))
            if need <= bm.num_available_blocks:
                return
            victim = self.running.pop()
            for seq in victim.seqs:
                bm.free(seq.seq_id)
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.counters.preemptions += 1
            self.waiting.appendleft(victim)
            out.preempted.append(victim)

    def _schedule_tokens(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Add ``req``'s chunks within ``budget`` tokens; return the tokens used."""
        rems = []
        for seq in req.seqs:
            computed = self.bm.num_computed_tokens(seq.seq_id)
            rem = len(seq.token_ids) - computed
            assert rem >= 1, f"live {seq} of {req} has nothing to compute ({computed} computed)"
            rems.append((seq, computed, rem))
        total = sum(r for _, _, r in rems)
        whole = total <= budget
        used = 0
        for seq, computed, rem in rems:
            n = rem if whole else min(rem - 1, budget - used)
            if n <= 0:
                continue
            out.chunks.append(ScheduledChunk(req, seq, computed, n, wants_logits=whole))
            used += n
            self.counters.computed_tokens += n
            if n > 1 or computed < seq.prompt_len:
                self.counters.prefill_tokens += n
            if req.num_preemptions and computed < len(seq.token_ids) - 1:
                self.counters.recomputed_tokens += min(n, len(seq.token_ids) - 1 - computed)
        return used

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        num_seqs = sum(r.num_seq_slots for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if num_seqs + req.num_seq_slots > self.max_num_seqs and self.running:
                return
            if not self._allocate(req, out):
                if not self.running:
                    # Nothing else holds blocks: this request can never fit the pool.
                    self.waiting.popleft()
                    req.status = RequestStatus.FINISHED
                    out.unschedulable.append(req)
                    continue
                return
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_seqs += req.num_seq_slots
            budget -= self._schedule_tokens(req, budget, out)

    def _allocate(self, req: Request, out: SchedulerOutput) -> bool:
        """Allocate every live sequence of ``req`` or none (moves of evictions are kept).

        With an executor, each allocation's moves run at once; if a promotion failed, every
        sequence of the request is freed, the bad blocks are invalidated and the request is
        allocated again (see the module docstring)."""
        self._flush(out)
        first_per_tier: tuple[int, ...] | None = None
        for _attempt in range(_MAX_LOAD_RETRIES):
            done = []
            failed: list[bytes] = []
            try:
                for seq in req.seqs:
                    a = self.bm.allocate(seq.seq_id, seq.token_ids, req.namespace)
                    out.kv_ops.extend(a.moves)
                    done.append(a)
                    failed = self._flush(out)
                    if failed:
                        break
            except OutOfBlocks:
                for a in done:
                    self.bm.free(a.seq_id)
                return False
            if first_per_tier is None:
                first_per_tier = done[0].cached_tokens_per_tier
            if not failed:
                break
            for a in done:
                self.bm.free(a.seq_id)
            self._invalidate(failed, out)
            self.counters.load_retries += 1
        else:
            raise AssertionError(f"{_MAX_LOAD_RETRIES} failed promotions in a row for {req}")
        if not req.admitted:
            req.admitted = True
            a = done[0]
            per_tier = _prefix_per_tier(first_per_tier, a.num_cached_tokens)
            req.num_cached_tokens = a.num_cached_tokens
            req.cached_tokens_per_tier = per_tier
            c = self.counters
            c.prompt_tokens += len(req.prompt_token_ids)
            c.cached_prompt_tokens += a.num_cached_tokens
            for t, n in enumerate(per_tier):
                c.cached_tokens_per_tier[t] += n
        return True


def _prefix_per_tier(per_tier: tuple[int, ...], num_cached: int) -> tuple[int, ...]:
    """Per-tier split of the first ``num_cached`` tokens of a chain whose first attempt found
    ``per_tier`` (tiers are non-decreasing along a chain). After a failed promotion the retry
    keeps a prefix of the first match, whose blocks it finds already promoted to the device:
    they are still counted in the tier they were loaded from."""
    out, left = [], num_cached
    for n in per_tier:
        out.append(min(n, left))
        left -= out[-1]
    return tuple(out)


__all__ = ["Scheduler", "SchedulerOutput", "ScheduledChunk", "SchedulerCounters"]
