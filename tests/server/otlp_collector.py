"""An OTLP trace collector served in the test's process: OpenTelemetry's own gRPC
``TraceService`` on 127.0.0.1, decoding what exporters send with OpenTelemetry's protobuf
classes (``tests/server/test_tracing.py``, and the fleet's ingress in ``tests/fleet``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Collector:
    """The spans an OTLP exporter sent, flattened: one dict per span. ``url``: where the
    gRPC collector listens (:func:`grpc_collector`)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.url = ""

    def add(self, req: Any) -> None:
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    with self.lock:
                        self.spans.append({
                            "name": sp.name, "kind": sp.kind, "trace_id": sp.trace_id.hex(),
                            "parent": sp.parent_span_id.hex(), "start": sp.start_time_unix_nano,
                            "end": sp.end_time_unix_nano, "resource": resource,
                            "attrs": {a.key: _value(a.value) for a in sp.attributes}})

    def wait(self, n: int, timeout: float = 30) -> list[dict[str, Any]]:
        """The spans once at least ``n`` arrived (AssertionError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while len(self.spans) < n:
            assert time.monotonic() < deadline, f"{len(self.spans)} of {n} spans arrived"
            time.sleep(0.05)
        with self.lock:
            return list(self.spans)

    def find(self, request_id: str, timeout: float = 30) -> dict[str, Any]:
        """The span whose ``gen_ai.request.id`` is ``request_id``, once it arrived."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                got = [s for s in self.spans if s["attrs"].get("gen_ai.request.id") == request_id]
            if got:
                return got[0]
            assert time.monotonic() < deadline, f"no span for {request_id}"
            time.sleep(0.05)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


@contextmanager
def grpc_collector() -> Iterator[Collector]:
    """A gRPC OTLP collector on a free port of 127.0.0.1, stopped on exit."""
    got = Collector()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the proto's name)
            got.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    got.url = f"http://127.0.0.1:{port}"
    try:
        yield got
    finally:
        server.stop(0)
