"""Model-based test of the radix tree's eviction order over runs: 1, 2 and 3 tiers, every
policy, write-back and write-through.

The real ``BlockManager``/``RadixTree`` runs beside a naive *per-block* model: a dict
``hash -> MBlock`` with each cached block's parent, tier, holders, last access, hits, priority and
write-through copies. The model knows nothing of runs: every block is its own eviction entry
with its own policy key, and eviction is computed block by block: the smallest
``(*key, block hash)`` among the tier's evictable entries (unheld primaries with no child block in
that tier, plus every copy), demoted one tier down (onto its copy there if it has one, else after
making room there, recursively) or dropped from the last tier. Promotions of slower-tier hits go
block by block too (take a device block, check the block is still there, promote it), and the
write-through copies of each committed block are made block by block.

After every rule the real tree must hold exactly the model's blocks, each in the model's tier
with the model's holders, key inputs, priority and copies: path compression (runs, cuts,
coalescing, batched drops and demotions) must be invisible, and eviction exactly per-block in
policy order -- "never evict a held block" and "always the policy's choice" both follow.
Capacities are tiny so eviction, demotion, promotion, copies and their eviction happen all the
time; time is a fake clock (``tick`` 0 makes equal keys, decided by the block hash).
Block contents are the manager machine's business (``test_manager_state.py``). The per-block
models themselves are in ``tree_models.py``.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from core_helpers import STEPS, FakeClock
from tree_models import ForecastModel, GhostTableModel, MBlock
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks, token_bytes
from radixkv.core.policy import TTLPolicy
from radixkv.core.tree import DEVICE
from radixkv.errors import OutOfBlocks

B = 2
DEFAULT_TTL = 5.0
DUEL_MEMBERS = ("lru", "lfu-ghost", "forecast")    # the duel's default members and their key slices
DUEL_CUTS = ((0, 1), (1, 3), (3, 6))
FRESH_COUNTS = ("lfu", "lfu-da", "lfu-ghost", "duel")    # blocks never join a run that has hits
NAMESPACES = [Namespace("m"), Namespace("m", cache_salt="t2")]
PREFIXES = [[], [0, 1, 0, 1], [1, 1, 2, 2, 0, 0], [2, 2, 2, 2, 1, 1, 0, 0]]
PROMPTS = st.builds(lambda p, tail: p + tail, st.sampled_from(PREFIXES),
                    st.lists(st.integers(0, 2), max_size=5)).filter(bool)


class TreeMachine(RuleBasedStateMachine):
    num_tiers = 1
    policy = "lru"
    write_through: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        wt = f", wt={list(self.write_through)}" if self.write_through else ""
        return f"tree[{self.num_tiers} tiers, {self.policy}{wt}]"

    @initialize(caps=st.tuples(st.integers(3, 8), st.integers(1, 4), st.integers(1, 4)))
    def setup(self, caps) -> None:
        STEPS.program(self.name)
        self.caps = list(caps[:self.num_tiers])
        self.clock = FakeClock()
        policy = TTLPolicy(DEFAULT_TTL) if self.policy == "ttl" else self.policy
        self.bm = BlockManager.create(self.caps[0], B, policy=policy,
                                      lower_tier_blocks=self.caps[1:], clock=self.clock,
                                      write_through=self.write_through)
        self.tree = self.bm.tree
        self.m: dict[bytes, MBlock] = {}
        self.live: dict[int, tuple[list[bytes], int]] = {}   # sid -> (held cached blocks, private)
        self.next_id = 0
        self.L = 0.0          # lfu-da: the largest key evicted so far (any tier, copies too)
        self.fm = ForecastModel()
        self.gt = GhostTableModel(sum(self.caps))

    # ------------------------------------------------------------------ the model
    def key(self, h: bytes) -> tuple:
        b = self.m[h]
        return {"lru": (b.last_access,), "lfu": (b.hits, b.last_access),
                "mru": (-b.last_access,), "priority": (b.priority, b.last_access),
                "ttl": (b.last_access + DEFAULT_TTL,), "fifo": (b.born, b.last_access),
                "lfu-da": (b.kda, b.last_access), "forecast": (*b.fkey, b.last_access),
                "lfu-ghost": (b.gbase + b.hits, b.last_access),
                "duel": (b.last_access, b.gbase + b.hits, b.last_access, *b.fkey,
                         b.last_access),
                }[self.policy]

    def m_hit(self, b: MBlock, now: float) -> None:
        """A request takes (locks or promotes) cached block ``b``."""
        prev = b.last_access
        b.last_access = now
        b.hits += 1
        b.kda = self.L + b.hits
        self.fm.hit(b, prev, now)

    def victim(self, entries: list[tuple]) -> tuple:
        """The entry a per-block cache evicts next (``entries`` sorted by whole key)."""
        if self.policy != "duel":
            return self.order_victim(self.policy, entries)
        # The duel evicts in its leader's order: the leader is the duel's own decision (from
        # its shadows' hits, checked against independent managers in test_policy_duel.py);
        # the order within it is modelled here.
        lead = self.tree.policy.leader
        a, b = DUEL_CUTS[lead]
        sub = sorted(e[a:b] + e for e in entries)
        return self.order_victim(DUEL_MEMBERS[lead], sub)[b - a:]

    def order_victim(self, policy: str, entries: list[tuple]) -> tuple:
        """The first victim of a plain policy's order among sorted ``entries``."""
        if policy == "forecast" and entries[0][0] >= self.clock.now:
            return min(entries, key=lambda e: (e[1], e))               # farthest forecast
        return entries[0]                                           # (forecast: overdue)

    def children(self, h: bytes) -> list[bytes]:
        return [x for x, b in self.m.items() if b.parent == h]

    def entries(self, tier: int, exclude: frozenset = frozenset()) -> list[tuple]:
        out = []
        for h, b in self.m.items():
            if h in exclude:
                continue
            if b.tier == tier and (tier > 0 or b.refs == 0) and \
                    not any(self.m[c].tier == tier for c in self.children(h)):
                out.append((*self.key(h), h, "primary"))
            if tier in b.copies:
                out.append((*self.key(h), h, "copy"))
        return sorted(out)

    def used(self, tier: int) -> int:
        n = sum(1 for b in self.m.values() if b.tier == tier)
        n += sum(1 for b in self.m.values() if tier in b.copies)
        if tier == DEVICE:
            n += sum(priv for _, priv in self.live.values())
        return n

    def free(self, tier: int) -> int:
        return self.caps[tier] - self.used(tier)

    def m_evict(self, tier: int, k: int, exclude: frozenset = frozenset()) -> None:
        for _ in range(k):
            e = self.victim(self.entries(tier, exclude))
            h, kind = e[-2], e[-1]
            if self.policy == "lfu-da":
                self.L = max(self.L, e[0])
            if kind == "copy":
                self.m[h].copies.discard(tier)
            else:
                self.m_move_out(h)

    def m_move_out(self, h: bytes) -> None:
        b = self.m[h]
        u = b.tier + 1
        if u == self.num_tiers:
            assert not self.children(h), "the model drops a block with children"
            self.gt.dropped(h, b)
            del self.m[h]
            return
        if u in b.copies:                       # a free demotion onto its copy
            b.copies.discard(u)
        elif self.free(u) == 0:
            self.m_evict(u, 1)
        b.tier = u

    def m_take_device(self, k: int) -> None:
        short = k - self.free(DEVICE)
        if short > 0:
            self.m_evict(DEVICE, short)

    def m_copies(self, h: bytes) -> None:
        for u in self.write_through:
            if self.free(u) == 0:
                if not self.entries(u):
                    continue
                self.m_evict(u, 1)
            self.m[h].copies.add(u)

    def m_match(self, hashes: list[bytes], tok: bytes, limit: int) -> list[bytes]:
        out, prev = [], None
        for i, h in enumerate(hashes[:limit]):
            b = self.m.get(h)
            if b is None or b.parent != prev:
                break
            out.append(h)
            prev = h
        return out

    # ------------------------------------------------------------------ rules
    @rule(tokens=PROMPTS, ns=st.sampled_from(NAMESPACES), hold=st.booleans(),
          dt=st.sampled_from([0.0, 1.0]), session=st.sampled_from([None, 0, 1, 2]),
          end=st.booleans())
    def request(self, tokens, ns, hold, dt, session, end) -> None:
        """allocate (match, lock, promote, take blocks), commit every full block, then free
        the sequence or keep holding it."""
        STEPS.step(self.name)
        self.clock.advance(dt)
        now = self.clock.now
        n = len(tokens)
        hashes = hash_token_blocks(tokens, B, ns)
        tok = token_bytes(tokens)
        matched = self.m_match(hashes, tok, (n - 1) // B)
        dev = [h for h in matched if self.m[h].tier == DEVICE]
        need = -(-n // B) - len(dev)
        avail = self.free(DEVICE) + sum(
            1 for b in self.m.values() if b.tier == DEVICE and b.refs == 0) - sum(
            1 for h in dev if self.m[h].refs == 0)
        sid = self.next_id = self.next_id + 1
        if need > avail:
            assert not self.bm.can_allocate(tokens, ns)
            with pytest.raises(OutOfBlocks):
                self.bm.allocate(sid, tokens, ns)
            return
        a = self.bm.allocate(sid, tokens, ns, session=session, end_session=end)
        # -- the model, block by block
        self.fm.start(session, end, now)
        for h in dev:
            b = self.m[h]
            b.refs += 1
            self.m_hit(b, now)
        held = list(dev)
        private = 0
        per_tier = [0] * self.num_tiers
        per_tier[DEVICE] = len(dev) * B
        for h in matched[len(dev):]:
            self.m_take_device(1)
            b = self.m.get(h)
            if b is None or b.tier == DEVICE or b.parent != (held[-1] if held else None):
                break   # making room dropped it: recomputed
            per_tier[b.tier] += B
            if b.tier in self.write_through:
                b.copies.add(b.tier)            # the source stays as a copy
            b.tier, b.refs = DEVICE, 1
            self.m_hit(b, now)
            held.append(h)
        rest = -(-n // B) - len(held)
        self.m_take_device(rest)
        private = rest
        self.live[sid] = (held, private)
        assert a.num_cached_tokens == len(held) * B, (a, held)
        assert list(a.cached_tokens_per_tier) == per_tier, (a.cached_tokens_per_tier, per_tier)
        # commit: every full block joins the tree
        self.bm.commit(sid, n)
        # The tree inserts a run of new blocks at once, then makes their write-through copies
        # (which may drop blocks from the last tier): the copies wait until the run ends.
        pending: list[bytes] = []

        def flush() -> None:
            for x in pending:
                self.m_copies(x)
            pending.clear()

        for i in range(len(held), n // B):
            h = hashes[i]
            parent = held[-1] if held else None
            b = self.m.get(h)
            private -= 1
            if b is not None:                   # cached already (beyond the match limit)
                flush()
                assert b.parent == parent
                if b.tier == DEVICE:            # another holder computed it: share it
                    b.refs += 1
                    self.m_hit(b, now)
                else:                           # recomputed: adopt, keep a write-through copy
                    if b.tier in self.write_through:
                        b.copies.add(b.tier)
                    b.tier, b.refs = DEVICE, 1
                held.append(h)
                continue
            p = self.m.get(parent) if parent is not None else None
            c = self.gt.take(h)             # lfu-ghost: a count it had before it was dropped
            base = 0 if c is None else c + 1
            if p is not None and p.tier == DEVICE and p.refs == 1 and p.priority == 0 and \
                    not self.children(parent) and not (p.hits and self.policy in FRESH_COUNTS) \
                    and (self.policy not in ("lfu-ghost", "duel") or p.gbase == base):
                # the block joins its parent's run: it takes the run's key inputs
                self.m[h] = MBlock(parent, DEVICE, 1, p.last_access, p.hits, born=p.born,
                                   kda=p.kda, gap=p.gap, owner=p.owner, fkey=p.fkey,
                                   gbase=base)
            else:
                self.m[h] = MBlock(parent, DEVICE, 1, now, 0, born=now, kda=self.L)
                self.fm.new_head(h, self.m[h], now)
                self.m[h].gbase = base
            held.append(h)
            pending.append(h)
        flush()
        self.live[sid] = (held, private)
        self.bm.take_moves()
        if not hold:
            self._free(sid)

    def _free(self, sid: int) -> None:
        held, _ = self.live.pop(sid)
        self.bm.free(sid)
        now = self.clock.now
        for h in held:
            b = self.m[h]
            b.refs -= 1
            if b.refs == 0:
                b.last_access = now
                self.fm.snapshot(b)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), dt=st.sampled_from([0.0, 1.0]))
    def release(self, data, dt) -> None:
        STEPS.step(self.name)
        self.clock.advance(dt)
        self._free(data.draw(st.sampled_from(sorted(self.live))))

    @rule(tier=st.integers(0, 2), k=st.integers(1, 4))
    def evict(self, tier, k) -> None:
        STEPS.step(self.name)
        tier %= self.num_tiers
        k = min(k, self.tree.num_evictable(tier))
        self.tree.evict(tier, k)
        self.m_evict(tier, k)

    @precondition(lambda self: self.m)
    @rule(data=st.data(), priority=st.integers(-2, 2))
    def hint(self, data, priority) -> None:
        """Give a cached block and every block before it on its chain a priority."""
        STEPS.step(self.name)
        h = data.draw(st.sampled_from(sorted(self.m)))
        chain = []
        while h is not None:
            chain.append(h)
            h = self.m[h].parent
        chain = chain[data.draw(st.integers(0, len(chain) - 1)):]
        self.tree.set_hints(chain, priority=priority)
        for x in chain:
            self.m[x].priority = priority

    @precondition(lambda self: self.num_tiers == 3 and any(b.tier == 2 for b in self.m.values()))
    @rule(data=st.data(), dt=st.sampled_from([0.0, 1.0]))
    def prefetch(self, data, dt) -> None:
        """A disk block whose parent is in the host (or a root) moves up into the host."""
        STEPS.step(self.name)
        self.clock.advance(dt)
        ready = sorted(h for h, b in self.m.items() if b.tier == 2 and
                       (b.parent is None or self.m[b.parent].tier <= 1))
        if not ready:
            return
        h = data.draw(st.sampled_from(ready))
        b = self.m[h]
        guard = b.parent if b.parent is not None and self.m[b.parent].tier == 1 else None
        pinned = 0
        a = guard
        while a is not None and self.m[a].tier == 1:
            pinned += 1
            a = self.m[a].parent
        room = self.free(1) + sum(1 for x in self.m.values() if x.tier == 1) + sum(
            1 for x in self.m.values() if 1 in x.copies) - pinned
        moves = self.bm.promote_lower(h, 1, 1)
        if room <= 0:
            assert moves == []
            return
        # the model: the block leaves its disk slot first, then room is made in the host
        # (never its parent chain), then it moves up, touched
        disk_free_before = self.free(2) + 1
        b.tier = -1                              # in flight: neither in host nor on disk
        if self.free(1) <= 0:
            self.m_evict(1, 1, frozenset([guard]) if guard is not None else frozenset())
        b.tier = 1
        b.last_access = self.clock.now
        if 2 in self.write_through and self.free(2) >= disk_free_before - 0:
            b.copies.add(2)                      # its disk slot was not taken: kept as a copy

    @rule(dt=st.sampled_from([0.0, 1.0, 3.0, 10.0]))
    def tick(self, dt) -> None:
        self.clock.advance(dt)

    @precondition(lambda self: self.policy == "duel")
    @rule(i=st.integers(0, len(DUEL_MEMBERS) - 1))
    def lead(self, i) -> None:
        """Hand the lead to member ``i`` (as its shadow winning would): every member's order
        gets exercised, not only the one the tiny shadows prefer."""
        self.tree.policy.leader = i

    @precondition(lambda self: self.policy == "ttl")
    @rule()
    def expire(self) -> None:
        STEPS.step(self.name)
        now = self.clock.now
        self.tree.evict_expired(now)
        for tier in range(self.num_tiers):
            while True:
                es = self.entries(tier)
                if not es or es[0][0] > now:
                    break
                self.m_evict(tier, 1)

    @precondition(lambda self: any(b.refs == 0 for b in self.m.values()))
    @rule(data=st.data())
    def invalidate(self, data) -> None:
        """A block's bytes proved bad: it and everything after it leave the cache."""
        STEPS.step(self.name)
        h = data.draw(st.sampled_from(sorted(self.m)))
        doomed = {h}
        grew = True
        while grew:
            grew = False
            for x, b in self.m.items():
                if b.parent in doomed and x not in doomed:
                    doomed.add(x)
                    grew = True
        if any(self.m[x].refs for x in doomed):
            return
        self.bm.invalidate(h)
        for x in doomed:
            del self.m[x]

    # ------------------------------------------------------------------ invariants
    @invariant()
    def same_as_the_model(self) -> None:
        tree = self.tree
        self.bm.check_invariants()
        index = tree.block_index()
        assert set(index) == set(self.m), (
            f"cached {len(index)} blocks, model {len(self.m)}: "
            f"extra {len(set(index) - set(self.m))}, missing {len(set(self.m) - set(index))}")
        for h, b in self.m.items():
            node = index[h]
            ref = tree.get(h)
            got = (ref.tier, node.ref, ref.parent_hash, tree.hints(h).priority,
                   {u for u in range(1, self.num_tiers) if tree.copy_block_id(h, u) is not None})
            want = (b.tier, b.refs, b.parent, b.priority, b.copies)
            assert got == want, f"block {h.hex()[:8]}: tree {got}, model {want}"
            assert node.last_access == b.last_access, (
                f"block {h.hex()[:8]}: last access {node.last_access}, model {b.last_access}")
            if self.policy in ("lfu", "lfu-da"):
                assert node.hits == b.hits, f"block {h.hex()[:8]}: hits {node.hits}, model {b.hits}"
            if self.policy == "fifo":
                assert node.aux == b.born, f"block {h.hex()[:8]}: born {node.aux}, model {b.born}"
            if self.policy == "duel":
                assert node.hits == b.hits, f"block {h.hex()[:8]}: hits {node.hits}, model {b.hits}"
            if self.policy in ("forecast", "duel"):
                aux = node.aux if self.policy == "forecast" else node.aux[2]
                assert aux == (*b.fkey, b.gap, b.owner), (
                    f"block {h.hex()[:8]}: (due, -far, gap, owner) {aux}, model "
                    f"{(*b.fkey, b.gap, b.owner)}")
            if self.policy == "lfu-da":
                assert node.aux == (b.kda, b.hits), (
                    f"block {h.hex()[:8]}: (K, hits) {node.aux}, model {(b.kda, b.hits)}")
            if self.policy in ("lfu-ghost", "duel"):
                base = node.aux if self.policy == "lfu-ghost" else node.aux[1]
                assert (base, node.hits) == (b.gbase, b.hits), (
                    f"block {h.hex()[:8]}: (restored, hits) {(base, node.hits)}, model "
                    f"{(b.gbase, b.hits)}")
        for t in range(self.num_tiers):
            assert tree.num_resident(t) + tree.num_copies(t) <= self.caps[t]

    def teardown(self) -> None:
        if hasattr(self, "tree"):
            st_ = self.tree.stats
            STEPS.event(self.name, "splits", st_.splits)
            STEPS.event(self.name, "evicted", sum(st_.evicted))
            if self.write_through:
                STEPS.event(self.name, "free_demotions", st_.free_demotions)
            if self.policy == "lfu-ghost":   # show that counts do come back from the ghost
                STEPS.event(self.name, "counts restored", self.tree.policy.restored)
            if self.policy == "duel":   # show that every member leads in some programs
                for m, k in self.tree.policy.led.items() if isinstance(
                        self.tree.policy.led, dict) else zip(DUEL_MEMBERS, self.tree.policy.led):
                    STEPS.event(self.name, f"requests led by {m}", k)


def _machine(tiers: int, policy: str, wt: tuple[int, ...] = ()):
    name = f"Tree{tiers}{policy.upper().replace('-', '')}{''.join(map(str, wt))}"
    return type(name, (TreeMachine,), {"num_tiers": tiers, "policy": policy,
                                        "write_through": wt}).TestCase


for _t in (1, 2, 3):
    for _p in ("lru", "lfu", "mru", "priority", "ttl", "fifo", "lfu-da", "lfu-ghost", "forecast",
               "duel"):
        globals()[f"TestTree{_t}Tier{_p.upper().replace('-', '')}"] = _machine(_t, _p)
for _p in ("lru", "lfu", "priority", "ttl", "fifo", "lfu-da", "lfu-ghost", "forecast", "duel"):
    globals()[f"TestTree2Tier{_p.upper().replace('-', '')}WT1"] = _machine(2, _p, (1,))
    globals()[f"TestTree3Tier{_p.upper().replace('-', '')}WT12"] = _machine(3, _p, (1, 2))
globals()["TestTree3TierLRUWT2"] = _machine(3, "lru", (2,))
