"""A reasoning model's thinking cut at a budget of tokens (vLLM's ``thinking_token_budget``).

Reasoning models (DeepSeek-R1, Qwen3) think between ``<think>`` and ``</think>`` before they
answer, and may think for thousands of tokens. With ``SamplingParams.thinking_token_budget``
the engine lets a sequence think that many tokens, then forces the tokens of the close marker
one per step, after which the model answers as it would have after closing on its own. The
thinking's boundaries are :class:`radixkv.engine.grammar.Thinking` (the same marks a grammar
uses to shape only the answer): ``from_start`` (DeepSeek-R1's template opens the thinking in
the prompt) or opened by the reply's first token (Qwen3).

The state of one sequence is a scan of its own output tokens, advanced over the tokens added
since the last step (amortized O(1) a token), kept on the request by output index; a sample
forked at its first token scans its own output from the start, which is right since what the
state records is a function of the output alone. A forced token replaces the whole row of
choice logits (``-inf`` but that token), so no bias, ban or filter can leave a row with no
token to choose; the reported log-probabilities stay the model's own.

Pure Python: ``engine.sampling.force_tokens`` writes the forced rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: ``BudgetScan.phase``: the first token decides (Qwen3); thinking; the thinking is over or
#: never began (nothing is forced again)
UNDECIDED, THINKING, OVER = "undecided", "thinking", "over"


class BudgetScan:
    """Where one sequence's output stands against its thinking budget."""

    __slots__ = ("phase", "start", "seen")

    def __init__(self, thinking: Any) -> None:
        self.phase = THINKING if thinking.from_start else UNDECIDED
        self.start = 0    # output index of the first thinking token
        self.seen = 0     # output tokens scanned

    def advance(self, tokens: Sequence[int], prompt_len: int, thinking: Any) -> None:
        """Scan the output tokens added since the last call (``tokens``: the sequence's
        prompt and output; output index i is ``tokens[prompt_len + i]``, read in place: the
        output is not copied)."""
        close = thinking.close
        k = len(close)
        for i in range(self.seen, len(tokens) - prompt_len):
            t = tokens[prompt_len + i]
            if self.phase == UNDECIDED:
                if t == thinking.open:
                    self.phase, self.start = THINKING, i + 1
                else:
                    self.phase = OVER
            elif self.phase == THINKING and t == close[-1] and i + 1 - k >= self.start and \
                    tuple(tokens[prompt_len + i + 1 - k:prompt_len + i + 1]) == close:
                self.phase = OVER
        self.seen = len(tokens) - prompt_len

    def forced(self, tokens: Sequence[int], prompt_len: int, thinking: Any, budget: int
               ) -> int | None:
        """The token the next step must choose, or None: once ``budget`` thinking tokens are
        written the close marker's tokens, in order (a close the model wrote itself ends the
        thinking and nothing is forced)."""
        self.advance(tokens, prompt_len, thinking)
        if self.phase != THINKING:
            return None
        j = len(tokens) - prompt_len - self.start - budget
        return thinking.close[j] if 0 <= j < len(thinking.close) else None


def scan_for(req: Any, seq: Any) -> BudgetScan:
    """``seq``'s scan (made on first use, stored on the request by output index)."""
    st = req.thinking_state.get(seq.index)
    if st is None:
        st = req.thinking_state[seq.index] = BudgetScan(req.params.thinking)
    return st


def forced_rows(items: Sequence[tuple[int, Any, Any]]) -> list[tuple[int, int]]:
    """``(row, token)`` for each ``(row, request, sequence)`` whose next token is forced."""
    out = []
    for r, req, seq in items:
        p = req.params
        if p.thinking_token_budget is None:
            continue
        tok = scan_for(req, seq).forced(seq.token_ids, seq.prompt_len, p.thinking,
                                        p.thinking_token_budget)
        if tok is not None:
            out.append((r, tok))
    return out


__all__ = ["BudgetScan", "OVER", "THINKING", "UNDECIDED", "forced_rows", "scan_for"]
