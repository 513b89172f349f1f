"""Who aborts a request that ends unfinished (``radixkv/server/serving.py``): every prompt of a
non-streamed request aborts itself, even when a sibling sharing its ``Timing`` finished first;
a streamed request submitted before its response started is aborted once by the response's
close, also when its event generator never ran, and not at all once it finished."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from radixkv.server import serving


class _Handle:
    """A backend's request handle that yields ``steps`` outputs, the last one finished."""

    def __init__(self, steps: int) -> None:
        self.submitted = 0.0
        self.steps, self.given, self.aborts = steps, 0, 0

    async def aget(self) -> Any:
        self.given += 1
        return SimpleNamespace(outputs=[SimpleNamespace(delta_token_ids=[7])], ttft=0.01,
                               finished=self.given >= self.steps)

    def abort(self) -> None:
        self.aborts += 1


class _Counter:
    def __init__(self) -> None:
        self.counts: dict[tuple, int] = {}

    def labels(self, *labels: str) -> Any:
        counts = self.counts
        return SimpleNamespace(inc=lambda: counts.__setitem__(labels, counts.get(labels, 0) + 1))


def _state(handles: list[_Handle]) -> Any:
    queue = list(handles)

    async def open_(*_: Any, **__: Any) -> _Handle:
        return queue.pop(0)

    return SimpleNamespace(engine=SimpleNamespace(open=open_), model_name="m",
                           metrics=SimpleNamespace(success=_Counter()),
                           observe_finished=lambda out, timing, params=None: None)


async def _read(gen: Any, items: int) -> None:
    for _ in range(items):
        await gen.__anext__()
    await gen.aclose()   # the caller stops reading (its client went away)


def test_each_prompt_of_a_request_aborts_itself_though_a_sibling_finished() -> None:
    short, long = _Handle(1), _Handle(100)
    state = _state([short, long])
    timing = serving.Timing(arrived=0.0)   # shared by the request's prompts, as in app._serve

    async def main() -> None:
        await _read(serving.run(state, "r-0", [1], None, None, timing), 1)   # finished
        await _read(serving.run(state, "r-1", [1], None, None, timing), 2)   # cut off

    asyncio.run(main())
    assert (short.aborts, long.aborts) == (0, 1)
    assert state.metrics.success.counts == {("m", "abort"): 1}


def test_a_streamed_request_is_aborted_once_however_its_response_ends() -> None:
    async def submitted(handle: _Handle) -> tuple[Any, serving.Timing]:
        state = _state([handle])
        timing = serving.Timing(arrived=0.0)
        assert await serving.submit(state, "r", [1], None, None, timing) is handle
        return state, timing

    async def main() -> None:
        # the generator never ran (the client left before the first chunk): close() aborts
        never = _Handle(5)
        state, timing = await submitted(never)
        serving.abort(state, never, timing)
        serving.abort(state, never, timing)
        assert never.aborts == 1 and state.metrics.success.counts == {("m", "abort"): 1}
        # cut off while streaming: run aborts it, the response's close() adds nothing
        cut = _Handle(5)
        state, timing = await submitted(cut)
        await _read(serving.run(state, "r", [], None, None, timing, handle=cut), 2)
        serving.abort(state, cut, timing)
        assert cut.aborts == 1 and state.metrics.success.counts == {("m", "abort"): 1}
        # finished: nothing to abort
        done = _Handle(2)
        state, timing = await submitted(done)
        await _read(serving.run(state, "r", [], None, None, timing, handle=done), 2)
        serving.abort(state, done, timing)
        assert done.aborts == 0 and state.metrics.success.counts == {}

    asyncio.run(main())
