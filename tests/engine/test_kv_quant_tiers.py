"""Quantized KV served from every tier gives the device tier's tokens (issue 31 goal 1).

A quantized block carries its own scales and moves through host, disk and a remote Redis
unchanged (docs/quantization.md), so a prefix served from any tier must give the tokens the
same prefix served from the device gives: per KV dtype, a device-only engine's cached run is
the reference; a tiered engine (a small device tier, host, disk, remote write-through) serves
the same conversations again from host and disk, and a fresh engine on the same remote
server serves them from the remote tier.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.kv_quant import FORMATS
from radixkv.engine.llm_engine import LLMEngine

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402
from tiers_helpers import BS, check_tiers, rand_tokens, serve  # noqa: E402


def _engine(hf, kv, device, url=None, tmp=None, host=0, disk=0, **cc) -> LLMEngine:
    return LLMEngine(copy.deepcopy(hf), None,
                     CacheConfig(block_size=BS, num_device_blocks=device, host_blocks=host,
                                 disk_dir=str(tmp / "kv") if disk else None, disk_blocks=disk,
                                 remote_url=url, kv_dtype=kv, **cc),
                     EngineConfig(max_num_seqs=4, max_num_batched_tokens=128),
                     model_id="tiny")


def _tokens(eng, convs, tag):
    outs = serve(eng, [(f"{tag}{i}", p) for i, p in enumerate(convs)], max_tokens=8)
    return [outs[f"{tag}{i}"] for i in range(len(convs))]


def _served(eng, outs) -> dict[str, int]:
    """Cached prompt tokens per tier name over ``outs``."""
    per = dict.fromkeys(eng.output_tier_names, 0)
    for o in outs:
        for name, n in zip(eng.output_tier_names, o.cached_tokens_per_tier):
            per[name] += n
    return per


@pytest.mark.parametrize("kv", sorted(FORMATS))
def test_every_tier_gives_the_device_tiers_tokens(make_tiny, tmp_path, kv):
    hf = make_tiny("qwen2")                       # MQA, tied embeddings, q/k/v biases
    convs = [rand_tokens(25, 300 + c) for c in range(4)]
    dev = _engine(hf, kv, device=256)
    _tokens(dev, convs, "cold")
    want = [o.outputs[0].token_ids for o in _tokens(dev, convs, "dev")]
    assert _served(dev, _tokens(dev, convs, "dev2"))["device"] > 0
    with RedisServer(tmp_path / "redis").start() as srv:
        tiered = _engine(hf, kv, device=12, url=srv.url, tmp=tmp_path, host=6, disk=64,
                         remote_write="write_through")
        _tokens(tiered, convs, "a")               # pushes blocks down the tiers
        again = _tokens(tiered, convs, "b")
        served = _served(tiered, again)
        assert served["host"] + served["disk"] > 0, served
        assert [o.outputs[0].token_ids for o in again] == want
        check_tiers(tiered)
        tiered._remote.store.flush(5.0)
        tiered.close()
        fresh = _engine(hf, kv, device=256, url=srv.url, host=8)
        remote = _tokens(fresh, convs, "r")
        assert _served(fresh, remote)["remote"] > 0
        assert [o.outputs[0].token_ids for o in remote] == want
        fresh.close()
