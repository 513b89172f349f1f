"""The engine on CUDA (compiled Triton kernels) against transformers on the same GPU: tiny
random-weight models of five architectures (Llama, Qwen2, Mistral with a sliding window,
Gemma-2 with soft-capping, Phi-3), float32, greedy; token identity cold, cached, after
preemption, with beam search (width 4), and n = 4 samples completing; int8 KV completing with
its in-place Triton read. Run by ``scripts/gpu_check.sh``; skipped without CUDA (the same
engine paths run on the CPU in tests/engine)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

FIVE = ["llama", "qwen2_window", "mistral_window", "gemma2", "phi3"]


def _model(family: str) -> torch.nn.Module:
    from test_model_families import make_family_model   # tests/engine: the same tiny models

    return make_family_model(family).cuda()


def _hf(model, prompt: list[int], max_new: int, **kw) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         pad_token_id=0, **({"do_sample": False} | kw))
    return out[0, len(prompt):].tolist()


def _engine(model, *, blocks: int = 96, seqs: int = 4, kv_dtype: str = "auto"):
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    return LLMEngine(copy.deepcopy(model), None,
                     CacheConfig(block_size=4, num_device_blocks=blocks, kv_dtype=kv_dtype),
                     EngineConfig(device="cuda", max_num_seqs=seqs, max_num_batched_tokens=16),
                     model_id=f"cuda-{blocks}-{seqs}-{kv_dtype}")


def _run(engine, prompts, params, tag):
    from engine_helpers import run_requests

    final = run_requests(engine, [(f"{tag}{i}", p, params) for i, p in enumerate(prompts)])
    return [final[f"{tag}{i}"] for i in range(len(prompts))]


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("family", FIVE)
def test_cuda_engine_matches_transformers(family):
    from radixkv.engine.sampling import SamplingParams

    hf = _model(family)
    prompts = _prompts([6, 19, 30])
    greedy = SamplingParams(max_tokens=10)
    engine = _engine(hf)
    assert engine.model_runner.kv_cache.device.type == "cuda"
    cold = _run(engine, prompts, greedy, "cold")
    assert [o.outputs[0].token_ids for o in cold] == [_hf(hf, p, 10) for p in prompts]
    longer = [p + [7, 11, 13] for p in prompts[1:]]
    cached = _run(engine, longer, greedy, "cached")
    assert all(o.num_cached_tokens >= 16 for o in cached)
    assert [o.outputs[0].token_ids for o in cached] == [_hf(hf, p, 10) for p in longer]
    # Preempted and resumed: 4 x (prompt + 20) tokens need ~26 blocks of 4; the pool has 16.
    small = _engine(hf, blocks=16)
    more = _prompts([10, 13, 7, 11], seed=5)
    out = _run(small, more, SamplingParams(max_tokens=20), "pre")
    assert small.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in out] == [_hf(hf, p, 20) for p in more]


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_cuda_beam_search_and_n_samples(family):
    from radixkv.engine.sampling import SamplingParams

    hf = _model(family)
    prompts = _prompts([7, 12], seed=4)
    engine = _engine(hf, seqs=8)
    beams = _run(engine, prompts, SamplingParams(max_tokens=10, beam_width=4), "beam")
    assert [o.outputs[0].token_ids for o in beams] == \
        [_hf(hf, p, 10, num_beams=4) for p in prompts]
    samples = _run(engine, prompts[:1], SamplingParams(max_tokens=8, n=4, temperature=1.0,
                                                       seed=7, ignore_eos=True), "n")
    assert len(samples[0].outputs) == 4
    assert all(len(c.token_ids) == 8 for c in samples[0].outputs)


def test_cuda_int8_kv_reads_in_place_and_completes():
    """int8 KV on CUDA: the Triton kernels read the quantized blocks in place and the greedy
    runs complete at full length (token identity with float32 is not a property of int8;
    tests/kernels/test_quantized_kernels.py compares the in-place logits on CUDA)."""
    from radixkv.engine.sampling import SamplingParams

    hf = _model("llama")
    prompts = _prompts([9, 21], seed=6)
    out = _run(_engine(hf, kv_dtype="int8"), prompts, SamplingParams(max_tokens=12,
                                                                     ignore_eos=True), "q")
    for o in out:
        assert len(o.outputs[0].token_ids) == 12
        assert all(0 <= t < hf.config.vocab_size for t in o.outputs[0].token_ids)
