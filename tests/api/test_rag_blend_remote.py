"""Blending from document entries that only the remote tier holds (a real ``redis-server``):
engine A computes the entries and leaves them on the server at close (its shutdown flush); a
fresh engine B on the same server and model id blends a prompt whose documents come in another
order from them, recomputing only the ``blend_ratio`` share, with the tokens of an engine that
computed the entries itself. Corrupt values are misses: B computes those entries instead.

B blends through the engine-level path (``blend_context``, what a request's ``documents``
field runs, e.g. from the server), not ``RAGHelper.ask``, whose ``warm_documents`` would first
fetch the entries by ordinary requests."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from radixkv import CacheConfig, SamplingParams
from radixkv.api.engine import Engine
from radixkv.config import EngineConfig
from radixkv.engine import blend

from .conftest import BLOCK_SIZE, make_tiny_vocab_model

pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402

DOCS = {d: " ".join(f"{d}{i} is fact number {i} of {d}." for i in range(12)) for d in "abc"}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
RATIO = 0.15
QUESTION = "Which fact comes first?"
ORDER = ["c", "a", "b"]


@pytest.fixture(scope="module")
def model4(smol_tokenizer):
    """Four layers: the blend selects at layer 1 and recomputes only the selected tokens on
    layers 2-3 (the shared two-layer model computes every token on both of its layers)."""
    return make_tiny_vocab_model(len(smol_tokenizer), num_layers=4)


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as srv:
        yield srv


def _engine(model, tokenizer, url=None):
    cc = CacheConfig(block_size=BLOCK_SIZE, num_device_blocks=256, remote_url=url,
                     remote_timeout_s=5.0)
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=1024, device="cpu",
                      max_model_len=4096)
    return Engine(model, tokenizer, cc, ec, model_id="tiny-llama-test")


def _rag(engine):
    rag = engine.rag(order="given", blend_ratio=RATIO)
    for k, v in DOCS.items():
        rag.add_document(k, v)
    return rag


def _entry_tokens(rag, docs):
    """Tokens of the full blocks of these documents' entries, their shared lead once."""
    lead = len(rag.document_entry_ids("a")) - rag.num_tokens("a")
    return lead + sum(rag.num_tokens(d) // BLOCK_SIZE * BLOCK_SIZE for d in docs)


def _blend_and_run(engine, rag):
    """Blend ``QUESTION`` over ``ORDER`` on the engine thread, then run it in the blend
    namespace (``Engine._blend`` + ``submit``, with the report kept); (report, answer tokens)."""
    ids = rag.prompt_ids(QUESTION, ORDER)
    spans = rag.document_spans(ORDER)
    core = engine.core
    rep = engine.loop.call(lambda: blend.blend_context(core, ids, spans, None, RATIO))
    assert rep is not None
    rid = engine.submit(ids, GREEDY, namespace_extra=rep.namespace_extra)
    return rep, list(engine.wait(rid).outputs[0].token_ids)


def _reference(model, tokenizer):
    """The answer of an engine that computes the entries itself (no remote tier)."""
    c = _engine(model, tokenizer)
    try:
        rag = _rag(c)
        assert rag.warm_documents() == len(DOCS)
        out = rag.ask(QUESTION, ORDER, GREEDY)
        assert out.blend is not None and out.blend.remote_tokens == 0
        assert out.blend.computed_entry_tokens == 0      # warmed: every entry was cached
        return out
    finally:
        c.close()


def _leave_entries_on_server(model, tokenizer, redis_srv):
    r = redis_srv.client()
    r.flushall()
    a = _engine(model, tokenizer, redis_srv.url)
    rag = _rag(a)
    assert rag.warm_documents() == len(DOCS)             # entries in order a, b, c
    a.close()                                            # the shutdown flush writes them
    assert r.dbsize() > 0
    return r


def test_a_fresh_engine_blends_entries_only_the_remote_tier_has(
        model4, smol_tokenizer, one_thread, redis_srv):
    ref = _reference(model4, smol_tokenizer)
    _leave_entries_on_server(model4, smol_tokenizer, redis_srv)
    b = _engine(model4, smol_tokenizer, redis_srv.url)
    try:
        rag = _rag(b)
        assert all(rag.cached_document_tokens(d) == 0 for d in DOCS)   # nothing local
        rep, tokens = _blend_and_run(b, rag)
        assert rep is not None and not rep.warm
        assert rep.computed_entry_tokens == 0                  # no entry was recomputed
        assert rep.remote_tokens == _entry_tokens(rag, DOCS)   # all of them came from Redis
        assert rep.prefix_tokens == 0
        assert rep.reused_tokens == sum(rag.num_tokens(d) // BLOCK_SIZE * BLOCK_SIZE for d in DOCS)
        # only the blend_ratio share of the reused document tokens was recomputed
        assert rep.recomputed_tokens == math.ceil(RATIO * rep.reused_tokens)
        assert b.stats()["remote"]["hit_tokens"] >= rep.remote_tokens
        assert tokens == ref.token_ids
        assert all(rag.cached_document_tokens(d) == rag.num_tokens(d) for d in DOCS)
        b.core.block_manager.check_invariants()
    finally:
        b.close(remote_flush_s=0)


def test_corrupt_remote_entries_are_computed_not_served(
        model4, smol_tokenizer, one_thread, redis_srv):
    ref = _reference(model4, smol_tokenizer)
    r = _leave_entries_on_server(model4, smol_tokenizer, redis_srv)
    for k in r.keys("*"):                                # flip one payload byte of every value
        v = bytearray(r.get(k))
        v[-1] ^= 0xFF
        r.set(k, bytes(v))
    b = _engine(model4, smol_tokenizer, redis_srv.url)
    try:
        rag = _rag(b)
        rep, tokens = _blend_and_run(b, rag)
        assert rep is not None and rep.remote_tokens == 0
        # every entry computed, each with its lead (one forward over all of them)
        assert rep.computed_entry_tokens == sum(
            len(rag.document_entry_ids(d)) // BLOCK_SIZE * BLOCK_SIZE for d in DOCS)
        assert tokens == ref.token_ids
        srv = b.stats()["remote"]["server"]
        assert srv["corrupt"] >= 1 and srv["deleted"] >= 1
    finally:
        b.close(remote_flush_s=0)


def test_every_entry_is_looked_up_in_one_round_of_the_server_and_verified(
        model4, smol_tokenizer, one_thread, redis_srv):
    """The blend asks the server for all its remote-only entries together
    (``RemoteLookup.fetch_now``): one EXISTS batch and one MGET whatever the number of entries
    (the server's own round-trip counter; one lookup per entry took two each), and every value
    is still verified: with one document's blocks corrupted, the other entries (and the shared
    lead) are installed, that document is computed, and the answer is unchanged."""
    from radixkv.core.hashing import hash_token_blocks
    from radixkv.engine.blend import document_namespace

    ref = _reference(model4, smol_tokenizer)
    for corrupt in (None, "b"):
        r = _leave_entries_on_server(model4, smol_tokenizer, redis_srv)
        b = _engine(model4, smol_tokenizer, redis_srv.url)
        try:
            rag = _rag(b)
            bad: list[bytes] = []
            if corrupt is not None:   # the document's own blocks, not the lead they share
                dns = document_namespace(b.namespace(None))
                lead = len(rag.document_entry_ids(corrupt)) - rag.num_tokens(corrupt)
                for h in hash_token_blocks(rag.document_entry_ids(corrupt), BLOCK_SIZE,
                                           dns)[lead // BLOCK_SIZE:]:
                    bad += r.keys(b"*" + h.hex().encode())
                assert bad
                for k in bad:
                    v = bytearray(r.get(k))
                    v[-1] ^= 0xFF
                    r.set(k, bytes(v))
            ids, spans = rag.prompt_ids(QUESTION, ORDER), rag.document_spans(ORDER)
            trips = b.stats()["remote"]["server"]["round_trips"]
            rep = b.loop.call(lambda: blend.blend_context(b.core, ids, spans, None, RATIO))
            srv = b.stats()["remote"]["server"]
            # EXISTS + MGET for three entries (+ one DELETE of the bad values when there are)
            assert srv["round_trips"] - trips == 2 + (corrupt is not None)
            assert rep is not None
            if corrupt is None:
                assert rep.remote_tokens == _entry_tokens(rag, DOCS)
                assert rep.computed_entry_tokens == 0
            else:
                assert srv["corrupt"] == len(bad)
                assert rep.remote_tokens == _entry_tokens(rag, [d for d in DOCS if d != corrupt])
                assert rep.computed_entry_tokens == \
                    rag.num_tokens(corrupt) // BLOCK_SIZE * BLOCK_SIZE
            rid = b.submit(ids, GREEDY, namespace_extra=rep.namespace_extra)
            assert list(b.wait(rid).outputs[0].token_ids) == ref.token_ids
            b.core.block_manager.check_invariants()
        finally:
            b.close(remote_flush_s=0)
