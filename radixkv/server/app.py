"""The FastAPI app: OpenAI-compatible endpoints over a :class:`~radixkv.server.backend.Backend`.

Build it with :func:`create_app` from an engine you already have, from a loader that
:func:`radixkv.server.cli.main` runs in the background while ``/health`` answers 503, or from a
backend (the fleet's: :mod:`radixkv.fleet`). Handlers never step an engine: they submit to it and
await their outputs, so the event loop keeps serving while the batch computes. Tokenization and
chat templating run in worker threads for the same reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from jinja2 import TemplateError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from radixkv.engine.grammar import DEFAULT_MAX_WHITESPACE, check_max_whitespace
from radixkv.engine.sampling import OUTPUT_FINAL_ONLY
from radixkv.server import conversations as cv
from radixkv.server import heap
from radixkv.server import responses as rs
from radixkv.server import serving
from radixkv.server.backend import Backend, LocalBackend
from radixkv.server.errors import APIError, install_handlers, validation_error
from radixkv.server.frontend import LOAD_TRACKED, FrontendOptions, load_middleware
from radixkv.server.metrics import ServerMetrics
from radixkv.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                     ConversationCreate, ConversationItemsCreate,
                                     ConversationUpdate, DetokenizeRequest, ResponsesRequest,
                                     TokenizeRequest)
from radixkv.server.tenants import Tenants
from radixkv.server.tools import Reader


#: ``--max-request-bytes`` by default: far above any prompt a context of 128k tokens holds as
#: JSON text or token ids, far below what would take seconds to parse.
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
#: Most ``cache_control`` breakpoints in one chat request (Anthropic allows 4 too): each costs
#: a render and a tokenization of the conversation up to it, so they are capped before any work.
MAX_CACHE_MARKS = 4
#: Text up to this many characters is templated and tokenized on the event loop itself (under
#: ~2 ms at ~0.5 us a character with a fast tokenizer); longer text goes to a worker thread. A
#: hop to a worker and back costs two thread wake-ups, 0.5 ms on an idle machine and a
#: scheduler time slice each (ms) when other processes hold the cores: more than the work.
INLINE_TOKENIZE_CHARS = 4096
#: uvicorn's event loop for ``radixkv serve``: the standard library's, not uvloop (uvicorn's
#: "auto" picks uvloop when it is installed). uvloop runs libuv with the GIL released and
#: re-takes it in every libuv callback (the cross-thread wake-up, the ready queue, queued
#: writes, each socket read), so one pass of the event loop takes the GIL several times; the
#: engine loop thread wants the GIL between its torch calls, and on a busy machine each of
#: those hand-overs waits for the scheduler. asyncio's loop holds the GIL for a whole pass
#: and releases it only in ``select``. Paired on the same cached chat turn (docs/serve.md,
#: "Server overhead"), asyncio was 3.9-5.3 ms faster to the first token at p50 beside 2 busy
#: processes and within 1 ms either way without them. The HTTP parser stays uvicorn's choice
#: (httptools when installed, else h11): the two were even (p50 difference 0.1 ms).
UVICORN_LOOP = "asyncio"

log = logging.getLogger("radixkv.server")


class ServerState:
    """What the handlers share: the backend (once loaded), tenants, limits, metrics."""

    def __init__(self, model_name: str, tenants: Tenants, max_queued: int,
                 default_max_tokens: int | None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 reasoning_parser: str | None = None, cache_reset: bool = False,
                 max_logprobs: int = 20, responses_store_size: int = rs.DEFAULT_STORE_SIZE,
                 stream_interval: int = 1,
                 json_max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
                 max_conversation_bytes: int = cv.DEFAULT_MAX_BYTES,
                 frontend: FrontendOptions | None = None) -> None:
        self.engine: Backend | None = None     # the backend (an engine, or a fleet)
        #: vLLM's frontend options (radixkv/server/frontend.py)
        self.frontend = frontend or FrontendOptions()
        #: generation requests in flight, for ``GET /load`` (``--enable-server-load-tracking``)
        self.server_load = 0
        self.load_error: str | None = None
        self.model_name = model_name
        self.tenants = tenants
        self.max_queued = max_queued
        self.default_max_tokens = default_max_tokens
        #: ``--reasoning-parser``: chat replies' thinking goes to ``reasoning`` (reasoning.py)
        self.reasoning_parser = reasoning_parser
        #: ``POST /reset_prefix_cache`` is served (``--enable-cache-reset``; else 404)
        self.cache_reset = cache_reset
        #: ``--max-logprobs``: most alternatives a token a request may ask for
        self.max_logprobs = max_logprobs
        #: ``--stream-interval``: the fewest tokens a streamed chunk carries (after the first)
        self.stream_interval = stream_interval
        #: the Responses API's stored responses (``previous_response_id``, ``GET``)
        self.responses = rs.ResponseStore(responses_store_size)
        #: the Conversations API's conversations (``conversation`` of a Responses request)
        self.conversations = cv.ConversationStore(responses_store_size, max_conversation_bytes)
        #: background responses' tasks, held until they end (the loop holds tasks weakly)
        self.background: set[asyncio.Task[None]] = set()
        self.metrics = ServerMetrics(model_name)
        self.max_request_bytes = max_request_bytes
        #: freeze the start-up heap once warm (create_app's ``freeze_heap``)
        self.freeze_heap = False
        self.max_token_chars: int | None = None   # of the vocabulary, once loaded
        self.max_token_chars_task: asyncio.Future[int] | None = None   # computing it
        self.grammar_compiler: Any = None         # response_format, built on first use
        #: ``--structured-outputs-max-whitespace``: JSON output's whitespace between tokens
        self.json_max_whitespace = json_max_whitespace
        #: Sequences (every prompt x n, or x beams) admitted and not finished: the engine
        #: holds each as its own row, so admission counts them, not HTTP requests (event-loop
        #: thread only).
        self.in_flight = 0
        #: ``--otlp-traces-endpoint``'s span recorder (radixkv/server/tracing.py), or None
        self.tracer: Any = None
        #: prompt tokens of each submitted request while it is before its first token, for
        #: ``--max-num-queued-tokens`` (filled only with that flag; a handle drops out when
        #: collected)
        self.prefill_tokens: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        #: a fleet's ingress draining at shutdown: new generation requests are a 503
        self.draining = False
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
        """Sequences held at once: a full running batch plus ``max_queued`` waiting."""
        return self.ready_engine().max_num_seqs + self.max_queued

    def acquire(self, seqs: int, param: str) -> None:
        """Admit a request of ``seqs`` sequences (prompts x n, or x beams), or refuse it: 400
        when it could never fit (``param`` names the field that makes it too big), 429 when
        it would fit once others finish."""
        if self.draining:
            raise APIError(503, "the server is shutting down; send the request again (to "
                           "another server)", code="shutting_down")
        if seqs > self.capacity:
            raise APIError(400, f"this request needs {seqs} sequences (prompts x n, or x "
                           f"best_of beams); the server holds at most {self.capacity} at once "
                           f"(--max-num-seqs {self.ready_engine().max_num_seqs} + --max-queued "
                           f"{self.max_queued}): split it", param=param,
                           code="too_many_sequences")
        self._queue_limits(seqs)
        if self.in_flight + seqs > self.capacity:
            self.metrics.rejected.labels(self.model_name, "429").inc()
            raise APIError(429, f"the server is at capacity ({self.in_flight} sequences running "
                           f"or queued, this request needs {seqs}, --max-queued "
                           f"{self.max_queued}); retry later", code="queue_full")
        self.in_flight += seqs

    def release(self, seqs: int) -> None:
        self.in_flight -= seqs

    def _queue_limits(self, seqs: int) -> None:
        """vLLM 0.32's admission valves, a 503 (retry on another instance) each:
        ``--max-num-queued-reqs`` bounds the sequences in flight (each prompt x n, as vLLM
        counts a request's n), ``--max-num-queued-tokens`` refuses while the prompts before
        their first token add up to the limit or more (the new request's own not counted, as
        vLLM's; whole prompts, cache hits included, as vLLM's)."""
        fe, m = self.frontend, self.metrics
        limit = fe.max_num_queued_reqs
        if limit is not None and self.in_flight + seqs > limit:
            m.rejected.labels(self.model_name, "503").inc()
            m.admission_rejections.labels(self.model_name, "max_num_queued_reqs").inc()
            raise APIError(503, f"the server is busy ({self.in_flight} sequences in flight, "
                           f"this request needs {seqs}, --max-num-queued-reqs {limit}); retry "
                           "later or on another instance", code="server_busy")
        limit = fe.max_num_queued_tokens
        if limit is not None:
            backlog = self.prefill_backlog()
            if backlog >= limit:
                m.rejected.labels(self.model_name, "503").inc()
                m.admission_rejections.labels(self.model_name, "max_num_queued_tokens").inc()
                raise APIError(503, f"the server's prefill backlog is full ({backlog} prompt "
                               f"tokens before their first token, --max-num-queued-tokens "
                               f"{limit}); retry later or on another instance",
                               code="server_busy")

    def prefill_backlog(self) -> int:
        """Prompt tokens of the requests submitted and not yet past their first token (those
        past it leave the ledger)."""
        total = 0
        for handle, tokens in list(self.prefill_tokens.items()):
            if handle.prefilling:
                total += tokens
            else:
                del self.prefill_tokens[handle]
        return total

    async def drain(self, timeout_s: float, settle_s: float = 10.0) -> dict[str, int]:
        """Stop admitting (503 ``shutting_down``), wait up to ``timeout_s`` for the sequences in
        flight to finish, then end the rest through the backend (``Backend.abort_open``: each
        reader gets a 503, a stream as its last event) and wait up to ``settle_s`` for their
        handlers to let go. A fleet's shutdown (``FleetIngress.drain``); the single server
        drains in uvicorn (``--shutdown-timeout``). Returns the sequences that finished in
        time and the requests ended."""
        self.draining = True
        loop = asyncio.get_running_loop()
        start, waiting = loop.time(), self.in_flight
        while self.in_flight > 0 and loop.time() - start < timeout_s:
            await asyncio.sleep(0.05)
        left, aborted = self.in_flight, 0
        if left and self.engine is not None:
            aborted = self.engine.abort_open(APIError(
                503, f"the server shut down before this request finished (it drains for "
                f"--shutdown-timeout {timeout_s:g} s)", code="shutting_down"))
            end = loop.time() + settle_s
            while self.in_flight > 0 and loop.time() < end:
                await asyncio.sleep(0.05)
        return {"finished_sequences": waiting - left, "aborted_requests": aborted}

    def check_model(self, name: str | None) -> None:
        """A 404 unless ``name`` is this server's model (or one of ``--served-model-name``'s
        other names); None (left out) is the server's model, as vLLM's."""
        if name is not None and name != self.model_name \
                and name not in self.frontend.model_aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    # ------------------------------------------------------------------ metrics
    def observe_finished(self, out: Any, timing: serving.Timing, params: Any = None) -> None:
        """Record a finished engine request (``out`` its final output, ``params`` its
        ``SamplingParams``) in the metrics: latencies, tokens, finish reason, and the
        per-request histograms vLLM's dashboards chart (tokens, parameters, phase times)."""
        m, lab = self.metrics, self.model_name
        now = time.perf_counter()
        if out.ttft is not None:
            m.ttft.labels(lab).observe(out.ttft)
        m.e2e.labels(lab).observe(now - timing.arrived)
        generated = sum(len(c.token_ids) for c in out.outputs)
        m.request_prompt_tokens.labels(lab).observe(len(out.prompt_token_ids))
        m.request_generation_tokens.labels(lab).observe(generated)
        m.request_max_num_generation_tokens.labels(lab).observe(
            max((len(c.token_ids) for c in out.outputs), default=0))
        if params is not None:
            m.request_params_n.labels(lab).observe(getattr(params, "n", 1) or 1)
            max_tokens = getattr(params, "max_tokens", None)
            if max_tokens is not None:
                m.request_params_max_tokens.labels(lab).observe(max_tokens)
        queue = getattr(out, "queue_time", None)
        if queue is not None:   # phases on the engine's clock (its submission, first
            m.request_queue_time.labels(lab).observe(queue)   # admission, first token), the
            if out.ttft is not None and timing.submitted:     # end as this handler saw it
                last = now - timing.submitted
                m.request_prefill_time.labels(lab).observe(max(0.0, out.ttft - queue))
                m.request_decode_time.labels(lab).observe(max(0.0, last - out.ttft))
                m.request_inference_time.labels(lab).observe(max(0.0, last - queue))
        itl = m.itl.labels(lab)
        for gap in timing.gaps:
            itl.observe(gap)
        m.prompt_tokens.labels(lab).inc(len(out.prompt_token_ids))
        m.generation_tokens.labels(lab).inc(generated)
        # one request, however many choices (n) it has: the first choice's reason
        reason = out.outputs[0].finish_reason if out.outputs else None
        m.success.labels(lab, reason or "unknown").inc()


class _Gate:
    """Pure ASGI middleware: stamps each request's arrival time and checks its API key on
    ``/v1/*`` and ``/reset_prefix_cache`` before the body is read (so a caller without a key
    learns nothing else)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return None
        st = scope.setdefault("state", {})
        st["arrived"] = time.perf_counter()
        frontend = self.state.frontend
        if frontend.request_id_headers:
            send = _with_request_id(scope, send)
        path = frontend.route_path(scope)   # below --root-path: what the routes match
        if path.startswith("/v1/") or path in ("/reset_prefix_cache", "/invocations"):
            headers = scope.get("headers", [])
            auth = next((v.decode("latin-1") for k, v in headers if k == b"authorization"),
                        None)
            if auth is None:   # Anthropic's SDKs send the key as x-api-key
                key_header = next((v.decode("latin-1") for k, v in headers
                                   if k == b"x-api-key"), None)
                auth = None if key_header is None else f"Bearer {key_header}"
            key = self.state.tenants.authenticate(auth)
            if key is None:
                self.state.metrics.rejected.labels(self.state.model_name, "401").inc()
                why = APIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                               "<key>' (or 'x-api-key: <key>')", code="invalid_api_key")
                resp = why.response()
                if path.startswith("/v1/messages"):   # Anthropic's error body there
                    from radixkv.server.anthropic import error_body

                    resp = JSONResponse(error_body(401, why.message), status_code=401)
                return await resp(scope, receive, send)
            st["api_key"] = key
        if scope["method"] == "POST":
            receive = await self._bounded(scope, receive, send)
            if receive is None:
                return None
            if frontend.load_tracking and path in LOAD_TRACKED:
                self.state.server_load += 1   # until the response (a stream: its end) is out
                try:
                    await self.app(scope, receive, send)
                    return None
                finally:
                    self.state.server_load -= 1
        await self.app(scope, receive, send)
        return None

    async def _bounded(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        """``receive`` for a body within ``--max-request-bytes``, or None after answering 413.
        A declared ``Content-Length`` is checked before anything is read; a chunked body is
        read up to the limit (never past it) and replayed to the app."""
        limit = self.state.max_request_bytes
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"),
                        None)
        too_big = APIError(413, f"the request body is larger than this server's limit of "
                           f"{limit} bytes (--max-request-bytes)", code="request_too_large")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                size = -1
            if size > limit:
                self.state.metrics.rejected.labels(self.state.model_name, "413").inc()
                await too_big.response()(scope, receive, send)
                return None
            return receive
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                chunks.append(msg)
                break
            total += len(msg.get("body", b""))
            if total > limit:
                self.state.metrics.rejected.labels(self.state.model_name, "413").inc()
                await too_big.response()(scope, receive, send)
                return None
            chunks.append(msg)
            if not msg.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replayed() -> Any:
            return replay.pop() if replay else await receive()

        return replayed


def _check_health(state: ServerState) -> None:
    """``/health`` and ``/ping``: 503 while the model loads or failed to (``ready_engine``),
    and while the backend says it cannot serve (an engine whose steps keep failing:
    ``EngineLoop.health``), so that an orchestrator restarts it and a balancer skips it."""
    why = state.ready_engine().health()
    if why is not None:
        raise APIError(503, why, code="engine_unhealthy")


def _request_defaults(state: ServerState, req: Any) -> None:
    """The server's defaults for what a request leaves unset (vLLM's frontend flags):
    ``chat_template_kwargs`` over ``--default-chat-template-kwargs`` (and under the variables
    of ``reasoning_effort``: :func:`_reasoning_effort`), and ``return_tokens_as_token_ids``
    from ``--return-tokens-as-token-ids``. Idempotent."""
    frontend = state.frontend
    if getattr(req, "return_tokens_as_token_ids", False) is None:
        req.return_tokens_as_token_ids = frontend.return_tokens_as_token_ids
    if hasattr(req, "chat_template_kwargs"):
        own = req.chat_template_kwargs or {}
        req.chat_template_kwargs = frontend.template_kwargs(req.chat_template_kwargs)
        if getattr(req, "reasoning_effort", None) is not None:
            req.chat_template_kwargs = {**(req.chat_template_kwargs or {}),
                                        **_reasoning_effort(state, req, own)}
    template = getattr(req, "chat_template", None)
    if template is not None:
        if not frontend.trust_request_chat_template:
            raise APIError(400, "a request's own chat_template is rendered only by a server "
                           "started with --trust-request-chat-template (rendering a "
                           "client's template can take any CPU and memory)",
                           param="chat_template", code="untrusted_chat_template")
        # every render of this request's prompt (prompt ids, cache breakpoints, documents,
        # tools) passes its template variables to apply_chat_template: the template rides there
        req.chat_template_kwargs = {**(req.chat_template_kwargs or {}),
                                    "chat_template": template}


def _reasoning_effort(state: ServerState, req: Any, own: dict[str, Any]) -> dict[str, Any]:
    """The template variables of a request's ``reasoning_effort``, as vLLM sets them: the value
    as ``reasoning_effort`` (templates with effort levels read it), and ``enable_thinking``
    false for ``none`` and true otherwise unless the request's own ``chat_template_kwargs``
    (``own``) set it (Qwen3-style templates switch thinking with it; the request's effort wins
    over ``--default-chat-template-kwargs``). Where vLLM renders a template that reads neither
    and so ignores the effort, this is a 400 naming ``reasoning_effort``: the client asked for
    something this model's template cannot do."""
    template = getattr(req, "chat_template", None) or getattr(
        state.ready_engine().chat_template.tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else str(template or "")
    if "reasoning_effort" not in text and "enable_thinking" not in text:
        raise APIError(400, "reasoning_effort: this model's chat template has no reasoning "
                       "control (it reads neither reasoning_effort nor enable_thinking)",
                       param="reasoning_effort", code="unsupported_parameter")
    effort = req.reasoning_effort
    out: dict[str, Any] = {"reasoning_effort": effort}
    if "enable_thinking" not in own:
        out["enable_thinking"] = effort != "none"
    return out


def _with_request_id(scope: dict[str, Any], send: Any) -> Any:
    """``send`` that adds ``X-Request-Id`` to the response's headers: the request's own (a
    proxy's trace id), else a new one (``--enable-request-id-headers``, as vLLM's)."""
    rid = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), None) \
        or uuid.uuid4().hex.encode()

    async def send_with_id(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                               (b"x-request-id", rid)]}
        await send(message)

    return send_with_id


def create_app(engine: Any = None, *, load: Callable[[], Any] | None = None,
               model_name: str | None = None, api_keys: list[str] | None = None,
               max_queued: int = 256, default_max_tokens: int | None = None,
               salt_secret: str | None = None,
               extra_metrics: Callable[[], Awaitable[bytes]] | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               on_load_error: Callable[[str], None] | None = None,
               reasoning_parser: str | None = None, cache_reset: bool = False,
               max_logprobs: int = 20, responses_store_size: int = rs.DEFAULT_STORE_SIZE,
               stream_interval: int = 1,
               json_max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
               freeze_heap: bool = False,
               max_conversation_bytes: int = cv.DEFAULT_MAX_BYTES,
               frontend: FrontendOptions | None = None) -> Any:
    """The ASGI app serving ``engine`` (a :class:`radixkv.Engine` or a
    :class:`~radixkv.server.backend.Backend`), or what ``load()`` returns, loaded in a thread at
    start-up (``/health`` is 503 until then). ``model_name`` is what clients pass as ``model``
    (default: the engine's ``model_id``). ``extra_metrics``: awaited for more Prometheus text
    appended to
    ``/metrics`` (the fleet's router). ``max_request_bytes``: larger bodies get 413 before
    they are read. ``on_load_error(message)``: called (in the loading thread) when ``load()``
    fails, e.g. to stop the server (``radixkv serve`` exits non-zero). ``reasoning_parser``: one
    of :data:`radixkv.server.reasoning.PARSERS` (chat replies' thinking apart). ``cache_reset``:
    serve ``POST /reset_prefix_cache``. ``max_logprobs``: ``--max-logprobs``.
    ``responses_store_size``: responses kept for ``previous_response_id`` (0: none), and
    conversations kept. ``max_conversation_bytes``: ``--max-conversation-bytes``, the most a
    conversation (or a ``previous_response_id`` chain) holds before it takes no more.
    ``stream_interval``: ``--stream-interval``. ``json_max_whitespace``:
    ``--structured-outputs-max-whitespace`` (None: unbounded). ``freeze_heap``: the app is the
    process (``radixkv serve``, the fleet's ingress): once loaded and warm, freeze the start-up
    heap out of the garbage collector's passes, and time the collector's pauses for
    ``/metrics`` (:mod:`radixkv.server.heap`); an app embedded in another program leaves its
    collector alone. ``frontend``: vLLM's frontend options (:mod:`radixkv.server.frontend`:
    request-id headers, default template variables, the reply's role, ...; default vLLM's
    defaults). Returns the app wrapped in its gate middleware; the FastAPI object is
    ``app.fastapi`` and the shared state ``app.state``."""
    if engine is None and load is None:
        raise ValueError("create_app needs an engine or a load() function")
    if engine is not None:
        engine = _backend(engine)
    name = model_name or (engine.model_id if engine is not None else "radixkv")
    if reasoning_parser is not None:
        from radixkv.server.reasoning import PARSERS

        if reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, got "
                             f"{reasoning_parser!r}")
    state = ServerState(name, Tenants.create(api_keys or [], salt_secret), max_queued,
                        default_max_tokens, max_request_bytes, reasoning_parser,
                        cache_reset, max_logprobs, responses_store_size, stream_interval,
                        check_max_whitespace(json_max_whitespace), max_conversation_bytes,
                        frontend)
    state.freeze_heap = freeze_heap
    if state.frontend.otlp_traces_endpoint is not None:
        from radixkv.server.tracing import RequestTracer

        state.tracer = RequestTracer(state.frontend.otlp_traces_endpoint)
    pauses = heap.PauseRecorder(state.metrics.gc_pause) if freeze_heap else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> Any:
        if pauses is not None:
            pauses.install()
        if engine is not None:
            await asyncio.to_thread(_warm, state, engine)   # as a loaded one is (_load)
            state.engine = engine
        else:
            threading.Thread(target=_load, args=(state, load, on_load_error),
                             name="radixkv-load",
                             daemon=True).start()
        yield
        for task in list(state.background):   # background responses end as cancelled,
            task.cancel()                      # their engine requests aborted, before the
        if state.background:                   # engine closes
            await asyncio.wait(set(state.background), timeout=5)
        if state.engine is not None:
            state.engine.close()
        if state.tracer is not None:   # the spans still batched go out now
            await asyncio.to_thread(state.tracer.shutdown)
        if pauses is not None:
            pauses.remove()

    frontend = state.frontend
    docs = frontend.docs   # --disable-fastapi-docs: none of the three
    api = FastAPI(title="radixkv", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None,
                  root_path=frontend.root_path)
    install_handlers(api)
    _routes(api, state, extra_metrics)
    for path in frontend.middleware:   # --middleware: the operator's, inside the key check
        kind, obj = load_middleware(path)
        if kind == "class":
            api.add_middleware(obj)
        else:
            api.middleware("http")(obj)
    app: Any = _Gate(api, state)
    if frontend.allowed_origins:
        # outside the gate: a browser's preflight (OPTIONS, no API key) is answered here, and
        # every answer, a 401 included, carries the CORS headers the browser needs to read it
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(app, allow_origins=list(frontend.allowed_origins),
                             allow_methods=list(frontend.allowed_methods),
                             allow_headers=list(frontend.allowed_headers),
                             allow_credentials=frontend.allow_credentials)
    app.fastapi, app.state = api, state
    return app


def _backend(engine: Any) -> Backend:
    return engine if isinstance(engine, Backend) else LocalBackend(engine)


def _load(state: ServerState, load: Callable[[], Any],
          on_error: Callable[[str], None] | None = None) -> None:
    try:
        backend = _backend(load())
        _warm(state, backend)
        state.engine = backend   # ready (/health 200) from here
    except Exception as exc:  # noqa: BLE001 (any load failure: 503 from /health and every endpoint)
        state.load_error = f"{type(exc).__name__}: {exc}"
        print(f"radixkv serve: {state.load_error}", file=sys.stderr, flush=True)
        if on_error is not None:
            on_error(state.load_error)


def _warm(state: ServerState, eng: Backend) -> None:
    """One-time work the first request would otherwise pay, done before the server says it is
    ready: the vocabulary's longest token (:func:`serving.max_token_chars`, ~14 ms on the
    embedded model's 49k-token vocabulary) and a first chat-template render (~4 ms). (The
    engine warms its forward itself: ``EngineConfig.warm_up``.) A backend without a chat
    template leaves both to the first request. Then, where the server owns its process
    (``freeze_heap``), the start-up heap is frozen out of the garbage collector's passes
    (:mod:`radixkv.server.heap`: a full pass over it stopped the engine for ~85 ms)."""
    try:
        state.max_token_chars = serving.max_token_chars(eng)
        eng.chat_template.prompt_ids([{"role": "user", "content": "Hi"}])
    except Exception:  # noqa: BLE001 (an optimisation: the request path computes it again)
        pass
    if state.freeze_heap:
        state.metrics.frozen_objects, _ = heap.freeze_startup_heap()


def _routes(api: FastAPI, state: ServerState,
            extra_metrics: Callable[[], Awaitable[bytes]] | None = None) -> None:
    @api.get("/health")
    async def health() -> Any:
        _check_health(state)
        return {"status": "ok"}

    @api.get("/metrics")
    async def metrics() -> Response:
        snaps: list[Any] = []
        if state.engine is not None:
            snaps = await state.engine.snapshots()
        body = state.metrics.render(snaps)
        if extra_metrics is not None:
            body += await extra_metrics()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    if state.frontend.tokenizer_info:
        @api.get("/tokenizer_info")
        async def get_tokenizer_info() -> Any:
            """vLLM's (``--enable-tokenizer-info-endpoint``): what a client needs to render and
            tokenize prompts itself."""
            from radixkv.server.frontend import tokenizer_info

            return tokenizer_info(state.ready_engine().chat_template.tokenizer)

    @api.get("/load")
    async def load() -> Any:
        """vLLM's: generation requests in flight (chat, completions, responses: from arrival
        to the response's end), counted with ``--enable-server-load-tracking``; 0 without."""
        return {"server_load": state.server_load}

    @api.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness probe: 200 once the model is loaded, 503 while
        its engine fails every step (as ``/health``)."""
        _check_health(state)
        return Response(status_code=200)

    @api.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Any:
        """vLLM's (a development endpoint there too): drop every cached block no running
        request holds, in every tier of this server but a shared remote one, e.g. between
        benchmark runs. Only with ``--enable-cache-reset`` (404 otherwise: it erases what
        every tenant has cached); an API key is needed when the server has keys."""
        if not state.cache_reset:
            raise APIError(404, "Not Found: start the server with --enable-cache-reset to "
                           "serve /reset_prefix_cache", code="not_found")
        dropped = await state.ready_engine().reset_prefix_cache()
        return {"dropped_blocks": dropped}

    @api.get("/version")
    async def version() -> Any:
        from radixkv import __version__

        return {"version": __version__}

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        """vLLM's ``/tokenize``: a prompt (``add_special_tokens``, default true) or chat
        ``messages`` (rendered with the template, generation prompt included) to token ids."""
        eng = state.ready_engine()
        if req.model is not None:
            state.check_model(req.model)
        limit = await _max_token_chars(state, eng)
        if req.documents is not None:
            serving.check_text(eng, serving.document_texts(req), "documents", limit)
        if req.messages is not None:
            from radixkv.server import tools as tool_calls

            template = req.chat_template or getattr(eng.chat_template.tokenizer,
                                                    "chat_template", None)
            try:
                msgs = tool_calls.template_messages(req.messages, tool_calls.history_format(
                    template, state.frontend.tool_call_parser))
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
            serving.check_text(eng, [m["content"] for m in msgs], "messages", limit)
            _request_defaults(state, req)
            variables = dict(req.chat_template_kwargs or {})
            if req.tools:   # rendered as a chat request with these tools renders them
                tool_calls.template_format(template, state.frontend.tool_call_parser)
                variables["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
            if req.documents is not None and not req.default_ending():
                raise APIError(400, "documents are not supported with add_generation_prompt "
                               "false or continue_final_message", param="documents")
            try:
                placed = None if req.documents is None else await asyncio.to_thread(
                    serving.document_prompt, eng, req, msgs, None, True, variables)
                ids = await asyncio.to_thread(functools.partial(
                    eng.chat_template.prompt_ids, **{**req.template_options(), **variables}),
                    msgs) if placed is None else placed.token_ids
            except (TemplateError, ValueError) as exc:
                raise _template_refused(exc) from None
        elif req.prompt is not None:
            serving.check_text(eng, [req.prompt], "prompt", limit)
            if req.documents is not None and any(isinstance(d, dict) for d in req.documents):
                raise APIError(400, "documents of a text prompt are the texts found in it "
                               "(strings)", param="documents")
            placed = None if req.documents is None else await asyncio.to_thread(
                serving.document_prompt, eng, req, None, req.prompt, req.add_special_tokens)
            ids = await asyncio.to_thread(
                eng.encode if req.add_special_tokens else eng.chat_template.encode,
                req.prompt) if placed is None else placed.token_ids
        else:
            raise APIError(400, "give a prompt or messages", param="prompt")
        strs = eng.chat_template.tokenizer.convert_ids_to_tokens(ids) \
            if req.return_token_strs else None
        out = {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids,
               "token_strs": strs}
        if placed is not None:   # where the documents are: for /v1/completions' spans
            out["document_spans"] = [list(sp) for sp in placed.spans]
        return out

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        eng = state.ready_engine()
        if req.model is not None:
            state.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < eng.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in [0, {eng.vocab_size})",
                           param="tokens")
        return {"prompt": await asyncio.to_thread(eng.decode, req.tokens, False)}

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created,
                "owned_by": "radixkv", "root": state.model_name,
                "max_model_len": state.ready_engine().max_model_len}

    @api.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [
            model_card(name) for name in (state.model_name, *state.frontend.model_aliases)]}

    @api.get("/v1/models/{model:path}")
    async def model(model: str) -> Any:
        """OpenAI's retrieve (``client.models.retrieve``; vLLM serves only the list): one of
        this server's names, else a 404 ``model_not_found``. A path: names hold ``/``."""
        state.check_model(model)
        return model_card(model)

    @api.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await _chat(state, request, req)

    @api.post("/v1/chat/completions/batch")
    async def chat_batch(request: Request) -> Any:
        """vLLM's batched chat: ``messages`` is a list of conversations, one choice each."""
        return await _chat_batch(state, request)

    @api.post("/invocations")
    async def invocations(request: Request) -> Any:
        """SageMaker's inference route, as vLLM serves it: a body with ``messages`` is a chat
        completion, one with ``prompt`` a completion (vLLM tries the request types in that
        order). Unlike vLLM's, it takes the API key like ``/v1/*`` (the gate)."""
        body = await _json_body(request)
        if not isinstance(body, dict) or not ({"messages", "prompt"} & body.keys()):
            raise APIError(400, "/invocations takes a chat completion (messages) or a "
                           "completion (prompt) request", param="messages")
        try:
            if "messages" in body:
                return await _chat(state, request, ChatCompletionRequest.model_validate(body))
            return await completions(CompletionRequest.model_validate(body), request)
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors())) from None

    @api.post("/v1/messages")
    async def messages(request: Request) -> Any:
        """Anthropic's Messages API over the chat path (radixkv/server/anthropic.py)."""
        return await _messages(state, request)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Any:
        return await _messages(state, request, count_only=True)

    @api.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        return await _responses(state, request, req)

    @api.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request, stream: bool = False,
                           starting_after: int | None = None) -> Any:
        entry = state.responses.get(_tenant(request), response_id)
        if entry is None:
            raise rs.not_found(response_id)
        if not stream:
            return entry.current()
        if entry.run is None or entry.run.events is None:
            raise APIError(400, "stream is for background responses created with stream: "
                           "true (their events are kept)", param="stream")
        if starting_after is not None and starting_after < 0:
            raise APIError(400, f"starting_after must be >= 0, got {starting_after}",
                           param="starting_after")
        after = -1 if starting_after is None else starting_after
        return StreamingResponse(entry.run.follow(after), media_type="text/event-stream")

    @api.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Any:
        entry = state.responses.get(_tenant(request), response_id)
        if entry is None:
            raise rs.not_found(response_id)
        run = entry.run
        if run is None:
            raise APIError(400, "only background responses can be cancelled",
                           param="response_id")
        if run.done and entry.response["status"] != "cancelled":
            raise APIError(400, f"the response is already {entry.response['status']}",
                           param="response_id")
        await run.cancel()
        # the run's ending stored the cancelled response in a new entry (unless the store
        # dropped it meanwhile)
        now = state.responses.get(_tenant(request), response_id, touch=False) or entry
        return now.response

    @api.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request,
                                   after: str | None = None, limit: int = 20,
                                   order: str = "desc") -> Any:
        entry = state.responses.get(_tenant(request), response_id)
        if entry is None:
            raise rs.not_found(response_id)
        _check_page(limit, order)
        return rs.page(entry.input_items(), after, limit, order)

    @api.post("/v1/conversations")
    async def create_conversation(body: ConversationCreate, request: Request) -> Any:
        conv = state.conversations.create(_tenant(request), cv.new_items(body.items or []),
                                          cv.check_metadata(body.metadata))
        return conv.body()

    @api.get("/v1/conversations/{conversation_id}")
    async def get_conversation(conversation_id: str, request: Request) -> Any:
        return state.conversations.get(_tenant(request), conversation_id).body()

    @api.post("/v1/conversations/{conversation_id}")
    async def update_conversation(conversation_id: str, body: ConversationUpdate,
                                  request: Request) -> Any:
        conv = state.conversations.get(_tenant(request), conversation_id)
        conv.metadata = cv.check_metadata(body.metadata)
        return conv.body()

    @api.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str, request: Request) -> Any:
        state.conversations.delete(_tenant(request), conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @api.post("/v1/conversations/{conversation_id}/items")
    async def add_conversation_items(conversation_id: str, body: ConversationItemsCreate,
                                     request: Request) -> Any:
        conv = state.conversations.get(_tenant(request), conversation_id)
        added = cv.new_items(body.items)
        conv.check_unlocked()
        conv.add(added, state.conversations.max_bytes)
        return rs.page(added, None, max(1, len(added)), "asc")

    @api.get("/v1/conversations/{conversation_id}/items")
    async def list_conversation_items(conversation_id: str, request: Request,
                                      after: str | None = None, limit: int = 20,
                                      order: str = "desc") -> Any:
        conv = state.conversations.get(_tenant(request), conversation_id)
        _check_page(limit, order)
        return rs.page(conv.items, after, limit, order)

    @api.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_conversation_item(conversation_id: str, item_id: str,
                                    request: Request) -> Any:
        return state.conversations.get(_tenant(request), conversation_id).item(item_id)

    @api.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_conversation_item(conversation_id: str, item_id: str,
                                       request: Request) -> Any:
        conv = state.conversations.get(_tenant(request), conversation_id)
        item = conv.item(item_id)
        conv.check_unlocked()
        conv.remove(item)
        return conv.body()

    @api.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Any:
        if not state.responses.delete(_tenant(request), response_id):
            raise rs.not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        eng = state.ready_engine()
        state.check_model(req.model)
        _request_defaults(state, req)
        if req.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        p = req.prompt
        prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) \
            else list(p)
        _admissible(state, len(prompts), req, "prompt")
        texts = [x for x in prompts if isinstance(x, str)]
        if texts:
            limit = await _max_token_chars(state, eng)
            for x in texts:   # each prompt alone must fit the context
                serving.check_text(eng, [x], "prompt", limit)
        if req.documents is not None and isinstance(req.prompt, str):   # texts found in it
            serving.check_text(eng, serving.document_texts(req), "documents",
                               await _max_token_chars(state, eng))
            ids = [(await _off_loop(len(req.prompt), serving.document_prompt, eng, req, None,
                                    req.prompt, req.add_special_tokens)).token_ids]
        else:
            encode = eng.encode if req.add_special_tokens else eng.chat_template.encode
            ids = [await _off_loop(len(x), encode, x) if isinstance(x, str) else list(x)
                   for x in prompts]
        points = None
        if req.prompt_cache_retention:
            points = [[serving.retention_point(len(x), req.prompt_cache_retention)] if x
                      else None for x in ids]
        return await _serve(state, request, req, ids, chat=False, points=points)


async def _chat(state: ServerState, request: Request, req: ChatCompletionRequest,
                count_only: bool = False) -> Any:
    """``POST /v1/chat/completions`` (and the chat request a Responses request becomes).
    ``count_only``: the prompt's length in tokens, nothing served (Responses' truncation)."""
    eng = state.ready_engine()
    state.check_model(req.model)
    _request_defaults(state, req)
    marks = [m.cache_control for m in req.messages]
    if sum(m is not None for m in marks) > MAX_CACHE_MARKS:
        raise APIError(400, f"at most {MAX_CACHE_MARKS} messages may carry cache_control "
                       f"(got {sum(m is not None for m in marks)})", param="messages",
                       code="too_many_cache_breakpoints")
    try:
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.text()} for m in req.messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    serving.check_text(eng, [m["content"] for m in messages], "messages",
                       await _max_token_chars(state, eng))
    if req.tools or any(m.tool_calls for m in req.messages):
        return await _chat_with_tools(state, request, req, eng, count_only)
    chars = sum(len(m["content"]) for m in messages)
    if req.chat_template is not None:   # a client's template: its cost is unknown, never inline
        chars = max(chars, INLINE_TOKENIZE_CHARS + 1)
    if req.documents is not None:   # RAG documents placed by the server (serve.md)
        docs = serving.document_texts(req)
        serving.check_text(eng, docs + [m["content"] for m in messages], "documents",
                           await _max_token_chars(state, eng))
        chars += sum(map(len, docs))
    try:
        ids = await _off_loop(chars, functools.partial(
            eng.chat_template.prompt_ids, **req.template_options()), messages) \
            if req.documents is None else \
            (await _off_loop(chars, serving.document_prompt, eng, req, messages)).token_ids
        points = None
        if any(marks) or req.prompt_cache_retention:
            points = await _off_loop(
                chars * (1 + sum(m is not None for m in marks)), serving.cache_points,
                eng.chat_template, messages, marks, len(ids),
                req.prompt_cache_retention, req.chat_template_kwargs)
    except (TemplateError, ValueError) as exc:   # the template refuses these messages
        raise _template_refused(exc) from None
    if count_only:
        return len(ids)
    return await _serve(state, request, req, [ids], chat=True,
                        points=None if points is None else [points],
                        chat_echo=serving.chat_echo(req, messages),
                        chat_role=serving.chat_role(req, messages,
                                                    state.frontend.response_role))


async def _json_body(request: Request) -> Any:
    """The body of a route that parses its own JSON (``/invocations``, the batched chat, the
    Messages API), or a 400 saying why it is not JSON (nested too deep included: a
    ``RecursionError``, not a ``ValueError``; FastAPI's own parsing answers the other routes so
    too)."""
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the body is not JSON: nested too deep") from None


#: ``/v1/chat/completions/batch`` fields that must keep their default (vLLM's limits of it)
_BATCH_FIXED: dict[str, tuple[Any, ...]] = {
    "stream": (False, None), "tools": (None, []), "use_beam_search": (False, None),
    "n": (1, None)}


async def _chat_batch(state: ServerState, request: Request) -> Any:
    """``POST /v1/chat/completions/batch`` (vLLM 0.32's): the fields of a chat request with
    ``messages`` a list of conversations; the answer is one ``chat.completion`` with a choice
    per conversation (``index`` its place) and the usage summed. As vLLM's: not streamed, no
    tools, no beam search, ``n`` 1 (a 400 naming the field otherwise). Each conversation is
    served as the chat request it would be alone (same template, cache, validation; the
    prefix cache makes a shared system prompt or document computed once), all at once; the
    batch is admitted as a whole (``--max-queued`` counts each conversation) and any refusal
    refuses the batch, before or while the others run (they are cancelled)."""
    body = await _json_body(request)
    convs = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(convs, list) or not convs or not all(
            isinstance(c, list) and c for c in convs):
        raise APIError(400, "messages must be a non-empty list of conversations, each a "
                       "non-empty list of messages", param="messages")
    for name, allowed in _BATCH_FIXED.items():
        if name in body and body[name] not in allowed:
            raise APIError(400, f"{name} is not supported by the batched chat endpoint (use "
                           "/v1/chat/completions)", param=name, code="unsupported_parameter")
    reqs = []
    for i, conv in enumerate(convs):
        try:
            reqs.append(ChatCompletionRequest.model_validate({**body, "messages": conv}))
        except ValidationError as exc:
            err = validation_error(RequestValidationError(exc.errors()))
            if err.param == "messages":
                err.message = f"conversation {i}: {err.message}"
            raise err from None
    state.check_model(reqs[0].model)
    _admissible(state, len(reqs), reqs[0], "messages")
    # One watch for the client's disconnect, here: each conversation's request sees a receive
    # that never returns (several concurrent readers of one ASGI receive channel is not a
    # pattern every server supports: Ray Serve's proxy stalled on it)
    inner = Request(request.scope, receive=_never)

    async def one(i: int, r: ChatCompletionRequest) -> Any:
        try:
            return await _chat(state, inner, r)
        except APIError as exc:   # (which conversation the refusal is about)
            exc.message = f"conversation {i}: {exc.message}"
            raise

    async def all_of() -> list[Any]:
        """Every conversation's answer; the first refusal (or a cancel) cancels the rest and
        is the batch's (a task group's semantics, without Python 3.11's TaskGroup)."""
        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(reqs)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    answers = await _unless_disconnected(request, all_of())
    if answers is None:
        return Response(status_code=499)   # the client went away: the work was cancelled
    for a in answers:
        if not isinstance(a, JSONResponse) or a.status_code != 200:
            return a
    bodies = [json.loads(bytes(a.body)) for a in answers]
    choices = []
    for i, b in enumerate(bodies):
        for c in b["choices"]:
            choices.append({**c, "index": i})
    return JSONResponse({"id": serving.new_id("chatcmpl"), "object": "chat.completion",
                         "created": int(time.time()), "model": state.model_name,
                         "choices": choices,
                         "usage": serving.sum_usage([b.get("usage") for b in bodies])})


def _check_page(limit: int, order: str) -> None:
    """A 400 for a list's ``limit`` outside 1..100 or an ``order`` other than asc / desc."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be asc or desc, got {order!r}", param="order")


def _tenant(request: Request) -> str:
    """The API key the request authenticated with ("" on a server without keys)."""
    return getattr(request.state, "api_key", "") or ""


async def _responses(state: ServerState, request: Request, req: ResponsesRequest) -> Any:
    """``POST /v1/responses``: the request as a chat request (radixkv/server/responses.py),
    continuing a stored conversation with ``previous_response_id``, answered as a
    ``Response`` or its event stream, and stored (``store``) once it completed; with
    ``background`` run apart from this HTTP request (:func:`_background`)."""
    state.ready_engine()
    tenant = _tenant(request)
    history: tuple[dict[str, Any], ...] = ()
    history_size = 0   # as --max-conversation-bytes counts it (cv.item_size)
    conv = None
    cid = cv.conversation_id(req.conversation)
    if cid is not None:
        if req.previous_response_id is not None:
            raise APIError(400, "conversation and previous_response_id both say what came "
                           "before: send one", param="conversation")
        conv = state.conversations.get(tenant, cid, param="conversation")
        conv.check_room(state.conversations.max_bytes)
        history = tuple(conv.messages())
        history_size = conv.size
    rid = rs.new_id("resp")
    # One response at a time in a conversation (a 400 conversation_locked otherwise); the
    # release is handed to the stream or the background run where those outlive this call.
    release = conv.lock(rid) if conv is not None else (lambda: None)
    handed = False
    try:
        if req.background and (not req.store or state.responses.capacity == 0):
            raise APIError(400, "background needs store: true (and a server that stores "
                           "responses, --responses-store-size > 0): it is read back by id",
                           param="background")
        if req.previous_response_id is not None:
            prev = state.responses.get(tenant, req.previous_response_id)
            if prev is None:
                raise rs.not_found(req.previous_response_id, "previous_response_id")
            if prev.current()["status"] in ("queued", "in_progress"):
                raise APIError(400, f"response {req.previous_response_id!r} is still in "
                               "progress", param="previous_response_id")
            if prev.size >= state.conversations.max_bytes:   # bounded as a conversation
                raise cv.too_large(f"the conversation that response "
                                   f"{req.previous_response_id!r} ended", prev.size,
                                   state.conversations.max_bytes, "previous_response_id")
            history, history_size = prev.messages, prev.size
        body, new = rs.chat_request(req, history)
        if req.background:   # generated as a stream whatever the client asked (_background)
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        body["model"] = req.model or state.model_name
        chat_req = _as_chat(body)
        conversation = (*history, *new)
        size = history_size + sum(map(cv.item_size, new))

        def join(final: dict[str, Any]) -> None:   # the conversation grows by this turn
            if conv is not None and final["status"] != "failed":
                cv.record(conv, new, final)
            release()

        def keep(final: dict[str, Any]) -> None:
            if req.store:
                reply = rs.assistant_message(final["output"])
                state.responses.put(rid, rs.Stored(tenant, (*conversation, reply), final,
                                                   size=size + cv.item_size(reply)))
            join(final)

        try:
            answer = await _chat(state, request, chat_req)
        except APIError as exc:
            if req.truncation != "auto" or exc.code != "context_length_exceeded":
                raise
            chat_req = await _truncated(state, request, req, body, conversation)
            answer = await _chat(state, request, chat_req)
        if req.background:
            queued = _background(state, tenant, rid, req, conversation, size, answer, join)
            handed = True   # released when the run ends (join)
            return queued
        if isinstance(answer, _Stream):
            events = rs.EventStream(rid, req, state.model_name, keep)

            def closed() -> None:
                answer.on_close()
                release()

            stream = _Stream(events.adapt(answer.body_iterator), closed,
                             state.frontend.sse_keep_alive_interval)
            handed = True   # released when the stream ends, however it ends
            return stream
        if not isinstance(answer, JSONResponse) or answer.status_code != 200:
            return answer   # the client went away (499)
        chat = json.loads(bytes(answer.body))
        choice = chat["choices"][0]
        final = rs.response_body(rid, req, state.model_name, int(time.time()),
                                 rs.output_items(choice["message"], choice.get("logprobs")),
                                 rs.usage(chat["usage"]),
                                 choice["finish_reason"])
        keep(final)
        return JSONResponse(final)
    finally:
        if not handed:
            release()


async def _messages(state: ServerState, request: Request, count_only: bool = False) -> Any:
    """``POST /v1/messages`` (``count_only``: ``/v1/messages/count_tokens``): the request as
    a chat request (radixkv/server/anthropic.py), answered as a ``message`` or its event
    stream (or ``{"input_tokens": N}``); every error in Anthropic's body."""
    from radixkv.errors import InvalidRequestError
    from radixkv.server import anthropic as am

    try:
        data = await _json_body(request)
        try:
            req = (am.CountTokensRequest if count_only else am.MessagesRequest
                   ).model_validate(data)
        except ValidationError as exc:
            raise validation_error(RequestValidationError(exc.errors())) from None
        try:
            chat_req = ChatCompletionRequest.model_validate(am.chat_body(req, state.model_name))
        except ValidationError as exc:
            err = validation_error(RequestValidationError(exc.errors()))
            err.param = am.chat_param(err.param)
            raise err from None
        if count_only:
            n = await _chat(state, request, chat_req, count_only=True)
            return JSONResponse({"input_tokens": int(n)})
        answer = await _chat(state, request, chat_req)
        mid = am.new_id()
        stops = getattr(req, "stop_sequences", None)
        if isinstance(answer, _Stream):
            events = am.MessageStream(mid, state.model_name, stops)
            return _Stream(events.adapt(answer.body_iterator), answer.on_close,
                           state.frontend.sse_keep_alive_interval)
        if not isinstance(answer, JSONResponse) or answer.status_code != 200:
            return answer   # the client went away (499)
        chat = json.loads(bytes(answer.body))
        return JSONResponse(am.message_body(mid, state.model_name, chat, stops))
    except APIError as exc:
        param = am.chat_param(exc.param)   # the Messages field the chat field came from
        message = exc.message if param is None or param == exc.param \
            else f"{param}: {exc.message}"
        return JSONResponse(am.error_body(exc.status, message), status_code=exc.status)
    except InvalidRequestError as exc:
        return JSONResponse(am.error_body(400, str(exc)), status_code=400)


def _as_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request a Responses request became; a 400 names the Responses field."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = validation_error(RequestValidationError(exc.errors()))
        err.param = rs.response_param(err.param)
        raise err from None


async def _truncated(state: ServerState, request: Request, req: ResponsesRequest,
                     body: dict[str, Any], conversation: Sequence[dict[str, Any]]
                     ) -> ChatCompletionRequest:
    """``truncation: "auto"`` for a request whose prompt does not fit: the chat request
    without the fewest earliest turns of ``conversation`` (:func:`rs.without_turns`) such
    that the prompt and ``max_output_tokens`` fit the context, found by bisection over the
    prompt's length (each probe templates and tokenizes, serves nothing). When even the last
    turn alone does not fit, the request without every earlier turn, whose serving raises
    the 400 as without truncation."""
    head = body["messages"][:len(body["messages"]) - len(conversation)]   # the instructions
    starts = rs.turn_starts(conversation)
    need = req.max_output_tokens or 1
    limit = state.ready_engine().max_model_len

    def cut(k: int) -> ChatCompletionRequest:
        return _as_chat({**body, "messages": [*head, *rs.without_turns(conversation, starts,
                                                                        k)]})

    async def fits(k: int) -> bool:
        try:
            return int(await _chat(state, request, cut(k), count_only=True)) + need <= limit
        except APIError as exc:
            if exc.code != "context_length_exceeded":
                raise
            return False

    lo, hi = 1, len(starts) - 1   # the smallest k in [lo, hi] that fits; hi: the last turn
    if hi < lo or not await fits(hi):
        return cut(max(hi, 0))
    while lo < hi:
        mid = (lo + hi) // 2
        if await fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return cut(lo)


def _background(state: ServerState, tenant: str, rid: str, req: ResponsesRequest,
                conversation: tuple[dict[str, Any], ...], size: int, answer: Any,
                on_end: Callable[[dict[str, Any]], None] = lambda final: None) -> Any:
    """A background response: ``answer`` (the chat stream, already admitted and in the engine,
    so a 400 or 429 reached the client before this) is driven by a task of its own, which
    neither a client that goes away nor the end of this HTTP request stops; only
    ``POST /v1/responses/{id}/cancel`` does. The response is stored at once (``queued``) and
    again when it ends. Answers the queued response, or with ``stream`` its events as they
    come (the same a ``GET ?stream=true`` replays). ``size``: the conversation's
    (:attr:`rs.Stored.size`). ``on_end(final)``: once it ended (its conversation grows by it)."""
    if not isinstance(answer, _Stream):   # the stream path always answers a stream
        raise RuntimeError(f"a background chat request answered {type(answer).__name__}")
    events = rs.EventStream(rid, req, state.model_name, queued=True)
    run = rs.Run(events, keep_events=req.stream)
    first = events.snapshot()
    state.responses.put(rid, rs.Stored(tenant, conversation, first, len(conversation), run,
                                       size))

    async def drive() -> None:
        async for event in events.adapt(answer.body_iterator):
            run.push(event)

    def ended(task: asyncio.Task[None]) -> None:
        # a done callback, not a ``finally``: a task cancelled before it first ran runs no
        # code of its own, and its request must still leave the engine and the admission
        state.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background response %s failed", rid, exc_info=task.exception())
        answer.on_close()   # admission slot back, engine request aborted if still there
        final = run.ended()
        reply = () if final["status"] == "failed" else (rs.assistant_message(final["output"]),)
        state.responses.put(rid, rs.Stored(tenant, (*conversation, *reply), final,
                                           len(conversation), run,
                                           size + sum(map(cv.item_size, reply))))
        on_end(final)
        run.finish()

    run.task = asyncio.ensure_future(drive())
    state.background.add(run.task)   # held: the loop keeps only weak references to tasks
    run.task.add_done_callback(ended)
    if req.stream:
        return StreamingResponse(run.follow(), media_type="text/event-stream")
    return JSONResponse(first)


def _template_refused(exc: Exception) -> APIError:
    """The 400 for messages the chat template (or ``apply_chat_template``, e.g. a
    ``continue_final_message`` whose last message the template does not write as given)
    refuses."""
    return APIError(400, f"the chat template rejected the messages: {exc}", param="messages")


async def _off_loop(chars: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (templating, tokenization) for text of ``chars`` characters: inline when
    it is short (:data:`INLINE_TOKENIZE_CHARS`), else in a worker thread so that the event loop
    keeps streaming other requests' tokens meanwhile."""
    if chars <= INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def _max_token_chars(state: ServerState, eng: Backend) -> int:
    """The longest token of the vocabulary in characters: computed once, in a thread, and
    awaited by every request that arrives meanwhile (a burst of requests on a server that
    skipped :func:`_warm` would otherwise each walk the vocabulary: 256 of them, ~3.6 s of
    CPU beside the engine, in ``radixkv run-batch`` before this was shared)."""
    if state.max_token_chars is None:
        if state.max_token_chars_task is None:
            state.max_token_chars_task = asyncio.ensure_future(
                asyncio.to_thread(serving.max_token_chars, eng))
        state.max_token_chars = await asyncio.shield(state.max_token_chars_task)
    return state.max_token_chars


async def _grammar(state: ServerState, eng: Backend, req: Any) -> Any:
    """The compiled grammar of the request's output constraint: ``response_format`` (none
    for ``text``), vLLM's ``structured_outputs`` or its older ``guided_*`` fields; None
    without one. A constraint that does not compile is a 400 naming its field."""
    found = req.output_constraint()
    if found is None:
        return None
    gc = await _compiler(state, eng, found[0])
    return await _constraint_grammar(gc, req, found, compiled=True)


async def _constraint_grammar(gc: Any, req: Any, found: tuple[str, str, Any],
                              compiled: bool) -> Any:
    """The grammar of the constraint ``found`` (``req.output_constraint()``): compiled, or
    (``compiled`` False, checked) its ``(kind, value, any_whitespace)`` to combine with another.
    A 400 naming its field when it does not compile."""
    from radixkv.errors import InvalidRequestError

    param, kind, value = found
    try:
        if kind == "json" and isinstance(value, str):   # vLLM takes the schema's text too
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                raise InvalidRequestError("the JSON schema is not JSON") from None
        spaces = not getattr(req.structured_outputs, "disable_any_whitespace", False)
        if compiled:
            return await asyncio.to_thread(gc.compile, kind, value, spaces)
        await asyncio.to_thread(gc.source, kind, value, spaces)   # a 400 now if it is wrong
        return kind, value, spaces
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=param) from None


async def _compiler(state: ServerState, eng: Backend, param: str) -> Any:
    """The server's grammar compiler (the vocabulary's token table, about a second), built
    once in a thread; a 400 naming ``param`` where grammars cannot run. A fleet's replicas
    compile the same recipes with their own (``engine.grammar.register_compiler``)."""
    from radixkv.engine.grammar import GrammarCompiler
    from radixkv.errors import ConfigError

    try:
        if state.grammar_compiler is None:
            state.grammar_compiler = await asyncio.to_thread(
                GrammarCompiler, eng.chat_template.tokenizer, eng.vocab_size,
                eng.eos_token_ids or None, state.json_max_whitespace)
    except ConfigError as exc:
        raise APIError(400, str(exc), param=param) from None
    return state.grammar_compiler


async def _chat_with_tools(state: ServerState, request: Request, req: Any, eng: Backend,
                           count_only: bool = False) -> Any:
    """A chat request with ``tools`` (``tool_choice`` auto, required or named): the tools
    rendered by the model's template, calls forced by a grammar when required, and the reply's
    calls (in the template's format, or ``--tool-call-parser``'s) answered as OpenAI
    ``tool_calls`` (radixkv/server/tools.py).
    ``count_only``: as :func:`_chat`'s."""
    from radixkv.api.chat import _ids
    from radixkv.errors import InvalidRequestError
    from radixkv.server import tools as tool_calls

    tok = eng.chat_template.tokenizer
    template = req.chat_template or getattr(tok, "chat_template", None)
    fmt = tool_calls.template_format(template, state.frontend.tool_call_parser)
    if req.use_beam_search:
        raise APIError(400, "use_beam_search is not supported together with tools yet",
                       param="use_beam_search", code="unsupported_parameter")
    # response_format / structured_outputs / guided_*: the shape of a reply that is not a call
    constraint = req.output_constraint()
    # tool_choice none: the tools are not offered (nor parsed), but a history with calls and
    # their results is still rendered as the template writes them
    active = bool(req.tools) and req.tool_choice != "none"
    defs = [t.model_dump(exclude_none=True) for t in req.tools] if active else None
    if active:
        tool_calls.check_names(fmt, (t.function.name for t in req.tools), template)
    msgs = tool_calls.template_messages(req.messages, fmt)
    if active and tool_calls.keeps_special_tokens(fmt):
        req.skip_special_tokens = False   # Mistral's [TOOL_CALLS] is a special token
    # what the template renders besides the messages (cache points and documents alike)
    variables = {**(req.chat_template_kwargs or {}), **({"tools": defs} if defs else {})}
    if req.documents is not None:
        serving.check_text(eng, serving.document_texts(req), "documents",
                           await _max_token_chars(state, eng))
    marks = [m.cache_control for m in req.messages]
    try:
        if req.documents is not None:   # placed as in a plain chat, the tools rendered too
            ids = (await asyncio.to_thread(serving.document_prompt, eng, req, msgs, None, True,
                                           variables)).token_ids
        else:
            ids = await asyncio.to_thread(lambda: _ids(tok.apply_chat_template(
                msgs, tools=defs, tokenize=True, **req.template_options())))
        points = None
        if any(marks) or req.prompt_cache_retention:
            points = [await asyncio.to_thread(
                serving.cache_points, eng.chat_template, msgs, marks, len(ids),
                req.prompt_cache_retention, variables)]
    except (TemplateError, ValueError) as exc:
        raise _template_refused(exc) from None
    if count_only:
        return len(ids)
    grammar = None   # none: _serve compiles the constraint, if any, alone
    choice = req.tool_choice
    forced = choice == "required" or not isinstance(choice, (str, type(None)))
    if forced or (active and constraint is not None):
        # a call is forced (of any tool, or the named one), or with "auto" and a constraint:
        # calls of any tool, or a reply of the constraint's shape
        wanted = [t.function for t in req.tools
                  if not forced or choice == "required"
                  or t.function.name == choice.function.name]
        gc = await _compiler(state, eng, "tool_choice")
        otherwise = None
        if not forced and constraint is not None:
            otherwise = await _constraint_grammar(gc, req, constraint, compiled=False)
        shape = tool_calls.grammar_shape(fmt, template)
        # "required" (and "auto" beside a constraint) call one or more tools, as OpenAI's and
        # vLLM's do, unless parallel_tool_calls is false; a named tool is called once
        once = (forced and choice != "required") or req.parallel_tool_calls is False
        try:
            grammar = await asyncio.to_thread(functools.partial(
                gc.tool_call, [(f.name, f.parameters) for f in wanted], shape.open_tag,
                shape.close_tag, otherwise, args_key=shape.args_key,
                separator=None if once else shape.separator, around=shape.around,
                name_first=shape.name_first, style=shape.style))
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param="tools") from None
    return await _serve(state, request, req, [ids], chat=True, points=points, grammar=grammar,
                        tools=tool_calls.Reader(
                            fmt, frozenset(t.function.name for t in req.tools),
                            single=req.parallel_tool_calls is False and not forced,
                            params={t.function.name: t.function.parameters
                                    for t in req.tools})
                        if active else None,
                        stop_after=tool_calls.stop_after(req.parallel_tool_calls, active,
                                                         forced, fmt),
                        chat_echo=serving.chat_echo(req, msgs),
                        chat_role=serving.chat_role(req, msgs,
                                                    state.frontend.response_role))


def _num_seqs(req: Any) -> int:
    """Sequences one prompt of ``req`` holds in the engine: its samples, or its beams."""
    n: int = req.n
    return max(n, req.best_of or n) if req.use_beam_search else n


def _admissible(state: ServerState, num_prompts: int, req: Any, param: str) -> None:
    """Refuse a request that could never be admitted before any prompt is tokenized."""
    if num_prompts * _num_seqs(req) > state.capacity:
        state.acquire(num_prompts * _num_seqs(req), param if num_prompts > 1 else "n")


async def _serve(state: ServerState, request: Request, req: Any, prompts: list[list[int]],
                 chat: bool, points: list[Any] | None = None, grammar: Any = None,
                 tools: Reader | None = None, stop_after: tuple[str, ...] = (),
                 chat_echo: str | None = None, chat_role: str = "assistant") -> Any:
    """Validate every prompt, then answer with one body or an SSE stream. ``chat_echo``: the
    text a chat reply's content starts with (vLLM's chat ``echo``); ``chat_role``: its role
    (:func:`serving.chat_role`). ``points``: per
    prompt, its cache points (breakpoints, retention) or None. ``grammar``: one that
    constrains the output (tool calls), instead of ``response_format``'s; ``tools``: a
    ``tools.Reader`` that reads the replies' tool calls; ``stop_after``: strings that end a
    reply and stay in it (``SamplingParams.stop_after``)."""
    points = points or [None] * len(prompts)
    eng = state.ready_engine()
    vocab = eng.vocab_size
    prompts = serving.truncate(req, prompts, eng.max_model_len)
    if grammar is None:
        grammar = await _grammar(state, eng, req)
    thinking = None   # where a reasoning model's thinking ends (grammars, thinking budgets)
    if chat and state.reasoning_parser is not None:
        thinking = serving.thinking_marks(eng.chat_template.tokenizer, state.reasoning_parser)
    if grammar is not None and thinking is not None:
        # a reasoning model thinks first: the grammar shapes the answer after it
        grammar = grammar.after_thinking(thinking)
    params = []
    for ids in prompts:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in [0, {vocab})", param="prompt")
        seq_thinking, seq_grammar = thinking, grammar
        if not chat and req.thinking_token_budget is not None \
                and state.reasoning_parser is not None:
            # a completion's prompt says whether its reply starts inside the thinking; the
            # grammar, if any, then shapes the answer after it, as in a chat
            seq_thinking = serving.completion_thinking(eng.chat_template.tokenizer,
                                                       state.reasoning_parser, ids)
            if grammar is not None and seq_thinking is not None:
                seq_grammar = grammar.after_thinking(seq_thinking)
        params.append(serving.sampling_params(req, len(ids), eng.max_model_len,
                                              state.default_max_tokens, vocab, seq_grammar,
                                              eng.sampling_defaults, state.max_logprobs,
                                              seq_thinking))
    if stop_after:
        params = [dataclasses.replace(sp, stop_after=stop_after) for sp in params]
    if req.stream and len(prompts) > 1:
        raise APIError(400, "stream one prompt per request", param="prompt")
    hints = {**serving.session_hints(req), **serving.priority_hint(
        req, request.headers.get(serving.PRIORITY_HEADER), eng.scheduling_policy)}
    key = request.state.api_key if hasattr(request.state, "api_key") else ""
    salt = state.tenants.cache_salt(key, serving.request_salt(req))
    timing = serving.Timing(arrived=getattr(request.state, "arrived", time.perf_counter()))
    if state.tracer is not None:
        from radixkv.server.tracing import trace_headers

        timing.trace_headers = trace_headers(request.headers)
    rid, eid = serving.response_ids("chatcmpl" if chat else "cmpl",
                                    request.headers.get("x-request-id"), req.request_id)
    seqs = len(prompts) * _num_seqs(req)
    state.acquire(seqs, "prompt" if len(prompts) > 1 else "n")
    if req.stream:
        release = _once(lambda: state.release(seqs))
        try:   # in the engine before the response starts: it computes while headers go out
            handle = await serving.submit(state, eid, prompts[0], params[0], salt, timing,
                                          points[0], hints, log_id=rid)
        except BaseException:
            release()
            raise

        def close() -> None:   # however the response ends (its generator may never start)
            release()
            serving.abort(state, handle, timing)

        echo = chat_echo if chat else (
            eng.decode(prompts[0]) if getattr(req, "echo", False) else None)
        return _Stream(_events(state, req, rid, handle, params[0], timing, chat, close,
                               tools, echo, prompts[0], chat_role, eid), close,
                       state.frontend.sse_keep_alive_interval)
    # Only the result is read: the engine builds, routes and wakes this loop for no snapshot
    # per step (final_only); TTFT comes from the engine's first-token reading (serving.run).
    params = [dataclasses.replace(sp, output_kind=OUTPUT_FINAL_ONLY) for sp in params]
    # the name the request log and the trace span give each prompt: vLLM's (a chat's one
    # prompt is the response's id, a completion's prompts ID-0, ID-1, ...)
    names = [rid] if chat and len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    try:
        outs = await _unless_disconnected(request, asyncio.gather(*(
            _final(state, f"{eid}-{i}", ids, sp, salt, timing, pts, hints, names[i])
            for i, (ids, sp, pts) in enumerate(zip(prompts, params, points)))))
    finally:
        state.release(seqs)
    if outs is None or any(o is None for o in outs):
        return Response(status_code=499)   # the client is gone; nobody reads this
    choices = []
    n = req.n
    echo_prompt = not chat and bool(getattr(req, "echo", False))
    only = serving.echo_only(req)   # max_tokens 0: the prompt alone

    def decode(tid: int) -> str:
        text: str = eng.decode([tid], skip_special_tokens=False)
        return text

    label = serving.token_id_label if req.return_tokens_as_token_ids else decode
    for i, out in enumerate(outs):
        for c in out.outputs:
            text = "" if only else c.text
            lps = _logprobs(eng, chat, c.logprobs, 0, req.return_tokens_as_token_ids)
            if echo_prompt:
                text = eng.decode(out.prompt_token_ids) + text
                if c.logprobs is not None:   # the prompt's entries, then the generated ones
                    gen = [] if only else c.logprobs
                    lps = serving.completion_logprobs(
                        decode, [*out.prompt_logprobs, *gen], 0,
                        [*out.prompt_token_ids, *(t.token_id for t in gen)], label)
            choice: dict[str, Any] = {"index": i * n + c.index, "finish_reason": c.finish_reason,
                                      "logprobs": lps,
                                      # vLLM's: the stop string or stop token id that ended it
                                      "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None and not chat:
                choice["prompt_logprobs"] = serving.vllm_prompt_logprobs(
                    label, out.prompt_logprobs)
            reasoning: str | None = None
            if chat and state.reasoning_parser is not None:   # thinking apart, then the rest
                from radixkv.server.reasoning import split

                reasoning, rest = split(text, state.reasoning_parser,
                                        tools.ends_thinking if tools is not None else ())
                text = rest or ""
            if chat and tools is not None:
                content, calls = tools.parse(text)
                choice["message"] = {"role": chat_role, "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    if c.finish_reason == "stop":
                        choice["finish_reason"] = "tool_calls"
            elif chat:
                choice["message"] = {"role": chat_role,
                                     "content": text if text or reasoning is None else None}
            if chat_echo is not None:   # vLLM's chat echo: the continued message first
                choice["message"]["content"] = chat_echo + (choice["message"]["content"] or "")
            else:
                choice["text"] = text
            if chat and state.reasoning_parser is not None:
                # vLLM's field, and the name older vLLM (and clients written for it) used
                if not req.include_reasoning:
                    reasoning = None
                choice["message"]["reasoning"] = reasoning
                choice["message"]["reasoning_content"] = reasoning
            if req.return_token_ids:   # vLLM's: what the engine computed and chose
                choice["token_ids"] = [] if only else list(c.token_ids)
                if not chat:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
    usage = serving.usage(outs, timing, eng.output_tier_names)
    if only:   # the token the engine picked is not part of the answer
        usage["completion_tokens"] = 0
        usage["total_tokens"] = usage["prompt_tokens"]
    body: dict[str, Any] = {
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": state.model_name, "choices": choices,
        "usage": usage}
    if chat and req.prompt_logprobs is not None:   # vLLM puts the chat's beside the choices
        body["prompt_logprobs"] = serving.vllm_prompt_logprobs(label, outs[0].prompt_logprobs)
    if chat and req.return_token_ids:
        body["prompt_token_ids"] = list(outs[0].prompt_token_ids)
    if chat and req.return_prompt_text:   # vLLM's: what the model read, as text
        body["prompt_text"] = eng.decode(list(outs[0].prompt_token_ids),
                                         skip_special_tokens=False)
    return JSONResponse(body)


def _logprobs(eng: Any, chat: bool, items: list[Any] | None, offset: int,
              as_ids: bool = False) -> dict[str, Any] | None:
    """``choice.logprobs`` in the endpoint's format (None when the request did not ask);
    ``as_ids``: tokens named ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)."""
    def decode(tid: int) -> str:
        text: str = eng.decode([tid], skip_special_tokens=False)
        return text

    label = serving.token_id_label if as_ids else decode
    if chat:
        return serving.chat_logprobs(label, items)
    return serving.completion_logprobs(decode, items, offset, label=label)


async def _final(state: ServerState, rid: str, ids: list[int], params: Any, salt: str | None,
                 timing: serving.Timing, points: Any = None,
                 hints: dict[str, Any] | None = None, log_id: str | None = None) -> Any:
    last = None
    async for last in serving.run(state, rid, ids, params, salt, timing, points, hints,
                                  restartable=True, log_id=log_id):
        pass
    return last if last is not None and last.finished else None


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``await work``, unless the client goes away first: then ``work`` is cancelled (which
    aborts its engine requests in :func:`serving.run`, freeing their blocks within a step) and
    None is returned. The disconnect is ASGI's ``http.disconnect`` message, awaited as soon as
    the body is read, so it is seen at once however often the engine produces tokens."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:   # this handler was cancelled: take the work down with it
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


async def _never() -> Any:
    """An ASGI ``receive`` that never returns (the inner requests of a batched chat: the batch
    watches the client itself)."""
    await asyncio.Event().wait()


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next message the
    server sends the app is ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(state: ServerState, req: Any, rid: str, handle: Any, params: Any,
                  timing: serving.Timing, chat: bool,
                  release: Callable[[], None] = lambda: None,
                  tools: Reader | None = None, echo: str | None = None,
                  prompt_ids: list[int] | None = None, role_name: str = "assistant",
                  engine_id: str | None = None) -> Any:
    """Server-Sent Events of one submitted request (``handle``), OpenAI's chunk format.
    ``rid`` names the chunks and the request log's lines; ``engine_id`` (default ``rid``) is
    the engine's id for it (:func:`serving.response_ids`).
    ``tools`` (a ``tools.Reader``): each choice's text goes through its call stream (content
    as it comes, the calls in ``delta.tool_calls``); with ``--reasoning-parser``
    a chat's thinking goes to ``delta.reasoning`` first (``reasoning.ReasoningStream``).
    ``echo``: sent first in every choice: a completion's prompt text (``echo: true``), or
    the message a chat reply continues (vLLM's chat ``echo``, :func:`serving.chat_echo`).
    ``prompt_ids``: the prompt, for ``return_token_ids`` (with each chunk's own token ids).
    ``role_name``: a chat reply's role in its first delta (:func:`serving.chat_role`)."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool(req.stream_options and req.stream_options.include_usage) \
        or state.frontend.force_include_usage
    # vLLM's continuous_usage_stats (and --enable-force-include-usage, which forces both as
    # vLLM's does): every chunk carries the usage so far (prompt, tokens generated)
    continuous = include_usage and (state.frontend.force_include_usage or bool(
        req.stream_options and req.stream_options.continuous_usage_stats))
    num_prompt = len(prompt_ids) if prompt_ids is not None else 0
    beam = params.use_beam_search

    # Every chunk is {"id", "object", "created", "model", "choices"[, "usage": null]}: the
    # fixed fields are encoded once, each chunk encodes its choices only (the same bytes as
    # serving.sse of the whole object).
    fixed = serving.sse({"id": rid, "object": kind, "created": created,
                         "model": state.model_name})
    head = fixed[:fixed.rindex("}")] + ',"choices":'
    tail = (',"usage":null' if include_usage else "") + "}\n\n"

    # once the first output is in, the continuous usage also has the prompt's cache split
    # (the engine knows it at the first token): what the prompt read from the cache and wrote
    # to it (Anthropic's message_start carries both; anthropic.MessageStream)
    cache_split: dict[str, Any] = {}

    def usage_tail(generated: int) -> str:
        if not continuous:
            return tail
        return ',"usage":' + json.dumps({"prompt_tokens": num_prompt,
                                         "completion_tokens": generated,
                                         "total_tokens": num_prompt + generated,
                                         **cache_split},
                                        separators=(",", ":")) + "}\n\n"

    def chunk(choices: list[dict[str, Any]], generated: int = 0) -> str:
        return head + json.dumps(choices, separators=(",", ":")) + usage_tail(generated)

    offsets: dict[int, int] = {}   # completions' text_offset: characters of tokens sent

    def choice(index: int, text: str | None, finish: str | None, role: bool = False,
               lps: list[Any] | None = None) -> dict[str, Any]:
        logprobs = None
        if lps is not None:
            eng = state.ready_engine()
            logprobs = _logprobs(eng, chat, lps, offsets.get(index, 0),
                                 req.return_tokens_as_token_ids)
            if not chat:   # the text's characters, however the tokens are named
                offsets[index] = offsets.get(index, 0) + sum(
                    len(eng.decode([t.token_id], skip_special_tokens=False)) for t in lps)
        if chat:
            delta: dict[str, Any] = {"role": role_name} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    calls: dict[int, Any] = {}   # choice index -> its call stream (with tools)
    if tools is not None:
        calls = {i: tools.stream() for i in range(req.n)}
    ids_out = bool(req.return_token_ids)
    thinks: dict[int, Any] = {}   # choice index -> its reasoning.ReasoningStream
    if chat and state.reasoning_parser is not None:
        from radixkv.server.reasoning import ReasoningStream

        ends = tools.ends_thinking if tools is not None else ()
        thinks = {i: ReasoningStream(state.reasoning_parser, ends) for i in range(req.n)}

    def parsed_part(c: Any, text: str) -> dict[str, Any] | None:
        """The chunk entry of choice ``c`` through its parsers: the thinking as ``reasoning``,
        then (with tools) content outside the calls and the calls completed now, with
        ``finish_reason`` "tool_calls" once a call was made."""
        finish = c.finish_reason
        reasoning = ""
        if thinks:
            reasoning, text = thinks[c.index].feed(text)
            if finish:
                r, t = thinks[c.index].finish()
                reasoning, text = reasoning + r, text + t
        made: list[dict[str, Any]] = []
        content = text
        if calls:
            stream = calls[c.index]
            content, made = stream.feed(text)
            if finish:
                rest, more = stream.finish()   # (a call cut short may end with a piece)
                content, made = content + rest, made + more
                if finish == "stop" and stream.num_calls:
                    finish = "tool_calls"
        if not (content or reasoning or made or finish or c.delta_logprobs):
            return None
        part = choice(c.index, content or None, finish, lps=c.delta_logprobs)
        if reasoning and req.include_reasoning:
            part["delta"]["reasoning"] = part["delta"]["reasoning_content"] = reasoning
        if made:
            part["delta"]["tool_calls"] = made
        return part

    try:
        if chat:   # the role, and vLLM's chat echo
            first = [choice(i, echo or "", None, role=True) for i in range(req.n)]
        else:
            first = [choice(i, echo, None) for i in range(req.n)] if echo or ids_out else []
        extra = ""
        if ids_out and prompt_ids is not None:   # vLLM's return_token_ids: the prompt first
            if chat:   # beside the choices, as the non-streamed chat answer has it
                extra = ',"prompt_token_ids":' + json.dumps(list(prompt_ids))
            else:
                for head_part in first:
                    head_part["prompt_token_ids"] = list(prompt_ids)
        if chat and req.return_prompt_text and prompt_ids is not None:   # first chunk only
            extra += ',"prompt_text":' + json.dumps(
                state.ready_engine().decode(list(prompt_ids), skip_special_tokens=False))
        if first:
            yield head + json.dumps(first, separators=(",", ":")) + extra + usage_tail(0)
        last, done = None, set()
        joined = serving.Coalescer(1 if beam else max(state.stream_interval,
                                                      req.stream_interval or 1))
        async for out in serving.run(state, engine_id or rid, [], params, None, timing,
                                     handle=handle, log_id=rid):
            last = out
            if beam and not out.finished:
                continue   # beams reorder until the end: only the final best n are sent
            if continuous and not num_prompt:
                num_prompt = len(out.prompt_token_ids)
            if continuous and not cache_split:
                cache_split.update({
                    "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
                    "radixkv": {"cache_read_tokens": out.num_cached_tokens,
                                "cache_write_tokens": getattr(out, "cache_write_tokens", 0)}})
            parts = []
            for c in out.outputs:
                if c.index in done:
                    continue
                c = joined.take(c)
                if c is None:
                    continue   # held for --stream-interval / stream_interval
                text = c.text if beam else c.delta_text
                part: dict[str, Any] | None = None
                if calls or thinks:
                    part = parsed_part(c, text or "")
                elif text or c.finish_reason or c.delta_logprobs or (ids_out and
                                                                     c.delta_token_ids):
                    part = choice(c.index, text, c.finish_reason, lps=c.delta_logprobs)
                if ids_out:
                    ids = list(c.token_ids if beam else c.delta_token_ids)
                    if part is None and ids:
                        part = choice(c.index, None, None)
                    if part is not None:
                        part["token_ids"] = ids
                if part is not None:
                    if c.finish_reason:   # vLLM's: the stop string or token id that ended it
                        part["stop_reason"] = getattr(c, "stop_reason", None)
                    parts.append(part)
                if c.finish_reason:
                    done.add(c.index)
            if parts:
                yield chunk(parts, sum(len(c.token_ids) for c in out.outputs)
                            if continuous else 0)
        if include_usage and last is not None:
            yield serving.sse({"id": rid, "object": kind, "created": created,
                               "model": state.model_name, "choices": [],
                               "usage": serving.usage([last], timing,
                                                     state.ready_engine().output_tier_names)})
        yield serving.SSE_DONE
    except APIError as exc:   # e.g. the fleet replica serving it died after sending tokens
        yield serving.sse(exc.body())
        yield serving.SSE_DONE
    finally:
        release()


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` made idempotent: the first call runs it, later ones do nothing."""
    done = [False]

    def call() -> None:
        if not done[0]:
            done[0] = True
            fn()

    return call


class _Stream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends. The event generator releases
    the request's admission slot in its ``finally``, but a client that disconnects before the
    generator's first step cancels it unstarted, and an unstarted generator runs no
    ``finally``: without this the slot would leak. ``keep_alive``: ``--sse-keep-alive-interval``
    (seconds; 0 none), applied only when this response is sent (the Responses API reads a chat
    stream's chunks without sending it, and must not see the comments)."""

    def __init__(self, content: Any, on_close: Callable[[], None],
                 keep_alive: float = 0.0) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close
        self.keep_alive = keep_alive

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.keep_alive > 0:
            from radixkv.server.frontend import keep_alive

            self.body_iterator = keep_alive(self.body_iterator, self.keep_alive)
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


__all__ = ["create_app", "ServerState", "UVICORN_LOOP"]
