"""Model-based test of RadixTree over 1, 2 and 3 tiers, every eviction policy, write-back and
write-through.

The real tree (with real BlockPools) runs beside a naive model: a dict ``hash -> MNode`` that
records each cached block's parent, primary tier and slot, copies (tier -> slot), references,
last access, hits and hints, and a *content* map standing in for the KV bytes: ``(tier, slot) ->
block hash``, except on the disk tier of a 3-tier tree, whose files are named by hash
(``(2, hash) -> hash``), as the storage layer's are. Every MoveOp the tree returns is executed on
the content map in order, the way the storage layer would (``keep_src`` keeps the source), and
checked against the model's prediction: the victim of each eviction is recomputed from the model
as the smallest policy key among the tier's evictable entries (unreferenced primary leaves and,
with write-through, every copy), so "never evict a referenced block" and "always the policy's
choice" are both checked, with the cascade of demotions (device -> host -> disk -> dropped, or a
free demotion onto a copy, which moves nothing) in the expected order. With write-through every
insert's copies (and the evictions that made room) are predicted too. After every step every
residency of every node, primary and copies, must hold exactly its own block. Capacities are
tiny so eviction, demotion, promotion and copy eviction happen all the time; time is a fake
clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from core_helpers import STEPS, FakeClock, assert_unchanged, snapshot_tree
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.core.hashing import Namespace, hash_token_blocks, token_bytes
from radixkv.core.pool import BlockPool
from radixkv.core.tree import DEVICE, MoveOp, RadixTree
from radixkv.errors import InvalidBlockError, OutOfBlocks

B = 2                      # tokens per block: short chains, many blocks
DEFAULT_TTL = 5.0
NAMESPACES = [Namespace("m"), Namespace("m", cache_salt="tenant-b")]
TOKENS = st.lists(st.integers(0, 2), min_size=B, max_size=5 * B)


@dataclass
class MNode:
    parent: bytes | None
    tokens: bytes
    tier: int
    slot: int
    refs: int = 0
    last_access: float = 0.0
    hits: int = 0
    priority: int = 0
    ttl: float | None = None
    copies: dict[int, int] = field(default_factory=dict)   # tier -> slot of a copy


class TreeMachine(RuleBasedStateMachine):
    num_tiers = 1
    policy = "lru"
    write_through: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        wt = f", wt={list(self.write_through)}" if self.write_through else ""
        return f"tree[{self.num_tiers} tiers, {self.policy}{wt}]"

    @initialize(caps=st.tuples(st.integers(2, 6), st.integers(1, 4), st.integers(1, 4)))
    def setup(self, caps) -> None:
        STEPS.program(self.name)
        self.caps = list(caps[:self.num_tiers])
        self.clock = FakeClock()
        self.pools = [BlockPool(c) for c in self.caps]
        policy = self.policy
        if policy == "ttl":
            from radixkv.core.policy import TTLPolicy
            policy = TTLPolicy(DEFAULT_TTL)
        self.tree = RadixTree(B, self.pools[0], self.pools[1:], policy=policy, clock=self.clock,
                              write_through=self.write_through)
        self.m: dict[bytes, MNode] = {}
        self.content: dict[tuple, bytes] = {}
        self.holders: list[list[bytes]] = []   # chains locked by pretend sequences
        self.stale: list = []                   # node objects that were dropped
        self.pending: list[MoveOp] = []         # write-through moves the tree still queues

    # ------------------------------------------------------------------ model helpers
    def _key(self, h: bytes) -> tuple:
        n = self.m[h]
        if self.policy == "lru":
            return (n.last_access, h)
        if self.policy == "lfu":
            return (n.hits, n.last_access, h)
        if self.policy == "priority":
            return (n.priority, n.last_access, h)
        if self.policy == "mru":
            return (-n.last_access, h)
        return (n.last_access + (DEFAULT_TTL if n.ttl is None else n.ttl), h)

    def _evictable(self, tier: int) -> list[bytes]:
        """Primaries that qualify for the tier's evictable set (unreferenced leaves in it)."""
        return [h for h, n in self.m.items() if n.tier == tier
                and (tier != DEVICE or n.refs == 0)
                and not any(c.parent == h and c.tier == tier for c in self.m.values())]

    def _entries(self, tier: int) -> list[bytes]:
        """Everything eviction may take in ``tier``: qualifying primaries and every copy."""
        return self._evictable(tier) + [h for h, n in self.m.items() if tier in n.copies]

    def _resident(self, tier: int) -> int:
        return sum(1 for n in self.m.values() if n.tier == tier)

    def _used(self, tier: int) -> int:
        return self._resident(tier) + sum(1 for n in self.m.values() if tier in n.copies)

    def _loc(self, tier: int, slot: int, h: bytes) -> tuple:
        """Where the bytes live: a slot, or (the disk tier of 3) a file named by the hash."""
        return (tier, h) if tier == 2 else (tier, slot)

    def _run_op(self, op: MoveOp) -> None:
        """Execute one MoveOp on the content model, as the storage layer would."""
        src = self._loc(op.src_tier, op.src_slot, op.block_hash)
        assert self.content.get(src) == op.block_hash, f"{op}: source holds {self.content.get(src)!r}"
        data = self.content[src] if op.keep_src else self.content.pop(src)
        if op.dst_tier is not None:
            dst = self._loc(op.dst_tier, op.dst_slot, op.block_hash)
            assert dst not in self.content, f"{op} overwrites a live slot"
            self.content[dst] = data
        else:
            assert not op.keep_src, op

    def _free_slot_ok(self, tier: int, slot: int) -> None:
        assert 0 <= slot < self.caps[tier]
        assert not any((x.tier == tier and x.slot == slot) or x.copies.get(tier) == slot
                       for x in self.m.values()), f"tier {tier} slot {slot} is taken"

    def _expect_out(self, h: bytes, ops: list[MoveOp]) -> None:
        """Model of moving evictable primary ``h`` out of its tier; consumes the real ops."""
        n = self.m[h]
        t = n.tier
        u = t + 1
        if u < self.num_tiers and u in n.copies:
            # free demotion: the copy becomes the primary, no op; the old slot is just released
            del self.content[self._loc(t, n.slot, h)]
            n.tier, n.slot = u, n.copies.pop(u)
        elif u < self.num_tiers:
            if self._used(u) == self.caps[u]:
                self._expect_evict_one(u, ops)
            assert ops, f"expected the demotion of {h.hex()[:8]} from tier {t}, got no more ops"
            op = ops.pop(0)
            assert op[:4] == (h, t, n.slot, u) and not op.keep_src, \
                f"expected demotion of {h.hex()[:8]} (tier {t} slot {n.slot}), got {op}"
            self._free_slot_ok(u, op.dst_slot)
            self._run_op(op)
            n.tier, n.slot = u, op.dst_slot
        else:
            assert not any(c.parent == h for c in self.m.values()), "dropping a parent"
            assert not n.copies, "a node in the last tier has no copy"
            assert ops, f"expected the drop of {h.hex()[:8]}, got no more ops"
            op = ops.pop(0)
            assert op == MoveOp(h, t, n.slot, None, None), f"expected drop of {h.hex()[:8]}, got {op}"
            self._run_op(op)
            del self.m[h]

    def _expect_entry_out(self, tier: int, h: bytes, ops: list[MoveOp]) -> None:
        n = self.m[h]
        if n.tier == tier:
            assert tier != DEVICE or n.refs == 0
            self._expect_out(h, ops)
            return
        assert ops, f"expected the drop of {h.hex()[:8]}'s copy in tier {tier}, got no more ops"
        op = ops.pop(0)
        assert op == MoveOp(h, tier, n.copies[tier], None, None), \
            f"expected the drop of {h.hex()[:8]}'s copy in tier {tier}, got {op}"
        self._run_op(op)
        del n.copies[tier]

    def _expect_evict_one(self, tier: int, ops: list[MoveOp], exclude=()) -> None:
        cands = [h for h in self._entries(tier) if h not in exclude]
        assert cands, f"model: nothing evictable in tier {tier}"
        self._expect_entry_out(tier, min(cands, key=self._key), ops)

    def _expect_copies(self, h: bytes) -> None:
        """Write-through of a new device node: peek at the queued moves and predict them."""
        ops = list(self.tree._pending[len(self.pending):])
        queued = list(ops)
        n = self.m[h]
        for u in self.write_through:
            if self._used(u) == self.caps[u]:
                if not self._entries(u):
                    continue   # skipped (cannot happen: a full slower tier has a leaf or a copy)
                self._expect_evict_one(u, ops)
            assert ops, f"expected the copy of {h.hex()[:8]} into tier {u}"
            op = ops.pop(0)
            assert op[:4] == (h, DEVICE, n.slot, u) and op.keep_src, op
            self._free_slot_ok(u, op.dst_slot)
            self._run_op(op)
            n.copies[u] = op.dst_slot
        assert not ops, f"unexpected extra moves {ops}"
        self.pending.extend(queued)

    def _flushed(self, ops) -> list[MoveOp]:
        """A returned move list starts with the queued write-through moves (already run)."""
        ops = list(ops)
        assert ops[:len(self.pending)] == self.pending, f"queued moves {self.pending} not first in {ops}"
        del ops[:len(self.pending)]
        self.pending = []
        return ops

    def _take(self) -> None:
        assert self.tree.take_moves() == self.pending
        self.pending = []

    def _evict(self, tier: int, n: int) -> None:
        avail = (sum(1 for x in self.m.values() if x.tier == DEVICE and x.refs == 0)
                 if tier == DEVICE else self._used(tier))
        if n > avail:
            before = snapshot_tree(self.tree)
            with pytest.raises(OutOfBlocks):
                self.tree.evict(tier, n)
            assert_unchanged(before, snapshot_tree(self.tree), f"evict({tier}, {n})")
            return
        dropped = {h: self.tree.get(h) for h in self.m}
        ops = self._flushed(self.tree.evict(tier, n))
        for _ in range(n):
            self._expect_evict_one(tier, ops)
        assert not ops, f"unexpected extra moves {ops}"
        self.stale.extend(node for h, node in dropped.items() if h not in self.m)

    def _device_block(self) -> int | None:
        if self.pools[0].num_free == 0:
            if not any(x.tier == DEVICE and x.refs == 0 for x in self.m.values()):
                return None
            self._evict(DEVICE, 1)
        return self.pools[0].allocate_one()

    def _lock(self, h: bytes) -> None:
        self.tree.lock(self.tree.get(h))
        n = self.m[h]
        n.refs += 1
        n.hits += 1
        n.last_access = self.clock()

    def _release(self, h: bytes) -> None:
        self.tree.release(self.tree.get(h))
        n = self.m[h]
        n.refs -= 1
        if n.refs == 0:
            n.last_access = self.clock()

    # ------------------------------------------------------------------ rules
    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES), keep=st.booleans(), take=st.booleans())
    def insert_chain(self, tokens, ns, keep, take) -> None:
        """What a sequence does: lock the cached prefix (promoting slow-tier hits), insert the
        rest block by block, then keep the chain locked (a live sequence) or release it. With
        write-through, the queued copies are taken before each promotion (as the block manager
        does) and at the end only if ``take`` (else the next returned move list starts with
        them)."""
        STEPS.step(self.name)
        hashes = hash_token_blocks(tokens, B, ns)
        tok = token_bytes(tokens)
        locked: list[bytes] = []
        parent = None
        for i, h in enumerate(hashes):
            chunk = tok[i * B * 4:(i + 1) * B * 4]
            node = self.tree.get(h)
            if node is not None:
                assert node.parent is parent and node.tokens == chunk
                if node.tier != DEVICE:
                    b = self._device_block()
                    node = self.tree.get(h)   # making room may have demoted or dropped it
                    if b is None or node is None:
                        if b is not None:
                            self.pools[0].free([b])
                        break
                    self._take()
                    src, old = self.m[h].tier, self.m[h].slot
                    op = self.tree.promote(node, b)
                    kept = src in self.write_through
                    assert op == MoveOp(h, src, old, DEVICE, b, kept), op
                    self._run_op(op)
                    self.m[h].tier, self.m[h].slot = DEVICE, b
                    if kept:
                        self.m[h].copies[src] = old
                self._lock(h)
            else:
                b = self._device_block()
                if b is None:
                    break
                assert (DEVICE, b) not in self.content, f"fresh block {b} holds live content"
                self.content[(DEVICE, b)] = h          # the prefill writes the KV
                self.pools[0].ref_counts[b] += 1       # the sequence's reference (as the manager)
                node = self.tree.insert(parent, h, chunk, b)
                assert node.slot == b and node.tier == DEVICE
                self.m[h] = MNode(None if parent is None else parent.block_hash, chunk, DEVICE, b,
                                  refs=1, last_access=self.clock())
                self._expect_copies(h)
            locked.append(h)
            parent = node
        else:
            # matching right after inserting returns every full block (nothing was evicted:
            # the whole chain is locked)
            assert [n.block_hash for n in self.tree.match(hashes, tok)] == hashes
        if keep and locked:
            self.holders.append(locked)
        else:
            for h in reversed(locked):
                self._release(h)
        if take:
            self._take()

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release_chain(self, data) -> None:
        STEPS.step(self.name)
        chain = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        for h in reversed(chain):
            self._release(h)

    @rule(tier=st.integers(0, 2), n=st.integers(0, 4))
    def evict(self, tier, n) -> None:
        STEPS.step(self.name)
        self._evict(tier % self.num_tiers, n)

    @rule(dt=st.sampled_from([0.0, 1.0, 2.5, 6.0]))
    def tick(self, dt) -> None:
        self.clock.advance(dt)

    @rule(ahead=st.sampled_from([0.0, 3.0, 100.0]))
    def evict_expired(self, ahead) -> None:
        STEPS.step(self.name)
        now = self.clock() + ahead
        dropped = {h: self.tree.get(h) for h in self.m}
        ops = self._flushed(self.tree.evict_expired(now))
        if self.policy == "ttl":
            for tier in range(self.num_tiers):
                while True:
                    cands = self._entries(tier)
                    if not cands:
                        break
                    v = min(cands, key=self._key)
                    if self._key(v)[0] > now:
                        break
                    self._expect_entry_out(tier, v, ops)
            # nothing unexpired that is unreferenced... and nothing expired left behind
            for t in range(self.num_tiers):
                assert all(self._key(h)[0] > now for h in self._entries(t))
        else:
            # Per-block TTL hints expire under any policy: each hinted primary whose TTL ran
            # out leaves its tier at most once per call, in (due, hash) order, if eviction
            # could take it at that moment (an unreferenced leaf of its tier); passes repeat
            # until one moves nothing (a parent freed by its expired child goes too).
            moved: set[bytes] = set()
            progressed = True
            while progressed:
                progressed = False
                due = sorted((n.last_access + n.ttl, h) for h, n in self.m.items()
                             if n.ttl is not None and n.last_access + n.ttl <= now)
                for _, h in due:
                    n = self.m.get(h)
                    if n is not None and h not in moved and h in self._evictable(n.tier):
                        self._expect_entry_out(n.tier, h, ops)
                        moved.add(h)
                        progressed = True
        assert not ops, f"unexpected moves {ops}"
        self.stale.extend(node for h, node in dropped.items() if h not in self.m)

    @precondition(lambda self: self.m)
    @rule(data=st.data(), priority=st.one_of(st.none(), st.integers(-2, 3)),
          ttl=st.one_of(st.none(), st.sampled_from([1.0, 4.0, 50.0])), with_stale=st.booleans())
    def set_hints(self, data, priority, ttl, with_stale) -> None:
        STEPS.step(self.name)
        hs = data.draw(st.lists(st.sampled_from(sorted(self.m)), max_size=3, unique=True))
        nodes = [self.tree.get(h) for h in hs]
        if with_stale and self.stale:
            # a dropped node anywhere in the list: all-or-nothing leaves every hint as it was
            # (regression of core bug 2)
            at = data.draw(st.integers(0, len(nodes)))
            before = snapshot_tree(self.tree)
            with pytest.raises(InvalidBlockError):
                self.tree.set_hints([*nodes[:at], self.stale[-1], *nodes[at:]],
                                    priority=priority, ttl=ttl)
            assert_unchanged(before, snapshot_tree(self.tree), "set_hints(stale node)")
            return
        self.tree.set_hints(nodes, priority=priority, ttl=ttl)
        for h in hs:
            if priority is not None:
                self.m[h].priority = priority
            if ttl is not None:
                self.m[h].ttl = ttl

    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES))
    def match(self, tokens, ns) -> None:
        STEPS.step(self.name)
        hashes = hash_token_blocks(tokens, B, ns)
        want = []
        for h in hashes:
            if h not in self.m:
                break
            want.append(h)
        before = snapshot_tree(self.tree)
        got = self.tree.match(hashes, token_bytes(tokens))
        assert_unchanged(before, snapshot_tree(self.tree), "match")  # (no exception: pure query)
        assert [n.block_hash for n in got] == want
        tiers = [n.tier for n in got]
        assert tiers == sorted(tiers), f"tiers along a matched chain must not decrease: {tiers}"
        for n in got:
            assert (n.tier, n.slot) == (self.m[n.block_hash].tier, self.m[n.block_hash].slot)
            assert self.content[self._loc(n.tier, n.slot, n.block_hash)] == n.block_hash, \
                "match would serve a wrong block"
        # the other namespace never matches these blocks
        other = NAMESPACES[1 - NAMESPACES.index(ns)]
        assert not set(hash_token_blocks(tokens, B, other)) & set(hashes)

    @precondition(lambda self: self.num_tiers > 1)
    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES), tier=st.integers(1, 2))
    def insert_lower(self, tokens, ns, tier) -> None:
        """A block found in a slow tier (e.g. on disk at start) under its cached prefix."""
        STEPS.step(self.name)
        hashes = hash_token_blocks(tokens, B, ns)
        tok = token_bytes(tokens)
        i = 0
        while i < len(hashes) and hashes[i] in self.m:
            i += 1
        if i == len(hashes):
            return
        parent = self.tree.get(hashes[i - 1]) if i else None
        tier = max(min(tier, self.num_tiers - 1), parent.tier if parent else 1)
        full = self._used(tier) == self.caps[tier]
        node = self.tree.insert_lower(parent, hashes[i], tok[i * B * 4:(i + 1) * B * 4], tier)
        if full:
            assert node is None
            return
        assert node is not None and node.tier == tier
        self._free_slot_ok(tier, node.slot)
        assert self._loc(tier, node.slot, hashes[i]) not in self.content
        self.content[self._loc(tier, node.slot, hashes[i])] = hashes[i]
        self.m[hashes[i]] = MNode(None if parent is None else parent.block_hash,
                                  node.tokens, tier, node.slot, last_access=self.clock())

    @precondition(lambda self: self.num_tiers == 3 and any(n.tier == 2 for n in self.m.values()))
    @rule(data=st.data())
    def promote_lower(self, data) -> None:
        """A prefetch disk -> host: the victims made room for it, its old disk slot is free for
        them, and (write-through disk) it keeps its file as a copy if no victim took the slot."""
        STEPS.step(self.name)
        cands = sorted(h for h, n in self.m.items()
                       if n.tier == 2 and (n.parent is None or self.m[n.parent].tier <= 1))
        if not cands:
            return
        h = data.draw(st.sampled_from(cands))
        n, node = self.m[h], self.tree.get(h)
        p = n.parent
        guard = p if p is not None and self.m[p].tier == 1 and p in self._evictable(1) else None
        full = self._used(1) == self.caps[1]
        if full and len(self._entries(1)) - (guard is not None) <= 0:
            before = snapshot_tree(self.tree)
            assert self.tree.promote_lower(node, 1) == []
            assert_unchanged(before, snapshot_tree(self.tree), "promote_lower (no room)")
            return
        ops = self._flushed(self.tree.promote_lower(node, 1))
        old = n.slot
        n.tier = -1          # in transit: its disk slot is free for a victim demoted there
        if full:
            self._expect_evict_one(1, ops, exclude=(guard,))
        assert len(ops) == 1, f"expected the load of {h.hex()[:8]} last, got {ops}"
        op = ops.pop()
        taken = any((x.tier == 2 and x.slot == old) or x.copies.get(2) == old for x in self.m.values())
        kept = 2 in self.write_through and not taken
        assert op == MoveOp(h, 2, old, 1, op.dst_slot, kept), op
        self._free_slot_ok(1, op.dst_slot)
        self._run_op(op)
        n.tier, n.slot, n.last_access = 1, op.dst_slot, self.clock()
        if kept:
            n.copies[2] = old
        if 2 in self.write_through:
            STEPS.event(self.name, "prefetch_kept_copy" if kept else "prefetch_slot_taken")

    @precondition(lambda self: self.m)
    @rule(data=st.data())
    def invalidate(self, data) -> None:
        """A block whose bytes proved bad: it goes with its subtree and every copy, children
        before parents, each node's copies right before its primary."""
        STEPS.step(self.name)
        h = data.draw(st.sampled_from(sorted(self.m)))
        doomed = {h}
        while True:
            more = {x for x, n in self.m.items() if n.parent in doomed} - doomed
            if not more:
                break
            doomed |= more
        node = self.tree.get(h)
        if any(self.m[x].tier == DEVICE and self.m[x].refs > 0 for x in doomed):
            before = snapshot_tree(self.tree)
            with pytest.raises(InvalidBlockError):
                self.tree.invalidate(node)
            assert_unchanged(before, snapshot_tree(self.tree), "invalidate (held)")
            return
        nodes = {x: self.tree.get(x) for x in doomed}
        ops = self._flushed(self.tree.invalidate(node))
        order = []
        for op in ops:
            if not order or order[-1] != op.block_hash:
                order.append(op.block_hash)
        assert sorted(order) == sorted(doomed), "each doomed node's drops must be contiguous"
        for x in doomed:
            n = self.m[x]
            want = [MoveOp(x, u, n.copies[u], None, None) for u in sorted(n.copies)]
            assert [op for op in ops if op.block_hash == x] == [*want, MoveOp(x, n.tier, n.slot, None, None)]
            if n.parent in doomed:
                assert order.index(x) < order.index(n.parent), "a parent dropped before its child"
        for op in ops:
            self._run_op(op)
        for x in doomed:
            del self.m[x]
        self.stale.extend(nodes.values())

    @precondition(lambda self: self.write_through and self.m)
    @rule(data=st.data(), tier=st.integers(1, 2), stale=st.booleans())
    def drop_copy(self, data, tier, stale) -> None:
        """The storage layer failed to write a copy (after running the queued moves)."""
        STEPS.step(self.name)
        self._take()
        tier = min(tier, self.num_tiers - 1)
        if stale and self.stale:
            assert self.tree.drop_copy(self.stale[-1], tier) is None
            return
        h = data.draw(st.sampled_from(sorted(self.m)))
        n = self.m[h]
        op = self.tree.drop_copy(self.tree.get(h), tier)
        if tier in n.copies:
            assert op == MoveOp(h, tier, n.copies.pop(tier), None, None), op
            self._run_op(op)
        else:
            assert op is None

    @precondition(lambda self: self.write_through)
    @rule()
    def take_moves(self) -> None:
        STEPS.step(self.name)
        self._take()

    def teardown(self) -> None:
        if hasattr(self, "tree") and self.write_through:
            for k in ("copies_made", "copies_dropped", "free_demotions", "copies_skipped"):
                STEPS.event(self.name, k, getattr(self.tree.stats, k))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        tree = self.tree
        tree.check_invariants()
        for p in self.pools:
            p.check_invariants()
        assert len(tree) == len(self.m), f"tree caches {len(tree)} blocks, model {len(self.m)}"
        assert tree._pending == self.pending, "queued write-through moves differ from the model"
        slots, locs = set(), set()
        for h, n in self.m.items():
            node = tree.get(h)
            assert node is not None, f"model block {h.hex()[:8]} missing from the tree"
            assert (node.tier, node.slot) == (n.tier, n.slot), (node, n)
            for t, slot in [(n.tier, n.slot), *n.copies.items()]:
                # every residency, primary and copies, holds exactly this block
                assert (t, slot) not in slots, f"tier {t} slot {slot} held twice"
                slots.add((t, slot))
                locs.add(self._loc(t, slot, h))
                assert self.content.get(self._loc(t, slot, h)) == h, (
                    f"{node}: content of tier {t} slot {slot} lost or overwritten")
            for t in range(1, self.num_tiers):
                assert tree.copy_slot(node, t) == n.copies.get(t), (node, t, n.copies)
            assert all(t > n.tier and t in self.write_through for t in n.copies), (node, n.copies)
            if n.parent is not None:
                assert self.m[n.parent].tier <= n.tier, "prefix closure per tier broken"
            if n.tier == DEVICE:
                assert self.pools[0].ref_counts[n.slot] == n.refs, (node, n.refs)
        for t in range(self.num_tiers):
            assert tree.num_resident(t) == self._resident(t)
            assert tree.num_copies(t) == self._used(t) - self._resident(t)
            assert self._used(t) <= self.caps[t], f"tier {t} over capacity"
            want_evictable = (sum(1 for x in self.m.values() if x.tier == DEVICE and x.refs == 0)
                              if t == DEVICE else self._used(t))
            assert tree.num_evictable(t) == want_evictable
        assert set(self.content) == locs, "content model holds slots of no cached block"


def _machine(num_tiers: int, policy: str, write_through: tuple[int, ...] = ()):
    wt = "WT" + "".join(map(str, write_through)) if write_through else ""
    cls = type(f"Tree{num_tiers}{policy.upper()}{wt}", (TreeMachine,),
               {"num_tiers": num_tiers, "policy": policy, "write_through": write_through})
    return cls.TestCase


for _t in (1, 2, 3):
    for _p in ("lru", "lfu", "mru", "priority", "ttl"):
        globals()[f"TestTree{_t}Tier{_p.upper()}"] = _machine(_t, _p)
# write-through: host (2 tiers), host and disk (3 tiers) with every policy; host only and disk
# only (3 tiers) with LRU and LFU (where a fresh copy ranks first in line to go)
for _t, _wt, _ps in ((2, (1,), ("lru", "lfu", "priority", "ttl")),
                     (3, (1, 2), ("lru", "lfu", "priority", "ttl")),
                     (3, (1,), ("lru", "lfu")), (3, (2,), ("lru", "lfu"))):
    for _p in _ps:
        _name = f"TestTree{_t}Tier{_p.upper()}WT{''.join(map(str, _wt))}"
        globals()[_name] = _machine(_t, _p, _wt)
