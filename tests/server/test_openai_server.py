"""The real server (``radixkv serve`` as a subprocess on 127.0.0.1) driven by the official
``openai`` client (issue 11). One server for the whole module keeps CI to one model load.

The server runs with two API keys (one from the command line, one from a file), so every test
also exercises authentication; a batch of 8 sequences plus 8 queued requests bounds admission.
The test process loads the same model once to compare greedy text with ``Engine.generate``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.model

KEY_A, KEY_B = "key-alpha", "key-bravo"
MODEL = "SmolLM2-135M-Instruct"
JSON_WHITESPACE = 6   # the shared server's --structured-outputs-max-whitespace
CONVERSATION_BYTES = 16384   # the shared server's --max-conversation-bytes
MAX_SEQS, MAX_QUEUED = 8, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(srv: Server, timeout: float = 600) -> None:
    """Until ``/health`` answers 200; raises with the server's output if it exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"server exited: {srv.proc.stdout.read()}")
        try:
            if srv.raw("GET", "/health", key=None)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server not ready")


@contextlib.contextmanager
def running_server(args: list[str], port: int | None = None,
                   wait: bool = True) -> Iterator[Server]:
    """``radixkv serve`` as a subprocess on 127.0.0.1 (a free port unless ``port``) with
    ``args``; ready (``/health`` 200) when ``wait``; SIGTERM on exit, killed after 30 s."""
    port = _free_port() if port is None else port
    proc = subprocess.Popen([sys.executable, "-m", "radixkv.server.cli", "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = Server(port, proc)
    try:
        if wait:
            _wait_ready(srv)
        yield srv
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


class Server:
    def __init__(self, port: int, proc: subprocess.Popen) -> None:
        self.port, self.proc = port, proc
        self.base = f"http://127.0.0.1:{port}"

    def client(self, key: str = KEY_A) -> Any:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0,
                             timeout=300)

    def raw(self, method: str, path: str, body: Any = None, key: str | None = KEY_A,
            raw_body: bytes | None = None, headers: dict[str, str] | None = None
            ) -> tuple[int, Any]:
        data = raw_body if raw_body is not None else (
            None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers=headers or {})
        req.add_header("Content-Type", "application/json")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                text = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            text, status = e.read().decode(), e.code
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text

    def metrics(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=60) as r:
            text = r.read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, name: str, **labels: str) -> float:
    total = 0.0
    for s in fams[name].samples:
        if s.name in (name, name + "_total") and all(s.labels.get(k) == v
                                                     for k, v in labels.items()):
            total += s.value
    return total


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    keyfile = tmp_path_factory.mktemp("keys") / "keys.txt"
    keyfile.write_text(f"# tenants\n{KEY_B}\n")
    args = ["--api-key", KEY_A, "--api-key-file", str(keyfile), "--max-num-seqs", str(MAX_SEQS),
            "--max-queued", str(MAX_QUEUED), "--device-blocks", "512", "--threads", "1",
            "--device", "cpu", "--enable-cache-reset",
            # below the default 20, which sampled JSON here exceeds (the whitespace test)
            "--structured-outputs-max-whitespace", str(JSON_WHITESPACE),
            "--max-conversation-bytes", str(CONVERSATION_BYTES),
            # float32: greedy equality with Engine.generate below (a CPU with native bf16
            # would default to bf16, whose cached and cold continuations may differ)
            "--dtype", "float32"]
    with running_server(args, wait=False) as srv:   # the first test waits for /health itself
        yield srv


@pytest.fixture(scope="module")
def ready(server: Server, engine: Any) -> Server:
    """The server once /health says 200 (it says 503 while loading: checked on the way)."""
    seen = set()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited: {server.proc.stdout.read()}")
        try:
            status, _ = server.raw("GET", "/health", key=None)
        except (ConnectionError, urllib.error.URLError):
            time.sleep(0.5)
            continue
        seen.add(status)
        if status == 200:
            break
        assert status == 503
        time.sleep(0.5)
    else:
        raise TimeoutError("server not ready in 600 s")
    return server


@pytest.fixture(scope="module")
def engine() -> Any:
    """The same model in this process, for greedy equality with Engine.generate."""
    import torch

    import radixkv
    from radixkv.config import CacheConfig, EngineConfig

    torch.set_num_threads(1)
    try:
        return radixkv.Engine.from_pretrained(
            cache_config=CacheConfig(num_device_blocks=256),
            engine_config=EngineConfig(device="cpu", dtype="float32"))
    except radixkv.ConfigError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"embedded model unavailable: {exc}")


def _chat(client: Any, messages: list[dict], **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def test_health_models_and_auth(ready: Server) -> None:
    assert ready.raw("GET", "/health", key=None)[0] == 200
    models = ready.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        ready.client("wrong-key").models.list()
    status, body = ready.raw("GET", "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert ready.client(KEY_B).models.list().data[0].id == MODEL   # key from the file


def test_two_chat_turns_reuse_the_cache_and_match_engine_generate(ready: Server, engine: Any
                                                                  ) -> None:
    from radixkv import SamplingParams

    client = ready.client()
    msgs = [{"role": "system", "content": "You are a terse assistant for a test suite."},
            {"role": "user", "content": "Name one primary colour."}]
    r1 = _chat(client, msgs, temperature=0, max_tokens=12)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    reply = r1.choices[0].message.content
    msgs2 = msgs + [{"role": "assistant", "content": reply},
                    {"role": "user", "content": "And another one?"}]
    r2 = _chat(client, msgs2, temperature=0, max_tokens=12)
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    ext = r2.usage.model_extra["radixkv"]
    assert ext["cached_tokens_per_tier"]["device"] == r2.usage.prompt_tokens_details.cached_tokens
    assert ext["ttft_s"] > 0 and ext["server_ttft_s"] >= ext["ttft_s"]
    ids = engine.chat_template.prompt_ids(msgs2)
    assert r2.usage.prompt_tokens == len(ids)
    ref = engine.generate(ids, SamplingParams(max_tokens=12))[0].outputs[0]
    assert r2.choices[0].message.content == ref.text
    assert r2.choices[0].finish_reason == ref.finish_reason


def test_streaming_with_usage_matches_the_plain_answer(ready: Server) -> None:
    client = ready.client()
    msgs = [{"role": "user", "content": "Count from one to five."}]
    plain = _chat(client, msgs, temperature=0, max_tokens=10)
    chunks = list(_chat(client, msgs, temperature=0, max_tokens=10, stream=True,
                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0   # same prompt as the plain request


def test_n2_and_text_and_token_prompts_and_beam_search(ready: Server, engine: Any) -> None:
    """n samples, text and token prompts, and beams: each equal to what the engine itself
    produces for the same prompt and parameters (float32: the batch does not change a row)."""
    from radixkv import SamplingParams

    client = ready.client()
    msgs = [{"role": "user", "content": "Say something."}]
    r = _chat(client, msgs, n=2, temperature=0.9, seed=7, max_tokens=6)
    assert sorted(c.index for c in r.choices) == [0, 1]
    ref = engine.generate(engine.chat_template.prompt_ids(msgs),
                          SamplingParams(n=2, temperature=0.9, seed=7, max_tokens=6))[0]
    got = {c.index: c.message.content for c in r.choices}
    assert [got[0], got[1]] == [o.text for o in sorted(ref.outputs, key=lambda o: o.index)]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)
    c1 = client.completions.create(model=MODEL, prompt="The capital of France is",
                                   max_tokens=5, temperature=0)
    ref = engine.generate(engine.encode("The capital of France is"),
                          SamplingParams(max_tokens=5))[0].outputs[0]
    assert c1.choices[0].text == ref.text
    assert c1.usage.prompt_tokens == len(engine.encode("The capital of France is"))
    ids = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 504, 3575, 282],
                                                "max_tokens": 3, "temperature": 0})
    assert ids[0] == 200 and ids[1]["usage"]["prompt_tokens"] == 4
    assert ids[1]["choices"][0]["text"] == engine.generate(
        [1, 504, 3575, 282], SamplingParams(max_tokens=3))[0].outputs[0].text
    status, beam = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
        "n": 2, "use_beam_search": True})
    assert status == 200 and len(beam["choices"]) == 2
    ref = engine.generate(engine.encode("Once upon a time"),
                          SamplingParams(max_tokens=4, beam_width=2, n=2))[0]
    assert [c["text"] for c in sorted(beam["choices"], key=lambda c: c["index"])] == \
        [o.text for o in ref.outputs]
    assert beam["choices"][0]["text"] != beam["choices"][1]["text"]
    scores = beam["usage"]["radixkv"]["cumulative_logprobs"]
    assert scores == pytest.approx([o.cumulative_logprob for o in ref.outputs], abs=1e-4)


def test_sixteen_concurrent_clients(ready: Server) -> None:
    """16 clients at once against a batch of 8: they share the batch (the running gauge goes
    past 1 while they run), and each gets exactly the answer it gets alone."""
    import threading

    def one(i: int) -> Any:
        return _chat(ready.client(), [{"role": "user", "content": f"Give me fact number {i}."}],
                     temperature=0, max_tokens=6, extra_body={"ignore_eos": True})

    peak, stop = [0.0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _value(ready.metrics(), "radixkv_num_requests_running"))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with cf.ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(one, range(16)))
    finally:
        stop.set()
        watcher.join()
    assert peak[0] >= 2, peak   # they ran together, not one after another
    alone = [one(i) for i in (0, 7, 15)]
    for i, a in zip((0, 7, 15), alone):
        assert outs[i].choices[0].message.content == a.choices[0].message.content
    assert all(o.usage.completion_tokens == 6 for o in outs)
    assert len({o.id for o in outs}) == 16
    assert len({o.choices[0].message.content for o in outs}) > 1   # each its own prompt


def _released(srv: Server, after: str, timeout: float = 60) -> dict:
    """The server's metrics once nothing runs and no block is held (an AssertionError naming
    ``after`` past ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        fams = srv.metrics()
        if _value(fams, "radixkv_num_requests_running") == 0 and _held_blocks(fams) == 0:
            return fams
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held after {after}: {_held_blocks(fams)}")
        time.sleep(0.2)


def _held_blocks(fams: dict) -> float:
    """Device blocks requests hold: not free, not cached, not a kept partial tail."""
    total = _value(fams, "radixkv_engine_device_blocks")
    free = _value(fams, "radixkv_engine_device_blocks_free")
    cached = _value(fams, "radixkv_engine_cached_blocks_per_tier", tier="device")
    return total - free - cached - _value(fams, "radixkv_engine_tail_blocks")


def test_disconnect_mid_stream_aborts_and_releases_blocks(ready: Server) -> None:
    before = ready.metrics()
    assert _held_blocks(before) == 0
    conn = http.client.HTTPConnection("127.0.0.1", ready.port, timeout=120)
    body = json.dumps({"model": MODEL, "prompt": "Write a long story about a lighthouse.",
                       "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                   "Authorization": f"Bearer {KEY_A}"})
    resp = conn.getresponse()
    assert resp.status == 200
    got = b""
    while got.count(b"data:") < 3:
        got += resp.read1(4096)
    held = _held_blocks(ready.metrics())
    assert held > 0   # the request is running and holds blocks
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    fams = _released(ready, "the disconnect")
    assert _value(fams, "radixkv_request_success", finished_reason="abort") >= 1


BAD = [
    # (body or raw bytes, endpoint, status, param)
    (b"{not json", "chat", 400, None),
    ({"model": MODEL}, "chat", 400, "messages"),
    # (a left-out model is the server's, as vLLM's: tests/server/test_frontend_options.py)
    ({"model": 7, "messages": [{"role": "user", "content": "hi"}]}, "chat", 400, "model"),
    ({"model": MODEL, "messages": "hello"}, "chat", 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     "chat", 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     "chat", 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     "chat", 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0},
     "chat", 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     "chat", 400, "temperature"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, "chat", 404, "model"),
    ({"model": MODEL, "messages": []}, "chat", 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "chat", 400,
     "messages"),
    ({"model": MODEL, "prompt": "word " * 9000, "max_tokens": 1}, "completions", 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, "completions", 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, "completions", 400, "prompt"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 2, "echo": True, "stream": True},
     "completions", 400, "echo"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "completions", 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, "completions", 400,
     "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "completions", 400, "logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi",
                                    "cache_control": {"type": "ephemeral", "ttl": "soon"}}]},
     "chat", 400, "messages"),
    ({"model": MODEL, "prompt": "hi", "prompt_cache_retention": "forever"}, "completions", 400,
     "prompt_cache_retention"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "chat", 400, "top_logprobs"),
    ({"model": MODEL, "prompt": "hi", "session_id": ""}, "completions", 400, "session_id"),
    ({"model": MODEL, "prompt": "hi", "session_id": 5}, "completions", 400, "session_id"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "end_session": "yes"},
     "chat", 400, "end_session"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 3},
     "chat", 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 1, "use_beam_search": True, "temperature": 0},
     "completions", 400, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True, "temperature": 0.7},
     "completions", 400, "temperature"),
]


def test_every_bad_input_is_a_4xx_with_openai_error_json_and_changes_nothing(ready: Server
                                                                            ) -> None:
    before = ready.metrics()
    for body, endpoint, status, param in BAD:
        raw = body if isinstance(body, bytes) else None
        got, err = ready.raw("POST", f"/v1/{endpoint}" if endpoint == "completions"
                             else "/v1/chat/completions", None if raw else body, raw_body=raw)
        assert got == status, (body if raw else str(body)[:120], got, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["message"]
        if param is not None:
            assert (err["error"]["param"] or "").split(".")[0] == param, (str(body)[:80], err)
    status, err = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "word " * 9000})
    assert "8192" in err["error"]["message"]   # the limit is stated
    with pytest.raises(openai.BadRequestError):
        _chat(ready.client(), [{"role": "user", "content": "hi"}], max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        ready.client().chat.completions.create(model="nope",
                                               messages=[{"role": "user", "content": "hi"}])
    after = ready.metrics()
    for name in ("radixkv_prefix_cache_queries", "radixkv_prefix_cache_hits"):
        assert _value(after, name) == _value(before, name), name
    assert ready.raw("GET", "/health", key=None)[0] == 200   # still alive


def test_api_keys_are_isolated_cache_namespaces(ready: Server) -> None:
    msgs = [{"role": "system", "content": "Tenant isolation check: " + "lorem ipsum " * 20},
            {"role": "user", "content": "Reply with OK."}]
    a1 = _chat(ready.client(KEY_A), msgs, temperature=0, max_tokens=2)
    a2 = _chat(ready.client(KEY_A), msgs, temperature=0, max_tokens=2)
    b1 = _chat(ready.client(KEY_B), msgs, temperature=0, max_tokens=2)
    assert a1.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens > 0
    assert b1.usage.prompt_tokens_details.cached_tokens == 0
    # a request's own salt narrows further within one key
    s1 = _chat(ready.client(KEY_A), msgs, temperature=0, max_tokens=2,
               extra_body={"cache_salt": "user-1"})
    s2 = _chat(ready.client(KEY_A), msgs, temperature=0, max_tokens=2,
               extra_body={"prompt_cache_key": "user-1"})
    s3 = _chat(ready.client(KEY_A), msgs, temperature=0, max_tokens=2,
               extra_body={"cache_salt": "user-2"})
    assert s1.usage.prompt_tokens_details.cached_tokens == 0
    # cache_salt (vLLM) and prompt_cache_key (OpenAI) name the same narrowing
    assert s2.usage.prompt_tokens_details.cached_tokens > 0
    assert s3.usage.prompt_tokens_details.cached_tokens == 0


def test_the_server_freezes_its_start_up_heap_and_times_the_collector(ready: Server) -> None:
    """``radixkv serve`` owns its process: once loaded it freezes the start-up heap out of the
    cyclic GC's passes (radixkv/server/heap.py: a full pass over it took ~85 ms), and /metrics
    shows how many objects that froze and every collection's pause by generation."""
    msgs = [{"role": "user", "content": "Say one word about garbage."}]
    for _ in range(3):
        _chat(ready.client(), msgs, temperature=0, max_tokens=4)
    fams = ready.metrics()
    assert fams["radixkv_gc_frozen_objects"].type == "gauge"
    assert _value(fams, "radixkv_gc_frozen_objects") > 50_000   # the model, torch, transformers
    assert fams["radixkv_gc_pause_seconds"].type == "histogram"
    counts = {g: sum(s.value for s in fams["radixkv_gc_pause_seconds"].samples
                     if s.name.endswith("_count") and s.labels["generation"] == g)
              for g in ("0", "1", "2")}
    assert counts["0"] > 0, counts   # requests allocate: young collections ran and were timed


def test_metrics_parse_with_prometheus_client(ready: Server) -> None:
    # Two identical requests first, so the test stands alone (the hit counter below must move
    # however the module's tests are selected or ordered).
    msgs = [{"role": "user", "content": "Metrics warm-up: say one word about caches."}]
    for _ in range(2):
        _chat(ready.client(), msgs, temperature=0, max_tokens=2)
    fams = ready.metrics()
    for name, kind in (("radixkv_prefix_cache_queries", "counter"),
                       ("radixkv_prefix_cache_hits", "counter"),
                       ("radixkv_prefix_cache_hits_by_tier", "counter"),
                       ("radixkv_time_to_first_token_seconds", "histogram"),
                       ("radixkv_e2e_request_latency_seconds", "histogram"),
                       ("radixkv_inter_token_latency_seconds", "histogram"),
                       ("radixkv_num_requests_running", "gauge"),
                       ("radixkv_num_requests_waiting", "gauge"),
                       ("radixkv_kv_cache_usage_perc", "gauge"),
                       ("radixkv_evictions", "counter"), ("radixkv_promotions", "counter"),
                       ("radixkv_demotions", "counter")):
        assert fams[name].type == kind, name
    assert _value(fams, "radixkv_prefix_cache_hits") > 0
    assert _value(fams, "radixkv_prefix_cache_hits") <= _value(fams,
                                                               "radixkv_prefix_cache_queries")
    count = [s for s in fams["radixkv_time_to_first_token_seconds"].samples
             if s.name.endswith("_count")]
    assert count and count[0].value > 0


def test_past_max_queued_the_server_answers_429(ready: Server) -> None:
    def one(i: int) -> int:
        return ready.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": f"Burst {i}", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True})[0]

    n = MAX_SEQS + MAX_QUEUED + 8
    with cf.ThreadPoolExecutor(n) as pool:
        codes = list(pool.map(one, range(n)))
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= MAX_SEQS + MAX_QUEUED - 4, codes


def test_logprobs_per_token_chat_stream_and_completions(ready: Server) -> None:
    """Per-token logprobs in OpenAI's shapes: greedy picks the most likely token, so each
    token's logprob equals its first alternative's; they sum to the choice's total; streamed
    deltas carry the same entries as the whole answer."""
    api = ready.client()
    msgs = [{"role": "user", "content": "Name three colours."}]
    r = api.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=6,
                                    logprobs=True, top_logprobs=3,
                                    extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert bytes(e.bytes).decode("utf-8") == e.token
    total = r.usage.model_extra["radixkv"]["cumulative_logprobs"][0]
    assert abs(sum(e.logprob for e in content) - total) < 1e-3
    assert "".join(e.token for e in content) == r.choices[0].message.content

    streamed = []
    for chunk in api.chat.completions.create(model=MODEL, messages=msgs, temperature=0,
                                             max_tokens=6, logprobs=True, top_logprobs=3,
                                             stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]

    c = api.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                               max_tokens=5, logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]
    assert all(len(t) <= 2 and max(t.values()) >= v - 1e-5
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    plain = _chat(api, msgs, temperature=0, max_tokens=2)
    assert plain.choices[0].logprobs is None   # not asked, not sent


def test_cache_breakpoints_and_cache_read_write_usage(ready: Server) -> None:
    """``cache_control`` on a message (Anthropic's breakpoint) and ``prompt_cache_retention``
    (OpenAI's) are accepted; usage reports the tokens each request wrote to and read from the
    cache (what hosted prompt caches bill separately)."""
    api = ready.client()
    system = {"role": "system", "content": "Breakpoint test. " + "Policy text. " * 30,
              "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    first = _chat(api, [system, {"role": "user", "content": "First question?"}],
                  temperature=0, max_tokens=2)
    ext = first.usage.model_extra["radixkv"]
    assert ext["cache_read_tokens"] == 0 and ext["cache_write_tokens"] > 0
    second = _chat(api, [system, {"role": "user", "content": "A different question?"}],
                   temperature=0, max_tokens=2, extra_body={"prompt_cache_retention": "24h"})
    ext2 = second.usage.model_extra["radixkv"]
    assert ext2["cache_read_tokens"] == second.usage.prompt_tokens_details.cached_tokens > 0
    assert ext2["cache_read_tokens"] + ext2["cache_write_tokens"] <= second.usage.prompt_tokens
    c = api.completions.create(model=MODEL, prompt="Retention " * 40, max_tokens=1,
                               temperature=0, extra_body={"prompt_cache_retention": "in_memory"})
    assert c.usage.model_extra["radixkv"]["cache_write_tokens"] > 0
    # the session hints (radixkv extension) are accepted on both endpoints
    for end in (False, True):
        _chat(api, [{"role": "user", "content": "Session turn?"}], temperature=0, max_tokens=1,
              extra_body={"session_id": "conv-7", "end_session": end})
    api.completions.create(model=MODEL, prompt="One-off", max_tokens=1, temperature=0,
                           extra_body={"end_session": True})


def test_penalties_and_logit_bias_change_the_choice(ready: Server) -> None:
    """Before: accepted and ignored (a 200 with the same text)."""
    api = ready.client()
    # a +100 bias on one token makes greedy pick it at every step
    tid = 504
    word = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": [tid],
                                                 "max_tokens": 1, "temperature": 0})[1]
    biased = api.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                    logit_bias={str(tid): 100})
    status, toks = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
        "logit_bias": {str(tid): 100}, "logprobs": 0})
    assert status == 200 and word
    assert biased.choices[0].text == toks["choices"][0]["text"]
    assert len(set(toks["choices"][0]["logprobs"]["tokens"])) == 1   # the same token 4 times
    # the raw model's logprobs are reported, not the biased distribution's
    assert all(lp < -1e-3 for lp in toks["choices"][0]["logprobs"]["token_logprobs"])
    # strong penalties make greedy repeat fewer of its own tokens
    def repeats(**kw: Any) -> int:
        toks = ready.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": "hello hello hello hello hello hello", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "logprobs": 0, **kw})[1]
        toks = toks["choices"][0]["logprobs"]["tokens"]
        return len(toks) - len(set(toks))

    plain_repeats = repeats()
    assert plain_repeats >= 6
    assert repeats(frequency_penalty=2.0, presence_penalty=2.0) < plain_repeats / 2
    assert repeats(repetition_penalty=3.0) < plain_repeats   # vLLM's, prompt tokens too
    # min_p 1 keeps only the most likely token: sampling at temperature 1 is then greedy
    greedy = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                   "max_tokens": 6, "temperature": 0})[1]
    sharp = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                  "max_tokens": 6, "temperature": 1.0,
                                                  "min_p": 1.0, "seed": 11})[1]
    assert sharp["choices"][0]["text"] == greedy["choices"][0]["text"]
    # vLLM's stop_token_ids end a choice at that token
    first = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                  "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True})[1]["choices"][0]["text"]
    third = ready.raw("POST", "/tokenize", {"prompt": first, "add_special_tokens": False},
                      key=None)[1]["tokens"][2]
    stopped = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stop_token_ids": [third]})[1]["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["text"]) < len(first)
    # the stop string that matched is vLLM's stop_reason (the last of four here); five are a
    # 400 naming stop (vLLM's default VLLM_MAX_STOP_STRINGS)
    word = first[len(first) // 2:len(first) // 2 + 3]
    assert word.strip(), first
    many = [f"<never {i}>" for i in range(3)] + [word]
    cut = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "stop": many})[1]["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == first[:first.index(word)]
    assert cut["stop_reason"] == word
    assert stopped["stop_reason"] == third   # a stop token: its id
    status, err = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hello", "max_tokens": 1, "stop": many + ["x"]})
    assert status == 400 and err["error"]["param"] == "stop", err
    # a -100 bias bans a token greedy would pick
    first = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello",
                                                  "max_tokens": 1, "temperature": 0,
                                                  "logprobs": 0})[1]
    chosen = first["choices"][0]["logprobs"]["tokens"][0]
    ids = ready.raw("POST", "/tokenize", {"model": MODEL, "prompt": chosen,
                                          "add_special_tokens": False}, key=None)[1]["tokens"]
    banned = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "logprobs": 0,
        "logit_bias": {str(ids[0]): -100}})[1]
    assert banned["choices"][0]["logprobs"]["tokens"][0] != chosen


def test_response_format_json_object_and_schema_give_valid_json(ready: Server) -> None:
    api = ready.client()
    msgs = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]
    # any object: the tiny model may go on adding keys, but what it writes is an object
    plain = _chat(api, msgs, temperature=0, max_tokens=8)
    r = _chat(api, msgs, temperature=0, max_tokens=8, response_format={"type": "json_object"})
    assert not plain.choices[0].message.content.lstrip().startswith("{")
    assert r.choices[0].message.content.lstrip().startswith("{"), r.choices[0]
    # a schema bounds the value: it completes, and it parses and validates
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    for temperature in (0, 1.0):
        r = _chat(api, msgs, temperature=temperature, seed=3, max_tokens=60, n=2,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "cat", "schema": schema}})
        for c in r.choices:
            assert c.finish_reason == "stop", c
            value = json.loads(c.message.content)
            assert set(value) == {"name", "age"} and isinstance(value["age"], int), value
    status, err = ready.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
    assert status == 400 and err["error"]["param"] == "response_format", err


def test_json_output_whitespace_is_bounded_by_the_flag(ready: Server) -> None:
    """``--structured-outputs-max-whitespace``: sampled JSON has no run of whitespace between
    tokens longer than the server's bound (the schema has no strings, so every run is between
    tokens). Under the default bound (20) these samples had runs up to 14 characters; without
    one a model can pad to ``max_tokens`` (engine/grammar.py)."""
    import re

    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    runs = []
    for seed in (1, 2):
        r = _chat(ready.client(), [{"role": "user", "content": "Give two numbers."}], n=8,
                  temperature=1.5, seed=seed, max_tokens=40,
                  response_format={"type": "json_schema", "json_schema": {"name": "two",
                                                                          "schema": schema}})
        runs += [max([0] + [len(m) for m in re.findall(r"\s+", c.message.content)])
                 for c in r.choices]
    assert max(runs) <= JSON_WHITESPACE, runs
    assert max(runs) >= 3, runs   # the samples do pad: the bound is what stops them


def test_structured_outputs_regex_choice_grammar_and_json(ready: Server) -> None:
    """vLLM's ``structured_outputs`` (and its older ``guided_*`` fields): sampled outputs match
    the regex, are one of the choices, are in the grammar's language (EBNF or Lark), or are
    JSON in its one canonical layout (no free whitespace) valid against a schema given as
    text; chat and completions."""
    import re

    api = ready.client()
    msgs = [{"role": "user", "content": "Give me a code."}]

    def texts(kw: dict[str, Any], n: int = 3, chat: bool = True) -> list[str]:
        if chat:
            r = _chat(api, msgs, temperature=1.0, seed=7, max_tokens=24, n=n, extra_body=kw)
            return [c.message.content for c in r.choices]
        r = api.completions.create(model=MODEL, prompt="Colour:", temperature=1.0, seed=7,
                                   max_tokens=24, n=n, extra_body=kw)
        return [c.text for c in r.choices]

    for t in texts({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", t), t
    colours = ["red", "green", "light blue"]
    for kw, chat in (({"structured_outputs": {"choice": colours}}, True),
                     ({"guided_choice": colours}, False)):
        assert all(t in colours for t in texts(kw, chat=chat))
    for grammar in ('root ::= "yes" | "no" | ("maybe " [0-9])',
                    'start: "yes" | "no" | "maybe " DIGIT\n%import common.DIGIT'):
        for t in texts({"structured_outputs": {"grammar": grammar}}):
            assert re.fullmatch(r"yes|no|maybe [0-9]", t), (grammar, t)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    for t in texts({"structured_outputs": {"json": json.dumps(schema),
                                           "disable_any_whitespace": True}}):
        assert set(json.loads(t)) == {"n"} and t == json.dumps(json.loads(t)), t
    for t in texts({"guided_regex": "[a-c]{4}"}, n=1, chat=False):
        assert re.fullmatch("[a-c]{4}", t), t
    # refused with the field named: two constraints, ones that do not compile, beam search
    for body, param in (
            ({"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]}, "guided_choice"),
            ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
             "structured_outputs"),
            ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
            ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
            ({"structured_outputs": {"choice": ["a"], "structural_tag": "x"}},
             "structured_outputs"),
            ({"guided_json": "{not json"}, "guided_json"),
            ({"guided_regex": "a", "use_beam_search": True, "n": 2, "temperature": 0},
             "guided_regex")):
        status, err = ready.raw("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": msgs, "max_tokens": 4, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)


UNSUPPORTED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("function_call", "auto"), ("functions", [{"name": "f"}]), ("audio", {"voice": "x"}),
    ("guided_whitespace_pattern", " "), ("prediction", {"type": "content", "content": "x"}),
    ("vllm_xargs", {"a": 1}), ("add_special_tokens", True), ("prompt_embeds", "AAAA"),
    ("verbosity", "low"),   # OpenAI's (GPT-5): shorter or longer answers; medium is the default
]


@pytest.mark.parametrize("field, value", UNSUPPORTED)
def test_unsupported_fields_are_a_400_naming_them(ready: Server, field: str, value: Any
                                                  ) -> None:
    """Before: a 200 with ordinary text, the field silently ignored. (``tools``: the embedded
    model's chat template declares none.)"""
    status, err = ready.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        field: value})
    assert status == 400 and err["error"]["param"] == field, err
    assert err["error"]["code"] == "unsupported_parameter"
    # their "off" values are fine (clients send them by default)
    ok = ready.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
        "verbosity": "medium"})
    assert ok[0] == 200, ok


def test_chat_echo_and_prompt_text(ready: Server) -> None:
    """vLLM's chat ``echo``: a reply that continues the last message (``continue_final_message``)
    starts with it, streamed or not; a reply in a new assistant turn has nothing to echo. The
    reply's role is the continued message's (vLLM's ``get_chat_request_role``), else assistant.
    ``return_prompt_text``: the prompt's tokens as text, beside the choices (streamed: in the
    first chunk), which tokenize back to the prompt's tokens."""
    api = ready.client()
    msgs = [{"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "The best fruit is"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = _chat(api, msgs, temperature=0, max_tokens=5, extra_body=cont)
    echoed = _chat(api, msgs, temperature=0, max_tokens=5, extra_body={**cont, "echo": True,
                                                                        "return_prompt_text": True})
    reply = plain.choices[0].message.content
    assert echoed.choices[0].message.content == "The best fruit is" + reply
    streamed = "".join(c.choices[0].delta.content or "" for c in _chat(
        api, msgs, temperature=0, max_tokens=5, stream=True,
        extra_body={**cont, "echo": True}) if c.choices)
    assert streamed == "The best fruit is" + reply
    fresh = _chat(api, msgs[:1], temperature=0, max_tokens=3, extra_body={"echo": True})
    assert not fresh.choices[0].message.content.startswith("Name a fruit.")
    # the reply's role, as vLLM names it: the continued message's, else the assistant's
    assert echoed.choices[0].message.role == "assistant" == fresh.choices[0].message.role
    said = _chat(api, msgs[:1], temperature=0, max_tokens=3,
                 extra_body={"add_generation_prompt": False, "continue_final_message": True,
                             "echo": True})
    assert said.choices[0].message.role == "user"
    assert said.choices[0].message.content.startswith("Name a fruit.")
    roles = [c.choices[0].delta.role for c in _chat(
        api, msgs[:1], temperature=0, max_tokens=3, stream=True,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
        if c.choices and c.choices[0].delta.role]
    assert roles == ["user"]
    text = echoed.model_extra["prompt_text"]
    assert text.endswith("The best fruit is") and "<|im_start|>user" in text
    status, ids = ready.raw("POST", "/tokenize", {"model": MODEL, "prompt": text,
                                                  "add_special_tokens": False}, key=None)
    assert ids["tokens"] and ids["count"] == echoed.usage.prompt_tokens
    first = next(c for c in _chat(api, msgs[:1], max_tokens=2, stream=True,
                                  extra_body={"return_prompt_text": True}))
    assert first.model_extra["prompt_text"].startswith("<|im_start|>")


def test_a_thinking_budget_needs_a_reasoning_parser(ready: Server) -> None:
    """vLLM's ``thinking_token_budget`` on a server without ``--reasoning-parser``: a 400
    naming it (nothing says where the thinking ends), not ignored; ``null`` is everyone's
    default and -1 vLLM's "unlimited", the same (tests/server/test_run_batch.py serves one)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for value in (3, 0):
        status, err = ready.raw("POST", "/v1/chat/completions",
                                {**chat, "thinking_token_budget": value})
        assert status == 400 and err["error"]["param"] == "thinking_token_budget", err
    status, err = ready.raw("POST", "/v1/chat/completions", {**chat, "thinking_token_budget": -2})
    assert status == 400 and err["error"]["param"] == "thinking_token_budget", err
    for value in (None, -1):
        assert ready.raw("POST", "/v1/chat/completions",
                         {**chat, "thinking_token_budget": value})[0] == 200


def test_priority_needs_priority_scheduling(ready: Server) -> None:
    """vLLM's ``priority`` (and its ``X-Vllm-Priority`` header, which overrides the body) on a
    server that schedules by lpm: 0 is everyone's default; anything else is a 400 naming the
    flag it needs (tests/server/test_priority_scheduling.py serves them). Before: a 400 as an
    unsupported parameter."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for path, body in (("/v1/chat/completions", chat),
                       ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})):
        status, err = ready.raw("POST", path, {**body, "priority": 3})
        assert status == 400 and err["error"]["param"] == "priority", err
        assert "--scheduling-policy priority" in err["error"]["message"]
        status, err = ready.raw("POST", path, body, headers={"X-Vllm-Priority": "-2"})
        assert status == 400 and err["error"]["param"] == "priority", err
        for ok_body, headers in (({**body, "priority": 0}, {}),
                                 ({**body, "priority": 5}, {"X-Vllm-Priority": "0"}),
                                 (body, {"X-Vllm-Priority": "soon"})):   # not an int: ignored
            status, out = ready.raw("POST", path, ok_body, headers=headers)
            assert status == 200, (ok_body, headers, out)
        for bad in ("3", True, 1.5, 2 ** 63):
            status, err = ready.raw("POST", path, {**body, "priority": bad})
            assert status == 400 and err["error"]["param"] == "priority", (bad, err)


def test_prompt_logprobs_echo_and_vllm_field_are_the_engines(ready: Server, engine: Any
                                                            ) -> None:
    """Prompt log-probabilities as evaluation harnesses read them: ``echo`` with ``logprobs``
    (``max_tokens`` 0: the prompt alone, lm-evaluation-harness's loglikelihood request; or
    the prompt then the generated tokens) and vLLM's ``prompt_logprobs`` (completions and
    chat); the values are the in-process engine's (float32 on both sides)."""
    from radixkv import SamplingParams

    text = "The capital of France is Paris. The capital of Italy is"
    ids = engine.encode(text)
    ref = engine.generate(ids, SamplingParams(max_tokens=3, prompt_logprobs=2,
                                              logprobs=2))[0]
    plp = ref.prompt_logprobs
    client = ready.client()
    r = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=2,
                                  max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == engine.decode(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in plp[1:]], abs=1e-4)
    for got, e in zip(lp.top_logprobs[1:], plp[1:]):
        assert len(got) == 2 and max(got.values()) == pytest.approx(e.top[0][1], abs=1e-4)
    # with generated tokens: the prompt's entries, then theirs; the text likewise
    r = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=2,
                                  max_tokens=3, temperature=0)
    c = r.choices[0]
    gen = ref.outputs[0]
    assert c.text == engine.decode(ids) + gen.text
    assert c.logprobs.token_logprobs[len(ids):] == pytest.approx(
        [e.logprob for e in gen.logprobs], abs=1e-4)
    assert r.usage.completion_tokens == 3
    # vLLM's field: {token id: {logprob, rank, decoded_token}}, the token and its top 2
    status, body = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 2})
    assert status == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for d, e in zip(got[1:], plp[1:]):
        mine = d[str(e.token_id)]
        assert mine["rank"] == e.rank and mine["logprob"] == pytest.approx(e.logprob,
                                                                           abs=1e-4)
        assert {k for k, v in d.items() if v["rank"] <= 2} >= {str(t) for t, _ in e.top}
    msgs = [{"role": "user", "content": "Hi"}]
    status, body = ready.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 200 and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    # a streamed echo starts with the prompt
    chunks = list(client.completions.create(model=MODEL, prompt=text, echo=True,
                                            max_tokens=3, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == engine.decode(ids) + gen.text


def test_allowed_token_ids_bad_words_and_truncation_as_the_engine(ready: Server,
                                                                   engine: Any) -> None:
    """vLLM's ``allowed_token_ids``, ``bad_words`` and ``truncate_prompt_tokens`` through the
    server: greedy text equal to the in-process engine's with the same settings."""
    from radixkv import SamplingParams

    client = ready.client()
    text = "The capital of France is Paris. The capital of Italy is"
    ids = engine.encode(text)
    plain = engine.generate(ids, SamplingParams(max_tokens=8))[0].outputs[0]
    allowed = sorted(set(plain.token_ids[:3]) | set(engine.encode(" Rome Milan")))
    word = engine.decode(plain.token_ids[:2]).strip()
    for extra, kw in (({"allowed_token_ids": allowed}, {"allowed_token_ids": allowed}),
                      ({"bad_words": [word]}, {"bad_words": [word]})):
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0,
                                      extra_body=extra)
        ref = engine.generate(ids, SamplingParams(max_tokens=8, **kw))[0].outputs[0]
        assert r.choices[0].text == ref.text, extra
        assert r.choices[0].text != plain.text or "allowed_token_ids" in extra
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 5})
    ref = engine.generate(ids[-5:], SamplingParams(max_tokens=4))[0].outputs[0]
    assert r.usage.prompt_tokens == 5 and r.choices[0].text == ref.text
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == len(ids)   # it all fits
    for body, param in (({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"bad_words": [" "]}, "bad_words"),
                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": 3, "prompt_cache_retention": "24h"},
                         "truncate_prompt_tokens")):
        status, err = ready.raw("POST", "/v1/completions", {
            "model": MODEL, "prompt": text, "max_tokens": 2, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)


def test_min_tokens_holds_the_end_off_as_the_engine_does(ready: Server, engine: Any) -> None:
    """vLLM's ``min_tokens`` through the server: a greedy reply that ends after a few tokens
    runs to at least that many, token for token the engine's own with the same setting."""
    from radixkv import SamplingParams

    msgs = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    client = ready.client()
    short = _chat(client, msgs, temperature=0, max_tokens=30)
    assert short.choices[0].finish_reason == "stop"
    k = short.usage.completion_tokens + 6
    long = _chat(client, msgs, temperature=0, max_tokens=30, extra_body={"min_tokens": k})
    assert long.usage.completion_tokens >= k
    ids = engine.chat_template.prompt_ids(msgs)
    ref = engine.generate(ids, SamplingParams(max_tokens=30, min_tokens=k))[0].outputs[0]
    assert long.choices[0].message.content == ref.text
    for body in ({"min_tokens": 31}, {"min_tokens": 2, "use_beam_search": True, "n": 2},
                 {"min_tokens": 2, "response_format": {"type": "json_object"}}):
        status, err = ready.raw("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": msgs, "max_tokens": 30, "temperature": 0, **body})
        assert status == 400 and err["error"]["param"] == "min_tokens", (body, err)


def test_return_token_ids_and_include_stop_str_in_output(ready: Server, engine: Any) -> None:
    """vLLM's ``return_token_ids`` (the prompt's and each choice's token ids, streamed or not)
    and ``include_stop_str_in_output`` (the stop string kept), as the engine gives them."""
    from radixkv import SamplingParams

    text = "The capital of France is Paris. The capital of Italy is"
    ids = engine.encode(text)
    ref = engine.generate(ids, SamplingParams(max_tokens=6))[0].outputs[0]
    status, body = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": text, "max_tokens": 6, "temperature": 0,
        "return_token_ids": True})
    c = body["choices"][0]
    assert status == 200 and c["prompt_token_ids"] == ids and c["token_ids"] == ref.token_ids
    _, plain = ready.raw("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    _, body = ready.raw("POST", "/v1/completions", {   # vLLM's add_special_tokens, as /tokenize
        "model": MODEL, "prompt": text, "max_tokens": 1, "add_special_tokens": False,
        "return_token_ids": True})
    assert body["choices"][0]["prompt_token_ids"] == plain["tokens"]
    msgs = [{"role": "user", "content": "Hi!"}]
    chat_ids = engine.chat_template.prompt_ids(msgs)
    chat_ref = engine.generate(chat_ids, SamplingParams(max_tokens=5))[0].outputs[0]
    status, body = ready.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0,
        "return_token_ids": True})
    assert body["prompt_token_ids"] == chat_ids
    assert body["choices"][0]["token_ids"] == chat_ref.token_ids
    chunks = list(ready.client().chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, temperature=0, stream=True,
        extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == chat_ids
    assert [t for ch in chunks for c in ch.choices
            for t in (c.model_extra or {}).get("token_ids") or []] == chat_ref.token_ids
    # special tokens: left out of the text by default, written with skip_special_tokens false;
    # the stop token that ended the reply (its EOS) only with include_stop_str_in_output too,
    # as in vLLM (its token id is in the answer's ids either way)
    plain = _chat(ready.client(), msgs, max_tokens=30, temperature=0).choices[0].message.content
    written = _chat(ready.client(), msgs, max_tokens=30, temperature=0,
                    extra_body={"skip_special_tokens": False}).choices[0].message.content
    want = engine.generate(chat_ids, SamplingParams(max_tokens=30, skip_special_tokens=False)
                           )[0].outputs[0]
    eos_text = engine.decode(want.token_ids[-1:], skip_special_tokens=False)
    assert want.finish_reason == "stop" and written == want.text and eos_text
    assert not written.endswith(eos_text) and written == plain   # no other special token
    kept = _chat(ready.client(), msgs, max_tokens=30, temperature=0, extra_body={
        "skip_special_tokens": False, "include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == plain + eos_text
    assert _chat(ready.client(), msgs, max_tokens=30, temperature=0, extra_body={
        "include_stop_str_in_output": True}).choices[0].message.content == plain
    # vLLM's spaces_between_special_tokens: accepted; transformers 5 never adds such spaces
    assert _chat(ready.client(), msgs, max_tokens=30, temperature=0, extra_body={
        "skip_special_tokens": False, "spaces_between_special_tokens": False}
    ).choices[0].message.content == written
    # the stop string: cut before it by default, kept on request
    stop = engine.decode(ref.token_ids)[3:6]
    for keep in (False, True):
        r = ready.client().completions.create(
            model=MODEL, prompt=text, max_tokens=6, temperature=0, stop=[stop],
            extra_body={"include_stop_str_in_output": keep})
        assert r.choices[0].text.endswith(stop) == keep, (keep, r.choices[0].text)


def test_template_endings_as_transformers_renders_them(ready: Server, engine: Any) -> None:
    """vLLM's ``add_generation_prompt`` and ``continue_final_message``: the prompt is the one
    ``apply_chat_template`` makes with them (``/tokenize`` and the chat's prompt_tokens), and a
    continued message is what ``/v1/completions`` generates from the same tokens."""
    tok = engine.tokenizer
    msgs = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "My favourite colour is"}]

    def hf(**kw: Any) -> list[int]:
        out = tok.apply_chat_template(msgs, tokenize=True, **kw)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    status, closed = ready.raw("POST", "/tokenize", {
        "model": MODEL, "messages": msgs, "add_generation_prompt": False}, key=None)
    assert status == 200 and closed["tokens"] == hf(add_generation_prompt=False)
    status, open_ = ready.raw("POST", "/tokenize", {
        "model": MODEL, "messages": msgs, "add_generation_prompt": False,
        "continue_final_message": True}, key=None)
    want = hf(continue_final_message=True)
    assert status == 200 and open_["tokens"] == want and want != closed["tokens"]
    assert engine.decode(want).endswith("My favourite colour is")
    client = ready.client()
    cont = _chat(client, msgs, temperature=0, max_tokens=6, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    assert cont.usage.prompt_tokens == len(want)
    ref = client.completions.create(model=MODEL, prompt=want, temperature=0, max_tokens=6)
    assert cont.choices[0].message.content == ref.choices[0].text
    # refused with the field named, nothing run: both endings, a reserved or odd variable,
    # documents with another ending, and the chat-only fields on /v1/completions
    for body, param in (
            ({"continue_final_message": True}, "continue_final_message"),
            ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"a b": 1}}, "chat_template_kwargs"),
            ({"add_generation_prompt": False, "documents": ["some retrieved text"]},
             "documents")):
        status, err = ready.raw("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": msgs, "max_tokens": 1, **body})
        assert status == 400 and err["error"]["param"] == param, (body, err)
    status, err = ready.raw("POST", "/v1/completions", {
        "model": MODEL, "prompt": "x", "max_tokens": 1, "chat_template_kwargs": {"a": 1}})
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs", err


def test_no_endpoint_takes_a_template_from_the_request(ready: Server) -> None:
    """Without --trust-request-chat-template (this server) a request's own Jinja template is
    refused everywhere, whichever field carries it: vLLM 0.16-0.31 let ``/v1/responses`` take
    one in ``chat_template_kwargs`` past its trust flag (CVE-2026-115918: CPU and memory
    exhaustion by rendering), so each way in is checked here with a template that would run
    for ever if rendered (the trusted case: tests/server/test_frontend_options.py)."""
    bomb = "{% for i in range(10**9) %}{{ i }}{% endfor %}"
    msgs = [{"role": "user", "content": "Hi"}]
    for path, body in (
            ("/v1/chat/completions", {"messages": msgs, "chat_template": bomb}),
            ("/tokenize", {"messages": msgs, "chat_template": bomb}),
            ("/v1/chat/completions", {"messages": msgs,
                                      "chat_template_kwargs": {"chat_template": bomb}}),
            ("/v1/responses", {"input": "Hi", "chat_template_kwargs": {"chat_template": bomb}}),
            ("/tokenize", {"messages": msgs, "chat_template_kwargs": {"chat_template": bomb}})):
        t0 = time.monotonic()
        status, err = ready.raw("POST", path, {"model": MODEL, "max_tokens": 1, **body})
        assert status == 400 and err["error"]["param"] in (
            "chat_template", "chat_template_kwargs"), (path, body, err)
        assert time.monotonic() - t0 < 10, path   # refused, not rendered


def test_vllm_endpoints_and_metric_names(ready: Server, engine: Any) -> None:
    """/tokenize, /detokenize, /version, /ping as vLLM answers them, and vLLM's metric names
    beside radixkv's (the same values), so vLLM dashboards work unchanged."""
    text = "The capital of France is"
    status, tok = ready.raw("POST", "/tokenize", {"model": MODEL, "prompt": text}, key=None)
    assert status == 200 and tok["tokens"] == engine.encode(text)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 8192
    msgs = [{"role": "user", "content": "hi"}]
    status, chat = ready.raw("POST", "/tokenize", {"model": MODEL, "messages": msgs}, key=None)
    assert chat["tokens"] == engine.chat_template.prompt_ids(msgs)
    status, de = ready.raw("POST", "/detokenize", {"model": MODEL, "tokens": tok["tokens"]},
                           key=None)
    assert status == 200 and de["prompt"].endswith(text)
    assert ready.raw("POST", "/detokenize", {"tokens": [10**9]}, key=None)[0] == 400
    assert ready.raw("POST", "/tokenize", {"model": "other", "prompt": "x"}, key=None)[0] == 404
    import radixkv

    assert ready.raw("GET", "/version", key=None) == (200, {"version": radixkv.__version__})
    assert ready.raw("GET", "/ping", key=None)[0] == 200

    before = ready.metrics()
    reply = _chat(ready.client(), msgs, temperature=0, max_tokens=2, n=3)
    fams = ready.metrics()
    for vname, rname in (("vllm:prefix_cache_queries", "radixkv_prefix_cache_queries"),
                         ("vllm:prefix_cache_hits", "radixkv_prefix_cache_hits"),
                         ("vllm:num_preemptions", "radixkv_num_preemptions"),
                         ("vllm:prompt_tokens", "radixkv_prompt_tokens"),
                         ("vllm:generation_tokens", "radixkv_generation_tokens")):
        assert _value(fams, vname) == _value(fams, rname), vname
    for vname in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):
        assert fams[vname].type == "gauge"
    counts = {name: [x.value for x in fams[name].samples if x.name.endswith("_count")][0]
              for name in ("vllm:time_to_first_token_seconds",
                           "radixkv_time_to_first_token_seconds")}
    assert counts["vllm:time_to_first_token_seconds"] == \
        counts["radixkv_time_to_first_token_seconds"] > 0
    # one request with n=3 is one success, not three
    total = sum(_value(fams, "radixkv_request_success", finished_reason=r)
                for r in ("stop", "length"))
    total_before = sum(_value(before, "radixkv_request_success", finished_reason=r)
                       for r in ("stop", "length"))
    assert total - total_before == 1
    assert sum(_value(fams, "vllm:request_success", finished_reason=r)
               for r in ("stop", "length")) == total

    # the per-request histograms vLLM's dashboards chart: this request's tokens, n, max_tokens
    # and one observation of each phase (twins under both names)
    def grew(name: str, suffix: str) -> float:
        def get(f: dict) -> float:
            return sum(x.value for x in f[name].samples if x.name == name + suffix)
        return get(fams) - get(before)

    for prefix in ("vllm:", "radixkv_"):
        assert grew(prefix + "request_prompt_tokens", "_sum") == reply.usage.prompt_tokens
        assert grew(prefix + "request_generation_tokens", "_sum") == \
            reply.usage.completion_tokens
        assert grew(prefix + "request_params_n", "_sum") == 3
        assert grew(prefix + "request_params_max_tokens", "_sum") == 2
        # the longest of the three samples (vLLM's: not the parameter)
        longest = grew(prefix + "request_max_num_generation_tokens", "_sum")
        assert longest == 2 if all(c.finish_reason == "length" for c in reply.choices) \
            else 1 <= longest <= 2
        for phase in ("queue", "prefill", "decode", "inference"):
            name = f"{prefix}request_{phase}_time_seconds"
            assert grew(name, "_count") == 1 and grew(name, "_sum") >= 0, name
        assert grew(f"{prefix}request_inference_time_seconds", "_sum") >= \
            grew(f"{prefix}request_prefill_time_seconds", "_sum")


def test_reset_prefix_cache_drops_what_no_request_holds(ready: Server) -> None:
    """vLLM's ``POST /reset_prefix_cache`` (served with ``--enable-cache-reset``, behind the API
    key): a repeated prompt is cached before it and cold after it, with the same answer."""
    client = ready.client()
    msgs = [{"role": "user", "content": "Name three rivers of Europe, briefly. " * 4}]
    first = _chat(client, msgs, temperature=0, max_tokens=6)
    again = _chat(client, msgs, temperature=0, max_tokens=6)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert ready.raw("POST", "/reset_prefix_cache", key=None)[0] == 401
    status, body = ready.raw("POST", "/reset_prefix_cache")
    assert status == 200 and body["dropped_blocks"] >= again.usage.prompt_tokens // 16
    cold = _chat(client, msgs, temperature=0, max_tokens=6)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == first.choices[0].message.content
    assert ready.raw("POST", "/reset_prefix_cache")[1]["dropped_blocks"] > 0   # cold's own


# ----------------------------------------------------------------------------- Responses API

def _responses_chat(ready: Server, messages: list, **kw: Any) -> Any:
    return ready.client().chat.completions.create(model=MODEL, messages=messages,
                                                  temperature=0, **kw)


@pytest.mark.model
def test_responses_is_the_chat_reply_and_continues_from_the_store(ready: Server) -> None:
    """``/v1/responses``: instructions + input give the chat completion's reply (greedy, same
    messages); ``previous_response_id`` continues the stored conversation (the next reply is
    the chat reply to the whole history, its prompt mostly cached); the stored response reads
    back with ``GET``, is another API key's 404, and is gone after ``DELETE``."""
    client = ready.client()
    first = client.responses.create(model=MODEL, instructions="Answer briefly.",
                                    input="Name a colour.", max_output_tokens=12,
                                    temperature=0)
    history = [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "Name a colour."}]
    chat = _responses_chat(ready, history, max_tokens=12)
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.output_text == chat.choices[0].message.content
    [item] = first.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == chat.usage.completion_tokens
    assert first.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                            else "completed")
    # the next turn: only the new input; instructions are not carried over (OpenAI's rule),
    # so a client that keeps them sends them again (as the Agents SDK does)
    history += [{"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And another?"}]
    for instructions, messages in ((None, history[1:]), ("Answer briefly.", history)):
        second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                         input=[{"role": "user", "content": "And another?"}],
                                         instructions=instructions, max_output_tokens=8,
                                         temperature=0)
        chat2 = _responses_chat(ready, messages, max_tokens=8)
        assert second.output_text == chat2.choices[0].message.content
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == chat2.usage.prompt_tokens
    # the first turn's blocks: the continuation's prompt starts with the first turn's
    assert second.usage.input_tokens_details.cached_tokens >= 32
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    other = ready.client(KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as exc:
        other.responses.create(model=MODEL, previous_response_id=first.id, input="x",
                               max_output_tokens=1)
    assert exc.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unsaved = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unsaved.id)


@pytest.mark.model
def test_responses_streamed_events_assemble_the_non_streamed_response(ready: Server) -> None:
    """The streamed event sequence (created, in_progress, the message item and its part
    added, text deltas, their done events, item done, completed; numbered in order) carries
    the non-streamed text, and the SDK's ``responses.stream()`` helper assembles the same
    response; ``max_output_tokens`` reached is ``incomplete``."""
    client = ready.client()
    kw = {"model": MODEL, "input": "Write a sentence about the sea.", "max_output_tokens": 10,
          "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    status, raw = ready.raw("POST", "/v1/responses", {**kw, "stream": True})
    assert status == 200 and '"_text"' not in raw and "[DONE]" not in raw   # OpenAI sends none
    assert raw.count("\nevent: ") + raw.startswith("event: ") == len(events)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text
    final = events[-1].response
    assert final.status == whole.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == whole.output_text and final.usage.output_tokens == 10
    # the SDK's helper assembles a completed response (it has no final response for an
    # incomplete one, whatever the server); a choice ends the reply early
    short = {**kw, "extra_body": {"structured_outputs": {"choice": ["calm", "rough"]}}}
    alone = client.responses.create(**short)
    with client.responses.stream(**short) as stream:
        kinds = [e.type for e in stream]
        done = stream.get_final_response()
    assert kinds[-1] == "response.completed" and done.status == alone.status == "completed"
    assert done.output_text == alone.output_text in ("calm", "rough")
    # a streamed response is stored too, and continues like any other
    follow = client.responses.create(model=MODEL, previous_response_id=final.id, input="More.",
                                     max_output_tokens=2, temperature=0)
    chat = _responses_chat(ready, [{"role": "user", "content": kw["input"]},
                                   {"role": "assistant", "content": final.output_text},
                                   {"role": "user", "content": "More."}], max_tokens=2)
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == chat.choices[0].message.content
    assert follow.usage.input_tokens_details.cached_tokens >= 16


@pytest.mark.model
def test_responses_structured_output_and_refusals(ready: Server) -> None:
    """``text.format`` json_schema is enforced like chat's ``response_format``; what radixkv
    does not implement is a 400 naming the field, never ignored."""
    client = ready.client()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Give a number.", max_output_tokens=40,
                                temperature=0,
                                text={"format": {"type": "json_schema", "name": "num",
                                                 "schema": schema}})
    assert set(json.loads(r.output_text)) == {"n"}
    refused = [({"background": True, "store": False}, "background"),
               ({"include": ["file_search_call.results"]}, "include"),
               ({"tools": [{"type": "web_search"}]}, "tools"),
               ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                         "image_url": "x"}]}]}, "input"),
               ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
               # an effort is chat's reasoning_effort: this model's template has no switch
               ({"reasoning": {"effort": "high"}}, "reasoning_effort"),
               ({"reasoning": {"summary": "concise"}}, "reasoning"),
               # vLLM's fields: a chosen id (ids key the shared store), harmony views, and
               # those the chat request refuses
               ({"request_id": "resp_mine"}, "request_id"),
               ({"enable_response_messages": True}, "enable_response_messages"),
               ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
               ({"kv_transfer_params": {"x": 1}}, "kv_transfer_params"),
               ({"truncation": "some"}, "truncation"), ({"max_output_tokens": 0},
                                                        "max_output_tokens"),
               ({"max_tool_calls": -1}, "max_tool_calls"),
               ({"tool_choice": "required"}, "tool_choice"),
               ({"previous_response_id": "resp_nothing"}, "previous_response_id")]
    for extra, param in refused:
        status, err = ready.raw("POST", "/v1/responses", {"model": MODEL, "input": "hi",
                                                          "max_output_tokens": 2, **extra})
        assert status == 400 and err["error"]["param"] == param, (extra, err)
    status, err = ready.raw("POST", "/v1/responses", {"model": MODEL, "input": "hi"}, key=None)
    assert status == 401


@pytest.mark.model
def test_truncation_auto_drops_the_earliest_turns_that_do_not_fit(ready: Server) -> None:
    """``truncation: "auto"``: a conversation past the context loses its earliest whole turns,
    the fewest that make the prompt and ``max_output_tokens`` fit (instructions and developer
    messages stay); the reply is the chat completion of what is left. ``disabled`` (the
    default) is the 400 it was."""
    client = ready.client()
    limit = client.models.list().data[0].model_extra["max_model_len"]
    big = "word " * (limit * 7 // 8)     # one turn of about 7/8 of the context
    mid = "note " * (limit // 4)          # fits beside the rest, not beside the big one
    convo = [{"role": "user", "content": big}, {"role": "assistant", "content": "Noted."},
             {"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": mid}, {"role": "assistant", "content": "Noted too."},
             {"role": "user", "content": "Name a colour."}]
    kw = dict(model=MODEL, input=convo, instructions="Be brief.", max_output_tokens=4,
              temperature=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(**kw)
    assert exc.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(**kw, truncation="auto")
    assert r.truncation == "auto"
    assert client.responses.create(**kw, truncation="auto", max_tool_calls=2).max_tool_calls == 2
    left = [{"role": "system", "content": "Be brief."}, convo[2], *convo[3:]]
    chat = _responses_chat(ready, left, max_tokens=4)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    # the last turn alone past the context: the same 400 as without truncation
    status, err = ready.raw("POST", "/v1/responses", {**kw, "truncation": "auto",
                                                      "input": [convo[0], {
                                                          "role": "user",
                                                          "content": "word " * limit}]})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err


@pytest.mark.model
def test_conversations_hold_the_history_responses_continue(ready: Server) -> None:
    """``/v1/conversations``: a conversation created with its first item; responses run in it
    answer its items as their history (equal to the chat completion of those messages, the
    earlier turn's prompt from the cache) and append their input and output; items are listed
    in pages, read, added and deleted; metadata updated; per API key; deleted: gone."""
    client = ready.client()
    conv = client.conversations.create(items=[{"type": "message", "role": "user",
                                               "content": "My name is Ada."}],
                                       metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    one = client.responses.create(model=MODEL, conversation=conv.id, input="Hello!",
                                  max_output_tokens=8, temperature=0)
    assert one.conversation.id == conv.id
    msgs = [{"role": "user", "content": "My name is Ada."}, {"role": "user", "content": "Hello!"}]
    chat = _responses_chat(ready, msgs, max_tokens=8)
    assert one.output_text == chat.choices[0].message.content
    two = client.responses.create(model=MODEL, conversation={"id": conv.id},
                                  input="What is my name?", max_output_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": one.output_text},
             {"role": "user", "content": "What is my name?"}]
    chat = _responses_chat(ready, msgs, max_tokens=8)
    assert two.output_text == chat.choices[0].message.content
    assert two.usage.input_tokens == chat.usage.prompt_tokens
    assert two.usage.input_tokens_details.cached_tokens >= 16   # the first turn's prompt
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", r) for r in (
        "user", "user", "assistant", "user", "assistant")]
    assert items[2].content[0].text == one.output_text and items[2].id == one.output[0].id
    desc = client.conversations.items.list(conv.id, limit=2)
    assert [i.id for i in desc.data] == [items[4].id, items[3].id] and desc.has_more
    assert client.conversations.items.retrieve(items[1].id,
                                               conversation_id=conv.id).content[0].text == \
        "Hello!"
    added = client.conversations.items.create(conv.id, items=[
        {"role": "user", "content": "Thanks."}])
    assert [i.content[0].text for i in added.data] == ["Thanks."]
    client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert len(client.conversations.items.list(conv.id).data) == 5
    # streamed and background turns join it too, once they end
    events = list(client.responses.create(model=MODEL, conversation=conv.id, input="Again?",
                                          max_output_tokens=3, temperature=0, stream=True))
    bg = client.responses.create(model=MODEL, conversation=conv.id, input="Once more?",
                                 max_output_tokens=3, temperature=0, background=True)
    _until_done(client, bg.id)
    texts = [i.content[0].text for i in client.conversations.items.list(conv.id, limit=4).data]
    assert texts[1::2] == ["Once more?", "Again?"], texts
    assert texts[2] == events[-1].response.output_text
    assert client.conversations.update(conv.id, metadata={"topic": "x"}).metadata == \
        {"topic": "x"}
    with pytest.raises(openai.NotFoundError):
        ready.client(KEY_B).conversations.retrieve(conv.id)
    status, err = ready.raw("POST", "/v1/responses", {"model": MODEL, "input": "x",
                                                      "conversation": conv.id,
                                                      "previous_response_id": one.id})
    assert status == 400 and err["error"]["param"] == "conversation", err
    for body, param in (({"items": [{"type": "item_reference", "id": "x"}]}, "items"),
                        ({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
                        ({"metadata": {"k": 1}}, "metadata")):
        status, err = ready.raw("POST", "/v1/conversations", body)
        assert status == 400 and err["error"]["param"] == param, (body, err)
    assert client.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    status, err = ready.raw("POST", "/v1/responses", {"model": MODEL, "input": "x",
                                                      "conversation": conv.id})
    assert status == 400 and err["error"]["param"] == "conversation", err


def test_a_conversation_runs_one_response_at_a_time(ready: Server) -> None:
    """While a response runs in a conversation, another response in it, and adding or deleting
    its items, are a 400 ``conversation_locked`` naming ``conversation`` (OpenAI's answer): they
    would answer, or change, a history the running response is about to extend. The lock goes
    however the response ends: streamed to the end, its client gone mid-stream, a background
    run cancelled; a response that fails validation never holds it."""
    client = ready.client()
    conv = client.conversations.create(items=[{"role": "user", "content": "Count to fifty."}])
    long = dict(model=MODEL, conversation=conv.id, max_output_tokens=400, temperature=0,
                extra_body={"ignore_eos": True})

    def locked(what: str) -> None:
        item = client.conversations.items.list(conv.id).data[0].id
        for method, path, body in (
                ("POST", "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2,
                                           "conversation": conv.id}),
                ("POST", f"/v1/conversations/{conv.id}/items",
                 {"items": [{"role": "user", "content": "x"}]}),
                ("DELETE", f"/v1/conversations/{conv.id}/items/{item}", None)):
            status, err = ready.raw(method, path, body)
            assert status == 400 and err["error"]["code"] == "conversation_locked" \
                and err["error"]["param"] == "conversation", (what, method, path, err)

    def free(what: str) -> None:
        deadline = time.monotonic() + 60   # a client's disconnect is seen at the next token
        while True:
            status, body = ready.raw("POST", "/v1/responses", {
                "model": MODEL, "input": "And?", "max_output_tokens": 2,
                "conversation": conv.id})
            if status == 200:
                assert body["status"] in ("completed", "incomplete"), (what, body)
                return
            assert body["error"]["code"] == "conversation_locked", (what, body)
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    # long enough to outlast locked()'s three requests, short enough to run to its end soon
    stream = client.responses.create(**{**long, "max_output_tokens": 120}, input="Go on.",
                                     stream=True)
    next(iter(stream))                       # response.created: it runs
    locked("a streamed response")
    events = list(stream)
    assert events[-1].type == "response.incomplete", events[-1]   # max_output_tokens
    free("the stream's end")
    # validation failures take no lock and leave none
    status, err = ready.raw("POST", "/v1/responses", {"model": MODEL, "input": "x",
                                                      "conversation": conv.id,
                                                      "background": True, "store": False})
    assert status == 400 and err["error"]["param"] == "background", err
    free("a refused request")
    gone = client.responses.create(**long, input="Again.", stream=True)
    next(iter(gone))
    locked("a stream whose client goes away")
    gone.close()
    free("the client's disconnect")
    bg = client.responses.create(**long, input="Once more.", background=True)
    locked("a background response")
    client.responses.cancel(bg.id)
    _until_done(client, bg.id)
    free("the cancel")


def test_a_conversation_past_its_size_bound_takes_no_more(ready: Server) -> None:
    """``--max-conversation-bytes`` (16 KiB here): items that would take a conversation past
    it are a 400 ``conversation_too_large`` naming ``items`` and nothing is added; a response's
    turn is recorded whole, after which a response in it is the same 400 naming
    ``conversation`` until items are deleted; a ``previous_response_id`` chain past it is the
    400 naming ``previous_response_id``. Before, a key could grow one without bound."""
    client = ready.client()
    big = {"role": "user", "content": "-" * 7000}   # few tokens: runs of '-' merge
    conv = client.conversations.create(items=[big])

    def refused(method: str, path: str, body: dict[str, Any], param: str) -> None:
        status, err = ready.raw(method, path, body)
        assert status == 400 and err["error"]["code"] == "conversation_too_large" \
            and err["error"]["param"] == param, err

    refused("POST", f"/v1/conversations/{conv.id}/items", {"items": [big, big]}, "items")
    assert len(client.conversations.items.list(conv.id).data) == 1
    client.conversations.items.create(conv.id, items=[big])
    answer = dict(model=MODEL, max_output_tokens=2, temperature=0)
    client.responses.create(**answer, conversation=conv.id, input="-" * 3000)
    items = client.conversations.items.list(conv.id, order="asc").data
    assert len(items) == 4   # the turn ran and was kept, past the bound
    refused("POST", "/v1/responses", {**answer, "input": "x", "conversation": conv.id},
            "conversation")
    refused("POST", "/v1/conversations", {"items": [big, big, big]}, "items")
    client.conversations.items.delete(items[0].id, conversation_id=conv.id)
    assert client.responses.create(**answer, conversation=conv.id, input="Hi").status in (
        "completed", "incomplete")
    first = client.responses.create(**answer, input="-" * (CONVERSATION_BYTES + 100))
    refused("POST", "/v1/responses", {**answer, "input": "x",
                                      "previous_response_id": first.id},
            "previous_response_id")


def _until_done(client: Any, rid: str) -> Any:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        time.sleep(0.05)
    raise AssertionError(f"response {rid} still {r.status}")


@pytest.mark.model
def test_background_responses_are_polled_followed_and_replayed(ready: Server) -> None:
    """``background: true``: the POST answers at once (``queued``); the response is generated
    apart from the request, polled with ``GET`` (the output growing), and equals the
    foreground answer. Created with ``stream``, its events can be dropped and followed again
    from any ``starting_after``, and replayed whole once it ended."""
    client = ready.client()
    kw = dict(model=MODEL, input="Tell me about the sea.", max_output_tokens=24, temperature=0)
    fore = client.responses.create(**kw)
    r = client.responses.create(**kw, background=True)
    assert r.status == "queued" and r.background is True and r.output == []
    g = _until_done(client, r.id)
    assert (g.status, g.output_text) == (fore.status, fore.output_text), g
    assert g.usage.output_tokens == fore.usage.output_tokens == 24
    # streamed: leave after a few events; the run goes on and is followed to its end
    stream = client.responses.create(**kw, background=True, stream=True)
    head = []
    for e in stream:
        head.append(e)
        if len(head) == 6:
            break
    stream.close()
    assert [e.type for e in head[:3]] == ["response.created", "response.queued",
                                          "response.in_progress"]
    assert head[0].response.status == "queued"
    rid = head[0].response.id
    rest = list(client.responses.retrieve(rid, stream=True,
                                          starting_after=head[-1].sequence_number))
    numbers = [e.sequence_number for e in head + rest]
    assert numbers == list(range(len(numbers))), numbers
    assert rest[-1].type == "response.incomplete"
    assert rest[-1].response.output[0].content[0].text == fore.output_text
    replay = list(client.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in head + rest]
    # what GET ?stream cannot replay, and what background needs
    status, err = ready.raw("GET", f"/v1/responses/{r.id}?stream=true")
    assert status == 400 and err["error"]["param"] == "stream", err
    status, err = ready.raw("GET", f"/v1/responses/{rid}?stream=true&starting_after=-2")
    assert status == 400 and err["error"]["param"] == "starting_after", err
    other = ready.client(KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(rid)


@pytest.mark.model
def test_cancelling_a_background_response_frees_the_engine(ready: Server) -> None:
    """``POST /v1/responses/{id}/cancel``: a running background response stops (its engine
    request aborted, its blocks freed), keeps the output it had, and is ``cancelled``
    (again: the same); a continuation of a running response is a 400, as is cancelling a
    foreground or finished one. A follower of the stream gets an ``error`` event."""
    client = ready.client()
    long = dict(model=MODEL, input="Write a long story about a lighthouse.",
                max_output_tokens=2000, temperature=0, background=True,
                extra_body={"ignore_eos": True})
    r = client.responses.create(**long, stream=True)
    first = next(iter(r))
    rid = first.response.id
    deadline = time.monotonic() + 60
    while not (now := client.responses.retrieve(rid)).output_text:   # the output grows
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    assert now.status == "in_progress" and _held_blocks(ready.metrics()) > 0
    status, err = ready.raw("POST", "/v1/responses", {"model": MODEL, "input": "more",
                                                      "previous_response_id": rid})
    assert status == 400 and err["error"]["param"] == "previous_response_id", err
    gone = client.responses.cancel(rid)
    assert gone.status == "cancelled" and 0 < len(gone.output_text), gone
    assert client.responses.retrieve(rid).status == "cancelled"
    assert client.responses.cancel(rid).status == "cancelled"
    tail = list(r)
    assert tail[-1].type == "error" and tail[-1].code == "response_cancelled", tail[-1]
    _released(ready, "the cancel")
    done = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                   background=True)
    _until_done(client, done.id)
    fore = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for rid_ in (done.id, fore.id):
        status, err = ready.raw("POST", f"/v1/responses/{rid_}/cancel")
        assert status == 400 and err["error"]["param"] == "response_id", err
    assert ready.raw("POST", "/v1/responses/resp_nothing/cancel")[0] == 404


@pytest.mark.model
def test_input_items_list_what_a_response_answered(ready: Server) -> None:
    """``GET /v1/responses/{id}/input_items``: the conversation a response answered (earlier
    turns' input and replies, then its own input; instructions apart), newest first by
    default, in pages (``limit``, ``after``); function calls and their outputs as their own
    items (tests/server/test_tool_calls.py)."""
    client = ready.client()
    one = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4,
                                  temperature=0, instructions="Be brief.")
    two = client.responses.create(model=MODEL, previous_response_id=one.id, temperature=0,
                                  max_output_tokens=4, input=[
                                      {"role": "user", "content": "Why that one?"},
                                      {"role": "assistant", "content": "It is calm."},
                                      {"role": "user", "content": "And another?"}])
    items = client.responses.input_items.list(two.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", r) for r in (
        "user", "assistant", "user", "assistant", "user")]
    assert items[0].content[0].text == "Name a colour."
    assert items[1].content[0].text == one.output_text
    assert items[1].content[0].type == "output_text" and items[0].content[0].type == "input_text"
    assert [i.content[0].text for i in items[2:]] == ["Why that one?", "It is calm.",
                                                      "And another?"]
    desc = client.responses.input_items.list(two.id).data
    assert [i.id for i in desc] == [i.id for i in reversed(items)]
    page = client.responses.input_items.list(two.id, order="asc", limit=2)
    assert [i.id for i in page.data] == [i.id for i in items[:2]] and page.has_more
    page2 = client.responses.input_items.list(two.id, order="asc", limit=2, after=page.last_id)
    assert [i.id for i in page2.data] == [i.id for i in items[2:4]]
    assert [i.type for i in client.responses.input_items.list(one.id).data] == ["message"]
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=x", "after")):
        status, err = ready.raw("GET", f"/v1/responses/{two.id}/input_items?{query}")
        assert status == 400 and err["error"]["param"] == param, (query, err)
    with pytest.raises(openai.NotFoundError):
        ready.client(KEY_B).responses.input_items.list(two.id)


@pytest.mark.model
def test_tokens_as_token_ids_and_right_truncation(ready: Server, engine: Any) -> None:
    """vLLM's ``return_tokens_as_token_ids`` (RL pipelines' form: each logprob token named
    ``token_id:N``, the values and text offsets unchanged; chat, completions, streamed, echo,
    prompt_logprobs) and ``truncation_side: "right"`` (``truncate_prompt_tokens`` keeps the
    first k tokens)."""
    client = ready.client()
    prompt = "The capital of France is"
    ids = engine.encode(prompt)
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**kw).choices[0]
    named = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True})
    out = named.choices[0]
    assert out.text == plain.text and out.logprobs.text_offset == plain.logprobs.text_offset
    # (the second request reads the first's prompt from the cache: the same values to
    # float32 rounding, not bit for bit)
    assert out.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs,
                                                        abs=1e-4)
    gen = [int(t.split(":")[1]) for t in out.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in out.logprobs.tokens)
    assert engine.decode(gen) == plain.text
    for top, ref in zip(out.logprobs.top_logprobs, plain.logprobs.top_logprobs):
        assert sorted(top.values()) == pytest.approx(sorted(ref.values()), abs=1e-4)
        assert all(k.startswith("token_id:") for k in top)
    streamed = [t for ch in client.completions.create(
        **kw, stream=True, extra_body={"return_tokens_as_token_ids": True})
        for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == out.logprobs.tokens
    echo = client.completions.create(**{**kw, "max_tokens": 1}, echo=True, extra_body={
        "return_tokens_as_token_ids": True}).choices[0]
    assert echo.logprobs.tokens[:len(ids)] == [f"token_id:{t}" for t in ids]
    status, got = ready.raw("POST", "/v1/completions", {
        **kw, "max_tokens": 1, "prompt_logprobs": 0, "return_tokens_as_token_ids": True})
    first = got["choices"][0]["prompt_logprobs"][1]
    assert status == 200 and first[str(ids[1])]["decoded_token"] == f"token_id:{ids[1]}"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True}).choices[0]
    toks = [e.token for e in chat.logprobs.content]
    assert all(t.startswith("token_id:") for t in toks)
    assert engine.decode([int(t.split(":")[1]) for t in toks]) == chat.message.content
    # truncation_side: the first k tokens (vLLM's "right"), or the last k (the default)
    for side, kept in (("right", ids[:3]), ("left", ids[-3:]), (None, ids[-3:])):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0,
                "truncate_prompt_tokens": 3, **({"truncation_side": side} if side else {})}
        status, got = ready.raw("POST", "/v1/completions", body)
        want = client.completions.create(model=MODEL, prompt=kept, max_tokens=2, temperature=0)
        assert status == 200 and got["usage"]["prompt_tokens"] == 3, got
        assert got["choices"][0]["text"] == want.choices[0].text, side
    status, err = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "x",
                                                        "truncation_side": "middle"})
    assert status == 400 and err["error"]["param"] == "truncation_side"


@pytest.mark.model
def test_logprob_token_ids_list_those_tokens_each_step(ready: Server, engine: Any) -> None:
    """vLLM's ``logprob_token_ids`` (a classifier's label set): each generated token's entry
    lists those tokens' log-probabilities in the order given, the in-process engine's values
    (float32 on both sides); chat and completions; refused beside ``top_logprobs`` and for a
    token outside the vocabulary."""
    from radixkv import SamplingParams

    yes, no = engine.encode(" yes")[-1], engine.encode(" no")[-1]
    prompt = "Is water wet? Answer:"
    [ref] = engine.generate(prompt, SamplingParams(max_tokens=2, logprob_token_ids=[yes, no]))
    want = [[v for _, v in e.top] for e in ref.outputs[0].logprobs]
    client = ready.client()
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"logprob_token_ids": [yes, no]}).choices[0]
    assert len(c.logprobs.top_logprobs) == len(want) >= 1
    for got, vals in zip(c.logprobs.top_logprobs, want):
        assert list(got) == [engine.decode([yes]), engine.decode([no])]
        assert list(got.values()) == pytest.approx(vals, abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=2,
        temperature=0, logprobs=True, extra_body={"logprob_token_ids": [no, yes],
                                                  "return_tokens_as_token_ids": True})
    for e in chat.choices[0].logprobs.content:
        assert [t.token for t in e.top_logprobs] == [f"token_id:{no}", f"token_id:{yes}"]
    for extra, param in (({"logprob_token_ids": [yes], "logprobs": 2}, "logprob_token_ids"),
                         ({"logprob_token_ids": [10**7]}, "logprob_token_ids"),
                         ({"logprob_token_ids": []}, "logprob_token_ids")):
        status, err = ready.raw("POST", "/v1/completions", {"model": MODEL, "prompt": "x",
                                                            "max_tokens": 1, **extra})
        assert status == 400 and err["error"]["param"] == param, (extra, err)


@pytest.mark.model
def test_stream_interval_joins_tokens_into_fewer_chunks(ready: Server) -> None:
    """vLLM's ``stream_interval``: after the first token (sent at once) each chunk carries
    that many tokens, the last one what is left; text, logprobs and token ids assemble to the
    non-streamed answer; each choice of ``n`` on its own."""
    client = ready.client()
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 17, "temperature": 0,
          "logprobs": 1}
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(**kw, extra_body=extra).choices[0]
    parts = [c for ch in client.completions.create(
        **kw, stream=True, extra_body={**extra, "stream_interval": 5}) for c in ch.choices]
    sized = [c for c in parts if c.logprobs and c.logprobs.tokens]
    assert [len(c.logprobs.tokens) for c in sized] == [1, 5, 5, 5, 1]
    assert "".join(c.text for c in parts) == whole.text
    assert [t for c in sized for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert [t for c in parts for t in (c.model_extra.get("token_ids") or [])] == \
        whole.model_extra["token_ids"]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=9,
        temperature=0, n=2, stream=True, extra_body={"stream_interval": 4, "ignore_eos": True,
                                                     "return_token_ids": True}))
    for i in (0, 1):
        ids = [len(c.model_extra["token_ids"]) for ch in chunks for c in ch.choices
               if c.index == i and c.model_extra.get("token_ids")]
        assert ids == [1, 4, 4], ids
    status, err = ready.raw("POST", "/v1/completions", {**kw, "stream": True,
                                                        "stream_interval": 0})
    assert status == 400 and err["error"]["param"] == "stream_interval"


@pytest.mark.model
def test_responses_output_text_logprobs(ready: Server) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the message's
    text tokens with their log-probabilities and alternatives, the chat completion's entries
    for the same messages (greedy), streamed on the text deltas too; ``top_logprobs`` alone
    is a 400."""
    client = ready.client()
    kw = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 6, "temperature": 0,
          "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = client.responses.create(**kw)
    lps = r.output[0].content[0].logprobs
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2).choices[0]
    assert "".join(e.token for e in lps) == r.output_text == chat.message.content
    assert [e.logprob for e in lps] == pytest.approx(
        [e.logprob for e in chat.logprobs.content], abs=1e-4)
    assert all(len(e.top_logprobs) == 2 for e in lps)
    events = list(client.responses.create(stream=True, **kw))
    streamed = [e for ev in events if ev.type == "response.output_text.delta"
                for e in ev.logprobs]
    assert [e.token for e in streamed] == [e.token for e in lps]
    assert [e.token for e in events[-1].response.output[0].content[0].logprobs] == \
        [e.token for e in lps]
    status, err = ready.raw("POST", "/v1/responses", {"model": MODEL, "input": "hi",
                                                      "top_logprobs": 2})
    assert status == 400 and err["error"]["param"] == "top_logprobs"


@pytest.mark.model
def test_batched_chat_answers_each_conversation_as_alone(ready: Server) -> None:
    """vLLM's ``/v1/chat/completions/batch``: a choice per conversation (``index`` its place),
    each the answer the conversation gets alone (greedy), the usage summed; vLLM's limits
    (no stream, tools, beam search or n > 1) and a bad conversation are 400s naming the
    field, and nothing is served for them."""
    system = {"role": "system", "content": "You answer in one short sentence."}
    convs = [[system, {"role": "user", "content": "Name a fruit."}],
             [system, {"role": "user", "content": "Name a river."}],
             [{"role": "user", "content": "Say hi."}]]
    status, batch = ready.raw("POST", "/v1/chat/completions/batch", {
        "model": MODEL, "messages": convs, "max_tokens": 6, "temperature": 0})
    assert status == 200, batch
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    alone = [ready.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": conv, "max_tokens": 6, "temperature": 0})[1]
        for conv in convs]
    for got, want in zip(batch["choices"], alone):
        assert got["message"] == want["choices"][0]["message"]
        assert got["finish_reason"] == want["choices"][0]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone), key
    for extra, param in (({"stream": True}, "stream"), ({"n": 2}, "n"),
                         ({"use_beam_search": True}, "use_beam_search"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                          "tools"),
                         ({"messages": [convs[0], []]}, "messages"),
                         ({"messages": convs[0]}, "messages"),
                         ({"messages": [convs[0], [{"role": "robot", "content": "x"}]]},
                          "messages"),
                         ({"model": "other"}, "model")):
        status, err = ready.raw("POST", "/v1/chat/completions/batch", {
            "model": MODEL, "messages": convs, "max_tokens": 2, **extra})
        assert status in (400, 404) and err["error"]["param"] == param, (extra, err)
    # a conversation refused while the others are served refuses the batch, naming it
    huge = [{"role": "user", "content": "word " * 20_000}]
    status, err = ready.raw("POST", "/v1/chat/completions/batch", {
        "model": MODEL, "messages": [convs[0], huge], "max_tokens": 2})
    assert status == 400 and err["error"]["message"].startswith("conversation 1: "), err
    assert err["error"]["code"] == "context_length_exceeded", err


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(ready: Server) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): each chunk
    has the prompt's tokens and those generated so far (and from the first token on its cache
    split: ``prompt_tokens_details.cached_tokens``), the last usage chunk the whole usage;
    without it only that last chunk has one (before 2026-12-07 the option was ignored)."""
    def usages(**opts: Any) -> list[Any]:
        return [c.usage for c in ready.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Count to ten."}],
            max_tokens=6, temperature=0, stream=True, n=2,
            stream_options={"include_usage": True, **opts})]

    seen = usages(continuous_usage_stats=True)
    assert all(u is not None for u in seen)
    counts = [u.completion_tokens for u in seen]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 12, counts
    assert {u.prompt_tokens for u in seen} == {seen[-1].prompt_tokens}
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in seen)
    # from the first token on, the prompt's cache split too (the role chunk comes before it)
    assert seen[0].prompt_tokens_details is None
    assert {u.prompt_tokens_details.cached_tokens for u in seen[1:]} == {
        seen[-1].prompt_tokens_details.cached_tokens}
    plain = usages()
    assert all(u is None for u in plain[:-1]) and plain[-1].completion_tokens == 12


def test_a_batched_chat_whose_client_left_is_aborted(ready: Server) -> None:
    """The batched chat watches its client once for all its conversations: the client going
    away aborts every conversation's request and frees their blocks."""
    assert _held_blocks(ready.metrics()) == 0
    conn = http.client.HTTPConnection("127.0.0.1", ready.port, timeout=120)
    conv = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    conn.request("POST", "/v1/chat/completions/batch", json.dumps({
        "model": MODEL, "messages": [conv, conv + [{"role": "user", "content": "Go on."}]],
        "max_tokens": 2000, "temperature": 0, "ignore_eos": True}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY_A}"})
    deadline = time.monotonic() + 60
    while _value(ready.metrics(), "radixkv_num_requests_running") < 2:
        assert time.monotonic() < deadline, "the batch's requests did not start"
        time.sleep(0.05)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    _released(ready, "the batch's client left", timeout=15)
