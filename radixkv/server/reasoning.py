"""Reasoning output apart from the answer: ``radixkv serve --reasoning-parser``, as vLLM's.

Reasoning models write their thinking between ``<think>`` and ``</think>`` before the answer.
With a parser chosen, a chat reply's thinking goes to ``message.reasoning`` (and, for clients
written against older vLLM, the same text in ``reasoning_content``) and the rest to
``content``; tool calls are then read from the content only. Two rules, by vLLM's names:

* ``deepseek_r1``: the reply *is* thinking from its first token (the template opened the
  ``<think>`` in the prompt; a ``<think>`` the model writes itself is dropped) until
  ``</think>``; a reply without ``</think>`` (cut by ``max_tokens``) is all reasoning.
* ``qwen3``: a reply that begins with ``<think>`` (leading whitespace aside) thinks until
  ``</think>`` (or its end); any other reply is all content (Qwen3 with
  ``enable_thinking: false`` writes no tags).

``ends``: tags that also end the thinking, staying in the answer: with tools offered in a
format whose calls open with ``<tool_call>``, a call the model starts while still thinking
(without ``</think>``) ends the thinking there, as vLLM's Qwen3 parser reads it, so the call is
read from the answer instead of lost in the reasoning.

Streamed, :class:`ReasoningStream` sends each delta to the side it belongs to as it comes,
holding back only text that may be the start of a tag; what a client assembles equals
:func:`split` of the whole reply (a property test checks it for any split into deltas).
"""

from __future__ import annotations

from radixkv.server.tags import first_tag, tag_prefix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: ``--reasoning-parser`` values
PARSERS = ("deepseek_r1", "qwen3")


def split(text: str, parser: str, ends: tuple[str, ...] = ()
          ) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole reply by ``parser``'s rule (module docstring), the
    thinking also ended by any of ``ends`` (kept in the content); an empty side is None."""
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    head = text.lstrip()
    if head.startswith(THINK_OPEN):
        text = head[len(THINK_OPEN):]
    elif parser == "qwen3":
        return None, text or None
    at, tag = first_tag(text, (THINK_CLOSE, *ends))
    if at < 0:
        return text or None, None
    content = text[at + len(tag):] if tag == THINK_CLOSE else text[at:]
    return text[:at] or None, content or None


class ReasoningStream:
    """One streamed reply split into reasoning and content deltas (module docstring).

    :meth:`feed` each delta and :meth:`finish` once; each returns ``(reasoning, content)``
    to send now."""

    def __init__(self, parser: str, ends: tuple[str, ...] = ()) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, "
                             f"got {parser!r}")
        self.parser = parser
        self._ends = (THINK_CLOSE, *ends)   # what ends the thinking
        # "start": deciding how the reply begins; "think": in the reasoning; "answer": after
        self._state = "start"
        self._buf = ""   # text not yet sent (a possible tag start)

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._buf + text
        reasoning = content = ""
        if self._state == "start":
            head = buf.lstrip()
            if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                self._buf = buf   # may still become "<think>": wait
                return "", ""
            if head.startswith(THINK_OPEN):
                buf = head[len(THINK_OPEN):]
                self._state = "think"
            elif self.parser == "deepseek_r1":
                self._state = "think"   # the prompt opened the thinking
            else:
                self._state = "answer"
        if self._state == "think":
            end, tag = first_tag(buf, self._ends)
            if end < 0:
                keep = max(tag_prefix(buf, t) for t in self._ends)
                self._buf = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning = buf[:end]
            buf = buf[end + len(tag):] if tag == THINK_CLOSE else buf[end:]
            self._state = "answer"
        self._buf = ""
        return reasoning, content + buf

    def finish(self) -> tuple[str, str]:
        """What is still held: a partial tag is text of the side it was on."""
        text, self._buf = self._buf, ""
        if self._state == "think" or (self._state == "start" and self.parser == "deepseek_r1"):
            return text, ""
        return "", text


__all__ = ["PARSERS", "THINK_CLOSE", "THINK_OPEN", "ReasoningStream", "split"]
