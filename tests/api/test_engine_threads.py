"""One Engine used from several threads at once (issue 18, item 3).

Before the engine loop, every thread stepped the core itself and the interleaved half-steps
failed with ``InvalidTokensError: num_computed_tokens must be in [...]``. Now one loop thread
steps; the threads' requests batch together and each gets exactly its own tokens.
"""

from __future__ import annotations

import asyncio
import threading

from radixkv import SamplingParams

GREEDY = SamplingParams(max_tokens=12)


def _prompts(k: int) -> list[list[int]]:
    # Shared 32-token prefix (two blocks) so requests from different threads hit each other's
    # cache while they run.
    return [list(range(100, 132)) + list(range(1000 + 40 * i, 1000 + 40 * i + 9 + i))
            for i in range(k)]


def test_generate_stream_and_chat_from_many_threads_match_one_thread(make_engine):
    prompts = _prompts(6)
    expected = [o.outputs[0].token_ids for o in make_engine().generate(prompts, GREEDY)]

    e = make_engine()
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(7)

    def gen(i: int) -> None:
        start.wait()
        results[f"gen{i}"] = e.generate(prompts[i], GREEDY)[0].outputs[0].token_ids

    def stream(i: int) -> None:
        start.wait()
        toks: list[int] = []
        for out in e.stream(prompts[i], GREEDY):
            toks.extend(out.outputs[0].delta_token_ids)
        results[f"stream{i}"] = toks

    def chat() -> None:
        start.wait()
        session = e.chat(system="Be brief.", params={"max_tokens": 4})
        results["chat1"] = session.send("hello").token_ids
        results["chat2"] = session.send("again").token_ids

    def guard(fn, *args):
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 (harness: re-raised in the main thread)
                errors.append(exc)
        return threading.Thread(target=run)

    threads = [guard(gen, i) for i in range(4)] + [guard(stream, i) for i in (4, 5)]
    threads += [guard(chat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(4):
        assert results[f"gen{i}"] == expected[i]
    for i in (4, 5):
        assert results[f"stream{i}"] == expected[i]
    assert len(results["chat1"]) >= 1 and len(results["chat2"]) >= 1
    st = e.stats()
    assert st["num_running_requests"] == 0 and st["num_waiting"] == 0
    assert st["device_blocks_free"] + st["cached_blocks_per_tier"][0] + st["tail_blocks"] == \
        st["device_blocks"]


def test_asyncio_callers_await_without_blocking_the_event_loop(make_engine):
    e = make_engine()
    prompts = _prompts(3)
    expected = [o.outputs[0].token_ids for o in e.generate(prompts, GREEDY)]
    ticks = 0

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    async def one(p: list[int]) -> list[int]:
        stream = await e.loop.acall(e.loop.add_request(f"a{p[-1]}", p, GREEDY))
        toks: list[int] = []
        while True:
            out = await stream.aget()
            toks.extend(out.outputs[0].delta_token_ids)
            if out.finished:
                return toks

    async def main() -> list[list[int]]:
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        got = await asyncio.gather(*(one(p) for p in prompts))
        stop.set()
        await tick
        return list(got)

    assert asyncio.run(main()) == expected
    assert ticks > 3   # the event loop kept running while the engine stepped


def test_abort_from_another_thread_ends_the_stream_and_frees_blocks(make_engine):
    e = make_engine()
    free0 = e.stats()["device_blocks_free"]
    rid = e.submit(list(range(200, 260)), {"max_tokens": 400, "ignore_eos": True})
    it = e.stream_request(rid)
    next(it)
    t = threading.Thread(target=e.abort, args=(rid,))
    t.start()
    t.join()
    outs = list(it)
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    st = e.stats()
    assert st["num_running_requests"] == 0
    assert st["device_blocks_free"] + st["cached_blocks_per_tier"][0] + st["tail_blocks"] >= free0


def test_a_failing_step_reaches_every_caller_and_the_loop_serves_the_next_request(
        make_engine, monkeypatch):
    import pytest

    e = make_engine()
    real_step = e.core.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(e.core, "step", flaky_step)
    with pytest.raises(RuntimeError, match="injected"):
        e.generate(list(range(300, 340)), GREEDY)
    out = e.generate(list(range(300, 340)), GREEDY)[0]   # the loop is alive and serves
    assert out.finished and out.outputs[0].finish_reason in ("stop", "length")
    st = e.stats()
    assert st["num_running_requests"] == 0 and st["num_waiting"] == 0


def test_ttft_clock_starts_when_the_request_is_queued_not_when_the_loop_gets_to_it(make_engine):
    """A request queued while a step runs waits for that step; that wait is the engine's (the
    server's overhead figure in bench serve subtracts the engine's TTFT and relied on it).
    Before the fix the clock started inside the loop's operation, so this queued wait vanished
    from ``ttft`` and showed up as server overhead instead."""
    import time

    e = make_engine()
    op = e.loop.add_request("queued", _prompts(1)[0], SamplingParams(max_tokens=2))
    time.sleep(0.3)   # the loop is "busy" for 0.3 s before it runs the operation
    stream = e.loop.call(op)
    out = stream.get(timeout=60)
    while not out.finished:
        out = stream.get(timeout=60)
    assert out.ttft is not None and out.ttft >= 0.3


def test_per_token_logprobs_follow_each_sample_through_the_fork(make_engine):
    """``SamplingParams.logprobs=k``: one entry per output token (the forked samples of n=3
    each get their own), matching the token ids, summing to ``cumulative_logprob``; streamed
    deltas add up to the final list; beam search refuses it."""
    import math

    import pytest

    from radixkv import InvalidRequestError

    e = make_engine()
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=3, logprobs=2,
                            ignore_eos=True)
    out = e.generate(_prompts(1)[0], params)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert [t.token_id for t in c.logprobs] == c.token_ids
        assert math.isclose(sum(t.logprob for t in c.logprobs), c.cumulative_logprob,
                            abs_tol=1e-4)
        for t in c.logprobs:
            assert len(t.top) == 2 and t.top[0][1] >= t.top[1][1]
            assert t.logprob <= t.top[0][1] + 1e-6   # the first alternative is the most likely
    deltas: dict[int, list] = {}
    for snap in e.stream(_prompts(1)[0], params):
        for c in snap.outputs:
            deltas.setdefault(c.index, []).extend(c.delta_logprobs)
    assert {i: [t.token_id for t in v] for i, v in deltas.items()} == \
        {c.index: c.token_ids for c in out.outputs}   # same seed, same samples
    assert e.generate(_prompts(1)[0], SamplingParams(max_tokens=2))[0].outputs[0].logprobs \
        is None
    with pytest.raises(InvalidRequestError):
        SamplingParams(beam_width=2, logprobs=1)
    with pytest.raises(InvalidRequestError):
        SamplingParams(logprobs=21)


def test_failures_that_persist_make_the_server_unhealthy_until_a_step_succeeds(
        make_engine, monkeypatch):
    """One failed step is one bad batch; three in a row mean every request fails: the loop's
    health() says why, the server's /health and /ping answer 503 with it (an orchestrator
    restarts, a balancer skips), and the first step that succeeds clears it."""
    import asyncio

    import pytest

    pytest.importorskip("fastapi")
    from radixkv.server.app import create_app
    from radixkv.server.backend import LocalBackend

    e = make_engine()
    real_step = e.core.step
    broken = {"on": True}

    def step():
        if broken["on"]:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(e.core, "step", step)
    app = create_app(load=lambda: None)
    app.state.engine = LocalBackend(e)

    def status(path: str) -> tuple[int, bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "root_path": "", "query_string": b"", "headers": [],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        asyncio.run(app(scope, receive, send))
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return sent[0]["status"], body

    assert status("/health")[0] == 200
    with pytest.raises(RuntimeError, match="device lost"):   # one bad batch: still healthy
        e.generate(list(range(300, 320)), GREEDY)
    assert e.loop.health() is None and status("/health")[0] == 200
    for _ in range(3):   # (a failed request's aborts are flushed by one more failing step)
        with pytest.raises(RuntimeError, match="device lost"):
            e.generate(list(range(300, 320)), GREEDY)
        if e.loop.health() is not None:
            break
    assert e.loop.failed_steps >= 3
    code, body = status("/health")
    assert code == 503 and b"engine_unhealthy" in body and b"device lost" in body
    assert status("/ping")[0] == 503
    broken["on"] = False
    assert e.generate(list(range(300, 320)), GREEDY)[0].finished
    assert e.loop.health() is None and status("/health")[0] == 200
