"""``SamplingParams.thinking_token_budget`` (engine/thinking_budget.py): a reasoning model thinks
at most that many tokens, then its close marker is forced, on the embedded model. The 135M
model was not trained to think, so tokens it writes (or chosen ones) stand in for ``<think>``
and ``</think>``: what the mechanism reads is token ids. Greedy outputs are compared with the
same request without a budget, token by token."""

from __future__ import annotations

from typing import Any

import pytest

from radixkv.engine.grammar import Thinking
from radixkv.engine.thinking_budget import BudgetScan
from radixkv.errors import InvalidRequestError


def test_the_scan_finds_where_thinking_starts_and_ends() -> None:
    """Pure: the scan over output tokens, advanced piecewise, against what it forces."""
    r1 = Thinking(None, (7, 8), True)
    q3 = Thinking(5, (7, 8), False)
    prompt = [1, 2]

    def forced(thinking: Thinking, out: list[int], budget: int) -> list[Any]:
        st, got = BudgetScan(thinking), []
        for n in range(len(out) + 1):   # one token at a time, as the engine sees them
            got.append(st.forced(prompt + out[:n], len(prompt), thinking, budget))
        return got

    assert forced(r1, [3, 4, 7, 8, 9], 2) == [None, None, 7, 8, None, None]
    assert forced(r1, [3, 7, 8, 9], 5) == [None] * 5          # closed on its own
    assert forced(r1, [7, 8, 9], 0) == [7, 8, None, None]
    assert forced(q3, [5, 3, 7, 8], 1) == [None, None, 7, 8, None]
    assert forced(q3, [4, 3, 3], 0) == [None] * 4             # did not open: no thinking
    assert forced(q3, [5, 7, 8, 3], 0) == [None, 7, 8, None, None]
    # a close split across the budget: the forced marker starts again from its first token
    assert forced(r1, [7, 7, 8, 9], 1) == [None, 7, 8, None, None]


@pytest.mark.parametrize("params", [
    dict(thinking_token_budget=2),
    dict(thinking_token_budget=-1, thinking=Thinking(None, (1,), True)),
    dict(thinking_token_budget=2, thinking=Thinking(None, (), True)),
    dict(thinking_token_budget=2, thinking=Thinking(None, (1,), False)),
    dict(thinking_token_budget=2, thinking=Thinking(None, (1,), True), beam_width=2),
])
def test_a_budget_needs_its_marks_and_no_beams(params: dict) -> None:
    from radixkv import SamplingParams

    with pytest.raises(InvalidRequestError):
        SamplingParams(**params)


@pytest.fixture(scope="module")
def eng() -> Any:
    import radixkv
    from radixkv.config import CacheConfig, EngineConfig

    e = radixkv.Engine.from_pretrained(cache_config=CacheConfig(num_device_blocks=64),
                                       engine_config=EngineConfig(device="cpu",
                                                                  dtype="float32"))
    yield e
    e.close()


@pytest.mark.model
def test_the_close_marker_comes_at_the_budget(eng: Any) -> None:
    from radixkv import SamplingParams

    ids = eng.chat_template.prompt_ids([{"role": "user", "content": "Tell me about tides."}])
    free = eng.generate(ids, SamplingParams(max_tokens=12))[0].outputs[0].token_ids
    close = tuple(eng.encode(" zebra quilt"))
    assert len(close) >= 2 and not set(close) & set(free)

    def out(budget: int, thinking: Thinking, **kw: Any) -> list[list[int]]:
        r = eng.generate(ids, SamplingParams(max_tokens=12, thinking_token_budget=budget,
                                             thinking=thinking, **kw))[0]
        return [list(c.token_ids) for c in r.outputs]

    k = len(close)
    [r1] = out(3, Thinking(None, close, True))   # thinks from the first token
    assert r1[:3] == free[:3] and tuple(r1[3:3 + k]) == close
    [zero] = out(0, Thinking(None, close, True))
    assert tuple(zero[:k]) == close
    [q3] = out(2, Thinking(free[0], close, False))   # opened by its first token
    assert q3[:3] == free[:3] and tuple(q3[3:3 + k]) == close
    [never] = out(0, Thinking(free[1], close, False))  # the first token does not open it
    assert never == free
    [own] = out(6, Thinking(None, (free[2],), True))   # closed on its own before the budget
    assert own == free
    # sampled, two samples forked from one prompt: each closes at its budget
    for sample in out(4, Thinking(None, close, True), n=2, temperature=1.0, seed=5):
        assert tuple(sample[4:4 + k]) == close, sample
