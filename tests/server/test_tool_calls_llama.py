"""Tool calls in Llama 3.x's JSON format (``--tool-call-parser llama3_json``), read and served.

Llama 3.1/3.2/3.3 templates teach the model to answer a call as a bare JSON object,
``{"name": ..., "parameters": {...}}``, several separated by ``;``. The reading is checked on its
own (streamed in any pieces against an independent reading of whole replies), and through a
real server whose template is written in that format (recognized from the template, no flag):
the 135M model was not trained on tools, so the served tests rely on the grammar of a forced
call and on the streamed and non-streamed answers agreeing, not on the model's choices.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from radixkv.server.errors import APIError  # noqa: E402
from radixkv.server.tools import (HERMES, LLAMA3_JSON, PYTHON_TAG, Reader,  # noqa: E402
                                  stop_after, template_format)
from tests.server.test_openai_server import MODEL, Server  # noqa: E402
from tests.server.test_tool_calls import (  # noqa: E402
    ASK, TEMPLATE, TIME, WEATHER, _assemble, _chat, template_server)

# A Llama 3.1-style template: the tools and the format instruction in a system turn, calls in
# history written back as JSON objects, tool results in an "ipython" turn.
LLAMA_TEMPLATE = """{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
To call a function, answer with JSON in the format {"name": function name, "parameters": \
dictionary of argument name and its value}. Do not use variables.
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_header_id|>assistant\
<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": \
{{ tc.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
NAMES = frozenset({"get_weather", "get_time"})


# ------------------------------------------------------------------------------ the reading

def test_the_format_is_read_from_the_template_or_named_by_the_flag() -> None:
    assert template_format(LLAMA_TEMPLATE) == LLAMA3_JSON
    assert template_format(TEMPLATE) == HERMES
    assert template_format(TEMPLATE, "llama3_json") == LLAMA3_JSON   # the flag wins
    assert template_format(LLAMA_TEMPLATE, "hermes") == HERMES
    assert template_format(LLAMA_TEMPLATE, "llama4_json") == LLAMA3_JSON
    with pytest.raises(APIError) as info:   # declares tools, in no format radixkv knows
        template_format("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert info.value.param == "tools" and "--tool-call-parser" in str(info.value)
    assert template_format("{% if tools %}{{ tools | tojson }}{% endif %}",
                           "llama3_json") == LLAMA3_JSON
    with pytest.raises(APIError):   # declares no tools: no flag makes a model call them
        template_format("{{ messages }}", "llama3_json")
    # Qwen3-Coder's / Qwen3.5's XML calls inside <tool_call> are their own format (read as
    # hermes they would all be content: tests/server/test_tool_calls_qwen_xml.py)
    xml = ("{% if tools %}{{ tools | tojson }} Reply <tool_call>\n<function=example_function_"
           "name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n"
           "</tool_call>{% endif %}")
    assert template_format(xml) == "qwen3_xml"
    assert template_format(xml, "hermes") == HERMES   # the operator's word wins


def test_frontend_options_carry_the_parser_and_refuse_an_unknown_one() -> None:
    from radixkv.errors import ConfigError
    from radixkv.server.frontend import FrontendOptions

    opts = FrontendOptions(tool_call_parser="llama3_json")
    assert FrontendOptions(**opts.as_dict()).tool_call_parser == "llama3_json"   # the fleet's
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        FrontendOptions(tool_call_parser="granite")


def _call_text(name: str, args: dict, key: str = "parameters", space: str = " ") -> str:
    return f'{{"name":{space}"{name}",{space}"{key}":{space}{json.dumps(args)}}}'


# Replies made of calls (known and unknown tools, either key, another key order, extra keys),
# separators, JSON that is not a call, broken JSON and text, cut into deltas anywhere.
_PIECES = st.one_of(
    st.builds(_call_text, st.sampled_from(["get_weather", "get_time", "unknown"]),
              st.dictionaries(st.sampled_from(["city", "zone"]),
                              st.text(alphabet="xyz {}\";", max_size=5), max_size=2),
              st.sampled_from(["parameters", "arguments"]), st.sampled_from(["", " ", "\n"])),
    st.just('{"parameters": {"zone": "UTC"}, "name": "get_time"}'),
    st.just('{"name": "get_time", "parameters": {"zone": "}"}, "id": [1, {"a": "]"}]}'),
    st.sampled_from(["; ", ";", " ", "\n", "{}", '{"answer": 42}', "{not json", PYTHON_TAG]),
    st.text(alphabet="ab {}\";\n", max_size=8))


def _reference(text: str, names: frozenset[str], single: bool) -> tuple[str | None, list]:
    """An independent reading of a whole reply with ``json.JSONDecoder.raw_decode``: after
    whitespace and an optional python tag, the leading run of objects (separated by
    whitespace and ``;``) that call a known tool are the calls; the rest is content (the whole
    reply when nothing was called); ``single`` drops every call after the first, and the
    text after it."""
    dec = json.JSONDecoder()
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    calls: list[dict] = []
    pos = 0
    while body.startswith("{", pos):
        try:
            obj, end = dec.raw_decode(body, pos)
        except ValueError:
            break
        if not isinstance(obj, dict) or obj.get("name") not in names:
            break
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"name": obj["name"], "arguments": args if isinstance(args, str)
                      else json.dumps(args, ensure_ascii=False)})
        if single:
            return None, calls
        pos = end
        while pos < len(body) and body[pos] in " \t\n\r;":
            pos += 1
    if not calls:
        return text.strip() or None, []
    return body[pos:].strip() or None, calls


def _stream(reader: Reader, text: str, data: st.DataObject) -> tuple[str, list[dict], int]:
    """``text`` through the reader's stream in random deltas: the content and the calls a
    client assembles."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    stream = reader.stream()
    content, calls = "", {}
    for piece in [*(text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])), None]:
        c, made = stream.feed(piece) if piece is not None else stream.finish()
        content += c
        for d in made:
            if "id" in d:
                assert d["index"] not in calls and isinstance(d["id"], str) and d["id"]
                calls[d["index"]] = dict(d["function"])
            else:
                assert set(d) == {"index", "function"} and d["function"]["arguments"]
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls))) == list(range(stream.num_calls))
    return content, [calls[i] for i in sorted(calls)], stream.num_calls


@settings(max_examples=1000)   # ~2 s: a pure function, cheap examples
@given(st.lists(_PIECES, max_size=8), st.booleans(), st.data())
def test_a_streamed_reply_assembles_what_a_whole_reading_finds(pieces: list[str], single: bool,
                                                              data: st.DataObject) -> None:
    """For any reply, cut into deltas anywhere: what a client assembles from the stream is
    what an independent reading of the whole text finds, and what the non-streamed answer
    holds (with ``parallel_tool_calls: false``, ``single``, too)."""
    text = "".join(pieces)
    reader = Reader(LLAMA3_JSON, NAMES, single)
    content, calls, _ = _stream(reader, text, data)
    want_content, want_calls = _reference(text, NAMES, single)
    assert (content or None, calls) == (want_content, want_calls)
    got_content, got_calls = reader.parse(text)
    assert (got_content, [c["function"] for c in got_calls]) == (want_content, want_calls)
    assert all(c["id"].startswith("call_") for c in got_calls)


_ARGS = st.dictionaries(st.sampled_from(["city", "unit", "path", "text"]),
                        st.one_of(st.text(max_size=20), st.integers(), st.booleans(),
                                  st.lists(st.integers(), max_size=3)), max_size=4)


@settings(max_examples=300)
@given(_ARGS, st.sampled_from(["", " ", "\n  "]), st.data())
def test_arguments_stream_before_the_object_closes_and_a_cut_call_keeps_them(
        args: dict, space: str, data: st.DataObject) -> None:
    """A call's arguments arrive in pieces as they are written, in ``json.dumps`` form
    whatever the model's layout; a reply cut inside them (``max_tokens``) keeps the call with
    the arguments written so far, streamed or not."""
    raw = json.dumps(args, indent=data.draw(st.sampled_from([None, 1])),
                     ensure_ascii=data.draw(st.booleans()))
    head = f'{PYTHON_TAG}{{"name":{space}"get_weather",{space}"parameters": '
    text = head + raw + "}"
    want = json.dumps(args, ensure_ascii=False)
    reader = Reader(LLAMA3_JSON, NAMES)
    content, calls, _ = _stream(reader, text, data)
    assert (content, calls) == ("", [{"name": "get_weather", "arguments": want}])
    _, early = reader.stream().feed(head + raw)   # before the object is closed
    assert "".join(d["function"]["arguments"] for d in early) == want
    cut = text[:data.draw(st.integers(len(head), len(head) + len(raw) - 1))]
    content, calls, _ = _stream(reader, cut, data)
    assert content == "" and len(calls) == 1 and want.startswith(calls[0]["arguments"])
    assert reader.parse(cut)[1][0]["function"] == calls[0]


def test_replies_that_are_not_calls_are_content() -> None:
    reader = Reader(LLAMA3_JSON, NAMES)
    for text in ("It is sunny in Paris.", 'Sure: {"name": "get_weather", "parameters": {}}',
                 '{"name": "book_flight", "parameters": {}}', "{}", "{broken",
                 PYTHON_TAG + '{"answer": 1}', PYTHON_TAG + " {broken"):
        assert reader.parse(text) == (text, []), text
    # calls first, then text: the text is the content
    content, calls = reader.parse('{"name": "get_time", "parameters": {"zone": "UTC"}};\n'
                                  "Checking the time.")
    assert content == "Checking the time." and calls[0]["function"]["name"] == "get_time"
    # a call read whole (name after its arguments), then an object the reply cuts short
    content, calls = reader.parse('{"parameters": {"zone": "UTC"}, "name": "get_time"}{')
    assert content == "{" and calls[0]["function"]["arguments"] == '{"zone": "UTC"}'
    # parallel_tool_calls false: one call; the reply has no tag to stop on, so the engine is
    # not told to stop (a hermes reply's is)
    two = ('{"name": "get_time", "parameters": {"zone": "UTC"}}; '
           '{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert len(reader.parse(two)[1]) == 2
    assert len(Reader(LLAMA3_JSON, NAMES, single=True).parse(two)[1]) == 1
    assert stop_after(False, active=True, forced=False, fmt=LLAMA3_JSON) == ()


# ----------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with template_server(tmp_path_factory, LLAMA_TEMPLATE) as server:
        yield server


@pytest.mark.model
def test_a_named_call_is_a_json_object_and_its_result_goes_back(srv: Server) -> None:
    """A forced call is written in the template's own format (the grammar's shape: the
    object alone, its arguments under ``parameters``), answered as an OpenAI call, and the
    call and its result are rendered back as the template writes them."""
    kw = {"messages": ASK, "tools": [WEATHER, TIME],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = _chat(srv, **kw, extra_body={"return_token_ids": True})   # vLLM's: the reply's tokens
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    status, body = srv.raw("POST", "/detokenize", {"model": MODEL, "tokens": c.token_ids},
                           key=None)   # the object, then the end-of-turn token
    obj, end = json.JSONDecoder().raw_decode(body["prompt"])
    assert status == 200 and obj == {"name": "get_weather", "parameters": args}
    assert body["prompt"][end:] == "<|im_end|>"
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    status, tok = srv.raw("POST", "/tokenize", {"model": MODEL, "messages": follow,
                                                 "tools": [WEATHER]}, key=None)
    assert status == 200
    status, text = srv.raw("POST", "/detokenize", {"model": MODEL, "tokens": tok["tokens"]},
                           key=None)
    assert '{"name": "get_weather", "parameters": {"city"' in text["prompt"]
    assert "ipython<|end_header_id|>\n\n18 C, sunny" in text["prompt"]
    r2 = _chat(srv, messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=4)
    assert r2.choices[0].message.tool_calls is None


@pytest.mark.model
def test_required_calls_stream_as_the_non_streamed_ones(srv: Server) -> None:
    sampled = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "n": 2,
               "temperature": 1.0, "seed": 7}
    ref = _chat(srv, **sampled)
    content, calls, finish = _assemble(_chat(srv, stream=True, **sampled))
    assert finish == {0: "tool_calls", 1: "tool_calls"} and not any(content.values())
    for c in ref.choices:
        (call,) = c.message.tool_calls
        (got,) = calls[c.index].values()
        assert got["id"] and got["name"] == call.function.name in ("get_weather", "get_time")
        assert got["arguments"] == call.function.arguments   # the same text, in pieces
        json.loads(got["arguments"])
    pieces = [tc for ch in _chat(srv, stream=True, **{**sampled, "n": 1}) for c in ch.choices
              for tc in c.delta.tool_calls or () if tc.function and tc.function.arguments]
    assert len(pieces) >= 3 and not any(tc.id for tc in pieces)


@pytest.mark.model
def test_required_may_call_several_tools_separated_by_semicolons(srv: Server) -> None:
    """``required`` allows one or more calls, written ``{...}; {...}`` in this format: kept from
    ending by a -100 bias on its end tokens, the model writes calls until ``max_tokens``, and
    the stream assembles the non-streamed answer; with ``parallel_tool_calls: false``, one."""
    kw = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 90, "logit_bias": {"0": -100, "2": -100}}
    whole = _chat(srv, **kw).choices[0]
    assert whole.finish_reason == "length" and len(whole.message.tool_calls) >= 2, whole
    for call in whole.message.tool_calls[:-1]:
        json.loads(call.function.arguments)
    content, calls, finish = _assemble(_chat(srv, stream=True, **kw))
    # (a last call cut before its header is complete is content, streamed or not)
    assert finish == {0: "length"}
    assert content.get(0) == whole.message.content or (
        not content.get(0) and whole.message.content is None)
    assert [(c["name"], c["arguments"]) for c in calls[0].values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    one = _chat(srv, **kw, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1


@pytest.mark.model
def test_auto_replies_agree_streamed_or_not(srv: Server) -> None:
    for extra in ({}, {"parallel_tool_calls": False}):
        kw = {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 40,
              **extra}
        whole = _chat(srv, **kw).choices[0]
        content, calls, finish = _assemble(_chat(srv, stream=True, **kw))
        assert content.get(0) == whole.message.content or (
            not content.get(0) and whole.message.content is None)
        assert [c["name"] for c in calls.get(0, {}).values()] == [
            c.function.name for c in whole.message.tool_calls or ()]
        assert finish[0] == whole.finish_reason
    none = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    auto = _chat(srv, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=1)
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens   # tools not rendered
