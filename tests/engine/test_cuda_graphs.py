"""Decode graphs (engine/cuda_graphs.py) on the CPU: the buckets, persistent buffers and padding
run with the capture replaced by an eager replay (``use_cuda_graphs=False``), against a plain
runner of the same model; padded rows must never touch the KV cache. On CUDA the same runner
captures real graphs (the CUDA case at the end)."""

from __future__ import annotations

import copy

import pytest
import torch

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.cuda_graphs import bucket_sizes
from radixkv.engine.model_runner import ModelRunner
from radixkv.errors import ConfigError

BLOCK = 4


def test_buckets_are_powers_of_two_then_multiples_of_eight():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(33) == [1, 2, 4, 8, 16, 24, 32, 33]
    with pytest.raises(ConfigError):
        bucket_sizes(0)


def _pair(model, num_blocks=48):
    """(plain runner, graph runner) over two copies of ``model``, each with its own pool."""
    plain = ModelRunner.for_model(copy.deepcopy(model), num_blocks, BLOCK)
    graphed = ModelRunner.for_model(copy.deepcopy(model), num_blocks, BLOCK)
    return plain, graphed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replayed_decode_matches_eager_and_padding_never_writes_kv(arch, make_tiny,
                                                                   toy_pager):
    plain, graphed = _pair(make_tiny(arch))
    before = graphed.kv_cache.clone()
    graphed.enable_decode_graphs(max_num_seqs=8, max_blocks=12, use_cuda_graphs=False)
    # capture's warm-up runs are all padding: nothing may have been written
    assert torch.equal(graphed.kv_cache, before)
    pagers = [toy_pager(48, BLOCK, seed=3), toy_pager(48, BLOCK, seed=3)]
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [11, 4, 6, 2, 9, 1, 7]]
    for p in pagers:
        for s, toks in enumerate(prompts):
            p.add(s, toks)
    for runner, p in zip((plain, graphed), pagers):   # prefill runs eagerly on both
        runner.execute(runner.build_batch([p.chunk(s) for s in range(3)]))
    for step in range(3):
        chunks = []
        for runner, p in zip((plain, graphed), pagers):
            for s in range(3):
                p.append(s, 10 + step + s)
            chunks.append([p.chunk(s) for s in range(3)])
        snapshot = graphed.kv_cache.clone()
        want = plain.execute(plain.build_batch(chunks[0]))
        batch = graphed.build_batch(chunks[1])
        got = graphed.execute(batch)
        assert got.shape == want.shape == (3, graphed.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        # only the three real tokens' slots changed, in every layer, K and V
        flat_new = graphed.kv_cache.flatten(2, 3)     # [L, 2, slots, Hkv, D]
        flat_old = snapshot.flatten(2, 3)
        changed = (flat_new != flat_old).flatten(3).any(-1).any(0).any(0).nonzero()[:, 0]
        assert set(changed.tolist()) <= set(batch.slot_mapping.tolist())
    assert graphed.graphs.replays[4] == 3 and sum(graphed.graphs.replays.values()) == 3
    assert torch.equal(graphed.kv_cache, plain.kv_cache) or torch.allclose(
        graphed.kv_cache, plain.kv_cache, rtol=1e-5, atol=1e-5)


def test_batches_the_buffers_cannot_hold_run_eagerly(make_tiny, toy_pager):
    plain, graphed = _pair(make_tiny("llama"))
    graphed.enable_decode_graphs(max_num_seqs=2, max_blocks=2, use_cuda_graphs=False)
    pager = toy_pager(48, BLOCK)
    pager.add(0, list(range(1, 12)))                   # 11 tokens: 3 blocks > max_blocks
    graphed.execute(graphed.build_batch([pager.chunk(0)]))
    pager.append(0, 5)
    batch = graphed.build_batch([pager.chunk(0)])
    assert not graphed.graphs.can_run(batch)
    graphed.execute(batch)
    assert sum(graphed.graphs.replays.values()) == 0


def test_models_whose_decode_plans_on_the_host_are_refused(make_tiny):
    runner = ModelRunner.for_model(make_tiny("mistral"), 16, BLOCK)
    with pytest.raises(ConfigError, match="sliding window"):
        runner.enable_decode_graphs(4, 8, use_cuda_graphs=False)
    runner = ModelRunner.for_model(make_tiny("llama"), 16, BLOCK, lean_forward=False)
    with pytest.raises(ConfigError, match="transformers' modules"):
        runner.enable_decode_graphs(4, 8, use_cuda_graphs=False)
    with pytest.raises(ConfigError, match="CUDA"):
        ModelRunner.for_model(make_tiny("llama"), 16, BLOCK).enable_decode_graphs(4, 8)


def test_engine_setting_is_on_where_possible_and_true_needs_cuda(make_tiny):
    """Default None: graphs wherever they can run (never on the CPU, never for a model whose
    step decides on the host); True insists and names why it cannot; False is eager."""
    from radixkv.engine.llm_engine import LLMEngine

    assert EngineConfig().cuda_graphs is None
    with pytest.raises(ConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ConfigError, match="CUDA device"):
        LLMEngine(make_tiny("llama"), None, CacheConfig(block_size=4, num_device_blocks=16),
                  EngineConfig(device="cpu", cuda_graphs=True), model_id="m")
    cpu = LLMEngine(make_tiny("llama"), None, CacheConfig(block_size=4, num_device_blocks=16),
                    EngineConfig(device="cpu"), model_id="m")
    assert cpu.model_runner.graphs is None
    cpu.close()
    if torch.cuda.is_available():
        on = LLMEngine(make_tiny("llama").cuda(), None,
                       CacheConfig(block_size=4, num_device_blocks=64),
                       EngineConfig(device="cuda", max_num_seqs=4), model_id="m")
        assert on.model_runner.graphs is not None
        on.close()
        q8 = LLMEngine(make_tiny("llama").cuda(), None,
                       CacheConfig(block_size=4, num_device_blocks=64, kv_dtype="int8"),
                       EngineConfig(device="cuda", max_num_seqs=4), model_id="m")
        assert q8.model_runner.graphs is None   # quantized KV plans on the host: eager
        q8.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_cuda_graphs_match_eager_on_cuda(make_tiny, toy_pager):
    model = make_tiny("llama").cuda()
    plain = ModelRunner.for_model(copy.deepcopy(model), 48, BLOCK)
    graphed = ModelRunner.for_model(copy.deepcopy(model), 48, BLOCK)
    graphed.enable_decode_graphs(max_num_seqs=8, max_blocks=12)
    pagers = [toy_pager(48, BLOCK, seed=1), toy_pager(48, BLOCK, seed=1)]
    for runner, p in zip((plain, graphed), pagers):
        for s in range(5):
            p.add(s, [s + 1, 2 * s + 3, 7])
        runner.execute(runner.build_batch([p.chunk(s) for s in range(5)]))
    for step in range(4):
        outs = []
        for runner, p in zip((plain, graphed), pagers):
            for s in range(5):
                p.append(s, 20 + step)
            outs.append(runner.execute(runner.build_batch([p.chunk(s) for s in range(5)]))
                        .clone())
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    assert graphed.graphs.replays[8] == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_with_cuda_graphs_matches_transformers_on_cuda(make_tiny):
    """On CUDA: greedy output of an engine that replays decode graphs equals transformers'
    ``generate`` token for token (fp32), and the graphs were replayed."""
    from radixkv.engine.llm_engine import LLMEngine
    from radixkv.engine.sampling import SamplingParams

    hf = make_tiny("llama").cuda()
    engine = LLMEngine(copy.deepcopy(hf), None, CacheConfig(block_size=4, num_device_blocks=256),
                       EngineConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=256,
                                    cuda_graphs=True), model_id="graphs")
    prompts = [[(5 * i + j) % 250 + 1 for j in range(3 + 4 * i)] for i in range(5)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda")
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                           do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert list(final[f"r{i}"].outputs[0].token_ids) == want, i
    assert sum(engine.model_runner.graphs.replays.values()) >= 10
    engine.close()
