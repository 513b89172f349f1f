"""The grammar compiler's constraints (engine/grammar.py) walked token by token with the
matcher, on the embedded model's tokenizer: what a constraint accepts and refuses, without a
model forward (the server tests run them end to end)."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from radixkv.engine.grammar import GrammarCompiler  # noqa: E402
from radixkv.errors import InvalidRequestError  # noqa: E402


@pytest.fixture(scope="module")
def gc() -> GrammarCompiler:
    from radixkv.models import load_tokenizer

    tok = load_tokenizer()
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])


def _accepts(gc: GrammarCompiler, grammar, text: str) -> bool:
    """Whether the matcher takes ``text`` (as the tokenizer splits it) and may end there."""
    from radixkv.models import load_tokenizer

    m = grammar.matcher()
    ids = load_tokenizer()(text, add_special_tokens=False)["input_ids"]
    return all(m.accept_token(t) for t in ids) and m.is_terminated() is False and \
        m.accept_token(load_tokenizer().eos_token_id)


@pytest.mark.parametrize("options", [["yes", "no"], ['say "hi"', "a\\b", "line\nbreak", "ünï"]])
def test_a_choice_takes_exactly_its_options(gc: GrammarCompiler, options: list[str]) -> None:
    g = gc.choice(options)
    for o in options:
        assert _accepts(gc, g, o), o
    assert not _accepts(gc, g, options[0] + "x")
    assert not _accepts(gc, g, "maybe")


def test_regex_and_both_grammar_forms(gc: GrammarCompiler) -> None:
    g = gc.regex(r"[0-9]{3}-[a-z]{2}")
    assert _accepts(gc, g, "123-ab") and not _accepts(gc, g, "12-ab")
    for text in ('root ::= "yes" | ("maybe " [0-9])',
                 'start: "yes" | "maybe " DIGIT\n%import common.DIGIT'):
        g = gc.ebnf(text)
        assert _accepts(gc, g, "yes") and _accepts(gc, g, "maybe 7")
        assert not _accepts(gc, g, "no")


@pytest.mark.parametrize("call, arg", [
    ("regex", "(a"), ("regex", ""), ("choice", []), ("choice", ["a", ""]),
    ("ebnf", "root ::= ("), ("ebnf", "  "), ("json_schema", {"type": "nope"}),
])
def test_what_does_not_compile_is_an_invalid_request(gc: GrammarCompiler, call: str,
                                                      arg: object) -> None:
    with pytest.raises(InvalidRequestError):
        getattr(gc, call)(arg)


@pytest.mark.model
def test_a_grammar_after_thinking_shapes_only_the_answer() -> None:
    """A reasoning model's grammar (``Grammar.after_thinking``) leaves the thinking free and
    shapes what follows its close marker; an undecided reply that does not open a thinking
    is shaped from its first token. The embedded model's own greedy first tokens stand in
    for the ``<think>`` and ``</think>`` tokens (what the mechanism reads is token ids)."""
    import re

    import radixkv
    from radixkv import SamplingParams
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.grammar import Thinking

    eng = radixkv.Engine.from_pretrained(cache_config=CacheConfig(num_device_blocks=64),
                                         engine_config=EngineConfig(device="cpu",
                                                                    dtype="float32"))
    ids = eng.chat_template.prompt_ids([{"role": "user", "content": "Hi!"}])
    free = eng.generate(ids, SamplingParams(max_tokens=4))[0].outputs[0].token_ids
    gc = GrammarCompiler(eng.tokenizer, eng.core.vocab_size, eng.core.eos_token_ids)
    digits = gc.regex("[0-9]{3}")
    head = eng.decode(free[:2])
    for thinking in (Thinking(free[0], (free[1],), False),    # qwen3: opens, then closes
                     Thinking(None, tuple(free[:2]), True)):  # deepseek_r1: from the start
        out = eng.generate(ids, SamplingParams(max_tokens=12,
                                               grammar=digits.after_thinking(thinking)))
        c = out[0].outputs[0]
        assert c.token_ids[:2] == free[:2], thinking
        assert c.text.startswith(head) and re.fullmatch("[0-9]{3}", c.text[len(head):]), c.text
    # undecided and not opened (the open token banned): shaped from the first token
    opener = Thinking(free[1], (free[2],), False)
    out = eng.generate(ids, SamplingParams(max_tokens=12, grammar=digits.after_thinking(opener),
                                           logit_bias={free[1]: -100}))
    assert re.fullmatch("[0-9]{3}", out[0].outputs[0].text), out[0].outputs[0].text
    eng.close()


def test_a_grammar_travels_as_its_recipe(gc: GrammarCompiler) -> None:
    """A fleet's ingress compiles a request's grammar and sends it to a replica: pickling
    sends the recipe, and the receiving process compiles it with its registered compiler
    into a grammar that takes the same outputs (thinking rule included)."""
    import pickle

    from radixkv.engine.grammar import Grammar, Thinking, register_compiler
    from radixkv.errors import ConfigError

    register_compiler(gc.vocab_size, lambda: gc)   # what a replica does with its engine's
    cases = [(gc.regex("[0-9]{3}"), "123", "12a"),
             (gc.choice(["yes", "no"]), "no", "nope"),
             (gc.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                              "required": ["n"]}, any_whitespace=False), '{"n": 7}', '{"m": 7}'),
             (gc.tool_call([("f", {"type": "object"})], "<a>", "</a>",
                           ("regex", "[0-9]+", True)), "42", "x"),
             # Llama 3.x's shape: the object alone, its arguments under "parameters"
             (gc.tool_call([("f", {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "required": ["a"]})], "", "", args_key="parameters"),
              '{"name": "f", "parameters": {"a": 1}}', '{"name": "f", "arguments": {"a": 1}}'),
             # several calls (required, parallel calls allowed): one or more, separated
             (gc.tool_call([("f", {"type": "object"}), ("g", {"type": "object"})], "<a>",
                           "</a>", separator="\n"),
              '<a>\n{"name": "f", "arguments": {}}\n</a>\n<a>\n{"name": "g", "arguments": '
              '{}}\n</a>', '<a>\n{"name": "f", "arguments": {}}\n</a>\n'),
             # Mistral's list (the tags around all the calls) and its newer name[ARGS] calls
             (gc.tool_call([("f", {"type": "object"}), ("g", {"type": "object"})],
                           "[TOOL_CALLS] [", "]", separator=", ", around=True),
              '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]',
              '[TOOL_CALLS] [{"name": "f", "arguments": {}}], [{"name": "g", "arguments": {}}]'),
             (gc.tool_call([("f", {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "required": ["a"]})], "[TOOL_CALLS]", "", separator="",
                           name_first="[ARGS]"),
              '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]f[ARGS]{"a": 2}', '[TOOL_CALLS]f[ARGS]{}'),
             (gc.tool_call([("f", {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "additionalProperties": False})], "", "",
                           args_key="parameters", separator="; "),
              '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {}}',
              '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {"b": 1}}'),
             # Qwen3-Coder's XML calls: one tag per parameter, the integer typed
             (gc.tool_call([("f", {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "required": ["a"]})], "<tool_call>", "</tool_call>",
                           style="qwen_xml"),
              "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n"
              "</tool_call>",
              "<tool_call>\n<function=f>\n<parameter=a>\none\n</parameter>\n</function>\n"
              "</tool_call>"),
             (gc.ebnf('root ::= "a" [0-9]').after_thinking(Thinking(5, (6,), False)),
              "a1", "b1")]
    for g, good, bad in cases:
        back = pickle.loads(pickle.dumps(g))
        assert (back.kind, back.spec, back.thinking) == (g.kind, g.spec, g.thinking)
        assert _accepts(gc, back, good) and not _accepts(gc, back, bad), g
    # without a separator, exactly one call (a named tool, parallel_tool_calls false)
    once = gc.tool_call([("f", {"type": "object"}), ("g", {"type": "object"})], "<a>", "</a>")
    assert _accepts(gc, once, '<a>\n{"name": "f", "arguments": {}}\n</a>')
    assert not _accepts(gc, once, '<a>\n{"name": "f", "arguments": {}}\n</a>\n<a>\n{"name": '
                        '"g", "arguments": {}}\n</a>')
    with pytest.raises(TypeError):   # compiled without a recipe: nothing to send
        pickle.dumps(Grammar(None, "regex", gc.vocab_size))
    with pytest.raises(ConfigError):   # a process without a compiler for that vocabulary
        pickle.loads(pickle.dumps(Grammar(None, "regex", 12345, spec=("constraint", "regex",
                                                                       "a", True))))


def test_json_whitespace_between_tokens_is_bounded(gc: GrammarCompiler) -> None:
    """JSON grammars allow at most ``max_whitespace`` whitespace characters between two tokens
    (default 20: a model cannot pad newlines until ``max_tokens``); ``None`` any; ``0`` (vLLM's
    ``disable_any_whitespace``) one layout. Inside strings whitespace is the value's. A
    grammar's recipe carries its bound, so a process whose compiler has another default
    compiles the same language."""
    import pickle

    from radixkv.engine.grammar import DEFAULT_MAX_WHITESPACE, register_compiler
    from radixkv.models import load_tokenizer

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
              "required": ["n", "s"], "additionalProperties": False}

    def text(gap: int, inside: int = 0) -> str:
        return '{"n":' + "\n" * gap + '7, "s": "' + " " * inside + '"}'

    bound = DEFAULT_MAX_WHITESPACE
    assert gc.max_whitespace == bound
    for g in (gc.json_schema(schema), gc.json_object(),
              gc.tool_call([("f", schema)], "<a>", "</a>", ("json_object", True, True))):
        wrap = (lambda t: "<a>\n" + '{"name": "f", "arguments": ' + t + "}\n</a>") \
            if g.kind == "tool_call" else (lambda t: t)
        assert _accepts(gc, g, wrap(text(bound, inside=50))), g
        assert not _accepts(gc, g, wrap(text(bound + 1))), g
    tok = load_tokenizer()
    free = GrammarCompiler(tok, len(tok), [tok.eos_token_id], max_whitespace=None)
    assert _accepts(free, free.json_schema(schema), text(200))
    one = gc.json_schema(schema, any_whitespace=False)
    assert _accepts(gc, one, '{"n": 7, "s": ""}') and not _accepts(gc, one, text(1))
    tight = GrammarCompiler(tok, len(tok), [tok.eos_token_id], max_whitespace=3)
    g = tight.json_schema(schema)
    assert _accepts(tight, g, text(3)) and not _accepts(tight, g, text(4))
    register_compiler(gc.vocab_size, lambda: gc)   # the receiving side's default is 20
    back = pickle.loads(pickle.dumps(g))
    assert back.spec == g.spec and not _accepts(gc, back, text(4))


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8"])
def test_a_whitespace_bound_is_a_positive_integer_or_none(bad: object) -> None:
    from radixkv.engine.grammar import check_max_whitespace
    from radixkv.errors import ConfigError
    from radixkv.models import load_tokenizer

    tok = load_tokenizer()
    with pytest.raises(ConfigError):
        GrammarCompiler(tok, len(tok), max_whitespace=bad)   # type: ignore[arg-type]
    assert check_max_whitespace(None) is None and check_max_whitespace(1) == 1


def test_a_schema_nested_too_deep_is_refused_before_it_compiles(gc: GrammarCompiler) -> None:
    """xgrammar's compile time grows faster than a schema's nesting (450 objects deep, an
    18 KB request, took 8.5 s): past MAX_SCHEMA_DEPTH containers a schema is refused at
    once, as a response format and as a tool's parameters; at the limit it compiles."""
    from radixkv.engine.grammar import MAX_SCHEMA_DEPTH
    from radixkv.errors import InvalidRequestError

    def nested(levels: int) -> dict:   # each level: an object schema and its properties
        schema: dict = {"type": "string"}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return schema

    gc.compile("json", nested(MAX_SCHEMA_DEPTH // 2 - 1))   # 2 containers a level, and 1
    for schema in (nested(MAX_SCHEMA_DEPTH // 2), nested(5000)):
        with pytest.raises(InvalidRequestError, match="deeper than"):
            gc.compile("json", schema)
        with pytest.raises(InvalidRequestError, match="parameters of tool 'f'"):
            gc.tool_call([("f", schema)], "<a>", "</a>")
        with pytest.raises(InvalidRequestError, match="deeper than"):
            gc.compile("json", {"type": "array", "items": [[[[schema]]]]})
