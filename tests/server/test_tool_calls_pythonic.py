"""Tool calls as a Python list (``--tool-call-parser pythonic`` / ``llama4_pythonic``).

Llama 3.2's pythonic template and Llama 4's teach the model to answer with a list of calls,
``[get_weather(city="Paris"), get_time(zone='UTC')]`` (Llama 4 between ``<|python_start|>``
and ``<|python_end|>``). The reading is checked on its own (replies built from parts whose
calls are known, streamed in any pieces) and through a real server whose template carries the
pythonic instruction (the format is recognized from it).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from radixkv.server.tools import (PARSERS, PYTHON_END, PYTHON_START, PYTHONIC,  # noqa: E402
                                  Reader, grammar_shape, template_format)
from tests.server.test_openai_server import Server  # noqa: E402
from tests.server.test_tool_calls import (  # noqa: E402
    ASK, TIME, WEATHER, _chat, check_required_and_auto, rendered, template_server)
from tests.server.test_tool_calls_llama import _stream  # noqa: E402

# A Llama 3.2 pythonic-style template: the instruction with the list format, an assistant's
# calls written back as the list, a tool's result as an ipython turn.
PYTHONIC_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. If you decide to invoke any of the function(s), you MUST put it in the \
format of [func_name1(params_name1=params_value1, params_name2=params_value2...), \
func_name2(params)]. You SHOULD NOT include any other text in the response.
{{ tools | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
[{%- for tc in message.tool_calls %}{{ tc.function.name }}(
{%- for key, value in tc.function.arguments | items %}{{ key }}={{ value | tojson }}
{%- if not loop.last %}, {% endif %}{%- endfor %}){%- if not loop.last %}, {% endif %}
{%- endfor %}]<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>ipython
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
NAMES = frozenset({"get_weather", "get_time", "tools.search"})


# ------------------------------------------------------------------------------ the reading

def test_the_format_is_read_from_the_template_or_named() -> None:
    assert template_format(PYTHONIC_TEMPLATE) == PYTHONIC
    plain = "{% if tools %}{{ tools }}{% endif %}"
    assert template_format(plain, "pythonic") == template_format(plain, "llama4_pythonic") \
        == PYTHONIC
    assert PARSERS["pythonic"] == PARSERS["llama4_pythonic"] == PYTHONIC
    shape = grammar_shape(PYTHONIC)   # forced calls: a JSON list, as vLLM forces them
    assert (shape.open_tag, shape.close_tag, shape.separator, shape.around) == (
        "[", "]", ", ", True)


def _calls(reader: Reader, text: str) -> tuple[str | None, list[tuple[str, Any]]]:
    """The whole reply's reading, checked against the same reply streamed a character at a
    time (every boundary: a quote that may begin or end a triple quote, an escape)."""
    content, calls = reader.parse(text)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    stream, streamed, made = reader.stream(), "", []
    for ch in [*text, None]:
        piece, deltas = stream.feed(ch) if ch is not None else stream.finish()
        streamed += piece
        made += deltas
    assert (streamed or None, [(d["function"]["name"], json.loads(d["function"]["arguments"]))
                               for d in made]) == (content, got)
    return content, got


def test_replies_with_calls() -> None:
    reader = Reader(PYTHONIC, NAMES)
    assert _calls(reader, '[get_weather(city="Paris", days=3), get_time(zone=\'UTC\')]') == (
        None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})])
    # Llama 4's tokens around the list, a bracket inside a string, text after the list
    assert _calls(reader, f' {PYTHON_START}[get_weather(city="a]b")]{PYTHON_END} ok') == (
        "ok", [("get_weather", {"city": "a]b"})])
    # Python's literals and JSON's spellings; tuples as lists; a dotted name; triple quotes
    # holding quotes and brackets; escapes
    assert _calls(reader, "[get_weather(a=True, b=null, c=-2.5, d=(1, 'x'), e={'k': [None]}), "
                  "tools.search(q='''it's ) '''), "
                  'get_time(zone="""a"b]""", x=\'\\\')\', y="")]') == (
        None, [("get_weather", {"a": True, "b": None, "c": -2.5, "d": [1, "x"],
                                "e": {"k": [None]}}), ("tools.search", {"q": "it's ) "}),
               ("get_time", {"zone": 'a"b]', "x": "')", "y": ""})])
    # a forced call's JSON objects
    assert _calls(reader, '[{"name": "get_time", "arguments": {"zone": "UTC"}}]') == (
        None, [("get_time", {"zone": "UTC"})])
    # not a list of calls: the whole reply is content
    for text in ("hello [x]", "[nope()]", "[get_weather(1)]", "[get_weather(**k)]",
                 "[get_weather(a={1, 2})]", "[get_weather(a=f(1))]", "[]", "[get_wea",
                 "[get_weather(a=1e999)]", '[{"name": "get_time", "arguments": 3}]',
                 '[{"name": "get_time", "arguments": {"n": 1e999}}]'):
        assert reader.parse(text) == (text, []), text
    # a number beyond a double's range is no JSON value in every format (json.dumps would
    # write Infinity): a call read whole is content, a streamed one keeps what it had
    for fmt, text, want in [
            ("hermes", '<tool_call>{"arguments": {"n": 1e999}, "name": "get_time"}</tool_call>',
             None),
            ("hermes", '<tool_call>{"name": "get_time", "arguments": {"n": 1e999}}</tool_call>',
             '{"n": '),
            ("llama3_json", '{"name": "get_time", "parameters": {"n": -1e999}}', '{"n": '),
            ("mistral", '[TOOL_CALLS]get_time[ARGS]{"n": 1e999}', '{"n": ')]:
        content, calls = Reader(fmt, NAMES).parse(text)
        assert [c["function"]["arguments"] for c in calls] == ([want] if want else [])
        assert content == (None if want else text)
    # nesting deeper than json.loads and json.dumps go (RecursionError; a few thousand tokens
    # of "[") is no call either, in every format read whole, and a history holding such
    # arguments is a 400, not a 500
    deep = "[" * 5000 + "]" * 5000
    for fmt, text in [
            ("hermes", '<tool_call>{"arguments": {"a": %s}, "name": "get_time"}</tool_call>'),
            ("llama3_json", '{"arguments": {"a": %s}, "name": "get_time"}'),
            ("mistral", '[TOOL_CALLS] [{"arguments": {"a": %s}, "name": "get_time"}]'),
            (PYTHONIC, '[{"name": "get_time", "arguments": {"a": %s}}]'),
            (PYTHONIC, "[get_time(a=%s)]")]:
        assert Reader(fmt, NAMES).parse(text % deep) == (text % deep, []), fmt
    from radixkv.server.tools import QWEN3_XML, template_messages

    _, calls = Reader(QWEN3_XML, NAMES, params={"get_time": {"properties": {
        "a": {"type": "array"}}}}).parse(f"<function=get_time><parameter=a>{deep}"
                                         "</parameter></function>")
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": deep}   # kept as text
    from radixkv.server.errors import APIError
    from radixkv.server.protocol import ChatMessage

    msg = ChatMessage(role="assistant", content=None, tool_calls=[{
        "id": "c1", "type": "function", "function": {"name": "get_time", "arguments": deep}}])
    with pytest.raises(APIError) as info:
        template_messages([msg])
    assert info.value.status == 400 and info.value.param == "messages"
    # after a call, what is not one is dropped with the rest; a cut list keeps its calls
    assert _calls(reader, "[get_time(zone='a'), nope()] rest") == (
        None, [("get_time", {"zone": "a"})])
    assert _calls(reader, "[get_time(zone='a'), get_weather(city='P") == (
        None, [("get_time", {"zone": "a"})])
    assert _calls(Reader(PYTHONIC, NAMES, single=True),
                  "[get_time(zone='a'), get_time(zone='b')] x") == (
        None, [("get_time", {"zone": "a"})])


def _py(value: Any, style: str) -> str:
    """``value`` written as a Python literal (``repr``; with ``triple``, its strings in triple
    quotes where they can be) or in JSON's spelling, which pythonic models also write."""
    if style == "json":
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_py(v, style) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_py(v, style)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and style.startswith("triple"):
        q = '"' if style == "triple" else "'"
        if q * 3 not in value and not value.endswith(q) and "\\" not in value:
            return q * 3 + value + q * 3
    return repr(value)


_VALUE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-99, 99),
              st.floats(-1e3, 1e3, allow_nan=False).map(lambda f: round(f, 3)),
              st.text(alphabet="ab '\"\\)](,\n}{=", max_size=6),
              st.sampled_from(['a"b)', "it's ]", '"x"}', "'(", "\n)\n"])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(alphabet="ab", min_size=1, max_size=2), inner, max_size=2),
    max_leaves=5)
_ARGS = st.dictionaries(st.sampled_from(["city", "zone", "q", "n"]), _VALUE, max_size=3)


@st.composite
def _element(draw: st.DrawFn) -> tuple[str, tuple[str, Any] | None]:
    """One element of the list and the call it is (None: not a call of a known tool)."""
    kind = draw(st.sampled_from(["call", "call", "call", "json", "unknown", "bad"]))
    name = draw(st.sampled_from(sorted(NAMES)))
    args = draw(_ARGS)
    style = draw(st.sampled_from(["py", "json", "triple", "triple1"]))
    space = draw(st.sampled_from(["", " ", "\n"]))
    if kind == "json":
        return json.dumps({"name": name, "arguments": args}), (name, args)
    body = f",{space}".join(f"{k}={space}{_py(v, style)}" for k, v in args.items())
    if kind == "call":
        return f"{name}({space}{body})", (name, args)
    if kind == "unknown":
        return f"other_tool({body})", None
    return draw(st.sampled_from([f"{name}(1)", f"{name}(**kw)", f"{name}(a={{1, 2}})",
                                 f"{name}(a=len('x'))", "x", "3", "'text'", "[1]"])), None


@st.composite
def _reply(draw: st.DrawFn) -> tuple[str, str | None, list[tuple[str, Any]], bool]:
    """A reply made of parts, and what reading it must give: ``(text, content, calls,
    single)``."""
    single = draw(st.booleans())
    llama4 = draw(st.booleans())
    elements = draw(st.lists(_element(), max_size=4))
    sep = draw(st.sampled_from([", ", ",", ",\n", " , "]))
    closed = draw(st.booleans())
    tail = draw(st.sampled_from(["", " Done.", "\nok"])) if closed else ""
    lead = draw(st.sampled_from(["", " ", "\n"])) + (PYTHON_START if llama4 else "")
    text = lead + "[" + sep.join(e for e, _ in elements)
    if closed:
        text += "]" + (PYTHON_END if llama4 else "") + tail
    calls: list[tuple[str, Any]] = []
    for _, call in elements:
        if call is None:   # not a call: content before any, the rest dropped after one
            return text, (None if calls else text.strip()), calls, single
        calls.append(call)
        if single:
            return text, None, calls, single
    if not calls:   # an empty list, or one cut before its first call ended
        return text, text.strip(), calls, single
    return text, (tail.strip() or None) if closed else None, calls, single


@settings(max_examples=1000)   # a pure function, cheap examples
@given(_reply(), st.data())
def test_a_streamed_reply_assembles_the_calls_it_was_made_of(
        reply: tuple[str, str | None, list[tuple[str, Any]], bool],
        data: st.DataObject) -> None:
    """For any reply built from known calls, other elements and text, cut into deltas
    anywhere: what a client assembles from the stream, and the non-streamed answer, are the
    calls it was built from (arguments equal as JSON values) and its content."""
    text, want_content, want_calls, single = reply
    reader = Reader(PYTHONIC, NAMES, single)
    content, calls, _ = _stream(reader, text, data)
    assert (content or None) == want_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls
    assert _calls(reader, text) == (want_content, want_calls)


def test_a_forced_call_is_a_json_list_the_reader_takes() -> None:
    from radixkv.engine.grammar import GrammarCompiler
    from radixkv.models import load_tokenizer

    tok = load_tokenizer()
    gc = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    shape = grammar_shape(PYTHONIC)
    fn = WEATHER["function"]
    g = gc.tool_call([(fn["name"], fn["parameters"])], shape.open_tag, shape.close_tag,
                     separator=shape.separator, around=shape.around)
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'
    m = g.matcher()
    assert all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
    assert m.accept_token(tok.eos_token_id)
    assert _calls(Reader(PYTHONIC, NAMES), text) == (
        None, [("get_weather", {"city": "Oslo", "unit": "celsius"})])


# ----------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with template_server(tmp_path_factory, PYTHONIC_TEMPLATE) as server:
        yield server


@pytest.mark.model
def test_a_named_call_and_its_result_go_back(srv: Server) -> None:
    """A forced call (a JSON list, as vLLM forces calls) comes back as an OpenAI call; the
    call and its result render back in the template's pythonic form."""
    r = _chat(srv, messages=ASK, tools=[WEATHER, TIME],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    follow = ASK + [{"role": "assistant", "content": None,
                     "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    assert f"[get_weather(city={json.dumps(args['city'])}" in rendered(srv, follow)


@pytest.mark.model
def test_required_calls_stream_as_the_non_streamed_ones(srv: Server) -> None:
    """``required``: one or more calls (the end tokens and ``]`` biased out, the model writes
    calls until ``max_tokens``), streamed as the non-streamed answer; with
    ``parallel_tool_calls: false`` one; ``auto`` streamed as not."""
    check_required_and_auto(srv, ("]", "}]", "]]", "\u0120]"))
