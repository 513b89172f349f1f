"""Load and abuse through the real server (``radixkv serve`` subprocess on 127.0.0.1): client
disconnects of non-streamed requests, admission by sequences, size limits before any work, bad
Unicode, and a model that fails to load.

One server for the module, with a small admission window (2 running + 1 queued sequences) so
the limits are reached with a few requests.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tests.server.test_openai_server import (MODEL, Server, _free_port,  # noqa: E402
                                             _held_blocks, _value, running_server)

MAX_SEQS, MAX_QUEUED = 2, 1
MAX_BYTES = 12 * 2**20


@pytest.fixture(scope="module")
def srv() -> Any:
    with running_server(["--max-num-seqs", str(MAX_SEQS), "--max-queued", str(MAX_QUEUED),
                         "--max-request-bytes", str(MAX_BYTES), "--device-blocks", "256",
                         "--threads", "1", "--device", "cpu", "--dtype", "float32"]) as server:
        yield server


def _post(port: int, path: str, body: bytes, headers: dict | None = None
          ) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
    return conn


def _idle(srv: Server, timeout: float) -> dict:
    """Metrics once nothing runs and no block is held (or AssertionError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        fams = srv.metrics()
        if _value(fams, "radixkv_num_requests_running") == 0 and _held_blocks(fams) == 0 \
                and _value(fams, "radixkv_num_requests_waiting") == 0:
            return fams
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout} s: held {_held_blocks(fams)}")
        time.sleep(0.1)


def _running(srv: Server, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _value(srv.metrics(), "radixkv_num_requests_running") < n:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


LONG = {"model": MODEL, "prompt": "Write a very long story about a lighthouse keeper.",
        "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.mark.model
def test_a_non_streamed_request_is_aborted_when_its_client_disconnects(srv: Server) -> None:
    """Before: the disconnect was polled only after 0.5 s without any output, which never
    happens while tokens flow, so the request ran its 3000 tokens holding blocks and a slot."""
    before = _idle(srv, 60)
    aborts = _value(before, "radixkv_request_success", finished_reason="abort")
    conn = _post(srv.port, "/v1/completions", json.dumps(LONG).encode())
    _running(srv, 1)
    assert _held_blocks(srv.metrics()) > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    t0 = time.monotonic()
    fams = _idle(srv, 10)
    assert time.monotonic() - t0 < 10
    assert _value(fams, "radixkv_request_success", finished_reason="abort") == aborts + 1
    # its admission slot is back: a full window of sequences is admitted again
    r = srv.raw("POST", "/v1/completions", {"model": MODEL, "max_tokens": 1,
                                            "prompt": ["Hi"] * (MAX_SEQS + MAX_QUEUED)},
                key=None)
    assert r[0] == 200, r


@pytest.mark.model
def test_admission_counts_every_prompt_times_n(srv: Server) -> None:
    """Before: one request of 100 prompts x n=2 took one slot and put 200 sequences in the
    queue past --max-queued 1."""
    _idle(srv, 60)
    status, err = srv.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": [f"p{i}" for i in range(100)], "n": 2, "max_tokens": 1},
        key=None)
    assert status == 400 and err["error"]["code"] == "too_many_sequences", err
    assert err["error"]["param"] == "prompt" and "200" in err["error"]["message"]
    status, err = srv.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 4,
                                                      "max_tokens": 1}, key=None)
    assert status == 400 and err["error"]["param"] == "n"
    # a request holding 2 sequences leaves room for 1 more, not 2
    conn = _post(srv.port, "/v1/completions", json.dumps({**LONG, "n": 2}).encode())
    try:
        _running(srv, 1)
        status, err = srv.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}, key=None)
        assert status == 429 and err["error"]["code"] == "queue_full", err
        assert _value(srv.metrics(), "radixkv_num_requests_waiting") == 0
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    _idle(srv, 10)


@pytest.mark.model
def test_sizes_and_counts_are_refused_before_any_work(srv: Server) -> None:
    _idle(srv, 60)
    before = srv.metrics()
    # a declared Content-Length past the limit: 413 without reading the body
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_BYTES + 1))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == \
        "request_too_large"
    conn.close()
    # a chunked body (no Content-Length) is cut at the limit
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    chunk = b"x" * 2**20
    conn.request("POST", "/v1/completions", (chunk for _ in range(13)),
                 {"Content-Type": "application/json"}, encode_chunked=True)
    assert conn.getresponse().status == 413
    conn.close()
    # 600 cache_control marks: refused by count, not after 600 renders (21 s before)
    msgs = [{"role": "user", "content": f"m{i}", "cache_control": {"type": "ephemeral"}}
            for i in range(600)]
    t0 = time.monotonic()
    status, err = srv.raw("POST", "/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                           "max_tokens": 1}, key=None)
    assert status == 400 and err["error"]["code"] == "too_many_cache_breakpoints", err
    assert time.monotonic() - t0 < 5
    # a 10 MiB chat: context_length_exceeded from its length, before tokenizing (21 s before)
    t0 = time.monotonic()
    status, err = srv.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": "lorem ipsum " * (10 * 2**20 // 12)}]},
        key=None)
    took = time.monotonic() - t0
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert took < 8, took
    status, err = srv.raw("POST", "/v1/completions", {
        "model": MODEL, "max_tokens": 1, "prompt": "lorem ipsum " * (4 * 2**20 // 12)},
        key=None)
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    after = srv.metrics()
    assert _value(after, "radixkv_prefix_cache_queries") == \
        _value(before, "radixkv_prefix_cache_queries")
    assert _value(after, "radixkv_request_rejected", status="413") == \
        _value(before, "radixkv_request_rejected", status="413") + 2


@pytest.mark.model
def test_a_lone_surrogate_in_chat_content_is_a_400(srv: Server) -> None:
    """Before: a TypeError in the template path, answered 500."""
    for content in ("bad \ud800 text", [{"type": "text", "text": "\udfff"}]):
        body = json.dumps({"model": MODEL, "max_tokens": 1,
                           "messages": [{"role": "user", "content": content}]})
        status, err = srv.raw("POST", "/v1/chat/completions", raw_body=body.encode(), key=None)
        assert status == 400 and err["error"]["param"] == "messages", err
        assert "Unicode" in err["error"]["message"]
    status, err = srv.raw("POST", "/v1/completions", raw_body=json.dumps(
        {"model": MODEL, "prompt": "\ud800", "max_tokens": 1}).encode(), key=None)
    assert status == 400


@pytest.mark.parametrize("model, words", [
    ("/nonexistent/model-dir", "nonexistent"),
    ("nobody-radixkv-test/not-a-model", "--allow-download"),
])
def test_a_model_that_fails_to_load_exits_non_zero(model: str, words: str) -> None:
    """Before: the socket stayed open answering 503 forever."""
    proc = subprocess.run([sys.executable, "-m", "radixkv.server.cli", model, "--port",
                           str(_free_port()), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    assert words in proc.stderr, proc.stderr
