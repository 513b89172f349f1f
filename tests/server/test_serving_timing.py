"""The request clock in ``serving.run``: a streamed (cumulative) request's first token is when
its handler got it and every later output adds a gap; a final-only request (a non-streamed
answer, one output at the end) takes its first token's time from the engine's reading, has no
gaps, and with several prompts sharing one ``Timing`` keeps the earliest of them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from radixkv.engine.sampling import OUTPUT_FINAL_ONLY, SamplingParams
from radixkv.server import serving


class _Handle:
    """Yields ``steps`` outputs of one token each (the last finished), engine TTFT ``ttft``."""

    def __init__(self, submitted: float, steps: int, ttft: float) -> None:
        self.submitted, self.steps, self.ttft, self.given = submitted, steps, ttft, 0

    async def aget(self) -> Any:
        self.given += 1
        return SimpleNamespace(outputs=[SimpleNamespace(delta_token_ids=[7] * self.given)],
                               ttft=self.ttft, finished=self.given >= self.steps)

    def abort(self) -> None:
        raise AssertionError("a finished request is not aborted")


def _drain(handles: list[_Handle], params: Any, timing: serving.Timing) -> list[Any]:
    finished: list[Any] = []
    state = SimpleNamespace(observe_finished=lambda out, t, params=None: finished.append(out))

    async def main() -> None:
        for i, h in enumerate(handles):
            async for _ in serving.run(state, f"r-{i}", [1], params, None, timing, handle=h):
                pass

    asyncio.run(main())
    return finished


def test_a_final_only_request_takes_the_engines_first_token_time_and_has_no_gaps() -> None:
    params = SamplingParams(max_tokens=4, output_kind=OUTPUT_FINAL_ONLY)
    timing = serving.Timing(arrived=99.0)
    # two prompts of one request: the second's engine chose its first token earlier
    finished = _drain([_Handle(100.0, 1, 0.5), _Handle(100.0, 1, 0.2)], params, timing)
    assert len(finished) == 2 and timing.finished
    assert timing.first_token == pytest.approx(100.2)
    assert timing.engine_first_token == pytest.approx(100.2)
    assert timing.gaps == []
    usage = serving.usage([SimpleNamespace(prompt_token_ids=[1], outputs=[], num_cached_tokens=0,
                                           cached_tokens_per_tier=(), ttft=0.2,
                                           num_preemptions=0)], timing, ("device",))
    assert usage["radixkv"]["server_ttft_s"] == pytest.approx(1.2)   # arrival -> engine's token
    assert usage["radixkv"]["delivery_s"] == 0


def test_a_streamed_request_times_its_own_first_token_and_each_gap() -> None:
    params = SamplingParams(max_tokens=4)
    timing = serving.Timing(arrived=0.0)
    _drain([_Handle(0.0, 3, 0.01)], params, timing)
    assert timing.first_token is not None and timing.first_token > 1.0   # perf_counter, now
    assert timing.engine_first_token == pytest.approx(0.01)
    assert len(timing.gaps) == 2
