"""OpenAI tool calls through the real server, with a chat template that declares tools.

The embedded model's own template declares none (tests/server/test_openai_server.py checks the
400), so this module's server takes a Hermes-style template with ``--chat-template`` (the format
Qwen2.5, Hermes and SmolLM3 templates use). The 135M model was not trained on tools, so the
tests rely on what does not depend on its skill: ``required`` and named choices are enforced by
a grammar, and parsing is checked on its own.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from radixkv.server.tools import CALL_CLOSE, CALL_OPEN, CallStream, parse  # noqa: E402
from tests.server.test_openai_server import MODEL, Server, _free_port, running_server  # noqa: E402

TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>
{% endif %}{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
        "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@contextlib.contextmanager
def template_server(tmp_path_factory: pytest.TempPathFactory, template: str,
                    *extra: str) -> Iterator[Server]:
    """A real server of the embedded model (float32, one thread) rendering chats with
    ``template`` (``--chat-template``): the tool-call modules' module server."""
    path = tmp_path_factory.mktemp("tpl") / "tools.jinja"
    path.write_text(template)
    with running_server(["--chat-template", str(path), "--device-blocks", "256", "--threads",
                         "1", "--device", "cpu", "--dtype", "float32", *extra]) as server:
        yield server


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with template_server(tmp_path_factory, TEMPLATE, "--reasoning-parser", "qwen3") as server:
        yield server


def _chat(srv: Server, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=300)
    return client.chat.completions.create(model=MODEL, **{"temperature": 0, "max_tokens": 60,
                                                          **kw})


@pytest.mark.model
def test_a_named_tool_choice_is_one_valid_call_of_that_tool(srv: Server) -> None:
    r = _chat(srv, messages=ASK, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")


@pytest.mark.model
def test_required_calls_one_of_the_tools_and_the_result_goes_back(srv: Server) -> None:
    r = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", n=2,
              temperature=1.0, seed=5)
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    call = r.choices[0].message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    r2 = _chat(srv, messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=8)
    assert r2.choices[0].message.tool_calls is None
    # the call and its result were rendered into the prompt (tools not offered: "none")
    alone = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice="none", max_tokens=1)
    assert r2.usage.prompt_tokens >= alone.usage.prompt_tokens + 20


@pytest.mark.model
def test_required_may_call_several_tools_unless_parallel_calls_are_off(srv: Server) -> None:
    """``required`` is one or more calls (OpenAI's and vLLM's meaning), streamed as the
    non-streamed answer; ``parallel_tool_calls: false`` makes it exactly one. The model is
    kept from ending after a call by a -100 ``logit_bias`` on its end tokens, so where the
    grammar lets another call follow, it writes calls until ``max_tokens`` (the last one cut
    short keeps the arguments it has), and where it does not, the end token is all it allows."""
    ends = {"0": -100, "2": -100}   # <|endoftext|>, <|im_end|>
    kw = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 90, "logit_bias": ends}
    whole = _chat(srv, **kw).choices[0]
    assert whole.finish_reason == "length" and len(whole.message.tool_calls) >= 2, whole
    for call in whole.message.tool_calls[:-1]:   # complete calls, each valid
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)
    content, calls, finish = _assemble(_chat(srv, stream=True, **kw))
    # (a last call cut before its header is complete is content, streamed or not)
    assert finish == {0: "length"}
    assert content.get(0) == whole.message.content or (
        not content.get(0) and whole.message.content is None)
    assert [(c["name"], c["arguments"]) for c in calls[0].values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    one = _chat(srv, **kw, parallel_tool_calls=False, n=3, temperature=1.0, seed=3)
    for c in one.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c


@pytest.mark.model
def test_auto_and_none(srv: Server) -> None:
    auto = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=40)
    c = auto.choices[0]
    assert c.message.tool_calls or c.message.content   # the model's own choice, well-formed
    one = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=40,
                parallel_tool_calls=False).choices[0].message
    assert len(one.tool_calls or []) <= 1 and (one.tool_calls or one.content)
    none = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens   # tools not rendered
    status, err = srv.raw("POST", "/v1/chat/completions", {
        "model": MODEL, "messages": ASK, "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}}}, key=None)
    assert status == 400 and err["error"]["param"] == "tool_choice"


def check_required_and_auto(srv: Server, closing: tuple[str, ...] = ()) -> None:
    """What the tool-call modules' servers check alike: ``required`` with the end tokens (and
    ``closing``, the tokens that would end a list of calls) biased out writes calls until
    ``max_tokens``, at least two, streamed as the non-streamed answer; with
    ``parallel_tool_calls: false`` exactly one; ``auto`` streamed as not."""
    from radixkv.models import load_tokenizer

    tok = load_tokenizer()
    bias = {"0": -100, "2": -100,
            **{str(tok.convert_tokens_to_ids(t)): -100 for t in closing}}
    kw = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 90, "logit_bias": bias}
    whole = _chat(srv, **kw).choices[0]
    assert len(whole.message.tool_calls) >= 2, whole
    content, calls, finish = _assemble(_chat(srv, stream=True, **kw))
    assert finish == {0: whole.finish_reason}
    assert [(c["name"], c["arguments"]) for c in calls[0].values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content.get(0) == whole.message.content or (
        not content.get(0) and whole.message.content is None)
    one = _chat(srv, **kw, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    auto = {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 30}
    whole = _chat(srv, **auto).choices[0]
    content, calls, finish = _assemble(_chat(srv, stream=True, **auto))
    assert content.get(0) == whole.message.content or (
        not content.get(0) and whole.message.content is None)


def rendered(srv: Server, messages: list[dict[str, Any]]) -> str:
    """The prompt text the server's template makes of ``messages`` (``/tokenize``, then
    ``/detokenize``): how a history's calls and results render back."""
    status, tok = srv.raw("POST", "/tokenize", {"model": MODEL, "messages": messages},
                          key=None)
    assert status == 200, tok
    status, text = srv.raw("POST", "/detokenize", {"model": MODEL, "tokens": tok["tokens"]},
                           key=None)
    assert status == 200, text
    prompt: str = text["prompt"]
    return prompt


def _assemble(chunks: Any) -> tuple[dict[int, str], dict[int, dict[int, Any]], dict[int, str]]:
    """Per choice: the content, the tool calls by index (fields merged over deltas, the
    arguments concatenated, as OpenAI's stream helpers do) and the finish reason."""
    content: dict[int, str] = {}
    calls: dict[int, dict[int, Any]] = {}
    finish: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            if c.delta.content:
                content[c.index] = content.get(c.index, "") + c.delta.content
            for tc in c.delta.tool_calls or ():
                got = calls.setdefault(c.index, {}).setdefault(
                    tc.index, {"id": None, "name": None, "arguments": ""})
                got["id"] = tc.id or got["id"]
                if tc.function is not None:
                    got["name"] = tc.function.name or got["name"]
                    got["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return content, calls, finish


@pytest.mark.model
def test_a_streamed_call_is_the_non_streamed_one(srv: Server) -> None:
    kw = {"messages": ASK, "tools": [WEATHER, TIME],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = _chat(srv, **kw).choices[0]
    content, calls, finish = _assemble(_chat(srv, stream=True, **kw))
    (call,) = whole.message.tool_calls
    (got,) = calls[0].values()
    assert finish == {0: "tool_calls"} and not content.get(0) and whole.message.content is None
    assert got["id"] and got["name"] == call.function.name == "get_weather"
    assert got["arguments"] == call.function.arguments   # the same text, sent in pieces:
    pieces = [tc for ch in _chat(srv, stream=True, **kw) for c in ch.choices
              for tc in c.delta.tool_calls or () if tc.function and tc.function.arguments]
    assert len(pieces) >= 3 and not any(tc.id for tc in pieces)
    # n = 2 sampled calls, each choice its own call stream; "required" picks a tool per choice
    sampled = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "n": 2,
               "temperature": 1.0, "seed": 11}
    ref = _chat(srv, **sampled)
    content, calls, finish = _assemble(_chat(srv, stream=True, **sampled))
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for c in ref.choices:
        (call,) = c.message.tool_calls
        (got,) = calls[c.index].values()
        assert (got["name"], json.loads(got["arguments"])) == (
            call.function.name, json.loads(call.function.arguments))


@pytest.mark.model
def test_streamed_auto_content_is_the_non_streamed_content(srv: Server) -> None:
    # the 135M model mostly answers in text with "auto": the content must match to the
    # character (held-back tag starts and whitespace included), whatever it wrote
    kw = {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 40}
    whole = _chat(srv, **kw).choices[0]
    content, calls, finish = _assemble(_chat(srv, stream=True, **kw))
    assert content.get(0) == whole.message.content or (
        not content.get(0) and whole.message.content is None)
    assert [c["name"] for c in calls.get(0, {}).values()] == [
        c.function.name for c in whole.message.tool_calls or ()]
    assert finish[0] == whole.finish_reason


# Replies made of text (with tag-like fragments), calls of known and unknown tools, broken
# JSON, unclosed blocks and whitespace, cut into deltas anywhere.
_PIECES = st.one_of(
    st.text(alphabet="ab <>/_tolc\n{}\"", max_size=12),
    st.sampled_from([CALL_OPEN, CALL_CLOSE, " ", "\n", "<tool", "</tool_", "<tool_call"]),
    st.builds(lambda name, city: (f'{CALL_OPEN}\n{{"name": "{name}", "arguments": '
                                  f'{{"city": "{city}"}}}}\n{CALL_CLOSE}'),
              st.sampled_from(["get_weather", "get_time", "unknown"]),
              st.text(alphabet="xyz <>", max_size=5)),
    st.just(f"{CALL_OPEN}{{not json}}{CALL_CLOSE}"))


_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


def _reference_parse(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """An independent reading of a whole reply (the regular expression the server used before
    calls streamed in pieces): each closed block whose JSON calls a known tool is a call, its
    arguments ``json.dumps`` of the parsed value; the rest is content."""
    calls, kept, pos = [], [], 0
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"name": obj["name"], "arguments": args if isinstance(args, str)
                      else json.dumps(args, ensure_ascii=False)})
    kept.append(text[pos:])
    return ("".join(kept).strip() or None), calls


def _stream(text: str, data: st.DataObject, names: set[str]) -> tuple[str, list[dict], Any]:
    """``text`` through a CallStream in random deltas: the content and the calls a client
    assembles (deltas of one ``index`` joined: the first names it, the rest add arguments)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    stream = CallStream(names)
    content, calls = "", {}
    for piece in [*(text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])), None]:
        c, made = stream.feed(piece) if piece is not None else stream.finish()
        content += c
        for d in made:
            if "id" in d:
                assert d["index"] not in calls and d["id"].startswith("call_")
                calls[d["index"]] = dict(d["function"])
            else:
                assert set(d) == {"index", "function"} and d["function"]["arguments"]
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls))) == list(range(stream.num_calls))
    return content, [calls[i] for i in sorted(calls)], stream


@settings(max_examples=400)   # ~2 s: a pure function, cheap examples
@given(st.lists(_PIECES, max_size=10), st.data())
def test_call_stream_assembles_what_a_whole_reading_finds(pieces: list[str],
                                                          data: st.DataObject) -> None:
    """For any reply made of text, calls and broken blocks, cut into deltas anywhere: what a
    client assembles from the stream is what an independent reading of the whole text finds,
    and what the non-streamed answer (``parse``) holds."""
    text = "".join(pieces)
    names = {"get_weather", "get_time"}
    content, calls, _ = _stream(text, data, names)
    want_content, want_calls = _reference_parse(text, names)
    assert content == (want_content or "")
    assert calls == want_calls
    got_content, got_calls = parse(text, names)
    assert (got_content, [c["function"] for c in got_calls]) == (want_content, want_calls)


_ARGS = st.dictionaries(st.sampled_from(["city", "unit", "path", "text"]),
                        st.one_of(st.text(max_size=20), st.integers(), st.booleans(),
                                  st.lists(st.integers(), max_size=3)), max_size=4)


@settings(max_examples=300)
@given(_ARGS, st.sampled_from(["", " ", "\n  "]), st.data())
def test_arguments_stream_in_pieces_and_a_cut_call_keeps_what_it_has(
        args: dict, space: str, data: st.DataObject) -> None:
    """A call's arguments arrive in pieces as they are written (before its closing tag), in
    ``json.dumps`` form whatever the model's layout; a reply cut inside them (``max_tokens``)
    keeps the call with the arguments written so far, streamed or not."""
    raw = json.dumps(args, indent=data.draw(st.sampled_from([None, 1])),
                     ensure_ascii=data.draw(st.booleans()))
    head = f'Sure.{CALL_OPEN}\n{{"name":{space}"get_weather",{space}"arguments": '
    text = head + raw + "}\n" + CALL_CLOSE
    want = json.dumps(args, ensure_ascii=False)
    content, calls, _ = _stream(text, data, {"get_weather"})
    assert (content, calls) == ("Sure.", [{"name": "get_weather", "arguments": want}])
    stream = CallStream({"get_weather"})
    _, early = stream.feed(head + raw)   # the arguments, before the call is closed
    assert "".join(d["function"]["arguments"] for d in early) == want
    cut = text[:data.draw(st.integers(len(head), len(head) + len(raw) - 1))]
    content, calls, _ = _stream(cut, data, {"get_weather"})
    assert content == "Sure." and len(calls) == 1 and want.startswith(calls[0]["arguments"])
    assert parse(cut, {"get_weather"})[1][0]["function"] == calls[0]


@pytest.mark.model
def test_chat_template_kwargs_reach_the_template(srv: Server) -> None:
    """vLLM's ``chat_template_kwargs`` (here Qwen3's ``enable_thinking``, read by this
    module's template): rendered into the prompt of a chat, of a chat with tools and of
    ``/tokenize``, and the cached prefix is shared up to where the variable changes it."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    status, plain = srv.raw("POST", "/tokenize", {"model": MODEL, "messages": ASK}, key=None)
    status2, thin = srv.raw("POST", "/tokenize", {"model": MODEL, "messages": ASK, **off},
                            key=None)
    assert status == status2 == 200
    assert thin["tokens"][:plain["count"]] == plain["tokens"]
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0,
                                       extra_body=off)
    assert r.usage.prompt_tokens == thin["count"] > plain["count"]
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, temperature=0, tools=[WEATHER],
        tool_choice="auto", extra_body=off)
    r0 = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                        temperature=0, tools=[WEATHER], tool_choice="auto")
    assert r.usage.prompt_tokens == r0.usage.prompt_tokens + thin["count"] - plain["count"]


@pytest.mark.model
def test_tools_beside_response_format(srv: Server) -> None:
    """``response_format`` shapes a reply that is not a call: with ``auto`` every sample is
    valid calls or a valid JSON value (one grammar, the union of the two), with ``none`` the
    JSON value, with ``required`` a call; streamed too."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    r = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", response_format=fmt,
              n=6, temperature=1.0, seed=2, max_tokens=80)
    # both shapes occur with this seed (float32: the same samples every run)
    assert {bool(c.message.tool_calls) for c in r.choices} == {True, False}
    for c in r.choices:
        if c.message.tool_calls:   # one call or several; the last may be cut by max_tokens
            assert c.message.content is None
            for i, call in enumerate(c.message.tool_calls):
                assert call.function.name in ("get_weather", "get_time")
                if c.finish_reason != "length" or i < len(c.message.tool_calls) - 1:
                    json.loads(call.function.arguments)
        else:
            assert set(json.loads(c.message.content)) == {"answer"}, c
    r = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="none", response_format=fmt,
              max_tokens=80)
    c = r.choices[0]
    assert c.message.tool_calls is None and set(json.loads(c.message.content)) == {"answer"}
    r = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="required", response_format=fmt,
              parallel_tool_calls=False)
    assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"
    content, calls, finish = _assemble(_chat(srv, messages=ASK, tools=[WEATHER],
                                             tool_choice="none", response_format=fmt,
                                             max_tokens=80, stream=True))
    assert set(json.loads(content[0])) == {"answer"} and not calls


@pytest.mark.model
def test_tools_with_documents_and_cache_breakpoints(srv: Server) -> None:
    """Tools beside RAG ``documents`` (placed before the last user message, the tools rendered
    too; the documents' blocks are reused in another order) and beside ``cache_control``
    marks and ``prompt_cache_retention`` (their positions in the prompt the tools are
    rendered into)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    a = "Paris is the capital of France and has a mild oceanic climate. " * 3
    b = "Rome is the capital of Italy and has hot, dry summers in most years. " * 3
    first = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                  extra_body={"documents": [a, b]})
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    alone = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    assert first.usage.prompt_tokens > alone.usage.prompt_tokens + 40   # the documents are in
    swapped = _chat(srv, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                    extra_body={"documents": [b, a]})
    # both documents' blocks come from their entries, not only the shared head
    assert swapped.usage.prompt_tokens_details.cached_tokens > \
        alone.usage.prompt_tokens_details.cached_tokens + 40
    system = {"role": "system", "content": "You answer weather questions. " * 8,
              "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    for _ in range(2):
        r = _chat(srv, messages=[system, *ASK], tools=[WEATHER], tool_choice="auto",
                  max_tokens=2, extra_body={"prompt_cache_retention": "in_memory"})
    assert r.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.model
def test_reasoning_parser_puts_the_thinking_apart(srv: Server) -> None:
    """``--reasoning-parser qwen3``: a reply that thinks (forced here by a regex, since the
    135M model was not trained to) has its thinking in ``reasoning`` and
    ``reasoning_content``, the answer in ``content``, streamed or not; a reply without
    ``<think>`` is all content."""
    import re

    form = r"<think>[a-z]{1,8}( [a-z]{1,8}){0,3}</think>(yes|no)"
    kw = {"messages": ASK, "temperature": 1.0, "seed": 3, "max_tokens": 40,
          "extra_body": {"structured_outputs": {"regex": form}}}
    whole = _chat(srv, **kw)
    msg = whole.choices[0].message
    extra = msg.model_extra
    assert re.fullmatch(r"[a-z]{1,8}( [a-z]{1,8}){0,3}", extra["reasoning"]), extra
    assert extra["reasoning_content"] == extra["reasoning"] and msg.content in ("yes", "no")
    reasoning = content = ""
    for ch in _chat(srv, stream=True, **kw):
        for c in ch.choices:
            d = c.delta.model_extra or {}
            reasoning += d.get("reasoning") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (extra["reasoning"], msg.content)
    kw["extra_body"] = {**kw["extra_body"], "include_reasoning": False}   # vLLM's: left out
    hidden = _chat(srv, **kw).choices[0].message
    assert hidden.model_extra["reasoning"] is None and hidden.content == msg.content
    plain = _chat(srv, messages=ASK, max_tokens=6).choices[0].message
    assert plain.model_extra["reasoning"] is None and plain.content


@pytest.mark.model
def test_a_call_written_while_thinking_ends_the_thinking(srv: Server) -> None:
    """With tools offered, a ``<tool_call>`` the model opens before ``</think>`` ends the
    thinking (as vLLM's Qwen3 parser reads it): the call is read from the answer, streamed
    or not, instead of being lost in the reasoning. The reply is forced by a regex (the
    135M model does not think); with tools and a constraint the grammar is calls or the
    constraint, and the model prefers calling, so a bias on the token after ``<`` in
    ``<think>`` makes it take the constraint's branch."""
    import re

    from radixkv.models import load_tokenizer

    think = load_tokenizer().encode("<think>", add_special_tokens=False)[1]
    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "celsius"}}\n</tool_call>')
    form = r"<think>[a-z]{1,8}\n" + re.escape(call)
    kw = {"messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 60,
          "logit_bias": {str(think): 100},
          "extra_body": {"structured_outputs": {"regex": form}}}
    c = _chat(srv, **kw).choices[0]
    assert re.fullmatch(r"[a-z]{1,8}\n", c.message.model_extra["reasoning"]), c
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (got,) = c.message.tool_calls
    assert (got.function.name, json.loads(got.function.arguments)) == (
        "get_weather", {"city": "Oslo", "unit": "celsius"})
    reasoning = ""
    chunks = list(_chat(srv, stream=True, **kw))
    for ch in chunks:
        for x in ch.choices:
            reasoning += (x.delta.model_extra or {}).get("reasoning") or ""
    content, calls, finish = _assemble(chunks)
    assert reasoning == c.message.model_extra["reasoning"] and not content.get(0)
    assert [(x["name"], x["arguments"]) for x in calls[0].values()] == [
        (got.function.name, got.function.arguments)] and finish == {0: "tool_calls"}


@pytest.mark.model
def test_tokenize_renders_the_tools_as_the_chat_does(srv: Server) -> None:
    """vLLM's ``/tokenize`` with ``tools``: the chat request's prompt, token for token."""
    status, tok = srv.raw("POST", "/tokenize", {"model": MODEL, "messages": ASK,
                                                "tools": [WEATHER], "return_token_strs": True},
                          key=None)
    r = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=1,
              extra_body={"return_token_ids": True})
    assert status == 200 and tok["tokens"] == r.model_extra["prompt_token_ids"]
    assert len(tok["token_strs"]) == tok["count"] and "".join(tok["token_strs"])
    _, bare = srv.raw("POST", "/tokenize", {"model": MODEL, "messages": ASK}, key=None)
    assert bare["count"] < tok["count"]


@pytest.mark.model
def test_reset_prefix_cache_is_404_without_the_flag(srv: Server) -> None:
    status, err = srv.raw("POST", "/reset_prefix_cache", key=None)
    assert status == 404 and "--enable-cache-reset" in err["error"]["message"]


def test_parallel_tool_calls_false_ends_an_auto_reply_after_its_first_call() -> None:
    """The reply's end, per ``parallel_tool_calls`` (the engine keeps a ``stop_after`` string
    in the text: tests/engine/test_engine_correctness.py); the call it ends on is parsed."""
    from radixkv.server.tools import stop_after

    assert stop_after(False, active=True, forced=False) == (CALL_CLOSE,)
    assert stop_after(True, active=True, forced=False) == ()
    assert stop_after(None, active=True, forced=False) == ()
    assert stop_after(False, active=True, forced=True) == ()    # the grammar makes one call
    assert stop_after(False, active=False, forced=False) == ()  # tool_choice none
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' + \
        CALL_CLOSE
    content, calls = parse(text, {"get_weather"})
    assert content == "Sure." and len(calls) == 1


def test_broken_arguments_keep_their_valid_part_and_drop_the_rest() -> None:
    text = (f'{CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo", oops}}}}'
            f'{CALL_CLOSE} done')
    content, calls = parse(text, {"get_weather"})
    assert content == "done"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", '}
    # arguments written as a string holding JSON are that string's text
    text = f'{CALL_OPEN}{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}{CALL_CLOSE}'
    assert parse(text, {"f"})[1][0]["function"]["arguments"] == '{"a": 1}'
    # another key order is parsed whole at the closing tag
    text = f'{CALL_OPEN}{{"arguments": {{"a": 1}}, "name": "f"}}{CALL_CLOSE}'
    assert parse(text, {"f"})[1][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_parse_takes_well_formed_calls_of_known_tools_and_leaves_the_rest() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
            '<tool_call>{not json}</tool_call>')
    content, calls = parse(text, {"get_weather"})
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert content.startswith("Let me check.") and "unknown" in content and "not json" in content
    assert parse("plain answer", {"f"}) == ("plain answer", [])


def test_the_template_file_must_exist() -> None:
    proc = subprocess.run([sys.executable, "-m", "radixkv.server.cli", "--chat-template",
                           str(Path("/nonexistent/t.jinja")), "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--chat-template" in proc.stderr


# ----------------------------------------------------------------------------- Responses API

def _flat(tool: dict) -> dict:
    """A chat tool in the Responses API's flat form."""
    return {"type": "function", **tool["function"]}


def _responses(srv: Server) -> Any:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0,
                         timeout=300).responses


@pytest.mark.model
def test_responses_function_calls_and_their_outputs_round_trip(srv: Server) -> None:
    """A forced call comes back as a ``function_call`` item (the chat reply's call); its
    output goes back as a ``function_call_output`` item, continuing the stored conversation
    or sent whole with the call as items, and the next reply is the chat reply to that
    history. Streamed, the call is an item with its argument events."""
    r = _responses(srv)
    tools = [_flat(WEATHER), _flat(TIME)]
    named = {"type": "function", "name": "get_weather"}
    first = r.create(model=MODEL, input=ASK[0]["content"], tools=tools, tool_choice=named,
                     temperature=0, max_output_tokens=60)
    [call] = [it for it in first.output if it.type == "function_call"]
    chat = _chat(srv, messages=ASK, tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [chat_call] = chat.choices[0].message.tool_calls
    assert (call.name, call.arguments) == ("get_weather", chat_call.function.arguments)
    assert call.call_id and call.status == "completed" and first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}]
    expect = _chat(srv, messages=follow, tools=[WEATHER, TIME], tool_choice="none",
                   max_tokens=8)
    stored = r.create(model=MODEL, previous_response_id=first.id, input=[result], tools=tools,
                      tool_choice="none", temperature=0, max_output_tokens=8)
    whole = r.create(model=MODEL, input=[ASK[0], {"type": "function_call", "call_id":
                                                  call.call_id, "name": call.name,
                                                  "arguments": call.arguments}, result],
                     tools=tools, tool_choice="none", temperature=0, max_output_tokens=8)
    for got in (stored, whole):
        assert got.output_text == expect.choices[0].message.content
        assert got.usage.input_tokens == expect.usage.prompt_tokens
    assert stored.usage.input_tokens_details.cached_tokens >= 32
    # what each answered, as items: the call and its output among them
    for got in (stored, whole):
        items = r.input_items.list(got.id, order="asc").data
        assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
        assert (items[1].call_id, items[1].name, items[1].arguments) == (
            call.call_id, call.name, call.arguments)
        assert (items[2].call_id, items[2].output) == (call.call_id, "18 C, sunny")
    events = list(r.create(model=MODEL, input=ASK[0]["content"], tools=tools,
                           tool_choice=named, temperature=0, max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"], kinds
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"], kinds
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"} and \
        len(kinds) - 6 >= 3   # the arguments in pieces, as they were written
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert "".join(e.delta for e in events[3:-3]) == events[-3].arguments == call.arguments
    [streamed] = events[-1].response.output
    assert (streamed.name, streamed.arguments, streamed.call_id) == (
        call.name, call.arguments, events[2].item.call_id)


@pytest.mark.model
def test_responses_reasoning_is_an_item_before_the_message(srv: Server) -> None:
    """With ``--reasoning-parser``, the thinking is a ``reasoning`` item (its text the chat
    reply's ``reasoning``) before the message item, streamed as ``reasoning_text`` events."""
    form = r"<think>[a-z]{1,8}( [a-z]{1,8}){0,3}</think>(yes|no)"
    kw = {"model": MODEL, "input": ASK[0]["content"], "temperature": 1.0, "max_output_tokens": 40,
          "extra_body": {"structured_outputs": {"regex": form}, "seed": 3}}
    whole = _responses(srv).create(**kw)
    chat = _chat(srv, messages=ASK, temperature=1.0, seed=3, max_tokens=40,
                 extra_body={"structured_outputs": {"regex": form}}).choices[0].message
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].text == chat.model_extra["reasoning"]
    assert whole.output_text == chat.content
    events = list(_responses(srv).create(stream=True, **kw))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == chat.model_extra["reasoning"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        chat.content
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning", "message"]
    # vLLM's include_reasoning: false leaves the reasoning item out, the message the same
    hidden = _responses(srv).create(**{**kw, "extra_body": {**kw["extra_body"],
                                                           "include_reasoning": False}})
    assert [it.type for it in hidden.output] == ["message"]
    assert hidden.output_text == chat.content
