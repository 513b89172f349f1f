"""RAGHelper with blending: document entries in the tree, blended prompts, tenants, fallbacks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv import InvalidRequestError, SamplingParams
from radixkv.core.hashing import token_bytes
from radixkv.engine import blend

from .conftest import BLOCK_SIZE

P4 = SamplingParams(max_tokens=4)
DOCS = {d: " ".join(f"{d}{i} is fact number {i} of {d}." for i in range(12)) for d in "abcd"}
_SLOW_FIXTURES = settings(max_examples=5, deadline=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture])


def helper(engine, **kw):
    rag = engine.rag(order="given", **kw)
    for k, v in DOCS.items():
        rag.add_document(k, v)
    return rag


def doc_blocks(rag, doc_id):
    """The cached blocks of a document's entry (BlockRefs), read on the engine thread."""
    ns = blend.document_namespace(rag.engine.namespace(rag.cache_salt))
    ids = rag.document_entry_ids(doc_id)
    tree = rag.engine.core.tree
    return rag.engine.loop.call(lambda: tree.match_tokens(token_bytes(ids), ns.seed))


@_SLOW_FIXTURES
@given(order=st.permutations("abcd"))
def test_blend_ratio_one_is_exactly_a_full_prefill(make_engine, order):
    e = make_engine()
    full = helper(e, cache_salt="full").ask("Which is first?", order, P4)
    rag = helper(e, cache_salt="blend", blend_ratio=1.0)
    rag.warm_documents()
    got = rag.ask("Which is first?", order, P4)
    assert got.blend is None                     # ratio 1: the ordinary request ran
    assert got.token_ids == full.token_ids


@_SLOW_FIXTURES
@given(asks=st.lists(st.lists(st.sampled_from("abcd"), min_size=1, max_size=4, unique=True),
                     min_size=1, max_size=4))
def test_a_document_entry_is_shared_by_every_prompt_and_held_only_while_used(make_engine, asks):
    e = make_engine()
    rag = helper(e, blend_ratio=0.15)
    seen: set[str] = set()
    entries: dict[str, list[bytes]] = {}
    for ids in asks:
        before = e.core.tree.stats.inserted
        ans = rag.ask("What is fact 3?", ids, P4)
        new_docs = [d for d in ids if d not in seen]
        seen |= set(ids)
        lead = len(rag.head_ids) // BLOCK_SIZE
        for d in ids:
            blocks = doc_blocks(rag, d)
            # one entry per document (after the head), whatever prompt it came in
            assert len(blocks) * BLOCK_SIZE == len(rag.head_ids) + rag.num_tokens(d)
            assert rag.cached_document_tokens(d) == rag.num_tokens(d)
            hashes = [b.block_hash for b in blocks[lead:]]
            assert entries.setdefault(d, hashes) == hashes
            # no prompt holds it once answered: evictable like any unreferenced block
            assert all(e.core.block_manager.block_refcount(b.block_id) == 0 for b in blocks)
        if not new_docs:   # every entry was cached: nothing recomputed
            assert rag.warm_documents(ids) == 0
        assert e.core.tree.stats.inserted >= before
        if ans.blend is not None and not ans.blend.warm:
            assert ans.blend.num_blended_tokens <= ans.prompt_tokens
            assert 0 < ans.blend.reused_tokens <= sum(rag.num_tokens(d) for d in ids)
    e.core.block_manager.check_invariants()
    # different documents, different entries
    all_hashes = [h for hs in entries.values() for h in hs]
    assert len(all_hashes) == len(set(all_hashes))


def test_entries_are_held_during_the_blend_and_evicted_when_space_is_needed(make_engine):
    e = make_engine(num_device_blocks=96)
    rag = helper(e, blend_ratio=0.15)
    rag.ask("q?", ["a", "b"], P4)
    held = []
    real_allocate = e.core.block_manager.allocate

    def spy(seq_id, *a, **kw):
        alloc = real_allocate(seq_id, *a, **kw)
        if isinstance(seq_id, tuple) and seq_id[1] == "doc":
            held.append([e.core.block_manager.block_refcount(b)
                         for b in alloc.block_ids[:alloc.num_cached_tokens // BLOCK_SIZE]])
        return alloc
    e.core.block_manager.allocate = spy
    try:
        out = rag.ask("q2?", ["b", "a"], P4)
    finally:
        del e.core.block_manager.allocate
    assert out.blend is not None and out.blend.reused_tokens > 0
    assert held and all(r and min(r) >= 1 for r in held)    # locked while read
    assert all(e.core.block_manager.block_refcount(b.block_id) == 0 for b in doc_blocks(rag, "a"))
    # other work needs the space: the unreferenced entries go like any cached block
    other = helper(e, cache_salt="other", blend_ratio=None)
    for i in range(6):
        other.add_document(f"x{i}", f"filler text {i} to take the pool. " * 60)
        other.ask("q?", [f"x{i}"], P4)
    assert len(doc_blocks(rag, "a")) * BLOCK_SIZE < len(rag.document_entry_ids("a"))
    e.core.block_manager.check_invariants()


@_SLOW_FIXTURES
@given(salts=st.lists(st.text(min_size=1, max_size=6), min_size=2, max_size=2, unique=True))
def test_tenants_never_share_documents(make_engine, salts):
    e = make_engine()
    a = helper(e, cache_salt=salts[0], blend_ratio=0.15)
    b = helper(e, cache_salt=salts[1], blend_ratio=0.15)
    a.ask("q?", ["a", "b"], P4)
    assert a.cached_document_tokens("a") == a.num_tokens("a")
    assert b.cached_document_tokens("a") == 0            # same tokens, other tenant: a miss
    assert b.warm_documents(["a"]) == 1                   # computed again, for b
    ha = {x.block_hash for x in doc_blocks(a, "a")}
    hb = {x.block_hash for x in doc_blocks(b, "a")}
    assert len(ha) * BLOCK_SIZE == len(a.document_entry_ids("a"))
    assert ha and hb and ha.isdisjoint(hb)
    # nor do document entries ever match a prefix chain of the same tokens
    plain = e.cached_prefix_nodes(a.document_entry_ids("a"), cache_salt=salts[0])
    assert {x.block_hash for x in plain}.isdisjoint(ha)


def test_blended_prompt_is_cached_whole_and_reused_warm(make_engine):
    e = make_engine()
    rag = helper(e, blend_ratio=0.15)
    rag.ask("q?", ["a", "b", "c", "d"], P4)          # entries cached, this order blended
    cold = rag.ask("q?", ["d", "b", "a", "c"], P4)  # all cached, in another order
    warm = rag.ask("q?", ["d", "b", "a", "c"], P4)
    assert cold.blend is not None and not cold.blend.warm
    assert cold.blend.reused_tokens >= sum(rag.num_tokens(d) for d in "bac")
    assert cold.cached_tokens == cold.blend.num_blended_tokens
    assert warm.blend is not None and warm.blend.warm
    assert warm.token_ids == cold.token_ids


def test_blending_runs_on_quantized_kv_and_ratio_one_is_a_full_prefill(
        smol_tokenizer, tiny_model_shared, one_thread):
    from radixkv import CacheConfig
    from radixkv.api.engine import Engine
    from radixkv.config import EngineConfig

    e = Engine(tiny_model_shared, smol_tokenizer,
               CacheConfig(block_size=BLOCK_SIZE, num_device_blocks=256, kv_dtype="int8"),
               EngineConfig(device="cpu", max_model_len=4096), model_id="tiny-int8")
    try:
        ref = helper(e, cache_salt="ref").ask("q?", ["c", "a"], P4)
        rag = helper(e, cache_salt="blend", blend_ratio=0.15)
        rag.warm_documents()
        got = rag.ask("q?", ["c", "a"], P4)
        assert got.blend is not None and got.blend.reused_tokens >= rag.num_tokens("a") - 16
        one = helper(e, cache_salt="one", blend_ratio=1.0).ask("q?", ["c", "a"], P4)
        assert one.blend is None and one.token_ids == ref.token_ids
    finally:
        e.close()


def test_bad_blend_settings_are_rejected(make_engine):
    e = make_engine()
    for bad in (-1, 2, "x"):
        with pytest.raises(InvalidRequestError):
            e.rag(blend_ratio=bad)
    with pytest.raises(InvalidRequestError):
        e.rag(order="random")
    with pytest.raises(InvalidRequestError):
        e.submit([1, 2, 3], P4, namespace_extra="")


def test_a_document_listed_twice_is_one_entry_and_blends(make_engine):
    e = make_engine()
    rag = helper(e, blend_ratio=0.15)
    rag.add_document("a2", DOCS["a"])   # same text, other id: differs only in its header line
    spans_doc = rag.document_entry_ids("a")
    out = rag.ask("q?", ["b", "a", "c", "a2"], P4)
    assert out.blend is not None and out.blend.reused_tokens >= 2 * rag.num_tokens("a") - 64
    assert len(doc_blocks(rag, "a")) * BLOCK_SIZE == len(spans_doc)
    e.core.block_manager.check_invariants()
    # the engine-level path: the same document's tokens twice in one prompt
    ids = rag.prompt_ids("q?", ["b", "a"])
    sp = rag.document_spans(["b", "a"])
    doc_a = ids[sp[1].start:sp[1].end]
    twice = ids[:sp[1].end] + doc_a + ids[sp[1].end:]
    spans = [(s.start, s.end) for s in sp] + [(sp[1].end, sp[1].end + len(doc_a))]
    core = e.core
    rep = e.loop.call(lambda: blend.blend_context(core, twice, blend.check_spans(spans,
                                                                               len(twice)),
                                                  None, 0.15))
    assert rep is not None and rep.reused_tokens >= 2 * len(doc_a) - BLOCK_SIZE
    e.core.block_manager.check_invariants()


def test_engine_config_blend_ratio_is_the_default_of_requests_with_documents(make_engine):
    from radixkv import ConfigError
    from radixkv.config import EngineConfig

    for bad in (-0.5, 1.5, True, "0.1"):
        with pytest.raises(ConfigError):
            EngineConfig(blend_ratio=bad)
    e = make_engine(blend_ratio=0.3)
    rag = helper(e)
    ids = rag.prompt_ids("q?", ["c", "a"])
    spans = [(s.start, s.end) for s in rag.document_spans(["c", "a"])]
    rid = e.submit(ids, P4)   # nothing cached: the request computes the prefix
    e.wait(rid)
    core = e.core
    e.loop.call(lambda: core.add_request("with-docs", ids, P4, cache_salt="s2",
                                         documents=spans))
    while core.has_unfinished_requests():
        e.loop.call(lambda: None)
    want = blend.blend_extra(blend.check_spans(spans, len(ids)), 0.3, blend.DEFAULT_CHECK_LAYER)
    ns = blend.blend_namespace(e.namespace("s2"), want)
    assert e.loop.call(lambda: core.tree.match_tokens(token_bytes(ids), ns.seed))
    with pytest.raises(InvalidRequestError):
        e.loop.call(lambda: core.add_request("bad", ids, P4, documents=[(5, 3)]))


@pytest.mark.parametrize("spans", [[(3, 25), (25, 35)], [(0, 5), (5, 40)], [(20, 30)]])
def test_documents_shorter_than_a_block_blend_without_error(make_engine, spans):
    """A document with no whole block of its own after the lead (here 10 or 5 tokens, blocks
    of 16) has nothing to reuse: it is computed like the text around it, the others blend, and
    ratio 1 answers as the same prompt without documents."""
    e = make_engine()
    ids = [(7 * i + 3) % 200 + 5 for i in range(60)]
    outs = {}
    for rid, salt, docs, ratio in (("plain", "p", None, None), ("first", "s", spans, 0.15),
                                   ("again", "s", spans, 0.15), ("full", "f", spans, 1.0)):
        stream = e.loop.submit(rid, ids, P4, salt, None, documents=docs, blend_ratio=ratio)
        out = stream.get(timeout=120)
        while not out.finished:
            out = stream.get(timeout=120)
        outs[rid] = out.outputs[0].token_ids
    assert set(outs) == {"plain", "first", "again", "full"}
    assert outs["full"] == outs["plain"]
    e.core.block_manager.check_invariants()
