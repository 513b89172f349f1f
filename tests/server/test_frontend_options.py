"""vLLM's frontend flags (radixkv/server/frontend.py) on the real server: ``radixkv serve`` as a
subprocess on 127.0.0.1 with all of them, driven by the official ``openai`` client and plain
HTTP. One server for the module; unit tests of the options need none."""

from __future__ import annotations

import copy
import http.client
import json
import os
import threading
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from radixkv.errors import ConfigError  # noqa: E402
from radixkv.server.frontend import FrontendOptions, parse_template_kwargs  # noqa: E402
from tests.server.test_openai_server import (MODEL, Server, running_server,  # noqa: E402
                                             stop_process)

# ChatML (the embedded model's format) with one variable of its own, so that what the template
# was given shows in the prompt's tokens.
TEMPLATE = (
    "{%- if probe_word is defined %}{{ '<|im_start|>system\\nprobe ' + probe_word + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    # a reasoning switch, as Qwen3's templates read it (only reasoning_effort's tests set it)
    "{%- if enable_thinking is defined %}{{ '[thinking ' ~ enable_thinking ~ ' effort ' ~ "
    "reasoning_effort ~ ']' }}{%- endif %}")
HI = [{"role": "user", "content": "Say hi."}]
KEY = "fe-key"
ROOT = "/llm"          # --root-path
KEEP_ALIVE_S = 0.2     # --sse-keep-alive-interval
ORIGIN = "https://chat.example"   # --allowed-origins
TOKENIZER_MARK = 12345            # model_max_length of the --tokenizer copy


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tpl = tmp_path_factory.mktemp("tpl") / "chatml_probe.jinja"
    tpl.write_text(TEMPLATE)
    # --tokenizer: the embedded model's tokenizer from another directory, marked
    from radixkv import models

    tok_dir = tmp_path_factory.mktemp("tokenizer")
    tok = copy.deepcopy(models.load_tokenizer())   # the cached one is the process's
    tok.model_max_length = TOKENIZER_MARK
    tok.save_pretrained(str(tok_dir))
    args = ["--threads", "1", "--device", "cpu", "--device-blocks", "256", "--dtype", "float32",
            "--max-num-seqs", "1",   # a second stream waits (keep-alive)
            "--chat-template", str(tpl), "--root-path", ROOT, "--tokenizer", str(tok_dir),
            "--served-model-name", MODEL, "alias-one",
            "--sse-keep-alive-interval", str(KEEP_ALIVE_S),
            "--allowed-origins", json.dumps([ORIGIN]), "--allow-credentials",
            "--enable-request-id-headers",
            "--default-chat-template-kwargs", json.dumps({"probe_word": "zebra"}),
            "--response-role", "helper",
            "--return-tokens-as-token-ids",
            "--enable-force-include-usage",
            "--enable-server-load-tracking",
            "--disable-fastapi-docs",
            "--disable-uvicorn-access-log",
            "--trust-request-chat-template", "--enable-tokenizer-info-endpoint",
            "--enable-prompt-tokens-details"]   # accepted: always reported
    # the key as a vLLM deployment sets it: the environment, no --api-key (the CORS and
    # root-path tests check that requests without it are refused)
    old = os.environ.get("VLLM_API_KEY")
    os.environ["VLLM_API_KEY"] = KEY
    try:
        with running_server(args) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("VLLM_API_KEY", None)
        else:
            os.environ["VLLM_API_KEY"] = old


def _http(srv: Server, method: str, path: str, body: Any = None,
          headers: dict[str, str] | None = None, key: str | None = KEY
          ) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json", **auth, **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()
    try:
        return r.status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return r.status, hdrs, text


def _client(srv: Server, root: str = "") -> Any:
    return openai.OpenAI(base_url=srv.base + root + "/v1", api_key=KEY, max_retries=0,
                         timeout=120)


def test_every_response_carries_x_request_id(server: Server) -> None:
    status, hdrs, _ = _http(server, "GET", "/health", headers={"X-Request-Id": "trace-42"})
    assert status == 200 and hdrs["x-request-id"] == "trace-42"
    status, hdrs, _ = _http(server, "GET", "/v1/models")
    assert status == 200 and len(hdrs["x-request-id"]) == 32
    int(hdrs["x-request-id"], 16)   # a fresh hex id when the request brings none
    status, hdrs, body = _http(server, "POST", "/v1/chat/completions",
                               {"model": "no-such-model", "messages": HI},
                               headers={"X-Request-Id": "trace-43"})
    assert status in (400, 404) and hdrs["x-request-id"] == "trace-43"   # errors too


def test_x_request_id_names_the_response_as_vllm_does(server: Server) -> None:
    """A completion answered to a request with ``X-Request-Id: T`` has the id ``chatcmpl-T``
    (``cmpl-T``), streamed chunks too; two requests with the same header both run; a header
    too long (or not printable ASCII) to name a response leaves it an id of its own."""
    client = _client(server)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                       extra_headers={"X-Request-Id": "trace-77"})
    assert r.id == "chatcmpl-trace-77"
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                  extra_headers={"X-Request-Id": "trace-78"})
    assert c.id == "cmpl-trace-78"
    ids = {chunk.id for chunk in client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, temperature=0, stream=True,
        extra_headers={"X-Request-Id": "trace-79"})}
    assert ids == {"chatcmpl-trace-79"}
    got: list[Any] = []

    def ask() -> None:
        got.append(client.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=4, temperature=0,
            extra_headers={"X-Request-Id": "same-twice"}))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [x.id for x in got] == ["chatcmpl-same-twice"] * 2
    long_id = "x" * 200
    status, hdrs, body = _http(server, "POST", "/v1/chat/completions",
                               {"model": MODEL, "messages": HI, "max_tokens": 1},
                               headers={"X-Request-Id": long_id})
    assert status == 200 and hdrs["x-request-id"] == long_id     # still echoed
    assert body["id"].startswith("chatcmpl-") and long_id not in body["id"]
    # vLLM's request_id field names it when no header does (the header wins), streamed too;
    # one that cannot name a response is a 400 naming it (not silently replaced)
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                       extra_body={"request_id": "body-1"})
    assert r.id == "chatcmpl-body-1"
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                       extra_body={"request_id": "body-2"},
                                       extra_headers={"X-Request-Id": "head-2"})
    assert r.id == "chatcmpl-head-2"
    ids = {chunk.id for chunk in client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, stream=True,
        extra_body={"request_id": "body-3"})}
    assert ids == {"cmpl-body-3"}
    for bad in ("", "x" * 129, "tr\u00e4ce", "a\nb"):
        status, _, err = _http(server, "POST", "/v1/completions",
                               {"model": MODEL, "prompt": "Hi", "max_tokens": 1,
                                "request_id": bad})
        assert status == 400 and err["error"]["param"] == "request_id", (bad, err)


def test_default_template_kwargs_reach_the_template_and_a_request_overrides_them(
        server: Server) -> None:
    def prompt(extra: dict[str, Any]) -> str:
        status, _, body = _http(server, "POST", "/tokenize",
                                {"model": MODEL, "messages": HI, **extra})
        assert status == 200, body
        status, _, text = _http(server, "POST", "/detokenize",
                                {"model": MODEL, "tokens": body["tokens"]})
        assert status == 200, text
        return text["prompt"]

    assert "probe zebra" in prompt({})
    overridden = prompt({"chat_template_kwargs": {"probe_word": "yak"}})
    assert "probe yak" in overridden and "zebra" not in overridden
    # the chat endpoint renders the same prompt: its usage counts the default's tokens
    r = _client(server).chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                                temperature=0)
    status, _, body = _http(server, "POST", "/tokenize", {"model": MODEL, "messages": HI})
    assert r.usage.prompt_tokens == body["count"]


def test_a_trusted_request_template_renders_the_prompt(server: Server) -> None:
    """With --trust-request-chat-template a request's chat_template replaces the model's on
    /tokenize and chat (the same prompt: the chat's usage counts its tokens); the template
    variables still reach it; chat_template_kwargs may not carry one even so."""
    mine = ("{%- for m in messages %}[{{ m['role'] }}|{{ probe_word }}]{{ m['content'] }}"
            "{%- endfor %}{%- if add_generation_prompt %}[answer]{%- endif %}")
    status, _, tok = _http(server, "POST", "/tokenize",
                           {"model": MODEL, "messages": HI, "chat_template": mine})
    assert status == 200, tok
    text = _http(server, "POST", "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})[2]
    assert text["prompt"] == "[user|zebra]Say hi.[answer]"   # the server's default variable
    r = _client(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, temperature=0,
        extra_body={"chat_template": mine})
    assert r.usage.prompt_tokens == tok["count"]
    status, _, err = _http(server, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": HI, "max_tokens": 1,
                            "chat_template_kwargs": {"chat_template": mine}})
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs"


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(server: Server) -> None:
    """``reasoning_effort`` is the template's ``reasoning_effort`` variable and switches
    ``enable_thinking`` (off for ``none``), unless the request's own ``chat_template_kwargs``
    set that; the Responses API's ``reasoning.effort`` is the same. A template that reads
    neither variable makes it a 400 naming the field (vLLM would render it and ignore it)."""
    def shown(**extra: Any) -> str:
        status, _, body = _http(server, "POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": HI, "max_tokens": 1,
                                 "return_prompt_text": True, **extra})
        assert status == 200, body
        return body["prompt_text"]

    assert "[thinking" not in shown()
    assert shown(reasoning_effort="low").endswith("[thinking True effort low]")
    assert shown(reasoning_effort="none").endswith("[thinking False effort none]")
    assert shown(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}
                 ).endswith("[thinking True effort none]")
    # the field wins over a template variable of the same name, as in vLLM
    assert shown(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}
                 ).endswith("[thinking True effort high]")
    status, _, err = _http(server, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": HI, "max_tokens": 1,
                            "reasoning_effort": "maximal"})
    assert status == 400 and err["error"]["param"] == "reasoning_effort", err
    plain = "{%- for m in messages %}{{ m['content'] }}{%- endfor %}"
    status, _, err = _http(server, "POST", "/v1/chat/completions",
                           {"model": MODEL, "messages": HI, "max_tokens": 1,
                            "reasoning_effort": "low", "chat_template": plain})
    assert status == 400 and err["error"]["param"] == "reasoning_effort", err
    assert "reads neither" in err["error"]["message"]
    # the official client's own field, and the Responses API's reasoning.effort
    api = _client(server)
    r = api.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                    reasoning_effort="none")
    assert r.usage.prompt_tokens == _http(server, "POST", "/tokenize", {
        "model": MODEL, "messages": HI,
        "chat_template_kwargs": {"enable_thinking": False, "reasoning_effort": "none"}}
        )[2]["count"]
    resp = api.responses.create(model=MODEL, input="Say hi.", max_output_tokens=1,
                                reasoning={"effort": "none", "summary": "auto"})
    assert resp.reasoning.effort == "none"
    assert resp.usage.input_tokens == r.usage.prompt_tokens
    for bad in ({"summary": "detailed"}, {"effort": "extreme"}, {"budget": 5}):
        status, _, err = _http(server, "POST", "/v1/responses",
                               {"model": MODEL, "input": "Hi", "reasoning": bad})
        assert status == 400 and err["error"]["param"] == "reasoning", (bad, err)


def test_the_reply_role_is_the_response_role(server: Server) -> None:
    c = _client(server)
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0)
    assert r.choices[0].message.role == "helper"
    first = next(iter(c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                temperature=0, stream=True)))
    assert first.choices[0].delta.role == "helper"
    # continuing the last message: its role, as vLLM
    r = c.chat.completions.create(
        model=MODEL, messages=[*HI, {"role": "assistant", "content": "Hi"}], max_tokens=2,
        temperature=0, extra_body={"add_generation_prompt": False,
                                   "continue_final_message": True})
    assert r.choices[0].message.role == "assistant"


def test_logprob_tokens_are_ids_unless_a_request_says_otherwise(server: Server) -> None:
    c = _client(server)
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0,
                                  logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") for e in content)
    assert all(t.token.startswith("token_id:") for e in content for t in e.top_logprobs)
    r = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, temperature=0,
                                  logprobs=True,
                                  extra_body={"return_tokens_as_token_ids": False})
    assert not any(e.token.startswith("token_id:") for e in r.choices[0].logprobs.content)
    r = c.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0,
                             logprobs=1)
    assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)


def test_a_stream_ends_with_usage_without_stream_options(server: Server) -> None:
    chunks = list(_client(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, temperature=0, stream=True))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 5 and not chunks[-1].choices
    assert usage.prompt_tokens_details.cached_tokens is not None
    # forced, as vLLM forces it: every chunk carries the usage so far
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 5, counts
    assert {c.usage.prompt_tokens for c in chunks} == {usage.prompt_tokens}


def test_load_counts_generation_requests_in_flight(server: Server) -> None:
    assert _http(server, "GET", "/load")[2] == {"server_load": 0}
    done = threading.Event()

    def stream() -> None:
        try:
            for _ in _client(server).chat.completions.create(
                    model=MODEL, messages=HI, max_tokens=48, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}):
                time.sleep(0.02)   # a slow reader: the request stays in flight a while
        finally:
            done.set()

    t = threading.Thread(target=stream)
    t.start()
    seen = 0
    while not done.is_set():
        seen = max(seen, _http(server, "GET", "/load")[2]["server_load"])
        time.sleep(0.01)
    t.join()
    assert seen == 1
    assert _http(server, "GET", "/load")[2] == {"server_load": 0}


def test_served_model_aliases_and_a_left_out_model(server: Server) -> None:
    """--served-model-name MODEL alias-one: either name is served (answers carry the first),
    /v1/models lists both; a request without `model` gets the server's (vLLM's leniency)."""
    r = _client(server).chat.completions.create(model="alias-one", messages=HI, max_tokens=1,
                                                temperature=0)
    assert r.model == MODEL
    status, _, body = _http(server, "POST", "/v1/completions",
                            {"prompt": "The sky is", "max_tokens": 1})
    assert status == 200 and body["model"] == MODEL
    status, _, body = _http(server, "POST", "/v1/chat/completions",
                            {"messages": HI, "max_tokens": 1})
    assert status == 200 and body["model"] == MODEL
    status, _, body = _http(server, "GET", "/v1/models")
    assert [m["id"] for m in body["data"]] == [MODEL, "alias-one"]
    assert {m["root"] for m in body["data"]} == {MODEL}
    status, _, body = _http(server, "POST", "/v1/completions",
                            {"model": "alias-two", "prompt": "x", "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # OpenAI's retrieve (vLLM has only the list): each served name, a 404 for others, the key
    # required as on the list
    for name in (MODEL, "alias-one"):
        card = _client(server).models.retrieve(name)
        assert card.id == name and card.model_extra["root"] == MODEL
    with pytest.raises(openai.NotFoundError):
        _client(server).models.retrieve("org/alias-two")
    status, _, body = _http(server, "GET", "/v1/models/org/alias-two")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert _http(server, "GET", "/v1/models/alias-one", key=None)[0] == 401


def test_sagemaker_invocations_route_by_the_body_and_need_the_key(server: Server) -> None:
    status, _, body = _http(server, "POST", "/invocations",
                            {"messages": HI, "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion", body
    assert body["choices"][0]["message"]["role"] == "helper"   # the same chat route
    status, _, body = _http(server, "POST", ROOT + "/invocations",
                            {"prompt": "The sky is", "max_tokens": 2})
    assert status == 200 and body["object"] == "text_completion", body
    assert _http(server, "POST", "/invocations", {"prompt": "x"}, key=None)[0] == 401
    status, _, body = _http(server, "POST", "/invocations", {"input": "x"})
    assert status == 400 and body["error"]["param"] == "messages"
    status, _, body = _http(server, "POST", "/invocations",
                            {"messages": HI, "temperature": "hot"})
    assert status == 400 and body["error"]["param"] == "temperature"
    # a body nested deeper than json.loads goes (RecursionError): a 400, as on the other
    # routes, where FastAPI reads the body (it was a 500 here)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", "/invocations", '{"prompt": ' + "[" * 100_000 + "]" * 100_000
                     + "}", {"Content-Type": "application/json",
                             "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        assert r.status == 400 and "nested too deep" in json.loads(r.read())["error"]["message"]
    finally:
        conn.close()


def test_tokenizer_info_has_the_template_in_use(server: Server) -> None:
    status, _, info = _http(server, "GET", "/tokenizer_info", key=None)
    assert status == 200, info
    assert info["chat_template"] == TEMPLATE   # --chat-template's, not the model's
    assert info["model_max_length"] == TOKENIZER_MARK   # --tokenizer's, not the model's
    assert info["tokenizer_class"] and info["eos_token"] == "<|im_end|>"
    assert not any(k.endswith("_file") for k in info)
    json.dumps(info)   # plain JSON all through


def test_no_api_docs(server: Server) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert _http(server, "GET", path)[0] == 404


def test_an_idle_stream_sends_keep_alive_comments(server: Server) -> None:
    """With --max-num-seqs 1 a second stream waits for the first one's 48 tokens: while it
    waits its response sends SSE comments every --sse-keep-alive-interval, which the openai
    client reads past."""
    first = threading.Thread(target=lambda: list(_client(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=48, temperature=0, stream=True,
        extra_body={"ignore_eos": True})))
    first.start()
    time.sleep(0.3)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": HI, "max_tokens": 2, "temperature": 0, "stream": True}),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    lines = conn.getresponse().read().decode().split("\n\n")
    conn.close()
    first.join()
    comments = [x for x in lines if x.startswith(":")]
    assert comments and set(comments) == {": keep-alive"}
    assert lines[-2] == "data: [DONE]"
    # the official client ignores the comments: a waiting stream still parses
    other = threading.Thread(target=lambda: list(_client(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=32, temperature=0, stream=True,
        extra_body={"ignore_eos": True})))
    other.start()
    time.sleep(0.3)
    chunks = list(_client(server).chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, temperature=0, stream=True))
    other.join()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


def test_cors_preflight_and_headers_come_before_the_key_check(server: Server) -> None:
    status, hdrs, _ = _http(server, "OPTIONS", "/v1/chat/completions", key=None, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert status == 200 and hdrs["access-control-allow-origin"] == ORIGIN
    assert hdrs["access-control-allow-credentials"] == "true"
    status, hdrs, _ = _http(server, "GET", "/v1/models", key=None, headers={"Origin": ORIGIN})
    assert status == 401 and hdrs["access-control-allow-origin"] == ORIGIN   # readable
    status, hdrs, _ = _http(server, "GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and hdrs["access-control-allow-origin"] == ORIGIN
    status, hdrs, _ = _http(server, "GET", "/v1/models",
                            headers={"Origin": "https://elsewhere.example"})
    assert status == 200 and "access-control-allow-origin" not in hdrs


def test_the_root_path_serves_below_it_and_keeps_the_key_check(server: Server) -> None:
    """Behind a proxy that keeps the prefix (PATH/v1/...) or strips it (/v1/...), the same
    routes answer, and the API key is required under the prefix too."""
    for prefix in (ROOT, ""):
        assert _http(server, "GET", prefix + "/v1/models")[0] == 200
        assert _http(server, "GET", prefix + "/v1/models", key=None)[0] == 401
        assert _http(server, "POST", prefix + "/v1/completions",
                     {"model": MODEL, "prompt": "Hi", "max_tokens": 1}, key=None)[0] == 401
    assert _http(server, "GET", ROOT + "/health", key=None)[0] == 200
    r = _client(server, ROOT).completions.create(model=MODEL, prompt="The sky is",
                                                 max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    assert _http(server, "GET", ROOT + "x/v1/models")[0] == 404   # a prefix, not a substring


def test_https_with_a_certificate_and_request_logs(tmp_path) -> None:
    """--ssl-keyfile / --ssl-certfile: the server answers over TLS (the openai client trusting
    the self-signed certificate), and plain HTTP gets no answer from it. The same server logs
    requests and outputs (--enable-log-requests --enable-log-outputs --max-log-len, prompt ids
    at --log-level debug), named by the ids their responses carry. At SIGTERM it drains the
    stream in flight (--shutdown-timeout 120) without waiting for an idle TLS client."""
    import ssl
    import urllib.error
    import urllib.request

    from tests.server.tls_cert import self_signed

    keyfile, certfile = tmp_path / "key.pem", tmp_path / "cert.pem"

    def make_cert() -> bytes:
        return self_signed(keyfile, certfile)

    def served_cert(port: int) -> bytes:
        """The certificate a new TLS connection is given (not verified: just looked at)."""
        import socket

        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw) as tls:
            return tls.getpeercert(binary_form=True)

    first_cert = make_cert()
    args = ["--threads", "1", "--device", "cpu", "--device-blocks", "64",
            "--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile),
            "--enable-log-requests", "--enable-log-outputs", "--max-log-len", "8",
            "--log-level", "debug", "--shutdown-timeout", "120", "--enable-ssl-refresh"]
    with running_server(args, wait=False) as srv:
        ctx = ssl.create_default_context(cafile=str(certfile))
        base = f"https://127.0.0.1:{srv.port}"
        deadline = time.monotonic() + 600
        while True:
            assert srv.proc.poll() is None, srv.proc.stdout.read()
            try:
                with urllib.request.urlopen(base + "/health", context=ctx, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        # (KEY: the module's server may have put VLLM_API_KEY in the environment it inherits)
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=ctx, timeout=120))
        with client:   # closed (TLS close_notify sent) before the server stops
            r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=2,
                                          temperature=0)
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=12, temperature=0, stream=True,
                extra_body={"ignore_eos": True}))
            # an X-Request-Id names the response, and the log lines (the engine's id has a
            # random suffix, the log keeps the client's name)
            tagged = client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, temperature=0,
                extra_headers={"X-Request-Id": "trace-log-1"})
            tagged_stream = [c.id for c in client.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=2, temperature=0, stream=True,
                extra_headers={"X-Request-Id": "trace-log-2"})]
        assert r.usage.completion_tokens == 2
        assert tagged.id == "chatcmpl-trace-log-1"
        assert set(tagged_stream) == {"chatcmpl-trace-log-2"}
        with pytest.raises((urllib.error.URLError, OSError)):   # no plain HTTP answer
            urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health", timeout=5)
        # --enable-ssl-refresh: a rotated certificate is what new connections get, no restart
        assert served_cert(srv.port) == first_cert
        second_cert = make_cert()
        deadline = time.monotonic() + 30
        while served_cert(srv.port) != second_cert:
            assert time.monotonic() < deadline, "the rotated certificate was not served"
            time.sleep(0.3)
        ctx = ssl.create_default_context(cafile=str(certfile))   # trusts the new one
        with urllib.request.urlopen(base + "/health", context=ctx, timeout=5) as health:
            assert health.status == 200
        # --shutdown-timeout 120: a stream in flight at SIGTERM is drained to its end
        drained: list[Any] = []
        started = threading.Event()

        def stream() -> None:
            with openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0,
                               http_client=openai.DefaultHttpxClient(verify=ctx,
                                                                     timeout=120)) as c:
                for chunk in c.chat.completions.create(
                        model=MODEL, messages=HI, max_tokens=40, temperature=0, stream=True,
                        extra_body={"ignore_eos": True}):
                    drained.append(chunk)
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        # a client holding an idle keep-alive connection (a pool between requests) does not
        # hold the drain: its TLS close waits tls.TLS_CLOSE_S for an answer, not the 120 s
        idle = http.client.HTTPSConnection("127.0.0.1", srv.port, context=ctx, timeout=60)
        idle.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        with idle.getresponse() as models:
            assert models.status == 200 and models.read()
        srv.proc.terminate()
        t.join(120)
        ended = time.monotonic()
        assert srv.proc.wait(60) is not None
        assert time.monotonic() - ended < 15, "the drain waited for the idle TLS client"
        idle.close()
        assert drained[-1].choices[0].finish_reason == "length"
        assert sum(1 for c in drained if c.choices and c.choices[0].delta.content) >= 30
    logs = srv.proc.stdout.read()
    streamed = chunks[0].id
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    for rid in (r.id + "-0", streamed):   # a non-streamed completion's prompts: ID-0, ID-1, ...
        assert f"Received request {rid}: params: SamplingParams(" in logs, logs[-3000:]
        assert f"Request {rid} details: prompt: " in logs   # debug: the prompt too
    assert f"Generated response {r.id}-0: output: {r.choices[0].text[:8]!r}, " \
           f"finish_reason: length" in logs
    assert f"Generated response {streamed}: output: {text[:8]!r}" in logs
    assert "prompt_tokens: " in logs
    # a chat's one prompt is named as its response, as vLLM names it (ID-0 before 2026-12-08)
    for rid in ("chatcmpl-trace-log-1", "chatcmpl-trace-log-2"):
        assert f"Received request {rid}: params: " in logs
        assert f"Generated response {rid}: output: " in logs
    assert "reloaded the TLS certificate" in logs


MIDDLEWARE = """
async def stamp(request, call_next):
    response = await call_next(request)
    response.headers["x-operator"] = "stamped"
    return response


class Count:
    calls = 0

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            Count.calls += 1

            async def counted(message):
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []),
                                          (b"x-count", str(Count.calls).encode())]
                await send(message)
            return await self.app(scope, receive, counted)
        return await self.app(scope, receive, send)
"""


def test_a_unix_socket_operator_middleware_and_quiet_probes(tmp_path) -> None:
    """--uds: the server listens on a Unix socket (no TCP port); --middleware adds an http
    function and an ASGI class by import path; --disable-access-log-for-endpoints drops the
    probes' access lines while other requests keep theirs."""
    import socket
    import subprocess
    import sys

    (tmp_path / "operator_mw.py").write_text(MIDDLEWARE)
    sock = str(tmp_path / "radixkv.sock")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("VLLM_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.server.cli", "--uds", sock, "--threads", "1",
         "--device", "cpu", "--device-blocks", "64", "--log-level", "info",
         "--middleware", "operator_mw.stamp", "--middleware", "operator_mw.Count",
         "--disable-access-log-for-endpoints", "/health,/metrics"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(sock)

    def get(path: str) -> tuple[int, dict[str, str], str]:
        conn = UnixConnection("localhost", timeout=60)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
        finally:
            conn.close()

    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if get("/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.5)
        status, hdrs, body = get("/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
        assert hdrs["x-operator"] == "stamped" and int(hdrs["x-count"]) >= 2
        assert get("/metrics")[0] == 200
        assert get("/tokenizer_info")[0] == 404   # only with --enable-tokenizer-info-endpoint
        # SIGTERM with a long stream in flight: by default (--shutdown-timeout 0, vLLM's) it
        # is aborted and the server exits at once, instead of generating its 3000 tokens
        conn = UnixConnection("localhost", timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": HI, "max_tokens": 3000, "stream": True,
             "ignore_eos": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert b"data: " in resp.read1(65536)   # streaming
        t0 = time.monotonic()
        proc.terminate()
        proc.wait(60)
        took = time.monotonic() - t0
        try:
            rest = resp.read()
        except http.client.IncompleteRead as exc:
            rest = exc.partial
        conn.close()
        assert took < 15, took
        assert rest.count(b"data: ") < 1000 and b"[DONE]" not in rest
    finally:
        stop_process(proc)
    logs = proc.stdout.read()
    assert "radixkv serve: unix:" + sock in logs
    assert '"GET /v1/models HTTP/1.1" 200' in logs
    assert '"GET /health' not in logs and '"GET /metrics' not in logs


# ------------------------------------------------------------------ the options alone
def test_keep_alive_fills_idle_gaps_and_closes_what_it_wraps() -> None:
    import asyncio

    from radixkv.server.frontend import KEEP_ALIVE, keep_alive

    closed = []

    async def slow() -> Any:
        try:
            for i in range(3):
                await asyncio.sleep(0.25)
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    async def run(limit: int | None) -> list[str]:
        out = []
        gen = keep_alive(slow(), 0.1)
        async for chunk in gen:
            out.append(chunk)
            if limit is not None and len(out) == limit:
                await gen.aclose()   # the client went away
                break
        return out

    out = asyncio.run(run(None))
    assert [c for c in out if c != KEEP_ALIVE] == ["data: 0\n\n", "data: 1\n\n",
                                                   "data: 2\n\n"]
    assert out.count(KEEP_ALIVE) >= 3 and closed == [True]
    closed.clear()
    asyncio.run(run(2))   # closed while the next chunk is pending
    assert closed == [True]


def test_cors_and_root_path_values_are_checked() -> None:
    from radixkv.server.frontend import parse_list

    assert parse_list('["*"]', "--allowed-origins") == ("*",)
    for bad in ('"*"', "[1]", "{"):
        with pytest.raises(ConfigError, match="--allowed-origins"):
            parse_list(bad, "--allowed-origins")
    for bad in ("llm", "/llm/"):
        with pytest.raises(ConfigError, match="--root-path"):
            FrontendOptions(root_path=bad)
    with pytest.raises(ConfigError, match="--sse-keep-alive-interval"):
        FrontendOptions(sse_keep_alive_interval=-1)
    with pytest.raises(ConfigError, match="needs --enable-log-requests"):
        FrontendOptions(log_outputs=True)
    with pytest.raises(ConfigError, match="--max-log-len"):
        FrontendOptions(log_requests=True, max_log_len=-1)
    for bad, words in (("nodot", "MODULE.NAME"), ("json.nosuchname", "has no attribute"),
                       ("json.dumps", "neither a class nor an async function")):
        with pytest.raises(ConfigError, match=words):
            FrontendOptions(middleware=(bad,))
    opts = FrontendOptions(root_path="/llm")
    assert [opts.route_path({"path": p}) for p in ("/llm/v1/x", "/llm", "/v1/x", "/llmx/v1")] \
        == ["/v1/x", "/", "/v1/x", "/llmx/v1"]
def test_options_refuse_bad_values_at_start_up() -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        FrontendOptions(response_role="")
    with pytest.raises(ConfigError, match="set by the server"):
        FrontendOptions(default_chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ConfigError, match="not a template variable"):
        FrontendOptions(default_chat_template_kwargs={"1x": 1})
    with pytest.raises(ConfigError, match="JSON object"):
        parse_template_kwargs('"text"')


def test_vllms_stop_string_limit_applies_and_its_variable_raises_it(monkeypatch) -> None:
    """At most 4 stop strings, as vLLM 0.32 and OpenAI; ``VLLM_MAX_STOP_STRINGS`` (read at
    start-up, as vLLM reads it) sets another limit; a value that is not a positive int is an
    error, not a silent default."""
    from pydantic import ValidationError

    from radixkv.server import protocol

    assert protocol.stop_strings_limit(None) == protocol.stop_strings_limit("") == 4
    assert protocol.stop_strings_limit("32") == 32
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="VLLM_MAX_STOP_STRINGS"):
            protocol.stop_strings_limit(bad)
    five = [f"s{i}" for i in range(5)]
    with pytest.raises(ValidationError, match="at most 4 stop sequences"):
        protocol.CompletionRequest(prompt="x", stop=five)
    monkeypatch.setattr(protocol, "MAX_STOP_STRINGS", 8)
    assert protocol.CompletionRequest(prompt="x", stop=five).stop == five
    with pytest.raises(ValidationError, match="at most 8"):
        protocol.ChatCompletionRequest(messages=HI, stop=five * 2)


def test_a_requests_own_template_kwargs_win() -> None:
    opts = FrontendOptions(default_chat_template_kwargs={"a": 1, "b": 2})
    assert opts.template_kwargs({"b": 3}) == {"a": 1, "b": 3}
    assert opts.template_kwargs(None) == {"a": 1, "b": 2}
    assert FrontendOptions().template_kwargs(None) is None
    assert FrontendOptions().template_kwargs({"c": 1}) == {"c": 1}
    assert FrontendOptions(**opts.as_dict()) == opts   # what the fleet's ingress rebuilds
    assert not FrontendOptions().trust_request_chat_template   # vLLM's default: refused


def test_a_requests_reasoning_effort_wins_over_the_servers_template_defaults() -> None:
    """``--default-chat-template-kwargs '{"enable_thinking": false}'`` (a common deployment)
    does not turn off the thinking a request asks for with ``reasoning_effort``; without the
    field the default holds. Idempotent, as ``_request_defaults`` must be."""
    from types import SimpleNamespace

    from radixkv.server.app import _request_defaults
    from radixkv.server.protocol import ChatCompletionRequest

    tok = SimpleNamespace(chat_template="{{ enable_thinking }}")
    eng = SimpleNamespace(chat_template=SimpleNamespace(tokenizer=tok))
    state = SimpleNamespace(ready_engine=lambda: eng, frontend=FrontendOptions(
        default_chat_template_kwargs={"enable_thinking": False, "x": 1}))
    req = ChatCompletionRequest(messages=HI, reasoning_effort="medium")
    _request_defaults(state, req)
    want = {"enable_thinking": True, "x": 1, "reasoning_effort": "medium"}
    assert req.chat_template_kwargs == want
    _request_defaults(state, req)
    assert req.chat_template_kwargs == want
    req = ChatCompletionRequest(messages=HI)
    _request_defaults(state, req)
    assert req.chat_template_kwargs == {"enable_thinking": False, "x": 1}


def test_docs_are_served_by_default() -> None:
    from radixkv.server.app import create_app

    assert create_app(load=lambda: None).fastapi.docs_url == "/docs"
    assert create_app(load=lambda: None,
                      frontend=FrontendOptions(docs=False)).fastapi.openapi_url is None


def test_the_request_log_handler_is_installed_once() -> None:
    import logging

    from radixkv.server import request_log

    before = list(request_log.log.handlers)
    try:
        request_log.install(debug=False)
        request_log.install(debug=True)
        added = [h for h in request_log.log.handlers if h not in before]
        assert len(added) <= 1 and request_log.log.level == logging.DEBUG
        assert not request_log.log.propagate
    finally:
        for h in list(request_log.log.handlers):
            if h not in before:
                request_log.log.removeHandler(h)
        request_log.log.setLevel(logging.NOTSET)
        request_log.log.propagate = True


def test_a_tls_reload_that_fails_keeps_the_old_certificate(tmp_path, capsys) -> None:
    """A rotation caught half-way (a new certificate beside the old key) does not load: the
    live context keeps serving the old pair, and says so."""
    import uvicorn
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from radixkv.server.tls import RefreshingServer

    def pair() -> tuple[bytes, bytes]:
        import datetime

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(1)
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                .sign(key, hashes.SHA256()))
        return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
                cert.public_bytes(serialization.Encoding.PEM))

    keyfile, certfile = tmp_path / "k.pem", tmp_path / "c.pem"
    k1, c1 = pair()
    keyfile.write_bytes(k1)
    certfile.write_bytes(c1)
    config = uvicorn.Config(lambda *a: None, ssl_keyfile=str(keyfile),
                            ssl_certfile=str(certfile))
    config.load()
    server = RefreshingServer(config, str(keyfile), str(certfile))
    certfile.write_bytes(pair()[1])   # the new certificate, the old key
    assert server.reload() is False and server.reloads == 0
    assert "did not load" in capsys.readouterr().err
    k2, c2 = pair()
    keyfile.write_bytes(k2)
    certfile.write_bytes(c2)
    assert server.reload() is True and server.reloads == 1


def test_response_ids_take_a_usable_x_request_id_and_keep_engine_ids_unique() -> None:
    from radixkv.server import serving

    rid, eid = serving.response_ids("chatcmpl", "trace-1")
    rid2, eid2 = serving.response_ids("chatcmpl", "trace-1")
    assert rid == rid2 == "chatcmpl-trace-1" and eid != eid2 and eid.startswith(rid + "-")
    for bad in (None, "", "a\nb", "tr\u00e4ce", "\x00", "y" * 129):
        rid, eid = serving.response_ids("cmpl", bad)
        assert rid == eid and rid.startswith("cmpl-") and len(rid) == len("cmpl-") + 24
    assert serving.response_ids("cmpl", "y" * 128)[0] == "cmpl-" + "y" * 128
    # the body's request_id when the header cannot name it
    assert serving.response_ids("cmpl", None, "f-1")[0] == "cmpl-f-1"
    assert serving.response_ids("cmpl", "a\nb", "f-1")[0] == "cmpl-f-1"
    assert serving.response_ids("cmpl", "h-1", "f-1")[0] == "cmpl-h-1"
