"""Sampling parameters and the token choice from one step's logits.

``SamplingParams`` is the per-request contract (validated at construction so a bad request never
reaches the scheduler). The functions below turn logits rows into tokens:

* greedy: ``torch.argmax`` (ties go to the lowest token id, as in transformers' greedy search);
* random: temperature, then min-p, top-k and top-p, then one draw (an exponential race) from
  the sequence's own ``torch.Generator``. Each row is drawn with its own generator, so a seeded
  request produces the same tokens whatever else is in the batch; every sampled row of a step
  is filtered and drawn in whole-batch tensor ops and read back in one transfer.
* before either, for the rows that ask: ``logit_bias``, the repetition, frequency and presence
  penalties (:func:`adjust_logits`) and a grammar's mask (:func:`choice_logits`,
  ``engine/grammar.py``), on a copy: the reported log-probabilities stay the raw model's.

Log-probabilities reported to users (``cumulative_logprob``) are those of the *raw* model
distribution, ``log_softmax(logits)``, before temperature/top-k/top-p: they measure how likely
the model found the text, independent of the sampling knobs.
"""

from __future__ import annotations

from functools import cached_property

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixkv.errors import InvalidRequestError

if TYPE_CHECKING:  # torch is imported inside the functions: the scheduler imports this module
    import torch


#: Temperatures below this sample as greedy (vLLM's choice too): logits / 1e-300 overflow to
#: inf, and softmax of inf is nan, so such a request crashed the step instead of sampling.
MIN_TEMPERATURE = 1e-5
#: Most alternatives per position a request may ask for (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20
#: Most ``logprob_token_ids`` one request may name (each is a value in every token's entry).
MAX_LOGPROB_TOKEN_IDS = 256
#: Seeds are used modulo 2**64 (torch generators take 64-bit seeds; sample i uses seed + i).
SEED_MODULUS = 2**64


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: Values of ``SamplingParams.output_kind``: a snapshot every step, or the final one only.
OUTPUT_CUMULATIVE = "cumulative"
OUTPUT_FINAL_ONLY = "final_only"
OUTPUT_KINDS = (OUTPUT_CUMULATIVE, OUTPUT_FINAL_ONLY)


@dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request.

    Attributes:
        max_tokens: new tokens at most (>= 1).
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature). Values below
            ``MIN_TEMPERATURE`` (1e-5) are set to 0: their limit is greedy, and dividing logits by
            them overflows.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set whose probability reaches top_p (1.0 = all).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (after the
            temperature, before top-k/top-p, as vLLM; 0 = off).
        seed: seeds this request's generator (sample i of ``n`` uses ``seed + i``); any int,
            used modulo 2**64; None = random.
        stop_token_ids: tokens that end a sequence (kept in ``token_ids``, dropped from the text).
        stop: strings that end a sequence; the text is cut before them unless
            ``include_stop_str_in_output``.
        stop_after: strings that end a sequence and stay in its text (the server ends a reply
            after its first ``</tool_call>`` for ``parallel_tool_calls: false``).
        n: samples per prompt; they share the prompt's KV blocks (fork + copy-on-write).
        beam_width: > 1 runs beam search with that many beams (returns the best ``n`` <= width);
            deterministic, so temperature must be 0.
        length_penalty, early_stopping: beam search knobs with transformers' semantics
            (score = sum of logprobs / generated_len ** length_penalty; early_stopping in
            {True, False, "never"}).
        ignore_eos: keep generating past the model's end-of-sequence token.
        allowed_token_ids: vLLM's: None = any token; else only these can be chosen (every
            other logit is ``-inf`` for the choice).
        bad_words: vLLM's: strings never generated. Each is tokenized as written and with a
            leading space (``engine.validation.bad_words_ids``); a token is banned where the
            output so far ends with all of a bad word's tokens but its last (a one-token word
            is always banned). Needs the engine's tokenizer.
        min_tokens: vLLM's: until this many tokens are generated, the end-of-sequence token
            (unless ``ignore_eos``) and ``stop_token_ids`` are masked out of the choice and no
            stop string ends the sequence (0 = off; at most ``max_tokens``). Not with beam
            search or a grammar (whose value may end earlier).
        skip_special_tokens: leave special tokens (end of turn, template markers) out of the
            text (default, as vLLM's); False writes them (token ids are the same either way).
        logprobs: None = no per-token log-probabilities; k in [0, MAX_LOGPROBS] = each output
            token's own log-probability plus the k most likely tokens at that position
            (``CompletionOutput.logprobs``). Raw model distribution, like
            ``cumulative_logprob``. Not with beam search (its tokens are re-ranked at the end).
        logprob_token_ids: vLLM's: None, or token ids (at most ``MAX_LOGPROB_TOKEN_IDS``) whose
            log-probabilities each output token's entry lists instead of the most likely ones,
            in this order (a classifier's label tokens, every step); implies ``logprobs`` (0:
            with ``logprobs`` k > 0 as well it is an error). Not with beam search.
        prompt_logprobs: vLLM's: None = none; k in [0, MAX_LOGPROBS] = the log-probability of
            every prompt token after the first, given the tokens before it, with its rank and
            the k most likely tokens at its position (``RequestOutput.prompt_logprobs``). Such a
            request computes its whole prompt: it neither reads nor feeds the prefix cache (a
            cached position has no logits). Not with beam search or RAG documents.
        frequency_penalty, presence_penalty: in [-2, 2], OpenAI's (and vLLM's) semantics: the
            logit of token j is lowered by ``frequency_penalty * c[j] + presence_penalty *
            (c[j] > 0)``, where ``c[j]`` counts j among the tokens this sequence generated so
            far (not the prompt).
        logit_bias: ``{token id: bias}`` (bias in [-100, 100]) added to those logits before
            sampling, as OpenAI's ``logit_bias``; stored as sorted ``(id, bias)`` pairs.
        repetition_penalty: > 0, 1 = off; vLLM's (and transformers') multiplicative penalty on
            every token of the prompt or the output so far: a positive logit is divided by it,
            a negative one multiplied.
        grammar: a compiled grammar (:class:`radixkv.engine.grammar.Grammar`, e.g. a JSON
            schema) that masks every token the output could not continue with.
        thinking_token_budget: vLLM's: None = off; n >= 0 = a reasoning model thinks at most
            n tokens, then the tokens of its close marker are forced one a step
            (``engine/thinking_budget.py``). Needs ``thinking``; not with beam search.
        thinking: where the thinking opens and closes
            (:class:`radixkv.engine.grammar.Thinking`: ``open`` token, ``close`` tokens,
            ``from_start``), for ``thinking_token_budget``.
        output_kind: ``"cumulative"`` (default): ``LLMEngine.step`` returns a ``RequestOutput``
            of the request after every step that changed it (streaming); ``"final_only"``:
            only the final one (vLLM's ``RequestOutputKind.FINAL_ONLY``), whose deltas then
            hold the whole completion. A caller that reads only the result (``Engine.generate``)
            saves building, routing and reading a snapshot per sequence per step.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    stop_after: tuple[str, ...] = ()
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    grammar: Any = None
    thinking_token_budget: int | None = None
    thinking: Any = None
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            try:
                bias = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
            except (TypeError, ValueError):
                raise InvalidRequestError(f"logit_bias must map token ids to numbers, got "
                                          f"{self.logit_bias!r}") from None
            object.__setattr__(self, "logit_bias", bias)
        # Normalise list inputs to tuples (frozen: set through object.__setattr__).
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        for name, value in (("stop", stop), ("stop_token_ids", self.stop_token_ids),
                            ("bad_words", self.bad_words), ("stop_after", self.stop_after)) + (
                (("allowed_token_ids", self.allowed_token_ids),)
                if self.allowed_token_ids is not None else ()) + (
                (("logprob_token_ids", self.logprob_token_ids),)
                if self.logprob_token_ids is not None else ()):
            try:
                object.__setattr__(self, name, tuple(value))
            except TypeError:
                raise InvalidRequestError(f"{name} must be a list, got {value!r}") from None
        bad = _first_error(self)
        if bad:
            raise InvalidRequestError(f"invalid sampling parameters: {bad}")
        if self.logprob_token_ids is not None and self.logprobs is None:
            object.__setattr__(self, "logprobs", 0)   # the entries that will list them
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)

    @cached_property   # frozen: read per sequence per step, computed once
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property   # frozen: read per sequence per step, computed once
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the choice (penalties, bias, grammar,
        ``min_tokens``'s mask)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.grammar is not None
                    or self.min_tokens or self.allowed_token_ids is not None
                    or self.bad_words or self.thinking_token_budget is not None)

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @cached_property   # frozen: read per sequence per step, computed once
    def num_seqs(self) -> int:
        """Live sequences this request will hold at once (samples or beams)."""
        return max(self.n, self.beam_width)

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> SamplingParams:
        """Build from user JSON/kwargs; an unknown key raises InvalidRequestError naming it.

        >>> SamplingParams.from_dict({"max_tokens": 4}).max_tokens
        4
        >>> SamplingParams.from_dict({"max_token": 4})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        radixkv.errors.InvalidRequestError: unknown sampling option 'max_token' (known: ...)
        """
        if not isinstance(d, Mapping):
            raise InvalidRequestError(f"sampling options must be a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in d if k not in known]
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling option {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**d)  # type: ignore[arg-type]


def _first_error(p: SamplingParams) -> str | None:
    """The first thing wrong with ``p``, as a message for the user, or None."""
    if not _is_int(p.max_tokens) or p.max_tokens < 1:
        return f"max_tokens must be an int >= 1, got {p.max_tokens!r}"
    if p.output_kind not in OUTPUT_KINDS:
        return f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {p.output_kind!r}"
    if not isinstance(p.temperature, (int, float)) or isinstance(p.temperature, bool) \
            or not p.temperature >= 0 or p.temperature == float("inf"):
        return f"temperature must be a finite number >= 0, got {p.temperature!r}"
    if not _is_int(p.top_k) or p.top_k < 0:
        return f"top_k must be an int >= 0 (0 disables it), got {p.top_k!r}"
    if not isinstance(p.top_p, (int, float)) or isinstance(p.top_p, bool) or not 0 < p.top_p <= 1:
        return f"top_p must be in (0, 1], got {p.top_p!r}"
    if not isinstance(p.min_p, (int, float)) or isinstance(p.min_p, bool) \
            or not 0 <= p.min_p <= 1:
        return f"min_p must be in [0, 1], got {p.min_p!r}"
    if p.seed is not None and not _is_int(p.seed):
        return f"seed must be an int or None, got {p.seed!r}"
    if not all(_is_int(t) and t >= 0 for t in p.stop_token_ids):
        return f"stop_token_ids must be non-negative ints, got {list(p.stop_token_ids)!r}"
    if not all(isinstance(s, str) and s for s in p.stop):
        return f"stop must be non-empty strings, got {list(p.stop)!r}"
    if not all(isinstance(s, str) and s for s in p.stop_after):
        return f"stop_after must be non-empty strings, got {list(p.stop_after)!r}"
    allowed = p.allowed_token_ids
    if allowed is not None and (not allowed or not all(_is_int(t) and t >= 0 for t in allowed)):
        return (f"allowed_token_ids must be None or a non-empty list of token ids >= 0, got "
                f"{list(allowed)!r}")
    if not all(isinstance(w, str) and w.strip() for w in p.bad_words):
        return f"bad_words must be non-blank strings, got {list(p.bad_words)!r}"
    if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
        return f"min_tokens must be an int in [0, max_tokens={p.max_tokens}], got {p.min_tokens!r}"
    if p.min_tokens and p.grammar is not None:
        return "min_tokens is not supported with a grammar (its value may end before)"
    if not _is_int(p.n) or p.n < 1:
        return f"n must be an int >= 1, got {p.n!r}"
    if not _is_int(p.beam_width) or p.beam_width < 1:
        return f"beam_width must be an int >= 1, got {p.beam_width!r}"
    if not isinstance(p.length_penalty, (int, float)) or isinstance(p.length_penalty, bool) \
            or not math.isfinite(p.length_penalty):
        return f"length_penalty must be a finite number, got {p.length_penalty!r}"
    if p.early_stopping not in (True, False, "never"):
        return f"early_stopping must be True, False or 'never', got {p.early_stopping!r}"
    if p.logprobs is not None and (not _is_int(p.logprobs)
                                   or not 0 <= p.logprobs <= MAX_LOGPROBS):
        return f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {p.logprobs!r}"
    ids = p.logprob_token_ids
    if ids is not None:
        if not ids or len(ids) > MAX_LOGPROB_TOKEN_IDS or not all(
                _is_int(t) and t >= 0 for t in ids):
            return (f"logprob_token_ids must be None or 1 to {MAX_LOGPROB_TOKEN_IDS} token ids "
                    f">= 0, got {list(ids)!r:.80}")
        if p.logprobs:
            return ("logprob_token_ids lists the log-probabilities of those tokens instead of "
                    "the most likely ones: not with logprobs > 0")
    if p.prompt_logprobs is not None and (not _is_int(p.prompt_logprobs)
                                          or not 0 <= p.prompt_logprobs <= MAX_LOGPROBS):
        return (f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got "
                f"{p.prompt_logprobs!r}")
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(p, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
            return f"{name} must be a number in [-2, 2], got {v!r}"
    rp = p.repetition_penalty
    if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0 < rp <= 100 \
            or not math.isfinite(rp):
        return f"repetition_penalty must be a number in (0, 100], got {rp!r}"
    try:
        bias_ok = all(_is_int(t) and t >= 0 and isinstance(b, (int, float))
                      and not isinstance(b, bool) and -100.0 <= b <= 100.0
                      for t, b in p.logit_bias)
    except (TypeError, ValueError):
        bias_ok = False
    if not bias_ok:
        return ("logit_bias must map token ids >= 0 to biases in [-100, 100], got "
                f"{p.logit_bias!r}")
    budget = p.thinking_token_budget
    if budget is not None:
        if not _is_int(budget) or budget < 0:
            return f"thinking_token_budget must be None or an int >= 0, got {budget!r}"
        t = p.thinking
        if t is None or not getattr(t, "close", None) or not all(
                _is_int(x) and x >= 0 for x in t.close) or (
                not t.from_start and not (_is_int(t.open) and t.open >= 0)):
            return ("thinking_token_budget needs thinking: where the model's thinking opens "
                    "and closes (engine.grammar.Thinking with close token ids, and an open "
                    f"token unless from_start), got {t!r}")
    if p.beam_width > 1:
        if p.adjusts_logits:
            return ("beam search does not take frequency_penalty, presence_penalty, "
                    "logit_bias, min_tokens, a grammar or thinking_token_budget")
        if p.logprobs is not None or p.prompt_logprobs is not None or \
                p.logprob_token_ids is not None:
            return "per-token logprobs are not available with beam search"
        if p.temperature != 0 or p.top_k or p.top_p != 1.0 or p.min_p:
            return ("beam search is deterministic: leave temperature at 0, top_k and min_p at "
                    "0, top_p at 1")
        if p.n > p.beam_width:
            return f"n ({p.n}) must be <= beam_width ({p.beam_width}) with beam search"
        if p.stop or p.stop_after:
            return "stop strings are not supported with beam search (use stop_token_ids)"
    return None


# ----------------------------------------------------------------------------- token choice

def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator for one sequence: seeded when ``seed`` is given (any int, taken modulo
    2**64, the range torch accepts), else from fresh entropy."""
    import torch

    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed % SEED_MODULUS)
    return g


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of ``[R, V]`` logits; ties resolve to the lowest token id.

    ``max(dim)`` rather than ``argmax``: the same indices (both documented to return the first
    maximal value), but on the CPU ``argmax`` over a 49k vocabulary took 2.0 ms for 16 rows
    against 0.74 ms, ~3% of a decode step of the embedded model.
    """
    return logits.max(dim=-1).indices.tolist()


def greedy_and_logsumexp(logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """Greedy tokens (as :func:`greedy_tokens`) and each row's log-sum-exp, from one native pass
    over float32 CPU logits (``kernels/cpu_sampling.c``); ``None`` where that does not run.

    Why: a decode step that needs only the chosen tokens' log-probabilities (no top
    logprobs requested) then skips ``max(dim)`` and a full ``log_softmax``, 1.6 ms of a 46 ms
    step of the embedded model; ``logit - lse`` is that log-probability.
    """
    if logits.device.type != "cpu":
        return None
    from radixkv.kernels import native

    return native.greedy_logsumexp(logits)


def to_device(values: Sequence[Any], device: torch.device, dtype: torch.dtype
              ) -> torch.Tensor:
    """A small host list as a tensor on ``device``, without a stream sync.

    Why: a blocking host-to-device copy (``torch.tensor(list, device="cuda")``,
    ``.to("cuda")`` of pageable memory) waits for every kernel queued before it, so each
    index list a step sends the GPU would drain the stream. Through pinned memory the copy is
    queued like a kernel (the caching host allocator keeps the buffer until the copy has
    run). On the CPU it is the plain tensor."""
    import torch

    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class StepReads:
    """The device values a step needs on the host, read back in one transfer.

    Why: on CUDA every read (``tolist``, ``item``, ``float``) waits for the stream; a step
    that read its greedy tokens, then their log-probabilities, then the sampled tokens, each
    after queueing the work that needs the previous answer, drained the GPU three to nine
    times. Here each part is queued (:meth:`add`) and :meth:`read` copies them all at once."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> int:
        """Queue ``t`` (any shape; read flattened); returns its index in :meth:`read`."""
        self._parts.append(t.reshape(-1))
        return len(self._parts) - 1

    def _one_transfer(self) -> bool:
        """Whether :meth:`read` gathers the parts into one copy (device tensors)."""
        return self._parts[0].device.type != "cpu"

    def read(self) -> list[list[Any]]:
        """Every queued part as a list, in the order added: on a GPU one device-to-host copy
        (as float64: exact for token ids and float32 values); on the CPU, where a read is no
        sync, each part as it is."""
        import torch

        parts = self._parts
        if not parts:
            return []
        if not self._one_transfer():
            return [t.tolist() for t in parts]
        flat = torch.cat([t.double() for t in parts]).tolist()
        out, at = [], 0
        for t in parts:
            n = t.numel()
            out.append(flat[at:at + n])
            at += n
        return out


def raw_logprobs(logits: torch.Tensor, tokens: Sequence[int]) -> list[float]:
    """log_softmax(logits)[r, tokens[r]] for each row: the model's own log-probability."""
    import torch

    idx = torch.tensor(list(tokens), device=logits.device, dtype=torch.long)
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, idx[:, None])[:, 0].tolist()


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[V]`` after temperature, min-p, top-k and top-p for one row (sum to
    1): :func:`filtered_probs_rows` of that row alone."""
    return filtered_probs_rows(logits[None], [params])[0]


def filtered_probs_rows(logits: torch.Tensor, params: Sequence[SamplingParams]
                        ) -> torch.Tensor:
    """Probabilities ``[R, V]`` of ``[R, V]`` logits, row r under ``params[r]``: temperature,
    then min-p, top-k and top-p, each on the rows that ask for it, in whole-batch tensor ops
    (no per-row Python work but building the per-row knobs, no host read of the device)."""
    import torch

    vocab = logits.shape[-1]
    ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    tops = [p.top_p if p.top_p < 1.0 else math.inf for p in params]
    # every row's knobs in one host-to-device copy (each copy of a host list is a stream sync
    # on CUDA): temperature, min-p, top-k (0: all), top-p cut (inf: none)
    knobs = to_device([(p.temperature, p.min_p, k, t) for p, k, t in zip(params, ks, tops)],
                      logits.device, torch.float32)
    x = logits.float() / knobs[:, 0:1]
    if any(p.min_p for p in params):
        p0 = torch.softmax(x, dim=-1)
        x = x.masked_fill(p0 < knobs[:, 1:2] * p0.amax(dim=-1, keepdim=True), float("-inf"))
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values                       # [R, kmax]
        k = knobs[:, 2:3].long()
        kth = top.gather(1, (k - 1).clamp_(min=0))
        kth = kth.masked_fill(k == 0, float("-inf"))                       # k = 0: keep all
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(t < math.inf for t in tops):
        cut = knobs[:, 3:4]
        kept = _nucleus(probs, cut)
        renorm = kept / kept.sum(dim=-1, keepdim=True)
        probs = torch.where(cut < math.inf, renorm, probs)   # rows without top_p untouched
    return probs


#: Candidates the CPU's top-p takes first (``torch.topk``): a nucleus inside them needs no sort
#: of the whole vocabulary.
TOP_P_CANDIDATES = 256


def _nucleus(probs: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """``probs`` ``[R, V]`` with every token dropped (0) that the tokens more likely than it
    already reach ``cut`` ``[R, 1]`` with; the top token always stays. Not renormalized.

    Why two ways: sorting a 49,152-token row costs ~3 ms on one CPU core, a fifth of a
    one-thread decode step of the embedded model, for every sampled sequence with top-p; the
    nucleus of a peaked distribution lies within its few hundred most likely tokens, which
    ``topk(TOP_P_CANDIDATES)`` finds far faster (``radixkv bench sampling``). On the CPU the
    rows whose candidates already reach ``cut`` take that path (the same kept set: every
    token past the candidates comes after a prefix that reached ``cut``); the others, and
    every row on a GPU (where reading the check back would be a device sync, and the sort is
    cheap), sort the whole row."""
    import torch

    def by_sort(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        sorted_p, order = p.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= c
        return p.scatter(1, order, sorted_p.masked_fill(drop, 0.0))

    if probs.device.type != "cpu" or probs.shape[-1] <= 4 * TOP_P_CANDIDATES:
        return by_sort(probs, cut)
    vals, idx = probs.topk(TOP_P_CANDIDATES, dim=-1)              # sorted, descending
    csum = vals.cumsum(-1)
    # nucleus within the candidates (rows without top-p: the caller keeps their probs as they are)
    inside = (csum[:, -1:] >= cut)[:, 0] | torch.isinf(cut[:, 0])
    kept = torch.zeros_like(probs).scatter_(
        1, idx, vals.masked_fill((csum - vals) >= cut, 0.0))
    if not bool(inside.all()):
        rest = (~inside).nonzero()[:, 0]
        kept[rest] = by_sort(probs[rest], cut[rest])
    return kept


def draw_tokens(probs: torch.Tensor, generators: Sequence[torch.Generator | None]
                ) -> torch.Tensor:
    """One token per row of ``[R, V]`` probabilities, row r drawn with ``generators[r]`` (the
    sequence's own: a seeded request gets the same tokens whatever shares its batch), as a
    device tensor ``[R]``: the caller reads every row's token in one transfer, not one
    ``.item()`` (a device sync on CUDA) per sequence.

    The draw is an exponential race: ``argmax_v probs[v] / E_v`` with ``E_v ~ Exp(1)`` picks
    ``v`` with probability ``probs[v]`` (vLLM's and FlashInfer's sampler), and needs only one
    elementwise noise fill per row, no per-row ``multinomial``. ``E`` is kept >= the smallest
    normal float so a zero draw cannot turn ``0 / 0`` into a NaN that argmax would pick.
    """
    import torch

    noise = torch.empty_like(probs, dtype=torch.float32)
    for r, g in enumerate(generators):
        noise[r].exponential_(generator=g)
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs.float() / noise).argmax(dim=-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw from ``filtered_probs`` with the sequence's own generator (one row of
    :func:`draw_tokens`; the engine draws a step's rows together)."""
    return int(draw_tokens(filtered_probs(logits, params)[None], [generator])[0])


def _pairs(rows: Sequence[int], ids: Sequence[Sequence[int]], vocab: int, device: Any
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct ``(row, token)`` pairs of ``ids[k]`` under ``rows[k]``, and how often each
    occurs: ``(rows, tokens, counts)`` as 1-D tensors. One ``unique`` over ``row * V + token``:
    work in proportion to the tokens, not to the vocabulary."""
    import torch

    lengths = torch.tensor([len(x) for x in ids], dtype=torch.long)
    toks = torch.tensor([t for x in ids for t in x], dtype=torch.long)
    owner = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    keys, counts = torch.unique(owner * vocab + toks, return_counts=True)
    if device.type != "cpu":   # queued, not a stream sync (see to_device)
        keys = keys.pin_memory().to(device, non_blocking=True)
        counts = counts.pin_memory().to(device, non_blocking=True)
    return keys // vocab, keys % vocab, counts


def adjust_logits(logits: torch.Tensor,
                  rows: Sequence[tuple[int, SamplingParams, Sequence[int]]],
                  prompts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """A copy of ``[R, V]`` logits with each listed row's penalties and ``logit_bias`` applied.

    ``rows``: ``(row, params, output token ids of that row's sequence)``; ``prompts``: each
    row's prompt ids (for ``repetition_penalty``, which also counts the prompt). In vLLM's
    order: the biases, the repetition penalty on every token seen (a positive logit divided,
    the others multiplied), then ``logit[j] -= f * c[j] + p * (c[j] > 0)`` over the generated
    tokens. Vectorized over the batch and sparse: each step is one ``unique`` of the
    ``(row, token)`` pairs and one gather or ``index_put`` over them, so its cost follows the
    tokens involved, never ``rows x vocabulary``; no Python loop over tokens.
    """
    import torch

    out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
    dev, vocab = out.device, out.shape[-1]
    bias = [(r, t, b) for r, p, _ in rows for t, b in p.logit_bias if t < vocab]
    if bias:
        r_i, t_i, b_v = zip(*bias)
        out.index_put_((to_device(r_i, dev, torch.long), to_device(t_i, dev, torch.long)),
                       to_device(b_v, dev, out.dtype), accumulate=True)
    rep = [(k, r, p) for k, (r, p, _) in enumerate(rows) if p.repetition_penalty != 1.0]
    if rep:
        seen = [list(prompts[k] if prompts is not None else ()) + list(rows[k][2])
                for k, _, _ in rep]
        factor = torch.ones(out.shape[0], device=dev)
        factor[to_device([r for _, r, _ in rep], dev, torch.long)] = to_device(
            [p.repetition_penalty for _, _, p in rep], dev, torch.float32)
        r_u, t_u, _ = _pairs([r for _, r, _ in rep], seen, vocab, dev)
        x, f = out[r_u, t_u], factor[r_u]
        out[r_u, t_u] = torch.where(x > 0, x / f, x * f)
    pen = [(r, p, ids) for r, p, ids in rows
           if (p.frequency_penalty or p.presence_penalty) and ids]
    if pen:
        freq = torch.zeros(out.shape[0], device=dev)
        pres = torch.zeros(out.shape[0], device=dev)
        idx = [r for r, _, _ in pen]
        rows_t = to_device(idx, dev, torch.long)
        freq[rows_t] = to_device([p.frequency_penalty for _, p, _ in pen], dev, torch.float32)
        pres[rows_t] = to_device([p.presence_penalty for _, p, _ in pen], dev, torch.float32)
        r_u, t_u, c_u = _pairs(idx, [ids for _, _, ids in pen], vocab, dev)
        out[r_u, t_u] = out[r_u, t_u] - (freq[r_u] * c_u + pres[r_u])   # distinct pairs
    return out


def choice_logits(logits: torch.Tensor, items: Sequence[tuple[int, Any, Any]],
                  eos: Collection[int] = ()) -> torch.Tensor:
    """The logits tokens are chosen from when some rows adjust them: ``items`` are ``(row,
    request, sequence)`` of those rows. Penalties and biases (:func:`adjust_logits`), the
    ``min_tokens`` mask (:func:`mask_min_tokens`; ``eos``: the model's end-of-sequence ids),
    ``allowed_token_ids`` (:func:`keep_only`), ``bad_words`` (:func:`banned_next`), each
    grammar's mask (``-inf`` for tokens it forbids), then the close marker a spent thinking
    budget forces (``engine/thinking_budget.py``). The raw ``logits`` are left as they are:
    reported log-probabilities stay the model's own."""
    import torch

    out = adjust_logits(logits, [(r, req.params, seq.output_token_ids)
                                 for r, req, seq in items],
                        [seq.token_ids[:seq.prompt_len] for _, _, seq in items])
    mask_min_tokens(out, [(r, req.params, len(seq.token_ids) - seq.prompt_len)
                          for r, req, seq in items], eos)
    allowed = [(r, req.params.allowed_token_ids) for r, req, _ in items
               if req.params.allowed_token_ids is not None]
    if allowed:
        keep_only(out, allowed)
    banned = [(r, t) for r, req, seq in items if req.bad_words_ids
              for t in banned_next(req.bad_words_ids, seq.output_token_ids)]
    if banned:
        r_i, t_i = zip(*banned)
        dev = out.device
        out.index_put_((to_device(r_i, dev, torch.long), to_device(t_i, dev, torch.long)),
                       torch.tensor(float("-inf"), device=dev, dtype=out.dtype))
    masked = [(r, req, seq) for r, req, seq in items if req.params.grammar is not None]
    if masked:
        from radixkv.engine import grammar

        grammar.mask_rows(out, [(r, grammar.matcher_for(req, seq)) for r, req, seq in masked])
    budgeted = [it for it in items if it[1].params.thinking_token_budget is not None]
    if budgeted:   # last: a forced token overrides every other mask of its row
        from radixkv.engine import thinking_budget

        forced = thinking_budget.forced_rows(budgeted)
        if forced:
            force_tokens(out, forced)
    return out


def force_tokens(logits: torch.Tensor, rows: Sequence[tuple[int, int]]) -> None:
    """In place: each row ``r`` of ``rows`` allows only its token (``-inf`` elsewhere, 0 on
    it), whatever masks the row had."""
    import torch

    dev = logits.device
    r_i = to_device([r for r, _ in rows], dev, torch.long)
    logits[r_i] = float("-inf")
    logits[r_i, to_device([t for _, t in rows], dev, torch.long)] = 0.0


def keep_only(logits: torch.Tensor, rows: Sequence[tuple[int, Sequence[int]]]) -> None:
    """In place: ``-inf`` for every token of row ``r`` but ``ids``, per ``(r, ids)``
    (``allowed_token_ids``): one boolean mask over those rows."""
    import torch

    dev, vocab = logits.device, logits.shape[-1]
    pairs = [(k, t) for k, (_, ids) in enumerate(rows) for t in ids if t < vocab]
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
    if pairs:
        k_i, t_i = zip(*pairs)
        keep[to_device(k_i, dev, torch.long), to_device(t_i, dev, torch.long)] = True
    idx = to_device([r for r, _ in rows], dev, torch.long)
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))


def banned_next(bad_words_ids: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """The tokens ``bad_words`` forbid next after ``output`` (the tokens generated so far): the
    last token of each bad word whose other tokens end the output (vLLM's rule)."""
    out = []
    n = len(output)
    for word in bad_words_ids:
        k = len(word) - 1
        if k == 0 or (k <= n and list(output[n - k:]) == list(word[:k])):
            out.append(word[-1])
    return out


def mask_min_tokens(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, int]],
                    eos: Collection[int]) -> None:
    """In place: ``-inf`` for the tokens that would end a sequence (``eos`` unless
    ``ignore_eos``, and ``stop_token_ids``) in the rows ``(row, params, tokens generated)``
    that have generated fewer than their ``min_tokens``: one ``index_put_`` for the batch."""
    import torch

    vocab = logits.shape[-1]
    pairs = [(r, t) for r, p, done in rows if done < p.min_tokens
             for t in {*p.stop_token_ids, *(() if p.ignore_eos else eos)} if t < vocab]
    if pairs:
        r_i, t_i = zip(*pairs)
        dev = logits.device
        logits.index_put_((to_device(r_i, dev, torch.long), to_device(t_i, dev, torch.long)),
                          torch.tensor(float("-inf"), device=dev, dtype=logits.dtype))


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The model's end-of-sequence token ids (generation config, then model config, then the
    tokenizer); empty if none is known."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else [int(e) for e in eos])


__all__ = ["MAX_LOGPROBS", "SamplingParams", "StepReads", "adjust_logits", "choice_logits",
           "banned_next", "eos_token_ids", "keep_only", "mask_min_tokens", "make_generator",
           "greedy_tokens",
           "raw_logprobs", "filtered_probs", "filtered_probs_rows", "draw_tokens",
           "sample_token", "to_device"]
