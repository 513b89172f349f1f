"""Closing an engine writes what its remote tier lacks (issue 33, item 2): with the default
write-back policy an engine whose memory never filled writes nothing while it runs, so without
the flush at close the engine that replaces it (a rolling restart) would find nothing. A real
``redis-server``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from radixkv import CacheConfig
from radixkv.api.engine import Engine
from radixkv.config import EngineConfig
from radixkv.errors import ConfigError, EngineClosedError

from .conftest import BLOCK_SIZE

pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402

PROMPT = list(range(2000, 2000 + 6 * BLOCK_SIZE + 5))
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as srv:
        yield srv


def _engine(model, tokenizer, url, **cc):
    cfg = CacheConfig(block_size=BLOCK_SIZE, num_device_blocks=64, host_blocks=32,
                      remote_url=url, remote_timeout_s=2.0, **cc)
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=1024, device="cpu",
                      max_model_len=1024)
    return Engine(model, tokenizer, cfg, ec, model_id="tiny-llama-test")


@pytest.mark.parametrize("flush_s", [5.0, 0.0])
def test_a_closed_engine_leaves_its_cache_to_the_next(tiny_model_shared, smol_tokenizer,
                                                      one_thread, redis_srv, flush_s) -> None:
    r = redis_srv.client()
    r.flushall()
    a = _engine(tiny_model_shared, smol_tokenizer, redis_srv.url,
                remote_shutdown_flush_s=flush_s)
    first = a.generate([PROMPT], GREEDY)[0]
    a.generate([PROMPT[:3 * BLOCK_SIZE] + [7] * 40], GREEDY)   # a branch off the same prefix
    a.core.remote_tier.store.flush(5.0)
    assert r.dbsize() == 0            # write-back: nothing left the host tier
    report = a.close()
    assert a.close() is None          # idempotent, and nothing more is written
    b = _engine(tiny_model_shared, smol_tokenizer, redis_srv.url)
    try:
        again = b.generate([PROMPT], GREEDY)[0]
    finally:
        b.close(remote_flush_s=0)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    if not flush_s:
        assert report is None and r.dbsize() == 0 and again.num_cached_tokens == 0
        return
    # every full block of both sequences, the 3 shared ones once: 6 + (88 + 6) // 16 - 3
    assert report["written"] == r.dbsize() == 6 + 2 and report["left"] == 0
    assert again.num_cached_tokens == 6 * BLOCK_SIZE
    assert again.cached_tokens_per_tier[-1] == 6 * BLOCK_SIZE          # all from "remote"


def test_flush_writes_only_what_the_server_lacks_and_keeps_the_deadline(
        tiny_model_shared, smol_tokenizer, one_thread, redis_srv) -> None:
    r = redis_srv.client()
    r.flushall()
    a = _engine(tiny_model_shared, smol_tokenizer, redis_srv.url, remote_write="write_through")
    try:
        a.generate([PROMPT], GREEDY)
        a.core.remote_tier.store.flush(5.0)
        n = r.dbsize()
        assert n >= 6
        a.loop.stop()
        report = a.core.flush_remote(5.0)
        assert report["written"] == 0 and report["present"] == n
        r.flushall()
        report = a.core.flush_remote(1e-9)   # past its deadline before the first round
        assert report["written"] == 0 and report["left"] == n and r.dbsize() == 0
    finally:
        a.close(remote_flush_s=0)
    for bad in (-1.0, float("nan"), True):
        with pytest.raises(ConfigError, match="remote_shutdown_flush_s"):
            CacheConfig(remote_shutdown_flush_s=bad)


def test_a_fleet_replica_flushes_at_its_graceful_shutdown(tiny_model_shared, smol_tokenizer,
                                                          one_thread, redis_srv) -> None:
    """Ray Serve calls a replica's ``__del__`` at a graceful shutdown (``serve.shutdown()``,
    a scale-down, a rolling update): it closes the engine, so the remote flush happens in a
    fleet as in ``radixkv serve``. The replica outside Serve (``EngineReplica.from_engine``)."""
    from radixkv.fleet.replica import EngineReplica

    r = redis_srv.client()
    r.flushall()
    replica = EngineReplica.from_engine(_engine(tiny_model_shared, smol_tokenizer,
                                                redis_srv.url), "r0")
    replica.engine.generate([PROMPT], GREEDY)
    st = replica.stats()
    assert st["kv_blocks_stored"][0] >= 6 and r.dbsize() == 0   # write-back: nothing yet
    replica.__del__()   # what Serve calls
    assert r.dbsize() == 6                                  # the prompt's full blocks
    assert replica.close() is None                          # idempotent
    with pytest.raises(EngineClosedError):
        replica.engine.generate([PROMPT], GREEDY)
