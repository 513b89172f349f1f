"""The batched sampler, the logit adjustments and blending of quantized caches, on CUDA.

Everything here also runs on the CPU in tests/engine (test_sampling.py, test_logit_adjust.py,
test_blend_quant.py); what only a GPU shows is that the same code is right with device tensors:
a sampled step's rows drawn on the device with each sequence's own CUDA generator, filtering
and penalties giving the CPU's numbers, the sync count of a sampled step not growing with the
batch, and a blend (documents' entries reused out of order, K re-rotated in an int8 / fp8 cache)
matching a full prefill on the card. Run by ``scripts/gpu_check.sh``; skipped without CUDA.

``RADIXKV_CUDA_TESTS_DEVICE=cpu`` runs the same cases on the CPU, to check the tests
themselves on a machine without a GPU.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

DEV = os.environ.get("RADIXKV_CUDA_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(),
                                 reason="needs CUDA"),
              pytest.mark.filterwarnings(
                  "ignore::radixkv.engine.kv_quant.QuantizedKVWarning")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

BS = 16
#: 1 - 2^-20: every reused token recomputed on every layer (tests/engine/test_blend_quant.py)
EVERY_TOKEN = 1 - 2.0 ** -20


def _engine(model, kv_dtype: str = "auto", seqs: int = 8, blocks: int = 128):
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    return LLMEngine(copy.deepcopy(model), None,
                     CacheConfig(block_size=BS, num_device_blocks=blocks, kv_dtype=kv_dtype),
                     EngineConfig(device=DEV, max_num_seqs=seqs, max_num_batched_tokens=1024,
                                  max_model_len=512),
                     model_id=f"dev-{kv_dtype}-{seqs}")


def _tiny(family: str = "llama"):
    from test_model_families import make_family_model   # tests/engine: the same tiny models

    return make_family_model(family).to(DEV)


def _tokens(seed: int, n: int) -> list[int]:
    from engine_helpers import seeded_tokens   # tests/engine

    return seeded_tokens(seed, n)


def _run(engine, requests):
    from engine_helpers import run_requests

    return run_requests(engine, requests)


# ------------------------------------------------------------------ the sampler's tensor ops
def _params():
    from radixkv.engine.sampling import SamplingParams

    return [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0,
                                                                       min_p=0.05),
            SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01)]


def test_filtered_probs_on_the_device_equal_the_cpus():
    """Temperature, min-p, top-k and top-p over a batch of rows with mixed knobs: the same
    kept tokens as on the CPU, and the same probabilities to float rounding (a 49,152-token
    vocabulary: the CPU takes its top-p candidates path, the device sorts the whole row)."""
    from radixkv.engine.sampling import filtered_probs_rows

    params = _params()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(params), 49_152, generator=g) * torch.tensor(
        [[1.0], [4.0], [2.0], [8.0], [0.5]])
    cpu = filtered_probs_rows(logits, params)
    dev = filtered_probs_rows(logits.to(DEV), params)
    assert dev.device.type == DEV
    assert torch.equal(dev.cpu() > 0, cpu > 0)
    torch.testing.assert_close(dev.cpu(), cpu, atol=1e-6, rtol=1e-4)


def test_draws_on_the_device_use_each_rows_generator_and_never_a_dropped_token():
    """Each row draws with its own device generator: seeded rows give the same tokens alone
    or together and on a second run; a token whose probability is 0 is never drawn; the
    frequencies of 4,000 draws follow the probabilities."""
    from radixkv.engine.sampling import draw_tokens, make_generator

    dev = torch.device(DEV)
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 1.0, 0.0],
                          [0.1, 0.2, 0.3, 0.4]], device=dev)
    gens = [make_generator(100 + r, dev) for r in range(3)]
    together = draw_tokens(probs, gens).tolist()
    alone = [int(draw_tokens(probs[r:r + 1], [make_generator(100 + r, dev)])[0])
             for r in range(3)]
    assert together == alone
    again = draw_tokens(probs, [make_generator(100 + r, dev) for r in range(3)]).tolist()
    assert again == together
    g = make_generator(11, dev)
    many = draw_tokens(probs[0:1].expand(4000, 4).contiguous(), [g] * 4000)
    counts = torch.bincount(many, minlength=4).cpu().float() / 4000
    assert counts[1] == 0
    torch.testing.assert_close(counts, probs[0].cpu(), atol=0.04, rtol=0)


def test_penalties_and_biases_on_the_device_equal_the_cpus():
    """frequency / presence / repetition penalties and logit_bias over rows with and without
    them: the device's adjusted logits are the CPU's."""
    from radixkv.engine.sampling import SamplingParams, adjust_logits

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=g) * 3
    rows = [(0, SamplingParams(frequency_penalty=0.8, presence_penalty=0.3), [5, 5, 9, 299]),
            (1, SamplingParams(logit_bias={7: 100.0, 8: -100.0, 12: 2.5}), [7]),
            (3, SamplingParams(repetition_penalty=1.3, frequency_penalty=-0.5,
                               logit_bias={0: -1.0}), [1, 2, 2, 3])]
    prompts = [[4, 4, 6], [], [11, 1]]
    cpu = adjust_logits(logits, rows, prompts)
    dev = adjust_logits(logits.to(DEV), rows, prompts)
    assert dev.device.type == DEV
    torch.testing.assert_close(dev.cpu(), cpu, atol=1e-6, rtol=1e-6)
    assert torch.equal(cpu[2], logits[2])                      # a row with nothing to adjust


# ---------------------------------------------------------------- sampled requests end to end
def test_seeded_sampled_requests_repeat_and_biases_steer_them():
    """Seeded sampled requests (n = 3, top-p, penalties) give the same completions in a second
    engine on the device and whatever else shares their batch; a +100 logit_bias makes every
    sampled token the biased one."""
    from radixkv.engine.sampling import SamplingParams

    hf = _tiny()
    prompts = [_tokens(s, 11 + s) for s in range(3)]
    p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=21,
                       frequency_penalty=0.5, presence_penalty=0.2, ignore_eos=True)
    first = _run(_engine(hf), [(f"a{i}", x, p) for i, x in enumerate(prompts)])
    second = _run(_engine(hf), [(f"a{i}", x, p) for i, x in enumerate(prompts)]
                  + [("noise", _tokens(9, 30), SamplingParams(max_tokens=8, temperature=1.2))])
    for i in range(3):
        a = [c.token_ids for c in first[f"a{i}"].outputs]
        assert len(a) == 3 and all(len(t) == 8 for t in a)
        assert a == [c.token_ids for c in second[f"a{i}"].outputs]
    forced = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias={42: 100.0},
                            ignore_eos=True)
    out = _run(_engine(hf), [("forced", prompts[0], forced)])
    assert out["forced"].outputs[0].token_ids == [42] * 6


def _syncs_of_a_decode_step(hf, params) -> list[str]:
    """Where a decode step (the third step of a request: prefill and first token, the forks'
    copy-on-write, then a plain decode) syncs the stream, caught by CUDA's sync-debug mode:
    one line of radixkv frames per sync raised on this thread."""
    import threading
    import traceback

    eng = _engine(hf, seqs=16)
    eng.add_request("r", [5, 9, 13, 2, 7, 1], params)
    eng.step()
    eng.step()
    torch.cuda.synchronize()
    me, sites = threading.get_ident(), []

    def record(message, *_a, **_k):
        text = str(message)   # (not the mode's own "prototype feature" notice, on first use)
        if threading.get_ident() == me and "synchroniz" in text and "prototype" not in text:
            stack = traceback.extract_stack()
            ours = [f"{f.filename.rsplit('radixkv/', 1)[-1]}:{f.lineno}" for f in stack
                    if "/radixkv/" in f.filename]
            sites.append(" <- ".join(ours) or f"{message} at "
                         + " <- ".join(f"{f.filename}:{f.lineno}" for f in stack[-4:]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def test_a_decode_step_syncs_the_stream_once_whatever_the_batch_and_sampling():
    """A decode step reads the device once: greedy, sampled (n = 2 and n = 8) and sampled with
    top-p, penalties and a logit bias, the greedy tokens, their log-probabilities and the draws
    come back in one transfer (StepReads); every index list goes to the GPU through pinned
    memory, queued like a kernel, not as a blocking copy that drains the stream."""
    from radixkv.engine.sampling import SamplingParams

    if DEV != "cuda":
        pytest.skip("sync-debug mode is CUDA's")
    hf = _tiny()
    base = dict(max_tokens=6, seed=3, ignore_eos=True)
    for kw in (dict(n=2), dict(n=2, temperature=1.0), dict(n=8, temperature=1.0),
               dict(n=8, temperature=1.0, top_p=0.9, frequency_penalty=0.2,
                    logit_bias={3: 1.5})):
        sites = _syncs_of_a_decode_step(hf, SamplingParams(**base, **kw))
        assert len(sites) == 1, (kw, sites)


# ------------------------------------------------------------- blending on the device's cache
def _prompt(order: str, seed: int) -> tuple[list[int], list[tuple[int, int]]]:
    from engine_helpers import documents_prompt   # tests/engine: as test_blend_quant's

    return documents_prompt(order, seed, BS)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8_e4m3"])
def test_blending_on_the_device_reuses_entries_and_matches_a_full_prefill(kv_dtype):
    """Documents cached in one order, asked in another: a plain-reuse blend serves every
    document from its entry (cached tokens = the whole documents, against the head alone by
    prefix), and a blend recomputing every token gives a full prefill's greedy continuation
    on the same (float32, int8 or fp8) cache."""
    from radixkv.engine import blend
    from radixkv.engine.sampling import SamplingParams

    core = _engine(_tiny(), kv_dtype)
    assert core.model_runner.kv_cache.device.type == DEV
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    toks, spans = _prompt("abc", 7)
    core.add_request("entries", toks, p, cache_salt="b", documents=spans, blend_ratio=0.15)
    _run(core, [])
    toks, spans = _prompt("cab", 7)
    n_full = spans[-1][1] // BS * BS
    core.add_request("reuse", toks, p, cache_salt="b", documents=spans, blend_ratio=0.0)
    reused = _run(core, [])["reuse"]
    assert reused.num_cached_tokens == n_full
    core.add_request("every", toks, p, cache_salt="b", documents=spans,
                     blend_ratio=EVERY_TOKEN)
    core.add_request("full", toks, p, cache_salt="other")
    out = _run(core, [])
    assert out["every"].num_cached_tokens == n_full
    assert out["full"].num_cached_tokens == 0
    assert out["every"].outputs[0].token_ids == out["full"].outputs[0].token_ids
    ns = core.namespace.with_salt("b")
    rep = blend.blend_context(core, toks, blend.check_spans(spans, len(toks)), "b", 0.0)
    assert rep is not None and rep.warm and rep.num_blended_tokens == n_full  # "reuse"'s
    got = blend.prompt_logits(core, toks, blend.blend_namespace(ns, rep.namespace_extra),
                              rep.num_blended_tokens)
    assert got.device.type == DEV and bool(torch.isfinite(got).all())
