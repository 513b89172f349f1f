"""``--otlp-traces-endpoint`` (radixkv/server/tracing.py): spans reach a real OTLP collector.

The collector is OpenTelemetry's own protocol served in this process: a gRPC ``TraceService``
(vLLM's default transport) for ``radixkv serve`` as a subprocess on 127.0.0.1, and an HTTP
``/v1/traces`` endpoint for the HTTP/protobuf transport. What arrives is decoded with
OpenTelemetry's protobuf classes and checked against the responses the official ``openai``
client got.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
try:   # the tracing extra (scripts/dev.sh installs it: CI must run these)
    import grpc  # noqa: F401
    import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    import opentelemetry.exporter.otlp.proto.http  # noqa: F401
except ImportError as exc:
    assert not os.environ.get("CI"), \
        f"the tracing extra missing in CI ({exc}): scripts/dev.sh installs it"
    pytest.skip(f"the tracing extra is not installed ({exc})", allow_module_level=True)

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

from radixkv.errors import ConfigError  # noqa: E402
from radixkv.server.frontend import check_tracing  # noqa: E402
from tests.server import otlp_collector  # noqa: E402
from tests.server.otlp_collector import Collector  # noqa: E402
from tests.server.test_openai_server import MODEL, running_server  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def grpc_collector() -> Any:
    with otlp_collector.grpc_collector() as got:
        yield got


@pytest.fixture(scope="module")
def srv(grpc_collector: Collector) -> Any:
    old = {k: os.environ.get(k) for k in ("OTEL_BSP_SCHEDULE_DELAY",
                                          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")}
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"   # ms between the SDK's batches (5 s)
    os.environ.pop("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None)   # gRPC, vLLM's default
    try:
        with running_server(["--threads", "1", "--device", "cpu", "--dtype", "float32",
                             "--device-blocks", "256", "--otlp-traces-endpoint",
                             grpc_collector.url]) as server:
            yield server
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.model
def test_a_span_per_request_continues_the_callers_trace(srv: Any,
                                                       grpc_collector: Collector) -> None:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
    system = "You answer in one short sentence. " * 12
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]
    before = len(grpc_collector.spans)
    t0 = time.time_ns()
    first = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                           temperature=0.5, top_p=0.9, n=2)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                            stream=True)
    chunks = list(stream)
    two = client.completions.create(model=MODEL, prompt=["Hello", "Count to three:"],
                                    max_tokens=3, temperature=0)
    t1 = time.time_ns()
    spans = grpc_collector.wait(before + 5)[before:]
    by_id = {s["attrs"]["gen_ai.request.id"]: s for s in spans}
    assert len(by_id) == 5
    assert all(s["name"] == "llm_request" and s["kind"] == 2 for s in spans)   # SERVER
    assert all(s["resource"]["service.name"] == "radixkv" for s in spans)
    assert all(t0 <= s["start"] <= s["end"] <= t1 for s in spans)
    # named as the request log names them (vLLM's names): a chat by its response's id, a
    # completion's prompts ID-0, ID-1, ...
    assert set(by_id) == {first.id, again.id, chunks[0].id, f"{two.id}-0", f"{two.id}-1"}
    # the caller's trace context: the same trace, the caller's span as parent
    a = by_id[first.id]["attrs"]
    assert by_id[first.id]["trace_id"] == TRACE_ID
    assert by_id[first.id]["parent"] == PARENT_ID
    assert a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.usage.prompt_tokens"] == first.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == first.usage.completion_tokens
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0
    assert a["radixkv.usage.cached_tokens"] == first.usage.prompt_tokens_details.cached_tokens
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    # without context: a trace of its own; n samples are one request; the cache is reported
    b = by_id[again.id]
    assert b["trace_id"] != TRACE_ID and b["parent"] == ""
    assert b["attrs"]["gen_ai.request.n"] == 2 and b["attrs"]["gen_ai.request.top_p"] == \
        pytest.approx(0.9)
    assert b["attrs"]["gen_ai.usage.completion_tokens"] == again.usage.completion_tokens
    assert b["attrs"]["radixkv.usage.cached_tokens"] == \
        again.usage.prompt_tokens_details.cached_tokens > 0
    assert b["attrs"]["radixkv.usage.cached_tokens.device"] > 0
    assert len(b["attrs"]["gen_ai.response.finish_reasons"]) == 2
    # streamed: its decode time; a completion's prompts: a span each
    s = by_id[chunks[0].id]["attrs"]
    assert s["gen_ai.latency.time_in_model_decode"] >= 0
    assert sum(by_id[f"{two.id}-{i}"]["attrs"]["gen_ai.usage.prompt_tokens"]
               for i in (0, 1)) == two.usage.prompt_tokens


def test_the_http_protobuf_transport_sends_the_same_span(monkeypatch: Any) -> None:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf: the same span as a POST of OTLP's
    protobuf to the collector's /v1/traces (the tracer alone, no model)."""
    from radixkv.server.serving import Timing
    from radixkv.server.tracing import RequestTracer

    got = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            req = trace_service_pb2.ExportTraceServiceRequest()
            req.ParseFromString(body)
            got.add(req)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
        tracer = RequestTracer(f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces")
        now = time.perf_counter()
        timing = Timing(arrived=now - 0.5, submitted=now - 0.4, first_token=now - 0.3,
                        last_token=now - 0.1)
        out = SimpleNamespace(prompt_token_ids=[1] * 7, num_cached_tokens=4,
                              cached_tokens_per_tier=(3, 1), ttft=0.1,
                              outputs=[SimpleNamespace(token_ids=[5, 6], finish_reason="stop")])
        params = SimpleNamespace(temperature=0.7, top_p=None, max_tokens=2, n=1)
        tracer.request({"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, "cmpl-x", "m",
                       params, out, timing, ("device", "host"))
        tracer.shutdown()   # flushes
        [span] = got.wait(1)
    finally:
        httpd.shutdown()
    a = span["attrs"]
    assert span["trace_id"] == TRACE_ID and span["parent"] == PARENT_ID
    assert (a["gen_ai.request.id"], a["gen_ai.usage.prompt_tokens"],
            a["gen_ai.usage.completion_tokens"]) == ("cmpl-x", 7, 2)
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(0.2, abs=1e-6)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.2, abs=1e-6)
    assert a["radixkv.latency.queue_and_tokenize"] == pytest.approx(0.1, abs=1e-6)
    assert (a["radixkv.usage.cached_tokens.device"], a["radixkv.usage.cached_tokens.host"]) \
        == (3, 1)
    assert "gen_ai.request.top_p" not in a
    assert span["end"] - span["start"] == pytest.approx(0.5e9, rel=0.05)


def test_a_span_that_cannot_be_made_does_not_fail_the_request(caplog: Any) -> None:
    """Telemetry never fails a served request: an output the tracer cannot read is logged
    and dropped."""
    from radixkv.server.serving import Timing
    from radixkv.server.tracing import RequestTracer

    tracer = RequestTracer("http://127.0.0.1:9")   # (nothing is sent: the span fails first)
    try:
        tracer.request(None, "cmpl-bad", "m", None, object(), Timing(arrived=0.0), ())
    finally:
        tracer.shutdown()
    assert "no trace span for request cmpl-bad" in caplog.text


def test_a_bad_tracing_setup_is_refused_at_start_up(monkeypatch: Any) -> None:
    check_tracing("http://127.0.0.1:4317")   # installed here: fine
    with pytest.raises(ConfigError, match="must name a collector"):
        check_tracing(" ")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError, match="http/json"):
        check_tracing("http://127.0.0.1:4318")
