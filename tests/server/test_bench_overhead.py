"""``bench serve --overhead``'s arithmetic on hand-made records (no server, no model): the
overhead splits exactly into the non-engine part and the two engines' compute difference, and
the paired before/after compares the same turns; and its raw client's reading of an SSE
stream (a stdlib HTTP server on loopback stands in for radixkv serve)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from radixkv.benchmarks.bench_serve import _overhead_row, _paired, _RawChat


def _rec(conv: int, server: str, ttft: float, core: float, engine: float,
         engine_core: float) -> dict:
    return {"threads": 1, "load": 0, "conv": conv, "turn": 1, "server": server, "ttft": ttft,
            "core_ttft": core, "engine_ttft": engine, "engine_core_ttft": engine_core,
            "in_server_ttft": ttft - 0.001, "pre_engine": 0.002, "delivery": 0.0005}


def test_overhead_is_the_non_engine_part_plus_the_compute_difference() -> None:
    # one turn: HTTP 60 ms of which the server's engine took 50; in-process 52 of which 49
    recs = [_rec(0, "serve", 0.060, 0.050, 0.052, 0.049)]
    row = _overhead_row("serve", "openai", 1, 0, recs)
    assert row["overhead_p50_ms"] == pytest.approx(8.0)
    assert row["nonengine_p50_ms"] == pytest.approx((60 - 50) - (52 - 49))
    engine_diff = 50 - 49
    assert row["overhead_p50_ms"] == pytest.approx(row["nonengine_p50_ms"] + engine_diff)
    assert row["nonengine_share"] == pytest.approx(0.007 / 0.052)
    assert row["nonengine_met"] is False and row["met"] is False   # 7 ms > 5 ms


def test_a_server_without_the_engine_reading_gets_no_non_engine_figures() -> None:
    rec = _rec(0, "serve", 0.060, 0.050, 0.052, 0.049)
    rec["core_ttft"] = None
    row = _overhead_row("serve", "openai", 1, 0, [rec])
    assert "nonengine_p50_ms" not in row and row["overhead_p50_ms"] == pytest.approx(8.0)


def test_paired_compares_the_same_turns_only() -> None:
    recs = [_rec(0, "serve", 0.060, 0.050, 0.052, 0.049),
            _rec(0, "serve@old", 0.070, 0.052, 0.052, 0.049),   # 18 ms outside its engine
            _rec(1, "serve", 0.040, 0.030, 0.041, 0.038),
            _rec(1, "serve@old", 0.041, 0.035, 0.041, 0.038),   # 6 ms
            _rec(2, "serve", 0.040, 0.030, 0.041, 0.038)]       # no partner: left out
    got = _paired(1, 0, "serve@old", recs)
    assert got["turns"] == 2 and got["serve_lower"] == 1
    # non-engine differences: (10 - 18) and (10 - 6) ms; the median of two is their mean
    assert got["nonengine_diff_p50_ms"] == pytest.approx((-8 + 4) / 2)
    assert got["ttft_diff_p50_ms"] == pytest.approx((-10 + -1) / 2)


class _SSE(BaseHTTPRequestHandler):
    """Streams a chat reply the way radixkv serve does: chunked SSE, a role chunk without
    content first, content chunks, a usage chunk with radixkv's figures, ``[DONE]``."""

    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []
    peers: list[tuple] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        _SSE.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        _SSE.peers.append(self.client_address)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        usage = {"prompt_tokens": 9, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": 7},
                 "radixkv": {"ttft_s": 0.01, "server_ttft_s": 0.012,
                             "queue_and_tokenize_s": 0.001, "delivery_s": 0.0002}}
        events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"delta": {"content": "Hi"}}]},
                  {"choices": [{"delta": {"content": "!"}}]},
                  {"choices": [], "usage": usage}]
        for data in [json.dumps(e).encode() for e in events] + [b"[DONE]"]:
            line = b"data: " + data + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


def test_raw_client_reads_the_stream_and_keeps_its_connection() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        chat = _RawChat(f"http://127.0.0.1:{server.server_address[1]}", "m", 4)
        msgs = [{"role": "user", "content": "Say hi."}]
        got = [chat(msgs), chat(msgs)]
    finally:
        server.shutdown()
        server.server_close()
    for rec in got:
        assert rec["cached_tokens"] == 7 and rec["core_ttft"] == 0.01
        assert rec["in_server_ttft"] == 0.012 and rec["pre_engine"] == 0.001
        assert rec["delivery"] == 0.0002 and 0 < rec["ttft"] < 5
    assert _SSE.bodies[-1] == {"model": "m", "messages": msgs, "temperature": 0,
                               "max_tokens": 4, "stream": True,
                               "stream_options": {"include_usage": True}}
    assert _SSE.peers[-1] == _SSE.peers[-2]   # the second request reused the connection
