"""``JSONCanon`` (radixkv/server/json_stream.py): a JSON value read in pieces is written in
``json.dumps`` form, and every split of its text gives the same output.

The raw texts are rendered from random values with random layout: whitespace between tokens,
each string character written as itself, as a short escape or as ``\\uXXXX`` (astral
characters as surrogate pairs), ``\\/`` for ``/``, and numbers in several notations.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.server.json_stream import JSONCanon

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
          "\f": "\\f", "/": "\\/"}


def _render(v, draw) -> str:
    ws = lambda: draw(st.sampled_from(["", "", " ", "\n  ", "\t"]))  # noqa: E731
    if isinstance(v, dict):
        items = [ws() + _string(k, draw) + ws() + ":" + ws() + _render(x, draw) + ws()
                 for k, x in v.items()]
        return "{" + ",".join(items) + ws() + "}"
    if isinstance(v, list):
        return "[" + ",".join(ws() + _render(x, draw) + ws() for x in v) + ws() + "]"
    if isinstance(v, str):
        return _string(v, draw)
    if isinstance(v, float):
        return draw(st.sampled_from([repr(v), format(v, "e"), format(v, "E")]))
    return json.dumps(v)


def _string(s: str, draw) -> str:
    out = []
    for c in s:
        forms = []
        if c >= " " and c not in '"\\':
            forms.append(c)
        if c in _SHORT:
            forms.append(_SHORT[c])
        cp = ord(c)
        if cp > 0xFFFF:
            cp -= 0x10000
            forms.append(f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04X}")
        else:
            forms.append(f"\\u{cp:04x}")
        out.append(draw(st.sampled_from(forms)))
    return '"' + "".join(out) + '"'


def _pieces(text: str, draw) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _run(pieces: list[str], raw_string: bool = False) -> tuple[str, JSONCanon, int]:
    canon, out, read = JSONCanon(raw_string), [], 0
    for p in pieces:
        got, n = canon.feed(p)
        out.append(got)
        read += n
        if canon.done or canon.failed:
            break
    out.append(canon.finish())
    return "".join(out), canon, read


@settings(max_examples=300, deadline=None)
@given(VALUES, st.data())
def test_any_split_of_any_layout_gives_json_dumps(value, data) -> None:
    raw = _render(value, data.draw)
    want = json.dumps(json.loads(raw), ensure_ascii=False)
    got, canon, read = _run(_pieces(raw, data.draw))
    assert got == want and canon.done and not canon.failed, (raw, got, want)
    # what follows the value (the end of a tool call) is left unread
    tail = data.draw(st.sampled_from(["}\n</tool_call>", " }", "\n"]))
    if isinstance(value, (dict, list, str)) or tail[0] != " ":
        got, canon, read = _run(_pieces(raw + tail, data.draw))
        assert got == want and canon.done and read <= len(raw) + 1


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.lists(VALUES, max_size=3), st.dictionaries(st.text(max_size=4), VALUES,
                                                              max_size=3), st.text()),
       st.data())
def test_a_cut_value_writes_a_prefix_and_is_not_done(value, data) -> None:
    """A container or a string cut short (a reply that ran out of tokens mid-call) has
    written a prefix of its ``json.dumps`` form, and is not done."""
    raw = _render(value, data.draw)
    want = json.dumps(json.loads(raw), ensure_ascii=False)
    cut = data.draw(st.integers(0, len(raw) - 1))
    got, canon, _ = _run(_pieces(raw[:cut], data.draw))
    assert want.startswith(got) and not canon.done and not canon.failed, (raw[:cut], got)


def test_raw_strings_and_failures() -> None:
    got, canon, _ = _run(['"{\\"city\\": \\"Par', 'is\\"}"'], raw_string=True)
    assert got == '{"city": "Paris"}' and canon.done
    for bad in ['{"a" 1}', '{"a": 1,}', "[1 2]", "{'a': 1}", '{"a": tru}', '{"a": NaN}',
                '"tab\there"', "01", '{"a": "\\x"}', '{"a": 1e999}', "[-1e400]"]:
        got, canon, _ = _run([bad])
        assert canon.failed or not canon.done, bad
    got, canon, read = _run(['{"a": [1, 2], "b": {}}xyz'])
    assert (got, read, canon.done) == ('{"a": [1, 2], "b": {}}', 22, True)
