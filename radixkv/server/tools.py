"""OpenAI tool calls for chat templates that declare tools, in the ``<tool_call>`` format.

A chat template that takes ``tools`` (it refers to the variable) renders their definitions into
the prompt; the model answers with calls written the way its template teaches. radixkv reads
the format of Hermes, Qwen2/2.5/3 and SmolLM3 templates, the common one::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* ``tool_choice: "auto"``: the model may call; calls found in its text become OpenAI
  ``tool_calls`` (``arguments`` as a JSON string) and the rest is ``content``.
* ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained by a grammar (:meth:`radixkv.engine.grammar.GrammarCompiler.tool_call`) to one call
  of one of the tools (of the named one), its arguments valid against the tool's JSON schema.
* ``"none"``: the tools are not rendered and nothing is parsed.

Streamed (``stream: true``), each choice's text goes through a :class:`CallStream`: the content
around the calls is sent as it is generated, and each call is sent whole, in one
``delta.tool_calls`` entry (its ``index``, ``id``, ``name`` and complete ``arguments``), as soon
as its ``</tool_call>`` arrives. Text that may be the start of ``<tool_call>`` is held back until
the next tokens tell. What a client assembles from the chunks is what the non-streamed answer
holds: the same content (stripped the same way) and the same calls (a property test checks it for
any split of the text into deltas).

A template that does not declare tools, or writes calls in another format, gets a 400 naming
``tools`` rather than tool definitions silently dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from radixkv.server.errors import APIError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


def check_template(template: str | None) -> None:
    """Raise a 400 naming ``tools`` unless ``template`` declares tools in the ``<tool_call>``
    format."""
    if not template or "tools" not in template:
        raise APIError(400, "this model's chat template does not declare tools, so the model "
                       "was not trained to call them", param="tools",
                       code="unsupported_parameter")
    if CALL_OPEN not in template:
        raise APIError(400, "this model's chat template writes tool calls in a format radixkv "
                       f"does not parse (it reads {CALL_OPEN} ... {CALL_CLOSE}: Hermes, Qwen, "
                       "SmolLM3)", param="tools", code="unsupported_parameter")


def _call(body: str, names: set[str]) -> dict[str, Any] | None:
    """The OpenAI tool call written by one ``<tool_call>`` block's ``body`` (the JSON between
    the tags), or None when it is not JSON or names no tool of ``names``."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str)
                         else json.dumps(args, ensure_ascii=False)}}


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` from a reply: each well-formed ``<tool_call>`` whose JSON
    names one of ``names`` becomes an OpenAI tool call; anything else stays in the content
    (``None`` when nothing is left)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _CALL.finditer(text):
        call = _call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


class CallStream:
    """One streamed choice's text split into content deltas and whole tool calls, so that what
    a client assembles equals :func:`parse` of the whole text (module docstring).

    :meth:`feed` each delta as it is generated and :meth:`finish` once at the end; each
    returns ``(content to send now, calls completed now)``. Held back meanwhile: text that may
    begin ``<tool_call>``, a call until its ``</tool_call>``, and trailing whitespace (the
    non-streamed content is stripped: whitespace is sent only once text follows it). A block
    that is not a call of a known tool, or is never closed, is sent as content, as
    :func:`parse` keeps it."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.num_calls = 0       # calls returned so far (the next call's ``index``)
        self._buf = ""           # text not yet sent: a possible tag start, or an open call
        self._in_call = False    # ``_buf`` starts with CALL_OPEN and has no CALL_CLOSE yet
        self._started = False    # some content was sent (leading whitespace is dropped)
        self._space = ""         # whitespace held after the content sent

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        buf = self._buf + text
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        while buf:
            if not self._in_call:
                at = buf.find(CALL_OPEN)
                if at < 0:
                    keep = _tag_prefix(buf)
                    out.append(buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                out.append(buf[:at])
                buf = buf[at:]
                self._in_call = True
            end = buf.find(CALL_CLOSE, len(CALL_OPEN))
            if end < 0:
                break
            end += len(CALL_CLOSE)
            block, buf = buf[:end], buf[end:]
            self._in_call = False
            m = _CALL.fullmatch(block)
            call = _call(m.group(1), self.names) if m is not None else None
            if call is None:
                out.append(block)
            else:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
        self._buf = buf
        return self._content("".join(out)), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The text still held (an unclosed call or a partial tag is content); trailing
        whitespace is dropped."""
        text, self._buf, self._in_call = self._buf, "", False
        return self._content(text), []

    def _content(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept):]
        return kept


def _tag_prefix(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``CALL_OPEN``."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def stop_after(parallel_tool_calls: bool | None, active: bool, forced: bool
               ) -> tuple[str, ...]:
    """What ends a reply for ``parallel_tool_calls``: false allows one call, so an ``auto``
    reply ends after its first ``</tool_call>`` (kept in its text:
    ``SamplingParams.stop_after``); a forced call is one call by its grammar already, and
    true (the default) or no tools offered end nothing."""
    if parallel_tool_calls is False and active and not forced:
        return (CALL_CLOSE,)
    return ()


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The request's messages as the template reads them, tool calls and results included
    (an assistant call's ``arguments`` JSON string is given to the template as an object, as
    transformers' templates expect)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": m.text()}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        raise APIError(400, "a tool call's arguments are not JSON",
                                       param="messages") from None
                calls.append({**c, "function": fn})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


__all__ = ["CALL_CLOSE", "CALL_OPEN", "CallStream", "check_template", "parse", "stop_after",
           "template_messages"]
