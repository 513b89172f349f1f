"""The eviction indexes against a plain sorted list: every add, remove and pop_min in any order
(entries arriving in order, out of order, re-added after removal, duplicates of dead entries)
gives the same minimum, the same length and the same iteration order. As in the tree, an index
holds at most one entry per block hash (the entry's last field) at a time."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from radixkv.core.evict_index import FrequencyIndex, RecencyIndex, SortedIndex

OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add", "remove", "pop"]),
                         st.integers(0, 40), st.integers(0, 15)), max_size=200)


@pytest.mark.parametrize("cls", [RecencyIndex, SortedIndex, FrequencyIndex])
@given(ops=OPS)
def test_index_matches_a_sorted_list(cls, ops) -> None:
    idx, model = cls(), []
    clock = 0
    for op, t, h in ops:
        if op == "add":
            # mostly increasing times (a release), sometimes an old one (a parent made a leaf)
            clock += 1
            e = (clock if t % 3 else t, bytes([h]))
            if cls is FrequencyIndex:
                e = (t % 4, *e)            # (hits, last_access, hash)
            if any(m[-1] == e[-1] for m in model):
                continue               # one entry per block hash, as the tree files them
            idx.add(e)
            model.append(e)
        elif op == "remove" and model:
            e = model[t % len(model)]
            idx.remove(e)
            model.remove(e)
        elif op == "pop" and model:
            model.sort()
            assert idx.min() == model[0]
            if cls is RecencyIndex and h % 2:
                # the device-only LRU loop's pop with a peek at the next entry
                assert idx.pop_min_peek() == (model.pop(0), model[0] if model else None)
            else:
                assert idx.pop_min() == model.pop(0)
        model.sort()
        assert len(idx) == len(model)
        if hasattr(idx, "check_invariants"):
            idx.check_invariants()
    assert list(idx) == sorted(model)
    assert all(e in idx for e in model)
    if model:
        return
    for pop in (idx.pop_min, idx.min) + ((idx.pop_min_peek,) if cls is RecencyIndex else ()):
        with pytest.raises(IndexError):   # EvictableSet.take relies on min() raising this
            pop()


def test_recency_index_reuses_a_removed_entry() -> None:
    """An entry removed (lazily) and added again is live once, not twice."""
    idx = RecencyIndex()
    idx.add((1.0, b"a"))
    idx.add((2.0, b"b"))
    idx.remove((1.0, b"a"))
    idx.add((3.0, b"c"))
    idx.add((1.0, b"a"))          # before the head: at the front again
    assert [idx.pop_min() for _ in range(3)] == [(1.0, b"a"), (2.0, b"b"), (3.0, b"c")]
    assert len(idx) == 0 and list(idx) == []


@given(ops=st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "pop"]),
                              st.integers(0, 60), st.integers(0, 63)), max_size=400))
def test_frequency_index_with_many_counts(ops) -> None:
    """lfu-ghost spreads entries over many counts, so buckets open and close all the time:
    the heap of counts (stale counts dropped lazily, rebuilt when they pile up) and the reused
    empty buckets keep exactly the sorted order."""
    idx, model = FrequencyIndex(), {}
    clock = 0
    for op, t, h in ops:
        if op == "add" and bytes([h]) not in model:
            clock += 1
            e = (t % 37, clock if t % 5 else t, bytes([h]))
            idx.add(e)
            model[e[-1]] = e
        elif op == "remove" and model:
            k = sorted(model)[t % len(model)]
            idx.remove(tuple(list(model.pop(k))))
        elif op == "pop" and model:
            want = min(model.values())
            assert idx.min() == want
            assert idx.pop_min() == want
            del model[want[-1]]
        assert len(idx) == len(model)
        idx.check_invariants()
    assert list(idx) == sorted(model.values())
    with pytest.raises((IndexError, KeyError, ValueError)):
        idx.remove((99, 0, b"none"))
    for _ in range(len(model)):
        idx.pop_min()
    with pytest.raises(IndexError):
        idx.pop_min()
