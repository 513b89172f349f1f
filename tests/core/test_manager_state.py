"""Model-based test of BlockManager (with 1, 2 and 3 tiers, write-back and write-through) and of
the KV *content* it implies.

Beside the real manager runs a naive model: the live sequences' token lists, and a content map
``(tier, slot) -> [payload per token position]`` standing in for the KV bytes of each device
block, host slot and disk slot. The payload of position ``p`` of a sequence is
``(namespace seed, tokens[:p+1])`` (KV depends on the namespace and on every earlier token).
The test does what the engine and storage layer would do with every result: it executes each
``MoveOp`` (demotion, promotion, drop) in order, then each ``CopyOp``, then writes the new
tokens' payloads into the slots it was given, asserting that it never writes into a block
whose refcount is > 1. After every step it checks that every position of every live sequence
reads back exactly its own payload through the block table, and that every cached block in
every tier holds exactly the payload of its prefix: a wrong-block serve, a write into a shared
block, a reference lost or a move executed in the wrong order all show up as wrong content.
With write-through tiers every residency of a cached block counts: its primary and each copy
(``RadixTree.copy_block_id``) must hold exactly its payload. The write-through moves of a commit are
run right after it (``take_moves``), or, in half of the programs, left queued until a
``take_moves`` rule or the next returned move list, which must start with them (until then their
destinations are not checked). A copy whose write "failed" is dropped with ``drop_copy``.

Half of the allocations take kept partial tails (``allocate(..., tail=True)``, core/tails.py):
a served tail's rows go through the same check as cached blocks (every position the
allocation counts as cached must already hold this request's payload), and every kept tail
must hold the payload its key (namespace, parent chain) and tokens say.

Operations that must raise (unknown or freed sequence, existing id, bad tokens, bad commit
range, OutOfBlocks) are run with a snapshot of the whole state before and after.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from core_helpers import STEPS, FakeClock, assert_unchanged, snapshot_manager
from hypothesis.stateful import (
    RuleBasedStateMachine, initialize, invariant, precondition, rule,
)

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks
from radixkv.core.tree import DEVICE, MoveOp
from radixkv.errors import (
    InvalidTokensError, OutOfBlocks, RadixKVError, SequenceExistsError, UnknownSequenceError,
)

B = 2
NAMESPACES = [Namespace("m"), Namespace("m", cache_salt="t2"), Namespace("m2")]
PREFIXES = [[], [0, 1, 0, 1], [1, 1, 2, 2, 0, 0], [2, 2, 2]]
ALPHABET = st.integers(0, 2)
# Few distinct prompts, so that identical and overlapping requests (hits, duplicates computed
# concurrently, dedupe on commit) are common.
PROMPTS = st.builds(lambda p, tail: p + tail, st.sampled_from(PREFIXES),
                    st.lists(st.integers(0, 1), max_size=3)).filter(bool)
BAD_TOKENS = st.sampled_from([[], [-1], [1, -3], [2**31], [1.5], ["a"], "abc", b"\x01", [None],
                              [1, 2**40]])


@dataclass
class MSeq:
    tokens: list[int]
    ns: Namespace
    computed: int      # what we told the manager with commit()
    cached: int = 0    # leading blocks committed into the tree (the manager's s.nodes)


class ManagerMachine(RuleBasedStateMachine):
    num_tiers = 1
    write_through: tuple[int, ...] = ()

    @initialize(dev=st.integers(3, 10), low=st.tuples(st.integers(1, 4), st.integers(1, 4)),
                policy=st.sampled_from(["lru", "lfu", "priority", "ttl"]), take=st.booleans(),
                big=st.booleans(), tails=st.integers(0, 3))
    def setup(self, dev, low, policy, take, big, tails) -> None:
        wt = f", wt={list(self.write_through)}" if self.write_through else ""
        self.name = f"manager[{self.num_tiers} tiers{wt}]"
        STEPS.program(self.name)
        self.clock = FakeClock()
        # slower tiers larger than the device too (the usual shape; copies then survive until
        # their block is demoted, so demotions onto copies are common)
        self.caps = [dev, *(x * (3 if big else 1) for x in low[:self.num_tiers - 1])]
        self.bm = BlockManager.create(dev, block_size=B, policy=policy,
                                      lower_tier_blocks=self.caps[1:], clock=self.clock,
                                      write_through=self.write_through, tail_blocks=tails)
        self.take = take      # run write-through moves right after each commit
        self.tree, self.pool = self.bm.tree, self.bm.pool
        self.seqs: dict[int, MSeq] = {}
        self.freed: list[int] = []
        self.next_id = 0
        self.content: dict[tuple[int, int], list] = {}
        self.hash_content: dict[bytes, list] = {}
        self.prompts: list[tuple[list[int], Namespace]] = []
        self.histories: list[tuple[list[int], Namespace]] = []

    # ------------------------------------------------------------------ model helpers
    @staticmethod
    def payload(ns: Namespace, tokens: list[int], p: int) -> tuple:
        return (ns.seed, tuple(tokens[:p + 1]))

    def block_payload(self, ns: Namespace, tokens: list[int], i: int) -> list:
        return [self.payload(ns, tokens, p) for p in range(i * B, (i + 1) * B)]

    def naive_match(self, tokens: list[int], ns: Namespace, max_blocks: int | None = None) -> list:
        """The model's own matcher (not ``RadixTree.match``): block i of the request is served
        iff the tree caches a block under the request's i-th chain hash (computed here, from the
        tokens) whose parent is block i-1's node and whose tokens are block i's."""
        hashes = hash_token_blocks(tokens, B, ns)[:max_blocks]
        out, prev = [], None
        for i, h in enumerate(hashes):
            ref = self.tree.get(h)
            if ref is None or ref.parent_hash != prev or \
                    ref.tokens != b"".join(x.to_bytes(4, "little")
                                           for x in tokens[i * B:(i + 1) * B]):
                break
            out.append(ref)
            prev = h
        return out

    def held(self) -> set[int]:
        return {b for sid in self.seqs for b in self.bm.block_table(sid)}

    def run_moves(self, moves, held_before: set[int]) -> None:
        for op in moves:
            assert isinstance(op, MoveOp)
            src = (op.src_tier, op.src_block_id)
            if op.src_tier == DEVICE and not op.keep_src:
                assert op.src_block_id not in held_before, (
                    f"{op}: evicted device block {op.src_block_id} is referenced by a live "
                    "sequence")
            assert self.content.get(src) == self.hash_content.get(op.block_hash), (
                f"{op}: source holds {self.content.get(src)}, "
                f"expected {self.hash_content.get(op.block_hash)}")
            if op.dst_tier is not None:
                self.content[(op.dst_tier, op.dst_block_id)] = list(self.content[src])

    def write(self, sid: int, p: int, block: int) -> None:
        s = self.seqs[sid]
        refs = self.bm.block_refcount(block)
        assert refs == 1, f"seq {sid} writes position {p} into block {block} with refcount {refs}"
        payload = self.payload(s.ns, s.tokens, p)
        self.content.setdefault((DEVICE, block), [None] * B)[p % B] = payload

    def raises(self, exc, fn, *args):
        before = snapshot_manager(self.bm)
        with pytest.raises(exc) as info:
            fn(*args)
        assert_unchanged(before, snapshot_manager(self.bm), f"{fn.__name__}{args!r}")
        assert isinstance(info.value, RadixKVError) and str(info.value)
        return info.value

    def evictable_device_blocks(self, exclude=()) -> int:
        """Cached device blocks no live table holds (counted from the outside)."""
        held = self.held()
        return sum(1 for b in range(self.pool.num_blocks)
                   if self.tree.device_block(b) is not None and b not in held and b not in exclude)

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # ------------------------------------------------------------------ rules
    @rule(tokens=PROMPTS, ns=st.sampled_from(NAMESPACES), commit=st.booleans(), data=st.data())
    def allocate(self, tokens, ns, commit, data) -> None:
        STEPS.step(self.name)
        if self.prompts and data.draw(st.booleans(), label="repeat a live prompt"):
            # the same request again while the first is live: duplicates computed concurrently
            tokens, ns = data.draw(st.sampled_from(self.prompts))
        self._allocate(tokens, ns, data.draw(st.booleans(), label="take a kept tail"), commit)

    @precondition(lambda self: self.histories)
    @rule(data=st.data(), more=st.lists(ALPHABET, min_size=1, max_size=4),
          commit=st.booleans())
    def next_turn(self, data, more, commit) -> None:
        """A chat's next turn: a freed sequence's tokens (its partial last block maybe kept
        as a tail) and then more, allocated with ``tail=True``."""
        STEPS.step(self.name)
        latest = data.draw(st.booleans(), label="the latest history")
        tokens, ns = self.histories[-1] if latest else data.draw(st.sampled_from(self.histories))
        self._allocate(list(tokens) + more, ns, True, commit)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data) -> None:
        """A sequence ends as the engine ends one: every token it holds computed and
        committed, then freed (its partial last block may stay as a tail)."""
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self._commit(sid, len(self.seqs[sid].tokens))
        self._free(sid)

    def _allocate(self, tokens: list[int], ns: Namespace, tail: bool, commit: bool) -> None:
        self.prompts.append((list(tokens), ns))
        sid = self.new_id()
        n = len(tokens)
        matched = self.naive_match(tokens, ns, (n - 1) // B)
        on_dev = [x for x in matched if x.tier == DEVICE]
        need = -(-n // B) - len(on_dev)
        # kept tails are reclaimable; a tail the allocation takes counts on both sides
        avail = self.pool.num_free + self.evictable_device_blocks({x.block_id for x in on_dev}) \
            + len(self.bm.tails)
        assert self.bm.can_allocate(tokens, ns, tail) == (need <= avail)
        if need > avail:
            err = self.raises(OutOfBlocks, self.bm.allocate, sid, tokens, ns, None, False,
                              False, tail)
            assert err.needed in (need, need - 1)
            return
        held_before = self.held()
        a = self.bm.allocate(sid, tokens, ns, tail=tail)
        assert a.seq_id == sid and len(a.block_ids) == -(-n // B)
        rows = a.num_cached_tokens % B      # served by a kept tail
        assert not rows or (tail and len(on_dev) == len(matched) and a.num_cached_tokens < n)
        assert a.num_cached_tokens - rows <= len(matched) * B
        assert sum(a.cached_tokens_per_tier) == a.num_cached_tokens
        assert a.cached_tokens_per_tier[DEVICE] == len(on_dev) * B + rows
        if rows:
            STEPS.event(self.name, "tail_hits")
        assert list(a.block_ids) == self.bm.block_table(sid)
        self.seqs[sid] = MSeq(list(tokens), ns, a.num_cached_tokens, a.num_cached_tokens // B)
        self.run_moves(a.moves, held_before)
        # the served prefix must already hold exactly this request's KV
        for p in range(a.num_cached_tokens):
            got = self.content.get((DEVICE, a.block_ids[p // B]), [None] * B)[p % B]
            assert got == self.payload(ns, tokens, p), f"cached position {p} serves {got}"
        for p in range(a.num_cached_tokens, n):       # the prefill of the rest
            self.write(sid, p, a.block_ids[p // B])
        if commit:
            self._commit(sid, n)

    def _commit(self, sid: int, k: int) -> None:
        s = self.seqs[sid]
        hashes = hash_token_blocks(s.tokens, B, s.ns)[:k // B]
        # Expected: every full computed block joins the tree. A block the tree already caches
        # elsewhere on the device is shared instead, by this sequence and by every fork sibling
        # that holds the same duplicate (core bug 1's regression; reuse is no longer lost).
        stop = len(hashes)
        self.bm.commit(sid, k)
        s.computed = k
        s.cached = max(s.cached, stop)
        for i, h in enumerate(hashes[:s.cached]):
            self.hash_content[h] = self.block_payload(s.ns, s.tokens, i)
            node = self.tree.get(h)
            # matching after insert: every committed block is cached, on the device, in the table
            assert node is not None and node.tier == DEVICE, f"committed block {i} of {sid} missing"
            assert self.bm.block_table(sid)[i] == node.block_id
        assert self.bm._seqs[sid].num_cached == s.cached
        if self.take:
            self.take_moves()

    def queued(self) -> set[tuple[int, int]]:
        """Residencies that queued (untaken) write-through moves have not written yet."""
        return {(op.dst_tier, op.dst_block_id) for op in self.tree.pending_moves
                if op.dst_tier is not None}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit(self, data) -> None:
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        self._commit(sid, data.draw(st.integers(s.computed, len(s.tokens))))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=ALPHABET, commit=st.booleans())
    def append(self, data, token, commit) -> None:
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self._append(sid, token)
        if commit:
            self._commit(sid, len(self.seqs[sid].tokens))

    def _append(self, sid: int, token: int) -> bool:
        s = self.seqs[sid]
        table = self.bm.block_table(sid)
        pos = len(s.tokens)
        needs_block = pos % B == 0 or self.bm.block_refcount(table[-1]) > 1
        assert self.bm.blocks_needed_to_append(sid) == int(needs_block)
        if needs_block and self.pool.num_free + self.evictable_device_blocks() + \
                len(self.bm.tails) == 0:
            self.raises(OutOfBlocks, self.bm.append_slot, sid, token)
            return False
        held_before = self.held()
        r = self.bm.append_slot(sid, token)
        s.tokens.append(token)
        new_table = self.bm.block_table(sid)
        assert r.slot // B == new_table[-1] and r.slot % B == pos % B, (r, new_table)
        self.run_moves(r.moves, held_before)
        if r.copy is not None:
            assert pos % B and r.copy.src == table[-1] and r.copy.dst == new_table[-1]
            assert self.bm.block_refcount(r.copy.dst) == 1
            self.content[(DEVICE, r.copy.dst)] = list(self.content[(DEVICE, r.copy.src)])
        else:
            assert not (pos % B) or new_table == table
        self.write(sid, pos, r.slot // B)
        return True

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=st.lists(ALPHABET, min_size=1, max_size=5), commit=st.booleans())
    def append_many(self, data, tokens, commit) -> None:
        """``append_slots``: a chunk of tokens at once (same contract as append_slot)."""
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        table = self.bm.block_table(sid)
        pos = len(s.tokens)
        cow = pos % B != 0 and self.bm.block_refcount(table[-1]) > 1
        need = -(-(pos + len(tokens)) // B) - len(table) + cow
        if need > self.pool.num_free + self.evictable_device_blocks() + len(self.bm.tails):
            self.raises(OutOfBlocks, self.bm.append_slots, sid, tokens)
            return
        held_before = self.held()
        slots, copy, moves = self.bm.append_slots(sid, tokens)
        s.tokens.extend(tokens)
        new_table = self.bm.block_table(sid)
        assert len(slots) == len(tokens)
        assert slots == [new_table[p // B] * B + p % B for p in range(pos, pos + len(tokens))]
        self.run_moves(moves, held_before)
        if copy is not None:
            assert cow and copy.src == table[-1] and copy.dst == new_table[len(table) - 1]
            self.content[(DEVICE, copy.dst)] = list(self.content[(DEVICE, copy.src)])
        else:
            assert not cow and new_table[:len(table)] == table
        for p, slot in zip(range(pos, pos + len(tokens)), slots):
            self.write(sid, p, slot // B)
        if commit:
            self._commit(sid, len(s.tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data) -> None:
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self.new_id()
        self.bm.fork(sid, child)
        p = self.seqs[sid]
        self.seqs[child] = MSeq(list(p.tokens), p.ns, p.computed, p.cached)
        assert self.bm.block_table(child) == self.bm.block_table(sid)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self._free(sid)

    def _free(self, sid: int) -> None:
        s = self.seqs.pop(sid)
        self.bm.free(sid)
        self.freed.append(sid)
        self.histories.append((list(s.tokens), s.ns))   # what a next turn may continue
        # its committed blocks stay cached (nothing was evicted by a free)
        got = self.naive_match(s.tokens, s.ns, s.computed // B)
        assert len(got) >= s.cached, f"freed seq {sid}: {len(got)}/{s.cached} blocks cached"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), width=st.integers(2, 3),
          tokens=st.lists(ALPHABET, min_size=3, max_size=3))
    def beam_step(self, data, width, tokens) -> None:
        """One beam-search step: fork the survivor into ``width`` beams, free the old beam,
        each beam appends its own token and commits; then the worst beam is dropped."""
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        beams = []
        for _ in range(width):
            c = self.new_id()
            self.bm.fork(sid, c)
            p = self.seqs[sid]
            self.seqs[c] = MSeq(list(p.tokens), p.ns, p.computed, p.cached)
            beams.append(c)
        self._free(sid)
        for c, t in zip(beams, tokens):
            if self._append(c, t):
                self._commit(c, len(self.seqs[c].tokens))
        self._free(beams[data.draw(st.integers(0, width - 1))])

    @rule(dt=st.sampled_from([0.0, 1.0, 400.0]))
    def tick(self, dt) -> None:
        self.clock.advance(dt)

    @precondition(lambda self: self.tree.num_tiers > 0)
    @rule(tokens=PROMPTS, ns=st.sampled_from(NAMESPACES))
    def probe(self, tokens, ns) -> None:
        """Query only: matching serves exactly this namespace's content, changes nothing."""
        STEPS.step(self.name)
        before = snapshot_manager(self.bm)
        self.bm.can_allocate(tokens, ns)
        tok = b"".join(x.to_bytes(4, "little") for x in tokens)
        got = self.tree.match_tokens(tok, ns.seed)
        got_hashes = self.tree.match_hashes(tok, ns.seed)
        assert_unchanged(before, snapshot_manager(self.bm), "probe")   # reads change nothing
        assert got == self.naive_match(tokens, ns), "match disagrees with the model"
        assert got_hashes == [x.block_hash for x in got]
        queued = self.queued()
        for i, node in enumerate(got):
            if (node.tier, node.block_id) in queued:
                continue
            payload = self.block_payload(ns, tokens, i)
            assert self.content.get((node.tier, node.block_id)) == payload, (
                f"match serves wrong content for block {i} ({node})")

    @rule(data=st.data(), kind=st.sampled_from(["unknown", "freed"]),
          op=st.sampled_from(["append", "fork", "free", "commit", "table"]))
    def unknown_sequence(self, data, kind, op) -> None:
        STEPS.step(self.name)
        sid = 10**6 + self.next_id if kind == "unknown" or not self.freed else \
            data.draw(st.sampled_from(self.freed))
        fn, args = {"append": (self.bm.append_slot, (sid, 1)),
                    "fork": (self.bm.fork, (sid, 10**7)),
                    "free": (self.bm.free, (sid,)),
                    "commit": (self.bm.commit, (sid, 0)),
                    "table": (self.bm.block_table, (sid,))}[op]
        err = self.raises(UnknownSequenceError, fn, *args)
        assert repr(sid) in str(err)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tokens=PROMPTS)
    def existing_id(self, data, tokens) -> None:
        STEPS.step(self.name)
        a = data.draw(st.sampled_from(sorted(self.seqs)))
        b = data.draw(st.sampled_from(sorted(self.seqs)))
        self.raises(SequenceExistsError, self.bm.allocate, a, tokens, NAMESPACES[0])
        self.raises(SequenceExistsError, self.bm.fork, a, b)

    @rule(bad=BAD_TOKENS)
    def bad_tokens(self, bad) -> None:
        STEPS.step(self.name)
        self.raises(InvalidTokensError, self.bm.allocate, 10**6 + self.next_id, bad, NAMESPACES[0])
        if self.seqs:
            sid = min(self.seqs)
            if bad == []:
                return
            tok = bad[-1] if isinstance(bad, list) else bad   # the invalid element
            self.raises(InvalidTokensError, self.bm.append_slot, sid, tok)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), delta=st.sampled_from([-1, 1, 5]))
    def bad_commit(self, data, delta) -> None:
        STEPS.step(self.name)
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        k = s.computed - 1 if delta < 0 else len(s.tokens) + delta
        if k < s.computed or k > len(s.tokens):
            self.raises(InvalidTokensError, self.bm.commit, sid, k)
        self.raises(InvalidTokensError, self.bm.commit, sid, 1.0)

    @rule(tier=st.integers(0, 2), k=st.integers(1, 3))
    def evict(self, tier, k) -> None:
        """Memory pressure from outside the manager (e.g. the engine freeing room ahead):
        demotions, free demotions onto copies, copy drops."""
        STEPS.step(self.name)
        tier %= self.tree.num_tiers
        k = min(k, self.tree.num_evictable(tier))
        self.run_moves(self.tree.evict(tier, k), self.held())

    @rule()
    def reset_cache(self) -> None:
        """vLLM's reset_prefix_cache: every cached block no live table holds leaves every tier
        (drops only, never of a held block), the kept tails go, and what live sequences hold
        stays cached and readable (the invariant re-reads every position)."""
        STEPS.step(self.name)
        self.run_moves(self.bm.take_moves(), self.held())
        held = self.held()
        kept = {h for h in self.tree.block_index()
                if (ref := self.tree.get(h)).tier == DEVICE and ref.block_id in held}
        moves = self.bm.reset_cache()
        assert all(op.dst_tier is None for op in moves), moves
        self.run_moves(moves, held)
        assert set(self.tree.block_index()) == kept
        assert len(self.bm.tails) == 0
        assert self.evictable_device_blocks() == 0
        STEPS.event(self.name, "reset_cache", len(moves))

    @precondition(lambda self: self.write_through)
    @rule()
    def take_moves(self) -> None:
        """The engine runs the write-through moves of a step's commits."""
        STEPS.step(self.name)
        moves = self.bm.take_moves()
        assert all(op.keep_src and op.src_tier == DEVICE for op in moves
                   if op.dst_tier is not None and op.dst_tier > op.src_tier + 1), moves
        self.run_moves(moves, self.held())
        assert self.bm.take_moves() == []

    @precondition(lambda self: self.write_through)
    @rule(data=st.data())
    def drop_copy(self, data) -> None:
        """A write-through write failed: the storage layer drops that copy (after the moves)."""
        STEPS.step(self.name)
        self.run_moves(self.bm.take_moves(), self.held())
        copies = sorted((h, u, slot) for h in self.tree.block_index()
                        for u in self.write_through
                        if (slot := self.tree.copy_block_id(h, u)) is not None)
        if not copies:
            return
        h, u, slot = data.draw(st.sampled_from(copies))
        assert self.bm.drop_copy(h, u) == MoveOp(h, u, slot, None, None)
        assert self.tree.copy_block_id(h, u) is None and self.bm.drop_copy(h, u) is None
        STEPS.event(self.name, "drop_copy")

    def teardown(self) -> None:
        if hasattr(self, "tree") and self.write_through:
            for k in ("copies_made", "copies_dropped", "free_demotions", "copies_skipped"):
                STEPS.event(self.name, k, getattr(self.tree.stats, k))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        bm, pool, tree = self.bm, self.pool, self.tree
        bm.check_invariants()
        assert len(bm) == len(self.seqs) and all(sid in bm for sid in self.seqs)
        held: dict[int, int] = {}
        for sid, s in self.seqs.items():
            assert bm.token_ids(sid) == s.tokens and bm.num_computed_tokens(sid) == s.computed
            table = bm.block_table(sid)
            assert len(table) == -(-len(s.tokens) // B)
            for b in table:
                held[b] = held.get(b, 0) + 1
            # every position reads back its own KV through the table
            for p in range(len(s.tokens)):
                got = self.content.get((DEVICE, table[p // B]), [None] * B)[p % B]
                assert got == self.payload(s.ns, s.tokens, p), (
                    f"seq {sid} position {p} (block {table[p // B]}) reads {got}")
        tails = set()
        for (seed, parent), t in bm.tails:   # a kept tail holds exactly what its key says
            tails.add(t.block)
            prefix: tuple = ()
            if parent is not None:
                assert parent in self.hash_content, f"tail under an unknown chain {parent!r}"
                prefix = self.hash_content[parent][-1][1]
            toks = tuple(int.from_bytes(t.tokens[i:i + 4], "little")
                         for i in range(0, len(t.tokens), 4))
            got = self.content.get((DEVICE, t.block), [None] * B)
            for i in range(len(toks)):
                assert got[i] == (seed, prefix + toks[:i + 1]), (
                    f"kept tail {t.block} row {i} holds {got[i]}")
        for b in range(pool.num_blocks):
            refs = bm.block_refcount(b)
            assert refs == held.get(b, 0) + (b in tails), (
                f"block {b}: refcount {refs}, held by {held.get(b, 0)}, tail {b in tails}")
            cached = tree.device_block(b) is not None
            free = pool.is_free(b)
            assert free == (not cached and refs == 0), (
                f"block {b}: free={free} cached={cached} refs={refs}")
        per_tier = [0] * tree.num_tiers
        queued = self.queued()
        for h in tree.block_index():
            node = tree.get(h)
            per_tier[node.tier] += 1
            residencies = [(node.tier, node.block_id)]
            for u in range(1, tree.num_tiers):
                slot = tree.copy_block_id(h, u)
                if slot is not None:
                    assert u in self.write_through and u > node.tier, (node, u)
                    residencies.append((u, slot))
                    per_tier[u] += 1
            for r in residencies:   # the primary and every copy hold exactly this block
                if r not in queued:
                    assert self.content.get(r) == self.hash_content[h], (
                        f"cached {node}: tier {r[0]} slot {r[1]} holds the wrong content")
        for t, c in enumerate(per_tier):
            assert c == tree.num_resident(t) + tree.num_copies(t) <= self.caps[t], (
                f"tier {t}: {c} > {self.caps[t]}")


class ChatTurnsMachine(ManagerMachine):
    """The manager machine with every rule, plus whole chat turns over a few conversations on
    a device pool large enough to keep their chains: a turn takes the previous turn's kept
    tail (``allocate(..., tail=True)``), computes its prompt, generates a few tokens and ends
    (commit, free: its own partial last block becomes the next turn's tail). Every check of
    the base machine holds, the content model included, so a tail that served a wrong row,
    or a block both kept and used, fails here."""

    @initialize(dev=st.integers(8, 16), policy=st.sampled_from(["lru", "lfu"]),
                tails=st.integers(1, 3))
    def setup(self, dev, policy, tails) -> None:   # type: ignore[override]
        self.name = "manager[chat turns]"
        STEPS.program(self.name)
        self.clock = FakeClock()
        self.caps = [dev]
        self.bm = BlockManager.create(dev, block_size=B, policy=policy, clock=self.clock,
                                      tail_blocks=tails)
        self.take = True
        self.tree, self.pool = self.bm.tree, self.bm.pool
        self.seqs = {}
        self.freed = []
        self.next_id = 0
        self.content = {}
        self.hash_content = {}
        self.prompts = []
        self.histories = []
        self.chats: dict[int, tuple[list[int], Namespace]] = {}

    @rule(turns=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(NAMESPACES),
                                   st.lists(ALPHABET, min_size=1, max_size=3),
                                   st.lists(ALPHABET, min_size=1, max_size=3)),
                         min_size=1, max_size=4))
    def chat_turns(self, turns) -> None:
        """A few turns, each of one of three conversations (user tokens, reply tokens)."""
        for conv, ns, user, reply in turns:
            self._chat_turn(conv, ns, user, reply)

    def _chat_turn(self, conv, ns, user, reply) -> None:
        STEPS.step(self.name)
        history, ns = self.chats.get(conv, ([], ns))
        tokens = history + user
        before = len(self.seqs)
        nid = self.next_id + 1
        self._allocate(tokens, ns, True, True)
        if len(self.seqs) == before:    # OutOfBlocks: the turn waits
            return
        for t in reply:
            if not self._append(nid, t):
                break
        s = self.seqs[nid]
        # the engine computes every token but the last sampled one before the sequence ends
        self._commit(nid, max(s.computed, len(s.tokens) - 1))
        self.chats[conv] = (list(s.tokens), ns)
        self._free(nid)


TestManagerChatTurns = ChatTurnsMachine.TestCase
TestManager1Tier = type("Manager1", (ManagerMachine,), {"num_tiers": 1}).TestCase
TestManager2Tiers = type("Manager2", (ManagerMachine,), {"num_tiers": 2}).TestCase
TestManager3Tiers = type("Manager3", (ManagerMachine,), {"num_tiers": 3}).TestCase
TestManager2TiersWT1 = type("Manager2WT1", (ManagerMachine,),
                            {"num_tiers": 2, "write_through": (1,)}).TestCase
TestManager3TiersWT12 = type("Manager3WT12", (ManagerMachine,),
                             {"num_tiers": 3, "write_through": (1, 2)}).TestCase
TestManager3TiersWT2 = type("Manager3WT2", (ManagerMachine,),
                            {"num_tiers": 3, "write_through": (2,)}).TestCase
