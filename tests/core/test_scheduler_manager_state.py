"""Model-based test of the scheduler over the block manager (issue 14): admit, step, preempt,
abort, finish, fork, with small pools so that eviction and recompute-preemption are common.

The "forward" is faked as in ``tests/engine/test_scheduler.py``: every scheduled chunk is
committed and a sequence that got logits appends a token. Beside the real objects the test
keeps its own model of which requests are live and which sequences they own, and checks from
the outside, after every step:

* blocks are conserved: every device block is exactly one of free, held by a live sequence
  of a running request, or cached and unreferenced; the pool's refcount of a block equals the
  number of live tables that hold it; the manager knows exactly the running requests'
  sequences;
* no in-use block is evicted: no MoveOp of a step moves or drops a device block that a
  sequence live both before and after the step held before it (preempted requests' blocks
  may go: they were freed first);
* a running sequence never has less KV computed than the tokens the manager holds for it
  minus the pending one, and each chunk starts where the computed KV ends.

The scheduler and the block manager are pure Python, so this stays fast.
"""

from __future__ import annotations

import hypothesis.strategies as st
from core_helpers import STEPS
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.core.tree import DEVICE, MoveOp
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.sampling import SamplingParams
from radixkv.engine.scheduler import Scheduler
from radixkv.engine.sequence import Request, RequestStatus, Sequence

NS = Namespace("sched")
BS = 2
PREFIXES = [[], [5, 5, 6, 6], [1, 2, 3, 4, 5, 6]]
PROMPTS = st.builds(lambda p, t: p + t, st.sampled_from(PREFIXES),
                    st.lists(st.integers(1, 3), max_size=4)).filter(bool)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(blocks=st.integers(4, 12), max_seqs=st.integers(1, 4),
                budget=st.integers(3, 16), policy=st.sampled_from(["lru", "lfu"]),
                priority=st.sampled_from([0, 1, 4]), long_prefill=st.sampled_from([0, 1, 3]),
                adaptive=st.booleans())
    def setup(self, blocks, max_seqs, budget, policy, priority, long_prefill=0,
              adaptive=False) -> None:
        self.name = "scheduler+manager"
        STEPS.program(self.name)
        self.bm = BlockManager.create(blocks, block_size=BS, policy=policy)
        self.s = Scheduler(self.bm, max_seqs, budget, prefill_priority_steps=priority,
                           long_prefill_token_threshold=long_prefill,
                           long_prefill_adaptive=adaptive)
        self.live: dict[str, Request] = {}      # added, not finished or aborted
        self.next = 0

    # ------------------------------------------------------------------ helpers
    def _new_seq(self, tokens: list[int], prompt_len: int) -> Sequence:
        self.next += 1
        return Sequence(self.next, 0, list(tokens), prompt_len, IncrementalDetokenizer(None))

    def _held(self) -> dict[int, set[int]]:
        """Live sequence id -> device blocks its table holds (running requests only; a staged
        follower of a resumed n>1 group holds nothing until it joins its leader)."""
        return {seq.seq_id: set(self.bm.block_table(seq.seq_id))
                for r in self.s.running for seq in r.seqs if seq.seq_id in self.bm}

    # ------------------------------------------------------------------ rules
    @rule(prompt=PROMPTS, max_tokens=st.integers(1, 6))
    def admit(self, prompt, max_tokens) -> None:
        """A new request joins the waiting queue (the scheduler admits it in a step)."""
        STEPS.step(self.name)
        self.next += 1
        rid = f"r{self.next}"
        req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), NS)
        req.seqs.append(self._new_seq(prompt, len(prompt)))
        self.s.add(req)
        self.live[rid] = req

    @precondition(lambda self: self.s.has_unfinished())
    @rule(token=st.integers(1, 3))
    def step(self, token) -> None:
        """schedule -> fake forward (commit, append a token) -> finish what reached max_tokens."""
        STEPS.step(self.name)
        held_before = self._held()
        out = self.s.schedule()
        held_after = self._held()
        if not out.chunks:
            # prefill priority leaves decodes out only for a step that computes a prefill
            assert not any(self.s._decoding(r) for r in self.s.running), "an empty step"
        elif self.s.prefill_priority_steps and any(
                self.s._decoding(r) for r in self.s.running):
            STEPS.event(self.name, "decodes waited" if not any(
                self.s._decoding(c.request) for c in out.chunks) else "mixed")
        survivors = set(held_before) & set(held_after)
        in_use = set().union(*(held_before[sid] for sid in survivors)) if survivors else set()
        for op in out.kv_ops:
            if isinstance(op, MoveOp) and op.src_tier == DEVICE and not op.keep_src:
                assert op.src_block_id not in in_use, f"{op}: block held by a live sequence evicted"
        if self.s._cap:   # a long-prefill cap: no request computes more (a group: its decode)
            per_req: dict[str, int] = {}
            for c in out.chunks:
                per_req[c.request.request_id] = per_req.get(c.request.request_id, 0) + \
                    c.num_tokens
            for c in out.chunks:
                assert per_req[c.request.request_id] <= max(self.s._cap, len(c.request.seqs))
            if any(c.num_tokens == self.s._cap and not c.wants_logits for c in out.chunks):
                STEPS.event(self.name, "long prefill capped")
        if out.preempted:
            STEPS.event(self.name, "preempted", len(out.preempted))
            for r in out.preempted:
                assert r.status is RequestStatus.WAITING and r in self.s.waiting
        for r in out.unschedulable:
            self.live.pop(r.request_id, None)
        for c in out.chunks:
            computed = self.bm.num_computed_tokens(c.seq.seq_id)
            assert c.start == computed, f"chunk of {c.seq} starts at {c.start}, computed {computed}"
            self.bm.commit(c.seq.seq_id, c.start + c.num_tokens)
            if c.wants_logits:
                c.seq.token_ids.append(token)
        for req in list(self.s.running):
            for seq in list(req.seqs):
                if seq.num_output_tokens >= req.params.max_tokens:
                    self.s.free_seq(req, seq)
            if not req.seqs:
                self.s.remove(req)
                self.live.pop(req.request_id, None)
                STEPS.event(self.name, "finished")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        """A client goes away: waiting or running, the request leaves and frees its blocks."""
        STEPS.step(self.name)
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        self.s.remove(req)
        assert req.status is RequestStatus.FINISHED
        assert req not in self.s.running and req not in self.s.waiting
        STEPS.event(self.name, "aborted")

    @precondition(lambda self: any(len(r.seqs) == 1 and
                                   self.bm.num_tokens(r.seqs[0].seq_id) == len(r.seqs[0].token_ids)
                                   for r in self.s.running))
    @rule(data=st.data())
    def fork(self, data) -> None:
        """A running request forks a sample (n > 1, beams): the child shares every block."""
        STEPS.step(self.name)
        cands = [r for r in self.s.running if len(r.seqs) == 1 and
                 self.bm.num_tokens(r.seqs[0].seq_id) == len(r.seqs[0].token_ids)]
        req = data.draw(st.sampled_from(cands))
        parent = req.seqs[0]
        child = self._new_seq(parent.token_ids, parent.prompt_len)
        self.s.fork(req, parent, child)
        assert self.bm.block_table(child.seq_id) == self.bm.block_table(parent.seq_id)
        STEPS.event(self.name, "forked")

    @precondition(lambda self: any(len(r.seqs) > 1 for r in self.s.running))
    @rule(data=st.data())
    def finish_sample(self, data) -> None:
        """One sample of a forked request ends early (a stop token, a losing beam)."""
        STEPS.step(self.name)
        req = data.draw(st.sampled_from([r for r in self.s.running if len(r.seqs) > 1]))
        seq = data.draw(st.sampled_from(req.seqs))
        self.s.free_seq(req, seq)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def blocks_conserved(self) -> None:
        if not hasattr(self, "bm"):
            return
        bm, pool, tree = self.bm, self.bm.pool, self.bm.tree
        bm.check_invariants()
        # A resumed n>1 group runs staged: its leader (seqs[0]) is allocated, the followers
        # join once the leader computed the shared prefix and hold nothing until then.
        live_seqs = {seq.seq_id for r in self.s.running for seq in r.seqs if seq.seq_id in bm}
        for r in self.s.running:
            assert not r.seqs or r.seqs[0].seq_id in bm, f"{r.request_id}: leader not allocated"
        assert len(bm) == len(live_seqs), (
            f"manager holds {len(bm)} sequences, running requests own {len(live_seqs)}")
        holders = [0] * pool.num_blocks
        for sid in live_seqs:
            for b in bm.block_table(sid):
                holders[b] += 1
        tails = {t.block for _, t in bm.tails}   # partial last blocks kept for a next turn
        free = held = cached_idle = 0
        for b in range(pool.num_blocks):
            assert bm.block_refcount(b) == holders[b] + (b in tails), (
                f"block {b}: refcount {bm.block_refcount(b)}, held by {holders[b]} live tables"
                f" (a kept tail: {b in tails})")
            if pool.is_free(b):
                assert holders[b] == 0 and tree.device_block(b) is None, f"free block {b} in use"
                free += 1
            elif holders[b] or b in tails:
                held += 1
            else:
                assert tree.device_block(b) is not None, f"block {b} leaked: not free, cached, held"
                cached_idle += 1
        assert free + held + cached_idle == pool.num_blocks
        assert bm.num_available_blocks == free + cached_idle + len(tails)
        assert tree.num_evictable(DEVICE) == cached_idle, (
            f"{tree.num_evictable(DEVICE)} evictable, {cached_idle} cached blocks nobody holds")
        for r in self.s.running:
            for seq in r.seqs:
                if seq.seq_id not in bm:
                    continue                      # a staged follower
                n = bm.num_tokens(seq.seq_id)
                assert bm.num_computed_tokens(seq.seq_id) <= n <= len(seq.token_ids)
        for rid, req in self.live.items():
            assert (req in self.s.running) != (req in self.s.waiting), f"{rid} lost"


TestSchedulerManager = SchedulerMachine.TestCase
