"""vLLM 0.32's admission valves on the real server (``radixkv serve`` subprocess on 127.0.0.1):
``--max-num-queued-reqs`` (sequences in flight) and ``--max-num-queued-tokens`` (prompt tokens
before their first token), each a 503 that tells a load balancer to retry elsewhere, counted in
``vllm:admission_rejections`` by reason. One server for the module: one running sequence at a
time, so a second request waits in the engine before its first token.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")

from tests.server.test_openai_server import MODEL, Server, _value, running_server  # noqa: E402

MAX_REQS, MAX_TOKENS = 3, 40
LONG = {"model": MODEL, "prompt": "Write a very long story about a lighthouse keeper. " * 5,
        "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def srv() -> Any:
    with running_server(["--max-num-seqs", "1", "--max-queued", "8",
                         "--max-num-queued-reqs", str(MAX_REQS),
                         "--max-num-queued-tokens", str(MAX_TOKENS),
                         "--enable-server-load-tracking", "--device-blocks", "256",
                         "--threads", "1", "--device", "cpu", "--dtype", "float32"]) as server:
        yield server


def _stream(srv: Server, body: dict) -> http.client.HTTPConnection:
    """A streamed completion whose response has started (it is in the engine: the server
    submits before it answers with headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    conn.resp = resp   # type: ignore[attr-defined]
    return conn


def _first_token(conn: http.client.HTTPConnection) -> None:
    """Read until the stream's first data event with text (the request is past its prompt)."""
    resp = conn.resp   # type: ignore[attr-defined]
    while True:
        line = resp.readline()
        assert line, "the stream ended"
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
            return


def _close(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def _load_is(srv: Server, n: int, timeout: float = 30) -> None:
    """Until ``GET /load`` counts ``n`` requests in flight (a closed stream has let go)."""
    deadline = time.monotonic() + timeout
    while srv.raw("GET", "/load", key=None)[1]["server_load"] != n:
        assert time.monotonic() < deadline, "the closed request is still in flight"
        time.sleep(0.05)


def _rejections(srv: Server, reason: str) -> float:
    return _value(srv.metrics(), "vllm:admission_rejections", reason=reason)


@pytest.mark.model
def test_the_queue_limits_answer_503_and_count_by_reason(srv: Server) -> None:
    long = _stream(srv, LONG)
    waiting = None
    try:
        _first_token(long)            # in flight: 1 sequence, past its first token
        # its prompt (>= 40 tokens) left the backlog with its first token: another request is
        # admitted (a stream, closed at once)
        _close(_stream(srv, {**LONG, "max_tokens": 1}))
        _load_is(srv, 1)
        # --max-num-queued-reqs: 1 + 3 sequences > 3
        status, err = srv.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": "Hi", "n": 3, "max_tokens": 1}, key=None)
        assert status == 503 and err["error"]["code"] == "server_busy", err
        assert "--max-num-queued-reqs 3" in err["error"]["message"]
        assert _rejections(srv, "max_num_queued_reqs") == 1
        # a prompt of >= 40 tokens waits behind the running one, before its first token
        prompt = " ".join(["lighthouse"] * 60)
        waiting = _stream(srv, {**LONG, "prompt": prompt, "max_tokens": 4})
        # --max-num-queued-tokens: the backlog is that prompt (>= 40); 2 + 1 sequences pass
        # the other valve
        status, err = srv.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": "Hi", "max_tokens": 1}, key=None)
        assert status == 503 and err["error"]["code"] == "server_busy", err
        assert "--max-num-queued-tokens 40" in err["error"]["message"]
        assert _rejections(srv, "max_num_queued_tokens") == 1
        assert _value(srv.metrics(), "radixkv_admission_rejections",
                      reason="max_num_queued_tokens") == 1
    finally:
        if waiting is not None:
            _close(waiting)
        _close(long)
    # both gone (aborted): nothing in flight, no backlog, a request is served again
    deadline = time.monotonic() + 30
    while True:
        status, body = srv.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": "Hi", "max_tokens": 1}, key=None)
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200, body
