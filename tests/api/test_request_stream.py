"""RequestStream's hand-over without a lock on the writer's path: every item reaches a blocked
``get()`` or a waiting ``aget()``, in order, however the writer's appends and the reader's
registration interleave (a lost wake-up would hang these tests, so each has a timeout)."""

from __future__ import annotations

import asyncio
import threading

from radixkv.api.engine_loop import RequestStream, _wake

N = 3000


def test_a_blocked_get_receives_every_item_in_order() -> None:
    stream = RequestStream("r", 0.0)
    got: list[int] = []

    def read() -> None:
        for _ in range(N):
            # a missed notify leaves the reader blocked until this timeout, past the join's
            got.append(stream.get(timeout=120))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    for i in range(N):
        stream.put(i)
        if i % 97 == 0:   # let the reader catch up and block again (the notify path)
            threading.Event().wait(0.002)
    reader.join(20)
    assert not reader.is_alive(), f"the reader missed a wake-up after {len(got)} items"
    assert got == list(range(N))
    assert stream._sync_waiters == 0


def test_get_raises_the_failure_item_and_times_out_when_nothing_comes() -> None:
    stream = RequestStream("r", 0.0)
    stream.put(ValueError("step failed"))
    try:
        stream.get(timeout=1)
    except ValueError as exc:
        assert str(exc) == "step failed"
    else:
        raise AssertionError("the exception item was not raised")
    try:
        stream.get(timeout=0.01)
    except TimeoutError:
        pass
    else:
        raise AssertionError("get() returned without an item")
    assert stream._sync_waiters == 0


def test_aget_receives_every_item_from_the_loop_thread_woken_once_per_batch() -> None:
    stream = RequestStream("r", 0.0)

    async def main() -> list[int]:
        async def consume() -> list[int]:
            return [await stream.aget() for _ in range(N)]

        task = asyncio.ensure_future(consume())

        def write() -> None:   # as EngineLoop._step: put without waking, then one wake
            i = 0
            while i < N:
                wake: dict = {}
                for _ in range(min(7, N - i)):
                    aio = stream.put(i, wake=False)
                    if aio is not None:
                        wake.setdefault(aio[0], []).append(aio[1])
                    i += 1
                _wake(wake)
                if i % 301 == 0:
                    threading.Event().wait(0.0005)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            return await asyncio.wait_for(task, 30)
        finally:
            writer.join(30)

    assert asyncio.run(main()) == list(range(N))
