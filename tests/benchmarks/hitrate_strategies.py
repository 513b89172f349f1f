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
