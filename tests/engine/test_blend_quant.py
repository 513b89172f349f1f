"""radixkv.engine.blend on quantized (int8 / fp8_e4m3) KV caches.

A stored row is ``x H`` (Hadamard-rotated) quantized with its own fp16 scale
(engine/kv_quant.py). Blending re-rotates a document's K rows by dequantizing them, applying the
RoPE offset and quantizing again; V rows keep their bytes. The references are the runner's own
paged prefill on the same quantized cache (its rows read back as bytes) and, end to end, the
engine's full prefill of the same prompt under another salt.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine import blend, kv_quant
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.model_runner import ModelRunner
from radixkv import SamplingParams

from conftest import TINY_ARCHS, ToyPager  # noqa: E402  (tests/engine is on sys.path)
from engine_helpers import documents_prompt, run_requests, seeded_tokens  # noqa: E402

#: fp8 engines warn that fp8 KV falls short of bf16's quality (kv_quant.fp8_warning): known here
pytestmark = pytest.mark.filterwarnings("ignore::radixkv.engine.kv_quant.QuantizedKVWarning")
BS = 16
FORMATS = sorted(kv_quant.FORMATS)
#: 1 - 2^-20: selects ceil(ratio * reused) = every reused token (fewer than 2^20 of them), so
#: every layer recomputes every token: a full prefill through the blend path (ratio 1 itself
#: runs the ordinary request instead, see blend.blend_context).
EVERY_TOKEN = 1 - 2.0 ** -20
_FIXTURES = settings(max_examples=4, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


_tokens = seeded_tokens


def _prefill_rows(runner: ModelRunner, toks: list[int]) -> torch.Tensor:
    """int8 ``[2, L, len(toks), Hkv, D + 2]``: the bytes of the K/V rows a full prefill of
    ``toks`` writes into the quantized cache (fresh pager)."""
    pg = ToyPager(runner.num_blocks, BS, seed=len(toks))
    pg.add(0, toks)
    ch = pg.chunk(0)
    runner.execute(runner.build_batch([ch]))
    kv = runner.kv_cache
    flat = kv.view(torch.int8).view(kv.shape[0], 2, -1, kv.shape[4], kv.shape[5])
    return flat.index_select(2, torch.tensor(ch.slot_mapping)).transpose(0, 1).contiguous()


@pytest.fixture(scope="module", params=[(a, f) for a in sorted(TINY_ARCHS) for f in FORMATS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def qrunner(request, make_tiny) -> ModelRunner:
    arch, fmt = request.param
    return ModelRunner.for_model(make_tiny(arch, num_layers=4), 64, BS, kv_dtype=fmt)


def _half_step(fmt: kv_quant.QuantFormat) -> float:
    """Largest rounding error of one element, in units of its row's scale: half the grid's
    step at its top (int8: 1 / 2; e4m3 between 256 and 448: 32 / 2)."""
    return 0.5 if fmt.storage == torch.int8 else 16.0


def test_blending_is_supported_on_quantized_caches(qrunner):
    assert blend.blend_unsupported(qrunner) is None


@settings(max_examples=4, deadline=None)
@given(delta=st.integers(1, 300), seed=st.integers(0, 99))
def test_rerotated_quantized_keys_equal_the_keys_computed_at_the_new_position(qrunner, delta,
                                                                              seed):
    """Layer 0's K depends only on the token and its position: a document's quantized keys
    from positions [0, n), re-rotated by delta (dequantize, rotate, requantize), equal the
    quantized keys a prefill computes at [delta, delta + n), within the rounding of the three
    quantizations involved (source, re-rotated, reference): per row, in L2, at most
    sqrt(D) * half a grid step of each row's scale."""
    fmt = kv_quant.format_of(qrunner.kv_cache.dtype)
    doc = _tokens(seed, 40)
    at_zero = _prefill_rows(qrunner, doc)[:, 0]                        # [2, n, Hkv, D+2]
    shifted = _prefill_rows(qrunner, _tokens(seed + 1, delta) + doc)[:, 0, delta:]
    src = at_zero[0].view(fmt.storage)
    got = blend.rerotate_quantized(src, qrunner.lean.rotary, delta)
    assert got.dtype == fmt.storage and got.shape == src.shape
    want = shifted[0].view(fmt.storage)

    def scale(rows: torch.Tensor) -> torch.Tensor:         # [..., 1] float32
        return rows.view(torch.int16)[..., -1:].view(torch.float16).float()

    err = (kv_quant.dequantize_rows(got, torch.float32)
           - kv_quant.dequantize_rows(want, torch.float32)).norm(dim=-1, keepdim=True)
    bound = (math.sqrt(src.shape[-1] - 2) * _half_step(fmt)
             * (scale(src) + scale(got) + scale(want)))
    assert bool((err <= bound * 1.001 + 1e-5).all()), float((err / bound).max())
    # and it is the float re-rotation of the dequantized keys, quantized once more
    plain = blend.rerotate(kv_quant.dequantize_rows(src, torch.float32), qrunner.lean.rotary,
                           delta)
    assert torch.equal(got.view(torch.int8),
                       kv_quant.quantize_rows(plain, fmt.name).view(torch.int8))
    assert blend.rerotate_quantized(src, qrunner.lean.rotary, 0) is src


@settings(max_examples=3, deadline=None)
@given(prefix_blocks=st.integers(0, 3), lo=st.integers(0, 30), hi=st.integers(31, 60),
       seed=st.integers(0, 99))
def test_blend_forward_at_ratio_one_writes_a_full_prefills_rows(qrunner, prefix_blocks, lo,
                                                               hi, seed):
    """Ratio 1 on a quantized cache recomputes every token on every layer over the rows as
    stored: the bytes it keeps are a full prefill's (dense vs paged attention round apart, so
    a value on a rounding boundary may land one step away: at most 1% of the bytes), and the
    float buffers it attended hold exactly those bytes, dequantized as stored."""
    n = 120
    fmt = kv_quant.format_of(qrunner.kv_cache.dtype)
    toks = _tokens(seed, n)
    ref = _prefill_rows(qrunner, toks)                                # [2, L, N, Hkv, D+2]
    m = prefix_blocks * BS
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randn(*ref.shape[:-1], ref.shape[-1] - 2, generator=g)
    rows = kv_quant.quantize_rows(garbage, fmt.name).view(torch.int8)
    rows[:, :, :m] = ref[:, :, :m]
    buf = kv_quant.dequantize_rows(rows.view(fmt.storage), torch.float32, rotated=True)
    reuse = torch.zeros(n, dtype=torch.bool)
    reuse[m + lo:m + hi] = True
    stats = blend.blend_forward(qrunner.lean, torch.tensor(toks), m, list(buf[0]),
                                list(buf[1]), reuse, 1.0, stored=blend.StoredRows(fmt, rows))
    assert stats.recomputed == stats.reused and stats.reused + stats.fresh == n - m
    assert torch.equal(rows[:, :, :m], ref[:, :, :m])                 # the prefix untouched
    differ = int((rows != ref).sum())
    assert differ <= 0.01 * rows.numel(), differ
    assert torch.equal(buf, kv_quant.dequantize_rows(rows.view(fmt.storage), torch.float32,
                                                     rotated=True))


# ------------------------------------------------------------------------------ the engine op
def _engine(model, kv_dtype: str) -> LLMEngine:
    return LLMEngine(model, None, CacheConfig(block_size=BS, num_device_blocks=96,
                                              kv_dtype=kv_dtype),
                     EngineConfig(max_num_seqs=4, max_num_batched_tokens=1024,
                                  max_model_len=512), model_id=f"tiny-{kv_dtype}")


def _prompt(order: str, seed: int) -> tuple[list[int], list[tuple[int, int]]]:
    return documents_prompt(order, seed, BS)


@pytest.fixture(scope="module", params=[(a, f) for a in sorted(TINY_ARCHS) for f in FORMATS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def qengine(request, make_tiny):
    arch, fmt = request.param
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _engine(make_tiny(arch, num_layers=4), fmt)
    torch.set_num_threads(before)


@_FIXTURES
@given(order=st.permutations("abc"), seed=st.integers(0, 999))
def test_blending_every_token_equals_a_full_prefill_on_the_same_quantized_cache(qengine,
                                                                                order, seed):
    """Every token recomputed (the ratio-1 blend, through the blend path): the blended
    quantized cache gives the teacher-forced next tokens of a full prefill of the same prompt
    on the same cache exactly, and logits equal up to the rare rounding-boundary step of the
    dense attention (the argmax margins of these models are far larger), and the same greedy
    continuation."""
    core = qengine
    salt = f"s{seed}{''.join(order)}"
    toks, spans = _prompt("abc", seed)     # the entries of a, b, c (a plain-reuse blend)
    assert blend.blend_context(core, toks, blend.check_spans(spans, len(toks)), salt,
                               0.0) is not None
    toks, spans = _prompt("".join(order), seed)
    rep = blend.blend_context(core, toks, blend.check_spans(spans, len(toks)), salt,
                              EVERY_TOKEN)
    assert rep is not None and not rep.warm and rep.computed_entry_tokens == 0
    assert rep.reused_tokens == sum(e - s for s, e in spans)   # every document's entry
    assert rep.recomputed_tokens == rep.reused_tokens
    ns = core.namespace.with_salt(salt)
    first = rep.num_blended_tokens          # the question's positions
    got = blend.prompt_logits(core, toks, blend.blend_namespace(ns, rep.namespace_extra), first)
    want = blend.prompt_logits(core, toks, core.namespace.with_salt(salt + "-full"), first)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # worst measured over 80 such prompts (4 architectures x 2 formats x 10): 0.053
    torch.testing.assert_close(got, want, atol=0.15, rtol=0.02)
    # and generation: the blended request and the full prefill continue alike
    p = SamplingParams(max_tokens=4)
    core.add_request(f"b{salt}", toks, p, cache_salt=salt, documents=spans,
                     blend_ratio=EVERY_TOKEN)
    core.add_request(f"f{salt}", toks, p, cache_salt=salt + "-other")
    out = run_requests(core, [])
    assert out[f"b{salt}"].outputs[0].token_ids == out[f"f{salt}"].outputs[0].token_ids
    assert out[f"b{salt}"].num_cached_tokens == rep.num_blended_tokens


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantized_blending_reuses_entries_copying_v_and_rerotating_k(make_tiny, kv_dtype):
    """Documents cached in another order: prefix-only reuse serves the head and the first
    document; blending reuses every later document's entry. With plain reuse (ratio 0) the
    blended rows of a document token are its entry's on every layer: V bytes as they are, K
    bytes re-rotated (rerotate_quantized), so nothing else rounds them."""
    core = _engine(make_tiny("llama", num_layers=4), kv_dtype)
    fmt = kv_quant.format_of(core.model_runner.kv_cache.dtype)
    p = SamplingParams(max_tokens=2)
    toks, spans = _prompt("abc", 7)        # the entries (a blend), then the prefix chain
    core.add_request("entries", toks, p, cache_salt="b", documents=spans, blend_ratio=0.15)
    core.add_request("abc", toks, p, cache_salt="b")
    run_requests(core, [])
    toks, spans = _prompt("cab", 7)
    n_full = spans[-1][1] // BS * BS
    # the report, and the rows, of a plain-reuse blend of the other order
    rep = blend.blend_context(core, toks, blend.check_spans(spans, len(toks)), "b", 0.0)
    assert rep is not None and rep.reused_tokens == sum(e - s for s, e in spans)
    assert rep.recomputed_tokens == 0 and rep.computed_entry_tokens == 0
    assert rep.num_blended_tokens == n_full and rep.prefix_tokens == spans[0][0]
    core.add_request("blend", toks, p, cache_salt="b", documents=spans, blend_ratio=0.15)
    blended = run_requests(core, [])["blend"]
    core.add_request("prefix", toks, p, cache_salt="b")   # last: it caches this order's chain
    prefix_only = run_requests(core, [])["prefix"]
    assert prefix_only.num_cached_tokens == spans[0][0]       # the head only
    assert blended.num_cached_tokens == n_full > prefix_only.num_cached_tokens
    kv = core.model_runner.kv_cache
    flat = kv.view(torch.int8).view(kv.shape[0], 2, -1, kv.shape[4], kv.shape[5])
    tree, bm = core.tree, core.block_manager

    def rows_of(ids: list[int], ns) -> torch.Tensor:          # [L, 2, len(ids), Hkv, D+2]
        from radixkv.core.hashing import token_bytes
        blocks = [b.block_id for b in tree.match_tokens(token_bytes(ids), ns.seed)]
        assert len(blocks) * BS == len(ids)
        slots = (torch.tensor(blocks)[:, None] * BS + torch.arange(BS)[None]).reshape(-1)
        return flat.index_select(2, slots)

    ns = core.namespace.with_salt("b")
    out = rows_of(toks[:n_full], blend.blend_namespace(ns, rep.namespace_extra))
    lead = spans[0][0]
    for s, e in spans:
        entry = rows_of(toks[:lead] + toks[s:e], blend.document_namespace(ns))[:, :, lead:]
        assert torch.equal(out[:, 1, s:e], entry[:, 1])        # V: the entry's bytes
        want_k = blend.rerotate_quantized(entry[:, 0].view(fmt.storage),
                                          core.model_runner.lean.rotary, s - lead)
        assert torch.equal(out[:, 0, s:e], want_k.view(torch.int8))
        assert s == lead or not torch.equal(out[:, 0, s:e], entry[:, 0])
    bm.check_invariants()
