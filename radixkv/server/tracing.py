"""Request traces over OTLP (``--otlp-traces-endpoint``), as ``vllm serve`` sends them.

Each engine request (one prompt of a completion or chat; the n samples of a prompt are one)
becomes one span when it ends: ``llm_request``, kind SERVER, from the HTTP request's arrival to
its last output, a child of the caller's span when the request carries W3C trace context
(``traceparent``, ``tracestate``), else the root of a trace of its own. Its attributes are
vLLM's names (OpenTelemetry's ``gen_ai.*``) for what radixkv measures the same way, and
``radixkv.*`` for the rest:

=======================================  ========================================================
``gen_ai.response.model``                the served model's name
``gen_ai.request.id``                    the response's id (``chatcmpl-...``; ``-0``, ``-1``
                                         per prompt of a non-streamed completion), as the
                                         request log names it
``gen_ai.request.temperature``,          the sampling parameters the engine ran with
``gen_ai.request.top_p``,
``gen_ai.request.max_tokens``,
``gen_ai.request.n``
``gen_ai.usage.prompt_tokens``,          tokens in, tokens out (every choice's)
``gen_ai.usage.completion_tokens``
``gen_ai.response.finish_reasons``       each choice's finish reason
``gen_ai.latency.time_to_first_token``   arrival to first token, seconds
``gen_ai.latency.e2e``                   arrival to the last output, seconds
``gen_ai.latency.time_in_model_decode``  first token to last token, seconds (streamed requests)
``radixkv.usage.cached_tokens``          prompt tokens served from the cache, and per tier
``radixkv.usage.cached_tokens.<tier>``   (device, host, disk, remote)
``radixkv.latency.queue_and_tokenize``   arrival to the engine's submission, seconds
=======================================  ========================================================

vLLM's ``time_in_queue`` and model-forward times (``--collect-detailed-traces``) are engine
step timings radixkv does not keep per request; they are left out rather than approximated.

The exporter is OTLP over gRPC (vLLM's default; plain text, ``insecure``) or HTTP/protobuf when
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``; spans leave in batches from the SDK's own
thread (``BatchSpanProcessor``: the event loop only appends), and the server flushes them when
it shuts down. Needs the ``tracing`` extra (OpenTelemetry's SDK and exporters).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from radixkv.errors import ConfigError

log = logging.getLogger("radixkv.server")

#: W3C trace-context headers a request's span continues (vLLM's ``TRACE_HEADERS``).
TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOLS = ("grpc", "http/protobuf")


class RequestTracer:
    """One OTLP exporter and tracer for a server's requests (see the module docstring)."""

    def __init__(self, endpoint: str, service_name: str = "radixkv") -> None:
        """Raises ConfigError when OpenTelemetry is not installed or the protocol in
        ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is neither ``grpc`` nor ``http/protobuf``."""
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        if protocol not in PROTOCOLS:
            raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: radixkv sends "
                              f"traces over {' or '.join(PROTOCOLS)}")
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )

                exporter: Any = OTLPSpanExporter(endpoint=endpoint, insecure=True)
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as OTLPHttpSpanExporter,
                )

                exporter = OTLPHttpSpanExporter(endpoint=endpoint)
        except ImportError as exc:
            raise ConfigError(f"--otlp-traces-endpoint needs OpenTelemetry ({exc}): pip install "
                              "'radixkv[tracing]'") from None
        self.endpoint, self.protocol = endpoint, protocol
        self._provider = TracerProvider(resource=Resource.create({
            "service.name": service_name, "radixkv.process_id": str(os.getpid())}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("radixkv.server")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER

    def request(self, headers: Mapping[str, str] | None, request_id: str, model: str,
                params: Any, out: Any, timing: Any, tier_names: Sequence[str]) -> None:
        """Record one finished engine request: ``out`` its final ``RequestOutput``, ``timing``
        the handler's :class:`~radixkv.server.serving.Timing`, ``headers`` the trace context
        the HTTP request carried (or None). Never raises: a span that cannot be made is
        logged and dropped, the request's answer is not affected."""
        try:
            self._record(headers, request_id, model, params, out, timing, tier_names)
        except Exception:  # noqa: BLE001 (telemetry must not fail a served request)
            log.warning("radixkv: no trace span for request %s", request_id, exc_info=True)

    def _record(self, headers: Mapping[str, str] | None, request_id: str, model: str,
                params: Any, out: Any, timing: Any, tier_names: Sequence[str]) -> None:
        now = time.perf_counter()
        wall = time.time_ns()

        def at(t: float) -> int:   # a perf_counter reading as epoch nanoseconds
            return wall - int((now - t) * 1e9)

        attrs: dict[str, Any] = {
            "gen_ai.response.model": model, "gen_ai.request.id": request_id,
            "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
            "gen_ai.usage.completion_tokens": sum(len(c.token_ids) for c in out.outputs),
            "gen_ai.response.finish_reasons": [str(c.finish_reason) for c in out.outputs],
            "gen_ai.latency.e2e": now - timing.arrived,
            "radixkv.usage.cached_tokens": int(out.num_cached_tokens),
            "radixkv.latency.queue_and_tokenize": max(0.0, timing.submitted - timing.arrived),
        }
        for name in ("temperature", "top_p", "max_tokens", "n"):
            value = getattr(params, name, None)
            if value is not None:
                attrs[f"gen_ai.request.{name}"] = value
        first = timing.first_token
        if first is None and getattr(out, "ttft", None) is not None:
            first = timing.submitted + out.ttft   # a non-streamed request: the engine's reading
        if first is not None:
            attrs["gen_ai.latency.time_to_first_token"] = first - timing.arrived
            if timing.last_token is not None and timing.first_token is not None:
                attrs["gen_ai.latency.time_in_model_decode"] = \
                    timing.last_token - timing.first_token
        for tier, n in zip(tier_names, getattr(out, "cached_tokens_per_tier", ()) or ()):
            attrs[f"radixkv.usage.cached_tokens.{tier}"] = int(n)
        context = None
        if headers and any(h in headers for h in TRACE_HEADERS):
            context = self._propagator.extract({h: headers[h] for h in TRACE_HEADERS
                                                if h in headers})
        span = self._tracer.start_span("llm_request", context=context, kind=self._kind,
                                       attributes=attrs, start_time=at(timing.arrived))
        span.end(end_time=wall)

    def shutdown(self) -> None:
        """Send the spans still batched and stop the exporter (at server shutdown)."""
        self._provider.shutdown()


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of a request, or None without any."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


__all__ = ["PROTOCOLS", "RequestTracer", "TRACE_HEADERS", "trace_headers"]
