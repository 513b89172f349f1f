"""The model families users bring (issue 17 goal 4), each token-identical to transformers.

For every architecture a tiny random-weight model is built from its config here (no download):
the engine's greedy output equals ``transformers`` ``generate`` (float32) for a batch of cold
prompts, prefilled in chunks smaller than the prompts, and again for prompts whose prefix comes
from the cache. Prompts are longer than the sliding windows (8 tokens), so Mistral's window,
Qwen2's windowed upper layers and Gemma's alternating local/global layers are exercised, and
Gemma-2 soft-caps its attention logits (cap lowered to 10 so it bites on these weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

import copy

import pytest
import torch

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.model_runner import ModelRunner, unsupported_features
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import hf_generate, run_requests  # noqa: E402

WINDOW = 8
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              max_position_embeddings=512, initializer_range=0.25, num_attention_heads=4,
              num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
             tie_word_embeddings=False,
             layer_types=["sliding_attention", "full_attention"] * 2)
FAMILIES: dict[str, tuple[str, dict, str]] = {
    # name: (config class, extra config, transformers attention used as the reference)
    "llama": ("LlamaConfig", {}, "sdpa"),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=True), "sdpa"),
    "qwen2_window": ("Qwen2Config", dict(sliding_window=WINDOW, use_sliding_window=True,
                                         max_window_layers=2), "sdpa"),
    "qwen3": ("Qwen3Config", dict(head_dim=16), "sdpa"),
    "mistral_window": ("MistralConfig", dict(sliding_window=WINDOW), "sdpa"),
    "phi3": ("Phi3Config", {}, "sdpa"),
    "gemma2": ("Gemma2Config", dict(GEMMA, attn_logit_softcapping=10.0), "eager"),
    "gemma3": ("Gemma3TextConfig", GEMMA, "sdpa"),
}


def make_family_model(name: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    cls, extra, attn = FAMILIES[name]
    config = getattr(transformers, cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation=attn)
    return model.eval()


_hf = hf_generate


def _run(engine, prompts, max_new, tag):
    final = run_requests(engine, [(f"{tag}{i}", p, SamplingParams(max_tokens=max_new))
                                  for i, p in enumerate(prompts)])
    return [final[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers_cold_and_cached(family):
    hf = make_family_model(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 19, 30)]
    max_new = 10
    engine = LLMEngine(copy.deepcopy(hf), None,
                       CacheConfig(block_size=4, num_device_blocks=96),
                       EngineConfig(max_num_seqs=4, max_num_batched_tokens=16),
                       model_id=family)
    cold = _run(engine, prompts, max_new, "cold")
    assert [o.outputs[0].token_ids for o in cold] == [_hf(hf, p, max_new) for p in prompts]
    # The same prefixes again with new endings: their full blocks come from the cache.
    longer = [p + [7, 11, 13] for p in prompts[1:]]
    cached = _run(engine, longer, max_new, "cached")
    assert all(o.num_cached_tokens >= 16 for o in cached), [o.num_cached_tokens for o in cached]
    assert [o.outputs[0].token_ids for o in cached] == [_hf(hf, p, max_new) for p in longer]


def test_windowed_path_reads_only_the_window():
    """A query far past the window gives the same output whatever lies before the window."""
    from radixkv.kernels import paged_attention_windowed

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 12, 4, 2, 16, generator=g)
    q = torch.randn(1, 4, 16, generator=g)
    table = torch.arange(12, dtype=torch.int32)[None]

    def run() -> torch.Tensor:
        return paged_attention_windowed(q, k_cache, v_cache, table, [0, 1], [45], 0.25,
                                        torch.empty_like(q), window=WINDOW, softcap=None)

    before = run().clone()
    k_cache[:9].normal_()   # positions < 36 = 44 - 8: outside the window of the query at 44
    v_cache[:9].normal_()
    torch.testing.assert_close(run(), before)
    k_cache[10, 2].normal_()  # position 42: inside
    assert not torch.allclose(run(), before)


def test_unsupported_architecture_names_what_is_missing():
    import transformers

    config = transformers.LlamaConfig(**COMMON)
    config.attention_chunk_size = 64
    config.layer_types = ["full_attention", "linear_attention"] * 2
    missing = unsupported_features(config)
    assert any("attention_chunk_size=64" in m for m in missing)
    assert any("linear_attention" in m for m in missing)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON))
    model.config.attention_chunk_size = 64
    with pytest.raises(ConfigError, match="chunked attention"):
        ModelRunner.for_model(model, num_blocks=8, block_size=4)
