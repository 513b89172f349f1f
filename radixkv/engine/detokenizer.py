"""Incremental detokenization and stop-string detection for one output sequence.

Decoding the whole output every step costs O(n^2); decoding each token alone breaks multi-token
characters and the leading-space rules of SentencePiece/byte-BPE tokenizers. As in vLLM and
transformers' ``TextStreamer``, we decode a short window twice: ``ids[prefix:read]`` (already
emitted) and ``ids[prefix:]``; the difference is the new text. A trailing U+FFFD means an
incomplete UTF-8 character: wait for more tokens before emitting.

Stop strings are searched only in the text that could contain a new match (the new text plus
``len(longest stop) - 1`` characters before it). While a stop string could still be forming at
the end of the text, that tail is held back from streaming deltas (``emittable_len``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    """Text of a growing list of output token ids; None tokenizer means no text (tests)."""

    __slots__ = ("tokenizer", "ids", "text", "prefix_offset", "read_offset", "stop", "max_stop",
                 "skip_special")

    def __init__(self, tokenizer: Any | None, stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop = tuple(stop)
        self.max_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special) if ids else ""

    def append(self, token_id: int) -> str:
        """Add a token; return the new text it completes (may be "")."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new

    def find_stop(self, new_text_len: int) -> tuple[str, int] | None:
        """The earliest stop string that ends inside the newest ``new_text_len`` characters:
        (stop string, index where it starts in ``text``), or None."""
        if not self.stop or new_text_len == 0:
            return None
        start = max(0, len(self.text) - new_text_len - self.max_stop + 1)
        best: tuple[str, int] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[1]):
                best = (s, i)
        return best

    def truncate(self, length: int) -> None:
        """Cut the text to ``length`` characters (after a stop string was found)."""
        self.text = self.text[:length]

    def emittable_len(self, finished: bool) -> int:
        """How much of ``text`` may be streamed now: all of it once finished, else all but a
        tail that might still become a stop string."""
        if finished or not self.max_stop:
            return len(self.text)
        return max(0, len(self.text) - self.max_stop + 1)


__all__ = ["IncrementalDetokenizer"]
