"""From an OpenAI request to engine requests and back: prompts, sampling, outputs, usage.

One code path serves both endpoints and both modes: :func:`run` submits a request to the engine
loop and yields its ``RequestOutput`` snapshots as they come; the endpoint turns them into one
JSON body or into Server-Sent Events (``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``, exactly
what OpenAI's clients parse). A request that ends early (client gone, task cancelled) is aborted
in ``run``'s ``finally``, which frees its blocks.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.api.metrics import TIER_NAMES
from radixkv.engine.sampling import OUTPUT_FINAL_ONLY
from radixkv.server.errors import APIError
from radixkv.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                     usable_request_id)

# Seeds: sample i of n uses seed + i (radixkv.engine.sampling); keep the sum inside torch's range.
MAX_SEED = 2**63 - 1 - 256


@dataclass
class Timing:
    """Per-request clock readings (``perf_counter`` seconds) for metrics and usage."""

    arrived: float
    submitted: float = 0.0
    first_token: float | None = None
    #: When the engine loop produced the first token (``perf_counter``, same process): the gap
    #: to ``first_token`` is the hand-over from the loop thread to this event loop.
    engine_first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    #: The engine's last output (``finished``) reached the handler (of a request's prompts:
    #: one of them; a streamed request has one).
    finished: bool = False
    #: A prompt of the request was aborted before it finished.
    aborted: bool = False
    #: The W3C trace context the HTTP request carried (``--otlp-traces-endpoint``; else None).
    trace_headers: dict[str, str] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def response_ids(prefix: str, header: str | None, field: str | None = None
                 ) -> tuple[str, str]:
    """``(the response's id, the engine's request id)`` of a completion.

    vLLM names a response after the request's ``X-Request-Id`` (``chatcmpl-<header>``), else
    after the body's ``request_id`` (``field``), so a proxy's trace id finds its answer in the
    client's logs; radixkv does too. An id names a response only when it is short and
    printable ASCII (``protocol.MAX_REQUEST_ID_CHARS``; a trace id: W3C's ``traceparent`` is 55
    characters): a longer or stranger header is still echoed by
    ``--enable-request-id-headers`` but the response keeps an id of its own, so that no header
    puts kilobytes or control characters into every streamed chunk (such a ``request_id``
    field is a 400: the body's validation). The engine's id stays unique (the name plus a
    random suffix), since two requests may carry the same one (a retry, a client that sets a
    constant one) and the engine refuses an id in flight. Without a usable name both are one
    new id."""
    name = header if usable_request_id(header) else field
    if usable_request_id(name):
        rid = f"{prefix}-{name}"
        return rid, f"{rid}-{uuid.uuid4().hex[:8]}"
    rid = new_id(prefix)
    return rid, rid


def request_salt(req: Any) -> str | None:
    """The request's own namespace narrowing: vLLM's ``cache_salt``, OpenAI's
    ``prompt_cache_key``, or both."""
    parts = [p for p in (req.cache_salt, req.prompt_cache_key) if p]
    return "|".join(parts) or None


def sampling_params(req: ChatCompletionRequest | CompletionRequest, prompt_len: int,
                    max_model_len: int, default_max_tokens: int | None,
                    vocab_size: int | None = None, grammar: Any = None,
                    defaults: Mapping[str, Any] | None = None, max_logprobs: int = 20,
                    thinking: Any = None) -> Any:
    """The engine's ``SamplingParams`` for a request whose prompt has ``prompt_len`` tokens
    (``grammar``: the compiled ``response_format``, or None). ``defaults``: the model's
    generation config (``radixkv.models.generation_defaults``) for the fields the request leaves
    unset (not for beam search, which is deterministic). ``max_logprobs``: the server's cap
    on alternatives a token (``--max-logprobs``). ``thinking``: where a chat reply's thinking
    opens and closes (:func:`thinking_marks` of ``--reasoning-parser``), for
    ``thinking_token_budget``. Raises :class:`APIError` (400) naming the field for anything
    the engine cannot honour."""
    from radixkv.engine.sampling import SamplingParams

    d = {} if req.use_beam_search or defaults is None else defaults

    def pick(value: Any, name: str, fallback: Any) -> Any:
        return value if value is not None else d.get(name, fallback)

    if prompt_len >= max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; "
                       f"the prompt has {prompt_len} tokens (at least one must be left to "
                       "generate)", param="messages" if isinstance(req, ChatCompletionRequest)
                       else "prompt", code="context_length_exceeded")
    room = max_model_len - prompt_len
    if echo_only(req):   # the prompt alone is answered; the engine still picks one token
        if req.stream:
            raise APIError(400, "max_tokens 0 (the echoed prompt alone) is answered in one "
                           "body: do not stream it", param="max_tokens")
        asked: int | None = 1
    else:
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) \
        else "max_tokens"
    if asked is not None and asked > room:
        raise APIError(400, f"{param}={asked} is past the context: this model's maximum context "
                       f"length is {max_model_len} tokens and the prompt has {prompt_len}, so "
                       f"at most {room} can be generated", param=param,
                       code="context_length_exceeded")
    max_tokens = asked if asked is not None else min(
        room, default_max_tokens or d.get("max_tokens") or room)
    top_logprobs = logprobs_asked(req)
    for name, k in (("top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs",
                     top_logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if k is not None and k > max_logprobs:
            raise APIError(400, f"{name}={k} is more than this server's --max-logprobs "
                           f"{max_logprobs}", param=name)
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise APIError(400, f"seed must be in [0, {MAX_SEED}], got {req.seed}", param="seed")
    temperature = pick(req.temperature, "temperature", 1.0)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kwargs: dict[str, Any] = dict(
        max_tokens=max_tokens, top_p=pick(req.top_p, "top_p", 1.0),
        min_p=pick(req.min_p, "min_p", 0.0),
        top_k=max(0, pick(req.top_k, "top_k", 0)), seed=req.seed, stop=tuple(stop), n=req.n,
        ignore_eos=req.ignore_eos, logprobs=top_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0, grammar=grammar,
        repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
        stop_token_ids=tuple(req.stop_token_ids or ()))
    _check_token_ids(kwargs["stop_token_ids"], "stop_token_ids", vocab_size)
    if req.allowed_token_ids is not None:
        _check_token_ids(req.allowed_token_ids, "allowed_token_ids", vocab_size)
        kwargs["allowed_token_ids"] = tuple(req.allowed_token_ids)
    if req.logprob_token_ids is not None:   # vLLM's: these tokens' logprobs, every step
        if top_logprobs:
            raise APIError(400, "logprob_token_ids lists those tokens' log-probabilities "
                           "instead of the most likely ones: not with top_logprobs / logprobs "
                           "> 0", param="logprob_token_ids")
        _check_token_ids(req.logprob_token_ids, "logprob_token_ids", vocab_size)
        kwargs["logprob_token_ids"] = tuple(req.logprob_token_ids)
        kwargs["logprobs"] = 0
    if req.bad_words:
        if not all(w.strip() for w in req.bad_words):
            raise APIError(400, "bad_words must be non-blank strings", param="bad_words")
        kwargs["bad_words"] = tuple(req.bad_words)
    if req.logit_bias:
        bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        over = [t for t in bias if vocab_size is not None and t >= vocab_size]
        if over:
            raise APIError(400, f"logit_bias names token {over[0]}, outside the vocabulary "
                           f"[0, {vocab_size})", param="logit_bias")
        kwargs["logit_bias"] = bias
    if grammar is not None and req.ignore_eos:
        raise APIError(400, "ignore_eos would run past the end of the constrained output "
                       "(response_format, structured_outputs, tool_choice)", param="ignore_eos")
    plp = req.prompt_logprobs
    if plp is None and getattr(req, "echo", False):
        plp = top_logprobs   # echo with logprobs: the prompt's, as vLLM
    if plp is not None:
        param = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        for bad, why in ((req.stream, "stream"), (req.use_beam_search, "use_beam_search"),
                         (getattr(req, "documents", None) is not None, "documents")):
            if bad:
                raise APIError(400, f"prompt logprobs are not available with {why}",
                               param=param)
        kwargs["prompt_logprobs"] = plp
    if req.min_tokens:
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens={req.min_tokens} is more than the {max_tokens} "
                           "tokens this request may generate", param="min_tokens")
        if grammar is not None or req.use_beam_search:
            raise APIError(400, "min_tokens is not supported with "
                           + ("use_beam_search" if req.use_beam_search else
                              "a constrained output (response_format, structured_outputs, "
                              "tool_choice: its value may end before)"),
                           param="min_tokens")
        kwargs["min_tokens"] = req.min_tokens
    if req.thinking_token_budget is not None:
        if thinking is None:
            raise APIError(400, "thinking_token_budget needs a server started with "
                           "--reasoning-parser (it is what says where the thinking ends) and a "
                           "reply that can think: a chat (deepseek_r1, or qwen3 where <think> "
                           "is one token), or a completion whose prompt ends inside <think> "
                           "(or, where <think> is one token, whose reply may open it)",
                           param="thinking_token_budget")
        if req.use_beam_search:
            raise APIError(400, "thinking_token_budget is not available with use_beam_search",
                           param="thinking_token_budget")
        kwargs.update(thinking_token_budget=req.thinking_token_budget, thinking=thinking)
    if req.use_beam_search:
        for name in ("frequency_penalty", "presence_penalty", "logit_bias",
                     "repetition_penalty"):
            value = getattr(req, name)
            if value and not (name == "repetition_penalty" and value == 1.0):
                raise APIError(400, f"{name} is not available with use_beam_search",
                               param=name)
        constraint = req.output_constraint()   # response_format, structured_outputs, ...
        if constraint is not None:
            raise APIError(400, f"{constraint[0]} is not available with use_beam_search",
                           param=constraint[0])
        if top_logprobs is not None:
            raise APIError(400, "logprobs are not available with use_beam_search (beams are "
                           "re-ranked at the end)", param="logprobs")
        if temperature != 0:
            raise APIError(400, "use_beam_search is deterministic: set temperature to 0",
                           param="temperature")
        kwargs.update(temperature=0.0, beam_width=max(req.n, req.best_of or req.n),
                      length_penalty=req.length_penalty)
    else:
        if temperature < 1e-5 and temperature != 0:   # below fp32's useful range: greedy
            temperature = 0.0
        kwargs.update(temperature=temperature)
    return SamplingParams(**kwargs)


def truncate(req: Any, prompts: list[list[int]], max_model_len: int) -> list[list[int]]:
    """``truncate_prompt_tokens``: each prompt's last k tokens, or its first k with vLLM's
    ``truncation_side: "right"`` (-1: as many as fit beside the request's ``max_tokens``, or
    one token to generate). Refused (400) where token positions
    were computed for the whole prompt: cache breakpoints, retention, documents."""
    k = getattr(req, "truncate_prompt_tokens", None)
    if k is None:
        return prompts
    right = getattr(req, "truncation_side", None) == "right"   # vLLM's: keep the first k
    marks = any(getattr(m, "cache_control", None) for m in getattr(req, "messages", None) or ())
    for bad, name in ((marks, "cache_control"),
                      (req.prompt_cache_retention, "prompt_cache_retention"),
                      (getattr(req, "documents", None), "documents")):
        if bad:
            raise APIError(400, f"truncate_prompt_tokens is not supported with {name} (their "
                           "positions are in the whole prompt)", param="truncate_prompt_tokens")
    if k == -1:
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens or 1
        k = max(1, max_model_len - asked)
    return [ids[:k] if right else ids[-k:] for ids in prompts]


@functools.lru_cache(maxsize=8)
def thinking_marks(tokenizer: Any, parser: str) -> Any:
    """Where a reply's thinking ends, for a grammar that shapes only the answer
    (``engine.grammar.Thinking``), by ``--reasoning-parser``'s rule: ``deepseek_r1`` thinks
    from the first token to the tokens of ``</think>``; ``qwen3`` thinks if the first token is
    ``<think>``, which must then be one token (Qwen3's is): otherwise None, and the grammar
    applies from the first token."""
    from radixkv.engine.grammar import Thinking
    from radixkv.server.reasoning import THINK_CLOSE, THINK_OPEN

    close = tuple(tokenizer.encode(THINK_CLOSE, add_special_tokens=False))
    if not close:
        return None
    if parser == "deepseek_r1":
        return Thinking(None, close, True)
    opening = tokenizer.encode(THINK_OPEN, add_special_tokens=False)
    return Thinking(opening[0], close, False) if len(opening) == 1 else None


def completion_thinking(tokenizer: Any, parser: str, prompt_ids: Sequence[int]) -> Any:
    """Where a completion's thinking ends (``engine.grammar.Thinking``), for a thinking budget:
    read from the prompt, as vLLM's budget reads it. A prompt that ends inside a thinking
    section (its last ``<think>`` after its last ``</think>``, as text, whichever parser) makes
    the reply think from its first token; otherwise the reply thinks only if its first token
    is ``<think>``, which must then be one token (else None: nothing to budget)."""
    from radixkv.engine.grammar import Thinking
    from radixkv.server.reasoning import THINK_CLOSE, THINK_OPEN

    close = tuple(tokenizer.encode(THINK_CLOSE, add_special_tokens=False))
    if not close or parser not in ("deepseek_r1", "qwen3"):
        return None
    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
    if text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE):
        return Thinking(None, close, True)
    opening = tokenizer.encode(THINK_OPEN, add_special_tokens=False)
    return Thinking(opening[0], close, False) if len(opening) == 1 else None


def chat_echo(req: Any, messages: Sequence[Any]) -> str | None:
    """vLLM's chat ``echo``: the text a reply starts with, the last message's, when the reply
    continues that message's role (the assistant's with ``add_generation_prompt``, any with
    it off, as in ``continue_final_message``); else None."""
    if not req.echo or not messages:
        return None
    last = messages[-1]
    if req.add_generation_prompt and last["role"] != "assistant":
        return None
    content = last.get("content")
    return content if isinstance(content, str) else ""


def chat_role(req: Any, messages: Sequence[Any], response_role: str = "assistant") -> str:
    """The role of a chat reply, as vLLM names it: ``response_role`` (``--response-role``,
    default ``assistant``) in a new turn (``add_generation_prompt``, the default), else the
    last message's role, the one the reply continues."""
    if req.add_generation_prompt or not messages:
        return response_role
    return str(messages[-1]["role"])


def echo_only(req: Any) -> bool:
    """A completions request that wants its prompt back and nothing generated (``echo`` with
    ``max_tokens`` 0, lm-evaluation-harness's way to read prompt logprobs)."""
    return bool(getattr(req, "echo", False)) and req.max_tokens == 0


def _check_token_ids(ids: Sequence[int], param: str, vocab_size: int | None) -> None:
    """A 400 naming ``param`` for the first token id outside the vocabulary (when known)."""
    bad = next((t for t in ids if vocab_size is not None and not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{param}: {bad} is not in [0, {vocab_size})", param=param)


def logprobs_asked(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives per token the request wants (None = no logprobs), by OpenAI's
    rules: chat has ``logprobs: bool`` + ``top_logprobs: 0..20``, completions ``logprobs: int``.
    Raises :class:`APIError` (400) for a combination OpenAI also refuses."""
    from radixkv.engine.sampling import MAX_LOGPROBS

    if isinstance(req, ChatCompletionRequest):
        if req.logprobs is not None and not isinstance(req.logprobs, bool):
            raise APIError(400, "logprobs must be a boolean in chat completions (the number "
                           "of alternatives goes in top_logprobs)", param="logprobs")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.logprobs is None or req.logprobs is False:
        return None
    if isinstance(req.logprobs, bool) or not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be an int in [0, {MAX_LOGPROBS}] in completions",
                       param="logprobs")
    return req.logprobs


#: ``prompt_cache_retention`` -> the TTL of a cache point at the end of the prompt (OpenAI:
#: in-memory retention keeps a prefix for minutes of inactivity, "24h" for up to a day).
RETENTION_TTL_S = {"in_memory": 600.0, "24h": 86400.0}
#: ... and whether the point persists the prompt to the remote tier: extended retention is the
#: one that outlives this replica's memory (OpenAI offloads it from GPU memory to storage).
RETENTION_PERSIST = {"in_memory": False, "24h": True}


def retention_point(position: int, retention: str) -> Any:
    """The cache point of ``prompt_cache_retention`` for a prompt of ``position`` tokens."""
    from radixkv.engine.cache_points import CachePoint

    return CachePoint(position, ttl=RETENTION_TTL_S[retention],
                      persist=RETENTION_PERSIST[retention])


def cache_points(template: Any, messages: list[dict[str, str]], marks: list[Any],
                 prompt_len: int, retention: str | None,
                 template_kwargs: dict[str, Any] | None = None) -> list[Any]:
    """Cache points of a chat request: one at the end of each message that carries
    ``cache_control`` (its token position in the rendered conversation, TTL from the mark,
    default 5 minutes as Anthropic's), and one at the end of the prompt for
    ``prompt_cache_retention``. ``template_kwargs``: the request's ``chat_template_kwargs``
    (the conversation is rendered as the prompt was)."""
    from radixkv.engine.cache_points import CachePoint

    points = []
    for k, mark in enumerate(marks):
        if mark is not None:
            pos = len(template.encode(template.render(messages[:k + 1], False,
                                                      **(template_kwargs or {}))))
            points.append(CachePoint(max(1, min(pos, prompt_len)), ttl=mark.ttl or "5m"))
    if retention is not None:
        points.append(retention_point(prompt_len, retention))
    return points


def max_token_chars(backend: Any) -> int:
    """Characters of the longest token in the backend's vocabulary (special tokens included).
    A text of ``c`` characters then has at least ``c / max_token_chars`` tokens, whatever the
    tokenizer does; see :func:`check_text`."""
    tok = backend.chat_template.tokenizer
    return max((len(t) for t in tok.get_vocab()), default=1) or 1


def check_text(backend: Any, texts: Sequence[str], param: str, token_chars: int) -> None:
    """Refuse, before any tokenization, prompt text that no tokenizer could take or that cannot
    fit the context. Linear in the text's length.

    * A lone surrogate (``"\\ud800"`` in JSON) is not Unicode text: 400 naming ``param``.
    * ``context_length_exceeded`` when the text is so long that even if every token were the
      vocabulary's longest (``token_chars`` characters), and Unicode normalisation halved it,
      it would still have ``max_model_len`` tokens or more: a 10 MiB body is refused in
      milliseconds instead of being tokenized for seconds first.
    """
    chars = 0
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise APIError(400, f"the text in {param} is not valid Unicode ({exc.reason} at "
                           f"position {exc.start}); decode input bytes with errors='replace'",
                           param=param, code="invalid_text") from None
        chars += len(text)
    at_least = chars // (2 * token_chars)
    limit = backend.max_model_len
    if at_least >= limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; the "
                       f"text in {param} has {chars} characters, at least {at_least} tokens",
                       param=param, code="context_length_exceeded")


def chat_logprobs(decode: Any, items: Sequence[Any] | None) -> dict[str, Any] | None:
    """OpenAI's chat ``choice.logprobs`` for ``TokenLogprob`` items (None when not asked)."""
    if items is None:
        return None

    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = decode(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top]} for t in items],
            "refusal": None}


def completion_logprobs(decode: Any, items: Sequence[Any] | None, offset: int,
                        ids: Sequence[int] | None = None, label: Any = None
                        ) -> dict[str, Any] | None:
    """OpenAI's legacy completions ``choice.logprobs`` (token strings, their logprobs, the top
    alternatives as ``{token: logprob}``, and each token's character offset from ``offset``).
    ``ids``: the token of each item, for items that may be None (an echoed prompt's first
    token, which has no logprob: OpenAI's ``null``). ``label``: how a token is named (default
    its text; :func:`token_id_label` for vLLM's ``return_tokens_as_token_ids``); offsets count
    the text either way."""
    if items is None:
        return None
    label = decode if label is None else label
    tokens, offsets = [], []
    for i, t in enumerate(items):
        offsets.append(offset)
        tid = t.token_id if ids is None else ids[i]
        tokens.append(label(tid))
        offset += len(decode(tid))
    return {"tokens": tokens,
            "token_logprobs": [None if t is None else t.logprob for t in items],
            "top_logprobs": [None if t is None else {label(i): v for i, v in t.top}
                             for t in items],
            "text_offset": offsets}


def token_id_label(tid: int) -> str:
    """vLLM's ``return_tokens_as_token_ids``: a token named ``token_id:N`` (RL pipelines map
    logprobs back to ids without re-tokenizing, and a token that is not valid UTF-8 alone
    still has a name)."""
    return f"token_id:{tid}"


def vllm_prompt_logprobs(decode: Any, items: Sequence[Any]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` field: per prompt token (None for the first) ``{token id:
    {"logprob", "rank", "decoded_token"}}`` for the token itself and its top alternatives
    (ranked 1, 2, ...)."""
    out: list[dict[str, Any] | None] = []
    for t in items:
        if t is None:
            out.append(None)
            continue
        d = {str(i): {"logprob": v, "rank": r + 1, "decoded_token": decode(i)}
             for r, (i, v) in enumerate(t.top)}
        d[str(t.token_id)] = {"logprob": t.logprob, "rank": t.rank,
                              "decoded_token": decode(t.token_id)}
        out.append(d)
    return out


class Coalescer:
    """vLLM's ``stream_interval``: a streamed choice's engine outputs joined so that each
    chunk carries ``interval`` tokens (its first token and its last chunk go at once). Each
    output passes through :meth:`take`, which returns ``None`` while it holds it, or an output
    whose ``delta_text``, ``delta_logprobs`` and ``delta_token_ids`` are everything held for
    that choice. Fewer chunks, so less JSON, fewer writes and fewer event-loop wake-ups per
    token for a client that does not need every token at once."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: dict[int, tuple[str, list[Any] | None, list[int]]] = {}
        self._sent: set[int] = set()

    def take(self, c: Any) -> Any:
        if self.interval <= 1:
            return c
        text, lps, ids = self._held.pop(c.index, ("", None, []))
        text += c.delta_text or ""
        if c.delta_logprobs is not None:
            lps = [*(lps or ()), *c.delta_logprobs]
        ids = [*ids, *c.delta_token_ids]
        if c.index in self._sent and not c.finish_reason and len(ids) < self.interval:
            self._held[c.index] = (text, lps, ids)
            return None
        self._sent.add(c.index)
        return _Joined(c.index, c.finish_reason, text, lps, ids, c.text, c.token_ids,
                       getattr(c, "stop_reason", None))


@dataclass
class _Joined:
    """A choice's outputs joined by :class:`Coalescer` (the fields the stream reads)."""

    index: int
    finish_reason: str | None
    delta_text: str
    delta_logprobs: list[Any] | None
    delta_token_ids: list[int]
    text: str
    token_ids: Any
    stop_reason: str | int | None = None


#: vLLM's header for a request's scheduling priority; it overrides the body's ``priority``
PRIORITY_HEADER = "x-vllm-priority"


def priority_hint(req: Any, header: str | None, policy: str) -> dict[str, Any]:
    """The request's scheduling priority for the engine (``{"priority": p}``, {} for 0): the
    ``X-Vllm-Priority`` header if it is an int (vLLM ignores one that is not, and so do we),
    else the body's ``priority``. Non-zero needs ``--scheduling-policy priority``: a 400
    naming ``priority`` otherwise, before anything is queued (vLLM documents the same)."""
    p = req.priority
    if header is not None:
        try:
            p = int(header.strip())
        except ValueError:
            pass
        if not -(2 ** 63) <= p < 2 ** 63:
            raise APIError(400, f"the {PRIORITY_HEADER} header must be a 64-bit signed int, "
                           f"got {header!r:.40}", param="priority")
    if not p:
        return {}
    if policy != "priority":
        raise APIError(400, f"priority {p} needs a server started with --scheduling-policy "
                       f"priority (this one schedules by {policy!r})", param="priority")
    return {"priority": p}


def session_hints(req: Any) -> dict[str, Any]:
    """The request's eviction hints for the engine (``session``/``end_session``), {} if none."""
    hints = blend_hints(req)
    if req.session_id is None and not req.end_session:
        return hints
    return {"session": req.session_id, "end_session": req.end_session, **hints}


def blend_hints(req: Any) -> dict[str, Any]:
    """A request's RAG documents (their token spans) and blend ratio for the engine
    (docs/rag.md), {} if none. Document texts (chat, a text prompt) have been placed or found
    by the endpoint, which recorded their spans (``place_documents``)."""
    docs = getattr(req, "document_spans", None)
    if docs is None:
        docs = getattr(req, "documents", None)
        if docs and isinstance(docs[0], (str, dict)):
            raise AssertionError("document texts reached the engine without their spans")
    ratio = getattr(req, "blend_ratio", None)
    if docs is None and ratio is None:
        return {}
    return {"documents": [tuple(d) for d in docs] if docs is not None else None,
            "blend_ratio": ratio}


async def submit(state: Any, request_id: str, prompt_ids: list[int], params: Any,
                 cache_salt: str | None, timing: Timing, cache_points: Any = None,
                 hints: dict[str, Any] | None = None, restartable: bool = False,
                 log_id: str | None = None) -> Any:
    """Submit one request to the backend; returns its handle for :func:`run`.

    ``restartable``: nothing of it reaches the client before it finishes (a non-streamed
    answer). A streamed answer submits before its response starts, so the engine computes the
    prompt while the event loop sends the headers and the first (role) chunk. ``log_id``: the
    name the request log gives it (default ``request_id``): the id its response carries,
    where the engine's adds a suffix (:func:`response_ids`)."""
    handle = await state.engine.open(request_id, prompt_ids, params, cache_salt, cache_points,
                                     restartable=restartable, **(hints or {}))
    timing.submitted = time.perf_counter()
    frontend = getattr(state, "frontend", None)
    if frontend is not None and frontend.max_num_queued_tokens is not None:
        state.prefill_tokens[handle] = len(prompt_ids)
    if frontend is not None and frontend.log_requests:   # --enable-log-requests
        from radixkv.server import request_log

        request_log.received(log_id or request_id, prompt_ids, params, frontend.max_log_len,
                             lambda ids: state.engine.decode(ids, skip_special_tokens=False))
    return handle


async def run(state: Any, request_id: str, prompt_ids: list[int], params: Any,
              cache_salt: str | None, timing: Timing, cache_points: Any = None,
              hints: dict[str, Any] | None = None, restartable: bool = False,
              handle: Any = None, log_id: str | None = None) -> AsyncIterator[Any]:
    """Submit one request (unless ``handle``: one :func:`submit` returned) and yield its
    outputs until it finishes. ``log_id``: as :func:`submit`'s.

    Whatever ends the iteration early (the caller stops reading, or its task is cancelled
    because the client went away: ``app._unless_disconnected``) aborts the request; a finished
    request is recorded in the metrics and sets ``timing.finished``.
    """
    stream = handle if handle is not None else await submit(
        state, request_id, prompt_ids, params, cache_salt, timing, cache_points, hints,
        restartable, log_id)
    # A final-only request (a non-streamed answer) gets one output, at the end: its first
    # token's time is the engine's reading (``ttft``), not this handler's, and it has no gaps.
    final_only = getattr(params, "output_kind", None) == OUTPUT_FINAL_ONLY
    finished = False
    try:
        while not finished:
            out = await stream.aget()
            now = time.perf_counter()
            if any(o.delta_token_ids for o in out.outputs):
                ttft = getattr(out, "ttft", None)
                if final_only:   # the earliest first token of the request's prompts
                    first = now if ttft is None else stream.submitted + ttft
                    if timing.first_token is None or first < timing.first_token:
                        timing.first_token = timing.engine_first_token = first
                elif timing.first_token is None:
                    timing.first_token = now
                    if ttft is not None:
                        timing.engine_first_token = stream.submitted + ttft
                elif timing.last_token is not None:
                    timing.gaps.append(now - timing.last_token)
                timing.last_token = now
            finished = bool(out.finished)
            if finished:
                timing.finished = True
                state.observe_finished(out, timing, params)
                tracer = getattr(state, "tracer", None)
                if tracer is not None:   # --otlp-traces-endpoint: this request's span
                    tracer.request(timing.trace_headers, log_id or request_id,
                                   state.model_name, params, out, timing,
                                   state.engine.output_tier_names)
                frontend = getattr(state, "frontend", None)
                if frontend is not None and frontend.log_outputs:   # --enable-log-outputs
                    from radixkv.server import request_log

                    request_log.generated(log_id or request_id, out, frontend.max_log_len)
            yield out
    finally:
        if not finished:   # this prompt's own request (several may share ``timing``)
            timing.aborted = True
            stream.abort()   # fire and forget: the engine drops it between two steps
            state.metrics.success.labels(state.model_name, "abort").inc()


def abort(state: Any, handle: Any, timing: Timing) -> None:
    """Abort a streamed request (one prompt: ``timing`` is its own) unless it finished or was
    aborted already, and count it; for a response whose event generator may never have run."""
    if timing.finished or timing.aborted:
        return
    timing.aborted = True
    handle.abort()
    state.metrics.success.labels(state.model_name, "abort").inc()


def usage(outs: Sequence[Any], timing: Timing,
          tier_names: Sequence[str] = TIER_NAMES) -> dict[str, Any]:
    """OpenAI's usage object plus ``radixkv``: cached tokens per tier (``tier_names``: the
    engine's ``output_tier_names``), TTFT, logprobs."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    per_tier = [0] * len(tier_names)
    for o in outs:
        for t, n in enumerate(o.cached_tokens_per_tier):
            if t < len(per_tier):
                per_tier[t] += n
    engine_ttft = [o.ttft for o in outs if o.ttft is not None]
    server_ttft = (timing.first_token - timing.arrived) if timing.first_token else None
    return {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "radixkv": {
            "cached_tokens_per_tier": dict(zip(tier_names, per_tier)),
            "ttft_s": max(engine_ttft) if engine_ttft else None,
            "server_ttft_s": server_ttft,
            "cache_read_tokens": cached,
            "cache_write_tokens": sum(getattr(o, "cache_write_tokens", 0) for o in outs),
            "queue_and_tokenize_s": timing.submitted - timing.arrived,
            "delivery_s": (timing.first_token - timing.engine_first_token)
            if timing.first_token and timing.engine_first_token else None,
            "cumulative_logprobs": [c.cumulative_logprob for o in outs for c in o.outputs],
            "num_preemptions": sum(o.num_preemptions for o in outs),
        },
    }


def sum_usage(usages: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One usage object for answers served together (the batched chat endpoint): the token
    counts and the cache's per-tier counts added, the TTFT the latest."""
    out: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
                           "prompt_tokens_details": {"cached_tokens": 0}}
    tiers: dict[str, int] = {}
    extra = {"cache_read_tokens": 0, "cache_write_tokens": 0}
    ttfts: list[float] = []
    for u in usages:
        if not u:
            continue
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            out[key] += u.get(key) or 0
        out["prompt_tokens_details"]["cached_tokens"] += (
            (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        ext = u.get("radixkv") or {}
        for tier, n in (ext.get("cached_tokens_per_tier") or {}).items():
            tiers[tier] = tiers.get(tier, 0) + n
        for key in extra:
            extra[key] += ext.get(key) or 0
        if ext.get("ttft_s") is not None:
            ttfts.append(ext["ttft_s"])
    out["radixkv"] = {"cached_tokens_per_tier": tiers, **extra,
                      "ttft_s": max(ttfts) if ttfts else None}
    return out


def document_prompt(backend: Any, req: Any, messages: list[dict[str, Any]] | None = None,
                    text: str | None = None, add_special_tokens: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> Any:
    """The :class:`~radixkv.api.rag.DocumentPrompt` (token ids, exact document spans) of a
    request whose ``documents`` are texts: chat ``messages`` get the documents placed before
    the last user message's text, padded to whole blocks
    (:func:`radixkv.api.rag.chat_document_prompt`); a ``text`` prompt is split where it contains
    them (:func:`radixkv.api.rag.text_document_prompt`). The spans of the documents that have a
    cache entry, at least one full block, are recorded on the request (``place_documents``, read
    by :func:`blend_hints`); a shorter document is computed like the text around it.
    ``template_kwargs``: the chat template's variables (default: the request's
    ``chat_template_kwargs``; with tools, those and ``tools``). A document
    that cannot be placed or found is a 400 naming ``documents``; nothing reaches the
    engine."""
    from radixkv.api.rag import chat_document_prompt, text_document_prompt
    from radixkv.errors import InvalidRequestError

    tpl = backend.chat_template
    try:
        if messages is not None:
            out = chat_document_prompt(
                tpl, messages, req.documents, backend.block_size,
                template_kwargs if template_kwargs is not None
                else getattr(req, "chat_template_kwargs", None))
        else:
            assert text is not None, "document_prompt needs messages or a text"
            out = text_document_prompt(backend.encode if add_special_tokens else tpl.encode,
                                       tpl.encode, text, req.documents)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param="documents", code="invalid_value") from None
    req.place_documents([sp for sp in out.spans if sp[1] - sp[0] >= backend.block_size])
    return out


def document_texts(req: Any) -> list[str]:
    """The texts of a request's ``documents`` (for :func:`check_text`), [] for spans."""
    return [d if isinstance(d, str) else d.get("text", "") + (d.get("title") or "")
            for d in req.documents or () if isinstance(d, (str, dict))]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"

__all__ = ["cache_points", "RETENTION_TTL_S", "sampling_params", "logprobs_asked",
           "chat_logprobs", "completion_logprobs", "run", "submit", "usage", "sse", "SSE_DONE",
           "Timing", "abort",
           "new_id", "request_salt", "check_text", "max_token_chars", "sum_usage"]
