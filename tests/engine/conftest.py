"""Fixtures shared by the engine tests: tiny random-weight models and a toy block pager.

``tiny_model(arch)`` builds a seeded, float32, eval-mode causal LM with hidden size 64, GQA and a
256-token vocabulary; two calls with the same arguments give identical weights, so one copy can
serve as the Hugging Face reference while another runs inside radixkv.

``ToyPager`` stands in for the block manager: it hands out block ids from a *shuffled* free list,
so block tables are non-contiguous and out of order, and turns "compute these tokens of sequence
s" into a :class:`SequenceChunk`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch

from radixkv.engine.batch import SequenceChunk

# name -> (config class name, extra kwargs). Together they cover: head_dim in the config
# (llama, mistral), head_dim derived as hidden/heads (qwen2 has no head_dim field), head_dim
# different from hidden/heads (llama_hd32), GQA 2:1 and 4:1, tied embeddings (qwen2),
# attention bias (qwen2), and a sliding window the sequences stay inside (mistral).
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1,
                                  tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=256)),
    "llama_hd32": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=32)),
}

#: Large enough that greedy argmax gaps dwarf float32 kernel differences (with the default 0.02
#: a random model's logits are nearly flat and argmax ties would make token comparisons flaky).
TINY_INIT_RANGE = 0.25


def make_tiny_model(arch: str, seed: int = 0, num_layers: int = 3) -> torch.nn.Module:
    """A seeded random-weight causal LM (float32, eval, sdpa attention) of architecture ``arch``."""
    import transformers

    cls_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, cls_name)(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        max_position_embeddings=512, initializer_range=TINY_INIT_RANGE,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="sdpa")
    return model.eval()


@pytest.fixture
def tiny_model() -> Callable[..., torch.nn.Module]:
    """Factory fixture: ``tiny_model("llama", seed=0)``; see :data:`TINY_ARCHS`."""
    return make_tiny_model


class ToyPager:
    """Trivial paging for tests: per-sequence token lists and block tables, shuffled block ids.

    Only the bookkeeping the runner needs; no sharing, no eviction.
    """

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}  # tokens whose K/V are in the cache
        self.tables: dict[int, list[int]] = {}

    def add(self, seq_id: int, tokens: Sequence[int]) -> None:
        self.tokens[seq_id], self.computed[seq_id], self.tables[seq_id] = list(tokens), 0, []

    def append(self, seq_id: int, token: int) -> None:
        self.tokens[seq_id].append(token)

    def chunk(self, seq_id: int, num_tokens: int | None = None,
              logit_offsets: Sequence[int] | None = None) -> SequenceChunk:
        """The next ``num_tokens`` uncomputed tokens of ``seq_id`` (default: all of them),
        allocating blocks so the table covers them; marks them computed."""
        toks, start, table = self.tokens[seq_id], self.computed[seq_id], self.tables[seq_id]
        n = len(toks) - start if num_tokens is None else num_tokens
        assert 0 < n <= len(toks) - start, (n, len(toks), start)
        end = start + n
        while len(table) * self.block_size < end:
            table.append(self.free.pop())
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for p in range(start, end)]
        self.computed[seq_id] = end
        return SequenceChunk(token_ids=toks[start:end], start_position=start,
                             block_table=list(table), slot_mapping=slots,
                             logit_offsets=logit_offsets)


@pytest.fixture
def toy_pager() -> type[ToyPager]:
    """The :class:`ToyPager` class: ``toy_pager(num_blocks, block_size, seed)``."""
    return ToyPager


@pytest.fixture(scope="session")
def make_tiny() -> Callable[..., torch.nn.Module]:
    """Session-scoped :func:`make_tiny_model`, for module-scoped fixtures (engine tests)."""
    return make_tiny_model
