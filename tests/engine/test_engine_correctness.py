"""LLMEngine end to end against transformers' own ``generate`` on tiny random-weight models.

Every greedy/beam comparison is token-exact. The tiny models (``conftest.make_tiny_model``) use a
wide init range so top-1/top-2 logit gaps are far above the ~1e-5 difference between paged and
sdpa attention; ``_assert_no_ties`` would flag a seed where that is not so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import copy

import pytest
import torch

from radixkv.config import CacheConfig, EngineConfig
from radixkv.engine.llm_engine import LLMEngine
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import ConfigError, InvalidRequestError

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import hf_generate, run_requests  # noqa: E402



@pytest.fixture(scope="module")
def hf_llama(make_tiny):
    return make_tiny("llama")


def _engine(hf, num_blocks=128, block_size=4, max_num_seqs=8, max_tokens=256, tokenizer=None,
            engine_kw=None, **cache_kw):
    return LLMEngine(copy.deepcopy(hf), tokenizer,
                     CacheConfig(block_size=block_size, num_device_blocks=num_blocks, **cache_kw),
                     EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                                  **(engine_kw or {})),
                     model_id="tiny")


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


_hf = hf_generate
_run = run_requests


def _greedy(n):
    return SamplingParams(max_tokens=n)


# ----------------------------------------------------------------------------- greedy vs HF

@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_batch_of_mixed_lengths_matches_hf(arch, make_tiny):
    hf = make_tiny(arch)
    prompts = _prompts([3, 9, 17, 30])
    want = [_hf(hf, p, 12) for p in prompts]
    out = _run(_engine(hf), [(f"r{i}", p, _greedy(12)) for i, p in enumerate(prompts)])
    for i, w in enumerate(want):
        o = out[f"r{i}"]
        assert o.outputs[0].token_ids == w, f"prompt {i}"
        assert o.outputs[0].finish_reason == "length"
        assert o.num_cached_tokens == 0 and o.ttft is not None and o.ttft > 0


def test_cache_hit_same_prompt_and_extension(hf_llama):
    [p] = _prompts([22])
    eng = _engine(hf_llama)
    first = _run(eng, [("a", p, _greedy(10))])["a"]
    assert first.outputs[0].token_ids == _hf(hf_llama, p, 10)
    again = _run(eng, [("b", p, _greedy(10))])["b"]
    assert again.num_cached_tokens == 20            # (22 - 1) // 4 full blocks
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # Next "turn": prompt + reply + new user tokens; the reply's blocks were committed too.
    turn2 = p + first.outputs[0].token_ids + _prompts([7], seed=5)[0]
    t2 = _run(eng, [("c", turn2, _greedy(10))])["c"]
    # 31 computed tokens: 7 full blocks, and the 3 rows of the first turn's partial last
    # block, kept as a tail (core/tails.py) and taken by this turn
    assert t2.num_cached_tokens == 31
    assert t2.outputs[0].token_ids == _hf(hf_llama, turn2, 10)


def test_chunked_prefill_matches_hf(hf_llama):
    prompts = _prompts([29, 6])
    eng = _engine(hf_llama, max_num_seqs=2, max_tokens=8)   # 29-token prompt: 4+ chunks
    out = _run(eng, [(f"r{i}", p, _greedy(9)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].outputs[0].token_ids == _hf(hf_llama, p, 9)
    assert eng.stats()["prefill_tokens_computed"] == 35


def test_long_prefill_threshold_chunks_and_matches_hf(hf_llama):
    """vLLM's long_prefill_token_threshold: three prompts in flight, each computed 5 tokens a
    step, and every reply still the model's own."""
    prompts = _prompts([29, 17, 6])
    eng = _engine(hf_llama, engine_kw={"long_prefill_token_threshold": 5})
    out = _run(eng, [(f"r{i}", p, _greedy(7)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].outputs[0].token_ids == _hf(hf_llama, p, 7)
        # the time waiting (submission to first admission) is part of the time to first token
        assert 0 <= out[f"r{i}"].queue_time <= out[f"r{i}"].ttft
    assert eng.stats()["steps"] >= 29 // 5 + 7   # (uncapped: one prefill step for all)


def test_preemption_resumes_with_identical_output(hf_llama):
    prompts = _prompts([10, 13, 7, 11])
    # 4 requests x (prompt + 20 tokens) need ~26 blocks of 4; the pool has 16.
    eng = _engine(hf_llama, num_blocks=16, policy="duel")   # a policy that counts turns
    out = _run(eng, [(f"r{i}", p, _greedy(20)) for i, p in enumerate(prompts)])
    st = eng.stats()
    assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0
    assert any(o.num_preemptions for o in out.values())
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].outputs[0].token_ids == _hf(hf_llama, p, 20), f"request {i}"
    # the duel's forecast saw 4 turns, not one more per resumption
    forecast = next(m for m in eng.tree.policy.members if m.name == "forecast")
    assert forecast.requests == 4


def test_request_that_outgrows_the_pool_finishes_with_capacity(hf_llama):
    [p] = _prompts([6])
    eng = _engine(hf_llama, num_blocks=3)            # 12 token slots
    o = _run(eng, [("a", p, _greedy(30))])["a"]
    assert o.outputs[0].finish_reason == "capacity"   # never "length": max_tokens was not hit
    assert eng.stats()["unschedulable"] == 1
    assert o.outputs[0].token_ids == _hf(hf_llama, p, 30)[:len(o.outputs[0].token_ids)]
    assert not eng.has_unfinished_requests()


# ----------------------------------------------------------------------------- beam search

@pytest.mark.parametrize("k,lp,es,eos_step", [
    (2, 1.0, False, None), (3, 1.0, True, 2), (4, 0.5, False, 1), (3, 2.0, "never", 3),
    (2, -1.0, True, 0),
])
def test_beam_search_matches_hf(hf_llama, k, lp, es, eos_step):
    prompts = _prompts([7, 12], seed=3)
    eng = _engine(hf_llama)
    reqs, want = [], []
    for i, p in enumerate(prompts):
        kw = dict(num_beams=k, length_penalty=lp, early_stopping=es)
        stop = ()
        if eos_step is not None:  # an eos that the search meets: the greedy token at eos_step
            eos = _hf(hf_llama, p, eos_step + 1)[eos_step]
            kw["eos_token_id"], stop = eos, (eos,)
        want.append(_hf(hf_llama, p, 10, **kw))
        reqs.append((f"b{i}", p, SamplingParams(max_tokens=10, beam_width=k, length_penalty=lp,
                                                 early_stopping=es, stop_token_ids=stop)))
    out = _run(eng, reqs)
    for i, w in enumerate(want):
        assert out[f"b{i}"].outputs[0].token_ids == w, f"prompt {i}"
    # nothing leaked: every block is free, cached and unheld, or a kept partial tail
    bm = eng.block_manager
    assert bm.num_free_blocks + eng.tree.num_evictable() + len(bm.tails) == 128


def test_beam_search_survives_preemption(hf_llama):
    prompts = _prompts([9, 14, 5], seed=4)
    eng = _engine(hf_llama, num_blocks=12, max_num_seqs=9)   # 3 x 3 beams, 48 token slots
    reqs = [(f"b{i}", p, SamplingParams(max_tokens=14, beam_width=3))
            for i, p in enumerate(prompts)]
    out = _run(eng, reqs)
    assert eng.stats()["preemptions"] > 0
    for i, p in enumerate(prompts):
        assert out[f"b{i}"].outputs[0].token_ids == _hf(hf_llama, p, 14, num_beams=3), f"prompt {i}"


# ----------------------------------------------------------------------------- n samples

def test_n_samples_seeded_reproducible_and_distinct(hf_llama):
    [p, other] = _prompts([10, 6], seed=7)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=123, n=4)
    eng = _engine(hf_llama)
    a = _run(eng, [("a", p, params)])["a"]
    copies_after_a = eng.kv_mover.num_copies
    assert copies_after_a >= 3                       # children CoW the shared partial tail
    # Same request again, this time batched with another request: same samples.
    b = _run(eng, [("x", other, SamplingParams(max_tokens=5, temperature=0.7, seed=9)),
                   ("b", p, params)])["b"]
    toks_a = [o.token_ids for o in a.outputs]
    assert toks_a == [o.token_ids for o in b.outputs]
    assert len({tuple(t) for t in toks_a}) == 4, "samples with different seeds should differ"
    assert [o.index for o in a.outputs] == [0, 1, 2, 3]
    assert all(o.cumulative_logprob < 0 for o in a.outputs)


def test_engine_seed_makes_unseeded_sampling_repeat(hf_llama):
    """``EngineConfig.seed`` (vLLM's ``--seed``): the same unseeded sampled requests in the
    same order draw the same tokens on a fresh engine, a greedy request between them does not
    shift the sequence, and a request's own seed still wins."""
    prompts = _prompts([7, 11, 5], seed=9)

    def run(seed, greedy_between=False):
        eng = LLMEngine(copy.deepcopy(hf_llama), None,
                        CacheConfig(block_size=4, num_device_blocks=128),
                        EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, seed=seed),
                        model_id="tiny")
        reqs = [(f"s{i}", p, SamplingParams(max_tokens=8, temperature=1.0, n=2))
                for i, p in enumerate(prompts)]
        if greedy_between:
            reqs.insert(1, ("g", prompts[0], _greedy(4)))
        reqs.append(("own", prompts[0], SamplingParams(max_tokens=8, temperature=1.0, seed=3)))
        out = _run(eng, reqs)
        return {k: [c.token_ids for c in o.outputs] for k, o in out.items() if k != "g"}

    a, b = run(5), run(5, greedy_between=True)
    assert a == b
    c = run(6)
    assert c["own"] == a["own"] and any(c[k] != a[k] for k in ("s0", "s1", "s2"))
    with pytest.raises(ConfigError):
        EngineConfig(seed="x")


def test_topk1_sampling_equals_greedy(hf_llama):
    [p] = _prompts([8])
    out = _run(_engine(hf_llama),
               [("s", p, SamplingParams(max_tokens=8, temperature=0.8, top_k=1))])
    assert out["s"].outputs[0].token_ids == _hf(hf_llama, p, 8)


# ----------------------------------------------------------------------------- stops

class CharTokenizer:
    """Token t decodes to one character; 0 is a special token (skipped)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids if not (skip_special_tokens and t == 0))


def test_stop_token_ids_and_stop_strings(hf_llama):
    [p] = _prompts([9], seed=11)
    full = _hf(hf_llama, p, 12)
    text = CharTokenizer().decode(full)
    eng = _engine(hf_llama, tokenizer=CharTokenizer())
    stop_tok = full[4]
    n_tok = full.index(stop_tok) + 1
    stop_str = text[5:7]
    cut = text.index(stop_str)
    out = _run(eng, [
        ("tok", p, SamplingParams(max_tokens=12, stop_token_ids=[stop_tok])),
        ("str", p, SamplingParams(max_tokens=12, stop=[stop_str])),
        ("keep", p, SamplingParams(max_tokens=12, stop=[stop_str],
                                   include_stop_str_in_output=True)),
    ])
    o = out["tok"].outputs[0]
    assert o.token_ids == full[:n_tok] and o.finish_reason == "stop" and o.stop_reason == stop_tok
    o = out["str"].outputs[0]
    assert o.text == text[:cut] and o.finish_reason == "stop" and o.stop_reason == stop_str
    assert o.token_ids == full[:cut + 2]
    assert out["keep"].outputs[0].text == text[:cut + 2]
    # stop_after: ends there too, the string kept (whatever include_stop_str_in_output says)
    out = _run(eng, [("after", p, SamplingParams(max_tokens=12, stop_after=[stop_str])),
                     ("both", p, SamplingParams(max_tokens=12, stop=["\x00"],
                                                stop_after=[stop_str]))])
    for rid in ("after", "both"):
        o = out[rid].outputs[0]
        assert (o.text, o.finish_reason, o.stop_reason) == (text[:cut + 2], "stop", stop_str)


def test_min_tokens_masks_the_stop_tokens_as_transformers_does(hf_llama):
    """vLLM's ``min_tokens``: the stop token cannot be chosen (nor a stop string end the
    text) before that many tokens; the tokens equal transformers' ``min_new_tokens`` with the
    same end token, in a batch beside requests without it."""
    [p] = _prompts([9], seed=11)
    full = _hf(hf_llama, p, 12)
    stop_tok = full[2]
    want = _hf(hf_llama, p, 12, min_new_tokens=6, eos_token_id=stop_tok)
    assert want[2] != stop_tok and len(full) == 12   # the mask changes this request's tokens
    text = CharTokenizer().decode(full)
    assert len(text) == len(full)   # one character per token
    stop_str = text[1:3]
    eng = _engine(hf_llama, tokenizer=CharTokenizer())
    out = _run(eng, [
        ("plain", p, SamplingParams(max_tokens=12, stop_token_ids=[stop_tok])),
        ("min", p, SamplingParams(max_tokens=12, stop_token_ids=[stop_tok], min_tokens=6)),
        ("str", p, SamplingParams(max_tokens=12, stop=[stop_str], min_tokens=5)),
        ("n2", p, SamplingParams(max_tokens=12, stop_token_ids=[stop_tok], min_tokens=6, n=2,
                                 temperature=0.8, seed=3)),
    ])
    assert out["plain"].outputs[0].token_ids == full[:3]
    o = out["min"].outputs[0]
    assert o.token_ids == want[:want.index(stop_tok, 6) + 1 if stop_tok in want[6:] else 12]
    assert stop_tok not in o.token_ids[:6]
    # the stop string at characters 1-2 ends nothing; the first one ending at token 5 or
    # later does (the stop check looks back over the string's length, as vLLM's)
    o = out["str"].outputs[0]
    later = [i for i in range(3, len(text)) if text.startswith(stop_str, i)]
    if later:
        assert (o.text, o.finish_reason) == (text[:later[0]], "stop")
        assert o.token_ids == full[:later[0] + 2]
    else:
        assert (o.token_ids, o.finish_reason) == (full, "length")
    for c in out["n2"].outputs:
        assert len(c.token_ids) >= 6 and stop_tok not in c.token_ids[:6]
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidRequestError):
        SamplingParams(max_tokens=8, min_tokens=2, beam_width=2)


@pytest.mark.parametrize("budget", [256, 7])   # whole prompts; chunks of up to 7 tokens
def test_prompt_logprobs_are_transformers_log_softmax(hf_llama, budget):
    """vLLM's ``prompt_logprobs``: each prompt token's log-probability, rank and top-k equal
    ``log_softmax`` of transformers' logits at the position before it, also when the prompt is
    computed in chunks beside other requests and when its prefix is cached (it reads nothing
    from the cache: every position's logits are needed)."""
    p, q = _prompts([13, 9], seed=21)
    eng = _engine(hf_llama, max_tokens=budget, max_num_seqs=min(8, budget))
    _run(eng, [("warm", p, _greedy(2))])   # p's blocks are cached now
    with torch.no_grad():
        ref = torch.log_softmax(hf_llama(torch.tensor([p])).logits[0].float(), dim=-1)
    out = _run(eng, [("lp", p, SamplingParams(max_tokens=3, prompt_logprobs=3)),
                     ("other", q, _greedy(4)),
                     ("lp0", q, SamplingParams(max_tokens=1, prompt_logprobs=0))])
    o = out["lp"]
    assert o.num_cached_tokens == 0 and o.outputs[0].token_ids == _hf(hf_llama, p, 3)
    lps = o.prompt_logprobs
    assert len(lps) == len(p) and lps[0] is None
    for i in range(1, len(p)):
        e, row = lps[i], ref[i - 1]
        assert e.token_id == p[i]
        assert e.logprob == pytest.approx(float(row[p[i]]), abs=1e-4)
        assert e.rank == int((row > row[p[i]]).sum()) + 1
        vals, ids = torch.topk(row, 3)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-4)
    assert out["other"].prompt_logprobs is None
    lq = out["lp0"].prompt_logprobs
    assert len(lq) == len(q) and all(e.top == () and e.token_id == t
                                     for e, t in zip(lq[1:], q[1:]))
    # preempted and recomputed: each position recorded once, the same values
    eng = _engine(hf_llama, num_blocks=16)
    prompts = _prompts([10, 13, 7, 11])
    out = _run(eng, [(f"r{i}", x, SamplingParams(max_tokens=20, prompt_logprobs=1))
                     for i, x in enumerate(prompts)])
    assert any(o.num_preemptions for o in out.values())
    for i, x in enumerate(prompts):
        with torch.no_grad():
            want = torch.log_softmax(hf_llama(torch.tensor([x])).logits[0].float(), dim=-1)
        got = out[f"r{i}"].prompt_logprobs
        assert [e.token_id for e in got[1:]] == x[1:]
        assert [e.logprob for e in got[1:]] == pytest.approx(
            [float(want[j - 1, x[j]]) for j in range(1, len(x))], abs=1e-4)
    with pytest.raises(InvalidRequestError):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError):
        SamplingParams(beam_width=2, prompt_logprobs=1)


def test_logprob_token_ids_are_transformers_log_softmax_at_those_tokens(hf_llama):
    """vLLM's ``logprob_token_ids``: every generated token's entry lists these tokens'
    log-probabilities, in the order given (a label set), equal to ``log_softmax`` of
    transformers' logits at that position; greedy, sampled with n=2 (each sample its own
    rows) and beside requests that ask nothing; the tokens chosen are unchanged."""
    p, q = _prompts([11, 7], seed=5)
    labels = (17, 3, 200, 3)
    eng = _engine(hf_llama)
    out = _run(eng, [("ids", p, SamplingParams(max_tokens=4, logprob_token_ids=labels)),
                     ("plain", q, _greedy(3)),
                     ("n2", q, SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=3,
                                              logprob_token_ids=[5]))])
    o = out["ids"].outputs[0]
    assert o.token_ids == _hf(hf_llama, p, 4) and len(o.logprobs) == 4
    seq = list(p)
    for e, tok in zip(o.logprobs, o.token_ids):
        with torch.no_grad():
            row = torch.log_softmax(hf_llama(torch.tensor([seq])).logits[0, -1].float(), -1)
        assert [t for t, _ in e.top] == list(labels)
        assert [v for _, v in e.top] == pytest.approx([float(row[t]) for t in labels],
                                                      abs=1e-4)
        assert e.token_id == tok and e.logprob == pytest.approx(float(row[tok]), abs=1e-4)
        seq.append(tok)
    assert out["plain"].outputs[0].logprobs is None
    for c in out["n2"].outputs:
        seq = list(q)
        for e in c.logprobs:
            with torch.no_grad():
                row = torch.log_softmax(hf_llama(torch.tensor([seq])).logits[0, -1].float(),
                                        -1)
            assert e.top[0][0] == 5 and e.top[0][1] == pytest.approx(float(row[5]), abs=1e-4)
            seq.append(e.token_id)
    for bad in ({"logprob_token_ids": []}, {"logprob_token_ids": [1], "logprobs": 2},
                {"logprob_token_ids": [-1]}, {"logprob_token_ids": [1], "beam_width": 2},
                {"logprob_token_ids": list(range(257))}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequestError, match="logprob_token_ids"):
        eng.add_request("big", p, SamplingParams(logprob_token_ids=[10**6]))
    assert not eng.has_request("big")


class UniTokenizer:
    """Token t is the one character chr(0x100 + t), both ways (so any token sequence is a
    string that tokenizes back to it); 0 is a special token."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x100 + t) for t in ids if not (skip_special_tokens and t == 0))

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 0x100 for c in text if ord(c) >= 0x100]


def _masked_greedy(model, prompt, n, mask):
    """Greedy decoding one token at a time with ``mask(logits row, output so far)`` applied to
    each choice: the reference for masks transformers has no processor for."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([ids])).logits[0, -1].float()
        t = int(mask(row.clone(), out).argmax())
        out.append(t)
        ids.append(t)
    return out


def test_allowed_token_ids_and_bad_words_as_vllm_applies_them(hf_llama):
    """vLLM's ``allowed_token_ids`` (only those tokens) and ``bad_words`` (a word's last token
    is banned where the output ends with its other tokens; a one-token word always), in one
    batch with an unmasked request, against greedy decoding with the same masks."""
    from radixkv.engine.validation import bad_words_ids

    p, q = _prompts([9, 6], seed=5)
    full = _hf(hf_llama, p, 10)
    allowed = sorted({full[1], full[4], 3, 7, 11})

    def only(row, out):
        keep = torch.full_like(row, float("-inf"))
        keep[allowed] = row[allowed]
        return keep

    tok = UniTokenizer()
    words = [tok.decode(full[2:4]), tok.decode([full[6]])]   # a two-token and a one-token word
    bad = bad_words_ids(tok, words)
    assert bad == ((full[2], full[3]), (full[6],))

    def no_bad(row, out):
        for w in bad:
            if len(w) == 1 or out[-(len(w) - 1):] == list(w[:-1]):
                row[w[-1]] = float("-inf")
        return row

    eng = _engine(hf_llama, tokenizer=tok)
    out = _run(eng, [
        ("only", p, SamplingParams(max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)),
        ("bad", p, SamplingParams(max_tokens=10, ignore_eos=True, bad_words=words)),
        ("plain", q, SamplingParams(max_tokens=6, ignore_eos=True)),
    ])
    got = out["only"].outputs[0].token_ids
    assert got == _masked_greedy(hf_llama, p, 10, only) and set(got) <= set(allowed)
    got = out["bad"].outputs[0].token_ids
    assert got == _masked_greedy(hf_llama, p, 10, no_bad) and got != full
    assert full[6] not in got
    assert out["plain"].outputs[0].token_ids == _hf(hf_llama, q, 6)
    for kw in ({"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"bad_words": [" "]}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kw)
    with pytest.raises(InvalidRequestError):   # outside the vocabulary, or no tokenizer
        eng.add_request("x", p, SamplingParams(allowed_token_ids=[10**6]))
    with pytest.raises(InvalidRequestError):
        _engine(hf_llama).add_request("y", p, SamplingParams(bad_words=["ab"]))
    assert not eng.has_unfinished_requests()


def test_streaming_deltas_add_up(hf_llama):
    [p] = _prompts([9], seed=11)
    eng = _engine(hf_llama, tokenizer=CharTokenizer())
    eng.add_request("s", p, SamplingParams(max_tokens=12, stop=["zz"]))
    text, toks = "", []
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.outputs[0].delta_text
            toks += o.outputs[0].delta_token_ids
            last = o
    assert text == last.outputs[0].text and toks == last.outputs[0].token_ids
    assert toks == _hf(hf_llama, p, 12)


def test_final_only_outputs_equal_the_streamed_result(hf_llama):
    # output_kind="final_only": no snapshot until the request ends, then the same completion
    # as a streamed request (text, tokens, stop, logprobs, n samples), with deltas holding all.
    ps = _prompts([9, 14], seed=12)
    kinds = {}
    for kind in ("cumulative", "final_only"):
        eng = _engine(hf_llama, tokenizer=CharTokenizer())
        reqs = [(f"s{i}", p, SamplingParams(max_tokens=10, stop=["zz"], logprobs=2, n=2,
                                            temperature=0.8, seed=5, output_kind=kind))
                for i, p in enumerate(ps)]
        for rid, p, sp in reqs:
            eng.add_request(rid, p, sp)
        seen: dict[str, list] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                seen.setdefault(o.request_id, []).append(o)
        kinds[kind] = seen
    for rid, snaps in kinds["final_only"].items():
        [final] = snaps
        assert final.finished
        streamed = kinds["cumulative"][rid]
        assert len(streamed) > 1
        for a, b in zip(final.outputs, streamed[-1].outputs):
            assert (a.text, a.token_ids, a.finish_reason, a.stop_reason, a.logprobs) == \
                (b.text, b.token_ids, b.finish_reason, b.stop_reason, b.logprobs)
            assert a.delta_token_ids == a.token_ids and a.delta_text == a.text
            assert a.delta_logprobs == a.logprobs
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="delta")


# ----------------------------------------------------------------------------- bad requests

def test_bad_requests_do_not_disturb_requests_in_flight(hf_llama):
    [p] = _prompts([11])
    eng = _engine(hf_llama)
    eng.add_request("good", p, _greedy(10))
    eng.step()
    eng.step()
    bad = [
        ("empty", [], _greedy(4), "empty"),
        ("long", [1] * 512, _greedy(4), "context"),
        ("oov", [1, 999], _greedy(4), "999"),
        ("dup", p, _greedy(4), "already"),
    ]
    for rid, prompt, params, msg in bad:
        with pytest.raises(InvalidRequestError, match=msg):
            eng.add_request("good" if rid == "dup" else rid, prompt, params)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request("neg", p, SamplingParams(max_tokens=-1))
    with pytest.raises(InvalidRequestError, match="'temprature'"):
        eng.add_request("typo", p, {"temprature": 0.5})
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        eng.add_request("stop", p, SamplingParams(stop=["x"]))
    final = _run(eng, [])
    assert final["good"].outputs[0].token_ids == _hf(hf_llama, p, 10)
    assert eng.stats()["prompt_tokens"] == 11


def test_abort(hf_llama):
    prompts = _prompts([8, 8], seed=2)
    eng = _engine(hf_llama)
    eng.add_request("a", prompts[0], _greedy(20))
    eng.add_request("b", prompts[1], _greedy(5))
    eng.step()
    eng.abort_request("a")
    eng.abort_request("nope")
    final = _run(eng, [])
    assert final["a"].outputs[0].finish_reason == "abort"
    assert final["b"].outputs[0].token_ids == _hf(hf_llama, prompts[1], 5)
    assert eng.stats()["num_running"] == 0


# ----------------------------------------------------------------------------- stats, namespaces

def test_stats_hit_rate_exact(hf_llama):
    [p, q] = _prompts([12, 9], seed=8)
    eng = _engine(hf_llama)
    _run(eng, [("a", p, _greedy(3))])
    _run(eng, [("b", p, _greedy(3)), ("c", q, _greedy(3))])
    st = eng.stats()
    # a: 12 computed; b: (12-1)//4 = 2 blocks = 8 tokens cached; c: cold.
    assert st["prompt_tokens"] == 33 and st["cached_prompt_tokens"] == 8
    assert st["hit_rate"] == pytest.approx(8 / 33)
    assert st["cached_prompt_tokens_per_tier"] == [8]
    assert st["prefill_tokens_computed"] == 12 + 4 + 9
    assert st["preemptions"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0


def test_kv_utilization_counts_shared_blocks_once(hf_llama):
    [p] = _prompts([10])
    eng = _engine(hf_llama)
    eng.add_request("a", p, SamplingParams(max_tokens=8, temperature=1.0, seed=0, n=3))
    eng.step()      # prefill + fork: 3 sequences share 3 blocks (2 full + partial tail of 2)
    st = eng.stats()
    assert st["kv_slots_allocated"] == 12 and st["kv_tokens_stored"] == 10
    assert st["kv_utilization"] == pytest.approx(10 / 12)


def test_cache_salt_and_disabled_prefix_cache(hf_llama):
    [p] = _prompts([13])
    eng = _engine(hf_llama)
    eng.add_request("a", p, _greedy(2), cache_salt="tenant-1")
    _run(eng, [])
    eng.add_request("b", p, _greedy(2), cache_salt="tenant-2")
    eng.add_request("c", p, _greedy(2), cache_salt="tenant-1")
    out = _run(eng, [])
    assert out["b"].num_cached_tokens == 0 and out["c"].num_cached_tokens == 12
    off = _engine(hf_llama, enable_prefix_caching=False)
    _run(off, [("a", p, _greedy(2))])
    assert _run(off, [("b", p, _greedy(2))])["b"].num_cached_tokens == 0


def test_config_errors(hf_llama):
    with pytest.raises(ConfigError):
        CacheConfig(block_size=6)
    with pytest.raises(ConfigError):
        EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ConfigError, match="disk_dir"):
        _engine(hf_llama, disk_blocks=8)
    eng = LLMEngine(copy.deepcopy(hf_llama), None, CacheConfig(device_memory="1MiB"),
                    EngineConfig(), "tiny")
    # 3 layers x 2 x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 12 KiB per block
    assert eng.block_manager.pool.num_blocks == (1 << 20) // (3 * 2 * 16 * 2 * 16 * 4)


# ----------------------------------------------------------------------------- embedded model

@pytest.fixture(scope="module")
def smol():
    from radixkv.models import load_model, load_tokenizer

    tok = load_tokenizer()
    model = load_model()  # one copy (loading is the slow part): the reference toggles sdpa
    eng = LLMEngine(model, tok, CacheConfig(num_device_blocks=256),
                    EngineConfig(max_num_seqs=4), model_id="SmolLM2-135M-Instruct")
    return model, tok, eng


def _hf_sdpa(model, prompt, max_new):
    """transformers' generate on the engine's own model object, with its sdpa attention."""
    from radixkv.engine.attention import ATTN_IMPLEMENTATION

    model.set_attn_implementation("sdpa")
    try:
        return _hf(model, prompt, max_new)
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


@pytest.mark.model
def test_embedded_model_greedy_and_two_turn_chat_hits_cache(smol):
    hf, tok, eng = smol
    msgs = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three primary colors."}]
    p1 = tok.apply_chat_template(msgs, add_generation_prompt=True)
    p1 = list(p1["input_ids"] if isinstance(p1, dict) or hasattr(p1, "keys") else p1)
    r1 = _run(eng, [("t1", p1, SamplingParams(max_tokens=16))])["t1"]
    assert r1.outputs[0].token_ids == _hf_sdpa(hf, p1, 16)
    assert r1.num_cached_tokens == 0 and r1.outputs[0].text
    # Turn 2 at the token level: history + reply ids + the next user message.
    nxt = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "x"},
                                          {"role": "user", "content": "And secondary?"}],
                                  add_generation_prompt=True)
    nxt = list(nxt["input_ids"] if hasattr(nxt, "keys") else nxt)
    tail = nxt[nxt.index(tok.convert_tokens_to_ids("<|im_end|>"), len(p1)):]
    p2 = p1 + r1.outputs[0].token_ids + tail
    r2 = _run(eng, [("t2", p2, SamplingParams(max_tokens=16))])["t2"]
    assert r2.num_cached_tokens >= (len(p1) + len(r1.outputs[0].token_ids) - 1) // 16 * 16
    assert r2.outputs[0].token_ids == _hf_sdpa(hf, p2, 16)
    assert eng.stats()["hit_rate"] > 0.4


# ----------------------------------------------------------------------------- warm-up

def test_warm_up_runs_a_prefill_and_a_decode_on_free_blocks_and_changes_nothing(
        hf_llama, monkeypatch):
    """EngineConfig.warm_up (default on): two forwards at construction (a prefill of a block
    less one token, then one decode token), before any block is handed out; afterwards the
    pool, the tree and the counters are those of a fresh engine, and greedy output is the
    same as without it (and as transformers')."""
    from radixkv.engine.model_runner import ModelRunner

    seen: list[tuple[int, str]] = []
    original = ModelRunner.execute

    def spy(self, batch):
        seen.append((int(batch.input_ids.shape[-1]), batch.mode.name))
        return original(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", spy)
    warm = _engine(hf_llama, num_blocks=16, block_size=4)
    assert seen == [(3, "PREFILL"), (1, "DECODE")] and warm.warm_up_s > 0
    bm = warm.block_manager
    assert bm.num_free_blocks == 16 and len(warm.tree) == 0
    stats = warm.stats()
    assert stats["prompt_tokens"] == stats["tokens_computed"] == 0
    assert stats["cached_blocks_per_tier"] == [0]
    assert warm.num_forwards == 0
    seen.clear()
    cold = LLMEngine(copy.deepcopy(hf_llama), None,
                     CacheConfig(block_size=4, num_device_blocks=16),
                     EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, warm_up=False),
                     model_id="tiny")
    assert seen == [] and cold.warm_up_s == 0.0
    prompts = _prompts([3, 7, 13])
    want = [_hf(hf_llama, p, 8) for p in prompts]
    for eng in (warm, cold):
        final = _run(eng, [(f"r{i}", p, _greedy(8)) for i, p in enumerate(prompts)])
        assert [final[f"r{i}"].outputs[0].token_ids for i in range(3)] == want
    with pytest.raises(ConfigError, match="warm_up"):
        EngineConfig(warm_up=1)


def test_warm_up_builds_the_packed_gemm_kernels_for_small_row_counts(hf_llama, monkeypatch):
    """Where the CPU's lean forward packs its GEMMs, the warm-up also runs layer 0's four GEMM
    shapes (and the head, for a few rows) on 1, 2, ... rows at one thread and at the
    configured count, so that oneDNN's per-row-count kernels exist before requests need them
    (a new prompt length had paid ~2 ms); it stops at ModelRunner.WARM_GEMM_ROWS or the time
    budget, restores the thread count, and leaves outputs as they were."""
    import torch

    from radixkv.engine import model_runner as mr
    from radixkv.engine import packed_linear

    if not packed_linear.packing_supported(next(hf_llama.parameters()).dtype,
                                           torch.device("cpu")):
        pytest.skip("this CPU does not pack the test model's dtype (oneDNN)")
    monkeypatch.setenv(mr.WARM_ROWS_VAR, "6")   # the suite's conftest sets 0
    monkeypatch.setattr(mr, "WARM_HEAD_ROWS", 2)
    calls: list[tuple[int, bool, int]] = []
    original = mr.decoder_forward.DecoderForward.warm_gemms

    def spy(self, rows, head):
        calls.append((rows, head, torch.get_num_threads()))
        return original(self, rows, head)

    monkeypatch.setattr(mr.decoder_forward.DecoderForward, "warm_gemms", spy)
    before = torch.get_num_threads()
    eng = _engine(hf_llama, num_blocks=16, block_size=4)
    assert torch.get_num_threads() == before
    runner = eng.model_runner
    assert runner.warm_gemm_rows == 6
    counts = sorted({1, before})
    assert calls == [(r, r <= 2, n) for r in range(1, 7) for n in counts]
    prompts = _prompts([3, 7])
    final = _run(eng, [(f"r{i}", p, _greedy(6)) for i, p in enumerate(prompts)])
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(2)] == \
        [_hf(hf_llama, p, 6) for p in prompts]
    calls.clear()
    plain = LLMEngine(copy.deepcopy(hf_llama), None,
                      CacheConfig(block_size=4, num_device_blocks=16),
                      EngineConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                   pack_weights=False), model_id="tiny")
    assert plain.model_runner.warm_gemm_rows == 0 and calls == []
    for bad in ("many", "-3"):
        monkeypatch.setenv(mr.WARM_ROWS_VAR, bad)
        with pytest.raises(ConfigError, match="RADIXKV_WARM_GEMM_ROWS"):
            _engine(hf_llama, num_blocks=16, block_size=4)


def test_pack_weights_false_runs_the_weights_as_loaded_and_true_is_checked(hf_llama):
    """EngineConfig.pack_weights: False keeps (or makes) every linear a plain nn.Linear, even
    on a model an earlier engine packed, and its greedy tokens are transformers'; True where
    this CPU does not pack the dtype is a ConfigError before anything loads."""
    from radixkv.engine import packed_linear

    def engine(model, **ec):
        return LLMEngine(model, None, CacheConfig(block_size=4, num_device_blocks=16),
                         EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, **ec),
                         model_id="tiny")

    def packed(model):
        return any(isinstance(m, packed_linear.PackedLinear) for m in model.modules())

    model = copy.deepcopy(hf_llama)
    first = engine(model)                                 # default: where this CPU packs
    assert packed(first.model) == (torch.float32 in packed_linear.PACKED_DTYPES)
    plain = engine(model, pack_weights=False)
    assert not packed(plain.model)
    prompts = _prompts([3, 7, 13])
    want = [_hf(hf_llama, p, 8) for p in prompts]
    final = _run(plain, [(f"r{i}", p, _greedy(8)) for i, p in enumerate(prompts)])
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(3)] == want
    if torch.float32 in packed_linear.PACKED_DTYPES:
        assert packed(engine(copy.deepcopy(hf_llama), pack_weights=True).model)
    with pytest.raises(ConfigError, match="pack_weights=True"):
        engine(copy.deepcopy(hf_llama), dtype="float16", pack_weights=True)
    with pytest.raises(ConfigError, match="pack_weights"):
        EngineConfig(pack_weights=1)
