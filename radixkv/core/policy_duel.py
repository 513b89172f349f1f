"""Set dueling: evict in the order of whichever member policy would be hitting most right now.

No single order suits every workload (docs/eviction.md): the next-use forecast wins big where
conversations loop through a cache too small for them and loses a few points where think times
are random; frequency wins on RAG, where one-off document combinations must not flush popular
documents, and loses badly on chat; LRU is never far from the best on open-loop chat and agent
loops. ``DuelPolicy`` runs all of them at once and follows the one that is winning, as adaptive
processor caches do (set dueling, Qureshi et al. 2007):

- **Shadows.** Each member also runs alone on a *shadow cache*: a ``BlockManager`` over a
  device-only ``RadixTree`` of the real device's capacity, with that member as its policy, that
  holds no KV (block ids and token ids only). Every finished request is replayed into each
  shadow (``on_finish``: prompt matched and committed, the rest appended and committed, freed),
  and the prompt tokens it hit there are added to that member's score, which decays by
  ``decay`` per request (0.99: about the last 100 requests count).
- **Leader.** After each request, the member with the highest score leads if it beats the
  current leader's (ties keep the leader). The real tree evicts in the leader's order.
- **One index per member.** Every evictable node is filed in each member's own index (in
  each tier); the key is the members' keys concatenated, and member ``i``'s index holds
  ``(*key_i, *whole key, hash)``, so it orders by its own key and then exactly as a per-block
  cache would. ``pop_min`` pops from the leader's index and removes the entry from the others:
  a change of leader costs nothing, and the new order is exact at once. Members with hooks
  (the forecast) keep their per-node state in their slot of ``node.aux`` and hear every
  event, whether leading or not.

Leaf-first eviction and "never a held block" hold whatever the leader: only evictable leaves
are ever filed. The slower tiers (host, disk) demote in the same leader's order.

Cost, per request: each shadow costs what the real bookkeeping of one request costs under
its member (O(nodes) locks and releases, O(new blocks) hashing and inserting); filing a node
costs one O(log n) (or O(1)) insertion per member. Memory: per shadow, the block ids and token
ids of up to the device capacity (no KV).

**Sampled shadows** (``sample=k``): as set dueling samples a few sets of a processor cache, and
as miss-ratio-curve samplers (SHARDS) sample keys, the shadows may see only every k-th *group*
of requests, a session with all its turns (a request without a session is its own group), chosen
by a fixed hash of the group id, in caches of 1/k the device's capacity. A shared prefix's reuse
interval and the volume inserted between two uses both shrink by k in the sampled stream, so
each member's hit rate there estimates its hit rate in the full cache; the shadows' cost drops
by about k. Scores then decay by ``decay ** k`` per replay, so they still span about the same
number of real requests. The default, ``sample="auto"``, samples only where the shadows stay
large (at least ``shadow_blocks`` blocks each): a device of fewer than 16,384 blocks runs the
full duel; a GPU's 10^5 blocks sample 8-16 (measured on RAG: at most 0.2 points of hit rate
for 0.41-0.67 of the CPU, docs/eviction.md).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from itertools import count
from typing import TYPE_CHECKING, TypedDict

import xxhash

from radixkv.core.policy import (
    CacheMaker, EvictionPolicy, Key, NodeHints, PolicyHost, ShadowCache,
)
from radixkv.core.policy_members import make_member
from radixkv.errors import ConfigError, OutOfBlocks

if TYPE_CHECKING:
    from radixkv.core.evict_index import Entry, EvictionIndex
    from radixkv.core.hashing import Namespace
    from radixkv.core.node import Node

    #: a policy's ``key`` function (bound method or ``_concat_keys``' closure)
    KeyFn = Callable[[Node, NodeHints], Key]
    #: a live sequence's request as the shadows replay it: (prompt tokens, namespace,
    #: session, end_session, resumed)
    Req = tuple[int, Namespace, Hashable | None, bool, bool]

DEFAULT_MEMBERS = ("lru", "lfu-ghost", "forecast")
#: The largest ``sample`` that ``sample="auto"`` picks (a device of 16 x 8,192 blocks and up).
MAX_AUTO_SAMPLE = 16


class DuelPolicy(EvictionPolicy):
    """Follow the member policy whose shadow cache hit the most prompt tokens lately.

    Args:
        members: policy names (each made fresh twice: once for the real tree, once for its
            shadow), at least two.
        decay: per-request decay of the shadows' hit scores, in (0, 1).
        sample: replay one group of requests (a session, or a request without one) in
            ``sample`` into shadows of 1/``sample`` the device's capacity (1: every request);
            ``"auto"``: the largest power of two up to :data:`MAX_AUTO_SAMPLE` that leaves
            each shadow at least ``shadow_blocks`` blocks, chosen when the policy is bound
            (so 1 for a device of fewer than 2 x ``shadow_blocks`` blocks).
        shadow_blocks: with ``sample="auto"``, the smallest shadow (default 8,192 blocks: 16
            requests of 8,192 tokens at block size 16; a shadow must hold several whole
            requests, docs/eviction.md).
    """

    hooks = True

    def __init__(self, members: Sequence[str] = DEFAULT_MEMBERS, decay: float = 0.99,
                 sample: int | str = "auto", shadow_blocks: int = 8192) -> None:
        if isinstance(members, str) or len(members) < 2 or \
                not all(isinstance(m, str) for m in members):
            raise ConfigError(f"a duel needs at least two member policy names, got {members!r}")
        if "duel" in members or any(m.startswith("duel") for m in members):
            raise ConfigError("a duel's members cannot be duels")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise ConfigError(f"decay must be in (0, 1), got {decay!r}")
        if sample != "auto" and (type(sample) is not int or sample < 1):
            raise ConfigError(f"sample must be an int >= 1 or 'auto', got {sample!r}")
        if type(shadow_blocks) is not int or shadow_blocks < 1:
            raise ConfigError(f"shadow_blocks must be an int >= 1, got {shadow_blocks!r}")
        self.member_names = tuple(members)
        self.members = [make_member(m) for m in members]
        self.decay = float(decay)
        self.auto_sample = sample == "auto"
        self.shadow_blocks = shadow_blocks
        self._set_sample(1 if self.auto_sample else int(sample))
        cuts, off = [], 0
        for i, m in enumerate(self.members):
            cuts.append((off, off + m.key_size))
            off += m.key_size
            if m.hooks:
                m.aux_slot = i
        self._cuts = cuts
        self.key_size = off
        self._hooked = [m for m in self.members if m.hooks]
        self._blank_aux = (None,) * len(self.members)
        # Per node event, the members that override its hook (bound methods): the tree calls
        # the duel once per node event, and a no-op call per member per event was a tenth of
        # its hook time (lfu-ghost hears no hits or releases, LRU nothing).
        self._on_insert: list[Callable[[Node, int, float], None]] = _overriding(
            self._hooked, "on_insert")
        self._on_hit: list[Callable[[Node, float, float], None]] = _overriding(
            self._hooked, "on_hit")
        self._on_release: list[Callable[[Node, float], None]] = _overriding(
            self._hooked, "on_release")
        self._on_leave: list[Callable[[Node, int], None]] = _overriding(self._hooked, "on_leave")
        # an instance attribute over the method: the tree calls it on every filing, and the
        # unrolled closure saves the loop (``_concat_keys``)
        self.key = _concat_keys(  # type: ignore[method-assign, assignment]
            [m.key for m in self.members])
        #: the members that tell new blocks apart (``insert_key`` not None: the ignores on
        #: calling theirs below mark that this list holds only such members)
        self._keyed = [m for m in self.members if m.insert_key is not None]
        if not self._keyed:
            # an instance attribute over the method, as the seam says (None: no insert keys)
            self.insert_key = None  # type: ignore[method-assign, assignment]
        self.fresh_counts = any(m.fresh_counts for m in self.members)
        self.leader = 0
        self.scores = [0.0] * len(members)
        self.led = [0] * len(members)          # requests each member led (statistics)
        self.shadow_hits = [0] * len(members)  # prompt tokens each shadow hit (statistics)
        self._shadows: list[ShadowCache] = []
        self._shadow_blocks = 1   # per shadow; set by ``bind``
        # live sequence -> (prompt tokens, ns, session, end, resumed); None: not in the sample
        self._reqs: dict[Hashable, Req | None] = {}
        self._ids = count()

    def _set_sample(self, sample: int) -> None:
        self.sample = sample
        self.name = "duel-" + "-".join(self.member_names) + (f"/{sample}" if sample > 1 else "")
        self._step_decay = self.decay ** sample   # per replay: the same span of requests

    # ------------------------------------------------------------------ the key and index
    def key(self, node: Node, hints: NodeHints) -> Key:
        """The members' keys concatenated (an instance gets ``_concat_keys``' version of
        this, with the members' bound ``key`` methods, set in ``__init__``)."""
        out: Key = ()
        for m in self.members:
            out += m.key(node, hints)
        return out

    def new_index(self) -> DuelIndex:
        return DuelIndex(self, self._cuts, [m.new_index() for m in self.members])

    def bind(self, tree: PolicyHost) -> None:
        super().bind(tree)
        for m in self._hooked:
            m.bind(tree)
        self._keyed = [m for m in self.members if m.insert_key is not None]   # after binding
        if not self._keyed:
            self.insert_key = None  # type: ignore[method-assign, assignment]  # as in __init__
        elif len(self._keyed) == 1:
            # the one member that tells new blocks apart answers the tree directly (the tree
            # asks per new block: no duel frame in between); instance attributes over the
            # methods, and that member's ``insert_key`` is not None (``_keyed``)
            self.insert_key = self._keyed[0].insert_key  # type: ignore[method-assign, assignment]
            self.can_extend = self._keyed[0].can_extend  # type: ignore[method-assign]
        if self.auto_sample:
            k, n = 1, tree.pools[0].num_blocks
            while 2 * k <= MAX_AUTO_SAMPLE and n // (2 * k) >= self.shadow_blocks:
                k *= 2
            self._set_sample(k)
        self._shadow_blocks = max(1, tree.pools[0].num_blocks // self.sample)

    def bind_manager(self, manager: CacheMaker) -> None:
        """One shadow cache per member, of 1/``sample`` of the device's blocks, made by the
        block manager that drives this policy (``BlockManager.shadow``)."""
        self._shadows = [manager.shadow(self._shadow_blocks, name) for name in self.member_names]

    def insert_key(self, block_hash: bytes) -> object:
        """The members' insert keys (``EvictionPolicy.insert_key``): new blocks are alike
        only if they are alike for every member."""
        keyed = self._keyed
        if len(keyed) == 1:
            return keyed[0].insert_key(block_hash)  # type: ignore[misc]  # not None: _keyed
        return tuple(m.insert_key(block_hash) for m in keyed)  # type: ignore[misc]  # as above

    def can_extend(self, node: Node, block_hash: bytes) -> bool:
        return all(m.can_extend(node, block_hash) for m in self._keyed)

    # ------------------------------------------------------------------ node events
    def on_insert(self, node: Node, start: int, now: float) -> None:
        if start == 0:
            node.aux = self._blank_aux
        for f in self._on_insert:
            f(node, start, now)

    def on_hit(self, node: Node, prev_access: float, now: float) -> None:
        for f in self._on_hit:
            f(node, prev_access, now)

    def on_release(self, node: Node, now: float) -> None:
        for f in self._on_release:
            f(node, now)

    def on_leave(self, node: Node, k: int) -> None:
        for f in self._on_leave:
            f(node, k)

    # ------------------------------------------------------------------ request events
    def on_start(self, seq_id: Hashable, num_tokens: int, namespace: Namespace,
                 session: Hashable | None, end_session: bool, now: float,
                 resumed: bool = False) -> None:
        if self.sample > 1 and self._bucket(seq_id if session is None else session):
            self._reqs[seq_id] = None   # not in the sample: the shadows never see it
        else:
            self._reqs[seq_id] = (num_tokens, namespace, session, end_session, resumed)
        for m in self._hooked:
            m.on_start(seq_id, num_tokens, namespace, session, end_session, now, resumed)

    def _bucket(self, group: Hashable) -> int:
        """0 for a group in the sample: a fixed hash (not ``hash()``, which is salted per
        process), so a replay and its rerun sample the same sessions."""
        return xxhash.xxh64_intdigest(repr(group).encode()) % self.sample

    def on_fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        if parent_id in self._reqs:
            self._reqs[child_id] = self._reqs[parent_id]
        for m in self._hooked:
            m.on_fork(parent_id, child_id)

    def enter(self, seq_id: Hashable) -> None:
        for m in self._hooked:
            m.enter(seq_id)

    def end_session(self, session: Hashable) -> None:
        for m in self._hooked:
            m.end_session(session)
        for sh in self._shadows:
            sh.end_session(session)

    def on_finish(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Replay the finished sequence into every shadow; rescore; pick the leader."""
        for m in self._hooked:
            m.on_finish(seq_id, token_ids)
        if seq_id not in self._reqs:
            return
        req = self._reqs.pop(seq_id)
        if req is None:           # not in the sample: led, not replayed
            self.led[self.leader] += 1
            return
        n, ns, session, end, resumed = req
        d, scores = self._step_decay, self.scores
        for i, sh in enumerate(self._shadows):
            hit = self._replay(sh, token_ids, n, ns, session, end, resumed)
            self.shadow_hits[i] += hit
            scores[i] = d * scores[i] + hit
        best = max(range(len(scores)), key=scores.__getitem__)
        if scores[best] > scores[self.leader]:
            self.leader = best
        self.led[self.leader] += 1

    def _replay(self, sh: ShadowCache, tokens: Sequence[int], n: int, ns: Namespace,
                session: Hashable | None, end: bool, resumed: bool) -> int:
        """One request through a shadow: the prompt tokens it would have hit."""
        sid = next(self._ids)
        try:
            a = sh.allocate(sid, tokens[:n], ns, session=session, end_session=end,
                            resumed=resumed)
        except OutOfBlocks:
            return 0        # a fork or preempted request that the shadow cannot hold alone
        try:
            sh.commit(sid, n)
            if len(tokens) > n:
                sh.append_slots(sid, tokens[n:])
                sh.commit(sid, len(tokens))
        except OutOfBlocks:
            pass
        sh.free(sid)
        return a.num_cached_tokens

    def stats(self) -> DuelStats:
        """Who leads, the decayed scores, requests led and shadow hits per member."""
        return {"leader": self.member_names[self.leader],
                "scores": dict(zip(self.member_names, self.scores)),
                "led": dict(zip(self.member_names, self.led)),
                "shadow_hit_tokens": dict(zip(self.member_names, self.shadow_hits))}


class DuelStats(TypedDict):
    """``DuelPolicy.stats()``: per member name, its decayed score, requests led and shadow
    hit tokens, and the leader's name."""

    leader: str
    scores: dict[str, float]
    led: dict[str, int]
    shadow_hit_tokens: dict[str, int]


def _overriding(members: list[EvictionPolicy], hook: str) -> list[Callable[..., None]]:
    """The bound ``hook`` methods of the members whose class overrides the base no-op (the
    caller's annotation gives the hook's signature)."""
    base = getattr(EvictionPolicy, hook)
    return [getattr(m, hook) for m in members if getattr(type(m), hook) is not base]


def _concat_keys(keys: list[KeyFn]) -> KeyFn:
    """``DuelPolicy.key`` for these member key functions, unrolled for two and three members
    (the default duel has three): the tree computes a key on every filing of every node."""
    if len(keys) == 2:
        k0, k1 = keys
        return lambda node, hints: k0(node, hints) + k1(node, hints)
    if len(keys) == 3:
        k0, k1, k2 = keys
        return lambda node, hints: k0(node, hints) + k1(node, hints) + k2(node, hints)

    def key(node: Node, hints: NodeHints) -> Key:
        out: Key = ()
        for k in keys:
            out += k(node, hints)
        return out
    return key


class DuelIndex:
    """One index per member; entries are the duel's whole keys plus the block hash. Member
    ``i``'s index holds ``(*key_i, *entry)``. ``min``/``pop_min`` follow the leader.
    Runtime complexity: per operation, one operation on each member's index."""

    __slots__ = ("_policy", "_subs", "_cuts", "_adds", "_removes")

    def __init__(self, policy: DuelPolicy, cuts: list[tuple[int, int]],
                 subs: list[EvictionIndex]) -> None:
        # cuts: member i's key is entry[a:b] for (a, b) = cuts[i]
        self._policy = policy
        self._subs = subs
        self._cuts = cuts
        self._adds = [(s.add, a, b) for (a, b), s in zip(self._cuts, subs)]
        self._removes = [(s.remove, a, b) for (a, b), s in zip(self._cuts, subs)]

    def add(self, entry: Entry) -> None:
        for add, a, b in self._adds:
            add(entry[a:b] + entry)

    def remove(self, entry: Entry) -> None:
        """Remove ``entry`` (must be present; ValueError otherwise)."""
        for remove, a, b in self._removes:
            remove(entry[a:b] + entry)

    def min(self) -> Entry:
        i = self._policy.leader
        a, b = self._cuts[i]
        return self._subs[i].min()[b - a:]

    def pop_min(self) -> Entry:
        i = self._policy.leader
        a, b = self._cuts[i]
        entry = self._subs[i].pop_min()[b - a:]
        for j, (remove, c, d) in enumerate(self._removes):
            if j != i:
                remove(entry[c:d] + entry)
        return entry

    def __contains__(self, entry: Entry) -> bool:
        a, b = self._cuts[0]
        return entry[a:b] + entry in self._subs[0]

    def __len__(self) -> int:
        return len(self._subs[0])

    def __iter__(self) -> Iterator[Entry]:
        """The entries in whole-key order (for checks)."""
        a, b = self._cuts[0]
        return iter(sorted(e[b - a:] for e in self._subs[0]))

    def check_invariants(self) -> None:
        sets: list[list[Entry]] = []
        for (a, b), s in zip(self._cuts, self._subs):
            own = getattr(s, "check_invariants", None)
            if own is not None:
                own()
            sets.append(sorted(e[b - a:] for e in s))
        assert all(x == sets[0] for x in sets), (
            f"member indexes disagree: sizes {[len(x) for x in sets]}")
