"""Structured output: a grammar (any JSON, or a JSON schema) applied as a token mask every step.

Built on xgrammar, the grammar engine vLLM and SGLang use by default (the ``grammar`` extra):
it compiles a JSON schema against the tokenizer's vocabulary once, then for each sequence a
``GrammarMatcher`` fills a bitmask of the tokens that can continue the output (a few
microseconds per token: the expensive part, which tokens fit which grammar state, is
precomputed), and the mask sets every other logit to ``-inf`` before the choice. So greedy and
sampled outputs are both valid by construction, and the model's own end-of-sequence token is
only allowed once the value is complete.

* :class:`GrammarCompiler`: one per tokenizer (the server keeps one); ``json_object()``,
  ``json_schema(schema)``, ``regex(pattern)``, ``choice(options)``, ``ebnf(grammar)`` (vLLM's
  ``structured_outputs``; all through ``compile(kind, value)``) and ``tool_call(tools, ...)``
  (optionally or another constraint's ``source``) give a :class:`Grammar`.
* :class:`Grammar` travels in ``SamplingParams.grammar``; the engine makes one matcher per
  sequence (:func:`matcher_for`), masks the rows (:func:`mask_rows`) and advances the matcher
  with each chosen token (:func:`accept`).

JSON grammars (``json_object``, ``json``, tool calls) bound the whitespace between two tokens
of the JSON text (:data:`DEFAULT_MAX_WHITESPACE` characters, ``GrammarCompiler(max_whitespace=)``):
with free whitespace a model that has nothing likely left to write can pad newlines until
``max_tokens`` and return JSON cut short (seen in this project's CI with SmolLM2, and reported
against vLLM, SGLang and oMLX); a bound leaves pretty-printing legal and forces the next token
of the value. Whitespace inside strings is the value's and is not bounded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from radixkv.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    import torch


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ConfigError(f"structured output needs xgrammar ({exc}): pip install "
                          "'radixkv[grammar]'") from None
    return xgrammar


#: Whitespace characters a JSON grammar allows between two of its tokens (newline and an
#: indent up to 19: four levels at indent 4, nine at indent 2). llama.cpp's JSON grammar
#: allows 20 too; None: unbounded (vLLM's and xgrammar's default).
DEFAULT_MAX_WHITESPACE = 20


#: How deep a JSON schema may nest (objects and lists, counted as JSON containers). xgrammar's
#: compile time grows faster than the nesting: on the 2-core Zen 5 box a schema of objects
#: nested 64 deep (128 containers) compiled in 0.03 s, 200 deep in 0.7 s and 450 deep (an
#: 18 KB request) in 8.5 s of CPU; real schemas nest a few levels.
MAX_SCHEMA_DEPTH = 128


def check_schema_depth(schema: Any, what: str = "the JSON schema") -> None:
    """An :class:`InvalidRequestError` when ``schema`` nests deeper than
    :data:`MAX_SCHEMA_DEPTH` (read without recursion, so any depth is measured)."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


def check_max_whitespace(value: int | None) -> int | None:
    """``value`` when it is a usable whitespace bound (an int >= 1, or None: unbounded); a
    :class:`ConfigError` otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise ConfigError(f"the JSON whitespace bound must be an integer >= 1 or None "
                          f"(unbounded), got {value!r}")
    return value


class Thinking(NamedTuple):
    """Where a reasoning model's thinking ends, so that a grammar shapes only the answer
    (vLLM applies structured outputs after the reasoning the same way).

    * ``from_start`` True (``--reasoning-parser deepseek_r1``): the reply thinks from its first
      token until it ends with ``close`` (token ids of ``</think>``).
    * ``from_start`` False (``qwen3``): the reply thinks only if its first token is ``open``
      (the one token of ``<think>``): the first token may be that or any the grammar allows;
      without thinking the grammar applies from the first token.
    """

    open: int | None
    close: tuple[int, ...]
    from_start: bool


class Grammar:
    """A grammar compiled for one vocabulary. Immutable; shared by every request using it.

    Pickling sends its *recipe* (``spec``), not xgrammar's compiled tables: a fleet's ingress
    compiles a request's grammar (a 400 before routing when it cannot), and the replica that
    runs the request compiles the same recipe with its own compiler
    (:func:`register_compiler`; xgrammar caches what it compiled).

    Attributes:
        kind: ``"json_object"``, ``"json_schema"``, ``"regex"``, ``"choice"``, ``"grammar"``
            or ``"tool_call"`` (for messages).
        vocab_size: the model's logits width the masks are made for.
        spec: the recipe: ``("constraint", kind, value, whitespace)`` or
            ``("tool_call", tools, open_tag, close_tag, otherwise, whitespace, args_key,
            separator, around, name_first, style)``,
            where ``whitespace`` is what JSON may have between tokens
            (:meth:`GrammarCompiler.source`): the recipe carries it so that another process
            compiles the same language whatever its own compiler's default.
    """

    def __init__(self, compiled: Any, kind: str, vocab_size: int,
                 thinking: Thinking | None = None, spec: tuple[Any, ...] | None = None) -> None:
        self.compiled, self.kind, self.vocab_size = compiled, kind, vocab_size
        #: with a reasoning model: the grammar applies after its thinking (:class:`Thinking`)
        self.thinking = thinking
        self.spec = spec

    def matcher(self) -> Any:
        """A fresh matcher (the state of one output sequence)."""
        return _xgr().GrammarMatcher(self.compiled)

    def after_thinking(self, thinking: Thinking) -> Grammar:
        """This grammar, applied only once the reply's thinking is over (the same compiled
        grammar: compiling is per vocabulary, not per request)."""
        return Grammar(self.compiled, self.kind, self.vocab_size, thinking, self.spec)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.spec is None:
            raise TypeError(f"{self!r} was compiled without a recipe and cannot be sent to "
                            "another process")
        return (_rebuild, (self.spec, self.vocab_size, self.thinking))

    def __repr__(self) -> str:
        return f"Grammar({self.kind})"


#: vocab_size -> a function that builds this process's compiler for it (a fleet replica
#: registers its engine's), and the compilers built
_FACTORIES: dict[int, Callable[[], GrammarCompiler]] = {}
_COMPILERS: dict[int, GrammarCompiler] = {}
_REGISTRY_LOCK = threading.Lock()


def register_compiler(vocab_size: int, factory: Callable[[], GrammarCompiler]) -> None:
    """How this process compiles grammars sent to it for a ``vocab_size`` model (built on the
    first one that arrives: building a compiler reads the whole vocabulary)."""
    with _REGISTRY_LOCK:
        _FACTORIES[vocab_size] = factory
        _COMPILERS.pop(vocab_size, None)


def _rebuild(spec: tuple[Any, ...], vocab_size: int, thinking: Thinking | None) -> Grammar:
    """Unpickling a :class:`Grammar`: compile its recipe with this process's compiler."""
    with _REGISTRY_LOCK:
        gc = _COMPILERS.get(vocab_size)
        if gc is None:
            factory = _FACTORIES.get(vocab_size)
            if factory is None:
                raise ConfigError(f"a grammar for a {vocab_size}-token vocabulary arrived, and "
                                  "this process has no compiler for it (register_compiler)")
            gc = _COMPILERS[vocab_size] = factory()
    if spec[0] == "constraint":
        g = gc.compile(spec[1], spec[2], whitespace=spec[3])
    else:
        g = gc.tool_call(spec[1], spec[2], spec[3], spec[4], whitespace=spec[5],
                         args_key=spec[6], separator=spec[7], around=spec[8],
                         name_first=spec[9], style=spec[10])
    return g if thinking is None else g.after_thinking(thinking)


#: what a grammar's ``whitespace`` was not given as: the compiler's bound
_DEFAULT: Any = object()


class GrammarCompiler:
    """Compiles grammars for one tokenizer (``vocab_size``: the model's logits width, which may
    exceed the tokenizer's vocabulary). Thread-safe; xgrammar caches compiled schemas.
    ``max_whitespace``: the whitespace characters JSON may have between two of its tokens
    (:data:`DEFAULT_MAX_WHITESPACE`; None: unbounded); raises :class:`ConfigError` for
    anything else."""

    def __init__(self, tokenizer: Any, vocab_size: int,
                 stop_token_ids: Iterable[int] | None = None,
                 max_whitespace: int | None = DEFAULT_MAX_WHITESPACE) -> None:
        self.max_whitespace = check_max_whitespace(max_whitespace)
        xgr = _xgr()
        stops = sorted(stop_token_ids) if stop_token_ids else None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return self.compile("json_object", True)

    def json_schema(self, schema: Any, any_whitespace: bool = True) -> Grammar:
        """Output that validates against ``schema`` (a JSON schema as a dict); properties the
        schema does not list are not generated. ``any_whitespace`` False: one layout only, no
        free whitespace (``{"n": 1}``; vLLM's ``disable_any_whitespace``). Raises
        :class:`InvalidRequestError` for a schema xgrammar cannot compile."""
        return self.compile("json", schema, any_whitespace)

    def regex(self, pattern: str) -> Grammar:
        """Output that matches ``pattern`` whole (xgrammar's regex dialect: the common
        ECMAScript/Python syntax without look-around or back-references)."""
        return self.compile("regex", pattern)

    def choice(self, options: Sequence[str]) -> Grammar:
        """Output that is exactly one of ``options`` (vLLM's ``choice``)."""
        return self.compile("choice", options)

    def ebnf(self, grammar: str) -> Grammar:
        """Output in the language of ``grammar``: EBNF (GBNF style, start rule ``root``), or a
        Lark grammar (start rule ``start``), the two forms vLLM's ``grammar`` takes."""
        return self.compile("grammar", grammar)

    def whitespace(self, any_whitespace: bool) -> int | None:
        """The ``whitespace`` of a JSON grammar asked ``any_whitespace`` (or not): this
        compiler's bound, or 0 (one layout)."""
        return self.max_whitespace if any_whitespace else 0

    def compile(self, kind: str, value: Any, any_whitespace: bool = True, *,
                whitespace: Any = _DEFAULT) -> Grammar:
        """The compiled grammar of one output constraint (:meth:`source`)."""
        if whitespace is _DEFAULT:
            whitespace = self.whitespace(any_whitespace)
        source = self.source(kind, value, whitespace=whitespace)
        try:
            with self._lock:
                compiled = self._compiler.compile_grammar(source)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidRequestError(f"the {kind} constraint cannot be compiled: {exc}"
                                      ) from None
        return Grammar(compiled, "json_schema" if kind == "json" else kind, self.vocab_size,
                       spec=("constraint", kind, value, whitespace))

    def source(self, kind: str, value: Any, any_whitespace: bool = True, *,
               whitespace: Any = _DEFAULT) -> Any:
        """The (uncompiled) xgrammar ``Grammar`` of one output constraint: ``json_object``
        (any object), ``json`` (a schema, a dict), ``regex``, ``choice`` (a list of strings)
        or ``grammar`` (EBNF, else Lark). JSON's ``whitespace`` between tokens: at most that
        many characters, None any, 0 one layout only (``{"n": 1}``; vLLM's
        ``disable_any_whitespace``); by default :meth:`whitespace` of ``any_whitespace``.
        Raises :class:`InvalidRequestError` naming what is wrong with ``value``."""
        xgr = _xgr()
        if whitespace is _DEFAULT:
            whitespace = self.whitespace(any_whitespace)
        try:
            if kind == "json_object":
                # not strict: an object with any properties (strict would forbid unlisted ones)
                return _json(xgr, '{"type": "object"}', whitespace, strict=False)
            if kind == "json":
                if not isinstance(value, dict):
                    raise InvalidRequestError(f"the JSON schema must be an object, got "
                                              f"{value!r}")
                check_schema_depth(value)
                try:
                    text = json.dumps(value)
                except (TypeError, ValueError) as exc:
                    raise InvalidRequestError(f"the JSON schema is not JSON: {exc}") from None
                return _json(xgr, text, whitespace)
            if kind == "regex":
                if not isinstance(value, str) or not value:
                    raise InvalidRequestError(f"the regex must be a non-empty string, got "
                                              f"{value!r}")
                return xgr.Grammar.from_regex(value)
            if kind == "choice":
                if not value or not all(isinstance(o, str) and o for o in value):
                    raise InvalidRequestError(f"choice must be a non-empty list of non-empty "
                                              f"strings, got {value!r}")
                # EBNF string literals take JSON's escapes (quotes, backslashes, controls)
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(o) for o in dict.fromkeys(value)))
            if kind == "grammar":
                if not isinstance(value, str) or not value.strip():
                    raise InvalidRequestError(f"the grammar must be a non-empty string, got "
                                              f"{value!r}")
                try:
                    return xgr.Grammar.from_ebnf(value)
                except (RuntimeError, TypeError, ValueError) as ebnf_error:
                    try:
                        return xgr.Grammar.from_lark(value)
                    except (RuntimeError, TypeError, ValueError):
                        raise ebnf_error from None   # EBNF's message: the documented form
        except (RuntimeError, TypeError, ValueError) as exc:
            # xgrammar raises RuntimeError on what it cannot parse or convert
            raise InvalidRequestError(f"the {kind} constraint cannot be compiled: {exc}"
                                      ) from None
        raise InvalidRequestError(f"unknown output constraint {kind!r}")

    def tool_call(self, tools: Sequence[tuple[str, Any]], open_tag: str, close_tag: str,
                  otherwise: tuple[str, Any, bool] | None = None, *,
                  whitespace: Any = _DEFAULT, args_key: str = "arguments",
                  separator: str | None = None, around: bool = False,
                  name_first: str | None = None, style: str = "json") -> Grammar:
        """One call of one of ``tools`` (``(name, JSON schema of its arguments)``), written
        ``open_tag\n{"name": ..., "arguments": {...}}\nclose_tag`` with arguments valid
        against the schema (OpenAI's ``tool_choice`` required or named); with no tags (Llama
        3.x's format) the object alone. ``separator``: one or more calls, this between two
        (``required`` with parallel calls allowed, as vLLM's; None: exactly one).
        ``args_key``: the arguments' key (``"parameters"`` for Llama). ``around``: the tags
        wrap the whole sequence of calls, without newlines (Mistral's ``[TOOL_CALLS] [...]``
        list). ``name_first``: a call is ``open_tag + name + name_first`` then the arguments
        alone (Mistral's ``[TOOL_CALLS]name[ARGS]{...}``). ``style="qwen_xml"``: a call is
        ``open_tag\n<function=NAME>\n``, one ``<parameter=KEY>value</parameter>`` per argument
        (xgrammar's Qwen XML form of the schema: strings as plain text, other values as
        JSON) and ``\n</function>\nclose_tag`` (Qwen3-Coder's, Qwen3.5's). ``otherwise``:
        ``(kind, value, any_whitespace)`` of a constraint (:meth:`source`) the output may
        follow instead of calling (``tool_choice`` auto beside ``response_format``).
        ``whitespace``: the calls' JSON whitespace bound (default this compiler's); the
        alternative keeps its own ``any_whitespace``."""
        xgr = _xgr()
        if whitespace is _DEFAULT:
            whitespace = self.max_whitespace
        for name, schema in tools:
            check_schema_depth(schema, f"the parameters of tool {name!r}")
        alternative = None
        if otherwise is not None:
            alternative = self.source(otherwise[0], otherwise[1], whitespace=(
                whitespace if otherwise[2] else 0))
        try:
            def text(value: str) -> Any:
                return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(value)}")

            if style == "qwen_xml":
                calls = [xgr.Grammar.concat(
                    text(f"{open_tag}\n<function={name}>\n"),
                    _qwen_xml(xgr, schema or {"type": "object"}, whitespace),
                    text(f"\n</function>\n{close_tag}")) for name, schema in tools]
            elif style != "json":
                raise ValueError(f"style is 'json' or 'qwen_xml', not {style!r}")
            elif name_first is not None:
                calls = [xgr.Grammar.concat(text(open_tag + name + name_first),
                                            _json(xgr, json.dumps(schema or {"type": "object"}),
                                                  whitespace))
                         for name, schema in tools]
            else:
                calls = [_json(xgr, json.dumps({
                    "type": "object", "properties": {"name": {"const": name},
                                                     args_key: schema or {"type": "object"}},
                    "required": ["name", args_key], "additionalProperties": False}), whitespace)
                    for name, schema in tools]
            body = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
            if name_first is not None or around or style != "json" \
                    or not (open_tag or close_tag):
                grammar = body
            else:
                grammar = xgr.Grammar.concat(text(open_tag + chr(10)), body,
                                             text(chr(10) + close_tag))
            if separator is not None:
                # call (separator call)*: xgrammar combines grammars by concat and union only,
                # so the repetition is a structural tag around the call's own EBNF (its rules
                # keep their names apart there; the whitespace bounds and strictness stay)
                one = {"type": "grammar", "grammar": str(grammar)}
                more = one if not separator else {"type": "sequence", "elements": [
                    {"type": "const_string", "value": separator}, one]}
                grammar = xgr.Grammar.from_structural_tag(json.dumps({
                    "type": "structural_tag", "format": {"type": "sequence", "elements": [
                        one, {"type": "star", "content": more}]}}))
            if around:
                grammar = xgr.Grammar.concat(text(open_tag), grammar, text(close_tag))
            if alternative is not None:
                grammar = xgr.Grammar.union(grammar, alternative)
            with self._lock:
                compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, TypeError, ValueError) as exc:   # as in source
            raise InvalidRequestError(f"the tools' parameters cannot be compiled: {exc}"
                                      ) from None
        return Grammar(compiled, "tool_call", self.vocab_size,
                       spec=("tool_call", [tuple(t) for t in tools], open_tag, close_tag,
                             otherwise, whitespace, args_key, separator, around,
                             name_first, style))


def _qwen_xml(xgr: Any, schema: Any, whitespace: int | None) -> Any:
    """xgrammar's grammar of a tool's arguments in Qwen's XML form (``<parameter=KEY>`` tags
    holding plain-text strings or JSON values), valid against ``schema``, with ``whitespace``
    between tags (None: unbounded)."""
    fmt: dict[str, Any] = {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"}
    if whitespace is not None:   # (xgrammar refuses a bound of 0 in this form)
        fmt["max_whitespace_cnt"] = max(whitespace, 1)
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag",
                                                       "format": fmt}))


def _json(xgr: Any, schema: str, whitespace: int | None, strict: bool = True) -> Any:
    """xgrammar's grammar of JSON valid against ``schema`` (its text) with ``whitespace``
    between tokens (:meth:`GrammarCompiler.source`)."""
    if whitespace == 0:
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    return xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict,
                                        max_whitespace_cnt=whitespace)


#: ``SeqGrammar.phase`` values: the grammar masks every token; the reply is thinking (no
#: mask); the first token decides (the grammar's tokens or ``Thinking.open``)
ACTIVE, THINKING, UNDECIDED = "active", "thinking", "undecided"


class SeqGrammar:
    """One output sequence's grammar state: its matcher and, with a :class:`Thinking`, whether
    the grammar applies yet."""

    __slots__ = ("matcher", "phase", "open")

    def __init__(self, grammar: Grammar) -> None:
        self.matcher = grammar.matcher()
        t = grammar.thinking
        self.phase = ACTIVE if t is None else THINKING if t.from_start else UNDECIDED
        self.open = t.open if t is not None else None


def matcher_for(req: Any, seq: Any) -> SeqGrammar:
    """The grammar state of ``seq`` (a sequence of ``req``), made on first use. Stored on the
    request by the sequence's output index, so it lives and dies with the request; a sample
    forked at its first token gets a fresh one, which is right since it has accepted nothing
    yet."""
    m = req.grammar_state.get(seq.index)
    if m is None:
        m = req.grammar_state[seq.index] = SeqGrammar(req.params.grammar)
    return m


def mask_rows(logits: torch.Tensor, rows: Sequence[tuple[int, Any]]) -> None:
    """Set to ``-inf``, in place, every logit of row ``r`` that its grammar does not allow
    next, for each ``(r, state)`` in ``rows`` (a :class:`SeqGrammar`; a thinking one masks
    nothing; an undecided one also allows its ``Thinking.open`` token). One bitmask for the
    batch, one apply call."""
    rows = [(r, st) for r, st in rows if st.phase != THINKING]
    if not rows:
        return
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for r, st in rows:
        st.matcher.fill_next_token_bitmask(bitmask, r)
        if st.phase == UNDECIDED:
            _allow(bitmask, r, st)
    if logits.device.type != "cpu":   # queued, not a stream sync (sampling.to_device)
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[r for r, _ in rows])


def _allow(bitmask: Any, row: int, st: SeqGrammar) -> None:
    """Set the bit of ``Thinking.open`` in ``row`` of an int32 bitmask (32 tokens a word)."""
    assert st.open is not None, "an undecided grammar has an open token"
    word, bit = divmod(st.open, 32)
    v = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = v - (1 << 32) if v >= 1 << 31 else v


def accept(req: Any, seq: Any, token: int) -> None:
    """Advance ``seq``'s grammar by the token just chosen for it (before it is appended to
    the sequence; masked, so always allowed;
    a token the grammar refuses would be a bug, reported loudly). Thinking: nothing is fed
    until the output ends with ``Thinking.close``, then the grammar starts; undecided: the
    open token starts thinking, any other is the grammar's first."""
    st = matcher_for(req, seq)
    if st.phase == THINKING:   # (``token`` is not in ``seq.token_ids`` yet)
        close = req.params.grammar.thinking.close
        k = len(close) - 1
        out = seq.token_ids
        if int(token) == close[-1] and len(out) - seq.prompt_len >= k and \
                (k == 0 or tuple(out[len(out) - k:]) == close[:-1]):
            st.phase = ACTIVE
        return
    if st.phase == UNDECIDED:
        if int(token) == req.params.grammar.thinking.open:
            st.phase = THINKING
            return
        st.phase = ACTIVE
    m = st.matcher
    if m.is_terminated():
        return
    if not m.accept_token(int(token)):
        raise RuntimeError(f"grammar {req.params.grammar!r} refused token {token} it allowed")


__all__ = ["ACTIVE", "DEFAULT_MAX_WHITESPACE", "MAX_SCHEMA_DEPTH", "THINKING", "UNDECIDED",
           "Grammar", "GrammarCompiler", "SeqGrammar", "Thinking", "accept",
           "check_max_whitespace", "check_schema_depth", "mask_rows", "matcher_for",
           "register_compiler"]
