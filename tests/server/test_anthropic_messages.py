"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the real
server, driven by Anthropic's official client (radixkv/server/anthropic.py).

The server is the tool-call modules' (a Hermes-style template that declares tools and reads
``enable_thinking``, ``--reasoning-parser qwen3``), with an API key, which the client sends as
``x-api-key``. Every answer is checked against the chat endpoint's answer to the same
conversation: the Messages API is a translation of it, so they must agree token for token.
The translation's pure parts (the request, the answer, the stream) are checked on their own."""

from __future__ import annotations

import asyncio
import http.client
import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from radixkv.server import anthropic as am  # noqa: E402
from tests.server.test_openai_server import MODEL, Server  # noqa: E402
from tests.server.test_tool_calls import ASK, TEMPLATE, TIME, WEATHER, template_server  # noqa: E402

KEY = "anthropic-key"
GREEDY = {"temperature": 0}   # (Anthropic's newest SDK has no temperature argument)
TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with template_server(tmp_path_factory, TEMPLATE, "--reasoning-parser", "qwen3",
                         "--api-key", KEY) as server:
        yield server


def _client(srv: Server, key: str = KEY) -> Any:
    return anthropic.Anthropic(base_url=srv.base, api_key=key, max_retries=0, timeout=300)


def _chat(srv: Server, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=300)
    return client.chat.completions.create(model=MODEL, **{"temperature": 0, **kw})


def _prompt_tokens(usage: Any) -> int:
    return (usage.input_tokens + usage.cache_read_input_tokens
            + usage.cache_creation_input_tokens)


@pytest.mark.model
def test_a_message_is_the_chat_reply_streamed_or_not(srv: Server) -> None:
    """Text, stop reason and usage are the chat answer's (the usage's three input parts add
    up to its prompt); streamed, the events are Anthropic's sequence and assemble to the same
    message. A system prompt with a cache breakpoint is the system message."""
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": "Name a color."}]
    r = _client(srv).messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system=system,
                                     messages=msgs)
    chat = _chat(srv, max_tokens=12, messages=[{"role": "system", "content": "You are terse."},
                                               *msgs])
    [block] = r.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert r.id.startswith("msg_") and r.role == "assistant" and r.model == MODEL
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        chat.choices[0].finish_reason]
    assert _prompt_tokens(r.usage) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    # the same prompt: the chat request after it read it from the cache the message filled
    assert chat.usage.prompt_tokens_details.cached_tokens >= r.usage.cache_creation_input_tokens
    assert r.usage.cache_creation_input_tokens > 0
    with _client(srv).messages.stream(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                      system=system, messages=msgs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # the prompt's length and its cache split from the start, as Anthropic's stream gives them
    # (the same split as the final usage's)
    start = events[0].message.usage
    assert _prompt_tokens(start) == chat.usage.prompt_tokens
    assert start.cache_read_input_tokens > 0   # (the message above computed this prompt)
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert final.content[0].text == block.text and final.stop_reason == r.stop_reason
    assert _prompt_tokens(final.usage) == chat.usage.prompt_tokens
    assert final.usage.output_tokens == r.usage.output_tokens
    assert final.usage.cache_read_input_tokens >= r.usage.cache_creation_input_tokens
    assert (start.input_tokens, start.cache_read_input_tokens,
            start.cache_creation_input_tokens) == (final.usage.input_tokens,
                                                   final.usage.cache_read_input_tokens,
                                                   final.usage.cache_creation_input_tokens)
    assert _client(srv).messages.count_tokens(
        model=MODEL, system=system, messages=msgs).input_tokens == chat.usage.prompt_tokens


@pytest.mark.model
def test_a_last_assistant_message_is_continued(srv: Server) -> None:
    """Anthropic's prefill: the reply continues the last assistant message (the chat request
    with ``continue_final_message``), and holds only the continuation."""
    msgs = [{"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "The best fruit is"}]
    r = _client(srv).messages.create(model=MODEL, max_tokens=6, messages=msgs,
                                     extra_body=GREEDY)
    chat = _chat(srv, max_tokens=6, messages=msgs,
                 extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.content[0].text == chat.choices[0].message.content
    assert _prompt_tokens(r.usage) == chat.usage.prompt_tokens
    plain = _chat(srv, max_tokens=6, messages=msgs)   # a new assistant turn: another prompt
    assert plain.usage.prompt_tokens != chat.usage.prompt_tokens


@pytest.mark.model
def test_a_stop_sequence_ends_it_and_is_named(srv: Server) -> None:
    msgs = [{"role": "user", "content": "Tell me a story."}]
    whole = _client(srv).messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                         messages=msgs).content[0].text
    words = whole.split()
    assert len(words) >= 3, whole
    stop = words[2]
    cut = _client(srv).messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                       messages=msgs, stop_sequences=["<never>", stop])
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == whole[:whole.index(stop)]
    with _client(srv).messages.stream(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                      messages=msgs, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert final.content[0].text == cut.content[0].text


@pytest.mark.model
def test_tool_use_and_tool_result_round_trip_as_the_chat_calls(srv: Server) -> None:
    """A forced tool (``tool_choice: tool``) is a ``tool_use`` block with the chat call's
    arguments as its input and ``stop_reason`` tool_use; streamed, its ``input_json_delta``
    pieces join to that input. The ``tool_result`` sent back renders the prompt the chat
    request with the call and a ``tool`` message renders. ``any`` calls one of the tools."""
    client = _client(srv)
    r = client.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK,
                               tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    [use] = r.content
    chat = _chat(srv, max_tokens=60, messages=ASK, tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = chat.choices[0].message.tool_calls
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    assert use.input == json.loads(call.function.arguments)
    assert r.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK,
                                tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(pieces) >= 2 and json.loads("".join(pieces)) == use.input
    assert final.content[0].input == use.input and final.stop_reason == "tool_use"
    follow = [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "18 C, sunny"}]}]
    chat_follow = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "18 C, sunny"}]
    after = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=follow,
                                   tools=TOOLS, tool_choice={"type": "none"})
    expect = _chat(srv, max_tokens=8, messages=chat_follow, tools=[WEATHER, TIME],
                   tool_choice="none")
    assert after.content[0].text == expect.choices[0].message.content
    assert _prompt_tokens(after.usage) == expect.usage.prompt_tokens
    anyone = client.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=TOOLS,
                                    tool_choice={"type": "any",
                                                 "disable_parallel_tool_use": True})
    assert [b.type for b in anyone.content] == ["tool_use"]
    assert anyone.content[0].name in ("get_weather", "get_time")


@pytest.mark.model
def test_thinking_switches_the_templates_thinking(srv: Server) -> None:
    """``thinking: disabled`` is ``reasoning_effort: none``: this template then writes an
    empty think block after the generation prompt (count_tokens sees it); ``enabled`` asks for
    a thinking budget, which this server cannot keep (``<think>`` is several tokens of this
    vocabulary), a 400 naming thinking."""
    client = _client(srv)
    plain = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    off = client.messages.count_tokens(model=MODEL, messages=ASK,
                                       thinking={"type": "disabled"}).input_tokens
    status, body = srv.raw("POST", "/tokenize", {
        "model": MODEL, "messages": ASK,
        "chat_template_kwargs": {"enable_thinking": False}}, key=KEY)
    assert status == 200 and off == body["count"] > plain
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["error"]["message"].startswith("thinking: ")


@pytest.mark.model
def test_errors_are_anthropics_and_the_key_may_be_x_api_key(srv: Server) -> None:
    client = _client(srv)
    bad = [({"messages": [{"role": "user", "content": [{"type": "image", "source": {
               "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400),
           ({"messages": ASK, "tools": [{"type": "web_search_20250305",
                                          "name": "web_search"}]}, 400),
           ({"messages": ASK, "tool_choice": {"type": "sometimes"}}, 400),
           ({"messages": [{"role": "system", "content": "x"}]}, 400),
           ({"messages": ASK, "model": "claude-nothing"}, 404),
           ({"messages": ASK, "extra_body": {"vllm_xargs": {"a": 1}}}, 400)]
    for extra, status in bad:
        kw = {"model": MODEL, "max_tokens": 4, **extra}
        with pytest.raises(anthropic.APIStatusError) as info:
            client.messages.create(**kw)
        assert info.value.status_code == status, (extra, info.value.body)
        err = info.value.body
        assert err["type"] == "error" and err["error"]["type"] == {
            400: "invalid_request_error", 404: "not_found_error"}[status], err
    status, body = srv.raw("POST", "/v1/messages", {"model": MODEL, "messages": ASK}, key=KEY)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"   # max_tokens
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        _client(srv, "wrong").messages.create(model=MODEL, max_tokens=2, messages=ASK)
    # the key as x-api-key (Anthropic's documented header, what its older SDKs and curl
    # examples send; the newest SDK sends a Bearer token, as above); a wrong one is a 401 in
    # Anthropic's body
    def post(headers: dict[str, str]) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        try:
            conn.request("POST", "/v1/messages", json.dumps(
                {"model": MODEL, "max_tokens": 2, "messages": ASK}),
                {"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                 **headers})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    status, body = post({"x-api-key": KEY})
    assert status == 200 and body["type"] == "message", body
    # a body nested past Python's json is a 400 in Anthropic's body (the shared parse helper)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request("POST", "/v1/messages", "[" * 100_000 + "]" * 100_000,
                     {"Content-Type": "application/json", "x-api-key": KEY})
        r = conn.getresponse()
        deep = (r.status, json.loads(r.read()))
    finally:
        conn.close()
    assert deep[0] == 400 and "nested too deep" in deep[1]["error"]["message"], deep
    assert deep[1]["type"] == "error"
    status, body = post({"x-api-key": "wrong"})
    assert status == 401 and body["error"]["type"] == "authentication_error", body
    assert post({})[0] == 401


def test_the_request_becomes_the_chat_request() -> None:
    """System blocks and their breakpoint, tool results before the user's text, tool uses as
    calls, earlier thinking dropped, the tool choices and the thinking switch."""
    req = am.MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "stop_sequences": ["x"], "top_k": 3, "stream": True,
        "system": [{"type": "text", "text": "a"},
                   {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"k": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "42"}]},
                {"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral",
                                                                     "ttl": "1h"}}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"}})
    body = am.chat_body(req, "server-model")
    assert body["messages"] == [
        {"role": "system", "content": "ab", "cache_control": {"type": "ephemeral"}},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f",
                                                          "arguments": '{"k": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "user", "content": "thanks", "cache_control": {"type": "ephemeral",
                                                                 "ttl": "1h"}}]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", False)
    assert body["reasoning_effort"] == "none" and body["stop"] == ["x"]
    assert (body["max_tokens"], body["top_k"], body["stream"]) == (5, 3, True)
    assert body["model"] == "m"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    out = am.chat_body(am.MessagesRequest.model_validate({
        "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],
        "cache_control": {"type": "ephemeral"}, "thinking": {"type": "adaptive"},
        "output_config": {"effort": "low", "format": {"type": "json_schema",
                                                      "schema": schema}}}), "s")
    assert out["messages"] == [{"role": "user", "content": "x",
                                "cache_control": {"type": "ephemeral"}}]
    assert out["reasoning_effort"] == "low" and "thinking_token_budget" not in out
    assert out["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": schema}}
    # Claude Code's per-request billing block is left out of the system prompt (it would
    # make every request's prefix its own); a tool result's text blocks join with a newline
    billed = am.chat_body(am.MessagesRequest.model_validate({
        "max_tokens": 2, "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=9f1e;"},
            {"type": "text", "text": "You are an agent."}],
        "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}]}]}]}),
        "s")
    assert billed["messages"] == [{"role": "system", "content": "You are an agent."},
                                  {"role": "tool", "tool_call_id": "t",
                                   "content": "line 1\nline 2"}]
    count = am.CountTokensRequest.model_validate({"messages": [{"role": "user",
                                                                "content": "x"}]})
    assert am.chat_body(count, "server-model") == {
        "model": "server-model", "messages": [{"role": "user", "content": "x"}]}
    # vLLM's extensions are the chat request's fields
    ext = am.chat_body(am.CountTokensRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "cache_salt": "s1",
        "chat_template_kwargs": {"enable_thinking": False}}), "m")
    assert (ext["cache_salt"], ext["chat_template_kwargs"]) == ("s1", {"enable_thinking": False})


def test_the_answer_and_its_stream_are_anthropics() -> None:
    """A chat answer with thinking, text and a call is a message of those three blocks; the
    chat stream of it is the event sequence whose blocks hold the same (any cut of the
    deltas); the stop reasons and the usage split."""
    call = {"id": "c1", "type": "function", "function": {"name": "f",
                                                         "arguments": '{"a": [1, 2]}'}}
    usage = {"prompt_tokens": 40, "completion_tokens": 7,
             "prompt_tokens_details": {"cached_tokens": 16},
             "radixkv": {"cache_write_tokens": 16}}
    chat = {"choices": [{"finish_reason": "tool_calls", "stop_reason": "</tool_call>",
                         "message": {"content": "ok", "reasoning": "think",
                                     "tool_calls": [call]}}], "usage": usage}
    msg = am.message_body("msg_1", "m", chat, None)
    assert msg["content"] == [{"type": "thinking", "thinking": "think", "signature": ""},
                              {"type": "text", "text": "ok"},
                              {"type": "tool_use", "id": "c1", "name": "f",
                               "input": {"a": [1, 2]}}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("tool_use", None)
    assert msg["usage"] == {"input_tokens": 8, "output_tokens": 7,
                            "cache_read_input_tokens": 16, "cache_creation_input_tokens": 16}
    assert am.stop_reason("stop", "x", False, ["x"]) == ("stop_sequence", "x")
    assert am.stop_reason("stop", 2, False, ["x"]) == ("end_turn", None)
    assert am.stop_reason("stop", "y", False, ["x"]) == ("end_turn", None)
    assert am.stop_reason("length", "x", True, ["x"]) == ("max_tokens", None)
    assert am.stop_reason("capacity", None, False, None) == (
        "model_context_window_exceeded", None)

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    deltas = [{"reasoning": "thi"}, {"reasoning": "nk"}, {"content": "o"}, {"content": "k"},
              {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "[1, 2]}"}}]}]
    chunks = [sse({"choices": [{"index": 0, "delta": d, "finish_reason": None}],
                   "usage": {"prompt_tokens": 40, "completion_tokens": 0}}) for d in deltas]
    chunks.append(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls",
                                    "stop_reason": "</tool_call>"}]}))
    chunks.append(sse({"choices": [], "usage": usage}) + "data: [DONE]\n\n")

    async def collect() -> list[dict[str, Any]]:
        async def gen() -> Any:
            for c in chunks:
                yield c.encode()
        out = []
        async for text in am.MessageStream("msg_1", "m", None).adapt(gen()):
            kind, data = text.split("\n")[:2]
            ev = json.loads(data[len("data: "):])
            assert kind == f"event: {ev['type']}"
            out.append(ev)
        return out

    events = asyncio.run(collect())
    # (these chunks' usage has no cache split: the stream starts at the first content)
    assert events[0]["message"]["usage"] == {"input_tokens": 40, "output_tokens": 0,
                                             "cache_read_input_tokens": 0,
                                             "cache_creation_input_tokens": 0}
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"], _json=""))
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            key = {"thinking_delta": "thinking", "text_delta": "text",
                   "input_json_delta": "partial_json"}[d["type"]]
            if key == "partial_json":
                b["_json"] += d[key]
            else:
                b[key] += d[key]
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["_json"])
        del b["_json"]
    assert blocks == msg["content"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == msg["usage"]


def test_the_stream_starts_with_the_prompts_cache_split() -> None:
    """message_start waits for the chat stream's first token, whose usage has the prompt's
    cache split (what it read, what it wrote), and carries it: the role-only first chunk
    starts nothing; a stream that ends before any token still starts before it ends."""
    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    bare = {"prompt_tokens": 40, "completion_tokens": 0, "total_tokens": 40}
    split = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
             "prompt_tokens_details": {"cached_tokens": 32},
             "radixkv": {"cache_read_tokens": 32, "cache_write_tokens": 0}}

    async def events(chunks: list[str]) -> list[dict[str, Any]]:
        async def gen() -> Any:
            for c in chunks:
                yield c
        out = []
        async for text in am.MessageStream("msg_1", "m", None).adapt(gen()):
            out.append(json.loads(text.split("\n")[1][len("data: "):]))
        return out

    got = asyncio.run(events([
        sse({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
             "usage": bare}),
        sse({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
             "usage": split}),
        "data: [DONE]\n\n"]))
    assert got[0]["type"] == "message_start" and got[1]["type"] == "content_block_start"
    assert got[0]["message"]["usage"] == {"input_tokens": 8, "output_tokens": 1,
                                          "cache_read_input_tokens": 32,
                                          "cache_creation_input_tokens": 0}
    got = asyncio.run(events([
        sse({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
             "usage": bare}), "data: [DONE]\n\n"]))
    assert [e["type"] for e in got] == ["message_start", "message_delta", "message_stop"]
