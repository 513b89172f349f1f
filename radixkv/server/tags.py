"""Finding tags in text that arrives in pieces: what the reasoning split and the tool-call
readers share.

A stream that looks for a tag (``</think>``, ``<tool_call>``, ``</parameter>``, ...) must hold
back the end of the text it has when that end may be the start of a tag the next piece
completes, and must find the first of several tags. Pure Python, no dependencies.
"""

from __future__ import annotations


def tag_prefix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag`` (what a
    stream holds back: the next piece may complete the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of ``tags`` occurs in ``text`` and which: ``(-1, "")`` for none (of two
    at the same place, the one listed first)."""
    best, found = -1, ""
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, tag
    return best, found


__all__ = ["first_tag", "tag_prefix"]
