"""radixkv.engine.blend: key re-rotation, the blend forward against a full prefill, selection.

The reference is the runner's own prefill (the paged kernels) of the same tokens: its K/V, read
back from the cache, are what a full prefill caches.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine import blend
from radixkv.engine.model_runner import ModelRunner
from radixkv.errors import InvalidRequestError

from conftest import TINY_ARCHS, ToyPager  # noqa: E402  (tests/engine is on sys.path)

BS = 16
N = 120


def _prefill_kv(runner: ModelRunner, toks: list[int]) -> tuple[list, list]:
    """Per layer ``[len(toks), Hkv, D]`` K and V of a full prefill of ``toks`` (fresh pager)."""
    pg = ToyPager(runner.num_blocks, BS, seed=len(toks))
    pg.add(0, toks)
    ch = pg.chunk(0)
    runner.execute(runner.build_batch([ch]))
    kv = runner.kv_cache
    flat = kv.view(kv.shape[0], 2, -1, kv.shape[4], kv.shape[5])
    s = torch.tensor(ch.slot_mapping)
    return ([flat[li, 0][s].clone() for li in range(kv.shape[0])],
            [flat[li, 1][s].clone() for li in range(kv.shape[0])])


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def runner(request, make_tiny) -> ModelRunner:
    return ModelRunner.for_model(make_tiny(request.param, num_layers=4), 64, BS)


def _tokens(seed: int, n: int = N) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 256, (n,), generator=g)]


@settings(max_examples=6, deadline=None)
@given(delta=st.integers(1, 300), seed=st.integers(0, 99))
def test_rerotating_cached_keys_equals_computing_them_at_the_new_position(runner, delta, seed):
    """Layer 0's K depends only on the token and its position: the keys of a document computed
    at positions [0, n), rotated by delta, equal those computed at [delta, delta + n)."""
    doc = _tokens(seed, 40)
    at_zero, _ = _prefill_kv(runner, doc)
    shifted, _ = _prefill_kv(runner, _tokens(seed + 1, delta) + doc)
    got = blend.rerotate(at_zero[0], runner.lean.rotary, delta)
    want = shifted[0][delta:]
    # float32 angles at position ~300 carry ~3e-5 rad of rounding (either way of computing)
    torch.testing.assert_close(got, want, atol=3e-4, rtol=1e-4)
    # and rotation by 0 is the identity, by d1 then d2 is by d1 + d2
    assert blend.rerotate(at_zero[0], runner.lean.rotary, 0) is at_zero[0]
    two = blend.rerotate(blend.rerotate(at_zero[0], runner.lean.rotary, 7), runner.lean.rotary,
                         delta)
    torch.testing.assert_close(two, blend.rerotate(at_zero[0], runner.lean.rotary, delta + 7),
                               atol=3e-4, rtol=1e-4)


@settings(max_examples=5, deadline=None)
@given(prefix_blocks=st.integers(0, 3), lo=st.integers(0, 30), hi=st.integers(31, 60),
       seed=st.integers(0, 99))
def test_blend_forward_at_ratio_one_equals_a_full_prefill(runner, prefix_blocks, lo, hi, seed):
    """Ratio 1 recomputes every token on every layer, whatever the cached rows held (garbage
    here): the K/V are a full prefill's, to float32 rounding (dense vs paged attention)."""
    toks = _tokens(seed)
    ref_k, ref_v = _prefill_kv(runner, toks)
    m = prefix_blocks * BS
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(k.shape, generator=g) for k in ref_k]
    vals = [torch.randn(v.shape, generator=g) for v in ref_v]
    for li in range(len(keys)):
        keys[li][:m], vals[li][:m] = ref_k[li][:m], ref_v[li][:m]
    reuse = torch.zeros(N, dtype=torch.bool)
    reuse[max(m, m + lo):m + hi] = True
    stats = blend.blend_forward(runner.lean, torch.tensor(toks), m, keys, vals, reuse, 1.0)
    assert stats.reused + stats.fresh == N - m
    assert stats.recomputed == stats.reused
    for li in range(len(keys)):
        torch.testing.assert_close(keys[li], ref_k[li], atol=5e-5, rtol=1e-4)
        torch.testing.assert_close(vals[li], ref_v[li], atol=5e-5, rtol=1e-4)


def test_plain_reuse_keeps_every_cached_row_and_recomputes_the_rest(runner):
    toks = _tokens(3)
    ref_k, ref_v = _prefill_kv(runner, toks)
    keys = [k.clone() for k in ref_k]
    vals = [v.clone() for v in ref_v]
    reuse = torch.zeros(N, dtype=torch.bool)
    reuse[40:100] = True
    for li in range(len(keys)):             # cached rows that differ from the prefill's
        keys[li][40:100] += 1.0
        vals[li][40:100] -= 1.0
    before_k = [k[40:100].clone() for k in keys]
    stats = blend.blend_forward(runner.lean, torch.tensor(toks), 16, keys, vals, reuse, 0.0)
    assert (stats.reused, stats.recomputed, stats.fresh) == (60, 0, N - 16 - 60)
    for li in range(len(keys)):
        assert torch.equal(keys[li][40:100], before_k[li])          # reused as cached
        torch.testing.assert_close(keys[li][:40], ref_k[li][:40])   # before them: exact
    # the rows after the documents attended to the altered rows: they differ from the prefill
    assert not torch.allclose(keys[-1][100:], ref_k[-1][100:], atol=1e-3)


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3])
def test_selection_recomputes_the_ratio_of_reused_tokens_with_the_largest_deviation(
        runner, ratio):
    toks = _tokens(5)
    ref_k, ref_v = _prefill_kv(runner, toks)
    keys = [k.clone() for k in ref_k]
    vals = [v.clone() for v in ref_v]
    reuse = torch.zeros(N, dtype=torch.bool)
    reuse[20:110] = True
    bad = list(range(30, 30 + math.ceil(ratio * 90)))
    for li in range(len(keys)):
        keys[li][bad] += 10.0                # these deviate most at the check layer
    stats = blend.blend_forward(runner.lean, torch.tensor(toks), 0, keys, vals, reuse, ratio)
    assert stats.recomputed == math.ceil(ratio * 90)
    # selected rows were recomputed on every later layer: back to the prefill's K
    for li in range(2, len(keys)):
        torch.testing.assert_close(keys[li][bad], ref_k[li][bad], atol=1e-3, rtol=1e-3)


def test_unsupported_models_keep_prefix_only_reuse(make_tiny):
    q = ModelRunner.for_model(make_tiny("llama", num_layers=2), 16, BS, kv_dtype="int8")
    assert blend.blend_unsupported(q) is None      # int8 / fp8 blend: test_blend_quant.py
    assert "no rotary" in blend.rope_unsupported(None)

    class Dyn:
        inv_freq = torch.ones(2)
        rope_type = "dynamic"
    assert "dynamic" in blend.rope_unsupported(Dyn())


def test_spans_and_ratio_are_validated():
    assert blend.check_spans([(0, 4), blend.DocSpan(4, 9)], 10) == [blend.DocSpan(0, 4),
                                                                     blend.DocSpan(4, 9)]
    for bad in ([(3, 3)], [(0, 11)], [(5, 8), (2, 4)], [(0, 1.5)], "01", [(1,)]):
        with pytest.raises(InvalidRequestError):
            blend.check_spans(bad, 10)
    for bad in (-0.1, 1.5, True, "0.1", None):
        with pytest.raises(InvalidRequestError):
            blend.check_blend_ratio(bad)
    assert blend.check_blend_ratio(1) == 1.0


@pytest.mark.parametrize("window,blends", [(32, False), (512, True)])
def test_a_sliding_window_shorter_than_the_prompt_keeps_prefix_only_reuse(window, blends):
    """On a model whose sliding window is shorter than the prompt, blending was measured below
    the quality bar (docs/rag.md), so the prompt keeps prefix-only reuse; the same model with a
    window longer than the prompt blends."""
    import transformers

    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        sliding_window=window, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
    core = LLMEngine(model, None, CacheConfig(block_size=BS, num_device_blocks=128),
                     EngineConfig(max_num_seqs=4, max_num_batched_tokens=256), model_id="w")
    toks = _tokens(3, 80)
    spans = blend.check_spans([(8, 40), (40, 72)], len(toks))
    reason = blend.window_unsupported(core.model_runner.lean, len(toks))
    assert (reason is None) == blends
    assert (blend.blend_context(core, toks, spans, None, 0.15) is not None) == blends
    core.block_manager.check_invariants()
