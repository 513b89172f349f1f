"""int8 KV blocks (issue 16, first part: ``CacheConfig(kv_dtype="int8")`` on the torch path).

* rows round-trip within their quantization error, zeros and outliers included (hypothesis);
* an int8 engine generates what the float32 engine generates on almost every token, and its
  cached runs equal its cold runs;
* int8 blocks move through host and disk unchanged, and a shared remote server serves them to
  another int8 engine but never to an engine of another KV dtype (the namespace includes it);
* an int8 block costs (head_dim + 2) / (2 head_dim) of a bf16 one.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.kv_quant import QMAX, dequantize_rows, quantize_rows
from radixkv.engine.llm_engine import LLMEngine
from radixkv.errors import ConfigError
from radixkv.storage.layout import KVLayout

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402
from tiers_helpers import BS, check_tiers, make_engine, rand_tokens, serve  # noqa: E402


@given(rows=st.integers(1, 6), heads=st.integers(1, 3), dim=st.sampled_from([4, 16, 64]),
       magnitude=st.sampled_from([0.0, 1e-3, 1.0, 50.0, 6e4]), outlier=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rows_round_trip_within_their_quantization_error(rows, heads, dim, magnitude, outlier,
                                                        seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, dim, generator=g) * magnitude
    if outlier:
        x[0, 0, 0] = magnitude * 100 + 1.0
    q = quantize_rows(x)
    assert q.dtype == torch.int8 and q.shape == (rows, heads, dim + 2)
    y = dequantize_rows(q, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    scale = (amax / QMAX).to(torch.float16).float()
    bound = scale / 2 + amax * 2.0 ** -10 + 1e-30   # rounding + the fp16 scale's own rounding
    assert bool(((y - x).abs() <= bound).all())
    assert bool((dequantize_rows(quantize_rows(torch.zeros(2, 3, dim)), torch.float32) == 0).all())


def test_int8_block_costs_about_half_a_bf16_block():
    bf16 = KVLayout(30, 3, 64, 16, "bfloat16")
    int8 = KVLayout(30, 3, 64, 16, "int8")
    assert int8.bytes_per_block / bf16.bytes_per_block == pytest.approx(66 / 128)
    assert int8.fingerprint("m") != bf16.fingerprint("m")
    with pytest.raises(ConfigError):
        CacheConfig(kv_dtype="int3")


@pytest.fixture(scope="module")
def hf_llama(make_tiny):
    return make_tiny("llama")


def _engine(hf, kv_dtype, **cc):
    return LLMEngine(copy.deepcopy(hf), None,
                     CacheConfig(block_size=BS, num_device_blocks=cc.pop("device", 64),
                                 kv_dtype=kv_dtype, **cc),
                     EngineConfig(max_num_seqs=4, max_num_batched_tokens=128), model_id="tiny")


def _run(eng, prompts, n=8):
    outs = serve(eng, [(f"r{i}", p) for i, p in enumerate(prompts)], max_tokens=n)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def test_int8_engine_tracks_float32_and_its_cache_is_consistent(hf_llama):
    prompts = [rand_tokens(21, s) for s in range(8)]
    ref = [o.outputs[0].token_ids for o in _run(_engine(hf_llama, "auto"), prompts)]
    eng = _engine(hf_llama, "int8")
    cold = [o.outputs[0].token_ids for o in _run(eng, prompts)]
    same = sum(a == b for r, c in zip(ref, cold) for a, b in zip(r, c))
    assert same >= 0.9 * sum(map(len, ref)), (ref, cold)
    warm = _run(eng, prompts)                      # every prompt's blocks are cached now
    assert all(o.num_cached_tokens > 0 for o in warm)
    assert [o.outputs[0].token_ids for o in warm] == cold


def test_int8_blocks_move_through_host_and_disk_unchanged(hf_llama, tmp_path):
    convs = [rand_tokens(21, 100 + c) for c in range(4)]
    big = _engine(hf_llama, "int8", device=256)             # nothing ever evicted
    want = [o.outputs[0].token_ids for o in _run(big, convs)]
    eng = make_engine(hf_llama, tmp_path, device=12, host=6, disk=64, kv_dtype="int8")
    _run(eng, convs)                                        # pushes blocks down the tiers
    again = _run(eng, convs)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert any(sum(o.cached_tokens_per_tier[1:]) for o in again)   # some came from host/disk
    assert [o.outputs[0].token_ids for o in again] == want
    check_tiers(eng)


def test_remote_serves_int8_blocks_to_int8_engines_only(hf_llama, tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    try:
        prompt = rand_tokens(33, 7)
        a = _engine(hf_llama, "int8", host_blocks=8, remote_url=srv.url,
                    remote_write="write_through")
        first = _run(a, [prompt])[0]
        a._remote.store.flush(5.0)
        other = _engine(hf_llama, "auto", host_blocks=8, remote_url=srv.url)
        assert _run(other, [prompt])[0].num_cached_tokens == 0   # another KV dtype: a miss
        b = _engine(hf_llama, "int8", host_blocks=8, remote_url=srv.url)
        out = _run(b, [prompt])[0]
        assert dict(zip(b.output_tier_names, out.cached_tokens_per_tier))["remote"] == 8 * BS
        assert out.outputs[0].token_ids == first.outputs[0].token_ids
        for e in (a, other, b):
            e.close()
    finally:
        srv.stop()
