"""RAGHelper: canonical document layout, whole-block reuse, pinning."""

from __future__ import annotations

import pytest

from radixkv import InvalidRequestError, SamplingParams

from .conftest import BLOCK_SIZE

P4 = SamplingParams(max_tokens=4)
DOCS = {
    "a": "Alpha is the first letter of the Greek alphabet. " * 4,
    "b": "Bravo is the word for B in the NATO phonetic alphabet. " * 3,
    "c": "Charlie is a name and the NATO word for the letter C. " * 5,
}


def helper(engine, **kw):
    rag = engine.rag(**kw)
    for k, v in DOCS.items():
        rag.add_document(k, v)
    return rag


def test_layout_is_canonical_and_documents_are_tokenized_once(make_engine):
    rag = helper(make_engine())
    assert rag.layout(["c", "a", "b", "a"]) == ["a", "b", "c"]
    assert rag.prompt_ids("q?", ["b", "a"]) == rag.prompt_ids("q?", ["a", "b"])
    # aligned: head and every document segment are whole blocks
    d = rag.describe()
    assert d["head_tokens"] % BLOCK_SIZE == 0
    assert all(n % BLOCK_SIZE == 0 for n in d["documents"].values())
    with pytest.raises(InvalidRequestError):
        rag.layout(["zzz"])
    with pytest.raises(InvalidRequestError):
        rag.add_document("empty", "   ")


def test_same_documents_second_question_reuses_the_whole_prefix(make_engine):
    e = make_engine()
    rag = helper(e)
    prefix = len(rag.prefix_ids(["a", "b", "c"]))
    first = rag.ask("What is alpha?", ["c", "b", "a"], P4)
    second = rag.ask("What is charlie?", ["a", "b", "c"], P4)
    assert first.cached_tokens == 0 and first.doc_ids == ("a", "b", "c")
    assert second.cached_tokens >= prefix              # all documents, plus question blocks
    assert second.cached_tokens == (second.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE or \
        second.cached_tokens < second.prompt_tokens


@pytest.mark.parametrize("align", [True, False])
def test_reuse_across_subsets_sharing_a_leading_document(make_engine, align):
    """{a, b} then {a, c}: a's blocks are shared; {b, c} after them shares only the head.
    With alignment, a's last block is shared too (it holds no token of b or c)."""
    e = make_engine()
    rag = helper(e, align_blocks=align)
    head = len(rag.head_ids)
    a_end = head + len(rag.prefix_ids(["a"])) - head   # tokens up to the end of document a
    rag.ask("q1?", ["a", "b"], P4)
    ac = rag.ask("q2?", ["a", "c"], P4)
    bc = rag.ask("q3?", ["b", "c"], P4)
    if align:
        assert ac.cached_tokens == a_end               # head + all of a, exactly
    else:
        assert ac.cached_tokens == a_end // BLOCK_SIZE * BLOCK_SIZE
    assert bc.cached_tokens == head // BLOCK_SIZE * BLOCK_SIZE


def test_ask_many_shares_the_prefix_in_one_batch(make_engine):
    e = make_engine()
    rag = helper(e)
    rag.pin(["a", "b", "c"], priority=None, warm=True)   # compute the documents once
    answers = rag.ask_many(["q1?", "q2?", "q3?"], params=P4)
    prefix = len(rag.prefix_ids())
    assert all(a.cached_tokens >= prefix for a in answers)
    assert all(len(a.token_ids) == 4 for a in answers)


def test_pin_keeps_documents_cached_under_pressure(make_engine):
    e = make_engine(num_device_blocks=40, policy="priority")
    rag = helper(e)
    hinted = rag.pin(["a"], priority=5)
    assert hinted == len(rag.prefix_ids(["a"])) // BLOCK_SIZE
    nodes = e.cached_prefix_nodes(rag.prefix_ids(["a"]))
    assert all(e.core.tree.hints(n.block_hash).priority == 5 for n in nodes)
    for i in range(12):                                  # 48 blocks through a 40-block pool
        e.generate(list(range(7000 + 100 * i, 7070 + 100 * i)), P4)
    assert e.stats()["evictions"][0] > 0
    assert rag.cached_tokens(["a"]) == len(rag.prefix_ids(["a"]))


def test_priority_order_puts_pinned_documents_first(make_engine):
    e = make_engine()
    rag = helper(e, order="priority")
    assert rag.layout() == ["a", "b", "c"]
    rag.pin(["c"], priority=3, warm=False)
    assert rag.layout() == ["c", "a", "b"]
    # any question over a set containing c now starts with c's blocks
    rag.ask("q?", ["c", "a"], P4)
    assert rag.ask("q2?", ["b", "c"], P4).cached_tokens >= len(rag.prefix_ids(["c"]))


def test_rag_salt_isolates_tenants(make_engine):
    e = make_engine()
    r1, r2 = helper(e, cache_salt="t1"), helper(e, cache_salt="t2")
    r1.ask("q?", ["a"], P4)
    assert r2.ask("q?", ["a"], P4).cached_tokens == 0
    assert r1.ask("q2?", ["a"], P4).cached_tokens > 0
