"""vLLM's frontend flags (radixkv/server/frontend.py) on the real server: ``radixkv serve`` as a
subprocess on 127.0.0.1 with all of them, driven by the official ``openai`` client and plain
HTTP. One server for the module; unit tests of the options need none."""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from radixkv.errors import ConfigError  # noqa: E402
from radixkv.server.frontend import FrontendOptions, parse_template_kwargs  # noqa: E402
from tests.server.test_openai_server import MODEL, Server, running_server  # noqa: E402

# ChatML (the embedded model's format) with one variable of its own, so that what the template
# was given shows in the prompt's tokens.
TEMPLATE = (
    "{%- if probe_word is defined %}{{ '<|im_start|>system\\nprobe ' + probe_word + "
    "'<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tpl = tmp_path_factory.mktemp("tpl") / "chatml_probe.jinja"
    tpl.write_text(TEMPLATE)
    args = ["--threads", "1", "--device", "cpu", "--device-blocks", "256", "--dtype", "float32",
            "--chat-template", str(tpl),
            "--enable-request-id-headers",
            "--default-chat-template-kwargs", json.dumps({"probe_word": "zebra"}),
            "--response-role", "helper",
            "--return-tokens-as-token-ids",
            "--enable-force-include-usage",
            "--enable-server-load-tracking",
            "--disable-fastapi-docs",
            "--disable-uvicorn-access-log",
            "--trust-request-chat-template",
            "--enable-prompt-tokens-details"]   # accepted: always reported
    with running_server(args) as srv:
        yield srv


def _http(srv: Server, method: str, path: str, body: Any = None,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        hdrs = {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()
    try:
        return r.status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return r.status, hdrs, text


def _client(srv: Server) -> Any:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0,
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


def test_no_api_docs(server: Server) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert _http(server, "GET", path)[0] == 404


# ------------------------------------------------------------------ the options alone
def test_options_refuse_bad_values_at_start_up() -> None:
    with pytest.raises(ConfigError, match="non-empty"):
        FrontendOptions(response_role="")
    with pytest.raises(ConfigError, match="set by the server"):
        FrontendOptions(default_chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ConfigError, match="not a template variable"):
        FrontendOptions(default_chat_template_kwargs={"1x": 1})
    with pytest.raises(ConfigError, match="JSON object"):
        parse_template_kwargs('"text"')


def test_a_requests_own_template_kwargs_win() -> None:
    opts = FrontendOptions(default_chat_template_kwargs={"a": 1, "b": 2})
    assert opts.template_kwargs({"b": 3}) == {"a": 1, "b": 3}
    assert opts.template_kwargs(None) == {"a": 1, "b": 2}
    assert FrontendOptions().template_kwargs(None) is None
    assert FrontendOptions().template_kwargs({"c": 1}) == {"c": 1}
    assert FrontendOptions(**opts.as_dict()) == opts   # what the fleet's ingress rebuilds
    assert not FrontendOptions().trust_request_chat_template   # vLLM's default: refused


def test_docs_are_served_by_default() -> None:
    from radixkv.server.app import create_app

    assert create_app(load=lambda: None).fastapi.docs_url == "/docs"
    assert create_app(load=lambda: None,
                      frontend=FrontendOptions(docs=False)).fastapi.openapi_url is None
