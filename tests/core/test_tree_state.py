"""Model-based test of RadixTree over 1, 2 and 3 tiers and every eviction policy.

The real tree (with real BlockPools) runs beside a naive model: a dict ``hash -> MNode`` that
records each cached block's parent, tier, slot, references, last access, hits and hints, and a
*content* map ``(tier, slot) -> block hash`` standing in for the KV bytes. Every MoveOp the tree
returns is executed on the content map in order, the way the storage layer would, and checked
against the model's prediction: the victim of each eviction is recomputed from the model as
the smallest policy key among unreferenced leaves of that tier (so "never evict a referenced
block" and "always the policy's choice" are both checked), with the cascade of demotions
(device -> host -> disk -> dropped) in the expected order. Capacities are tiny so eviction,
demotion and promotion happen all the time; time is a fake clock.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class TreeMachine(RuleBasedStateMachine):
    num_tiers = 1
    policy = "lru"

    @initialize(caps=st.tuples(st.integers(2, 6), st.integers(1, 4), st.integers(1, 4)))
    def setup(self, caps) -> None:
        STEPS.program(f"tree[{self.num_tiers} tiers, {self.policy}]")
        self.caps = list(caps[:self.num_tiers])
        self.clock = FakeClock()
        self.pools = [BlockPool(c) for c in self.caps]
        policy = self.policy
        if policy == "ttl":
            from radixkv.core.policy import TTLPolicy
            policy = TTLPolicy(DEFAULT_TTL)
        self.tree = RadixTree(B, self.pools[0], self.pools[1:], policy=policy, clock=self.clock)
        self.m: dict[bytes, MNode] = {}
        self.content: dict[tuple[int, int], bytes] = {}
        self.holders: list[list[bytes]] = []   # chains locked by pretend sequences
        self.stale: list = []                   # node objects that were dropped

    # ------------------------------------------------------------------ model helpers
    def _key(self, h: bytes) -> tuple:
        n = self.m[h]
        if self.policy == "lru":
            return (n.last_access, h)
        if self.policy == "lfu":
            return (n.hits, n.last_access, h)
        if self.policy == "priority":
            return (n.priority, n.last_access, h)
        return (n.last_access + (DEFAULT_TTL if n.ttl is None else n.ttl), h)

    def _evictable(self, tier: int) -> list[bytes]:
        return [h for h, n in self.m.items() if n.tier == tier
                and (tier != DEVICE or n.refs == 0)
                and not any(c.parent == h and c.tier == tier for c in self.m.values())]

    def _resident(self, tier: int) -> int:
        return sum(1 for n in self.m.values() if n.tier == tier)

    def _run_op(self, op: MoveOp) -> None:
        """Execute one MoveOp on the content model, as the storage layer would."""
        assert self.content.get((op.src_tier, op.src_slot)) == op.block_hash, (
            f"{op}: source slot holds {self.content.get((op.src_tier, op.src_slot))!r}")
        data = self.content.pop((op.src_tier, op.src_slot))
        if op.dst_tier is not None:
            assert (op.dst_tier, op.dst_slot) not in self.content, f"{op} overwrites a live slot"
            self.content[(op.dst_tier, op.dst_slot)] = data

    def _expect_out(self, h: bytes, ops: list[MoveOp]) -> None:
        """Model of moving evictable ``h`` out of its tier; consumes the real ops in order."""
        n = self.m[h]
        t = n.tier
        if t + 1 < self.num_tiers:
            if self._resident(t + 1) == self.caps[t + 1]:
                self._expect_evict_one(t + 1, ops)
            assert ops, f"expected the demotion of {h.hex()[:8]} from tier {t}, got no more ops"
            op = ops.pop(0)
            assert op[:4] == (h, t, n.slot, t + 1), f"expected demotion of {h.hex()[:8]} " \
                f"(tier {t} slot {n.slot}), got {op}"
            assert 0 <= op.dst_slot < self.caps[t + 1]
            assert not any(x.tier == t + 1 and x.slot == op.dst_slot for x in self.m.values())
            self._run_op(op)
            n.tier, n.slot = t + 1, op.dst_slot
        else:
            assert not any(c.parent == h for c in self.m.values()), "dropping a parent"
            assert ops, f"expected the drop of {h.hex()[:8]}, got no more ops"
            op = ops.pop(0)
            assert op == MoveOp(h, t, n.slot, None, None), f"expected drop of {h.hex()[:8]}, got {op}"
            self._run_op(op)
            del self.m[h]

    def _expect_evict_one(self, tier: int, ops: list[MoveOp]) -> None:
        cands = self._evictable(tier)
        assert cands, f"model: nothing evictable in tier {tier}"
        victim = min(cands, key=self._key)
        assert tier != DEVICE or self.m[victim].refs == 0
        self._expect_out(victim, ops)

    def _evict(self, tier: int, n: int) -> None:
        avail = (sum(1 for x in self.m.values() if x.tier == DEVICE and x.refs == 0)
                 if tier == DEVICE else self._resident(tier))
        if n > avail:
            before = snapshot_tree(self.tree)
            with pytest.raises(OutOfBlocks):
                self.tree.evict(tier, n)
            assert_unchanged(before, snapshot_tree(self.tree), f"evict({tier}, {n})")
            return
        dropped = {h: self.tree.get(h) for h in self.m}
        ops = list(self.tree.evict(tier, n))
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
    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES), keep=st.booleans())
    def insert_chain(self, tokens, ns, keep) -> None:
        """What a sequence does: lock the cached prefix (promoting slow-tier hits), insert the
        rest block by block, then keep the chain locked (a live sequence) or release it."""
        STEPS.step(f"tree[{self.num_tiers} tiers, {self.policy}]")
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
                    src = self.m[h].tier
                    op = self.tree.promote(node, b)
                    assert op[:4] == (h, src, self.m[h].slot, DEVICE) and op.dst_slot == b, op
                    self._run_op(op)
                    self.m[h].tier, self.m[h].slot = DEVICE, b
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

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release_chain(self, data) -> None:
        STEPS.step(f"tree[{self.num_tiers} tiers, {self.policy}]")
        chain = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        for h in reversed(chain):
            self._release(h)

    @rule(tier=st.integers(0, 2), n=st.integers(0, 4))
    def evict(self, tier, n) -> None:
        STEPS.step(f"tree[{self.num_tiers} tiers, {self.policy}]")
        self._evict(tier % self.num_tiers, n)

    @rule(dt=st.sampled_from([0.0, 1.0, 2.5, 6.0]))
    def tick(self, dt) -> None:
        self.clock.advance(dt)

    @rule(ahead=st.sampled_from([0.0, 3.0, 100.0]))
    def evict_expired(self, ahead) -> None:
        STEPS.step(f"tree[{self.num_tiers} tiers, {self.policy}]")
        now = self.clock() + ahead
        dropped = {h: self.tree.get(h) for h in self.m}
        ops = list(self.tree.evict_expired(now))
        if self.policy == "ttl":
            for tier in range(self.num_tiers):
                while True:
                    cands = self._evictable(tier)
                    if not cands:
                        break
                    v = min(cands, key=self._key)
                    if self._key(v)[0] > now:
                        break
                    self._expect_out(v, ops)
            # nothing unexpired that is unreferenced... and nothing expired left behind
            for t in range(self.num_tiers):
                assert all(self._key(h)[0] > now for h in self._evictable(t))
        assert not ops, f"unexpected moves {ops}"
        self.stale.extend(node for h, node in dropped.items() if h not in self.m)

    @precondition(lambda self: self.m)
    @rule(data=st.data(), priority=st.one_of(st.none(), st.integers(-2, 3)),
          ttl=st.one_of(st.none(), st.sampled_from([1.0, 4.0, 50.0])), with_stale=st.booleans())
    def set_hints(self, data, priority, ttl, with_stale) -> None:
        STEPS.step(f"tree[{self.num_tiers} tiers, {self.policy}]")
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
        STEPS.step(f"tree[{self.num_tiers} tiers, {self.policy}]")
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
            assert self.content[(n.tier, n.slot)] == n.block_hash, "match would serve a wrong block"
        # the other namespace never matches these blocks
        other = NAMESPACES[1 - NAMESPACES.index(ns)]
        assert not set(hash_token_blocks(tokens, B, other)) & set(hashes)

    @precondition(lambda self: self.num_tiers > 1)
    @rule(tokens=TOKENS, ns=st.sampled_from(NAMESPACES), tier=st.integers(1, 2))
    def insert_lower(self, tokens, ns, tier) -> None:
        """A block found in a slow tier (e.g. on disk at start) under its cached prefix."""
        STEPS.step(f"tree[{self.num_tiers} tiers, {self.policy}]")
        hashes = hash_token_blocks(tokens, B, ns)
        tok = token_bytes(tokens)
        i = 0
        while i < len(hashes) and hashes[i] in self.m:
            i += 1
        if i == len(hashes):
            return
        parent = self.tree.get(hashes[i - 1]) if i else None
        tier = max(min(tier, self.num_tiers - 1), parent.tier if parent else 1)
        full = self._resident(tier) == self.caps[tier]
        node = self.tree.insert_lower(parent, hashes[i], tok[i * B * 4:(i + 1) * B * 4], tier)
        if full:
            assert node is None
            return
        assert node is not None and node.tier == tier
        assert (tier, node.slot) not in self.content
        self.content[(tier, node.slot)] = hashes[i]
        self.m[hashes[i]] = MNode(None if parent is None else parent.block_hash,
                                  node.tokens, tier, node.slot, last_access=self.clock())

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
        tree = self.tree
        tree.check_invariants()
        for p in self.pools:
            p.check_invariants()
        assert len(tree) == len(self.m), f"tree caches {len(tree)} blocks, model {len(self.m)}"
        slots = set()
        for h, n in self.m.items():
            node = tree.get(h)
            assert node is not None, f"model block {h.hex()[:8]} missing from the tree"
            assert (node.tier, node.slot) == (n.tier, n.slot), (node, n)
            assert (n.tier, n.slot) not in slots
            slots.add((n.tier, n.slot))
            assert self.content.get((n.tier, n.slot)) == h, f"{node}: content lost or overwritten"
            if n.parent is not None:
                assert self.m[n.parent].tier <= n.tier, "prefix closure per tier broken"
            if n.tier == DEVICE:
                assert self.pools[0].ref_counts[n.slot] == n.refs, (node, n.refs)
        for t in range(self.num_tiers):
            assert tree.num_resident(t) == self._resident(t) <= self.caps[t]
            want_evictable = (sum(1 for x in self.m.values() if x.tier == DEVICE and x.refs == 0)
                              if t == DEVICE else self._resident(t))
            assert tree.num_evictable(t) == want_evictable
        assert set(self.content) == slots, "content model holds slots of no cached block"


def _machine(num_tiers: int, policy: str):
    cls = type(f"Tree{num_tiers}{policy.upper()}", (TreeMachine,),
               {"num_tiers": num_tiers, "policy": policy})
    return cls.TestCase


for _t in (1, 2, 3):
    for _p in ("lru", "lfu", "priority", "ttl"):
        globals()[f"TestTree{_t}Tier{_p.upper()}"] = _machine(_t, _p)
