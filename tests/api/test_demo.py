"""The demo and chat CLI entry points, driven with tiny engines (the real run loads SmolLM2)."""

from __future__ import annotations

import io

from radixkv.api import demo


def test_demo_prints_a_row_per_turn_with_baseline(make_engine, capsys):
    e, base = make_engine(), make_engine(enable_prefix_caching=False)
    assert demo.main(["--quick", "--max-tokens", "6"], engine=e, baseline=base) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("chat turn", "rag question"))]
    assert len(rows) == 3 + 2
    # turn 1 and question 1 are cold, later ones hit; the baseline column is filled in
    cached = [int(r.split()[4]) for r in rows]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:3]) and cached[4] > 0
    # a cold turn (nothing cached) shows "cold", not a ratio of two full prefills (noise)
    assert all(r.split()[-1] == ("cold" if c == 0 else r.split()[-1]) for r, c in zip(rows, cached))
    assert all(r.split()[-1].endswith("x") for r, c in zip(rows, cached) if c > 0)
    assert demo.LEGEND.splitlines()[0] in out


def test_chat_cli_streams_and_prints_figures_until_exit(make_engine):
    e = make_engine()
    stdin = io.StringIO("Hello\n\n/stats\nHow are you?\n/exit\nnever read\n")
    out = io.StringIO()
    assert demo.chat_main(["--max-tokens", "5", "--no-compare"], engine=e, stdin=stdin,
                          stdout=out) == 0
    text = out.getvalue()
    assert text.count("[turn ") == 2 and "prompt_tokens:" in text
    assert "[turn 2: prompt" in text and "cached 0" not in text.split("[turn 2:")[1][:40]


def test_chat_cli_exits_on_eof(make_engine):
    out = io.StringIO()
    assert demo.chat_main(["--no-compare"], engine=make_engine(), stdin=io.StringIO(""),
                          stdout=out) == 0
