"""Tool calls in Qwen3-Coder's XML format (``--tool-call-parser qwen3_coder``), read and served.

Qwen3-Coder's, Qwen3.5's and later Qwen templates teach the model to write a call as tags, one
per parameter, the values as plain text::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The values are typed by the tool's JSON schema (a string stays text, a number, boolean, array
or object is read as one). The reading is checked on its own (any reply, streamed in any
pieces, against an independent reading of the whole), and through a real server whose template
writes calls that way (the format is recognized from the template).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from radixkv.server.tools import (CALL_CLOSE, CALL_OPEN, PARSERS, QWEN3_XML,  # noqa: E402
                                  XML_FUNC, XML_FUNC_END, XML_PARAM, XML_PARAM_END, Reader,
                                  grammar_shape, stop_after, template_format, typed_value)
from tests.server.test_openai_server import MODEL, Server  # noqa: E402
from tests.server.test_tool_calls import (  # noqa: E402
    ASK, WEATHER, _chat, check_required_and_auto, rendered, template_server)
from tests.server.test_tool_calls_llama import _stream  # noqa: E402

# A Qwen3-Coder-style template: the tools in the system turn with the call format spelled out,
# an assistant's calls written back as tags (objects and lists as JSON, the rest as text), a
# tool's result as a user turn.
QWEN_XML_TEMPLATE = """{%- if tools %}<|im_start|>system
You have these functions:
<tools>
{%- for tool in tools %}
<function><name>{{ tool.function.name }}</name><parameters>{{ tool.function.parameters | tojson }}\
</parameters></function>
{%- endfor %}
</tools>
To call one, reply with:
<tool_call>
<function=example_function_name>
<parameter=example_parameter>
value
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for tc in message.tool_calls %}
{{- '\n<tool_call>\n<function=' + tc.function.name + '>\n' }}
{%- for key, value in tc.function.arguments | items %}
{{- '<parameter=' + key + '>\n' }}
{%- if value is mapping or (value is sequence and value is not string) %}{{ value | tojson }}
{%- else %}{{ value | string }}{% endif %}
{{- '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
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
{% endif %}"""
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "hourly": {"type": "boolean"}},
        "required": ["city", "days", "hourly"], "additionalProperties": False}}}
NAMES = frozenset({"get_weather", "get_time"})
PARAMS = {"get_weather": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
    "tags": {"type": "array"}, "note": {"type": ["string", "null"]}}}}
TYPED = {"days", "hourly", "tags", "note"}   # keys of get_weather not typed as text alone


# ------------------------------------------------------------------------------ the reading

def test_the_format_is_read_from_the_template_or_named() -> None:
    assert template_format(QWEN_XML_TEMPLATE) == QWEN3_XML
    plain = "{% if tools %}{{ tools }}{% endif %}"
    assert template_format(plain, "qwen3_coder") == template_format(plain, "qwen3_xml") \
        == QWEN3_XML
    assert PARSERS["qwen3_coder"] == PARSERS["qwen3_xml"] == QWEN3_XML
    shape = grammar_shape(QWEN3_XML)
    assert (shape.open_tag, shape.close_tag, shape.style) == (CALL_OPEN, CALL_CLOSE, "qwen_xml")
    # one call with parallel_tool_calls false: the reply ends at its first closing tag
    assert stop_after(False, True, False, QWEN3_XML) == (CALL_CLOSE,)


@pytest.mark.parametrize("raw, schema, want", [
    ("Paris", {"type": "string"}, "Paris"),
    (" 42 ", {"type": "string"}, " 42 "),              # text stays text, spaces and all
    ("42", {"type": "integer"}, 42),
    ("3.0", {"type": "integer"}, 3),                   # an integral number
    ("2.5", {"type": "number"}, 2.5),
    ("7", {"type": "number"}, 7),
    ("true", {"type": "boolean"}, True),
    ("False", {"type": "boolean"}, False),
    ("1", {"type": "boolean"}, True),
    ("null", {"type": ["string", "null"]}, None),
    ("none", {"type": ["string", "null"]}, "none"),
    ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2]", {"type": "object"}, [1, 2]),            # not the type: read as JSON
    ("x", {"type": "integer"}, "x"),                   # not JSON at all: the text
    ("NaN", {"type": "number"}, "NaN"),                # not a JSON number
    ("1e999", {"type": "number"}, "1e999"),            # not finite
    ("5", {"enum": [1, 5, 9]}, 5),                     # the enum's values give the type
    ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
    ("5", None, "5"),                                  # no schema: text
    # inside an object or array, strings typed by their sub-schemas (vLLM's parser too)
    ('{"days": "3", "name": "42", "x": "7", "tags": ["true", "0", 1]}',
     {"type": "object", "properties": {"days": {"type": "integer"}, "name": {"type": "string"},
                                       "tags": {"type": "array",
                                                "items": {"type": "boolean"}}}},
     {"days": 3, "name": "42", "x": "7", "tags": [True, False, 1]}),
    ('["1", "2.5"]', {"type": "array", "items": {"type": "number"}}, [1, 2.5]),
])
def test_values_are_typed_by_the_schema(raw: str, schema: Any, want: Any) -> None:
    got = typed_value(raw, schema)
    assert got == want and type(got) is type(want)


def test_replies_with_calls() -> None:
    reader = Reader(QWEN3_XML, NAMES, params=PARAMS)
    content, calls = reader.parse(
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "</function>\n</tool_call>")
    assert content == "Let me look."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather",
         "arguments": '{"city": "New\\nYork", "days": 3, "tags": ["a", 1]}'},
        {"name": "get_time", "arguments": "{}"}]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    # the outer tag left out, a closing tag left out: read as vLLM reads them
    _, calls = reader.parse("<function=get_weather><parameter=city>Rome<parameter=days>2"
                            "</parameter></function>")
    assert calls[0]["function"]["arguments"] == '{"city": "Rome", "days": 2}'
    # an unknown tool, a tag without a function: content, as written
    for text in ("<tool_call>\n<function=nope>\n</function>\n</tool_call>",
                 "a <tool_call> b", "x <function=get_weather no", "<tool_cal"):
        assert reader.parse(text) == (text.strip(), []), text
    # cut short by max_tokens: the parameters so far, the last as far as written, as one
    # JSON object
    _, calls = reader.parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs")
    assert calls[0]["function"]["arguments"] == '{"city": "Os"}'
    _, calls = reader.parse("<tool_call>\n<function=get_weather>\n<parameter=days>\n1")
    assert calls[0]["function"]["arguments"] == '{"days": 1}'


def test_text_values_stream_as_they_are_written() -> None:
    """A text value goes out as it comes (less a newline that may be the closing markup);
    a typed one at its end."""
    stream = Reader(QWEN3_XML, NAMES, params=PARAMS).stream()
    _, made = stream.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nLon")
    assert made[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in made[1:]) == '{"city": "Lon'
    _, made = stream.feed("don\n")
    assert made[0]["function"]["arguments"] == "don"
    _, made = stream.feed("</parameter>\n<parameter=days>\n1")
    assert "".join(d["function"]["arguments"] for d in made) == '", "days": '
    _, made = stream.feed("4\n</parameter>\n</function>")
    assert "".join(d["function"]["arguments"] for d in made) == "14}"


def _call_text(name: str, params: list[tuple[str, str]], outer: bool, close_param: bool,
               space: str) -> str:
    body = "".join(f"{XML_PARAM}{k}>{space}{v}{space}"
                   f"{XML_PARAM_END if close_param else ''}{space}" for k, v in params)
    text = f"{XML_FUNC}{name}>{space}{body}{XML_FUNC_END}"
    return f"{CALL_OPEN}{space}{text}{space}{CALL_CLOSE}" if outer else text


_KEY = st.sampled_from(["city", "days", "hourly", "tags", "note", "other"])
_VALUE = st.one_of(st.sampled_from(["3", "true", "0", "null", "[1, 2]", '{"a": 1}', "x",
                                    "2.5", ""]),
                   st.text(alphabet='ab <>/="\\\n1', max_size=6))
_TOOL = st.sampled_from(["get_weather", "get_time", "unknown", " get_time "])
# Replies made of text, whole calls (known and unknown tools, with and without the outer tag
# and the parameters' closing tags, any whitespace), loose tags and their starts, cut into
# deltas anywhere.
_PIECES = st.one_of(
    st.builds(_call_text, _TOOL, st.lists(st.tuples(_KEY, _VALUE), max_size=3),
              st.booleans(), st.booleans(), st.sampled_from(["", "\n", " \n"])),
    st.sampled_from([CALL_OPEN, CALL_CLOSE, XML_FUNC, XML_FUNC_END, XML_PARAM, XML_PARAM_END,
                     "get_weather>", "city>", ">", "\n", " ", "<", "<tool", "</param"]),
    st.text(alphabet="ab <>/=\n", max_size=8))
_WS = re.compile(r"[ \t\n\r]*")
_OPEN = re.compile(re.escape(CALL_OPEN) + "|" + re.escape(XML_FUNC))


def _reference(text: str) -> tuple[str | None, list[dict]]:
    """An independent reading of a whole reply, by searching the text: content up to a
    ``<tool_call>`` followed (after whitespace) by ``<function=``, or a bare ``<function=``;
    a known tool's name up to ``>`` (at most 256 characters, no newline or ``<``) makes a
    call, else the tag is content and the reading goes on after it; in a call, parameters
    (a value: one newline trimmed at each end, up to ``</parameter>`` or the next
    ``<parameter=``), stray text dropped up to its next ``<``, until ``</function>`` (and up
    to ``</tool_call>`` after it) or ``</tool_call>``; the reply's end closes what is open."""
    n = len(text)
    content: list[str] = []
    calls: list[dict] = []

    def done() -> tuple[str | None, list[dict]]:
        return ("".join(content).strip() or None), calls

    def args(items: list[tuple[str, Any]]) -> str:
        return "{" + ", ".join(json.dumps(k, ensure_ascii=False) + ": "
                               + json.dumps(v, ensure_ascii=False) for k, v in items) + "}"

    def value(key: str, raw: str) -> Any:
        if raw.endswith("\n"):
            raw = raw[:-1]
        props = PARAMS["get_weather"]["properties"]
        return typed_value(raw, props[key]) if key in TYPED and name == "get_weather" else raw

    pos = 0
    while True:
        m = _OPEN.search(text, pos)
        if m is None:
            content.append(text[pos:])
            return done()
        content.append(text[pos:m.start()])
        q = m.end()
        if m.group() == CALL_OPEN:
            w = _WS.match(text, q).end()
            if text.startswith(XML_FUNC, w):
                q = w + len(XML_FUNC)
            elif XML_FUNC.startswith(text[w:]):   # the reply ends in the tag
                content.append(text[m.start():])
                return done()
            else:
                content.append(m.group())
                pos = q
                continue
        r = re.compile(r"[^>\n<]*").match(text, q).end()
        if r - q > 256 or (r < n and (text[r] != ">" or text[q:r].strip() not in NAMES)):
            content.append(text[m.start():q])   # not a call: read on after the tag
            pos = q
            continue
        if r == n:   # the reply ends in the name
            content.append(text[m.start():])
            return done()
        name = text[q:r].strip()
        items: list[tuple[str, Any]] = []
        i = r + 1
        while True:
            i = _WS.match(text, i).end()
            if text.startswith(XML_PARAM, i):
                start = i + len(XML_PARAM)
                k = text.find(">", start)
                if k < 0 and n - start <= 256:   # the reply ends in the key
                    calls.append({"name": name, "arguments": args(items)})
                    return done()
                if k < 0 or k - start > 256:   # not a key: read as what follows a parameter
                    i = start
                    continue
                key, v = text[start:k].strip(), k + 1
                if text.startswith("\n", v):
                    v += 1
                ends = [(text.find(t, v), t) for t in (XML_PARAM_END, XML_PARAM)]
                ends = [(e, t) for e, t in ends if e >= 0]
                if not ends:   # the reply ends in the value
                    items.append((key, value(key, text[v:])))
                    calls.append({"name": name, "arguments": args(items)})
                    return done()
                e, t = min(ends)
                items.append((key, value(key, text[v:e])))
                i = e + len(t) if t == XML_PARAM_END else e
            elif text.startswith(XML_FUNC_END, i):
                calls.append({"name": name, "arguments": args(items)})
                w = _WS.match(text, i + len(XML_FUNC_END)).end()
                if text.startswith(CALL_CLOSE, w):
                    pos = w + len(CALL_CLOSE)
                elif CALL_CLOSE.startswith(text[w:]):
                    return done()
                else:
                    pos = w
                break
            elif text.startswith(CALL_CLOSE, i):
                calls.append({"name": name, "arguments": args(items)})
                pos = i + len(CALL_CLOSE)
                break
            elif any(t.startswith(text[i:]) for t in (XML_PARAM, XML_FUNC_END, CALL_CLOSE)):
                calls.append({"name": name, "arguments": args(items)})
                return done()
            else:   # stray text: dropped up to its next "<"
                j = text.find("<", i + 1)
                if j < 0:
                    calls.append({"name": name, "arguments": args(items)})
                    return done()
                i = j


@settings(max_examples=1000)   # a pure function, cheap examples
@given(st.lists(_PIECES, max_size=8), st.data())
def test_a_streamed_reply_assembles_what_a_whole_reading_finds(pieces: list[str],
                                                              data: st.DataObject) -> None:
    """For any reply, cut into deltas anywhere: what a client assembles from the stream is
    what an independent reading of the whole text finds, and what the non-streamed answer
    holds."""
    text = "".join(pieces)
    reader = Reader(QWEN3_XML, NAMES, params=PARAMS)
    content, calls, _ = _stream(reader, text, data)
    want_content, want_calls = _reference(text)
    assert (content or None, calls) == (want_content, want_calls)
    got_content, got_calls = reader.parse(text)
    assert (got_content, [c["function"] for c in got_calls]) == (want_content, want_calls)
    for call in got_calls:
        json.loads(call["function"]["arguments"])   # always one whole JSON object


def test_a_forced_call_takes_the_template_shape() -> None:
    """The grammar of a forced call admits the template's call, typed values and all, and
    refuses one whose integer is text; what it admits reads back as the schema's values."""
    from radixkv.engine.grammar import GrammarCompiler
    from radixkv.models import load_tokenizer

    tok = load_tokenizer()
    gc = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    shape = grammar_shape(QWEN3_XML)
    fn = FORECAST["function"]
    g = gc.tool_call([(fn["name"], fn["parameters"])], shape.open_tag, shape.close_tag,
                     separator=shape.separator, style=shape.style)
    good = ("<tool_call>\n<function=get_forecast>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n"
            "</function>\n</tool_call>")

    def admits(text: str) -> bool:
        m = g.matcher()
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) \
            and m.accept_token(tok.eos_token_id)

    assert admits(good) and admits(good + "\n" + good)   # required: one or more
    assert not admits(good.replace("\n3\n", "\nthree\n"))
    assert not admits(good.replace("<parameter=days>\n3\n</parameter>\n", ""))
    reader = Reader(QWEN3_XML, frozenset({fn["name"]}), params={fn["name"]: fn["parameters"]})
    _, calls = reader.parse(good)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 3,
                                                            "hourly": True}


# ----------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with template_server(tmp_path_factory, QWEN_XML_TEMPLATE) as server:
        yield server


@pytest.mark.model
def test_a_named_call_is_typed_and_its_result_goes_back(srv: Server) -> None:
    """A forced call is written in the template's tags and answered as an OpenAI call whose
    arguments have the schema's types; the call and its result render back as tags."""
    r = _chat(srv, messages=ASK, tools=[WEATHER, FORECAST], max_tokens=80,
              extra_body={"return_token_ids": True},
              tool_choice={"type": "function", "function": {"name": "get_forecast"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_forecast" and set(args) == {"city", "days", "hourly"}
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    assert isinstance(args["hourly"], bool) and isinstance(args["city"], str)
    status, body = srv.raw("POST", "/detokenize", {"model": MODEL, "tokens": c.token_ids},
                           key=None)
    assert status == 200 and body["prompt"].startswith(
        "<tool_call>\n<function=get_forecast>\n<parameter=city>")
    follow = ASK + [{"role": "assistant", "content": None,
                     "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = _chat(srv, messages=follow, tools=[FORECAST], tool_choice="none", max_tokens=2)
    assert r2.choices[0].message.tool_calls is None
    assert f"<parameter=days>\n{args['days']}\n</parameter>" in rendered(srv, follow)


@pytest.mark.model
def test_required_calls_stream_as_the_non_streamed_ones(srv: Server) -> None:
    """``required``: one or more calls (kept from ending by a -100 bias on the end tokens, the
    model writes calls until ``max_tokens``), streamed as the non-streamed answer; with
    ``parallel_tool_calls: false`` one."""
    check_required_and_auto(srv)


def test_names_the_format_cannot_write_are_refused() -> None:
    """A tool whose name would not read back in the format (a call of it would come back
    as content) is a 400 naming ``tools``, before anything is computed."""
    from radixkv.server.errors import APIError
    from radixkv.server.tools import MISTRAL, PYTHONIC, check_names
    from tests.server.test_tool_calls_mistral import MISTRAL_TEMPLATE

    cases = [(QWEN3_XML, None, ["get_weather", "a.b-c", "x y"], ["a>b", "a<b", " pad",
                                                                   "two\nlines"]),
             (PYTHONIC, None, ["get_weather", "tools.search", "_x1"], ["a-b", "1x", "class",
                                                                        "a..b", "x y"]),
             (MISTRAL, MISTRAL_TEMPLATE + "[ARGS]", ["get-weather", "a.b"], ["a b", "ü"]),
             (MISTRAL, MISTRAL_TEMPLATE, ["a b", "ü"], []),   # the list form writes any name
             ("hermes", None, ["a>b", "x y", 'q"'], [])]
    for fmt, template, good, bad in cases:
        check_names(fmt, good, template)
        for name in bad:
            with pytest.raises(APIError) as info:
                check_names(fmt, ["ok", name], template)
            assert info.value.param == "tools" and repr(name) in str(info.value), (fmt, name)


@pytest.mark.model
def test_a_name_the_format_cannot_write_is_a_400(srv: Server) -> None:
    bad = {"type": "function", "function": {"name": "get>weather", "parameters": {}}}
    with pytest.raises(openai.BadRequestError) as info:
        _chat(srv, messages=ASK, tools=[bad])
    assert info.value.body["param"] == "tools" and "get>weather" in info.value.body["message"]
    r = _chat(srv, messages=ASK, tools=[bad], tool_choice="none", max_tokens=2)
    assert r.choices[0].finish_reason == "length"   # not offered: nothing to write
