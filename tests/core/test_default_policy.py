"""The default eviction policy (issue 30): one default everywhere, LRU (order and fast paths)
until a client sends a session-end hint, then the hinted policy, re-filing every node once."""

from __future__ import annotations

import inspect
import random

import hypothesis.strategies as st
import pytest
from core_helpers import FakeClock, snapshot_manager

from radixkv.config import CacheConfig
from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace
from radixkv.core.policy import LRUPolicy
from radixkv.core.policy_registry import AUTO_THEN, DEFAULT_POLICY, auto_policy, make_policy
from radixkv.core.policy_forecast import ForecastPolicy
from radixkv.core.tree import RadixTree
from radixkv.errors import ConfigError

NS = Namespace("m")


def test_one_default_everywhere() -> None:
    """``CacheConfig``, ``RadixTree`` and ``BlockManager.create`` default to the same policy."""
    assert CacheConfig().policy == DEFAULT_POLICY == "auto"
    assert inspect.signature(RadixTree.__init__).parameters["policy"].default == DEFAULT_POLICY
    assert inspect.signature(BlockManager.create).parameters["policy"].default == DEFAULT_POLICY
    tree = BlockManager.create(8, 2).tree
    assert tree.policy.name == "auto" and tree.policy.on_end_hint == AUTO_THEN
    # it *is* LRU to the tree: the same key, index and fast path, no hooks to call
    assert type(tree.policy) is LRUPolicy and tree._lru and not tree.hooks


def _stream(seed: int, n: int):
    """Chat-like requests: sessions going on turn after turn, with replies."""
    rng = random.Random(seed)
    hist: dict[int, list[int]] = {}
    for j in range(n):
        s = rng.randrange(5)
        prompt = hist.get(s, [s, s]) + [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        reply = [rng.randrange(3) for _ in range(rng.randint(0, 4))]
        hist[s] = prompt + reply
        if len(hist[s]) > 18:
            del hist[s]
        yield j, float(j), s, prompt, reply


def _serve(bm: BlockManager, clock: FakeClock, j, t, s, prompt, reply, end=False) -> int:
    clock.now = t
    a = bm.allocate(j, prompt, NS, session=s, end_session=end)
    bm.commit(j, len(prompt))
    if reply:
        bm.append_slots(j, reply)
        bm.commit(j, len(prompt) + len(reply))
    bm.free(j)
    return a.num_cached_tokens


@pytest.mark.parametrize("seed", range(4))
def test_auto_without_hints_is_lru_hit_for_hit(seed) -> None:
    """No hint, no switch: the same hits and the same cached blocks as LRU after every request
    (sessions alone are not a hint: a forecast told only sessions falls below LRU)."""
    clocks = FakeClock(0.0), FakeClock(0.0)
    auto = BlockManager.create(14, 2, policy="auto", clock=clocks[0])
    lru = BlockManager.create(14, 2, policy="lru", clock=clocks[1])
    for req in _stream(seed, 200):
        assert _serve(auto, clocks[0], *req) == _serve(lru, clocks[1], *req)
        assert _cached(auto) == _cached(lru)
    assert auto.tree.policy.name == "auto"
    auto.check_invariants()


def _warm(policy: str):
    """Three sessions cached in a 12-block device, s0 oldest; s2's last turn is just done."""
    clock = FakeClock(0.0)
    bm = BlockManager.create(12, 2, policy=policy, clock=clock)
    for j, s in enumerate((0, 1, 2)):
        _serve(bm, clock, j, float(j), s, [10 * s + 1, 10 * s + 2, 10 * s + 3, 10 * s + 4], [])
    return bm, clock


def _cached(bm: BlockManager) -> set[bytes]:
    return set(bm.tree.block_index())


def _victims(bm: BlockManager, k: int) -> set[bytes]:
    before = _cached(bm)
    bm.tree.evict(0, k)
    return before - _cached(bm)


def _hashes_of(bm: BlockManager, tokens: list[int]) -> set[bytes]:
    from radixkv.core.hashing import token_bytes

    return set(bm.tree.match_hashes(token_bytes(tokens), NS.seed, len(tokens) // 2))


def test_first_end_hint_switches_to_the_hinted_policy() -> None:
    """The first request that says its session ends hands eviction to ``forecast``: from then
    on the victims are the forecast's (the ended session's blocks first), where LRU's are the
    oldest session's."""
    bm, clock = _warm("auto")
    lru, lclock = _warm("lru")
    last_turn = [21, 22, 23, 24, 25, 26]
    for m, c in ((bm, clock), (lru, lclock)):
        assert type(m.tree.policy) is LRUPolicy
        _serve(m, c, 3, 3.0, 2, last_turn, [], end=True)      # s2's last request, hinted
    assert type(bm.tree.policy) is ForecastPolicy and bm.tree.hooks and not bm.tree._lru
    assert type(lru.tree.policy) is LRUPolicy                 # plain LRU never switches
    bm.check_invariants()
    ended = _hashes_of(bm, last_turn)
    assert len(ended) == 3
    assert _victims(bm, 3) == ended                            # the ended session first
    lru_victims = _victims(lru, 3)
    assert _hashes_of(lru, [1, 2, 3, 4]) == set() and not lru_victims & ended   # s0 went
    bm.check_invariants()


def test_end_session_call_switches_too() -> None:
    """``BlockManager.end_session`` is a hint as well: the tree switches, then the forecast
    hears the end (the session's blocks go first)."""
    bm, clock = _warm("auto")
    bm.end_session(2)
    assert type(bm.tree.policy) is ForecastPolicy
    bm.check_invariants()
    bm.end_session(1)                  # already switched: the forecast re-keys s1's chain
    assert type(bm.tree.policy) is ForecastPolicy
    bm.check_invariants()


def test_switch_with_slower_tiers_and_write_through_keeps_invariants() -> None:
    clock = FakeClock(0.0)
    bm = BlockManager.create(16, 2, policy="auto", lower_tier_blocks=(8, 8),
                             write_through=(1,), clock=clock)
    reqs = list(_stream(7, 120))
    for req in reqs[:60]:
        _serve(bm, clock, *req)
    j, t, s, prompt, reply = reqs[60]
    _serve(bm, clock, j, t, s, prompt, reply, end=True)
    assert type(bm.tree.policy) is ForecastPolicy
    bm.check_invariants()
    for req in reqs[61:]:
        _serve(bm, clock, *req)
        bm.check_invariants()


def test_bad_then_is_a_config_error() -> None:
    assert auto_policy("fifo").on_end_hint == "fifo"
    for bad in ("auto", "nope", "duel", "lfu-ghost", 3):
        with pytest.raises(ConfigError):
            make_policy("auto", then=bad)
    with pytest.raises(ConfigError):
        CacheConfig(policy="auto", policy_options={"then": "lfu"})


def test_switch_to_a_policy_that_cuts_runs_differently_changes_nothing() -> None:
    bm, _ = _warm("lru")
    tree = bm.tree
    before = snapshot_manager(bm)
    policy = tree.policy
    with pytest.raises(ConfigError, match="cuts runs differently"):
        tree.switch_policy("lfu")
    assert tree.policy is policy and tree._lru and snapshot_manager(bm) == before
    bm.check_invariants()


# ---------------------------------------------------------------------------------------------
# The tree state machine (test_tree_state.py) on the default policy: its per-block model orders
# by LRU until the first request that says its session ends, then starts a fresh forecast model
# (every cached block's state as if just cached at its last access, no session) and
# orders by it, so every eviction after the switch is checked against the forecast's order.

from hypothesis.stateful import initialize  # noqa: E402
from test_tree_state import TreeMachine  # noqa: E402
from tree_models import ForecastModel  # noqa: E402


class _SwitchOnEnd:
    """The machine's forecast model until the switch: the request rule calls ``start`` right
    after ``allocate``, which is where the block manager switches the tree."""

    def __init__(self, machine: AutoTreeMachine, inner: ForecastModel) -> None:
        self.machine, self.inner = machine, inner

    def start(self, session, end: bool, now: float) -> None:
        m = self.machine
        if end:
            m.switch()
            m.fm.start(session, end, now)
        else:
            self.inner.start(session, end, now)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class AutoTreeMachine(TreeMachine):
    num_tiers = 1
    write_through: tuple[int, ...] = ()
    _mode: str | None = None

    @property
    def policy(self) -> str:            # the order the model follows (``auto`` to build it)
        return self._mode or "auto"

    @property
    def name(self) -> str:
        wt = f", wt={list(self.write_through)}" if self.write_through else ""
        return f"tree[{self.num_tiers} tiers, auto{wt}]"

    @initialize(caps=st.tuples(st.integers(3, 8), st.integers(1, 4), st.integers(1, 4)))
    def setup(self, caps) -> None:
        super().setup(caps)
        assert type(self.bm.tree.policy) is LRUPolicy and self.bm.tree.policy.name == "auto"
        self._mode = "lru"
        self.fm = _SwitchOnEnd(self, self.fm)

    def switch(self) -> None:
        assert type(self.bm.tree.policy) is ForecastPolicy, "the first end hint must switch"
        self._mode = "forecast"
        self.fm = ForecastModel()
        for b in self.m.values():
            b.gap, b.owner = 0.0, None
            self.fm.snapshot(b)


def _auto_machine(tiers: int, wt: tuple[int, ...] = ()):
    return type(f"AutoTree{tiers}{''.join(map(str, wt))}", (AutoTreeMachine,),
                {"num_tiers": tiers, "write_through": wt}).TestCase


TestAutoTree1Tier = _auto_machine(1)
TestAutoTree3Tier = _auto_machine(3)
TestAutoTree3TierWT12 = _auto_machine(3, (1, 2))
