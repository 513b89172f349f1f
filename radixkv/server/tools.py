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
around the calls is sent as it is generated; a call is announced in a ``delta.tool_calls``
entry (its ``index``, ``id``, ``name`` and empty ``arguments``) as soon as its header
``{"name": ..., "arguments":`` is written, and its arguments follow in pieces as the model
writes them, in ``json.dumps`` form (:mod:`radixkv.server.json_stream`), as vLLM's parsers
stream them. Text that may be the start of ``<tool_call>`` is held back until the next tokens
tell. The non-streamed answer is the same reading of the whole text (:func:`parse`), so what a
client assembles from the chunks is what it holds, for any split of the text into deltas; a
property test also checks both against an independent reading of whole replies.

A template that does not declare tools, or writes calls in another format, gets a 400 naming
``tools`` rather than tool definitions silently dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from radixkv.server.errors import APIError
from radixkv.server.json_stream import JSONCanon

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


class CallStream:
    """One streamed choice's text split into content deltas and tool-call deltas (module
    docstring); :func:`parse` is this over the whole text.

    :meth:`feed` each delta as it is generated and :meth:`finish` once at the end; each
    returns ``(content to send now, tool-call deltas)``. A call is announced (``index``,
    ``id``, ``type``, ``function.name``, ``function.arguments`` empty) once its block's header
    ``{"name": "...", "arguments":`` is complete and names one of ``names``; its arguments
    follow in pieces (``{"index", "function": {"arguments": piece}}``) as the model writes
    them, in ``json.dumps`` form (:class:`~radixkv.server.json_stream.JSONCanon`). A block
    whose header is not that (another key order, an escaped name) is parsed at its
    ``</tool_call>`` and sent whole, or as content when it is not a call of a known tool. An
    announced call keeps what it has: cut short by the end of the reply (``max_tokens``), or
    written as invalid JSON, its arguments are the part that was valid, as OpenAI's are for a
    call cut short. Held back meanwhile: text that may begin ``<tool_call>``, a block until
    its header is known, and trailing whitespace (the non-streamed content is stripped)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.num_calls = 0       # calls announced so far (the next call's ``index``)
        self._buf = ""           # text not yet sent or dropped
        # None: outside a block; "pending": in a block, header not known yet; "whole": a
        # block parsed at its end; "args": an announced call's arguments; "tail": after them,
        # up to the closing tag (dropped); "broken": invalid arguments, up to the closing tag
        self._mode: str | None = None
        self._canon: JSONCanon | None = None
        self._started = False    # some content was sent (leading whitespace is dropped)
        self._space = ""         # whitespace held after the content sent

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        buf = self._buf + text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while buf:
            mode = self._mode
            if mode is None:
                at = buf.find(CALL_OPEN)
                if at < 0:
                    keep = _tag_prefix(buf, CALL_OPEN)
                    out.append(buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                out.append(buf[:at])
                buf = buf[at:]
                self._mode = "pending"
            elif mode == "pending":
                body = buf[len(CALL_OPEN):]
                status, name, start = _header(body)
                if status == "pending" and CALL_CLOSE not in body:
                    break
                if status != "yes" or name not in self.names:
                    self._mode = "whole"
                    continue
                deltas.append({"index": self.num_calls,
                               "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": name, "arguments": ""}})
                self.num_calls += 1
                self._mode, self._canon = "args", JSONCanon(raw_string=True)
                buf = body[start:]
            elif mode == "whole":
                end = buf.find(CALL_CLOSE, len(CALL_OPEN))
                if end < 0:
                    break
                end += len(CALL_CLOSE)
                block, buf = buf[:end], buf[end:]
                self._mode = None
                m = _CALL.fullmatch(block)
                call = _call(m.group(1), self.names) if m is not None else None
                if call is None:
                    out.append(block)
                else:
                    deltas.append({"index": self.num_calls, **call})
                    self.num_calls += 1
            elif mode == "args":
                assert self._canon is not None
                piece, read = self._canon.feed(buf)
                if piece:
                    deltas.append({"index": self.num_calls - 1,
                                   "function": {"arguments": piece}})
                buf = buf[read:]
                if self._canon.done:
                    self._mode = "tail"
                elif self._canon.failed:
                    self._mode = "broken"
                else:
                    break
            else:   # "tail" / "broken": drop up to the closing tag
                end = buf.find(CALL_CLOSE)
                if end < 0:
                    buf = buf[len(buf) - _tag_prefix(buf, CALL_CLOSE):]
                    break
                buf = buf[end + len(CALL_CLOSE):]
                self._mode = None
        self._buf = buf
        return self._content("".join(out)), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the reply: a partial tag or an unannounced, unclosed block is content;
        an announced call ends with the arguments it has (trailing whitespace is dropped)."""
        text, mode, self._buf, self._mode = self._buf, self._mode, "", None
        deltas: list[dict[str, Any]] = []
        if mode == "args":
            assert self._canon is not None
            piece = self._canon.finish()
            if piece:
                deltas.append({"index": self.num_calls - 1, "function": {"arguments": piece}})
            text = ""
        elif mode in ("tail", "broken"):
            text = ""
        return self._content(text), deltas

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


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole reply: what a :class:`CallStream` fed the whole
    text sends, assembled (so a streamed reply and a non-streamed one agree by construction).
    Each ``<tool_call>`` block that calls one of ``names`` becomes an OpenAI tool call; the rest
    stays in the content (``None`` when nothing is left)."""
    stream = CallStream(names)
    content, deltas = stream.feed(text)
    rest, more = stream.finish()
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas + more:
        if "id" in d:
            calls[d["index"]] = {k: v for k, v in d.items() if k != "index"}
            calls[d["index"]]["function"] = dict(d["function"])
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return (content + rest or None), [calls[i] for i in sorted(calls)]


def _header(body: str) -> tuple[str, str | None, int]:
    """Whether a ``<tool_call>`` block's text (after the tag) starts with the header
    ``{"name": "NAME", "arguments":`` (or ``"parameters"``), any whitespace between:
    ``("yes", NAME, where the arguments value begins)``, ``("no", None, 0)`` or, when the text
    so far is a proper start of one, ``("pending", None, 0)``."""
    n, i = len(body), 0
    name = None
    for step in ("{", '"name"', ":", '"', None, ",", ('"arguments"', '"parameters"'), ":"):
        while i < n and body[i] in " \t\n\r":
            i += 1
        if i >= n:
            return "pending", None, 0
        if step is None:   # the name, up to its closing quote
            end = i
            while end < n and body[end] not in '"\\':
                end += 1
            if end >= n:
                return "pending", None, 0
            if body[end] == "\\":
                return "no", None, 0   # an escaped name: the block is parsed at its end
            name, i = body[i:end], end + 1
            continue
        words = step if isinstance(step, tuple) else (step,)
        word = next((w for w in words if body.startswith(w, i)), None)
        if word is None:
            if any(w.startswith(body[i:]) for w in words):
                return "pending", None, 0
            return "no", None, 0
        i += len(word)
    return "yes", name, i


def _tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
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
