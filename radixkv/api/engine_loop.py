"""One stepping thread owns an ``LLMEngine``; any number of threads and event loops submit to it.

Why a loop thread: the core engine (scheduler, block manager, radix tree, model runner) is plain
single-threaded Python. Two threads that each call ``step()`` interleave half-finished steps and
corrupt the per-sequence token counts (issue 18: ``InvalidTokensError: num_computed_tokens must
be in [34, 36] ... got 33``). Locking every call would work but makes callers take turns at
stepping; here exactly one thread ever touches the core, and everybody else talks to it:

* **Operations** (add a request, abort one, read stats, anything that touches the core) are
  closures queued with :meth:`EngineLoop.call`. The loop thread runs them *between* steps, in
  submission order, and hands back the result or the exception through a
  ``concurrent.futures.Future``: a sync caller blocks on it, an asyncio handler awaits
  ``asyncio.wrap_future`` (:meth:`EngineLoop.acall`) without blocking its event loop. A
  validation error raised by ``add_request`` therefore reaches the caller's thread with the engine
  unchanged, exactly as before.
* **Outputs** of each request go to its own :class:`RequestStream`, a small thread-safe queue
  that can be read with :meth:`RequestStream.get` (blocking) or :meth:`RequestStream.aget`
  (awaitable; the loop thread wakes each event loop with one ``call_soon_threadsafe`` per
  step, for all of its streams that got an output).
* **Stepping**: while any request is unfinished the thread alternates "run queued operations,
  one ``step()``, route outputs". When there is nothing to do it waits on a condition variable
  and, after ``idle_exit_s`` without work, exits; the next operation starts a fresh thread. So
  an idle engine holds no thread, and a process never exits with the loop in the middle of a
  step unless a request is still running.

Failure model: an exception from ``step()`` is delivered to every request in flight (their
callers re-raise it) and those requests are aborted, so the loop never spins on a broken batch
and later requests still run.

Lock order: ``EngineLoop._cv`` is never held while taking a ``RequestStream._cv``, and a step
routes its outputs without taking either unless a thread is blocked in ``RequestStream.get``.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from radixkv.errors import EngineClosedError, InvalidRequestError

T = TypeVar("T")


class EngineLoopClosed(EngineClosedError):
    """The engine loop was stopped (the engine was closed): raised to calls made afterwards and
    to requests that were still running. An :class:`EngineClosedError`, as the public API
    documents for a closed engine."""


class RequestStream:
    """Outputs of one request, written by the loop thread, read by one consumer.

    Items are ``RequestOutput`` snapshots in step order; an exception item ends the stream
    with that error. ``submitted`` is the ``perf_counter`` at submission (for TTFT).

    Hand-over protocol (no lock on the loop thread's path for an asyncio reader): the loop
    thread appends to a deque (atomic under the GIL) and then reads ``_sync_waiters`` and
    ``_aio``; a reader registers itself (a blocked :meth:`get` counts in ``_sync_waiters``, an
    :meth:`aget` sets ``_aio``) *before* it checks the deque. So either the reader sees the
    item, or the writer sees the reader and wakes it: no output is missed, and a step pays a
    condition variable only for a thread that is actually blocked in :meth:`get`.
    """

    def __init__(self, request_id: str, submitted: float) -> None:
        self.request_id = request_id
        self.submitted = submitted
        self._cv = threading.Condition()
        self._items: deque[Any] = deque()
        self._sync_waiters = 0   # threads inside get() (changed under _cv)
        self._aio: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def put(self, item: Any, wake: bool = True
            ) -> tuple[asyncio.AbstractEventLoop, asyncio.Event] | None:
        """Append an output (or an exception). Called on the loop thread.

        An asyncio consumer is woken with ``call_soon_threadsafe``; with ``wake=False`` the
        caller does it instead, from the returned ``(event loop, event)`` (None when no
        asyncio consumer waits): :meth:`EngineLoop._step` wakes each event loop once per step
        for all its streams (:func:`_wake`)."""
        self._items.append(item)
        if self._sync_waiters:
            with self._cv:
                self._cv.notify_all()
        aio = self._aio
        if aio is not None and wake:
            _wake({aio[0]: [aio[1]]})
            return None
        return aio

    def _pop(self) -> Any:
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def get(self, timeout: float | None = None) -> Any:
        """The next output, blocking until the loop thread delivers it.
        Raises the step's exception if the request failed; TimeoutError after ``timeout``."""
        if self._items:
            return self._pop()
        with self._cv:
            self._sync_waiters += 1   # before the check: put() then notifies (class docstring)
            try:
                if not self._cv.wait_for(lambda: bool(self._items), timeout):
                    raise TimeoutError(f"no output for {self.request_id!r} in {timeout} s")
            finally:
                self._sync_waiters -= 1
        return self._pop()

    async def aget(self) -> Any:
        """The next output, awaited without blocking the running event loop. The event is set
        and cleared on the event loop's own thread only (the loop thread schedules the set with
        ``call_soon_threadsafe``), so no lock is needed; a wake-up for an output already read
        costs one more pass of this loop."""
        while True:
            if self._items:
                return self._pop()
            if self._aio is None:   # registered before the check below (class docstring)
                self._aio = (asyncio.get_running_loop(), asyncio.Event())
                continue
            event = self._aio[1]
            event.clear()
            if self._items:
                continue
            await event.wait()


class EngineLoop:
    """The only thread that calls into ``core`` (an ``LLMEngine``); see the module docstring.

    Args:
        core: the engine to own. Nothing else may call it while this loop has work.
        idle_exit_s: seconds without work after which the thread exits (restarted on demand).
    """

    def __init__(self, core: Any, idle_exit_s: float = 2.0) -> None:
        self.core = core
        self.idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._ops: deque[tuple[Callable[[], Any], Future]] = deque()
        self._streams: dict[str, RequestStream] = {}   # touched on the loop thread only
        self._thread: threading.Thread | None = None
        self._at_exit: Callable[[], None] | None = None   # registered while a thread may run
        self._closed = False
        # True after a step raised: do not step again until a new operation arrives (a broken
        # batch is not retried in a hot loop; the aborts of the failed requests are flushed by
        # the next step anyone asks for).
        self._stalled = False
        #: Steps in a row that raised (0 after any step that did not) and the last error:
        #: a server's ``/health`` turns 503 once failures persist (:meth:`health`).
        self.failed_steps = 0
        self.last_failure: str | None = None

    # ------------------------------------------------------------------ operations
    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the loop thread between two steps; return its result (or raise its
        exception) in the calling thread. Called on the loop thread itself, runs inline."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.call_future(fn).result()

    async def acall(self, fn: Callable[[], T]) -> T:
        """:meth:`call` for asyncio handlers: awaits without blocking the event loop."""
        return await asyncio.wrap_future(self.call_future(fn))

    def call_future(self, fn: Callable[[], T]) -> Future:
        """Queue ``fn`` for the loop thread; the future holds its result."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise EngineLoopClosed("the engine loop is stopped (the engine was closed)")
            self._ops.append((fn, fut))
            self._ensure_thread()
            self._cv.notify_all()
        return fut

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    cache_salt: str | None = None, cache_points: Any = None, **hints: Any
                    ) -> Callable[[], RequestStream]:
        """The operation that adds a request and registers its stream (run it with
        :meth:`call` / :meth:`acall`). Validation errors leave the engine unchanged."""
        submitted = time.perf_counter()

        def op() -> RequestStream:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in flight")
            self.core.add_request(request_id, prompt_token_ids, params, cache_salt=cache_salt,
                                  arrival_time=submitted, cache_points=cache_points, **hints)
            stream = RequestStream(request_id, submitted)
            self._streams[request_id] = stream
            return stream

        return op

    def submit(self, request_id: str, prompt_token_ids: list[int], params: Any,
               cache_salt: str | None = None, cache_points: Any = None, **hints: Any
               ) -> RequestStream:
        """Add a request from any thread; returns its stream once the engine accepted it.
        ``hints``: ``session``/``end_session`` (``LLMEngine.add_request``)."""
        return self.call(self.add_request(request_id, prompt_token_ids, params, cache_salt,
                                          cache_points, **hints))

    def submit_many(self, requests: list[tuple[str, list[int], Any, str | None, dict[str, Any]]]
                    ) -> list[RequestStream]:
        """Add several requests in one operation, all or nothing: if one is refused, those
        already added are aborted before any step runs, and the error is raised here. Each is
        ``(request id, prompt ids, params, cache salt, add_request keywords)``."""
        ops = [self.add_request(rid, ids, params, salt, **kw)
               for rid, ids, params, salt, kw in requests]

        def op() -> list[RequestStream]:
            streams: list[RequestStream] = []
            try:
                for add in ops:
                    streams.append(add())
            except BaseException:
                for stream in streams:
                    del self._streams[stream.request_id]
                    self.core.abort_request(stream.request_id)
                raise
            return streams

        return self.call(op)

    def abort_op(self, request_id: str) -> Callable[[], bool]:
        """The operation that aborts a request; True if it was in flight here. Its stream
        receives a final ``finish_reason="abort"`` output from the next step."""
        def op() -> bool:
            if request_id not in self._streams:
                return False
            self.core.abort_request(request_id)
            return True

        return op

    def abort(self, request_id: str) -> bool:
        return self.call(self.abort_op(request_id))

    def is_running(self, request_id: str) -> bool:
        return self.call(lambda: request_id in self._streams)

    def num_in_flight(self) -> int:
        """Requests submitted here and not finished (approximate when read off-thread)."""
        return len(self._streams)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread: requests still running get :class:`EngineLoopClosed`. Idempotent."""
        with self._cv:
            self._closed = True
            thread = self._thread
            self._cv.notify_all()
            hook, self._at_exit = self._at_exit, None
        if hook is not None:
            atexit.unregister(hook)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _ensure_thread(self) -> None:
        # Called with self._cv held.
        if self._thread is None:
            if self._at_exit is None:
                # Stop (and join) the thread before the interpreter finalizes: a daemon thread
                # still inside a CUDA call then re-takes the GIL during finalization and is
                # unwound through C++ frames: "terminate called without an active exception".
                self._at_exit = _stop_at_exit(weakref.ref(self))
                atexit.register(self._at_exit)
            self._thread = threading.Thread(target=self._run, name="radixkv-engine-loop",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                idle_since = time.monotonic()
                while not self._ops and not self._closed and not self._busy():
                    left = self.idle_exit_s - (time.monotonic() - idle_since)
                    if left <= 0:
                        self._thread = None   # the next call_future starts a new thread
                        return
                    self._cv.wait(left)
                ops = list(self._ops)
                self._ops.clear()
                closed = self._closed
                if ops:
                    self._stalled = False
            for fn, fut in ops:
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 (thread boundary: the caller re-raises it)
                    fut.set_exception(exc)
            if closed:
                self._fail_all(EngineLoopClosed("the engine loop was stopped"))
                with self._cv:
                    self._thread = None
                return
            if self._busy():
                self._step()

    def _busy(self) -> bool:
        return not self._stalled and bool(self.core.has_unfinished_requests())

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as exc:  # noqa: BLE001 (loop thread: callers in flight get it, it goes on)
            self._stalled = True
            self.failed_steps += 1
            self.last_failure = f"{type(exc).__name__}: {exc}"
            self._fail_all(exc)
            return
        self.failed_steps = 0
        now = time.perf_counter()
        # One wake-up per event loop per step, however many of its streams got an output: each
        # call_soon_threadsafe writes the loop's self-pipe and costs it a pass of its selector.
        wake: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue   # a request added to the core directly, not through this loop
            if out.ttft is None and out.outputs and out.outputs[0].token_ids:
                _set_ttft(out, now - stream.submitted)
            if out.finished:
                del self._streams[out.request_id]
            aio = stream.put(out, wake=False)
            if aio is not None:
                wake.setdefault(aio[0], []).append(aio[1])
        _wake(wake)

    def health(self, after: int = 3) -> str | None:
        """None while the engine serves; else why not: the last ``after`` steps in a row
        raised (one failed step can be one bad batch, whose requests get the error while the
        loop goes on; failures that persist mean every request will fail, and a server should
        say so, so that an orchestrator restarts it and a balancer stops sending it work).
        A step that succeeds clears it."""
        if self.failed_steps >= after:
            return (f"the engine's last {self.failed_steps} steps failed "
                    f"(last: {self.last_failure})")
        return None

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            self.core.abort_request(rid)
            stream.put(exc)


def _stop_at_exit(loop_ref: Any) -> Callable[[], None]:
    """An ``atexit`` hook that stops the loop if it still exists (a weak reference: the hook
    does not keep an unused loop alive)."""
    def stop() -> None:
        loop = loop_ref()
        if loop is not None:
            loop.stop()
    return stop


def _wake(events: dict[asyncio.AbstractEventLoop, list[asyncio.Event]]) -> None:
    """Set ``events`` on their event loops: one ``call_soon_threadsafe`` per loop."""
    for loop, evs in events.items():
        try:
            loop.call_soon_threadsafe(_set_all, evs)
        except RuntimeError:   # the consumer's event loop is closed: nobody is listening
            pass


def _set_all(events: list[asyncio.Event]) -> None:
    for ev in events:
        ev.set()


def _set_ttft(out: Any, seconds: float) -> None:
    """Fill in ``ttft`` when the core did not (outputs may be frozen dataclasses)."""
    try:
        out.ttft = seconds
    except (AttributeError, TypeError):
        object.__setattr__(out, "ttft", seconds)


__all__ = ["EngineLoop", "RequestStream", "EngineLoopClosed"]
