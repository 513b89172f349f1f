"""The FastAPI app: OpenAI-compatible endpoints over a :class:`~radixkv.server.backend.Backend`.

Build it with :func:`create_app` from an engine you already have, from a loader that
:func:`radixkv.server.cli.main` runs in the background while ``/health`` answers 503, or from a
backend (the fleet's: :mod:`radixkv.fleet`). Handlers never step an engine: they submit to it and
await their outputs, so the event loop keeps serving while the batch computes. Tokenization and
chat templating run in worker threads for the same reason.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from radixkv.server import serving
from radixkv.server.backend import Backend, LocalBackend
from radixkv.server.errors import APIError, install_handlers
from radixkv.server.metrics import ServerMetrics
from radixkv.server.protocol import ChatCompletionRequest, CompletionRequest
from radixkv.server.tenants import Tenants


class ServerState:
    """What the handlers share: the backend (once loaded), tenants, limits, metrics."""

    def __init__(self, model_name: str, tenants: Tenants, max_queued: int,
                 default_max_tokens: int | None) -> None:
        self.engine: Backend | None = None     # the backend (an engine, or a fleet)
        self.load_error: str | None = None
        self.model_name = model_name
        self.tenants = tenants
        self.max_queued = max_queued
        self.default_max_tokens = default_max_tokens
        self.metrics = ServerMetrics(model_name)
        self.in_flight = 0          # HTTP requests holding a slot (event-loop thread only)
        self.created = int(time.time())

    # ------------------------------------------------------------------ admission
    def ready_engine(self) -> Backend:
        if self.engine is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else \
                "the model is still loading"
            raise APIError(503, why, code="not_ready")
        return self.engine

    @property
    def capacity(self) -> int:
        """Requests held at once: a full running batch plus ``max_queued`` waiting."""
        return self.engine.max_num_seqs + self.max_queued

    def acquire(self) -> None:
        if self.in_flight >= self.capacity:
            self.metrics.rejected.labels(self.model_name, "429").inc()
            raise APIError(429, f"the server is at capacity ({self.in_flight} requests running "
                           f"or queued, --max-queued {self.max_queued}); retry later",
                           code="queue_full")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    # ------------------------------------------------------------------ metrics
    def observe_finished(self, out: Any, timing: serving.Timing) -> None:
        m, lab = self.metrics, self.model_name
        if out.ttft is not None:
            m.ttft.labels(lab).observe(out.ttft)
        m.e2e.labels(lab).observe(time.perf_counter() - timing.arrived)
        for gap in timing.gaps:
            m.itl.labels(lab).observe(gap)
        m.prompt_tokens.labels(lab).inc(len(out.prompt_token_ids))
        m.generation_tokens.labels(lab).inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            m.success.labels(lab, c.finish_reason or "unknown").inc()


class _Gate:
    """Pure ASGI middleware: stamps each request's arrival time and checks its API key on
    ``/v1/*`` before the body is read (so a caller without a key learns nothing else)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = scope.setdefault("state", {})
        st["arrived"] = time.perf_counter()
        if scope["path"].startswith("/v1/"):
            auth = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                         if k == b"authorization"), None)
            key = self.state.tenants.authenticate(auth)
            if key is None:
                self.state.metrics.rejected.labels(self.state.model_name, "401").inc()
                resp = APIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                                "<key>'", code="invalid_api_key").response()
                return await resp(scope, receive, send)
            st["api_key"] = key
        return await self.app(scope, receive, send)


def create_app(engine: Any = None, *, load: Callable[[], Any] | None = None,
               model_name: str | None = None, api_keys: list[str] | None = None,
               max_queued: int = 256, default_max_tokens: int | None = None,
               salt_secret: str | None = None,
               extra_metrics: Callable[[], Awaitable[bytes]] | None = None) -> Any:
    """The ASGI app serving ``engine`` (a :class:`radixkv.Engine` or a
    :class:`~radixkv.server.backend.Backend`), or what ``load()`` returns, loaded in a thread at
    start-up (``/health`` is 503 until then). ``model_name`` is what clients pass as ``model``
    (default: the engine's ``model_id``). ``extra_metrics``: awaited for more Prometheus text appended to
    ``/metrics`` (the fleet's router). Returns the app wrapped in its gate middleware; the
    FastAPI object is ``app.fastapi`` and the shared state ``app.state``."""
    if engine is None and load is None:
        raise ValueError("create_app needs an engine or a load() function")
    if engine is not None:
        engine = _backend(engine)
    name = model_name or (engine.model_id if engine is not None else "radixkv")
    state = ServerState(name, Tenants.create(api_keys or [], salt_secret), max_queued,
                        default_max_tokens)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        if engine is not None:
            state.engine = engine
        else:
            threading.Thread(target=_load, args=(state, load), name="radixkv-load",
                             daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.close()

    api = FastAPI(title="radixkv", lifespan=lifespan)
    install_handlers(api)
    _routes(api, state, extra_metrics)
    gate = _Gate(api, state)
    gate.fastapi, gate.state = api, state  # type: ignore[attr-defined]
    return gate


def _backend(engine: Any) -> Backend:
    return engine if isinstance(engine, Backend) else LocalBackend(engine)


def _load(state: ServerState, load: Callable[[], Any]) -> None:
    try:
        state.engine = _backend(load())
    except Exception as exc:   # reported by /health and every endpoint (503), and on stderr
        state.load_error = f"{type(exc).__name__}: {exc}"
        print(f"radixkv serve: {state.load_error}", file=sys.stderr, flush=True)


def _routes(api: FastAPI, state: ServerState,
            extra_metrics: Callable[[], Awaitable[bytes]] | None = None) -> None:
    @api.get("/health")
    async def health() -> Any:
        state.ready_engine()
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics() -> Response:
        snaps: list = []
        if state.engine is not None:
            snaps = await state.engine.snapshots()
        body = state.metrics.render(snaps)
        if extra_metrics is not None:
            body += await extra_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models() -> Any:
        eng = state.ready_engine()
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "radixkv", "max_model_len": eng.max_model_len}]}

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        eng = state.ready_engine()
        state.check_model(req.model)
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role,
                         "content": m.text()} for m in req.messages]
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        try:
            ids = await asyncio.to_thread(eng.chat_template.prompt_ids, messages)
            marks = [m.cache_control for m in req.messages]
            points = None
            if any(marks) or req.prompt_cache_retention:
                points = await asyncio.to_thread(
                    serving.cache_points, eng.chat_template, messages, marks, len(ids),
                    req.prompt_cache_retention)
        except TemplateError as exc:   # the model's template refuses these messages
            raise APIError(400, f"the chat template rejected the messages: {exc}",
                           param="messages") from None
        return await _serve(state, request, req, [ids], chat=True,
                            points=None if points is None else [points])

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        eng = state.ready_engine()
        state.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        p = req.prompt
        prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) \
            else list(p)
        ids = [await asyncio.to_thread(eng.encode, x) if isinstance(x, str) else list(x)
               for x in prompts]
        points = None
        if req.prompt_cache_retention:
            points = [[serving.retention_point(len(x), req.prompt_cache_retention)] if x
                      else None for x in ids]
        return await _serve(state, request, req, ids, chat=False, points=points)


async def _serve(state: ServerState, request: Request, req: Any, prompts: list[list[int]],
                 chat: bool, points: list[Any] | None = None) -> Any:
    """Validate every prompt, then answer with one body or an SSE stream. ``points``: per
    prompt, its cache points (breakpoints, retention) or None."""
    points = points or [None] * len(prompts)
    eng = state.engine
    vocab = eng.vocab_size
    params = []
    for ids in prompts:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in [0, {vocab})", param="prompt")
        params.append(serving.sampling_params(req, len(ids), eng.max_model_len,
                                              state.default_max_tokens))
    if req.stream and len(prompts) > 1:
        raise APIError(400, "stream one prompt per request", param="prompt")
    key = request.state.api_key if hasattr(request.state, "api_key") else ""
    salt = state.tenants.cache_salt(key, serving.request_salt(req))
    timing = serving.Timing(arrived=getattr(request.state, "arrived", time.perf_counter()))
    rid = serving.new_id("chatcmpl" if chat else "cmpl")
    state.acquire()
    if req.stream:
        return StreamingResponse(_events(state, req, rid, prompts[0], params[0], salt, timing,
                                         chat, points[0]), media_type="text/event-stream")
    try:
        outs = await asyncio.gather(*(
            _final(state, f"{rid}-{i}", ids, sp, salt, timing, request, pts,
                   serving.session_hints(req))
            for i, (ids, sp, pts) in enumerate(zip(prompts, params, points))))
    finally:
        state.release()
    if any(o is None for o in outs):
        return Response(status_code=499)   # the client is gone; nobody reads this
    choices = []
    n = req.n
    for i, out in enumerate(outs):
        for c in out.outputs:
            text = c.text
            if not chat and getattr(req, "echo", False):
                text = eng.decode(out.prompt_token_ids) + text
            choice: dict[str, Any] = {"index": i * n + c.index, "finish_reason": c.finish_reason,
                                      "logprobs": _logprobs(eng, chat, c.logprobs, 0)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": state.model_name, "choices": choices,
        "usage": serving.usage(outs, timing, eng.output_tier_names)})


def _logprobs(eng: Any, chat: bool, items: list | None, offset: int) -> dict | None:
    """``choice.logprobs`` in the endpoint's format (None when the request did not ask)."""
    def decode(tid: int) -> str:
        return eng.decode([tid], skip_special_tokens=False)

    if chat:
        return serving.chat_logprobs(decode, items)
    return serving.completion_logprobs(decode, items, offset)


async def _final(state: ServerState, rid: str, ids: list[int], params: Any, salt: str | None,
                 timing: serving.Timing, request: Request, points: Any = None,
                 hints: dict[str, Any] | None = None) -> Any:
    last = None
    async for last in serving.run(state, rid, ids, params, salt, timing, request, points,
                                  hints):
        pass
    return last if last is not None and last.finished else None


async def _events(state: ServerState, req: Any, rid: str, ids: list[int], params: Any,
                  salt: str | None, timing: serving.Timing, chat: bool, points: Any = None
                  ) -> Any:
    """Server-Sent Events of one request, OpenAI's chunk format."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    beam = params.use_beam_search

    def chunk(choices: list[dict]) -> str:
        body: dict[str, Any] = {"id": rid, "object": kind, "created": created,
                                "model": state.model_name, "choices": choices}
        if include_usage:
            body["usage"] = None
        return serving.sse(body)

    offsets: dict[int, int] = {}   # completions' text_offset: characters of tokens sent

    def choice(index: int, text: str | None, finish: str | None, role: bool = False,
               lps: list | None = None) -> dict:
        logprobs = None
        if lps is not None:
            logprobs = _logprobs(state.engine, chat, lps, offsets.get(index, 0))
            if not chat:
                offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    try:
        if chat:
            yield chunk([choice(i, "", None, role=True) for i in range(req.n)])
        last, done = None, set()
        async for out in serving.run(state, rid, ids, params, salt, timing,
                                     cache_points=points, hints=serving.session_hints(req)):
            last = out
            if beam and not out.finished:
                continue   # beams reorder until the end: only the final best n are sent
            parts = []
            for c in out.outputs:
                if c.index in done:
                    continue
                text = c.text if beam else c.delta_text
                if text or c.finish_reason or c.delta_logprobs:
                    parts.append(choice(c.index, text, c.finish_reason, lps=c.delta_logprobs))
                if c.finish_reason:
                    done.add(c.index)
            if parts:
                yield chunk(parts)
        if include_usage and last is not None:
            yield serving.sse({"id": rid, "object": kind, "created": created,
                               "model": state.model_name, "choices": [],
                               "usage": serving.usage([last], timing,
                                                     state.engine.output_tier_names)})
        yield serving.SSE_DONE
    except APIError as exc:   # e.g. the fleet replica serving it died after sending tokens
        yield serving.sse(exc.body())
        yield serving.SSE_DONE
    finally:
        state.release()


__all__ = ["create_app", "ServerState"]
