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

Asynchronous promotions (``loads``, the engine passes one when its mover supports them): a
promotion into the device is left running, and every request that holds a device block still
being written -- the one that allocated it, another that matched the freshly promoted node in
the same step, or a running sequence whose commit switched to that node -- is *loading*: it
keeps its blocks and its place among the running requests but computes nothing until the load
lands (vLLM's "waiting for remote KVs"). Other requests' forwards run meanwhile. Each step
first settles the loads that finished; a failed one frees every holder of the bad block
(they go back to the front of the waiting queue, in order), invalidates the node and its
subtree, and the holders are allocated again (their match stops before the bad block). If a
step would compute nothing but requests are loading, it waits for the loads instead of
spinning. A loading request that is aborted or preempted waits for its loads before its blocks
are freed (a block must not be reused while a copy still writes it).

Pure Python: imports no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

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
    loading_steps: int = 0                    # request-steps spent waiting for a promotion
    load_waits: int = 0                       # steps that blocked on promotions (nothing else)


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

_MAX_LOAD_RETRIES = 64


class Scheduler:
    """FCFS continuous batching over a :class:`BlockManager` (see module docstring)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, run_ops: RunOps | None = None,
                 loads: Loads | None = None) -> None:
        self.bm = block_manager
        self.run_ops = run_ops
        self.loads = loads
        self.loading: set[str] = set()          # ids of running requests waiting for loads
        self._failed: list[bytes] = []          # failed promotions not yet recovered
        self._fresh: set[str] = set()           # admitted, loading, nothing computed yet
        self._first_tiers: dict[str, tuple[int, ...]] = {}   # see _undo_admission
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
            self._free_request(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    def _free_request(self, req: Request) -> None:
        """Free every live sequence of ``req``; a loading request first waits for its loads
        (their failures are recovered before the next allocation)."""
        self._fresh.discard(req.request_id)
        self._first_tiers.pop(req.request_id, None)
        if req.request_id in self.loading:
            self.loading.discard(req.request_id)
            self._failed.extend(self.loads.wait())
        for seq in req.seqs:
            self.bm.free(seq.seq_id)

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
        if self.loads is not None:
            self._settle_loads(out, wait=False)
        self._reserve_appends(out)
        self._recover_failed(out)
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
            if req.request_id not in self.loading:
                budget -= self._schedule_tokens(req, budget, out)
        if not out.preempted:
            budget = self._admit(budget, out)
        self._flush(out)
        if self.loading and not out.chunks:
            # Nothing else to compute: wait for the loads rather than return an empty step.
            self.counters.load_waits += 1
            ready = [r for r in self.running if r.request_id in self.loading]
            self._settle_loads(out, wait=True)
            for req in ready:
                if req in self.running and req.request_id not in self.loading:
                    budget -= self._schedule_tokens(req, budget, out)
            self._flush(out)
        self.counters.loading_steps += len(self.loading)
        return out

    def _holds(self, req: Request, blocks: frozenset[int] | set[int]) -> bool:
        bm = self.bm
        return any(b in blocks for seq in req.seqs for b in bm.block_table(seq.seq_id))

    def _settle_loads(self, out: SchedulerOutput, wait: bool) -> None:
        """Settle finished (or, with ``wait``, all) promotions: recover failed ones, then mark
        which running requests still hold a block being written (see the module docstring)."""
        self._failed.extend(self.loads.wait() if wait else self.loads.poll())
        self._recover_failed(out)
        inflight = self.loads.inflight()
        if not inflight:
            self.loading.clear()
            return
        for req in self.running:
            if self._holds(req, inflight):
                self.loading.add(req.request_id)
            else:
                self.loading.discard(req.request_id)

    def _recover_failed(self, out: SchedulerOutput) -> None:
        """Blocks whose promotion failed: free every running request that holds one (back to
        the front of the waiting queue, in order; they recompute from the bad block) and
        invalidate the nodes. Runs before any allocation can match those nodes."""
        tree = self.bm.tree
        while self._failed:
            failed = list(dict.fromkeys(self._failed))
            self._failed = []
            bad = {n.slot for n in (tree.get(h) for h in failed) if n is not None and n.tier == 0}
            holders = [r for r in self.running if self._holds(r, bad)] if bad else []
            for req in holders:
                self.running.remove(req)
                self.loading.discard(req.request_id)
                for seq in req.seqs:
                    self.bm.free(seq.seq_id)
                req.status = RequestStatus.WAITING
                self.counters.load_retries += 1
                if req.request_id in self._fresh:   # never computed: count it at re-admission
                    self._undo_admission(req)
            self.waiting.extendleft(reversed(holders))
            self._invalidate(failed, out)

    def _flush(self, out: SchedulerOutput) -> list[bytes]:
        """Run the pending KV ops now (with an executor). Returns the hashes of failed
        promotions it learnt of, which are also kept for :meth:`_recover_failed` (a wait forced
        by a conflict may settle another request's load)."""
        if self.run_ops is None or not out.kv_ops:
            return []
        ops, out.kv_ops = out.kv_ops, []
        failed = list(self.run_ops(ops))
        self._failed.extend(failed)
        return failed

    def _invalidate(self, failed: Seq[bytes], out: SchedulerOutput) -> None:
        """Drop blocks whose promotion failed (and their subtrees) from the cache."""
        tree = self.bm.tree
        for h in failed:
            node = tree.get(h)
            if node is not None:
                out.kv_ops.extend(tree.invalidate(node))
        self.counters.load_failures += len(failed)
        self._flush(out)   # drops; a wait they force may report more failed loads

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
            self._free_request(victim)
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.counters.preemptions += 1
            self.waiting.appendleft(victim)
            out.preempted.append(victim)

    def _undo_admission(self, req: Request) -> None:
        """Take back the prompt/cache counters of a request sent back before it computed (its
        first match counted a block whose load then failed); counted again at re-admission."""
        self._fresh.discard(req.request_id)
        c = self.counters
        c.prompt_tokens -= len(req.prompt_token_ids)
        c.cached_prompt_tokens -= req.num_cached_tokens
        for t, n in enumerate(req.cached_tokens_per_tier):
            c.cached_tokens_per_tier[t] -= n
        req.admitted = False
        # the blocks that did land are device hits now; they still count in their first tier
        self._first_tiers[req.request_id] = req.cached_tokens_per_tier
        req.num_cached_tokens = 0
        req.cached_tokens_per_tier = ()

    def _schedule_tokens(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Add ``req``'s chunks within ``budget`` tokens; return the tokens used."""
        self._fresh.discard(req.request_id)
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

    def _admit(self, budget: int, out: SchedulerOutput) -> int:
        """Admit waiting requests FCFS; returns the token budget left."""
        num_seqs = sum(r.num_seq_slots for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if num_seqs + req.num_seq_slots > self.max_num_seqs and self.running:
                return budget
            self.waiting.popleft()
            left = len(self.waiting)
            if not self._allocate(req, out):
                if not self.running:
                    # Nothing else holds blocks: this request can never fit the pool.
                    req.status = RequestStatus.FINISHED
                    out.unschedulable.append(req)
                    continue
                # back to the head, behind requests a failed load sent back meanwhile
                self.waiting.insert(len(self.waiting) - left, req)
                return budget
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_seqs += req.num_seq_slots
            inflight = self.loads.inflight() if self.loads is not None else None
            if inflight and self._holds(req, inflight):
                self.loading.add(req.request_id)   # computes once its blocks have landed
                if req.num_preemptions == 0 and not req.done and req.first_token_time is None:
                    self._fresh.add(req.request_id)
                continue
            budget -= self._schedule_tokens(req, budget, out)
        return budget

    def _allocate(self, req: Request, out: SchedulerOutput) -> bool:
        """Allocate every live sequence of ``req`` or none (moves of evictions are kept).

        With an executor, each allocation's moves run at once; if a promotion failed, every
        sequence of the request is freed, the bad blocks are invalidated and the request is
        allocated again (see the module docstring)."""
        self._flush(out)
        self._recover_failed(out)
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
                first_per_tier = self._first_tiers.pop(req.request_id, None) \
                    or done[0].cached_tokens_per_tier
            if not failed:
                break
            for a in done:
                self.bm.free(a.seq_id)
            self._recover_failed(out)   # also other requests' loads a forced wait reported
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
