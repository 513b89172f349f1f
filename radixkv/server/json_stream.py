"""One JSON value, read as it is generated and written out in ``json.dumps`` form as it goes.

A streamed tool call sends its ``arguments`` piece by piece while the model writes them. The
pieces must add up to what the non-streamed answer holds, which is the arguments as
``json.dumps(value, ensure_ascii=False)`` writes them (the model's own spacing and escapes
normalized), and they must be sent before the value is complete. :class:`JSONCanon` does both:
it tokenizes the raw text one character at a time and writes each token in ``json.dumps``'s
form as soon as the token is complete (a string's characters one by one, each escaped as
``json.dumps`` escapes it; a number, ``true``/``false``/``null`` once they end; separators as
``", "`` and ``": "``). Every prefix of its output is a prefix of ``json.dumps(json.loads(raw),
ensure_ascii=False)``, and the whole output equals it, whatever the pieces the raw text came in
(tests/server/test_json_stream.py, a hypothesis property). Two differences from
``json.loads``, both in what it accepts: an object with a repeated key is written with both
(``json.loads`` keeps the last), and ``NaN``/``Infinity`` are not JSON, so they fail, as does
a number beyond a double's range (``1e999``, which ``json.dumps`` would write as ``Infinity``).

``raw_string``: a value that is a JSON string is written as its decoded characters alone, no
quotes and no escapes (a tool call whose ``arguments`` the model wrote as a string holding
JSON: its arguments are that string's text).

Pure Python, no dependencies.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("-+.eE0123456789")
_LITERALS = ("true", "false", "null")
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
           "t": "\t"}
_WS = frozenset(" \t\n\r")
# json.dumps(c, ensure_ascii=False)[1:-1] for the characters it escapes
_ESCAPED = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
            "\f": "\\f", **{chr(i): f"\\u{i:04x}" for i in range(0x20)
                            if chr(i) not in "\n\r\t\b\f"}}

# what a container expects next
_KEY_OR_END, _KEY, _COLON, _VALUE, _VALUE_OR_END, _COMMA_OR_END = range(6)


class JSONCanon:
    """Reads one JSON value in pieces (:meth:`feed`) and writes it in ``json.dumps`` form
    (module docstring). ``done``: the value is complete (characters after it are not read);
    ``failed``: the text is not JSON (the output so far stays a valid prefix)."""

    def __init__(self, raw_string: bool = False) -> None:
        self.raw_string = raw_string
        self.done = False
        self.failed = False
        self._stack: list[list[Any]] = []   # [kind ("{" or "["), expecting]
        self._top = True                  # expecting the top value (nothing read yet)
        self._string = False              # inside a string
        self._key = False                 # that string is an object key
        self._escape: str | None = None   # "\\..." being read (after the backslash)
        self._high: str | None = None     # a high surrogate waiting for its low half
        self._token = ""                  # a number or literal being read
        self._bare = False                # the top value is a raw string (no quotes out)

    # -------------------------------------------------------------------------- helpers
    def _expecting(self) -> int:
        return self._stack[-1][1] if self._stack else _VALUE

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        self._stack[-1][1] = _COMMA_OR_END

    def _emit_char(self, c: str, out: list[str]) -> None:
        out.append(c if self._bare else _ESCAPED.get(c, c))

    def _end_token(self, out: list[str]) -> bool:
        tok, self._token = self._token, ""
        if tok[0] in "tfn":
            if tok not in _LITERALS:
                return False
            out.append(tok)
        else:
            if not _NUMBER.fullmatch(tok):
                return False
            value = json.loads(tok)
            if isinstance(value, float) and not math.isfinite(value):
                return False   # 1e999: json.dumps would write Infinity, which is not JSON
            out.append(json.dumps(value))
        self._value_done()
        return True

    # -------------------------------------------------------------------------- reading
    def feed(self, text: str) -> tuple[str, int]:
        """Read ``text``: returns ``(output, characters read)``; fewer than ``len(text)`` are
        read only when the value completed (or failed) inside it."""
        out: list[str] = []
        i = 0
        n = len(text)
        while i < n and not self.done and not self.failed:
            c = text[i]
            if self._string:
                if not self._string_char(c, out):
                    self.failed = True
                    break
                i += 1
                continue
            if self._token:
                if c in _NUMBER_CHARS if self._token[0] not in "tfn" else c.isalpha():
                    self._token += c
                    if self._token[0] in "tfn" and not any(
                            lit.startswith(self._token) for lit in _LITERALS):
                        self.failed = True
                        break
                    i += 1
                    continue
                if not self._end_token(out):
                    self.failed = True
                    break
                if self.done:
                    break
                continue   # the character that ended the token is read next
            i += 1
            if c in _WS:
                continue
            if not self._structural(c, out):
                self.failed = True
                i -= 1
                break
        return "".join(out), i

    def finish(self) -> str:
        """The end of the text: a number still being read at the top ends here."""
        if self._token and not self._stack and not self.done and not self.failed:
            out: list[str] = []
            if self._end_token(out):
                return "".join(out)
            self.failed = True
        return ""

    def _structural(self, c: str, out: list[str]) -> bool:
        exp = self._expecting()
        if exp in (_KEY_OR_END, _KEY):
            if c == '"':
                self._string, self._key = True, True
                out.append('"')
                return True
            if c == "}" and exp == _KEY_OR_END:
                return self._close("{", out)
            return False
        if exp == _COLON:
            if c != ":":
                return False
            out.append(": ")
            self._stack[-1][1] = _VALUE
            return True
        if exp == _COMMA_OR_END:
            kind = self._stack[-1][0]
            if c == ",":
                out.append(", ")
                self._stack[-1][1] = _KEY if kind == "{" else _VALUE
                return True
            if c == ("}" if kind == "{" else "]"):
                return self._close(kind, out)
            return False
        # a value (at the top, after a colon, in an array)
        if c == "]" and exp == _VALUE_OR_END:
            return self._close("[", out)
        top = not self._stack
        if c == "{":
            out.append("{")
            self._stack.append(["{", _KEY_OR_END])
        elif c == "[":
            out.append("[")
            self._stack.append(["[", _VALUE_OR_END])
        elif c == '"':
            self._string, self._key = True, False
            self._bare = top and self.raw_string
            if not self._bare:
                out.append('"')
        elif c in "-0123456789" or c in "tfn":
            self._token = c   # a number or literal: written once it ends
        else:
            return False
        return True

    def _close(self, kind: str, out: list[str]) -> bool:
        out.append("}" if kind == "{" else "]")
        self._stack.pop()
        self._value_done()
        return True

    def _string_char(self, c: str, out: list[str]) -> bool:
        if self._escape is not None:
            self._escape += c
            esc = self._escape
            if esc[0] == "u":
                if c not in "0123456789abcdefABCDEF" and len(esc) > 1:
                    return False
                if len(esc) < 5:
                    return True
                self._escape = None
                ch = chr(int(esc[1:], 16))
                if self._high is not None:
                    high, self._high = self._high, None
                    if "\udc00" <= ch <= "\udfff":
                        pair = (ord(high) - 0xD800) * 0x400 + (ord(ch) - 0xDC00) + 0x10000
                        self._emit_char(chr(pair), out)
                        return True
                    self._emit_char(high, out)
                if "\ud800" <= ch <= "\udbff":
                    self._high = ch   # its low half may follow as the next escape
                    return True
                self._emit_char(ch, out)
                return True
            self._escape = None
            if esc not in _SIMPLE:
                return False
            self._flush_high(out)
            self._emit_char(_SIMPLE[esc], out)
            return True
        if c == "\\":
            self._escape = ""
            return True
        self._flush_high(out)
        if c == '"':
            self._string = False
            if self._key:
                out.append('"')
                self._stack[-1][1] = _COLON
            else:
                if not self._bare:
                    out.append('"')
                self._value_done()
            return True
        if c < " ":
            return False   # a raw control character: json.loads refuses it too
        self._emit_char(c, out)
        return True

    def _flush_high(self, out: list[str]) -> None:
        if self._high is not None:
            self._emit_char(self._high, out)
            self._high = None


__all__ = ["JSONCanon"]
