"""OpenAI tool calls for chat templates that declare tools, in the five formats open models use.

A chat template that takes ``tools`` (it refers to the variable) renders their definitions into
the prompt; the model answers with calls written the way its template teaches. radixkv reads
five formats (vLLM's ``--tool-call-parser`` names them):

* ``hermes``: Hermes, Qwen2/2.5/3 and SmolLM3 templates, calls in tags, anywhere in the reply::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* ``mistral``: Mistral templates, calls after a ``[TOOL_CALLS]`` special token, as a list or
  (newer templates) one ``name[ARGS]{...}`` per marker (:class:`MistralCallStream`)::

      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

* ``llama3_json`` (also named ``llama4_json``): Llama 3.1/3.2/3.3 templates, a reply that *is*
  calls: JSON objects, after an optional ``<|python_tag|>``, separated by ``;``::

      {"name": "get_weather", "parameters": {"city": "Paris"}}

  A reply is read as calls only when it starts (after whitespace) with ``{``; the calls are
  its leading run of objects that each call a known tool, and the text from the first thing
  that is not one is content. This is vLLM's streaming rule; vLLM's non-streamed parser also
  looks for objects later in the text and then drops the text around them, so its two answers
  can differ where radixkv's cannot.

* ``qwen3_xml`` (also named ``qwen3_coder``): Qwen3-Coder, Qwen3.5 and later Qwen templates,
  calls in tags, the arguments as one tag per parameter, values as plain text typed by the
  tool's schema (:class:`XMLCallStream`, :func:`typed_value`)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

* ``pythonic`` (also named ``llama4_pythonic``): Llama 3.2's pythonic template, Llama 4's, a
  reply that *is* a Python list of calls (Llama 4: between ``<|python_start|>`` and
  ``<|python_end|>``), each sent whole when its element ends (:class:`PythonicCallStream`)::

      [get_weather(city="Paris"), get_time(zone='UTC')]

Which format a template writes is read from the template (:func:`template_format`: the
``<tool_call>`` tag, with ``<function=`` in it for the XML calls, the ``[TOOL_CALLS]`` marker,
the pythonic ``[func_name1(`` instruction, or Llama's ``"parameters": dictionary of argument
name`` instruction);
``--tool-call-parser`` fixes it for every template that declares tools.

* ``tool_choice: "auto"``: the model may call; calls found in its text become OpenAI
  ``tool_calls`` (``arguments`` as a JSON string) and the rest is ``content``.
* ``"required"`` / ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained by a grammar (:meth:`radixkv.engine.grammar.GrammarCompiler.tool_call`, in the
  format's own shape: :func:`grammar_shape`) to calls of the tools (one or more; exactly one
  of the named tool, or with ``parallel_tool_calls: false``), each one's arguments valid
  against its tool's JSON schema.
* ``"none"``: the tools are not rendered and nothing is parsed.
* ``parallel_tool_calls: false``: one call; a hermes or XML reply ends after its first
  ``</tool_call>`` (:func:`stop_after`), a Llama or Mistral reply's later calls are dropped
  (its calls have no closing tag to stop on).

Streamed (``stream: true``), each choice's text goes through its format's stream
(:meth:`Reader.stream`): the content around the calls is sent as it is generated; a call is
announced in a ``delta.tool_calls`` entry (its ``index``, ``id``, ``name`` and empty
``arguments``) as soon as its header ``{"name": ..., "arguments":`` (or ``"parameters":``;
an XML call's ``<function=NAME>``) is written, and its arguments follow in pieces as the
model writes them, in ``json.dumps`` form (:mod:`radixkv.server.json_stream`; the XML
format's object is built key by key), as vLLM's parsers stream them. Text that may be the start
of a call is held back until the next tokens tell. The non-streamed answer is the same reading
of the whole text (:meth:`Reader.parse`), so what a client assembles from the chunks is what it
holds, for any split of the text into deltas; property tests also check both against
independent readings of whole replies.

A template that does not declare tools, or writes calls in another format, gets a 400 naming
``tools`` rather than tool definitions silently dropped.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import keyword
import re
import uuid
from collections.abc import Iterable, Mapping, Set
from typing import Any, NamedTuple

from radixkv.server.errors import APIError
from radixkv.server.json_stream import JSONCanon
from radixkv.server.tags import first_tag, tag_prefix

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
_SPACE = re.compile(r"[ \t\n\r]+")
#: what a Llama 3.x reply may start with before its calls (a special token: in the text only
#: with ``skip_special_tokens: false``)
PYTHON_TAG = "<|python_tag|>"
HERMES, LLAMA3_JSON, MISTRAL, QWEN3_XML = "hermes", "llama3_json", "mistral", "qwen3_xml"
PYTHONIC = "pythonic"
#: ``--tool-call-parser`` names -> the format read (vLLM registers one parser for both Llamas'
#: JSON calls, and one for both names of Qwen's XML calls; its llama4_pythonic is pythonic
#: with Llama 4's ``<|python_start|>`` around the list, which this reader takes too)
PARSERS = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "llama4_json": LLAMA3_JSON,
           "mistral": MISTRAL, "qwen3_coder": QWEN3_XML, "qwen3_xml": QWEN3_XML,
           "pythonic": PYTHONIC, "llama4_pythonic": PYTHONIC}
#: Llama 4's special tokens around a pythonic list (in the text only with
#: ``skip_special_tokens: false``)
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
#: the pythonic templates' instruction (Llama 3.2's pythonic template, Llama 4's): the mark of
#: the format
_PYTHONIC_MARK = "[func_name1("
#: Mistral's marker before its calls (a special token: the server keeps special tokens in the
#: text of a Mistral reply that may call, :func:`keeps_special_tokens`) and, in its newer
#: templates, between a call's name and its arguments
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_NAME_PREFIX = re.compile(r"[A-Za-z0-9_.\-]{0,64}")   # (a function name, or its start)
_ID_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
#: Llama 3.1/3.2/3.3 templates' instruction to the model (the mark of the JSON format)
_LLAMA_MARK = '"parameters": dictionary of argument name'
#: Qwen3-Coder's / Qwen3.5's XML calls (:class:`XMLCallStream`); the first is also the mark
#: of the format in a template
XML_FUNC, XML_FUNC_END = "<function=", "</function>"
XML_PARAM, XML_PARAM_END = "<parameter=", "</parameter>"
#: what ends a parameter's value: its closing tag, or (left out) the next parameter's tag;
#: not ``</function>``, which a value (code, say) may hold, as xgrammar's form allows
_VALUE_ENDS = (XML_PARAM_END, XML_PARAM)
_LONGEST_NAME = 256            # characters before a tag's ``>`` that can still be a name
_BAD_NAME = re.compile(r"[\n<]")   # what a function's name cannot hold


def template_format(template: str | None, parser: str | None = None) -> str:
    """The format ``template``'s calls are read in (one of :data:`PARSERS`' values):
    ``parser`` (``--tool-call-parser``) when given, else what the template writes. A 400
    naming ``tools`` when the template does not declare tools, or (without ``parser``) writes
    calls in a format radixkv does not read."""
    if not template or "tools" not in template:
        raise APIError(400, "this model's chat template does not declare tools, so the model "
                       "was not trained to call them", param="tools",
                       code="unsupported_parameter")
    if parser is not None:
        return PARSERS[parser]
    if CALL_OPEN in template and XML_FUNC in template:
        # Qwen3-Coder's and Qwen3.5's <tool_call><function=...><parameter=...>: the tag is
        # hermes', the body is not JSON (read as hermes, every call would be content)
        return QWEN3_XML
    if CALL_OPEN in template:
        return HERMES
    if MISTRAL_CALLS in template:
        return MISTRAL
    if _PYTHONIC_MARK in template:
        return PYTHONIC
    if _LLAMA_MARK in template:
        return LLAMA3_JSON
    raise APIError(400, "this model's chat template writes tool calls in a format radixkv "
                   f"does not recognize (it reads {CALL_OPEN} ... {CALL_CLOSE}: Hermes, Qwen, "
                   f"SmolLM3, with {XML_FUNC}NAME> inside: Qwen3-Coder, Qwen3.5; "
                   f"{MISTRAL_CALLS}: Mistral; Llama 3.x's JSON calls; and pythonic lists, "
                   f"{_PYTHONIC_MARK}...: Llama 3.2's pythonic template, Llama 4); "
                   "--tool-call-parser hermes, qwen3_coder, mistral, llama3_json or pythonic "
                   "names the format for such a template", param="tools",
                   code="unsupported_parameter")


class CallShape(NamedTuple):
    """How calls are written in a format: what a forced call's grammar produces
    (:meth:`~radixkv.engine.grammar.GrammarCompiler.tool_call`, which takes these as keyword
    arguments). ``open_tag``/``close_tag`` wrap each call, or the whole sequence of calls with
    ``around``; ``separator`` goes between two calls where several are allowed; ``name_first``:
    a call is ``open_tag + name + middle + arguments`` (Mistral's newer templates) instead of
    one JSON object holding both under ``name`` and ``args_key``; ``style``: how the
    arguments are written, ``"json"`` or ``"qwen_xml"`` (a call is then ``open_tag`` and
    ``<function=NAME>``, one ``<parameter=KEY>`` tag per argument, ``</function>`` and
    ``close_tag``)."""

    open_tag: str
    close_tag: str
    args_key: str = "arguments"
    separator: str = "\n"
    around: bool = False
    name_first: str | None = None
    style: str = "json"


def grammar_shape(fmt: str, template: str | None = None) -> CallShape:
    """The :class:`CallShape` of ``fmt`` (for Mistral, of the ``template``'s generation: a
    list after ``[TOOL_CALLS]``, or ``[TOOL_CALLS]name[ARGS]{...}`` per call where the
    template writes ``[ARGS]``)."""
    if fmt == LLAMA3_JSON:
        return CallShape("", "", "parameters", "; ")
    if fmt == QWEN3_XML:
        return CallShape(CALL_OPEN, CALL_CLOSE, style="qwen_xml")
    if fmt == PYTHONIC:   # a JSON list of call objects, as vLLM forces calls for this format
        return CallShape("[", "]", separator=", ", around=True)
    if fmt == MISTRAL:
        if template is not None and MISTRAL_ARGS in template:
            return CallShape(MISTRAL_CALLS, "", separator="", name_first=MISTRAL_ARGS)
        return CallShape(MISTRAL_CALLS + " [", "]", separator=", ", around=True)
    return CallShape(CALL_OPEN, CALL_CLOSE)


def check_names(fmt: str, names: Iterable[str], template: str | None = None) -> None:
    """A 400 naming ``tools`` for a tool whose name the format cannot write so that it reads
    back: in Qwen's XML calls a name ends at ``>`` (and holds no ``<`` or newline, nor space
    at its ends), in a pythonic call it is a Python name (dotted parts allowed), and in
    Mistral's ``name[ARGS]`` calls it is letters, digits, ``_``, ``.`` and ``-``. Such a
    tool could be offered, but no call of it would ever come back as one."""
    for name in names:
        if fmt == QWEN3_XML:
            ok = name == name.strip() and not _BAD_NAME.search(name) and ">" not in name
        elif fmt == PYTHONIC:
            ok = all(part.isidentifier() and not keyword.iskeyword(part)
                     for part in name.split("."))
        elif fmt == MISTRAL and grammar_shape(fmt, template).name_first is not None:
            ok = bool(name) and _NAME_PREFIX.fullmatch(name) is not None
        else:
            ok = True
        if not ok:
            raise APIError(400, f"the tool name {name!r} cannot be written in this model's "
                           f"tool-call format ({fmt}), so no call of it could be read back; "
                           "use letters, digits and underscores", param="tools",
                           code="invalid_value")


def history_format(template: str | None, parser: str | None = None) -> str | None:
    """The format a history's calls are rendered for where no tools are offered (``/tokenize``
    of a history): Mistral where the parser or the template says so (its call ids are
    mapped, :func:`mistral_id`), else None (ids as they are)."""
    if parser is not None:
        return PARSERS[parser]
    return MISTRAL if template and MISTRAL_CALLS in template else None


def keeps_special_tokens(fmt: str) -> bool:
    """Whether a reply that may call is decoded with its special tokens (vLLM's Mistral
    parser asks the same): Mistral's ``[TOOL_CALLS]`` is one, and without it the calls cannot
    be told from text."""
    return fmt == MISTRAL


def call_id(fmt: str) -> str:
    """A new call's ``id``: OpenAI's ``call_`` + 24 hex digits, or for Mistral 9 letters and
    digits, the only ids its templates render back (they raise on any other)."""
    if fmt == MISTRAL:
        import secrets

        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_id(given: str) -> str:
    """A call id as Mistral's templates take it: itself when it is 9 letters and digits, else
    9 letters and digits derived from it (the same for a call and its result, so they still
    pair), since a history from another server's calls would otherwise make the template
    raise."""
    if _MISTRAL_ID.fullmatch(given):
        return given
    import hashlib

    n = int.from_bytes(hashlib.blake2b(given.encode(), digest_size=8).digest(), "big")
    out = []
    for _ in range(9):
        n, r = divmod(n, len(_ID_CHARS))
        out.append(_ID_CHARS[r])
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class Reader:
    """How one request's replies are read for calls: the format, the tools that may be
    called, ``single`` (``parallel_tool_calls: false`` with ``auto``: a Llama or Mistral
    reply's calls after its first are dropped; a hermes or XML reply already ends there,
    :func:`stop_after`) and ``params``, each tool's parameters schema (the XML format's values
    are text, typed by it: :func:`typed_value`)."""

    format: str
    names: frozenset[str]
    single: bool = False
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def stream(self) -> (CallStream | JSONCallStream | MistralCallStream | XMLCallStream
                         | PythonicCallStream):
        """A fresh stream for one choice's text."""
        if self.format == PYTHONIC:
            return PythonicCallStream(self.names, self.single)
        if self.format == LLAMA3_JSON:
            return JSONCallStream(self.names, self.single)
        if self.format == MISTRAL:
            return MistralCallStream(self.names, self.single)
        if self.format == QWEN3_XML:
            return XMLCallStream(self.names, self.params)
        return CallStream(self.names)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a whole reply: what :meth:`stream` fed the whole text
        sends, assembled (so a streamed reply and a non-streamed one agree by construction)."""
        return _assemble(self.stream(), text)

    @property
    def ends_thinking(self) -> tuple[str, ...]:
        """Tags that end a reasoning model's thinking when written in it
        (:mod:`radixkv.server.reasoning`, ``ends``): a call's opening tag where the format has
        one (hermes, Qwen's XML), as vLLM's Qwen3 parser ends the reasoning at it."""
        return (CALL_OPEN,) if self.format in (HERMES, QWEN3_XML) else ()


def _call(body: str, names: Set[str]) -> dict[str, Any] | None:
    """The OpenAI tool call written by one ``<tool_call>`` block's ``body`` (the JSON between
    the tags), or None when it is not JSON or names no tool of ``names``."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json_text(args)
    if text is None:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": text}}


def json_text(value: Any) -> str | None:
    """``value`` as JSON text (``json.dumps``, ``ensure_ascii=False``), or None where it has
    none: a number beyond a double's range (``1e999`` reads as inf, which ``json.dumps``
    would write as ``Infinity``, not JSON) or nesting deeper than Python's recursion limit
    (which ``json.loads`` and ``json.dumps`` raise RecursionError for: a reply of 5,000
    ``[`` is a few thousand tokens)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


class _Content:
    """The content side of a call stream: leading whitespace dropped, trailing whitespace
    held until more content follows (the non-streamed content is stripped)."""

    def __init__(self) -> None:
        self._started = False    # some content was sent (leading whitespace is dropped)
        self._space = ""         # whitespace held after the content sent

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


class CallStream(_Content):
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

    def __init__(self, names: Set[str]) -> None:
        super().__init__()
        self.names = names
        self.num_calls = 0       # calls announced so far (the next call's ``index``)
        self._buf = ""           # text not yet sent or dropped
        # None: outside a block; "pending": in a block, header not known yet; "whole": a
        # block parsed at its end; "args": an announced call's arguments; "tail": after them,
        # up to the closing tag (dropped); "broken": invalid arguments, up to the closing tag
        self._mode: str | None = None
        self._canon: JSONCanon | None = None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        buf = self._buf + text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while buf:
            mode = self._mode
            if mode is None:
                at = buf.find(CALL_OPEN)
                if at < 0:
                    keep = tag_prefix(buf, CALL_OPEN)
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
                    buf = buf[len(buf) - tag_prefix(buf, CALL_CLOSE):]
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


class _ObjectCalls(_Content):
    """What the Llama and Mistral streams share: reading one call written as a JSON object
    (:meth:`_read_object`), in the modes ``"pending"`` (its header not known yet),
    ``"whole"`` (read to its end, then judged), ``"args"`` (an announced call's arguments,
    streamed) and ``"tail"`` (the rest of its object, skipped). The subclass decides what
    comes around the objects and what follows each outcome."""

    FORMAT = LLAMA3_JSON   # whose call ids (:func:`call_id`)
    OBJECT_MODES = frozenset({"pending", "whole", "args", "tail"})

    def __init__(self, names: Set[str], single: bool) -> None:
        super().__init__()
        self.names, self.single = names, single
        self.num_calls = 0       # calls announced so far (the next call's ``index``)
        self._buf = ""           # text not yet sent or dropped
        self._mode = ""
        self._raw = ""           # "whole": the object's text read so far
        self._canon: JSONCanon | None = None
        self._close = _Closing()
        self._tail = True        # an announced call's object goes on after its arguments

    def count_call(self) -> None:
        """A call was announced: counted (a stream with more to track extends this)."""
        self.num_calls += 1

    def _read_object(self, buf: str, deltas: list[dict[str, Any]]) -> tuple[str, str]:
        """Advance the object being read over ``buf``: ``(rest, what happened)``, one of
        ``"wait"`` (more text is needed), ``"more"`` (read on: the mode changed),
        ``"called"`` (a call is complete), ``"other"`` (not a call: ``rest`` starts with the
        object's text) or ``"broken"`` (an announced call's arguments are not JSON)."""
        mode = self._mode
        if mode == "pending":
            status, name, start = _header(buf)
            if status == "pending":
                return buf, "wait"
            if status == "yes" and name is not None and name in self.names:
                deltas.append({"index": self.num_calls, "id": call_id(self.FORMAT),
                               "type": "function", "function": {"name": name, "arguments": ""}})
                self.count_call()
                self._mode, self._canon = "args", JSONCanon(raw_string=True)
                return buf[start:], "more"
            self._mode, self._canon, self._raw = "whole", JSONCanon(), ""
            return buf, "more"
        if mode == "whole":
            assert self._canon is not None
            _, read = self._canon.feed(buf)
            self._raw, buf = self._raw + buf[:read], buf[read:]
            if self._canon.done:
                call = _call(self._raw, self.names)
                if call is not None:
                    deltas.append({"index": self.num_calls, **call, "id": call_id(self.FORMAT)})
                    self.count_call()
                    self._raw = ""
                    return buf, "called"
            elif not self._canon.failed:
                return buf, "wait"
            raw, self._raw = self._raw, ""
            return raw + buf, "other"
        if mode == "args":
            assert self._canon is not None
            piece, read = self._canon.feed(buf)
            if piece:
                deltas.append({"index": self.num_calls - 1, "function": {"arguments": piece}})
            buf = buf[read:]
            if self._canon.done:
                if not self._tail:
                    return buf, "called"
                self._mode, self._close = "tail", _Closing()
                return buf, "more"
            return buf, "broken" if self._canon.failed else "wait"
        end = self._close.feed(buf)   # "tail"
        return ("", "wait") if end < 0 else (buf[end:], "called")

    def _finish_args(self, deltas: list[dict[str, Any]]) -> None:
        """The reply ended inside an announced call's arguments: the last piece, if any."""
        assert self._canon is not None
        piece = self._canon.finish()
        if piece:
            deltas.append({"index": self.num_calls - 1, "function": {"arguments": piece}})


class JSONCallStream(_ObjectCalls):
    """One streamed choice's text in Llama 3.x's JSON format (module docstring) split into
    content deltas and tool-call deltas; :meth:`Reader.parse` is this over the whole text.

    The interface and the deltas are :class:`CallStream`'s. The reply's start decides: after
    whitespace and an optional ``<|python_tag|>``, a ``{`` begins calls; anything else makes
    the whole reply content, sent as it comes. An object is announced once its header
    ``{"name": "...", "parameters":`` (or ``"arguments":``) names a known tool; its arguments
    stream, and keys after them are skipped to the object's closing brace. An object with
    another key order is read to its end and then judged. Between objects, whitespace and
    ``;`` separate; anything else, or an object that is not a call of a known tool, begins
    the content, which runs to the end of the reply (the ``<|python_tag|>`` included when no
    call was made). ``single``: the reply's first call is its only one, the rest is dropped.
    A call cut short keeps the arguments it has, as in :class:`CallStream`."""

    def __init__(self, names: Set[str], single: bool = False) -> None:
        super().__init__(names, single)
        # "start": whitespace or a python tag so far; the object modes (_ObjectCalls);
        # "between": after a call; "text": content to the end; "drop": dropped to the end
        self._mode = "start"
        self._lead = ""          # what preceded the first object (whitespace, the tag)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        buf = self._buf + text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while buf:
            mode = self._mode
            if mode == "start":
                rest = _after_lead(buf, PYTHON_TAG)
                if rest is None:
                    break
                if rest[0] == "{":
                    self._lead, buf = buf[:len(buf) - len(rest)], rest
                    self._mode = "pending"
                else:
                    self._mode = "text"
            elif mode in self.OBJECT_MODES:
                buf, what = self._read_object(buf, deltas)
                if what == "wait":
                    break
                if what == "called":
                    self._mode = "drop" if self.single else "between"
                elif what == "other":   # not a call: content from here (the lead before it)
                    buf = (self._lead if not self.num_calls else "") + buf
                    self._mode = "text"
                elif what == "broken":
                    self._mode = "drop"
            elif mode == "between":
                rest = buf.lstrip(" \t\n\r;")
                if not rest:
                    buf = ""
                    break
                buf, self._mode = rest, "pending" if rest[0] == "{" else "text"
            elif mode == "text":
                out.append(buf)
                buf = ""
            else:   # "drop"
                buf = ""
        self._buf = buf
        return self._content("".join(out)), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the reply: an object not yet judged is content; an announced call ends
        with the arguments it has."""
        text, mode, self._buf, self._mode = self._buf, self._mode, "", "drop"
        deltas: list[dict[str, Any]] = []
        if mode == "args":
            self._finish_args(deltas)
            text = ""
        elif mode in ("pending", "whole"):
            raw, self._raw = self._raw, ""
            text = (self._lead if not self.num_calls else "") + raw + text
        elif mode not in ("start", "text"):
            text = ""
        return self._content(text), deltas


class MistralCallStream(_ObjectCalls):
    """One streamed choice's text in Mistral's format split into content deltas and tool-call
    deltas; :meth:`Reader.parse` is this over the whole text.

    The interface and the deltas are :class:`CallStream`'s (ids of 9 letters and digits,
    :func:`call_id`). Text up to ``[TOOL_CALLS]`` is content (a start of the marker is held
    back until the next tokens tell). After the marker and any whitespace, either a JSON list
    of calls, ``[{"name": ..., "arguments": {...}}, ...]`` (the templates of Mistral 7B v0.3,
    Mixtral, Nemo, Ministral, Small 2501), each element announced at its header with its
    arguments streamed as in :class:`JSONCallStream` (keys after them, such as an ``id``,
    skipped to the element's end; another key order read whole, then judged), or
    ``name[ARGS]{...}`` (newer templates: one call per marker). After a list or such a call
    the text is content again, and another marker starts more calls. Calls that do not parse
    (no list, an unknown tool, broken JSON) before any of the marker's was announced are
    content, the marker included; once one was, the rest of the reply is dropped. ``single``:
    the first call only."""

    FORMAT = MISTRAL

    def __init__(self, names: Set[str], single: bool = False) -> None:
        super().__init__(names, single)
        # "text": content, watching for the marker; "open": just after a marker; "name": a
        # newer call's name, up to [ARGS]; "item": in a list, before an element; the object
        # modes (_ObjectCalls); "sep": after an element; "drop": dropped to the end
        self._mode = "text"
        self._section = ""       # read since the marker while none of its calls was announced
        self._calls_here = 0     # calls announced since the marker

    def count_call(self) -> None:
        super().count_call()
        self._calls_here += 1
        self._section = ""

    def _keep(self, text: str) -> None:
        if not self._calls_here:
            self._section += text

    def _fail(self, out: list[str]) -> None:
        """What followed the marker is not (more of) its calls: content from the marker when
        none was announced (the caller goes on reading the rest as text), else dropped."""
        if self._calls_here:
            self._mode = "drop"
        else:
            out.append(self._section)
            self._section, self._mode = "", "text"

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        buf = self._buf + text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while buf:
            mode = self._mode
            if mode == "text":
                at = buf.find(MISTRAL_CALLS)
                if at < 0:
                    keep = tag_prefix(buf, MISTRAL_CALLS)
                    out.append(buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                out.append(buf[:at])
                buf = buf[at + len(MISTRAL_CALLS):]
                self._mode, self._section, self._calls_here = "open", MISTRAL_CALLS, 0
            elif mode == "open":
                rest = buf.lstrip()
                self._keep(buf[:len(buf) - len(rest)])
                buf = rest
                if not rest:
                    break
                if rest[0] == "[":
                    self._keep("[")
                    buf, self._mode, self._tail = rest[1:], "item", True
                else:
                    self._mode, self._tail = "name", False
            elif mode == "name":
                at = buf.find(MISTRAL_ARGS)
                if at < 0:
                    if _NAME_PREFIX.fullmatch(buf[:len(buf) - tag_prefix(buf, MISTRAL_ARGS)]):
                        break   # a name being written
                    self._fail(out)
                    continue
                name = buf[:at]
                if _NAME_PREFIX.fullmatch(name) and name in self.names:
                    deltas.append({"index": self.num_calls, "id": call_id(MISTRAL),
                                   "type": "function",
                                   "function": {"name": name, "arguments": ""}})
                    self.count_call()
                    self._mode, self._canon = "args", JSONCanon(raw_string=True)
                    buf = buf[at + len(MISTRAL_ARGS):]
                else:
                    self._fail(out)
            elif mode == "item":
                rest = buf.lstrip()
                self._keep(buf[:len(buf) - len(rest)])
                buf = rest
                if not rest:
                    break
                if rest[0] == "{":
                    self._mode = "pending"
                elif rest[0] == "]" and self._calls_here:   # after a trailing comma
                    buf, self._mode = rest[1:], "text"
                else:
                    self._fail(out)
            elif mode in self.OBJECT_MODES:
                buf, what = self._read_object(buf, deltas)
                if what == "wait":
                    break
                if what == "called":   # a list's element goes on to its separator
                    self._mode = "drop" if self.single else "sep" if self._tail else "text"
                elif what == "other":
                    self._fail(out)
                elif what == "broken":
                    self._mode = "drop"
            elif mode == "sep":
                rest = buf.lstrip()
                if not rest:
                    buf = ""
                    break
                if rest[0] == ",":
                    buf, self._mode = rest[1:], "item"
                elif rest[0] == "]":
                    buf, self._mode = rest[1:], "text"
                else:
                    buf, self._mode = "", "drop"
            else:   # "drop"
                buf = ""
        self._buf = buf
        return self._content("".join(out)), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the reply: a marker none of whose calls was announced is content with
        what followed it; an announced call ends with the arguments it has."""
        text, mode, self._buf, self._mode = self._buf, self._mode, "", "drop"
        deltas: list[dict[str, Any]] = []
        if mode == "args":
            self._finish_args(deltas)
            text = ""
        elif mode in ("open", "name", "item", "pending", "whole"):
            raw, self._raw = self._raw, ""
            text = "" if self._calls_here else self._section + raw + text
        elif mode != "text":
            text = ""
        return self._content(text), deltas


class PythonicCallStream(_Content):
    """One streamed choice's text in the pythonic format (module docstring) split into content
    deltas and tool-call deltas; :meth:`Reader.parse` is this over the whole text.

    The interface and the deltas are :class:`CallStream`'s. The reply's start decides, as for
    Llama's JSON calls: after whitespace and an optional ``<|python_start|>`` (Llama 4), a
    ``[`` begins a list of calls; anything else makes the whole reply content. Each element is
    read to its end (brackets counted outside Python string literals, :class:`_PyScan`) and
    then judged (:func:`_element_call`): ``name(key=value, ...)`` with a known tool's name
    (dotted names too, as vLLM reads them) and literal values (Python's, or JSON's ``true`` /
    ``false`` / ``null``), or a JSON object ``{"name": ..., "arguments": {...}}`` (how a forced
    call is written, :func:`grammar_shape`). A call is sent whole when its element ends (name
    and arguments in one delta: its values are Python literals, whose JSON form is known once
    they end). After the list's ``]`` (and an optional ``<|python_end|>``) the text is content.
    An element that is not a call makes the whole reply content when no call was sent yet,
    and is dropped with the rest of the reply after one; so is an element cut short by the
    end of the reply (``max_tokens``). ``single``: the first call is the only one, the rest
    is dropped."""

    def __init__(self, names: Set[str], single: bool = False) -> None:
        super().__init__()
        self.names, self.single = names, single
        self.num_calls = 0
        self._buf = ""
        # "start", "list" (an element is next), "elem" (one is being read: its text is the
        # scanner's), "after" (after one: "," or "]"), "end" (after "]"), "text" (content to
        # the end), "drop"
        self._mode = "start"
        self._raw: list[str] = []    # the reply's text until a call is sent (content if none)
        self._scan = _PyScan()

    def _fail(self, elem: str = "") -> None:
        """Not a list of calls (``elem``: the element read, before the text held): content
        from the start before any call, dropped after one."""
        if self.num_calls:
            self._mode, self._buf = "drop", ""
        else:
            self._buf = "".join(self._raw) + elem + self._buf
            self._mode = "text"
        self._raw, self._scan = [], _PyScan()

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf += text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._buf:
            buf, mode = self._buf, self._mode
            if mode == "start":
                rest = _after_lead(buf, PYTHON_START)
                if rest is None:
                    break
                if rest[0] != "[":
                    self._mode = "text"
                    continue
                cut = len(buf) - len(rest) + 1
                self._raw.append(buf[:cut])
                self._buf, self._mode = buf[cut:], "list"
            elif mode == "list":
                rest = _skip_space(buf)
                self._raw.append(buf[:len(buf) - len(rest)])
                self._buf = rest
                if not rest:
                    break
                if rest[0] != "{" and not rest[0].isidentifier():
                    self._fail()
                    continue
                self._mode, self._scan = "elem", _PyScan()
            elif mode == "elem":
                self._buf = ""
                end = self._scan.feed(buf)
                if end == -2:   # not an element of a list of calls
                    self._fail(self._scan.text)
                    continue
                if end < 0:
                    break
                elem, self._buf = self._scan.text[:end], self._scan.text[end:]
                call = _element_call(elem, self.names)
                if call is None:
                    self._fail(elem)
                    continue
                deltas.append({"index": self.num_calls, **call})
                self.num_calls += 1
                self._raw, self._scan = [], _PyScan()
                self._mode = "drop" if self.single else "after"
            elif mode == "after":
                rest = _skip_space(buf)
                self._buf = rest
                if not rest:
                    break
                if rest[0] == ",":
                    self._buf, self._mode = rest[1:], "list"
                elif rest[0] == "]":
                    self._buf, self._mode = rest[1:], "end"
                else:
                    self._fail()
            elif mode == "end":
                rest = _skip_space(buf)
                if PYTHON_END.startswith(rest):
                    self._buf = rest
                    break
                self._buf = rest[len(PYTHON_END):] if rest.startswith(PYTHON_END) else rest
                self._mode = "text"
            elif mode == "text":
                out.append(buf)
                self._buf = ""
            else:   # "drop"
                self._buf = ""
        return self._content("".join(out)), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the reply: a list not yet made of calls is content (its start
        included); after a call, an unfinished element is dropped, and so is a held start of
        ``<|python_end|>``."""
        if self._mode in ("list", "elem", "after"):
            self._fail(self._scan.text if self._mode == "elem" else "")
        text = self._buf if self._mode in ("start", "text") else ""
        self._buf, self._mode = "", "drop"
        return self._content(text), []


class _PyScan:
    """Where one element of a list of calls ends, its text given in pieces (:attr:`text`
    holds all of it): brackets counted outside Python string literals (single, double and
    triple quotes, backslash escapes). Quote characters at the end of the text so far that may
    still become a triple quote are read with the next piece."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0          # scanned up to here
        self.depth = 0
        self.quote = ""       # the open string's delimiter: ', ", ''' or """
        self.opened = False   # the element's first bracket was seen

    def feed(self, piece: str) -> int:
        """The index just past the element's closing bracket in :attr:`text`, -1 (read on)
        or -2 (not an element: before its first bracket, a character no name has)."""
        self.text += piece
        text, n, i = self.text, len(self.text), self.pos
        while i < n:
            q = self.quote
            if q:   # inside a string: to its next quote or backslash
                j, k = text.find(q[0], i), text.find("\\", i)
                if k >= 0 and (j < 0 or k < j):
                    if k + 1 >= n:
                        i = k
                        break
                    i = k + 2
                    continue
                if j < 0:
                    i = n
                    break
                if len(q) == 1:
                    self.quote, i = "", j + 1
                elif text.startswith(q, j):
                    self.quote, i = "", j + 3
                elif n - j < 3 and text[j:] == q[0] * (n - j):
                    i = j   # may be the closing triple quote
                    break
                else:
                    i = j + 1
                continue
            c = text[i]
            if c in "'\"":
                if text.startswith(c * 3, i):
                    self.quote, i = c * 3, i + 3
                    continue
                if n - i < 3 and text[i:] == c * (n - i):
                    break   # may open a triple quote
                self.quote = c
            elif c in "([{":
                self.depth += 1
                self.opened = True
            elif c in ")]}":
                self.depth -= 1
                if self.depth < 0:
                    return -2
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
            elif not self.opened and not (c.isalnum() or c in "_. \t\n\r"):
                return -2
            i += 1
        self.pos = i
        return -1


def _element_call(text: str, names: Set[str]) -> dict[str, Any] | None:
    """The OpenAI tool call one element of a pythonic list writes: ``name(key=value, ...)``
    (literal values, Python's or JSON's spellings) or a JSON object with ``name`` and
    ``arguments`` (or ``parameters``); None when it is neither or names no tool of ``names``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or set(obj) - {"name", "arguments", "parameters"} \
                or obj.get("name") not in names:
            return None
        given = obj.get("arguments", obj.get("parameters", {}))
        arguments = json_text(given) if isinstance(given, dict) else None
        if arguments is None:
            return None
        return {"id": call_id(PYTHONIC), "type": "function",
                "function": {"name": obj["name"], "arguments": arguments}}
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None or name not in names:
        return None
    args: dict[str, Any] = {}
    try:
        for kw in node.keywords:
            if kw.arg is None:   # **kwargs
                return None
            args[kw.arg] = _literal(kw.value)
    except (ValueError, RecursionError):
        return None
    arguments = json_text(args)
    if arguments is None:
        return None
    return {"id": call_id(PYTHONIC), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of a name or a chain of attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """The JSON value of a literal: strings, numbers, booleans, None, lists and tuples, dicts
    with string keys, a sign before a number, and JSON's ``true`` / ``false`` / ``null``
    (models trained on JSON write them); ValueError for anything else."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, bool, int, float)):
            return node.value
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ValueError("a dict key that is not a string")
            out[k.value] = _literal(v)
        return out
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) \
            and not isinstance(node.operand.value, bool):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


class XMLCallStream(_Content):
    """One streamed choice's text in Qwen3-Coder's XML format (module docstring) split into
    content deltas and tool-call deltas; :meth:`Reader.parse` is this over the whole text.

    The interface and the deltas are :class:`CallStream`'s. A call opens with ``<tool_call>``
    and whitespace then ``<function=NAME>``, or with ``<function=NAME>`` alone (models of
    this family sometimes leave the outer tag out, and vLLM reads those too); it is announced
    at the ``>`` after a known tool's name. Then each ``<parameter=KEY>VALUE</parameter>``
    becomes one key of the arguments' JSON object as it is written: the value's text with one
    newline at each end taken as markup (the template writes them), ended by
    ``</parameter>``, or by the next ``<parameter=`` when the model left the closing tag out.
    A value whose schema type (the tool's ``parameters``) is only a string,
    or whose key the schema does not define, streams as a JSON string as it comes; another
    type is held to the value's end and written typed (:func:`typed_value`). ``</function>``
    closes the object; text up to ``</tool_call>`` after it is dropped. A tag or a name that
    is not a call of a known tool is content, as is text that may still begin a tag until
    the next tokens tell. A call cut short (``max_tokens``) ends with the parameters written
    so far, the last one's value as far as it got, as a whole JSON object."""

    def __init__(self, names: Set[str], params: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.names = names
        self.params = params or {}   # a tool's name -> the JSON schema of its parameters
        self.num_calls = 0           # calls announced so far (the next call's ``index``)
        self._buf = ""               # text not yet sent or dropped
        # None: content; "open": after <tool_call>, before <function=; "name": the function's
        # name; "params": between parameters; "key": a parameter's name; "value": its value;
        # "tail": after </function>, up to </tool_call>
        self._mode: str | None = None
        self._block = ""             # an unannounced call's text (content if it is not one)
        self._props: Mapping[str, Any] = {}   # the called tool's parameter schemas
        self._nargs = 0              # keys written in the announced call's object
        self._schema: Any = None     # the value's schema
        self._typed = False          # the value is held and typed at its end
        self._raw: list[str] = []    # a typed value's text so far
        self._first = False          # the value's first character (a newline there is markup)

    def _args(self, piece: str) -> dict[str, Any]:
        return {"index": self.num_calls - 1, "function": {"arguments": piece}}

    def _not_a_call(self, out: list[str]) -> None:
        """The tag read so far is content; the text after it is read again."""
        out.append(self._block)
        self._block, self._mode = "", None

    def _value(self, piece: str, deltas: list[dict[str, Any]]) -> None:
        if not piece:
            return
        if self._typed:
            self._raw.append(piece)
        else:
            deltas.append(self._args(json.dumps(piece, ensure_ascii=False)[1:-1]))

    def _end_value(self, deltas: list[dict[str, Any]]) -> None:
        if self._typed:
            value = typed_value("".join(self._raw), self._schema)
            self._raw = []
            deltas.append(self._args(json.dumps(value, ensure_ascii=False)))
        else:
            deltas.append(self._args('"'))

    def _end_args(self, deltas: list[dict[str, Any]]) -> None:
        deltas.append(self._args("}" if self._nargs else "{}"))

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        buf = self._buf + text
        out: list[str] = []
        deltas: list[dict[str, Any]] = []
        while buf:
            mode = self._mode
            if mode is None:
                at, tag = first_tag(buf, (CALL_OPEN, XML_FUNC))
                if at < 0:
                    keep = max(tag_prefix(buf, CALL_OPEN), tag_prefix(buf, XML_FUNC))
                    out.append(buf[:len(buf) - keep])
                    buf = buf[len(buf) - keep:]
                    break
                out.append(buf[:at])
                self._block, buf = tag, buf[at + len(tag):]
                self._mode = "open" if tag == CALL_OPEN else "name"
            elif mode == "open":
                rest = _skip_space(buf)
                if rest.startswith(XML_FUNC):
                    self._block += buf[:len(buf) - len(rest) + len(XML_FUNC)]
                    buf, self._mode = rest[len(XML_FUNC):], "name"
                elif XML_FUNC.startswith(rest):
                    break
                else:
                    self._not_a_call(out)
            elif mode == "name":
                end = buf.find(">")
                head = buf if end < 0 else buf[:end]
                if end < 0 and len(buf) <= _LONGEST_NAME and not _BAD_NAME.search(buf):
                    break
                name = head.strip()
                if end < 0 or len(head) > _LONGEST_NAME or _BAD_NAME.search(head) \
                        or name not in self.names:
                    self._not_a_call(out)
                    continue
                deltas.append({"index": self.num_calls, "id": call_id(QWEN3_XML),
                               "type": "function", "function": {"name": name, "arguments": ""}})
                self.num_calls += 1
                props = (self.params.get(name) or {}).get("properties") \
                    if isinstance(self.params.get(name), dict) else None
                self._props = props if isinstance(props, dict) else {}
                self._nargs, self._block = 0, ""
                buf, self._mode = buf[end + 1:], "params"
            elif mode == "params":
                rest = _skip_space(buf)
                if rest.startswith(XML_PARAM):
                    buf, self._mode = rest[len(XML_PARAM):], "key"
                elif rest.startswith(XML_FUNC_END):
                    self._end_args(deltas)
                    buf, self._mode = rest[len(XML_FUNC_END):], "tail"
                elif rest.startswith(CALL_CLOSE):   # the function's end left out
                    self._end_args(deltas)
                    buf, self._mode = rest[len(CALL_CLOSE):], None
                elif any(tag.startswith(rest) for tag in (XML_PARAM, XML_FUNC_END, CALL_CLOSE)):
                    buf = rest
                    break
                else:   # stray text between parameters: dropped up to the next tag
                    at = rest.find("<", 1)
                    buf = rest[at:] if at > 0 else ""
            elif mode == "key":
                end = buf.find(">")
                if end < 0 and len(buf) <= _LONGEST_NAME:
                    break
                if end < 0 or end > _LONGEST_NAME:   # not a key: stray text
                    self._mode = "params"
                    continue
                key, buf = buf[:end].strip(), buf[end + 1:]
                self._schema = self._props.get(key)
                self._typed = _types(self._schema) != {"string"}
                self._raw, self._first = [], True
                self._nargs += 1
                head = "{" if self._nargs == 1 else ", "
                deltas.append(self._args(head + json.dumps(key, ensure_ascii=False) + ": "
                                         + ("" if self._typed else '"')))
                self._mode = "value"
            elif mode == "value":
                if self._first:   # one newline after the tag is markup
                    self._first = False
                    if buf[0] == "\n":
                        buf = buf[1:]
                        continue
                at, tag = first_tag(buf, _VALUE_ENDS)
                if at < 0:
                    cut = len(buf) - max(tag_prefix(buf, t) for t in _VALUE_ENDS)
                    if cut > 0 and buf[cut - 1] == "\n":   # may be the markup before the end
                        cut -= 1
                    self._value(buf[:cut], deltas)
                    buf = buf[cut:]
                    break
                value = buf[:at]
                self._value(value[:-1] if value.endswith("\n") else value, deltas)
                self._end_value(deltas)
                buf = buf[at + len(tag):] if tag == XML_PARAM_END else buf[at:]
                self._mode = "params"
            else:   # "tail": up to </tool_call>, dropped
                rest = _skip_space(buf)
                if rest.startswith(CALL_CLOSE):
                    buf, self._mode = rest[len(CALL_CLOSE):], None
                elif CALL_CLOSE.startswith(rest):
                    buf = rest
                    break
                else:   # no closing tag: what follows is read as content (or a next call)
                    buf, self._mode = rest, None
        self._buf = buf
        return self._content("".join(out)), deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The end of the reply: held text outside a call, and an unannounced call's text,
        are content; an announced call ends with what it has, its object closed."""
        text, mode, self._buf, self._mode = self._buf, self._mode, "", None
        deltas: list[dict[str, Any]] = []
        if mode in ("open", "name"):
            text, self._block = self._block + text, ""
        elif mode == "value":
            if self._first and text.startswith("\n"):
                text = text[1:]
            self._value(text[:-1] if text.endswith("\n") else text, deltas)
            self._end_value(deltas)
            self._end_args(deltas)
            text = ""
        elif mode in ("params", "key"):
            self._end_args(deltas)
            text = ""
        elif mode == "tail":
            text = ""
        return self._content(text), deltas


def _after_lead(text: str, tag: str) -> str | None:
    """What a reply that *is* its calls has after its leading whitespace and an optional
    ``tag`` (Llama's ``<|python_tag|>``, Llama 4's ``<|python_start|>``), or None while the
    text so far may still be only those (read on)."""
    rest = text.lstrip()
    if rest.startswith(tag):
        rest = rest[len(tag):].lstrip()
    elif tag.startswith(rest):   # whitespace, or the tag's start
        return None
    return rest or None


def _skip_space(text: str) -> str:
    space = _SPACE.match(text)
    return text[space.end():] if space is not None else text


def _types(schema: Any) -> set[str]:
    """The JSON types a schema allows (``type``, an ``enum``'s values, ``anyOf`` / ``oneOf``
    / ``allOf`` alternatives); ``{"string"}`` where it says nothing (or is not a schema)."""
    if not isinstance(schema, dict):
        return {"string"}
    found: set[str] = set()
    kind = schema.get("type")
    for t in [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []:
        if isinstance(t, str):
            found.add(t)
    enum = schema.get("enum")
    for v in enum if isinstance(enum, list) else []:
        found.add("null" if v is None else "boolean" if isinstance(v, bool)
                  else "integer" if isinstance(v, int) else "number" if isinstance(v, float)
                  else "string" if isinstance(v, str) else "array" if isinstance(v, list)
                  else "object")
    for key in ("anyOf", "oneOf", "allOf"):
        alts = schema.get(key)
        for alt in alts if isinstance(alts, list) else []:
            found |= _types(alt)
    return found or {"string"}


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its schema types it: the first of null, integer,
    number, boolean, object, array and string that the schema allows and the text reads as
    (``true``/``1``, ``false``/``0`` as booleans; an integral number as an integer), else the
    text read as JSON, else the text (the order vLLM's Qwen3-Coder parser tries types in).
    Inside an object or array read so, a string where the sub-schema (``properties``,
    ``items``) wants another type is typed the same way (``{"days": "3"}`` for an integer
    ``days`` is ``{"days": 3}``), as vLLM's parser does."""
    allowed = _types(schema)
    text = raw.strip()
    parsed: Any = _NO_JSON
    try:
        parsed = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        pass
    if parsed is not _NO_JSON and json_text(parsed) is None:   # 1e999, or nested too deep
        parsed = _NO_JSON
    for kind in ("null", "integer", "number", "boolean", "object", "array", "string"):
        if kind not in allowed:
            continue
        if kind == "string":
            return raw
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "boolean" and text.lower() in ("true", "1", "false", "0"):
            return text.lower() in ("true", "1")
        if parsed is _NO_JSON or isinstance(parsed, bool):
            continue
        if kind in ("integer", "number") and isinstance(parsed, (int, float)):
            if isinstance(parsed, float) and parsed.is_integer():
                return int(parsed)
            if kind == "number" or isinstance(parsed, int):
                return parsed
        if kind == "object" and isinstance(parsed, dict) \
                or kind == "array" and isinstance(parsed, list):
            return _retyped(parsed, schema)
    return raw if parsed is _NO_JSON else _retyped(parsed, schema)


def _retyped(value: Any, schema: Any) -> Any:
    """``value`` (read from JSON) with its strings typed by their sub-schemas
    (:func:`typed_value`); as it is where that nests past Python's recursion limit."""
    def walk(v: Any, sub: Any) -> Any:
        if not isinstance(sub, dict):
            return v
        if isinstance(v, str):
            return typed_value(v, sub) if _types(sub) != {"string"} else v
        if isinstance(v, dict) and isinstance(sub.get("properties"), dict):
            props = sub["properties"]
            return {k: walk(x, props.get(k)) for k, x in v.items()}
        if isinstance(v, list) and isinstance(sub.get("items"), dict):
            return [walk(x, sub["items"]) for x in v]
        return v

    try:
        return walk(value, schema)
    except RecursionError:
        return value


def _no_constant(name: str) -> Any:
    raise ValueError(name)   # NaN, Infinity: not JSON


_NO_JSON: Any = object()


class _Closing:
    """Where the object being read closes, its text given in pieces: braces and brackets
    counted outside strings (the keys after a call's arguments are skipped unread)."""

    def __init__(self) -> None:
        self.depth, self.string, self.escape = 1, False, False

    def feed(self, text: str) -> int:
        """The index just past the closing brace in ``text``, or -1 (read on)."""
        for i, c in enumerate(text):
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole hermes reply (:meth:`Reader.parse`): each
    ``<tool_call>`` block that calls one of ``names`` becomes an OpenAI tool call; the rest
    stays in the content (``None`` when nothing is left)."""
    return _assemble(CallStream(names), text)


def _assemble(stream: (CallStream | JSONCallStream | MistralCallStream | XMLCallStream
                       | PythonicCallStream),
              text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """What a client assembles from ``stream`` fed the whole of ``text``."""
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
    """Whether a call's text (a ``<tool_call>`` block's after the tag, or a Llama object's
    from its brace) starts with the header
    ``{"name": "NAME", "arguments":`` (or ``"parameters"``), any whitespace between:
    ``("yes", NAME, where the arguments value begins)``, ``("no", None, 0)`` or, when the text
    so far is a proper start of one, ``("pending", None, 0)``."""
    n, i = len(body), 0
    name = None
    for step in ("{", '"name"', ":", '"', None, ",", ('"arguments"', '"parameters"'), ":"):
        # whitespace skipped at C speed: a block padded with it is rescanned at every delta
        # until its header is known (quadratic in Python: 1 s over 8,000 newline tokens)
        space = _SPACE.match(body, i)
        i = space.end() if space is not None else i
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


def stop_after(parallel_tool_calls: bool | None, active: bool, forced: bool,
               fmt: str = HERMES) -> tuple[str, ...]:
    """What ends a reply for ``parallel_tool_calls``: false allows one call, so a hermes or
    XML ``auto`` reply ends after its first ``</tool_call>`` (kept in its text:
    ``SamplingParams.stop_after``); a forced call is one call by its grammar already, and
    true (the default) or no tools offered end nothing. A Llama or Mistral call has no
    closing tag to stop on: its reply's later calls are dropped instead (:class:`Reader`)."""
    if parallel_tool_calls is False and active and not forced and fmt in (HERMES, QWEN3_XML):
        return (CALL_CLOSE,)
    return ()


def template_messages(messages: list[Any], fmt: str | None = None) -> list[dict[str, Any]]:
    """The request's messages as the template reads them, tool calls and results included
    (an assistant call's ``arguments`` JSON string is given to the template as an object, as
    transformers' templates expect; for ``fmt`` Mistral, call ids as :func:`mistral_id`)."""
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
                    except (ValueError, RecursionError):
                        raise APIError(400, "a tool call's arguments are not JSON",
                                       param="messages") from None
                call = {**c, "function": fn}
                if fmt == MISTRAL and isinstance(call.get("id"), str):
                    call["id"] = mistral_id(call["id"])
                calls.append(call)
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = (mistral_id(m.tool_call_id) if fmt == MISTRAL
                                 else m.tool_call_id)
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


__all__ = ["CALL_CLOSE", "CALL_OPEN", "HERMES", "LLAMA3_JSON", "MISTRAL", "MISTRAL_ARGS",
           "MISTRAL_CALLS", "PARSERS", "PYTHONIC", "PYTHON_END", "PYTHON_START", "PYTHON_TAG",
           "QWEN3_XML", "XML_FUNC", "XML_FUNC_END", "XML_PARAM", "XML_PARAM_END", "CallShape",
           "CallStream", "JSONCallStream", "MistralCallStream", "PythonicCallStream", "Reader",
           "XMLCallStream", "call_id", "check_names", "grammar_shape", "history_format",
           "json_text", "keeps_special_tokens", "mistral_id", "parse", "stop_after",
           "template_format", "template_messages", "typed_value"]
