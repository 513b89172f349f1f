"""Bad input at every public call raises radixkv's own error types and changes nothing (issue 18,
items 4 and 6), and ``ask_many`` computes a new document once (item 8)."""

from __future__ import annotations

import math

import pytest
import torch

from radixkv import SamplingParams
from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.sampling import MIN_TEMPERATURE, make_generator
from radixkv.errors import (
    ConfigError, EngineClosedError, InvalidRequestError, InvalidTokensError, RadixKVError,
    UnknownDocumentError, UnknownRequestError,
)

P4 = SamplingParams(max_tokens=4)


# ----------------------------------------------------------------------------- item 4

@pytest.mark.parametrize("kw", [
    dict(temperature=1e-300, seed=1), dict(temperature=1e-300, n=4, seed=1),
    dict(temperature=0.8, seed=2**64), dict(temperature=0.8, seed=-2**63 - 1),
    dict(temperature=0.8, seed=2**64 - 2, n=4), dict(temperature=0.8, seed=10**30, n=2),
])
def test_edge_sampling_values_run(make_engine, kw):
    e = make_engine()
    [out] = e.generate("Hello there", SamplingParams(max_tokens=3, **kw))
    assert all(len(c.token_ids) == 3 for c in out.outputs)


def test_tiny_temperature_is_greedy_and_seeds_wrap():
    assert SamplingParams(temperature=MIN_TEMPERATURE / 10).temperature == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).temperature == MIN_TEMPERATURE
    cpu = torch.device("cpu")
    a, b = make_generator(2**64 + 5, cpu), make_generator(5, cpu)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


@pytest.mark.parametrize("lp", [math.nan, math.inf, -math.inf])
def test_non_finite_length_penalty_is_refused(lp):
    with pytest.raises(InvalidRequestError):
        SamplingParams(beam_width=2, length_penalty=lp)


# ----------------------------------------------------------------------------- item 6

def test_invalid_unicode_prompt(make_engine):
    e = make_engine()
    with pytest.raises(InvalidRequestError, match="Unicode"):
        e.generate("a\x00b\ud800c", P4)
    assert not e.has_unfinished_requests()
    [out] = e.generate("a\x00b c", P4)        # a NUL alone is fine
    assert len(out.outputs[0].token_ids) == 4


def test_unknown_and_finished_request_ids(make_engine):
    e = make_engine()
    with pytest.raises(UnknownRequestError):
        e.wait("no-such-id")
    with pytest.raises(UnknownRequestError):
        next(e.stream_request("no-such-id"))
    rid = e.submit("Hi", P4)
    assert e.wait(rid).finished
    with pytest.raises(UnknownRequestError, match="not in flight"):
        e.wait(rid)
    with pytest.raises(KeyError):              # still a KeyError for old callers
        e.wait(rid)
    with pytest.raises(InvalidRequestError):
        e.abort(None)
    e.abort("no-such-id")                      # aborting is idempotent


def test_prefix_queries_reject_non_token_lists(make_engine):
    e = make_engine()
    for bad in (None, "text", 5):
        with pytest.raises(InvalidTokensError):
            e.cached_prefix_tokens(bad)
        with pytest.raises(InvalidTokensError):
            e.set_prefix_hints(bad, priority=1)
    assert e.cached_prefix_tokens([]) == 0


def test_chat_and_rag_arguments(make_engine):
    e = make_engine()
    with pytest.raises(InvalidRequestError):
        e.chat(system=123)
    with pytest.raises(InvalidRequestError):
        e.chat(cache_salt=5)
    rag = e.rag()
    with pytest.raises(UnknownDocumentError):
        rag.remove_document("missing")
    with pytest.raises(UnknownDocumentError):
        rag.num_tokens("missing")


def test_config_types():
    with pytest.raises(ConfigError, match="floating-point"):
        EngineConfig(dtype="int8")
    with pytest.raises(ConfigError):
        EngineConfig(dtype=torch.int8)
    with pytest.raises(ConfigError):
        EngineConfig(dtype=3)
    assert EngineConfig(dtype="bfloat16").torch_dtype(None) is torch.bfloat16
    with pytest.raises(ConfigError):
        CacheConfig(disk_dir=123, disk_blocks=10)
    from pathlib import Path
    assert CacheConfig(disk_dir=Path("/tmp/kv"), disk_blocks=10).disk_dir == "/tmp/kv"


def test_policy_options_reach_the_policy_and_bad_ones_fail_at_config(tiny_model_shared,
                                                                     smol_tokenizer):
    """``CacheConfig.policy_options`` (``radixkv serve --policy-options JSON``) are the policy's
    keyword arguments: checked when the config is built, used by the engine's tree."""
    from radixkv.api.engine import Engine
    from radixkv.server.cli import build_parser, configs

    for bad in ({"sample": 0}, {"nope": 1}, {1: 2}, "sample=4"):
        with pytest.raises(ConfigError):
            CacheConfig(policy_options=bad)
    with pytest.raises(ConfigError):
        CacheConfig(policy="lru", policy_options={"sample": 4})   # LRU takes no options
    cc = CacheConfig(num_device_blocks=64, policy="duel", policy_options={"sample": 4})
    e = Engine(tiny_model_shared, smol_tokenizer, cc, EngineConfig(device="cpu"))
    try:
        pol = e.core.block_manager.tree.policy
        assert pol.sample == 4 and all(sh.pool.num_blocks == 16 for sh in pol._shadows)
    finally:
        e.close()
    args = build_parser().parse_args(["--policy", "duel", "--policy-options", '{"sample": 2}'])
    assert configs(args)[0].policy_options == {"sample": 2}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policy-options", "[2]"])


def test_engine_constructor_arguments(tiny_model_shared, smol_tokenizer):
    from radixkv.api.engine import Engine

    with pytest.raises(ConfigError, match="causal LM"):
        Engine(None, smol_tokenizer)
    with pytest.raises(ConfigError, match="cache_config"):
        Engine(tiny_model_shared, smol_tokenizer, "x")
    with pytest.raises(ConfigError, match="engine_config"):
        Engine(tiny_model_shared, smol_tokenizer, None, CacheConfig())
    with pytest.raises(ConfigError):
        Engine(tiny_model_shared, smol_tokenizer, model_id=7)


def test_closed_engine_refuses_work(tmp_path, tiny_model_shared, smol_tokenizer, one_thread):
    from radixkv.api.engine import Engine

    e = Engine(tiny_model_shared, smol_tokenizer,
               CacheConfig(block_size=16, num_device_blocks=64, host_blocks=8,
                           disk_dir=str(tmp_path), disk_blocks=32),
               EngineConfig(device="cpu", max_model_len=4096), model_id="tiny-closed")
    e.generate("Hello", P4)
    e.close()
    e.close()                                  # idempotent
    with pytest.raises(EngineClosedError):
        e.generate("Hello", P4)
    with pytest.raises(RadixKVError):
        e.core.step()


# ----------------------------------------------------------------------------- item 8

def test_ask_many_computes_a_new_document_once(make_engine):
    doc = "The Zephyr protocol routes packets through seven relays before delivery. " * 12
    qs = ["How many relays?", "What routes packets?", "Name the protocol.",
          "What happens before delivery?", "Is it fast?"]
    together = make_engine()
    rag = together.rag()
    rag.add_document("z", doc)
    answers = rag.ask_many(qs, params=P4)
    prefill_batch = together.stats()["prefill_tokens_computed"]
    prefix = len(rag.prefix_ids())
    assert all(a.cached_tokens >= prefix // 16 * 16 for a in answers[1:])

    apart = make_engine()
    rag2 = apart.rag()
    rag2.add_document("z", doc)
    singles = [rag2.ask(q, params=P4) for q in qs]
    prefill_apart = apart.stats()["prefill_tokens_computed"]
    # One batch costs what five separate asks cost, the document once, but for the rows of
    # the document's partial last block: an ask after another takes them from the previous
    # ask's kept tail (core/tails.py); five asks at once each compute their own.
    assert prefill_apart <= prefill_batch <= prefill_apart + (len(qs) - 1) * 15
    assert prefill_batch < 2 * prefix
    assert [a.token_ids for a in answers] == [a.token_ids for a in singles]
