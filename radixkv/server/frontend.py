"""vLLM's frontend options: how the HTTP server presents itself to clients, apart from the engine.

``vllm serve`` has a group of flags that change only the OpenAI-compatible layer: response
headers, defaults a request does not set, what a response names, which helper endpoints exist.
Deployment scripts written for vLLM pass them, so ``radixkv serve`` takes the same flags with
the same meaning (docs/serve.md, "vLLM compatibility"):

========================================  ==================================================
``--enable-request-id-headers``           every response carries ``X-Request-Id``: the
                                          request's own, else a new one (tracing across a
                                          proxy and the server's logs)
``--default-chat-template-kwargs JSON``   chat-template variables for requests that do not
                                          set them (e.g. Qwen3's ``{"enable_thinking":
                                          false}`` server-wide); a request's own win
``--response-role ROLE``                  the role a chat reply is given in a new turn
                                          (default ``assistant``)
``--return-tokens-as-token-ids``          logprobs name tokens ``token_id:N`` unless a request
                                          says otherwise (RL pipelines)
``--enable-force-include-usage``          streamed responses end with a usage chunk even
                                          without ``stream_options.include_usage``
``--enable-server-load-tracking``         ``GET /load`` counts the generation requests in
                                          flight (without it, it answers 0, as vLLM's)
``--disable-fastapi-docs``                no ``/docs``, ``/redoc``, ``/openapi.json``
``--sse-keep-alive-interval S``           a streamed response idle for S seconds (queued,
                                          prefilling, between tokens) sends an SSE comment,
                                          so a proxy's read timeout does not cut it
``--allowed-origins JSON`` (and           CORS for browsers calling the server directly
``--allowed-methods``,                    (Starlette's middleware, outside the API-key check
``--allowed-headers``,                    so that preflights are answered)
``--allow-credentials``)
``--root-path PATH``                      served behind a proxy that routes PATH/...: routes
                                          and the API-key check see the path below it
``--enable-log-requests``,                a log line per request reaching the engine, and
``--enable-log-outputs``,                 per finished one (radixkv/server/request_log.py),
``--max-log-len N``                       texts and id lists cut to N
``--served-model-name A B ...``           more names a request's ``model`` may give (the
                                          first, A, is the one answers carry)
``--enable-tokenizer-info-endpoint``      ``GET /tokenizer_info``: the tokenizer's
                                          configuration and the chat template in use
``--middleware MODULE.NAME``              an operator's ASGI middleware class, or an
                                          ``http`` middleware function, added to the app
``--trust-request-chat-template``         a chat or ``/tokenize`` request's ``chat_template``
                                          is rendered instead of the model's (without it, a
                                          400: a template can take any CPU and memory to
                                          render, so only for clients the operator trusts)
``--max-num-queued-reqs N``               a request that would put more than N sequences
                                          (prompts x n) in flight is a 503, a load
                                          balancer's cue to retry elsewhere (vLLM 0.32's
                                          coarse capacity valve)
``--max-num-queued-tokens N``             while the prompts not yet past their first token
                                          add up to N tokens or more, a new request is a 503
                                          (vLLM 0.32's TTFT valve)
``--otlp-traces-endpoint URL``            a span per request to this OTLP collector
                                          (radixkv/server/tracing.py), continuing the caller's
                                          W3C trace context
``--tool-call-parser NAME``               the format tool calls are read in (``hermes``,
                                          ``mistral``, ``llama3_json``) for every template
                                          that declares
                                          tools; without it, the template's own
                                          (radixkv/server/tools.py)
========================================  ==================================================

One frozen value carries them from the command line (``serve`` and the fleet's ingress alike)
into :func:`radixkv.server.app.create_app`, so a new one is a field here, not a new argument
threaded through every layer. Bad values are :class:`~radixkv.errors.ConfigError` at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any

from radixkv.errors import ConfigError

#: Paths whose requests ``GET /load`` counts (vLLM's load-aware routes that radixkv serves).
LOAD_TRACKED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                "/v1/chat/completions/batch", "/invocations")
#: What ``--sse-keep-alive-interval`` sends: an SSE comment, which clients ignore and proxies
#: count as traffic.
KEEP_ALIVE = ": keep-alive\n\n"


def check_tracing(endpoint: str) -> None:
    """A ConfigError now (at start-up) for what would stop ``--otlp-traces-endpoint`` later: an
    empty endpoint, OpenTelemetry not installed, an OTLP protocol radixkv does not send."""
    import importlib.util
    import os

    from radixkv.server.tracing import PROTOCOLS

    if not endpoint.strip():
        raise ConfigError("--otlp-traces-endpoint must name a collector, e.g. "
                          "http://127.0.0.1:4317")
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: radixkv sends "
                          f"traces over {' or '.join(PROTOCOLS)}")
    module = "opentelemetry.exporter.otlp.proto." + ("grpc" if protocol == "grpc" else "http")
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:   # (a parent package is missing)
        found = False
    if not found:
        raise ConfigError("--otlp-traces-endpoint needs OpenTelemetry's OTLP exporter: pip "
                          "install 'radixkv[tracing]'")


@dataclasses.dataclass(frozen=True)
class FrontendOptions:
    """The OpenAI layer's vLLM options (module docstring); the defaults are vLLM's."""

    request_id_headers: bool = False
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False
    load_tracking: bool = False
    docs: bool = True
    trust_request_chat_template: bool = False
    sse_keep_alive_interval: float = 0.0
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    log_requests: bool = False
    log_outputs: bool = False
    max_log_len: int | None = None
    middleware: tuple[str, ...] = ()
    model_aliases: tuple[str, ...] = ()
    tokenizer_info: bool = False
    tool_call_parser: str | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "middleware", tuple(self.middleware))
        object.__setattr__(self, "model_aliases", tuple(self.model_aliases))
        for path in self.middleware:
            load_middleware(path)   # importable, and a class or a coroutine function
        if self.tool_call_parser is not None:
            from radixkv.server.tools import PARSERS

            if self.tool_call_parser not in PARSERS:
                raise ConfigError(f"--tool-call-parser must be one of {sorted(PARSERS)}, got "
                                  f"{self.tool_call_parser!r}")
        if self.otlp_traces_endpoint is not None:
            check_tracing(self.otlp_traces_endpoint)
        if self.log_outputs and not self.log_requests:
            raise ConfigError("--enable-log-outputs needs --enable-log-requests (as vLLM's)")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {v!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ConfigError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        every = self.sse_keep_alive_interval
        if not isinstance(every, (int, float)) or not math.isfinite(every) or every < 0:
            raise ConfigError(f"--sse-keep-alive-interval must be >= 0 seconds (0: off), got "
                              f"{every!r}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"--{name.replace('_', '-')} must be a JSON list of "
                                  f"strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        root = self.root_path
        if root and (not root.startswith("/") or root.endswith("/")):
            raise ConfigError(f"--root-path must start with / and not end with one, got "
                              f"{root!r}")
        if not isinstance(self.response_role, str) or not self.response_role.strip():
            raise ConfigError(f"--response-role must be a non-empty name, got "
                              f"{self.response_role!r}")
        kwargs = self.default_chat_template_kwargs
        if kwargs is not None:
            from radixkv.server.protocol import RESERVED_TEMPLATE_KWARGS

            if not isinstance(kwargs, Mapping):
                raise ConfigError("--default-chat-template-kwargs must be a JSON object, got "
                                  f"{type(kwargs).__name__}")
            for k in kwargs:
                if not isinstance(k, str) or not k.isidentifier():
                    raise ConfigError(f"--default-chat-template-kwargs: {k!r} is not a "
                                      "template variable name")
                if k in RESERVED_TEMPLATE_KWARGS:
                    raise ConfigError(f"--default-chat-template-kwargs: {k!r} is set by the "
                                      "server (or is the template's own)")
            object.__setattr__(self, "default_chat_template_kwargs", dict(kwargs))

    @classmethod
    def from_args(cls, args: Any) -> FrontendOptions:
        """From ``radixkv serve``'s parsed arguments."""
        return cls(request_id_headers=args.enable_request_id_headers,
                   default_chat_template_kwargs=parse_template_kwargs(
                       args.default_chat_template_kwargs),
                   response_role=args.response_role,
                   return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                   force_include_usage=args.enable_force_include_usage,
                   load_tracking=args.enable_server_load_tracking,
                   docs=not args.disable_fastapi_docs,
                   trust_request_chat_template=args.trust_request_chat_template,
                   sse_keep_alive_interval=args.sse_keep_alive_interval,
                   allowed_origins=parse_list(args.allowed_origins, "--allowed-origins")
                   or (),
                   allowed_methods=parse_list(args.allowed_methods, "--allowed-methods")
                   or ("*",),
                   allowed_headers=parse_list(args.allowed_headers, "--allowed-headers")
                   or ("*",),
                   allow_credentials=args.allow_credentials,
                   root_path=args.root_path or "",
                   log_requests=args.enable_log_requests,
                   log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len,
                   middleware=tuple(args.middleware or ()),
                   model_aliases=tuple(getattr(args, "served_model_aliases", ())),
                   tokenizer_info=args.enable_tokenizer_info_endpoint,
                   tool_call_parser=args.tool_call_parser,
                   max_num_queued_reqs=getattr(args, "max_num_queued_reqs", None),
                   max_num_queued_tokens=getattr(args, "max_num_queued_tokens", None),
                   otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None))

    def route_path(self, scope: dict[str, Any]) -> str:
        """The path a request addresses below ``--root-path`` (the routes' own: ``/v1/...``),
        whether or not the proxy in front kept the prefix."""
        path: str = scope["path"]
        root = self.root_path
        if root and (path == root or path.startswith(root + "/")):
            return path[len(root):] or "/"
        return path

    def as_dict(self) -> dict[str, Any]:
        """Plain values (the fleet passes them to its ingress replicas)."""
        return dataclasses.asdict(self)

    def template_kwargs(self, requested: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A request's ``chat_template_kwargs`` over the server's defaults (vLLM's merge: the
        request's own values win); None when neither has any."""
        if not self.default_chat_template_kwargs:
            return None if requested is None else dict(requested)
        return {**self.default_chat_template_kwargs, **(requested or {})}


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` body: the tokenizer's construction arguments (its
    ``tokenizer_config.json``, without file paths; special tokens as their text), its class,
    and the chat template it renders with (``--chat-template``'s when given)."""

    def plain(v: Any) -> Any:
        if hasattr(v, "content"):   # tokenizers' AddedToken
            return v.content
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if v is None or isinstance(v, (str, int, float, bool)):
            return v
        return str(v)

    config = {k: plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if not k.endswith("_file") and k not in ("name_or_path", "tokenizer_object")}
    config["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
    return config


def load_middleware(path: str) -> tuple[str, Any]:
    """``--middleware MODULE.NAME``: ``("class", cls)`` for an ASGI middleware class (added
    with ``add_middleware``), ``("http", fn)`` for an ``async def fn(request, call_next)``
    (FastAPI's ``@app.middleware("http")``), as vLLM's flag takes them; a ConfigError names what
    is wrong. The module must be importable where the app runs (the fleet: its ingress)."""
    import importlib
    import inspect

    module, _, name = path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"--middleware {path!r}: give MODULE.NAME")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--middleware {path!r}: {exc}") from None
    if inspect.isclass(obj):
        return "class", obj
    if inspect.iscoroutinefunction(obj):
        return "http", obj
    raise ConfigError(f"--middleware {path!r} is neither a class nor an async function")


class AccessLogFilter:
    """A ``logging`` filter for uvicorn's access log that drops the lines of some paths
    (``--disable-access-log-for-endpoints /health,/metrics``: probes every few seconds drown
    the requests). uvicorn's access record's ``args`` are (client, method, path with query,
    HTTP version, status)."""

    def __init__(self, paths: str) -> None:
        self.paths = frozenset(p.strip() for p in paths.split(",") if p.strip())

    def filter(self, record: Any) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def _json_flag(text: str, flag: str) -> Any:
    """A flag's JSON value; a ConfigError naming the flag when it is not JSON."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(f"{flag} is not JSON: {exc}") from None


def parse_list(text: str | None, flag: str) -> tuple[str, ...] | None:
    """A JSON list of strings (vLLM's ``--allowed-origins '["*"]'``); None for None."""
    if text is None:
        return None
    value = _json_flag(text, flag)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{flag} must be a JSON list of strings, got {text!r}")
    return tuple(value)


async def keep_alive(chunks: AsyncIterable[Any], every: float) -> AsyncIterator[Any]:
    """``chunks`` (a streamed response's body), with :data:`KEEP_ALIVE` whenever none came for
    ``every`` seconds. One pending ``__anext__`` task advances ``chunks`` (an async generator
    may not be advanced twice at once), watched with a timeout that does not cancel it; when
    this generator is closed or cancelled (the client went away), so is that task and then
    ``chunks``, whose own clean-up runs."""
    it = chunks.__aiter__()
    pending: asyncio.Future[Any] = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            yield chunk
            pending = asyncio.ensure_future(it.__anext__())
    finally:
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
        close = getattr(it, "aclose", None)
        if close is not None:
            with contextlib.suppress(BaseException):
                await close()


def parse_template_kwargs(text: str | None) -> dict[str, Any] | None:
    """``--default-chat-template-kwargs``' JSON; a ConfigError names what is wrong."""
    if text is None:
        return None
    value = _json_flag(text, "--default-chat-template-kwargs")
    if not isinstance(value, dict):
        raise ConfigError("--default-chat-template-kwargs must be a JSON object, got "
                          f"{type(value).__name__}")
    return value
