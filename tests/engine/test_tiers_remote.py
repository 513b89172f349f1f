"""The remote tier inside the engine, against a real ``redis-server`` (issue 12, part 2).

* two engines sharing one server: the second engine's first request on the first engine's
  conversation is served from the remote tier (counted as ``remote``) and its greedy output
  equals transformers';
* write-back: blocks leaving the host tier are written; write-through: at once;
* another tenant (cache salt) or another model gets a miss, never the other's blocks;
* a server that is down at start, or killed mid-run, costs misses only: the engine starts,
  requests finish with the right output, nothing hangs past the bounded timeout.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import pytest

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402
from tiers_helpers import BS, check_tiers, hf_greedy, rand_tokens, serve  # noqa: E402


@pytest.fixture(scope="module")
def hf_llama(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as srv:
        yield srv


@pytest.fixture
def url(redis_srv) -> str:
    redis_srv.client().flushall()
    return redis_srv.url


def remote_engine(hf, url, device=16, host=8, model_id="tiny", **kw) -> LLMEngine:
    return LLMEngine(copy.deepcopy(hf), None,
                     CacheConfig(block_size=BS, num_device_blocks=device, host_blocks=host,
                                 remote_url=url, remote_timeout_s=2.0, **kw),
                     EngineConfig(max_num_seqs=4, max_num_batched_tokens=128),
                     model_id=model_id)


def _flush(eng: LLMEngine) -> None:
    eng._remote.store.flush(5.0)


def test_second_engine_is_served_by_what_the_first_wrote_through(hf_llama, url):
    prompt = rand_tokens(33, 1)                 # 8 full blocks + 1 token
    a = remote_engine(hf_llama, url, remote_write="write_through")
    out_a = serve(a, [("a1", prompt)])["a1"]
    _flush(a)
    assert a.stats()["remote"]["blocks_written"] >= 8
    b = remote_engine(hf_llama, url)
    out_b = serve(b, [("b1", prompt)])["b1"]
    assert out_b.num_cached_tokens == 8 * BS
    assert dict(zip(b.output_tier_names, out_b.cached_tokens_per_tier))["remote"] == 8 * BS
    assert out_b.outputs[0].token_ids == out_a.outputs[0].token_ids == hf_greedy(hf_llama, prompt)
    st = b.stats()["remote"]
    assert st["blocks_installed"] == 8 and st["hit_tokens"] == 8 * BS
    assert st["server"]["round_trips"] <= 3   # EXISTS batch + MGET batch (+ nothing per block)
    a.close(), b.close()


def test_write_back_writes_blocks_as_they_leave_the_host_tier(hf_llama, url):
    a = remote_engine(hf_llama, url, device=12, host=4)   # default: write_back
    convs = [rand_tokens(25, 10 + i) for i in range(4)]   # 6 full blocks each: host overflows
    serve(a, [(f"c{i}", p) for i, p in enumerate(convs)])
    _flush(a)
    st = a.stats()
    assert st["dropped"] > 0 and st["remote"]["blocks_written"] > 0
    written = st["remote"]["blocks_written"]
    # the first conversation left the device and host first: a fresh engine finds it remotely
    b = remote_engine(hf_llama, url)
    out = serve(b, [("again", convs[0])])["again"]
    assert out.num_cached_tokens > 0
    assert dict(zip(b.output_tier_names, out.cached_tokens_per_tier))["remote"] == \
        out.num_cached_tokens
    assert out.outputs[0].token_ids == hf_greedy(hf_llama, convs[0])
    assert written <= st["dropped"] + st["demotions"][1] + 1
    a.close(), b.close()



def _serve_points(eng, rid, prompt, points):
    eng.add_request(rid, prompt, {"max_tokens": 2}, cache_points=points)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
    check_tiers(eng)
    return final


def test_a_persist_point_writes_the_prompt_under_write_back_with_its_retention(
        hf_llama, url, redis_srv):
    """``prompt_cache_retention: "24h"``'s engine side: a ``persist`` cache point writes the
    prompt's blocks to the shared server at once, though write-back would write nothing yet,
    with the point's TTL on the keys (longer than the store's own); a fresh replica is then
    served from it. A prompt without the point is not written. Used again, the retained blocks
    have their expiry restarted, no payload resent; keys the server lost are written again."""
    from radixkv.engine.cache_points import CachePoint

    r = redis_srv.client()
    prompt, other = rand_tokens(33, 21), rand_tokens(33, 22)
    a = remote_engine(hf_llama, url, device=32, host=8, remote_ttl_s=60)   # write_back
    _serve_points(a, "p", prompt, [CachePoint(33, ttl="24h", persist=True)])
    _serve_points(a, "o", other, None)
    _flush(a)
    st = a.stats()["remote"]
    assert st["blocks_persisted"] == st["blocks_written"] == 8 and st["persist_skipped"] == 0
    keys = sorted(r.keys("*"))
    assert len(keys) == 8   # only the persisted prompt: nothing left the host tier
    assert all(86_000_000 < r.pttl(k) <= 86_400_000 for k in keys)
    b = remote_engine(hf_llama, url)
    out = serve(b, [("b", prompt)])["b"]
    assert dict(zip(b.output_tier_names, out.cached_tokens_per_tier))["remote"] == 8 * BS
    assert out.outputs[0].token_ids == hf_greedy(hf_llama, prompt)

    for k in keys:
        r.pexpire(k, 5000)
    _serve_points(a, "p2", prompt, [CachePoint(33, ttl="24h", persist=True)])
    _flush(a)
    st = a.stats()["remote"]
    assert st["persist_refreshes"] == 8 and st["blocks_written"] == 8   # no payload resent
    assert all(r.pttl(k) > 86_000_000 for k in keys)

    r.delete(*keys[:3])      # the server lost three (maxmemory, a flush): the next refresh
    _serve_points(a, "p3", prompt, [CachePoint(33, ttl="24h", persist=True)])   # finds out
    _flush(a)
    assert a.stats()["remote"]["server"]["refresh_missed"] == 3
    _serve_points(a, "p4", prompt, [CachePoint(33, ttl="24h", persist=True)])   # rewrites
    _flush(a)
    st = a.stats()["remote"]
    assert st["blocks_written"] == 11 and len(r.keys("*")) == 8
    a.close(), b.close()



def test_one_prompt_retained_twice_in_a_step_is_written_once(hf_llama, url):
    """Two requests retaining the same prompt before the step's writes: one write per block,
    and no refresh of keys that are still on their way to the server."""
    from radixkv.engine.cache_points import cached_chain

    prompt = rand_tokens(33, 24)
    a = remote_engine(hf_llama, url, remote_ttl_s=60)
    serve(a, [("x", prompt)])
    req = type("R", (), {"namespace": a._namespace})()
    hashes = cached_chain(a.block_manager, req, prompt)
    assert len(hashes) == 8
    a._remote.persist(hashes, 86400.0)
    a._remote.persist(hashes, 86400.0)
    a._remote.after_step()
    _flush(a)
    st = a.stats()["remote"]
    assert st["blocks_persisted"] == 8 and st["persist_refreshes"] == 0
    assert st["server"]["refresh_missed"] == 0
    a.close()

def test_a_read_only_tier_persists_nothing(hf_llama, url, redis_srv):
    from radixkv.engine.cache_points import CachePoint

    a = remote_engine(hf_llama, url, remote_write="read_only")
    _serve_points(a, "p", rand_tokens(33, 23), [CachePoint(33, ttl="24h", persist=True)])
    _flush(a)
    st = a.stats()["remote"]
    assert st["blocks_written"] == 0 and st["persist_skipped"] == 8
    assert redis_srv.client().dbsize() == 0
    a.close()

def test_other_tenant_and_other_model_miss(hf_llama, url):
    prompt = rand_tokens(33, 2)
    a = remote_engine(hf_llama, url, remote_write="write_through")
    a.add_request("x", prompt, {"max_tokens": 2}, cache_salt="tenant-a")
    while a.has_unfinished_requests():
        a.step()
    _flush(a)
    b = remote_engine(hf_llama, url)
    out = serve_salted(b, prompt, "tenant-b")
    assert out.num_cached_tokens == 0
    c = remote_engine(hf_llama, url, model_id="another-model")
    out = serve_salted(c, prompt, "tenant-a")
    assert out.num_cached_tokens == 0
    d = remote_engine(hf_llama, url)
    assert serve_salted(d, prompt, "tenant-a").num_cached_tokens == 8 * BS
    for e in (a, b, c, d):
        e.close()


def serve_salted(eng, prompt, salt):
    eng.add_request("s", prompt, {"max_tokens": 2}, cache_salt=salt)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
    return final


def test_server_down_at_start_then_killed_mid_run_costs_only_misses(hf_llama, tmp_path):
    srv = RedisServer(tmp_path / "r")          # not started: down at start
    eng = remote_engine(hf_llama, srv.url, remote_write="write_through")
    prompts = [rand_tokens(21, 30 + i) for i in range(3)]
    t0 = time.monotonic()
    outs = serve(eng, [(f"p{i}", p) for i, p in enumerate(prompts)])
    assert time.monotonic() - t0 < 30
    for i, p in enumerate(prompts):
        assert outs[f"p{i}"].outputs[0].token_ids == hf_greedy(hf_llama, p)
    assert eng.stats()["remote"]["available"] is False
    srv.start()
    try:
        deadline = time.monotonic() + 15
        while not eng._remote.store.available and time.monotonic() < deadline:
            serve(eng, [("probe", rand_tokens(9, 99))], max_tokens=1)   # reconnects w/ backoff
            time.sleep(0.2)
        assert eng._remote.store.available
        serve(eng, [("w", rand_tokens(21, 40))])
        srv.kill()                              # dies mid-run, no goodbye
        t0 = time.monotonic()
        outs = serve(eng, [(f"k{i}", p) for i, p in enumerate(prompts)])
        assert time.monotonic() - t0 < 60       # bounded by remote_timeout_s per lookup
        for i, p in enumerate(prompts):
            assert outs[f"k{i}"].outputs[0].token_ids == hf_greedy(hf_llama, p)
        check_tiers(eng)
    finally:
        srv.stop()
        eng.close()


def test_a_corrupted_value_is_a_miss_and_deleted(hf_llama, url, redis_srv):
    prompt = rand_tokens(33, 3)
    a = remote_engine(hf_llama, url, remote_write="write_through")
    serve(a, [("a", prompt)])
    _flush(a)
    cli = redis_srv.client()
    keys = sorted(cli.keys("*"))
    assert keys
    for k in keys:                              # flip one payload byte of every value
        v = bytearray(cli.get(k))
        v[-1] ^= 0xFF
        cli.set(k, bytes(v))
    b = remote_engine(hf_llama, url)
    out = serve(b, [("b", prompt)])["b"]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == hf_greedy(hf_llama, prompt)
    srv_stats = b.stats()["remote"]["server"]
    assert srv_stats["corrupt"] >= 1 and srv_stats["deleted"] >= 1
    a.close(), b.close()


def test_remote_config_errors_are_typed():
    from radixkv.errors import ConfigError

    with pytest.raises(ConfigError):
        CacheConfig(remote_url="http://nope")
    with pytest.raises(ConfigError):
        CacheConfig(remote_url="redis://127.0.0.1:1/0", remote_write="sometimes")
    with pytest.raises(ConfigError):
        CacheConfig(remote_ttl_s=0)
    assert "remote_url" not in repr(CacheConfig(remote_url="redis://:pw@127.0.0.1:1/0"))


def test_a_remote_tier_without_a_host_tier_gets_a_staging_host_tier(hf_llama, url):
    from radixkv.config import REMOTE_STAGING_BLOCKS

    eng = LLMEngine(copy.deepcopy(hf_llama), None,
                    CacheConfig(block_size=BS, num_device_blocks=16, remote_url=url),
                    EngineConfig(max_num_seqs=4, max_num_batched_tokens=128), model_id="tiny")
    assert eng.tier_names == ["device", "host"]
    assert eng.output_tier_names == ["device", "host", "remote"]
    assert eng.tier_capacity_blocks[1] == REMOTE_STAGING_BLOCKS
    eng.close()


def test_a_hung_server_delays_a_request_by_the_timeout_at_most(hf_llama, tmp_path):
    srv = RedisServer(tmp_path / "hung").start()
    eng = LLMEngine(copy.deepcopy(hf_llama), None,
                    CacheConfig(block_size=BS, num_device_blocks=16, host_blocks=8,
                                remote_url=srv.url, remote_timeout_s=0.5),
                    EngineConfig(max_num_seqs=4, max_num_batched_tokens=128), model_id="tiny")
    try:
        srv.pause()                               # accepts, never answers
        prompt = rand_tokens(21, 50)
        t0 = time.monotonic()
        out = serve(eng, [("h", prompt)])["h"]
        assert time.monotonic() - t0 < 10
        assert out.outputs[0].token_ids == hf_greedy(hf_llama, prompt)
        st = eng.stats()["remote"]
        # the lookup was abandoned at its deadline, or the store's own socket timeout (the same
        # bound) answered first with a miss: either way a bounded wait, counted
        assert st["lookup_timeouts"] + st["server"]["timeouts"] >= 1
    finally:
        srv.resume()
        srv.stop()
        eng.close()
