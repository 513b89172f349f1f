"""SamplingParams validation, the token-choice functions and incremental detokenization."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.sampling import (
    SamplingParams, draw_tokens, filtered_probs, filtered_probs_rows, greedy_tokens,
    make_generator, raw_logprobs, sample_token, greedy_and_logsumexp,
)
from radixkv.errors import InvalidRequestError


@pytest.mark.parametrize("kw,msg", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"n": 0}, "n must"), ({"beam_width": 0}, "beam_width"),
    ({"seed": 1.5}, "seed"), ({"stop": [""]}, "stop"), ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"beam_width": 2, "temperature": 0.5}, "deterministic"),
    ({"beam_width": 2, "n": 3}, "n \\(3\\)"),
    ({"beam_width": 2, "stop": ["x"]}, "stop strings"),
])
def test_invalid_params_raise_invalid_request(kw, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kw)


def test_from_dict_names_unknown_key_and_normalises_lists():
    with pytest.raises(InvalidRequestError, match="'max_new_tokens'"):
        SamplingParams.from_dict({"max_new_tokens": 3})
    p = SamplingParams.from_dict({"stop": ["a", "b"], "stop_token_ids": [1]})
    assert p.stop == ("a", "b") and p.stop_token_ids == (1,)
    assert SamplingParams(stop="x").stop == ("x",)
    assert hash(p) is not None                      # frozen and hashable


def test_greedy_ties_lowest_id_and_logprobs():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert greedy_tokens(logits) == [1, 0]
    lp = raw_logprobs(logits, [1, 3])
    assert lp[1] == pytest.approx(-torch.log(torch.tensor(4.0)).item())


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0]))     # 0.5 + 0.3 reaches 0.8
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (p > 0).sum() == 3
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))
    assert torch.equal(p, torch.tensor([1.0, 0, 0, 0]))               # top token always stays
    cold = filtered_probs(logits, SamplingParams(temperature=0.1))
    assert cold[0] > 0.99


def test_seeded_generator_is_reproducible():
    logits = torch.zeros(50)
    params = SamplingParams(temperature=1.0, seed=5)

    def draw():
        g = make_generator(5, torch.device("cpu"))
        return [sample_token(logits, params, g) for _ in range(20)]

    assert draw() == draw()
    g = make_generator(6, torch.device("cpu"))
    assert [sample_token(logits, params, g) for _ in range(20)] != draw()


class Chars:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


class Utf8Bytes:
    """Token i = byte i: multi-byte characters span several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_incremental_text_and_stop_search():
    d = IncrementalDetokenizer(Chars(), stop=["cd", "zz"])
    news = [d.append(t) for t in [0, 1, 2]]
    assert news == ["a", "b", "c"] and d.find_stop(1) is None
    assert d.emittable_len(False) == 2                # "c" might start "cd": held back
    d.append(3)
    assert d.find_stop(1) == ("cd", 2)


def test_detokenizer_waits_for_complete_utf8():
    d = IncrementalDetokenizer(Utf8Bytes())
    e = "é".encode()                                   # two bytes
    assert d.append(ord("x")) == "x"
    assert d.append(e[0]) == ""
    assert d.append(e[1]) == "é"
    assert d.text == "xé"


def test_greedy_ties_lowest_id_on_a_real_vocabulary():
    """Ties far apart in a 49k vocabulary (vectorized max reductions): still the lowest id."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 49152, generator=g)
    want = []
    for r in range(16):
        lo, hi = sorted(torch.randint(0, 49152, (2,), generator=g).tolist())
        hi = hi if hi != lo else lo + 1
        logits[r, lo] = logits[r, hi] = 10.0 + r
        want.append(lo)
    assert greedy_tokens(logits) == want == logits.argmax(dim=-1).tolist()
    assert greedy_tokens(logits.to(torch.bfloat16)) == want


def test_native_greedy_pass_matches_log_softmax():
    """The step's native pass over float32 CPU logits (used when no request wants top
    logprobs): the same greedy tokens (ties far apart -> lowest id), and logit - lse equal to
    the float64 log_softmax's entry within 5e-6 (one float32 sum over a 49152-entry row was
    off by 2.4e-5 with AVX2; torch's own float32 log_softmax by 1.2e-5 there); a NaN row makes
    it decline (torch's path runs)."""
    from radixkv.kernels import native

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 49152, generator=g) * 4
    logits[2, 7] = logits[2, 40000] = 99.0
    logits[5] = float("-inf")
    logits[5, 123] = 0.0
    fast = greedy_and_logsumexp(logits)
    if not native.available():
        assert fast is None
        return
    assert fast is not None
    argmax, lse = fast
    assert argmax == greedy_tokens(logits) and argmax[2] == 7 and len(lse) == 16
    full = torch.log_softmax(logits.double(), dim=-1)
    got = [float(logits[r, t]) - lse[r] for r, t in enumerate(argmax)]
    want = [float(full[r, t]) for r, t in enumerate(argmax)]
    assert got == pytest.approx(want, abs=5e-6)
    logits[9, 3] = float("nan")
    assert greedy_and_logsumexp(logits) is None


# ----------------------------------------------------------------------------- batched draws

def _one_row_reference(logits, params):
    """The filters one row at a time, as the engine applied them before rows were batched."""
    x = logits.float() / params.temperature
    if params.min_p > 0:
        p0 = torch.softmax(x, dim=-1)
        x = x.masked_fill(p0 < params.min_p * p0.max(), float("-inf"))
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = (sorted_p.cumsum(0) - sorted_p) >= params.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


_row_params = st.builds(
    SamplingParams, temperature=st.sampled_from([0.3, 0.7, 1.0, 1.9]),
    top_k=st.sampled_from([0, 1, 3, 7, 40]), top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]))


@settings(max_examples=60, deadline=None)
@given(params=st.lists(_row_params, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_filtered_probs_rows_equal_the_row_by_row_filters(params, seed):
    """Each row of the batched filters (different knobs per row) is the one-row filter's
    result for that row: batching the rows changes no probability."""
    logits = torch.randn(len(params), 40, generator=torch.Generator().manual_seed(seed)) * 3
    got = filtered_probs_rows(logits, params)
    for r, p in enumerate(params):
        want = _one_row_reference(logits[r], p)
        torch.testing.assert_close(got[r], want, atol=1e-6, rtol=1e-5)
        assert torch.equal(got[r] > 0, want > 0), (r, p)   # the same tokens survive


def test_draw_tokens_follow_the_probabilities_and_never_a_dropped_token():
    """The exponential race draws token v with probability probs[v]: 40,000 rows of
    [0.5, 0.3, 0.2, 0] land within 1.5 points of each share, and never on the 0."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0]).repeat(40_000, 1)
    g = make_generator(11, torch.device("cpu"))
    toks = draw_tokens(probs, [g] * len(probs))
    share = torch.bincount(toks, minlength=4).double() / len(toks)
    assert share[3] == 0
    torch.testing.assert_close(share[:3], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
                               atol=0.015, rtol=0)


def test_draw_tokens_rows_use_their_own_generators():
    """A row's token depends on its own generator alone: the same seeded generator gives the
    same token whether its row is drawn alone or beside others."""
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(2)), -1)
    alone = [int(draw_tokens(probs[r:r + 1], [make_generator(100 + r, torch.device("cpu"))])[0])
             for r in range(5)]
    together = draw_tokens(probs, [make_generator(100 + r, torch.device("cpu"))
                                   for r in range(5)]).tolist()
    assert together == alone


def test_sampled_step_reads_the_device_once_whatever_the_number_of_sequences(make_tiny,
                                                                             monkeypatch):
    """Sampled tokens and their log-probabilities come back in one transfer per step (one
    ``tolist`` for the batch), not an ``.item()`` and a ``float()`` per sequence, each a device
    sync on CUDA: a decode step of 2 sampled sequences and one of 8 read the same number of
    times."""
    import copy

    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    hf = make_tiny("llama")
    reads = {"n": 0}
    for name in ("item", "tolist", "__float__", "__int__"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **kw):
            reads["n"] += 1
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counted)

    def reads_per_decode_step(n: int) -> int:
        eng = LLMEngine(copy.deepcopy(hf), None, CacheConfig(block_size=4, num_device_blocks=256),
                        EngineConfig(max_num_seqs=16, max_num_batched_tokens=256),
                        model_id="tiny")
        eng.add_request("r", [5, 9, 13, 2, 7, 1], SamplingParams(max_tokens=6, temperature=1.0,
                                                                 n=n, seed=3, ignore_eos=True))
        eng.step()          # prefill and the first token of each sample (the fork)
        eng.step()          # first decode step: the forks' copy-on-write settles
        before = reads["n"]
        eng.step()          # a plain decode step of n sampled sequences
        return reads["n"] - before

    two, eight = reads_per_decode_step(2), reads_per_decode_step(8)
    assert two == eight, (two, eight)


@settings(max_examples=25, deadline=None)
@given(scales=st.lists(st.sampled_from([0.05, 1.0, 4.0, 12.0]), min_size=1, max_size=5),
       tops=st.lists(st.sampled_from([1.0, 0.99, 0.9, 0.5]), min_size=5, max_size=5),
       seed=st.integers(0, 2**16))
def test_top_p_over_a_large_vocabulary_keeps_the_same_tokens(scales, tops, seed):
    """Over a vocabulary larger than the CPU's top-p candidates, peaked rows (whose nucleus lies
    inside the candidates: no sort) and flat rows (sorted whole) keep exactly the tokens the
    row-by-row filter keeps."""
    from radixkv.engine import sampling

    vocab = 6 * sampling.TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(seed)
    logits = torch.stack([torch.randn(vocab, generator=g) * s for s in scales])
    params = [SamplingParams(temperature=1.0, top_p=t) for t in tops[:len(scales)]]
    got = filtered_probs_rows(logits, params)
    for r, p in enumerate(params):
        want = _one_row_reference(logits[r], p)
        assert torch.equal(got[r] > 0, want > 0), (r, p, scales[r])
        torch.testing.assert_close(got[r], want, atol=1e-6, rtol=1e-5)


def test_top_p_candidates_path_is_taken_only_where_the_nucleus_fits(monkeypatch):
    """A peaked row is served from the candidates without sorting the vocabulary; a flat row
    (its nucleus larger than the candidates) is sorted."""
    from radixkv.engine import sampling

    vocab = 8 * sampling.TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(1)
    sorted_rows = []
    real_sort = torch.Tensor.sort

    def counting_sort(self, *a, **kw):
        sorted_rows.append(self.shape[0])
        return real_sort(self, *a, **kw)
    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    peaked = torch.randn(1, vocab, generator=g) * 12
    flat = torch.randn(1, vocab, generator=g) * 0.05
    filtered_probs_rows(torch.cat([peaked, flat]), [SamplingParams(temperature=1.0, top_p=0.9)] * 2)
    assert sorted_rows == [1]               # the flat row alone
    sorted_rows.clear()
    filtered_probs_rows(peaked, [SamplingParams(temperature=1.0, top_p=0.9)])
    assert sorted_rows == []


@pytest.mark.parametrize("kw", [dict(n=2), dict(n=8, temperature=1.0),
                                dict(n=8, temperature=1.0, top_p=0.9, frequency_penalty=0.2,
                                     logit_bias={3: 1.5}),
                                dict(n=3, temperature=1.0, logprobs=2),
                                dict(n=2, logprobs=3, repetition_penalty=1.2)],
                         ids=["greedy", "sampled", "penalized", "logprobs", "adjusted-greedy"])
def test_a_decode_step_takes_one_read_on_the_device_path(make_tiny, monkeypatch, kw):
    """With the logits on a device (the native CPU pass off, as on CUDA), a decode step reads
    back once: greedy tokens, their log-probabilities, adjusted argmaxes, the draws and the
    top log-probabilities all come in one transfer (``StepReads``). Each read on CUDA is a
    stream sync; tests/kernels/test_cuda_sampling_blend.py counts the syncs on a card."""
    import copy

    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine import llm_engine, sampling
    from radixkv.engine.llm_engine import LLMEngine

    for mod in (llm_engine, sampling):
        monkeypatch.setattr(mod, "greedy_and_logsumexp", lambda logits: None, raising=False)
    monkeypatch.setattr(sampling.StepReads, "_one_transfer", lambda self: True, raising=False)
    reads = {"n": 0}
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            reads["n"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    eng = LLMEngine(copy.deepcopy(make_tiny("llama")), None,
                    CacheConfig(block_size=4, num_device_blocks=256),
                    EngineConfig(max_num_seqs=16, max_num_batched_tokens=256), model_id="tiny")
    eng.add_request("r", [5, 9, 13, 2, 7, 1], SamplingParams(max_tokens=6, seed=3,
                                                             ignore_eos=True, **kw))
    eng.step()
    eng.step()
    before = reads["n"]
    outs = eng.step()
    assert reads["n"] - before == 1
    assert outs and all(len(c.token_ids) == 3 for c in outs[0].outputs)
