"""Pinning RAG documents across replicas: ``RAGHelper.pin(persist=True)`` writes the documents'
prefix to the shared remote tier at once (a real ``redis-server``), with the pin's TTL on the
keys, so a second engine on the same server starts with them cached; without ``persist`` a
write-back engine writes nothing while its memory is not full."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixkv import CacheConfig, SamplingParams
from radixkv.api.engine import Engine
from radixkv.config import EngineConfig

from .conftest import BLOCK_SIZE

pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402

DOCS = {"a": "Alpha is the first letter of the Greek alphabet. " * 6,
        "b": "Bravo is the word for B in the NATO phonetic alphabet. " * 5}


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as srv:
        yield srv


def _engine(model, tokenizer, url):
    cc = CacheConfig(block_size=BLOCK_SIZE, num_device_blocks=256, remote_url=url,
                     remote_ttl_s=60, remote_timeout_s=2.0)
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=1024, device="cpu",
                      max_model_len=4096)
    return Engine(model, tokenizer, cc, ec, model_id="tiny-llama-test")


def _rag(engine):
    rag = engine.rag()
    for k, v in DOCS.items():
        rag.add_document(k, v)
    return rag


def test_pinned_documents_reach_a_second_engine(tiny_model_shared, smol_tokenizer, one_thread,
                                                redis_srv):
    r = redis_srv.client()
    r.flushall()
    a = _engine(tiny_model_shared, smol_tokenizer, redis_srv.url)
    try:
        rag = _rag(a)
        rag.pin(["b"], priority=None, ttl=3600)            # not persisted: nothing written
        a.core.remote_tier.store.flush(5.0)
        assert r.dbsize() == 0
        n = rag.pin(["a"], priority=None, ttl=3600, persist=True)
        assert n == len(rag.prefix_ids(["a"])) // BLOCK_SIZE > 0
        a.core.remote_tier.store.flush(5.0)
        keys = r.keys("*")
        assert len(keys) == n and all(3_500_000 < r.pttl(k) <= 3_600_000 for k in keys)
        assert a.stats()["remote"]["blocks_persisted"] == n
    finally:
        a.close()
    b = _engine(tiny_model_shared, smol_tokenizer, redis_srv.url)
    try:
        out = _rag(b).ask("Which letter?", ["a"], SamplingParams(max_tokens=2))
        assert out.cached_tokens >= n * BLOCK_SIZE
        assert b.stats()["remote"]["hit_tokens"] >= n * BLOCK_SIZE
    finally:
        b.close()
