"""Penalties and logit_bias (engine/sampling.adjust_logits) against OpenAI's formula, written
out per token, and the validation of their ranges."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.engine.sampling import SamplingParams, adjust_logits
from radixkv.errors import InvalidRequestError

V = 11


def _reference(row: torch.Tensor, p: SamplingParams, out_ids: list[int], prompt: list[int]
               ) -> torch.Tensor:
    """vLLM's order, one token at a time: the bias, then the repetition penalty on tokens of
    the prompt or the output (divide a positive logit, multiply the others), then OpenAI's
    formula mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty."""
    res = row.clone()
    for t, b in p.logit_bias:
        res[t] += b
    for j in range(V):
        if j in out_ids or j in prompt:
            res[j] = res[j] / p.repetition_penalty if res[j] > 0 else \
                res[j] * p.repetition_penalty
        c = out_ids.count(j)
        res[j] -= c * p.frequency_penalty + (1.0 if c > 0 else 0.0) * p.presence_penalty
    return res


params_st = st.builds(
    SamplingParams,
    frequency_penalty=st.floats(-2, 2), presence_penalty=st.floats(-2, 2),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    logit_bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=4))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(params_st, st.lists(st.integers(0, V - 1), max_size=12),
                          st.lists(st.integers(0, V - 1), max_size=6)),
                min_size=1, max_size=5), st.integers(0, 2**31 - 1))
def test_adjust_logits_matches_the_formula_row_by_row(rows: list, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(rows) + 1, V, generator=g)   # the last row is left alone
    got = adjust_logits(logits, [(r, p, ids) for r, (p, ids, _) in enumerate(rows)],
                        [prompt for _, _, prompt in rows])
    for r, (p, ids, prompt) in enumerate(rows):
        torch.testing.assert_close(got[r], _reference(logits[r], p, ids, prompt), rtol=1e-5,
                                   atol=1e-4)
    assert torch.equal(got[-1], logits[-1])


def test_a_bias_of_100_forces_the_token_and_minus_100_bans_it() -> None:
    logits = torch.zeros(2, V)
    logits[:, 3] = 5.0
    out = adjust_logits(logits, [(0, SamplingParams(logit_bias={7: 100}), []),
                                 (1, SamplingParams(logit_bias={3: -100}), [])])
    assert int(out[0].argmax()) == 7 and int(out[1].argmax()) != 3


def test_min_p_keeps_the_tokens_within_that_share_of_the_most_likely() -> None:
    from radixkv.engine.sampling import filtered_probs

    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.15))
    assert (probs > 0).tolist() == [True, True, True, False, False]   # 0.1 >= 0.15 * 0.5
    torch.testing.assert_close(probs[:3], torch.tensor([0.5, 0.3, 0.1]) / 0.9)
    assert torch.equal(filtered_probs(logits, SamplingParams(temperature=1.0)) > 0,
                       torch.ones(5, dtype=torch.bool))


@pytest.mark.parametrize("kw", [
    {"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"logit_bias": {1: 101}},
    {"logit_bias": {-1: 1}}, {"logit_bias": {"x": 1}}, {"repetition_penalty": 0}, {"min_p": 1.5},
    {"frequency_penalty": 1.0, "beam_width": 2},
])
def test_out_of_range_values_are_refused(kw: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)
