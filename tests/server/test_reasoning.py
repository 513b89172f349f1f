"""``--reasoning-parser`` (radixkv/server/reasoning.py): the streamed split assembles to the
whole-reply split for any cut into deltas, and the two rules on the replies that tell them
apart. Through the real server: tests/server/test_tool_calls.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.server.reasoning import PARSERS, THINK_CLOSE, THINK_OPEN, ReasoningStream, split

_PIECES = st.one_of(
    st.text(alphabet="ab <>/thinkc_ol\n", max_size=10),
    st.sampled_from([THINK_OPEN, THINK_CLOSE, " ", "\n", "<th", "</thi", "<think", "</",
                     "<tool_call>", "<tool_", "<t"]))


@settings(max_examples=400)   # ~2 s: a pure function, cheap examples
@given(st.sampled_from(PARSERS), st.lists(_PIECES, max_size=8),
       st.sampled_from([(), ("<tool_call>",)]), st.data())
def test_streamed_split_assembles_to_the_whole_split(parser: str, pieces: list[str],
                                                     ends: tuple[str, ...],
                                                     data: st.DataObject) -> None:
    """Also with ``<tool_call>`` ending the thinking (tools offered in a format that opens
    calls with it)."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    stream = ReasoningStream(parser, ends)
    reasoning = content = ""
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    assert ((reasoning + r) or None, (content + c) or None) == split(text, parser, ends)


@pytest.mark.parametrize("parser", PARSERS)
def test_a_call_opened_while_thinking_ends_the_thinking(parser: str) -> None:
    """vLLM's Qwen3 parser ends the reasoning at a ``<tool_call>`` written before
    ``</think>``; with ``ends`` so does radixkv, the tag staying in the answer (where the
    call is read); without it the call is thinking."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    ends = ("<tool_call>",)
    assert split(f"<think>I should call f.\n{call}", parser, ends) == (
        "I should call f.\n", call)
    assert split(f"<think>plan</think>a {call}", parser, ends) == ("plan", f"a {call}")
    assert split(f"<think>I should call f.\n{call}", parser) == (
        f"I should call f.\n{call}", None)


@pytest.mark.parametrize("text, r1, q3", [
    ("<think>plan</think>\n\nYes.", ("plan", "\n\nYes."), ("plan", "\n\nYes.")),
    ("plan</think>Yes.", ("plan", "Yes."), (None, "plan</think>Yes.")),   # prompt opened it
    ("Yes.", ("Yes.", None), (None, "Yes.")),
    ("  <think>cut by max_tokens", ("cut by max_tokens", None), ("cut by max_tokens", None)),
    ("<think></think>Yes.", (None, "Yes."), (None, "Yes.")),
])
def test_the_two_rules(text: str, r1: tuple, q3: tuple) -> None:
    assert split(text, "deepseek_r1") == r1
    assert split(text, "qwen3") == q3


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError):
        ReasoningStream("granite")


class _Tok:
    """A tokenizer whose <think> and </think> are one token each (as Qwen3's special tokens)
    or several (``split``)."""

    def __init__(self, split: bool) -> None:
        self.split = split

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.split:
            return [ord(c) for c in text]
        return {THINK_OPEN: [7], THINK_CLOSE: [8]}[text]


def test_where_thinking_ends_for_a_grammar() -> None:
    """``serving.thinking_marks``: what a constrained reply's grammar waits for under each
    parser; qwen3 needs a one-token <think> (the first token decides), else the grammar
    shapes the reply from its first token."""
    from radixkv.engine.grammar import Thinking
    from radixkv.server.serving import thinking_marks

    assert thinking_marks(_Tok(False), "qwen3") == Thinking(7, (8,), False)
    assert thinking_marks(_Tok(False), "deepseek_r1") == Thinking(None, (8,), True)
    assert thinking_marks(_Tok(True), "qwen3") is None
    assert thinking_marks(_Tok(True), "deepseek_r1") == Thinking(
        None, tuple(ord(c) for c in THINK_CLOSE), True)
