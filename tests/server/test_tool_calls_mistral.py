"""Tool calls in Mistral's format (``--tool-call-parser mistral``), read and served.

Mistral templates teach the model to answer calls after a ``[TOOL_CALLS]`` marker (a special
token of its vocabulary): a JSON list, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}]``
(Mistral 7B v0.3, Mixtral, Nemo, Ministral), or, in newer templates, one
``[TOOL_CALLS]name[ARGS]{...}`` per call. Their templates render a call back only with an id of
9 letters and digits. The reading is checked on its own (any reply, streamed in any pieces,
against an independent reading of the whole), and through a real server whose template is
written in that format (recognized from the template): the embedded 135M model has no
``[TOOL_CALLS]`` token, so there the marker is plain text, which reads the same.
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

from radixkv.server.tools import (MISTRAL, MISTRAL_ARGS, MISTRAL_CALLS, Reader,  # noqa: E402
                                  call_id, grammar_shape, history_format, mistral_id,
                                  template_format)
from tests.server.test_openai_server import MODEL, Server  # noqa: E402
from tests.server.test_tool_calls import (  # noqa: E402
    ASK, TIME, WEATHER, _chat, check_required_and_auto, rendered, template_server)
from tests.server.test_tool_calls_llama import _stream  # noqa: E402

# A Mistral 7B v0.3-style template: the tools before the last user turn, a call in history
# written back as the list with its id (which must be 9 letters and digits, as Mistral's
# templates demand), a result with its call id.
MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}
[INST] {{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] [
{%- for tc in message.tool_calls %}
{%- if tc.id is not defined or tc.id | length != 9 %}{{ raise_exception("Tool call IDs should \
be alphanumeric strings with length 9!") }}{% endif -%}
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, \
"id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]</s>
{%- elif message.role == 'tool' %}
{%- if message.tool_call_id | length != 9 %}{{ raise_exception("Tool call IDs should be \
alphanumeric strings with length 9!") }}{% endif -%}
[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": \
"{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %} {{ message.content }}</s>
{%- endif %}
{%- endfor %}"""
NAMES = frozenset({"get_weather", "get_time"})
_NAME = re.compile(r"[A-Za-z0-9_.\-]{0,64}")


# ------------------------------------------------------------------------------ the reading

def test_the_format_ids_and_grammar_shape() -> None:
    assert template_format(MISTRAL_TEMPLATE) == MISTRAL
    assert template_format("{% if tools %}{{ tools }}{% endif %}", "mistral") == MISTRAL
    list_shape = grammar_shape(MISTRAL, MISTRAL_TEMPLATE)
    assert (list_shape.open_tag, list_shape.close_tag, list_shape.around) == (
        "[TOOL_CALLS] [", "]", True)
    newer = grammar_shape(MISTRAL, MISTRAL_TEMPLATE + "{# [TOOL_CALLS]name[ARGS]args #}")
    assert (newer.open_tag, newer.name_first, newer.separator) == ("[TOOL_CALLS]", "[ARGS]", "")
    for _ in range(20):
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id(MISTRAL))
    assert call_id("hermes").startswith("call_")
    assert mistral_id("abcDEF123") == "abcDEF123"             # already one: kept
    mapped = mistral_id("call_0123456789abcdef01234567")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mapped)
    assert mistral_id("call_0123456789abcdef01234567") == mapped   # a call and its result pair
    assert history_format(MISTRAL_TEMPLATE) == MISTRAL and history_format("{{ x }}") is None


def test_a_forced_call_may_open_with_the_marker_token() -> None:
    """Where ``[TOOL_CALLS]`` is one (special) token, as in Mistral's vocabulary, the forced
    call's grammar lets the model write that token, not only the marker spelled in ordinary
    tokens: a vocabulary with it added (the embedded tokenizer's copy)."""
    import copy

    import xgrammar as xgr

    from radixkv.engine.grammar import GrammarCompiler
    from radixkv.models import load_tokenizer

    tok = copy.deepcopy(load_tokenizer())   # (load_tokenizer's object is the process's)
    tok.add_special_tokens({"additional_special_tokens": [MISTRAL_CALLS]})
    marker = tok.convert_tokens_to_ids(MISTRAL_CALLS)
    gc = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    shape = grammar_shape(MISTRAL, MISTRAL_TEMPLATE)
    g = gc.tool_call([("get_weather", {"type": "object"})], shape.open_tag, shape.close_tag,
                     args_key=shape.args_key, around=shape.around)
    m = g.matcher()
    mask = xgr.allocate_token_bitmask(1, len(tok))
    m.fill_next_token_bitmask(mask, 0)
    assert (int(mask[0, marker // 32]) >> (marker % 32)) & 1
    assert m.accept_token(marker)
    for t in tok.encode(' [{"name": "get_weather", "arguments": {}}]', add_special_tokens=False):
        assert m.accept_token(t)
    assert m.accept_token(tok.eos_token_id)


def _call_list(calls: list[tuple[str, dict]], space: str) -> str:
    body = f",{space}".join(json.dumps({"name": n, "arguments": a}) for n, a in calls)
    return f"{MISTRAL_CALLS}{space}[{body}]"


_ARG = st.dictionaries(st.sampled_from(["city", "zone"]),
                       st.text(alphabet="xyz []{}\",", max_size=5), max_size=2)
_TOOL = st.sampled_from(["get_weather", "get_time", "unknown"])
# Replies made of text, markers, call lists (known and unknown tools, extra keys, another key
# order), newer name[ARGS] calls and JSON that is not a call, cut into deltas anywhere.
_PIECES = st.one_of(
    st.builds(_call_list, st.lists(st.tuples(_TOOL, _ARG), min_size=1, max_size=3),
              st.sampled_from(["", " ", "\n"])),
    st.builds(lambda n, a: f"{MISTRAL_CALLS}{n}{MISTRAL_ARGS}{json.dumps(a)}", _TOOL, _ARG),
    st.just(f'{MISTRAL_CALLS} [{{"name": "get_time", "arguments": {{"zone": "]"}}, '
            f'"id": "abcdefghi"}}]'),
    st.just(f'{MISTRAL_CALLS}[{{"arguments": {{"zone": "UTC"}}, "name": "get_time"}}]'),
    st.sampled_from([MISTRAL_CALLS, " ", "\n", "[", "]", ",", "{}", '{"answer": 1}', "[TOOL"]),
    st.text(alphabet="ab {}\",\n]", max_size=8))


def _reference(text: str, names: frozenset[str], single: bool) -> tuple[str | None, list]:
    """An independent reading of a whole reply with ``json.JSONDecoder.raw_decode``: text is
    content; after a marker, a list of calls or one ``name[ARGS]{...}`` call; where the
    marker's calls stop parsing, before any of them was read the marker and what follows it
    up to there are content (and the reading goes on from there), after one the rest of the
    reply is dropped; ``single`` ends the reply at its first call."""
    dec = json.JSONDecoder()
    content: list[str] = []
    calls: list[dict] = []

    def skip(i: int) -> int:
        return len(text) - len(text[i:].lstrip())

    def as_call(obj: Any) -> dict | None:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return {"name": obj["name"], "arguments": args if isinstance(args, str)
                else json.dumps(args, ensure_ascii=False)}

    def done() -> tuple[str | None, list]:
        return ("".join(content).strip() or None), calls

    pos = 0
    while True:
        at = text.find(MISTRAL_CALLS, pos)
        if at < 0:
            content.append(text[pos:])
            return done()
        content.append(text[pos:at])
        q = skip(at + len(MISTRAL_CALLS))
        made = 0
        fail = None          # where the marker's calls stopped parsing
        if q < len(text) and text[q] == "[":
            r = q + 1
            while True:
                r = skip(r)
                if r >= len(text):
                    fail = r
                    break
                if text[r] == "]" and made:
                    pos = r + 1
                    break
                if text[r] != "{":
                    fail = r
                    break
                try:
                    obj, end = dec.raw_decode(text, r)
                except ValueError:
                    obj = None
                call = as_call(obj)
                if call is None:
                    fail = r
                    break
                calls.append(call)
                made += 1
                if single:
                    return done()
                r = skip(end)
                if r < len(text) and text[r] == ",":
                    r += 1
                    continue
                if r < len(text) and text[r] == "]":
                    pos = r + 1
                    break
                fail = r
                break
        else:
            name = _NAME.match(text, q).group(0)
            args_at = q + len(name)
            if q < len(text) and text.startswith(MISTRAL_ARGS, args_at) and name in names:
                v = args_at + len(MISTRAL_ARGS)
                while v < len(text) and text[v] in " \t\n\r":
                    v += 1
                obj, end = dec.raw_decode(text, v)   # the pieces write whole arguments
                calls.append({"name": name, "arguments": json.dumps(obj, ensure_ascii=False)})
                if single:
                    return done()
                pos = end
            else:
                fail = q
        if fail is not None:
            if made:
                return done()   # the rest is dropped
            if fail >= len(text):
                content.append(text[at:])
                return done()
            content.append(text[at:fail])
            pos = fail


@settings(max_examples=1000)   # a pure function, cheap examples
@given(st.lists(_PIECES, max_size=8), st.booleans(), st.data())
def test_a_streamed_reply_assembles_what_a_whole_reading_finds(pieces: list[str], single: bool,
                                                              data: st.DataObject) -> None:
    """For any reply, cut into deltas anywhere: what a client assembles from the stream is
    what an independent reading of the whole text finds, and what the non-streamed answer
    holds (with ``parallel_tool_calls: false``, ``single``, too)."""
    text = "".join(pieces)
    reader = Reader(MISTRAL, NAMES, single)
    content, calls, _ = _stream(reader, text, data)
    want_content, want_calls = _reference(text, NAMES, single)
    assert (content or None, calls) == (want_content, want_calls)
    got_content, got_calls = reader.parse(text)
    assert (got_content, [c["function"] for c in got_calls]) == (want_content, want_calls)
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in got_calls)


def test_replies_around_the_marker() -> None:
    reader = Reader(MISTRAL, NAMES)
    content, calls = reader.parse('Let me check. [TOOL_CALLS] [{"name": "get_weather", '
                                  '"arguments": {"city": "Oslo"}}] Done.')
    assert content == "Let me check.  Done." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    for text in ("[TOOL_CALLS] not a list", '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]',
                 "plain [TOOL_CA"):
        assert reader.parse(text) == (text, []), text
    newer = reader.parse('[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]get_weather'
                         '[ARGS]{"city": "Rome"}')
    assert [c["function"]["name"] for c in newer[1]] == ["get_time", "get_weather"]
    # a list cut by max_tokens keeps the call written so far, its arguments as far as written
    cut = reader.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Os')
    assert cut[0] is None and cut[1][0]["function"]["arguments"] == '{"city": "Os'


# ----------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with template_server(tmp_path_factory, MISTRAL_TEMPLATE) as server:
        yield server


@pytest.mark.model
def test_a_named_call_is_a_list_and_its_result_goes_back(srv: Server) -> None:
    """A forced call is the template's list after the marker, answered as an OpenAI call with
    an id of 9 letters and digits, and the call and its result render back (the template
    raises on other ids; one from another server is mapped, so it renders too)."""
    r = _chat(srv, messages=ASK, tools=[WEATHER, TIME], extra_body={"return_token_ids": True},
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    status, body = srv.raw("POST", "/detokenize", {"model": MODEL, "tokens": c.token_ids},
                           key=None)
    assert status == 200 and body["prompt"].startswith("[TOOL_CALLS] [{")
    for cid in (call.id, "call_0123456789abcdef01234567"):
        tc = {**call.model_dump(), "id": cid}
        follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [tc]},
                        {"role": "tool", "tool_call_id": cid, "content": "18 C"}]
        r2 = _chat(srv, messages=follow, tools=[WEATHER], tool_choice="none", max_tokens=2)
        assert r2.choices[0].message.tool_calls is None
        assert f'"call_id": "{mistral_id(cid)}"' in rendered(srv, follow)


@pytest.mark.model
def test_required_calls_stream_as_the_non_streamed_ones(srv: Server) -> None:
    """``required``: one or more calls in one list (kept from closing it by a -100 bias on the
    end tokens and on ``]``, ``}]``, ``]]``, `` ]``, the model writes calls until
    ``max_tokens``), streamed as the non-streamed answer; with ``parallel_tool_calls: false``
    the list holds one."""
    check_required_and_auto(srv, ("]", "}]", "]]", "\u0120]"))
