"""Engine: generate / stream / submit over a tiny random model with the SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from radixkv import InvalidRequestError, SamplingParams

GREEDY8 = SamplingParams(max_tokens=8)


def test_generate_accepts_text_ids_and_lists_and_keeps_order(make_engine):
    e = make_engine()
    ids = list(range(100, 140))
    [a] = e.generate("Hello world", GREEDY8)
    [b] = e.generate(ids, GREEDY8)
    outs = e.generate(["Hello world", ids], GREEDY8)
    assert ([o.outputs[0].token_ids for o in outs]
            == [a.outputs[0].token_ids, b.outputs[0].token_ids])
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outs)
    assert outs[1].prompt_token_ids == ids
    assert e.generate([], GREEDY8) == []


def test_second_request_hits_the_cache_and_gives_the_same_tokens(make_engine):
    e = make_engine()
    prompt = list(range(1000, 1050))                 # 50 tokens: 3 full blocks of 16
    [cold] = e.generate(prompt, GREEDY8)
    [warm] = e.generate(prompt, GREEDY8)
    assert cold.num_cached_tokens == 0
    # 3 full blocks, and the first row of the cold request's partial last block (a kept
    # tail): its last prompt token is computed again, for the logits
    assert warm.num_cached_tokens == 49
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # whole cached blocks, and the warm request's own kept tail: its partial last block holds
    # the prompt's last 2 tokens (and the reply's), which a third request would take
    assert e.cached_prefix_tokens(prompt) == 50
    assert len(e.cached_prefix_nodes(prompt)) * 16 == 48
    st = e.stats()
    assert st["cached_prompt_tokens"] == 49 and st["tail_hits"] == 1
    assert st["tail_hit_tokens"] == 1
    [third] = e.generate(prompt + [7], GREEDY8)      # extends it: takes the 2 tail rows
    assert third.num_cached_tokens == 50 and e.stats()["tail_hit_tokens"] == 3


def test_params_as_dict_and_per_prompt(make_engine):
    e = make_engine()
    outs = e.generate(["a b c", "d e f"], [{"max_tokens": 3}, {"max_tokens": 5}])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(InvalidRequestError):
        e.generate("x", {"max_tokens": 3, "no_such_option": 1})
    with pytest.raises(InvalidRequestError):
        e.generate(["a", "b"], [GREEDY8])


def test_bad_request_runs_nothing_and_leaves_engine_clean(make_engine):
    e = make_engine()
    with pytest.raises(InvalidRequestError):
        e.generate(["fine prompt", []], GREEDY8)     # second prompt empty
    st = e.stats()                                   # the first prompt was aborted, not run
    assert st["num_waiting"] == st["num_running"] == st["prompt_tokens"] == 0
    with pytest.raises(InvalidRequestError):
        e.generate([{"not": "a prompt"}], GREEDY8)
    [ok] = e.generate("still works", GREEDY8)
    assert ok.finished


def test_stream_deltas_add_up_and_interleave_with_generate(make_engine):
    e = make_engine()
    stream = e.stream("Once upon a time", SamplingParams(max_tokens=12))
    first = next(stream)
    assert first.ttft is not None and first.ttft > 0
    # A generate call while the stream is open must not steal the stream's outputs.
    [other] = e.generate("Another prompt", GREEDY8)
    assert other.finished
    rest = list(stream)
    snaps = [first, *rest]
    assert snaps[-1].finished and not any(s.finished for s in snaps[:-1])
    toks = [t for s in snaps for t in s.outputs[0].delta_token_ids]
    assert toks == snaps[-1].outputs[0].token_ids and len(toks) == 12
    assert "".join(s.outputs[0].delta_text for s in snaps) == snaps[-1].outputs[0].text


def test_closing_a_stream_early_aborts_its_request(make_engine):
    e = make_engine()
    stream = e.stream("abc def", SamplingParams(max_tokens=50))
    next(stream)
    stream.close()
    # the abort's final output is drained by the next step; nothing keeps running
    [ok] = e.generate("after", GREEDY8)
    assert ok.finished and e.stats()["num_running"] == 0


def test_cache_salts_never_share_blocks(make_engine):
    e = make_engine()
    prompt = list(range(2000, 2064))
    [a1] = e.generate(prompt, GREEDY8, cache_salt="tenant-a")
    [b1] = e.generate(prompt, GREEDY8, cache_salt="tenant-b")
    [a2] = e.generate(prompt, GREEDY8, cache_salt="tenant-a")
    [n1] = e.generate(prompt, GREEDY8)
    assert (a1.num_cached_tokens, b1.num_cached_tokens, n1.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 48                 # (64 - 1) // 16 blocks: one token computed
    assert e.cached_prefix_tokens(prompt, "tenant-b") == 64
    assert e.cached_prefix_tokens(prompt, "tenant-c") == 0
    # the same content is stored once per tenant: no block is shared across namespaces
    blocks = {s: {n.block_id for n in e.cached_prefix_nodes(prompt, s)}
              for s in ("tenant-a", "tenant-b", None)}
    assert not (blocks["tenant-a"] & blocks["tenant-b"]) and not (blocks["tenant-a"] & blocks[None])


def test_caching_disabled_engine_never_hits(make_engine):
    e = make_engine(enable_prefix_caching=False)
    prompt = list(range(3000, 3050))
    outs = [e.generate(prompt, GREEDY8)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_prefix_hints_protect_a_prefix_under_priority_policy(make_engine):
    e = make_engine(num_device_blocks=24, policy="priority")
    keep = list(range(4000, 4065))                   # 4 full blocks + 1
    e.generate(keep, SamplingParams(max_tokens=1))
    assert e.set_prefix_hints(keep, priority=10) == 4
    for i in range(6):                               # 6 x 4 blocks of other prompts
        e.generate(list(range(5000 + 100 * i, 5065 + 100 * i)), SamplingParams(max_tokens=1))
    assert e.stats()["evictions"][0] > 0
    assert e.cached_prefix_tokens(keep) == 64


def test_scheduling_priority_through_generate_stream_and_submit(make_engine):
    """vLLM's ``LLM.generate(priority=[...])``: one sequence at a time, the queue is served by
    priority (lower first), so the TTFTs come in that order; ``stream``/``submit`` take one.
    Non-zero under another scheduling policy, or a list of the wrong length, is refused."""
    e = make_engine(scheduling_policy="priority", max_num_seqs=1)
    outs = e.generate(["one two", "three four", "five six"], GREEDY8, priority=[4, -2, 0])
    ttft = [o.ttft for o in outs]
    assert ttft[1] < ttft[2] < ttft[0], ttft
    streamed = "".join(o.outputs[0].delta_text for o in e.stream("one two", GREEDY8,
                                                                  priority=-9))
    assert streamed == outs[0].outputs[0].text
    with pytest.raises(InvalidRequestError, match="2 priorities for 3 prompts"):
        e.generate(["a", "b", "c"], GREEDY8, priority=[1, 2])
    with pytest.raises(InvalidRequestError, match="one int per prompt"):
        e.generate(["a"], GREEDY8, priority=1)
    fcfs = make_engine()
    with pytest.raises(InvalidRequestError, match="priority"):
        fcfs.submit("a", GREEDY8, priority=1)
    with pytest.raises(InvalidRequestError, match="priority"):
        fcfs.generate(["a", "b"], GREEDY8, priority=[0, 1])
    assert fcfs.stats()["num_waiting"] == fcfs.stats()["num_running"] == 0
    [ok] = fcfs.generate(["a"], GREEDY8, priority=[0])
    assert ok.finished


def test_stats_and_metrics_text(make_engine):
    e = make_engine()
    e.generate(list(range(10, 60)), GREEDY8)
    e.generate(list(range(10, 60)), GREEDY8)
    st = e.stats()
    assert st["prompt_tokens"] == 100 and st["cached_prompt_tokens"] == 49   # 48 + a tail row
    text = e.metrics_text()
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["radixkv_hit_rate"].type == "gauge"
    assert fams["radixkv_hit_rate"].samples[0].value == 0.49
    assert fams["radixkv_hit_rate"].samples[0].labels == {"model": "tiny-llama-test"}
    assert fams["radixkv_cached_prompt_tokens"].type == "counter"
    assert fams["radixkv_cached_prompt_tokens"].samples[0].value == 49
    assert fams["radixkv_evictions"].type == "counter"
    assert {s.labels["tier"] for s in fams["radixkv_evictions"].samples} == {"device"}


def test_the_engine_converts_the_model_it_is_given_in_place(smol_tokenizer):
    """What docs/api.md promises: ``EngineConfig(dtype=...)`` converts the very model object
    passed (``nn.Module.to`` is in place) and puts it in eval mode; a deep copy passed instead
    leaves the caller's model as it was."""
    import copy

    import torch

    from radixkv import CacheConfig
    from radixkv.api.engine import Engine
    from radixkv.config import EngineConfig

    from .conftest import make_tiny_vocab_model

    mine = make_tiny_vocab_model(len(smol_tokenizer), num_layers=1).train()
    kept = copy.deepcopy(mine)
    for model, expect_converted in ((copy.deepcopy(kept), True), (kept, False)):
        passed = model if expect_converted else copy.deepcopy(model)
        engine = Engine(passed, smol_tokenizer, CacheConfig(num_device_blocks=16),
                        EngineConfig(dtype="bfloat16"), model_id="inplace")
        try:
            dtype = next(model.parameters()).dtype
            assert (dtype == torch.bfloat16) == expect_converted
            assert (not model.training) == expect_converted
        finally:
            engine.close()
