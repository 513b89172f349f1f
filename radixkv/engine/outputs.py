"""What the engine returns to callers after each step (plain dataclasses, no tensors).

A ``RequestOutput`` is a snapshot of one request: every completion so far (``text`` and
``token_ids`` are cumulative) plus what is new since the previous snapshot of that request
(``delta_text`` / ``delta_token_ids``, for streaming). ``finished`` is True exactly once, in the
last snapshot. Cache figures (``num_cached_tokens``, ``cached_tokens_per_tier``) describe the
request's first admission: how many prompt tokens were served from the cache instead of computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Values of ``CompletionOutput.finish_reason``.
FINISH_STOP = "stop"      # an end-of-sequence token, a stop token or a stop string
FINISH_LENGTH = "length"  # max_tokens or max_model_len reached
FINISH_ABORT = "abort"    # abort_request
#: The request cannot fit the device KV pool even with nothing else running (the output holds
#: what was generated before it outgrew the pool); counted in ``stats()["unschedulable"]``.
FINISH_CAPACITY = "capacity"


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one output token and the ``k`` most likely tokens at its position
    (raw model distribution, before temperature/top-k/top-p), when the request asked for
    ``SamplingParams.logprobs = k``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob), most likely first
    #: 1 + how many tokens the model found more likely (set for prompt tokens; vLLM's rank)
    rank: int | None = None


@dataclass
class CompletionOutput:
    """One completion (a sample of ``n``, or one of the best beams).

    Attributes:
        index: which completion of the request (0-based; beams: 0 = best score).
        text: detokenized output so far (stop string removed unless asked to keep it);
            empty when the engine has no tokenizer.
        token_ids: output token ids so far, including a final stop/eos token.
        finish_reason: None while running, else ``"stop"``, ``"length"``, ``"abort"`` or
            ``"capacity"`` (the KV pool cannot hold the request, see ``FINISH_CAPACITY``).
        cumulative_logprob: sum of the model's log-probabilities of ``token_ids``.
        delta_text, delta_token_ids: what was added since the previous output of this request.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs, delta_logprobs: one :class:`TokenLogprob` per entry of ``token_ids`` /
            ``delta_token_ids`` when the request asked for them, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Snapshot of one request after an engine step.

    Attributes:
        request_id: the caller's id.
        prompt_token_ids: the prompt as given (one list per request, shared by its snapshots:
            copying it per snapshot cost O(prompt) per sequence per step).
        outputs: the completions (``n`` of them; beam search: the best ``n`` once finished).
        finished: True when every completion is finished (sent once).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission.
        cached_tokens_per_tier: the same split by tier (0 = device, 1 = host, 2 = disk).
        ttft: seconds from ``add_request`` to the first generated token (None before it).
        queue_time: seconds from ``add_request`` to the scheduler's first admission of it
            (None before it): vLLM's time in the waiting phase.
        num_preemptions: times the request was preempted (and recomputed) so far.
        cache_write_tokens: prompt tokens the request's prefill added to the cache (full blocks
            that were not cached before it); with ``num_cached_tokens`` (read), what hosted
            prompt caches report as cache writes and reads. Set once the prompt is computed.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, once the prompt is computed:
            one entry per prompt token, None for the first, then its :class:`TokenLogprob`
            (with ``rank``) given the tokens before it; else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    cached_tokens_per_tier: tuple[int, ...] = ()
    ttft: float | None = None
    num_preemptions: int = 0
    cache_write_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None
    queue_time: float | None = None

    @property
    def cache_read_tokens(self) -> int:
        """Prompt tokens read from the cache (= ``num_cached_tokens``)."""
        return self.num_cached_tokens

    @property
    def new_token_ids(self) -> list[list[int]]:
        """Per completion, the token ids added since the previous snapshot."""
        return [o.delta_token_ids for o in self.outputs]


def check_stop(seq: Any, params: Any, tok: int, eos: Any, max_model_len: int) -> None:
    """Set ``seq.finish_reason`` (and ``stop_reason``) if ``tok``, just appended, ends it: an
    end-of-sequence token (unless ``ignore_eos``) or a stop token, whose own text (with
    ``skip_special_tokens`` false) stays out of the text unless ``include_stop_str_in_output``
    (vLLM's rule: the token ids keep it), a stop string in the new text (which is cut there,
    or after it with ``include_stop_str_in_output`` or for a ``stop_after`` string), or the
    length.
    Before ``min_tokens`` tokens, only the length (vLLM's rule; the choice masked the stop
    tokens, so one here came from a caller that did not)."""
    detok = seq.detok
    new_text = detok.append(tok)
    if params.min_tokens and len(seq.token_ids) - seq.prompt_len < params.min_tokens:
        n = len(seq.token_ids)
        if n >= max_model_len:
            seq.finish_reason = FINISH_LENGTH
        return
    if (not params.ignore_eos and tok in eos) or tok in params.stop_token_ids:
        seq.finish_reason, seq.stop_reason = FINISH_STOP, tok
        if new_text and not params.include_stop_str_in_output:
            detok.truncate(len(detok.text) - len(new_text))
        return
    hit = detok.find_stop(len(new_text)) if new_text and detok.stop else None
    if hit is not None:
        s, i = hit
        keep = params.include_stop_str_in_output or s in params.stop_after
        detok.truncate(i + len(s) if keep else i)
        seq.finish_reason, seq.stop_reason = FINISH_STOP, s
        return
    n = len(seq.token_ids)
    if n - seq.prompt_len >= params.max_tokens or n >= max_model_len:
        seq.finish_reason = FINISH_LENGTH


def request_output(req: Any, finished: bool, tokenizer: Any, remote_host_tier: int | None
                   ) -> RequestOutput:
    """The ``RequestOutput`` of ``req`` now; each sequence's deltas are those since the last
    output (its sent counters advance). ``remote_host_tier``: with a remote tier, the host tier
    whose blocks a remote lookup installed (counted as ``remote``, a last entry)."""
    if req.beam is not None:
        comps = []
        for i, (toks, _score, raw) in enumerate(req.beam.best(req.params.n)):
            reason = FINISH_STOP if toks and toks[-1] in req.beam.eos else FINISH_LENGTH
            shown = toks[:-1] if reason == FINISH_STOP and not \
                req.params.include_stop_str_in_output else toks   # (check_stop's rule)
            text = tokenizer.decode(shown, skip_special_tokens=req.params.skip_special_tokens) \
                if tokenizer else ""
            comps.append(CompletionOutput(i, text, toks, reason, raw, text, list(toks)))
    else:
        comps = []
        seqs = req.seqs + req.done if req.done else req.seqs
        if len(seqs) > 1:
            seqs = sorted(seqs, key=_index)   # (a new list: req.seqs keeps its order)
        for seq in seqs:
            detok = seq.detok
            text = detok.text
            if detok.max_stop and text:   # a stop string may be forming at the end: hold it
                text = text[:detok.emittable_len(seq.finish_reason is not None)]
            out_ids = seq.token_ids[seq.prompt_len:]   # a fresh list: the snapshot's own
            sent = seq.sent_num_tokens
            lps = seq.logprobs
            comps.append(CompletionOutput(
                seq.index, text, out_ids, seq.finish_reason, seq.cumulative_logprob,
                text[seq.sent_text_len:], out_ids[sent:], seq.stop_reason,
                None if lps is None else list(lps),
                None if lps is None else lps[sent:]))
            seq.sent_text_len, seq.sent_num_tokens = len(text), len(out_ids)
    per_tier = req.cached_tokens_per_tier
    if remote_host_tier is not None:
        per = list(per_tier) or [0] * (remote_host_tier + 1)
        moved = min(req.remote_tokens, per[remote_host_tier])
        per[remote_host_tier] -= moved
        per_tier = (*per, moved)
    prompt = req.output_prompt_ids
    if prompt is None:   # one copy per request, shared by its snapshots (not O(prompt) each)
        prompt = req.output_prompt_ids = list(req.prompt_token_ids)
    first = req.first_token_time   # (``req.ttft``, without the property call)
    plp = req.prompt_logprobs
    if plp is not None and len(plp) < len(prompt):
        plp = None   # still being computed (chunked prefill)
    scheduled = req.scheduled_time
    return RequestOutput(req.request_id, prompt, comps, finished, req.num_cached_tokens,
                         per_tier, None if first is None else first - req.arrival_time,
                         req.num_preemptions,
                         req.cache_write_tokens, plp,
                         None if scheduled is None else scheduled - req.arrival_time)


def _index(seq: Any) -> int:
    return seq.index


__all__ = ["request_output", "check_stop", "CompletionOutput", "RequestOutput", "TokenLogprob",
           "FINISH_STOP", "FINISH_LENGTH", "FINISH_ABORT", "FINISH_CAPACITY"]
