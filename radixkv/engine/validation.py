"""Validation of ``LLMEngine.add_request``: every check runs before anything changes, so a bad
request raises a typed error and leaves the engine (and requests in flight) untouched."""

from __future__ import annotations

from collections.abc import Mapping, Sequence as Seq
from typing import Any

from radixkv.engine.sampling import SamplingParams
from radixkv.errors import EngineClosedError, InvalidRequestError


def check_request(engine: Any, request_id: Any, prompt: Any, params: Any, salt: Any
                  ) -> SamplingParams:
    """Validate one ``add_request`` call against ``engine`` (an ``LLMEngine``) without
    changing anything; returns the request's ``SamplingParams``. Raises the typed errors the
API documents (``InvalidRequestError``, ``EngineClosedError``)."""
    if engine.closed:
        raise EngineClosedError("the engine is closed; build a new one")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
    if engine.has_request(request_id):
        raise InvalidRequestError(f"request {request_id!r} is already in flight")
    if params is None:
        params = SamplingParams()
    elif isinstance(params, Mapping):
        params = SamplingParams.from_dict(params)
    elif not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"params must be SamplingParams or a dict, got {type(params).__name__}")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError(f"cache_salt must be a string or None, got {type(salt).__name__}")
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Seq):
        raise InvalidRequestError("prompt_token_ids must be a list of token ids "
                                  f"(tokenize text first), got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise InvalidRequestError("the prompt is empty: give at least one token")
    bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)
                or not 0 <= t < engine.vocab_size), None)
    if bad is not None or any(isinstance(t, bool) for t in prompt):
        raise InvalidRequestError(f"token id {bad!r} is not in [0, {engine.vocab_size})")
    if len(prompt) >= engine.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; the model's context is {engine.max_model_len} "
            "tokens and at least one must be left to generate")
    bm = engine.block_manager
    blocks = -(-len(prompt) // bm.block_size)
    if blocks > bm.pool.num_blocks:
        raise InvalidRequestError(
            f"the prompt needs {blocks} KV blocks; the device pool has "
            f"{bm.pool.num_blocks}: raise CacheConfig.num_device_blocks/device_memory")
    if params.num_seqs > engine.engine_config.max_num_seqs:
        raise InvalidRequestError(
            f"n/beam_width {params.num_seqs} exceeds EngineConfig.max_num_seqs "
            f"{engine.engine_config.max_num_seqs}")
    if (params.stop or params.stop_after) and engine.tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; this engine has none")
    if params.bad_words and engine.tokenizer is None:
        raise InvalidRequestError("bad_words need a tokenizer; this engine has none")
    for name in ("allowed_token_ids", "logprob_token_ids"):
        ids = getattr(params, name)
        bad = next((t for t in ids if t >= engine.vocab_size), None) if ids else None
        if bad is not None:
            raise InvalidRequestError(f"{name}: {bad} is not in [0, {engine.vocab_size})")
    return params


def bad_words_ids(tokenizer: Any, words: Seq[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences that ``bad_words`` forbid, by vLLM's rule: each word (leading
    whitespace stripped) as it tokenizes at the start of a text, and with a leading space when
    that gives a different first token and as many tokens (a word in mid-text). Raises
    ``InvalidRequestError`` for a word that tokenizes to nothing."""
    out: list[tuple[int, ...]] = []
    for word in dict.fromkeys(words):
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidRequestError(f"bad word {word!r} tokenizes to nothing")
        out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


#: the range of a request's scheduling ``priority`` (a signed 64-bit int, as vLLM's protocol)
PRIORITY_RANGE = (-(2 ** 63), 2 ** 63 - 1)


def check_priority(priority: Any, policy: str) -> int:
    """A request's scheduling ``priority`` (``LLMEngine.add_request``), or
    ``InvalidRequestError``: an int in :data:`PRIORITY_RANGE`; non-zero only under the
    ``"priority"`` scheduling policy, where it orders the queue (under the others it would
    be silently ignored, so it is refused, as vLLM documents)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority must be an int, got {type(priority).__name__}")
    lo, hi = PRIORITY_RANGE
    if not lo <= priority <= hi:
        raise InvalidRequestError(f"priority must be a 64-bit signed int, got {priority}")
    if priority and policy != "priority":
        raise InvalidRequestError(
            f"priority {priority} needs priority scheduling (EngineConfig.scheduling_policy="
            f"'priority', radixkv serve --scheduling-policy priority); this engine schedules "
            f"by {policy!r}")
    return priority


__all__ = ["PRIORITY_RANGE", "bad_words_ids", "check_priority", "check_request"]
