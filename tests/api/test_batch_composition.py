"""What a request's output may depend on besides its own prompt and parameters (issue 33,
item 3; docs/serve.md "Determinism and batch composition").

* The same batch, same order: bit-identical tokens and log-probabilities, run after run, in
  float32 and bfloat16 (the property every reproduction relies on).
* Another batch around it: the request's log-probabilities move by at most ``TOL[dtype]`` at
  each step before its tokens part, and greedy tokens part only at a near-tie (where the alone
  run's top-2 margin is under ``2 * TOL``): what the kernels' batch-dependent summation order
  can do and no more. Not promised: bit-identical results across batch compositions.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv import CacheConfig
from radixkv.api.engine import Engine
from radixkv.config import EngineConfig

#: per-step log-probability tolerance across batch compositions (docs/serve.md gives the
#: measured figures: float32 <= 2e-5, bf16 0 on this model, <= 0.1 on SmolLM2-135M)
TOL = {"float32": 1e-3, "bfloat16": 0.25}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engines(tiny_model_shared: Any, one_thread: Any) -> Any:
    made = {}
    for dtype in TOL:
        cc = CacheConfig(block_size=16, num_device_blocks=256, enable_prefix_caching=False)
        ec = EngineConfig(device="cpu", dtype=dtype, max_model_len=512, max_num_seqs=16,
                          max_num_batched_tokens=512)
        # a copy each: the engine converts its model to its dtype in place
        made[dtype] = Engine(copy.deepcopy(tiny_model_shared), None, cc, ec,
                             model_id=f"tiny-{dtype}")
    yield made
    for e in made.values():
        e.close()


prompts = st.lists(st.integers(3, 40_000), min_size=1, max_size=70)
compositions = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(TOL)),
    "target": prompts,
    "others": st.lists(st.tuples(prompts, st.integers(1, MAX_TOKENS + 4)), max_size=10),
    "position": st.integers(0, 10),
})


def _params(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}


def _run(engine: Engine, c: dict[str, Any]) -> tuple[list[Any], int]:
    others = c["others"]
    pos = min(c["position"], len(others))
    batch = [o[0] for o in others[:pos]] + [c["target"]] + [o[0] for o in others[pos:]]
    params = ([_params(o[1]) for o in others[:pos]] + [_params(MAX_TOKENS)]
              + [_params(o[1]) for o in others[pos:]])
    return engine.generate(batch, params), pos


def _trace(out: Any) -> list[tuple[int, float, tuple]]:
    c = out.outputs[0]
    return [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(c=compositions)
def test_the_same_batch_gives_the_same_bits(engines, c) -> None:
    first, _ = _run(engines[c["dtype"]], c)
    again, _ = _run(engines[c["dtype"]], c)
    assert [_trace(o) for o in first] == [_trace(o) for o in again]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(c=compositions)
def test_another_batch_moves_logprobs_within_tolerance(engines, c) -> None:
    engine, tol = engines[c["dtype"]], TOL[c["dtype"]]
    alone = _trace(engine.generate([c["target"]], _params(MAX_TOKENS))[0])
    outs, pos = _run(engine, c)
    mixed = _trace(outs[pos])
    assert len(alone) == len(mixed) == MAX_TOKENS
    for (tok_a, lp_a, top_a), (tok_m, lp_m, _) in zip(alone, mixed):
        if tok_a != tok_m:   # a greedy choice may only differ at a near-tie
            assert top_a[0][1] - top_a[1][1] <= 2 * tol
            break
        assert abs(lp_a - lp_m) <= tol
