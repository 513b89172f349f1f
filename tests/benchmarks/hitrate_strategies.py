"""Hypothesis strategy shared by the hit-rate tests: small token traces with real sharing."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st


@dataclass
class R:
    prompt: list[int]
    reply: list[int] = field(default_factory=list)


# A strategy for small traces with real sharing: each prompt extends or branches an earlier
# sequence (like chat turns, shared system prompts or sampling), over a tiny alphabet.
@st.composite
def traces(draw, max_requests=8, max_len=8):
    seqs: list[list[int]] = []
    reqs = []
    for _ in range(draw(st.integers(1, max_requests))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            cut = draw(st.integers(0, len(base)))
            prompt = base[:cut] + draw(st.lists(st.integers(0, 2), max_size=3))
        else:
            prompt = draw(st.lists(st.integers(0, 2), min_size=1, max_size=max_len))
        prompt = prompt[:max_len] or [0]
        reply = draw(st.lists(st.integers(0, 2), max_size=3))
        seqs.append(prompt + reply)
        reqs.append(R(prompt, reply))
    return reqs


@dataclass
class T:
    """A request with its time, conversation and turn (what ``bounds.session_phantoms`` reads)."""

    t: float
    conv: int
    turn: int
    prompt: list[int]
    reply: list[int] = field(default_factory=list)


def loop(n_conv=4, turns=6, size=4):
    """Round-robin chats: conversation c's turn k re-sends its history plus ``size`` tokens."""
    hist: dict[int, list[int]] = {c: [] for c in range(n_conv)}
    out = []
    for k in range(turns):
        for c in range(n_conv):
            prompt = hist[c] + [1000 * c + 10 * k + i for i in range(size)]
            reply = [1000 * c + 10 * k + 5 + i for i in range(2)]
            out.append(T(float(len(out)), c, k, prompt, reply))
            hist[c] = prompt + reply
    return out
