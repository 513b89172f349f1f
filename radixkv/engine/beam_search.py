"""Beam search with transformers' exact semantics, for one request, on top of fork/free.

This mirrors transformers' ``generate()`` beam search (``_beam_search``, transformers 5.x, batch
size 1) tensor for tensor,
so that radixkv returns what ``model.generate(num_beams=k, do_sample=False, length_penalty=...,
early_stopping=...)`` returns:

* scores are cumulative ``log_softmax`` log-probabilities (float32). At the first step all k beams
  hold the prompt; beams 1.. start at -1e9 so only beam 0's continuations count.
* each step keeps the top ``K = max(2, 1 + num_eos) * k`` candidates over all beams (``topk`` on
  the flattened ``[k * vocab]`` scores, so ties break like transformers'); a candidate *hits* a
  stop when its token is an eos/stop token or it is the last allowed token.
* the next running beams are the best k candidates that did not hit (hits get -1e9);
* hits among the first k candidates become finished hypotheses with score
  ``logprob_sum / generated_len ** length_penalty`` (generated_len counts the new token) and are
  merged with the previous k best finished (early stopping and the "cannot improve" heuristic
  add -1e9 exactly where transformers does);
* the search ends when no running beam can improve on the finished ones (heuristic), when all k
  finished slots are full and ``early_stopping is True``, or when every candidate hit a stop.

The engine owns the sequences: after :meth:`BeamSearch.step` it forks each chosen parent once per
extra child and frees parents nobody chose (``LLMEngine._beam_step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEG = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True)
class BeamStep:
    """The running beams after one step: beam j continues live beam ``parents[j]`` with
    ``tokens[j]``; ``raw_scores[j]`` is its cumulative logprob. ``done``: the search is over."""

    parents: list[int]
    tokens: list[int]
    raw_scores: list[float]
    done: bool


class BeamSearch:
    """State of one request's beam search (see module docstring)."""

    def __init__(self, num_beams: int, max_new_tokens: int, eos_token_ids: Sequence[int],
                 length_penalty: float, early_stopping: bool | str) -> None:
        self.k = num_beams
        self.max_new = max_new_tokens
        self.eos = frozenset(eos_token_ids)
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.beams_to_keep = max(2, 1 + len(self.eos)) * num_beams
        self.running_scores = torch.zeros(num_beams)
        self.running_scores[1:] = NEG
        self.running_out: list[list[int]] = [[] for _ in range(num_beams)]
        self.beam_to_live = [0] * num_beams            # first step: every beam is the prompt
        self.fin_scores = torch.full((num_beams,), NEG)
        self.fin_raw = [NEG] * num_beams
        self.fin_out: list[list[int]] = [[] for _ in range(num_beams)]
        self.fin_flag = torch.zeros(num_beams, dtype=torch.bool)
        self.improvable = True
        self.gen_len = 0

    def step(self, logits: torch.Tensor) -> BeamStep:
        """Advance with ``logits`` ``[num_live, vocab]`` (live sequences in beam order)."""
        k, lp_pen = self.k, self.length_penalty
        logp = torch.log_softmax(logits.float(), dim=-1)[self.beam_to_live].cpu()
        vocab = logp.shape[-1]
        acc = (logp + self.running_scores[:, None]).reshape(-1)
        top_lp, top_idx = torch.topk(acc, self.beams_to_keep)
        cand_beam = (top_idx // vocab).tolist()
        cand_tok = (top_idx % vocab).tolist()
        last = self.gen_len + 1 >= self.max_new
        hits = torch.tensor([last or t in self.eos for t in cand_tok], dtype=torch.bool)

        # running beams for the next iteration
        run_lp = top_lp + hits.to(torch.float32) * NEG
        sel = torch.topk(run_lp, k)[1].tolist()

        # finished hypotheses
        just_done = hits.clone()
        just_done[k:] = False
        fin = top_lp / ((self.gen_len + 1) ** lp_pen)
        full = bool(self.fin_flag.all()) and self.early_stopping is True
        fin = fin + float(full) * NEG
        fin = fin + float(not self.improvable) * NEG
        fin = fin + (~just_done) * NEG
        merged = torch.cat((self.fin_scores, fin))
        keep = torch.topk(merged, k)[1].tolist()
        cand_out = [self.running_out[b] + [t] for b, t in zip(cand_beam, cand_tok)]
        old_out, old_raw, old_flag = self.fin_out, self.fin_raw, self.fin_flag.tolist()
        top_lp_list = top_lp.tolist()
        self.fin_out = [old_out[i] if i < k else cand_out[i - k] for i in keep]
        self.fin_raw = [old_raw[i] if i < k else top_lp_list[i - k] for i in keep]
        self.fin_flag = torch.tensor(
            [old_flag[i] if i < k else bool(just_done[i - k]) for i in keep])
        self.fin_scores = merged[keep]

        self.running_scores = run_lp[sel]
        self.running_out = [cand_out[i] for i in sel]
        parents = [cand_beam[i] for i in sel]
        self.gen_len += 1

        # stopping heuristic (transformers' _check_early_stop_heuristic)
        if self.early_stopping == "never" and lp_pen > 0.0:
            best_len = self.max_new
        else:
            best_len = self.gen_len
        best_possible = self.running_scores[:1] / (best_len ** lp_pen)
        worst = torch.where(self.fin_flag, self.fin_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool(torch.any(best_possible > worst))
        done = not (self.improvable
                    and not (bool(self.fin_flag.all()) and self.early_stopping is True)
                    and not bool(hits.all()))
        live_parents = [self.beam_to_live[p] for p in parents]
        self.beam_to_live = list(range(k))
        return BeamStep(live_parents, [cand_tok[i] for i in sel], self.running_scores.tolist(),
                        done)

    def best(self, n: int) -> list[tuple[list[int], float, float]]:
        """The ``n`` best finished hypotheses: (output tokens, score, cumulative logprob)."""
        return [(list(self.fin_out[i]), float(self.fin_scores[i]), self.fin_raw[i])
                for i in range(min(n, self.k))]


__all__ = ["BeamSearch", "BeamStep"]
