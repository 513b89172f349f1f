"""Model-based test of BlockPool: the real pool beside a naive model (a set and a Counter).

Rules allocate/free blocks, take and drop references the way the tree and block manager do
(``ref_counts[b] += 1``; the pool has no incref/decref methods), and try every way of misusing
the pool (invalid ids, double free, freeing a referenced block, over-allocation, duplicates in
one free call). Each misuse must raise the documented typed error and leave the pool exactly as
it was (free list order included).
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from core_helpers import STEPS, assert_unchanged, snapshot_pool
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.core.pool import BlockPool
from radixkv.errors import ConfigError, InvalidBlockError, OutOfBlocks, RadixKVError

BAD_IDS = st.one_of(st.integers(-5, -1), st.integers(64, 200), st.sampled_from(
    [None, "0", 1.0, True, False, (0,), 2**70]))


class PoolMachine(RuleBasedStateMachine):
    """BlockPool vs. model: ``allocated`` (set of held ids) and ``refs`` (Counter)."""

    @initialize(n=st.integers(1, 12))
    def setup(self, n: int) -> None:
        STEPS.program("pool")
        self.pool = BlockPool(n)
        self.n = n
        self.allocated: set[int] = set()
        self.refs: Counter[int] = Counter()

    def _raises(self, exc: type[RadixKVError], fn, *args) -> RadixKVError:
        before = snapshot_pool(self.pool)
        with pytest.raises(exc) as info:
            fn(*args)
        assert_unchanged(before, snapshot_pool(self.pool), f"{fn.__name__}{args!r}")
        assert isinstance(info.value, RadixKVError) and str(info.value)
        return info.value

    @rule(k=st.integers(0, 14))
    def allocate(self, k: int) -> None:
        STEPS.step("pool")
        free = self.n - len(self.allocated)
        if k > free:
            err = self._raises(OutOfBlocks, self.pool.allocate, k)
            assert (err.needed, err.free) == (k, free)
            return
        got = self.pool.allocate(k)
        assert len(got) == len(set(got)) == k
        assert not (set(got) & self.allocated), (
            f"handed out held blocks {set(got) & self.allocated}")
        assert all(0 <= b < self.n and self.refs[b] == 0 for b in got)
        self.allocated |= set(got)

    @rule()
    def allocate_one(self) -> None:
        STEPS.step("pool")
        if len(self.allocated) == self.n:
            self._raises(OutOfBlocks, self.pool.allocate_one)
            return
        b = self.pool.allocate_one()
        assert b not in self.allocated and 0 <= b < self.n
        self.allocated.add(b)

    @rule(k=st.integers(-3, -1))
    def allocate_negative(self, k: int) -> None:
        STEPS.step("pool")
        self._raises(InvalidBlockError, self.pool.allocate, k)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def incref(self, data) -> None:
        STEPS.step("pool")
        b = data.draw(st.sampled_from(sorted(self.allocated)))
        self.pool.ref_counts[b] += 1
        self.refs[b] += 1

    @precondition(lambda self: +self.refs)
    @rule(data=st.data())
    def decref(self, data) -> None:
        STEPS.step("pool")
        b = data.draw(st.sampled_from(sorted(+self.refs)))
        self.pool.ref_counts[b] -= 1
        self.refs[b] -= 1

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def free(self, data) -> None:
        STEPS.step("pool")
        unref = sorted(b for b in self.allocated if self.refs[b] == 0)
        ids = data.draw(st.lists(st.sampled_from(sorted(self.allocated)), max_size=4, unique=True))
        if any(self.refs[b] for b in ids):
            err = self._raises(InvalidBlockError, self.pool.free, ids)
            assert "reference" in str(err)
            return
        del unref
        self.pool.free(ids)
        self.allocated -= set(ids)

    @rule(data=st.data())
    def double_free(self, data) -> None:
        STEPS.step("pool")
        free_ids = sorted(set(range(self.n)) - self.allocated)
        if not free_ids:
            return
        b = data.draw(st.sampled_from(free_ids))
        # a valid free beside the bad one must not be applied either (all-or-nothing)
        ok = [x for x in self.allocated if self.refs[x] == 0][:1]
        err = self._raises(InvalidBlockError, self.pool.free, ok + [b])
        assert "double free" in str(err)

    @precondition(lambda self: any(self.refs[b] == 0 for b in self.allocated))
    @rule(data=st.data())
    def free_duplicate_in_one_call(self, data) -> None:
        STEPS.step("pool")
        b = data.draw(st.sampled_from(sorted(b for b in self.allocated if self.refs[b] == 0)))
        self._raises(InvalidBlockError, self.pool.free, [b, b])

    @rule(bad=BAD_IDS)
    def bad_id(self, bad) -> None:
        STEPS.step("pool")
        if isinstance(bad, int) and not isinstance(bad, bool) and 0 <= bad < self.n:
            return
        err = self._raises(InvalidBlockError, self.pool.free, [bad])
        assert "outside" in str(err)
        self._raises(InvalidBlockError, self.pool.is_free, bad)

    @invariant()
    def agrees_with_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free == self.n - len(self.allocated)
        for b in range(self.n):
            assert self.pool.is_free(b) == (b not in self.allocated), b
            assert self.pool.ref_counts[b] == self.refs[b], b


TestPoolMachine = PoolMachine.TestCase


@pytest.mark.parametrize("n", [0, -1, 1.5, True, None, "4"])
def test_impossible_capacity(n) -> None:
    with pytest.raises(ConfigError, match="positive integer"):
        BlockPool(n)
