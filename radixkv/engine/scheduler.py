"""Continuous batching: which sequences compute which tokens in the next forward.

Every step the scheduler, in this order,

1. reserves KV slots for the running sequences' pending tokens (the token sampled last step).
   If the pool (free + evictable blocks) is short, it *preempts* a request (the most recently
   admitted one; under the ``priority`` order the least urgent, see
   :meth:`~radixkv.engine.admission_order.AdmissionOrder.victim`): frees its sequences (their
   committed full blocks stay in the prefix cache) and puts it back at the FRONT of the
   waiting queue. Resuming re-prefills the sequence's tokens, mostly from the cache; greedy
   output is unchanged (recompute-preemption, as in vLLM).
2. gives running requests, oldest first, their tokens to compute within
   ``max_num_batched_tokens``: a decode is one token per live sequence, a prefill the uncached
   suffix of the prompt. A prefill that does not fit is *chunked*: it computes up to all but its
   last token now, and the rest in later steps (only the last token produces logits).
3. admits waiting requests first-come-first-served while blocks, ``max_num_seqs`` and the token
   budget allow. Admission stops at the first request that does not fit (no overtaking, so the
   head of the queue is never starved), and is skipped in a step that had to preempt (else the
   victim would be re-admitted at once and thrash). A waiting request that shares a prefix
   with a running sequence still prefilling it is *held* (skipped, not blocking the queue)
   until that prefix is committed, so a shared new prefix is computed once
   (:mod:`radixkv.engine.shared_prefix`). The order admission tries is the queue's, as an
   :class:`~radixkv.engine.admission_order.AdmissionOrder` leaves it: FCFS (default), longest
   cached prefix first with an age limit (``lpm``, the engine's default), or the requests'
   ``priority`` (see that module).

**Prefill priority** (``prefill_priority_steps``, the engine's default 4): in a step where
requests wait, running requests that only decode are left out of step 2; if admission then
gives a new request a chunk, the step is that prefill alone, else the decodes run in it after
all. At most ``prefill_priority_steps`` steps in a row leave the decodes out, then one carries
them. Why: a decode row riding in a new turn's prefill step makes that step, and so the new
turn's time to first token, longer (a 32-token turn over ~300 cached tokens beside 3 decodes
took 0.86x / 0.90x the time alone at one / two threads on the embedded model, paired in one
process), while the decodes lose one step's wait. Through ``radixkv serve`` with four clients
(docs/serve.md) the later turns' mean TTFT fell 5-13% in five sessions, with the same decode
ms per token and throughput. It is SGLang's default (prefill batches first, unless
``--enable-mixed-chunk``), bounded; 0 gives vLLM's order (every running decode in every step).
Only admissions count: the later chunks of a long prompt run beside the decodes.

**Long prefills** (``long_prefill_token_threshold``, vLLM's flag of that name; 0, the default,
is off): in a step where more than one request runs or waits, a request computes at most that
many of its remaining prompt tokens, so one long prompt cannot take a step's whole budget while
short turns wait behind it; alone it takes the whole budget (there is nobody to starve). With
``long_prefill_adaptive`` the cap is at least the budget's fair share,
``max_num_batched_tokens // (running + waiting)`` (vLLM's
``--long-prefill-token-threshold-adaptive``). A request's decode, or its group's (n samples,
beams: one token a sequence), is never cut: the cap is at least its live sequence count.

A request with several live sequences (n samples or beams resumed after a preemption) is
allocated *staged*: its first sequence alone, the others once the first has computed the
blocks they share (otherwise each would need the whole prompt again, and a request that ran
fine could look too large for the pool). A request that cannot fit an empty pool even so is
finished as *unschedulable* (``SchedulerOutput.unschedulable``; the engine reports finish reason
``"capacity"``), never silently truncated.

Group rule: all live sequences of a request (n samples, beams) get their logits in the same
step, so a request is sampled as a whole; when a group does not fit the budget entirely, each
sequence advances by at most ``remaining - 1`` tokens.

The scheduler decides and does no I/O. Its step is a *plan* (:meth:`Scheduler.plan`, a
generator): KV operations (tier moves from allocation/eviction and copy-on-write copies) are
returned in the order the block manager produced them, for the engine to run before the forward;
with ``immediate`` (the engine's setting) the plan instead *yields* them as it goes -- the
pending ops before each allocation, and each allocation's moves right after it -- and the
engine's driver (:func:`radixkv.engine.schedule_types.drive`) runs them with the mover and sends
back the hashes of failed promotions. That is what makes a failed promotion safe: when loading a
block from a slower tier fails, the request's sequences are freed, the node and its subtree are
invalidated, and the request is allocated again (its match now stops before the bad block, so
it recomputes) -- before any later request of the same step can match and lock that node.
Waiting for or polling promotions in flight is yielded the same way.

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

import time
from collections import deque
from collections.abc import Sequence as Seq

from radixkv.core.block_manager import BlockManager
from radixkv.engine.admission_order import AdmissionOrder, FCFSOrder
from radixkv.engine.schedule_types import (
    POLL, WAIT, IORequest, Loads, Plan, RunOps, ScheduledChunk, SchedulerCounters,
    SchedulerOutput, drive,
)
from radixkv.engine.sequence import Request, RequestStatus, Sequence
from radixkv.engine.shared_prefix import Leaders, blocks_to_wait_for, share_target
from radixkv.errors import OutOfBlocks


_MAX_LOAD_RETRIES = 64


class Scheduler:
    """FCFS continuous batching over a :class:`BlockManager` (see module docstring)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, run_ops: RunOps | None = None,
                 loads: Loads | None = None, immediate: bool | None = None,
                 admission: AdmissionOrder | None = None,
                 prefill_priority_steps: int = 0, long_prefill_token_threshold: int = 0,
                 long_prefill_adaptive: bool = False) -> None:
        self.bm = block_manager
        #: reorders the waiting queue before each step's admissions (FCFS: leaves it)
        self.admission: AdmissionOrder = FCFSOrder() if admission is None else admission
        # Executors for the convenience drivers schedule()/remove() only; the plans never call
        # them. ``immediate``: plans yield each allocation's KV ops to be run at once (default:
        # when an executor is given).
        self.run_ops = run_ops
        self.immediate = run_ops is not None if immediate is None else immediate
        self.loads = loads
        self.loading: set[str] = set()          # ids of running requests waiting for loads
        self._failed: list[bytes] = []          # failed promotions not yet recovered
        self._fresh: set[str] = set()           # admitted, loading, nothing computed yet
        self._first_tiers: dict[str, tuple[int, ...]] = {}   # see _undo_admission
        # request id -> its sequences not allocated yet (they join once seqs[0] computed the
        # blocks they share; see the module docstring)
        self._staged: dict[str, list[Sequence]] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []      # in admission order
        self.counters = SchedulerCounters(cached_tokens_per_tier=[0] * block_manager.tree.num_tiers)
        #: the most consecutive steps whose admissions may run without the running decodes
        #: (module docstring, "Prefill priority"); 0: every step carries every decode
        self.prefill_priority_steps = prefill_priority_steps
        self._deferrals = 0   # consecutive steps that left the decodes out
        #: the most prompt tokens one request computes in a step shared with others (module
        #: docstring, "Long prefills"; 0: no cap) and whether the fair share raises it
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.long_prefill_adaptive = long_prefill_adaptive
        self._cap = 0   # this step's cap (0: none)

    def _decoding(self, req: Request) -> bool:
        """Every live sequence of ``req`` has its prompt computed and only its last sampled
        token to compute (a decode, not a prefill or a re-prefill after preemption)."""
        bm = self.bm
        for seq in req.seqs:
            if seq.seq_id not in bm:
                return False
            n = len(seq.token_ids)
            if n <= seq.prompt_len or bm.num_computed_tokens(seq.seq_id) != n - 1:
                return False
        return bool(req.seqs) and req.request_id not in self._staged

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
        """Take a request out of the queues and free its live sequences (finish or abort);
        :meth:`remove_plan` driven by this scheduler's own executors."""
        drive(self.remove_plan(req), self.run_ops, self.loads)

    def remove_plan(self, req: Request) -> Plan[None]:
        if req in self.running:
            self.running.remove(req)
            yield from self._free_request(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    def _free_request(self, req: Request) -> Plan[None]:
        """Free every live sequence of ``req``; a loading request first waits for its loads
        (their failures are recovered before the next allocation)."""
        self._fresh.discard(req.request_id)
        self._first_tiers.pop(req.request_id, None)
        if req.request_id in self.loading:
            self.loading.discard(req.request_id)
            self._failed.extend((yield WAIT))
        self._free_seqs(req)

    def _free_seqs(self, req: Request) -> None:
        """Free the allocated sequences of ``req`` (staged ones hold nothing yet)."""
        self._staged.pop(req.request_id, None)
        for seq in req.seqs:
            if seq.seq_id in self.bm:
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
        """One step's decisions: :meth:`plan` driven by this scheduler's own executors (the
        engine drives :meth:`plan` with its mover itself)."""
        return drive(self.plan(), self.run_ops, self.loads)

    def plan(self) -> Plan[SchedulerOutput]:
        """The step as a plan: yields the KV work it needs done before deciding further (see
        :mod:`radixkv.engine.schedule_types`) and returns the ``SchedulerOutput``."""
        out = SchedulerOutput()
        self.counters.steps += 1
        if self.loads is not None:
            yield from self._settle_loads(out, wait=False)
        pending = yield from self._reserve_appends(out)
        recovering = bool(self._failed)   # a failed promotion may send requests back (freed)
        yield from self._recover_failed(out)
        bm = self.bm
        for seq in pending:
            if not recovering or seq.seq_id in bm:
                s = bm.append_slot(seq.seq_id, seq.token_ids[-1])
                if s.moves:
                    out.kv_ops.extend(s.moves)
                if s.copy is not None:
                    out.kv_ops.append(s.copy)
        yield from self._flush(out)
        if self._staged:
            yield from self._join_staged(out)
        budget = self.max_num_batched_tokens
        self._cap = self._step_cap()
        deferred: list[Request] = []
        # Prefill priority: while requests wait, decodes sit this step out if an admission
        # gets a chunk (else they run after all, in the same step).
        defer = (bool(self.waiting) and not out.preempted
                 and self._deferrals < self.prefill_priority_steps)
        for req in self.running:
            if req.request_id not in self.loading:
                if defer and self._decoding(req):
                    deferred.append(req)
                    continue
                budget -= self._schedule_tokens(req, budget, out)
        if not out.preempted:
            self.admission.reorder(self.waiting)
            before = len(out.chunks)
            budget = yield from self._admit(budget, out)
            if deferred and len(out.chunks) > before:
                self._deferrals += 1
                deferred = []
        if deferred or not defer:
            self._deferrals = 0
        for req in deferred:
            budget -= self._schedule_tokens(req, budget, out)
        yield from self._flush(out)
        if self.loading and not out.chunks:
            # Nothing else to compute: wait for the loads rather than return an empty step.
            self.counters.load_waits += 1
            ready = [r for r in self.running if r.request_id in self.loading]
            yield from self._settle_loads(out, wait=True)
            for req in ready:
                if req in self.running and req.request_id not in self.loading:
                    budget -= self._schedule_tokens(req, budget, out)
            yield from self._flush(out)
        self.counters.loading_steps += len(self.loading)
        return out

    def _step_cap(self) -> int:
        """The step's cap on one request's tokens (module docstring, "Long prefills"), counted
        as vLLM counts it: at the step's start, over the running and the waiting requests."""
        cap = self.long_prefill_token_threshold
        eligible = len(self.running) + len(self.waiting)
        if cap <= 0 or eligible <= 1:
            return 0
        if self.long_prefill_adaptive:
            cap = max(cap, self.max_num_batched_tokens // eligible)
        return cap

    def _holds(self, req: Request, blocks: frozenset[int] | set[int]) -> bool:
        bm = self.bm
        return any(b in blocks for seq in req.seqs if seq.seq_id in bm
                   for b in bm.block_table(seq.seq_id))

    def _settle_loads(self, out: SchedulerOutput, wait: bool) -> Plan[None]:
        """Settle finished (or, with ``wait``, all) promotions: recover failed ones, then mark
        which running requests still hold a block being written (see the module docstring)."""
        self._failed.extend((yield WAIT if wait else POLL))
        yield from self._recover_failed(out)
        inflight = self.loads.inflight()
        if not inflight:
            self.loading.clear()
            return
        for req in self.running:
            if self._holds(req, inflight):
                self.loading.add(req.request_id)
            else:
                self.loading.discard(req.request_id)

    def _recover_failed(self, out: SchedulerOutput) -> Plan[None]:
        """Blocks whose promotion failed: free every running request that holds one (back to
        the front of the waiting queue, in order; they recompute from the bad block) and
        invalidate the nodes. Runs before any allocation can match those nodes."""
        tree = self.bm.tree
        while self._failed:
            failed = list(dict.fromkeys(self._failed))
            self._failed = []
            bad = {n.block_id for n in (tree.get(h) for h in failed)
                   if n is not None and n.tier == 0}
            holders = [r for r in self.running if self._holds(r, bad)] if bad else []
            for req in holders:
                self.running.remove(req)
                self.loading.discard(req.request_id)
                self._free_seqs(req)
                req.status = RequestStatus.WAITING
                self.counters.load_retries += 1
                if req.request_id in self._fresh:   # never computed: count it at re-admission
                    self._undo_admission(req)
            self.waiting.extendleft(reversed(holders))
            yield from self._invalidate(failed, out)

    def _flush(self, out: SchedulerOutput) -> Plan[list[bytes]]:
        """Have the pending KV ops run now (when the driver executes during planning: it was
        given an executor). Returns the hashes of failed promotions it learnt of, which are also
        kept for :meth:`_recover_failed` (a wait forced by a conflict may settle another
        request's load)."""
        if not self.immediate or not out.kv_ops:
            return []
        ops, out.kv_ops = out.kv_ops, []
        failed = list((yield IORequest("run", tuple(ops))))
        self._failed.extend(failed)
        return failed

    def _invalidate(self, failed: Seq[bytes], out: SchedulerOutput) -> Plan[None]:
        """Drop blocks whose promotion failed (and their subtrees) from the cache."""
        tree = self.bm.tree
        for h in failed:
            if tree.get(h) is not None:   # (a bad block before it may have taken it along)
                out.kv_ops.extend(self.bm.invalidate(h))
        self.counters.load_failures += len(failed)
        yield from self._flush(out)   # drops; a wait they force may report more failed loads

    def _pending(self, seq: Sequence) -> bool:
        """An allocated sequence whose last sampled token has no KV slot yet."""
        return seq.seq_id in self.bm and self.bm.num_tokens(seq.seq_id) < len(seq.token_ids)

    def _reserve_appends(self, out: SchedulerOutput) -> Plan[list[Sequence]]:
        """Preempt (the admission order's victim first) until every running sequence's pending
        token has a slot; returns those sequences (running order). An append takes at most one
        block, so the exact count is only needed when fewer blocks are available than sequences
        pending."""
        bm = self.bm
        while self.running:
            num_tokens = bm.num_tokens   # (= self._pending, inlined: once per sequence)
            pending = [s for r in self.running for s in r.seqs
                       if s.seq_id in bm and num_tokens(s.seq_id) < len(s.token_ids)]
            available = bm.num_available_blocks
            if len(pending) <= available or sum(
                    bm.blocks_needed_to_append(s.seq_id) for s in pending) <= available:
                return pending
            victim = self.running.pop(self.admission.victim(self.running))
            yield from self._free_request(victim)
            victim.status = RequestStatus.WAITING
            victim.num_preemptions += 1
            self.counters.preemptions += 1
            self.waiting.appendleft(victim)
            out.preempted.append(victim)
        return []

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
        """Add ``req``'s chunks within ``budget`` tokens (and this step's cap on one request,
        never below its live sequence count: a group's decode is whole); return the tokens
        used."""
        self._fresh.discard(req.request_id)
        staged = req.request_id in self._staged
        if self._cap:
            budget = min(budget, max(self._cap, len(req.seqs)))
        if len(req.seqs) == 1 and not staged:
            # one live sequence (the decode step's common case, once per sequence per step):
            # the same decision and counters as below, without the group's lists
            seq = req.seqs[0]
            computed = self.bm.num_computed_tokens(seq.seq_id)
            total = len(seq.token_ids)
            rem = total - computed
            assert rem >= 1, f"live {seq} of {req} has nothing to compute ({computed} computed)"
            whole = rem <= budget
            n = rem if whole else min(rem - 1, budget)
            if n <= 0:
                return 0
            out.chunks.append(ScheduledChunk(req, seq, computed, n, whole))
            c = self.counters
            c.computed_tokens += n
            if n > 1 or computed < seq.prompt_len:
                c.prefill_tokens += n
            if req.num_preemptions and computed < total - 1:
                c.recomputed_tokens += min(n, total - 1 - computed)
            return n
        rems = []
        for seq in req.seqs:
            if staged and seq.seq_id not in self.bm:
                continue
            computed = self.bm.num_computed_tokens(seq.seq_id)
            rem = len(seq.token_ids) - computed
            assert rem >= 1, f"live {seq} of {req} has nothing to compute ({computed} computed)"
            rems.append((seq, computed, rem))
        total = sum(r for _, _, r in rems)
        whole = total <= budget and not staged   # staged: logits once the whole group is in
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

    def _admit(self, budget: int, out: SchedulerOutput) -> Plan[int]:
        """Admit waiting requests FCFS (held ones are skipped, see
        :meth:`_held`); returns the token budget left."""
        if not self.waiting:
            return budget
        num_seqs = sum(r.num_seq_slots for r in self.running)
        # The running sequences that may still compute a block a waiting request could share
        # (those that have not computed all but their last token); admissions add theirs.
        leaders = Leaders(self.bm.block_size)
        self._add_leaders(leaders, self.running)
        i = 0   # position in the queue: requests before it are held
        while i < len(self.waiting) and budget > 0:
            req = self.waiting[i]
            if num_seqs + req.num_seq_slots > self.max_num_seqs and self.running:
                return budget
            if self._held(req, leaders):
                self.counters.held_admissions += 1
                i += 1
                continue
            del self.waiting[i]
            left = len(self.waiting) - i
            if not (yield from self._allocate(req, out)):
                if not self.running:
                    # Nothing else holds blocks: this request can never fit the pool.
                    self._unschedulable(req, out)
                    i = len(self.waiting) - left
                    continue
                # back in its place, behind requests a failed load sent back meanwhile
                self.waiting.insert(len(self.waiting) - left, req)
                return budget
            i = len(self.waiting) - left
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_seqs += req.num_seq_slots
            self._add_leaders(leaders, [req])
            inflight = self.loads.inflight() if self.loads is not None else None
            if inflight and self._holds(req, inflight):
                self.loading.add(req.request_id)   # computes once its blocks have landed
                if req.num_preemptions == 0 and not req.done and req.first_token_time is None:
                    self._fresh.add(req.request_id)
                continue
            budget -= self._schedule_tokens(req, budget, out)
        return budget

    def _unschedulable(self, req: Request, out: SchedulerOutput) -> None:
        req.status = RequestStatus.FINISHED
        self.counters.unschedulable += 1
        out.unschedulable.append(req)

    def _add_leaders(self, leaders: Leaders, requests: Seq[Request]) -> None:
        """File the allocated sequences of ``requests`` that have not computed all but their
        last token: the only ones :func:`blocks_to_wait_for` can find a block to wait for in
        (a decoding sequence has computed all it will ever share). O(sequences)."""
        bm = self.bm
        for r in requests:
            for s in r.seqs:
                if s.seq_id in bm and bm.num_computed_tokens(s.seq_id) < len(s.token_ids) - 1:
                    leaders.add(r.namespace, s, r)

    def _held(self, req: Request, leaders: Leaders | None = None) -> bool:
        """Whether ``req`` should wait for a running sequence that is still computing blocks it
        could share (see :mod:`radixkv.engine.shared_prefix`). ``leaders``: the candidates of
        this admission pass (default: every running sequence). O(candidates x shared prefix).
        """
        toks, bs, bm = req.seqs[0].token_ids, self.bm.block_size, self.bm
        if leaders is None:
            leaders = Leaders(bs)
            self._add_leaders(leaders, self.running)
        # (a request a failed promotion sent back meanwhile holds no blocks: not in bm)
        for _r, s in leaders.candidates(req.namespace, toks):
            if s.seq_id in bm and blocks_to_wait_for(
                    toks, s.token_ids, bm.num_computed_tokens(s.seq_id), bs):
                return True
        return False

    def _join_staged(self, out: SchedulerOutput) -> Plan[None]:
        """Allocate the staged sequences of running requests whose leader has computed the
        blocks they share. A request alone in the pool whose followers still do not fit is
        unschedulable; with others running it waits (they finish or are preempted)."""
        bs = self.bm.block_size
        for req in list(self.running):
            followers = self._staged.get(req.request_id)
            if followers is None or req.request_id in self.loading:
                continue
            leader = req.seqs[0]
            computed = self.bm.num_computed_tokens(leader.seq_id)
            if any(share_target(f.token_ids, leader.token_ids, bs) > computed
                   for f in followers):
                continue
            got = yield from self._allocate_seqs(req, followers, out)
            if got is None:
                if self.running == [req]:
                    self.running.remove(req)
                    yield from self._free_request(req)
                    self._unschedulable(req, out)
                continue
            if req not in self.running:
                continue   # a failed promotion sent it back to the queue (all freed)
            del self._staged[req.request_id]
            self.counters.staged_joins += len(followers)
            inflight = self.loads.inflight() if self.loads is not None else None
            if inflight and self._holds(req, inflight):
                self.loading.add(req.request_id)

    def _allocate_seqs(self, req: Request, seqs: Seq[Sequence], out: SchedulerOutput
                       ) -> Plan[tuple[list, tuple[int, ...]] | None]:
        """Allocate ``seqs`` of ``req`` all or none; None when out of blocks (moves of
        evictions are kept). Also returns the per-tier split of the first sequence's match
        at the first attempt.

        With an executor, each allocation's moves run at once; if a promotion failed, the
        sequences are freed, the bad blocks are invalidated and they are allocated again (their
        match now stops before the bad block; see the module docstring)."""
        yield from self._flush(out)
        yield from self._recover_failed(out)
        first_per_tier: tuple[int, ...] | None = None
        for _attempt in range(_MAX_LOAD_RETRIES):
            done = []
            failed: list[bytes] = []
            try:
                for seq in seqs:
                    a = self.bm.allocate(seq.seq_id, seq.token_ids, req.namespace,
                                         tail=True, **req.policy_hints())
                    req.policy_started = True
                    out.kv_ops.extend(a.moves)
                    done.append(a)
                    failed = yield from self._flush(out)
                    if failed:
                        break
            except OutOfBlocks:
                for a in done:
                    self.bm.free(a.seq_id)
                return None
            if first_per_tier is None:
                first_per_tier = done[0].cached_tokens_per_tier
            if not failed:
                return done, first_per_tier
            for a in done:
                self.bm.free(a.seq_id)
            yield from self._recover_failed(out)   # also other requests' loads a wait reported
            self.counters.load_retries += 1
        raise AssertionError(f"{_MAX_LOAD_RETRIES} failed promotions in a row for {req}")

    def _allocate(self, req: Request, out: SchedulerOutput) -> Plan[bool]:
        """Allocate every live sequence of ``req`` or none. The first is allocated alone; the
        others too if they share no block with it that is not cached yet, else they are staged
        (allocated by :meth:`_join_staged` once the first has computed those blocks)."""
        got = yield from self._allocate_seqs(req, req.seqs[:1], out)
        if got is None:
            return False
        [a], first_per_tier = got
        rest = req.seqs[1:]
        staged = self._to_stage(req, a.num_cached_tokens) if rest else []
        if rest and not staged and (yield from self._allocate_seqs(req, rest, out)) is None:
            self.bm.free(a.seq_id)
            return False
        if staged:
            self._staged[req.request_id] = staged
        if not req.admitted:
            req.admitted = True
            if req.scheduled_time is None:   # (a request sent back and re-admitted keeps it)
                req.scheduled_time = time.perf_counter()
            first_per_tier = self._first_tiers.pop(req.request_id, None) or first_per_tier
            per_tier = _prefix_per_tier(first_per_tier, a.num_cached_tokens)
            req.num_cached_tokens = a.num_cached_tokens
            req.cached_tokens_per_tier = per_tier
            c = self.counters
            c.prompt_tokens += len(req.prompt_token_ids)
            c.cached_prompt_tokens += a.num_cached_tokens
            for t, n in enumerate(per_tier):
                c.cached_tokens_per_tier[t] += n
        return True

    def _to_stage(self, req: Request, leader_cached: int) -> list[Sequence]:
        """The sequences after the first one, if any of them shares blocks with it that are
        not cached yet (they then wait for the first to compute them); else []."""
        leader, bs = req.seqs[0], self.bm.block_size
        rest = req.seqs[1:]
        if any(share_target(f.token_ids, leader.token_ids, bs) > leader_cached for f in rest):
            return list(rest)
        return []


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


__all__ = ["Scheduler", "SchedulerOutput", "ScheduledChunk", "SchedulerCounters", "Loads", "RunOps"]
