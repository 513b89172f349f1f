"""The policies with state (issue 15): the duel's choice of leader against independent managers,
its index against its members' own, the session-end hint, bad input, and that LRU pays nothing
for the seam. The eviction *order* of each policy is the tree state machine's business
(``test_tree_state.py``)."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from core_helpers import FakeClock
from hypothesis import given, settings

from radixkv.core.block_manager import BlockManager
from radixkv.core.evict_index import SortedIndex
from radixkv.core.hashing import Namespace
from radixkv.core.policy_registry import POLICIES, make_policy
from radixkv.core.policy_duel import DEFAULT_MEMBERS, DuelIndex, DuelPolicy
from radixkv.core.policy_forecast import ForecastIndex, ForecastPolicy
from radixkv.errors import ConfigError, InvalidRequestError, OutOfBlocks

NS = Namespace("m")


def _requests(seed: int, n: int):
    """A small chat-like stream: sessions that go on turn after turn, some one-off requests."""
    rng = random.Random(seed)
    hist: dict[int, list[int]] = {}
    for j in range(n):
        s = rng.randrange(6)
        prompt = hist.get(s, [s, s]) + [rng.randrange(3) for _ in range(rng.randint(1, 4))]
        reply = [rng.randrange(3) for _ in range(rng.randint(0, 4))]
        hist[s] = prompt + reply
        if len(hist[s]) > 16:
            del hist[s]
        yield j, float(j), s, prompt, reply


def _serve_small(bm: BlockManager, clock: FakeClock, j, t, s, prompt, reply) -> int:
    """``_serve`` in a cache that may be too small for the request, as a duel's shadow serves
    it: a prompt that does not fit scores nothing, a reply that does not fit is dropped."""
    clock.now = t
    try:
        a = bm.allocate(j, prompt, NS, session=s)
    except OutOfBlocks:
        return 0
    try:
        bm.commit(j, len(prompt))
        if reply:
            bm.append_slots(j, reply)
            bm.commit(j, len(prompt) + len(reply))
    except OutOfBlocks:
        pass
    bm.free(j)
    return a.num_cached_tokens


def _serve(bm: BlockManager, clock: FakeClock, j, t, s, prompt, reply) -> int:
    clock.now = t
    a = bm.allocate(j, prompt, NS, session=s)
    bm.commit(j, len(prompt))
    if reply:
        bm.append_slots(j, reply)
        bm.commit(j, len(prompt) + len(reply))
    bm.free(j)
    return a.num_cached_tokens


@pytest.mark.parametrize("seed,sample", [(s, 1) for s in range(4)] + [(0, 2), (1, 3)])
def test_duel_leader_follows_independent_managers(seed, sample) -> None:
    """Each member's score is the decayed prompt tokens a manager running that member alone,
    at the same capacity, hits; the leader changes only to a strictly higher score. Sampled
    (``sample=k``): the managers are a k-th of the capacity and see only the sampled sessions,
    and a score decays by ``decay ** k`` per request they see."""
    cap, decay = 24, 0.9
    clock = FakeClock(0.0)
    pol = DuelPolicy(DEFAULT_MEMBERS, decay, sample=sample)
    duel = BlockManager.create(cap, 2, policy=pol, clock=clock)
    alone = [BlockManager.create(cap // sample, 2, policy=m, clock=clock)
             for m in DEFAULT_MEMBERS]
    scores, lead, led = [0.0] * 3, 0, [0, 0, 0]
    for req in _requests(seed, 200):
        _serve(duel, clock, *req)
        if pol._bucket(req[2]) == 0 or sample == 1:
            for i, bm in enumerate(alone):
                scores[i] = decay ** sample * scores[i] + _serve_small(bm, clock, *req)
            best = max(range(3), key=scores.__getitem__)
            if scores[best] > scores[lead]:
                lead = best
        led[lead] += 1
        pol = duel.tree.policy
        assert pol.scores == pytest.approx(scores) and pol.leader == lead, (pol.stats(), scores)
        duel.check_invariants()
    assert pol.led == led


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 3),
                              st.integers(0, 30)), max_size=60),
       leader=st.integers(0, 2), now=st.integers(0, 40))
def test_duel_index_pops_in_the_leaders_order(ops, leader, now) -> None:
    """The duel's index pops exactly what each member's order over the whole entries would:
    (member key, whole entry), the forecast's due-or-far choice included."""
    pol = DuelPolicy(("lru", "lfu", "forecast"))
    pol.members[2].clock = lambda: now
    pol.leader = leader
    idx = pol.new_index()
    assert type(idx) is DuelIndex
    live: dict[bytes, tuple] = {}
    for add, t, hits, due in ops:
        h = bytes([len(live), t, hits, due])
        if add or not live:
            e = (float(t), hits, float(t), float(due), -float(due) / 2, float(t), h)
            if h not in live:
                live[h] = e
                idx.add(e)
        else:
            h = sorted(live)[t % len(live)]
            idx.remove(live.pop(h))
        idx.check_invariants()
    a, b = pol._cuts[leader]
    while live:
        subs = sorted(e[a:b] + e for e in live.values())
        if leader == 2 and subs[0][0] >= now:
            want = min(subs, key=lambda s: (s[1], s))[b - a:]
        else:
            want = subs[0][b - a:]
        assert idx.min() == want
        assert idx.pop_min() == want
        del live[want[-1]]
    assert len(idx) == 0


def test_forecast_index_is_sorted_index_when_nothing_is_due() -> None:
    pol = ForecastPolicy()
    pol.clock = lambda: -1e9
    fi, si = ForecastIndex(pol), SortedIndex()
    rng = random.Random(1)
    for i in range(200):
        e = (rng.random(), -rng.random(), rng.random(), bytes([i]))
        fi.add(e)
        si.add((e[1], e))
    while len(si):
        assert fi.pop_min() == si.pop_min()[1]


@pytest.mark.parametrize("policy", ["forecast", "duel"])
def test_end_session_lets_a_closed_session_go_first(policy) -> None:
    """Two sessions of equal history; the one the client closes is evicted first, though it
    was used last (LRU would keep it); a held session is never touched."""
    clock = FakeClock(0.0)
    bm = BlockManager.create(12, 2, policy=policy, clock=clock)
    for turn in range(2):
        for s in ("a", "b"):
            sid = f"{s}{turn}"
            clock.advance(1.0)
            prompt = [1 if s == "a" else 2] * (4 + 4 * turn)
            bm.allocate(sid, prompt, NS, session=s)
            bm.commit(sid, len(prompt))
            bm.free(sid)
    tree = bm.tree
    if policy == "duel":
        tree.policy.leader = 2     # the forecast's order
    b_chain = tree.match_hashes(bytes(4 * 8).replace(b"\0" * 4, (2).to_bytes(4, "little")),
                                NS.seed)
    bm.end_session("b")
    moves = []
    before = set(tree.block_index())
    moves += tree.evict(0, 2)
    gone = before - set(tree.block_index())
    assert gone and gone <= set(b_chain), "the closed session's blocks go first"
    bm.check_invariants()


def test_forecast_patience_grows_with_the_share_of_announced_ends() -> None:
    """A silent session is written off after ``overdue x patience`` gaps: patience is 1 / the
    share of sessions *not* announced as ended (each counted once, by the request flag or
    ``end_session``), at most 16, and 1 where no client announces ends."""
    bm = BlockManager.create(64, 2, policy="forecast", clock=FakeClock(0.0))
    pol = bm.tree.policy

    def turn(rid, session, end=False):
        bm.allocate(rid, [1, 2, 3], NS, session=session, end_session=end)
        bm.free(rid)

    turn("a1", "a")
    turn("b1", "b")
    turn("c1", "c")
    turn("d1", "d")
    turn("x", None, end=True)             # a request on its own: not a session
    assert (pol.sessions, pol.announced, pol.patience) == (4, 0, 1.0)
    turn("a2", "a", end=True)             # announced by its last request
    bm.end_session("b")                   # announced afterwards
    bm.end_session("b")                   # twice: counted once
    assert (pol.sessions, pol.announced, pol.patience) == (4, 2, 2.0)
    bm.end_session("c")
    assert pol.patience == 4.0
    bm.end_session("d")
    assert pol.patience == 16.0         # every session announced: the cap
    turn("e1", "e")                       # a fifth session, not announced
    assert pol.sessions == 5 and pol.patience == 1.0 / (1 - 4 / 5)
    bm.check_invariants()


def test_forecast_learns_overdue_from_the_last_2048_ratios() -> None:
    """``overdue`` is a quantile (here 0.3) of the last 2,048 ratios gap / forecast gap of returning
    sessions (once 64 are seen, updated every 32): kept by insertion into a sorted window, it
    must equal re-sorting that window from scratch at every update (ties and the window's
    slide included). One session; its gaps are drawn from a few values (many equal ratios) or
    scaled at random."""
    clock = FakeClock(0.0)
    bm = BlockManager.create(64, 2, policy=ForecastPolicy(quantile=0.3, slack=1.5), clock=clock)
    pol = bm.tree.policy
    rng = random.Random(7)
    times: list[float] = []
    gaps: list[float] = []
    checked = 0
    for i in range(2600):
        if i:
            clock.advance(rng.choice([1.0, 2.0, 3.0, 5.0, 8.0]) * (
                1.0 if rng.random() < 0.5 else 1.0 + rng.random()))
            gaps.append(clock() - times[-1])      # as the policy sees it: clock differences
        times.append(clock())
        bm.allocate(i, [1, 2, 3], NS, session="s")
        bm.free(i)
        # request i >= 2 saw gap gaps[i-1] where the session's last gap forecast gaps[i-2]
        n = max(len(gaps) - 1, 0)
        if n >= 64 and n % 32 == 0:
            w = sorted(gaps[k] / gaps[k - 1] for k in range(max(1, n + 1 - 2048), n + 1))
            assert len(w) == min(n, 2048)
            assert pol.overdue == 1.5 * w[int(0.3 * (len(w) - 1))], n
            assert pol._sorted == w, n          # the whole window, not only its quantile
            checked += 1
    assert checked == (2598 - 64) // 32 + 1
    bm.check_invariants()


def test_bad_input_is_typed() -> None:
    bm = BlockManager.create(8, 2, policy="duel")
    with pytest.raises(InvalidRequestError):
        bm.allocate(1, [1, 2, 3], NS, session=[1])          # unhashable
    with pytest.raises(InvalidRequestError):
        bm.allocate(1, [1, 2, 3], NS, end_session="yes")    # not a bool
    with pytest.raises(InvalidRequestError):
        bm.end_session(None)
    with pytest.raises(InvalidRequestError):
        bm.end_session({})
    assert len(bm) == 0
    for bad in [dict(members=("lru",)), dict(members="lru"), dict(members=("lru", "duel")),
                dict(members=("lru", "nope")), dict(decay=1.0), dict(decay=True)]:
        with pytest.raises(ConfigError):
            make_policy("duel", **bad)
    with pytest.raises(ConfigError):
        ForecastPolicy(quantile=0)
    pol = make_policy("forecast")
    BlockManager.create(4, 2, policy=pol)
    with pytest.raises(ConfigError, match="belongs to one tree"):
        BlockManager.create(4, 2, policy=pol)


def test_plain_policies_hear_nothing() -> None:
    """LRU and the other key policies have no hooks: the tree and manager skip the seam."""
    for name, cls in POLICIES.items():
        pol = make_policy(name)
        assert pol.hooks == (name in ("fifo", "lfu-da", "lfu-ghost", "forecast", "duel")), name
    bm = BlockManager.create(8, 2, policy="lru")
    assert bm.tree.hooks is False
    bm.end_session("s")     # accepted, ignored


@pytest.mark.parametrize("policy", ["forecast", "duel"])
def test_a_resumed_request_is_not_another_turn(policy) -> None:
    """A preempted request allocated again (``resumed=True``: also its other samples, a retry
    after a failed load) is the same turn of its session: the forecast learns no gap from it."""
    clock = FakeClock(0.0)
    bm = BlockManager.create(32, 2, policy=policy, clock=clock)
    pol = bm.tree.policy
    fc = pol if policy == "forecast" else next(m for m in pol.members if m.name == "forecast")
    bm.allocate("r1", [1, 2, 3, 4], NS, session="s")
    bm.free("r1")                                   # preempted
    clock.advance(0.5)
    bm.allocate("r1", [1, 2, 3, 4], NS, session="s", resumed=True)
    bm.free("r1")
    assert (fc.requests, fc.followups, fc.mean_gap) == (1, 0, 0.0)
    clock.advance(10.0)
    bm.allocate("r2", [1, 2, 3, 4, 5, 6], NS, session="s")   # the session's next turn
    bm.free("r2")
    assert (fc.requests, fc.followups, fc.mean_gap) == (2, 1, 10.5)
    with pytest.raises(InvalidRequestError):
        bm.allocate("r3", [1], NS, resumed=1)
    bm.check_invariants()


def test_sampled_duel_replays_whole_sessions_in_smaller_shadows() -> None:
    """``DuelPolicy(sample=k)``: the shadows are 1/k of the device and see every turn of the
    sessions in the sample and none of the others; which ones is fixed (not ``hash()``)."""
    full = BlockManager.create(64, 2, policy=make_policy("duel"))
    bm = BlockManager.create(64, 2, policy=make_policy("duel", sample=4))
    pol = bm.tree.policy
    assert pol.name.endswith("/4")
    assert all(sh.pool.num_blocks == 16 for sh in pol._shadows)
    sampled = {s for s in range(40) if pol._bucket(s) == 0}
    assert 0 < len(sampled) < 40
    again = make_policy("duel", sample=4)
    assert {s for s in range(40) if again._bucket(s) == 0} == sampled
    seen = []
    for m in (full, bm):
        shadow = m.tree.policy._shadows[0]
        orig = shadow.allocate
        def spy(sid, toks, ns, *a, _o=orig, _seen=seen, _m=m, **k):
            if _m is bm:
                _seen.append(k.get("session"))
            return _o(sid, toks, ns, *a, **k)
        shadow.allocate = spy
        for j in range(40):
            for turn in range(2):
                rid = f"{j}-{turn}"
                m.allocate(rid, [j % 7, turn, 1, 2], NS, session=j)
                m.commit(rid, 4)
                m.free(rid)
        m.check_invariants()
    assert sorted(set(seen)) == sorted(sampled) and len(seen) == 2 * len(sampled)
    assert sum(full.tree.policy.shadow_hits) > 0
    for bad in (0, 2.0, True):
        with pytest.raises(ConfigError):
            make_policy("duel", sample=bad)


@pytest.mark.parametrize("device, shadow_blocks, sample", [
    (64, 64, 1), (127, 64, 1), (128, 64, 2), (255, 64, 2), (256, 64, 4), (64, 4, 16),
    (64, 2, 16), (64, 1000, 1)])
def test_auto_sample_keeps_each_shadow_at_least_shadow_blocks(device, shadow_blocks,
                                                              sample) -> None:
    """``sample="auto"`` (the default): the largest power of two, at most MAX_AUTO_SAMPLE,
    whose shadows still hold ``shadow_blocks`` blocks; chosen when bound, then as ``sample=k``
    (name, shadow size, decay per replay)."""
    from radixkv.core.policy_duel import MAX_AUTO_SAMPLE

    assert MAX_AUTO_SAMPLE == 16
    pol = BlockManager.create(device, 2, policy=make_policy(
        "duel", shadow_blocks=shadow_blocks)).tree.policy
    fixed = BlockManager.create(device, 2, policy=make_policy("duel", sample=sample)).tree.policy
    assert pol.sample == sample and pol.name == fixed.name
    assert [sh.pool.num_blocks for sh in pol._shadows] == [
        sh.pool.num_blocks for sh in fixed._shadows] == [device // sample] * 3
    assert pol._step_decay == fixed._step_decay == 0.99 ** sample


def test_auto_sample_is_the_duels_default_and_bad_options_are_refused() -> None:
    assert make_policy("duel").auto_sample
    assert BlockManager.create(64, 2, policy="duel").tree.policy.sample == 1
    for kw in ({"sample": "often"}, {"shadow_blocks": 0}, {"shadow_blocks": 8.0}):
        with pytest.raises(ConfigError):
            make_policy("duel", **kw)


def test_a_resumed_request_without_a_session_keeps_its_one_off_session() -> None:
    bm = BlockManager.create(32, 2, policy="forecast", clock=FakeClock(0.0))
    pol = bm.tree.policy
    bm.allocate("r1", [1, 2, 3, 4], NS)
    first = pol._seqs["r1"]
    bm.free("r1")
    bm.allocate("r1", [1, 2, 3, 4], NS, resumed=True)
    assert pol._seqs["r1"] == first and pol.requests == 1
    bm.free("r1")
    bm.allocate("r2", [1, 2, 3, 4], NS)
    assert pol._seqs["r2"] != first and pol.requests == 2


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "pop"]),
                              st.integers(0, 20), st.integers(0, 20), st.integers(0, 40)),
                    max_size=300),
       now=st.integers(0, 20))
def test_forecast_index_matches_its_definition(ops, now) -> None:
    """The forecast's index (two heaps with lazy deletion): ``min`` is the smallest entry if its
    ``due`` is past, else the smallest by ``(-far, entry)``; entries removed and added again
    (equal values, new tuples) count once; long runs rebuild the heaps."""
    pol = ForecastPolicy()
    pol.clock = lambda: now
    idx, model = ForecastIndex(pol), {}
    for op, due, far, h in ops:
        if op == "add" and bytes([h]) not in model:
            e = (float(due), -float(far), 0.0, bytes([h]))
            idx.add(e)
            model[e[-1]] = e
        elif op == "remove" and model:
            k = sorted(model)[due % len(model)]
            idx.remove(tuple(list(model.pop(k))))      # an equal tuple, not the one filed
        elif op == "pop" and model:
            first = min(model.values())
            want = first if first[0] < now else min(model.values(), key=lambda e: (e[1], e))
            assert idx.min() == want
            assert idx.pop_min() == want
            del model[want[-1]]
        assert len(idx) == len(model)
        assert all(e in idx for e in model.values())
        idx.check_invariants()
    assert list(idx) == sorted(model.values())
    with pytest.raises(ValueError):
        idx.remove((0.0, 0.0, 0.0, b"none"))
