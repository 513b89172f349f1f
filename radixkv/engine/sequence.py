"""Per-request state: a ``Request`` (what the caller asked) holding live ``Sequence`` objects.

A request starts with one sequence (its prompt). ``n`` samples fork it into n sequences after
the prompt's forward; beam search keeps ``beam_width`` live beams, forking survivors and freeing
losers each step. The scheduler moves whole requests between *waiting* and *running*: every live
sequence of a request is scheduled, preempted and resumed together (beams must step in lockstep).

A sequence's tokens are ``prompt + output``. Relative to the block manager a live sequence is in
one of three states (the scheduler brings it to the last one every step):

    not allocated        new, or preempted (recompute: all its tokens are re-prefilled, mostly
                         served from the prefix cache)
    one token pending    the last sampled token has no KV slot yet (``append_slot`` gives one)
    synced               the manager holds every token; KV of [num_computed, len) is to compute

Pure Python (no torch): the scheduler imports this module.
"""

from __future__ import annotations

import enum
import time
from typing import Any

from radixkv.core.hashing import Namespace
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One output stream: a sample of ``n``, a beam, or the prompt before it forks.

    ``seq_id`` is the block manager's id (unique for the engine's lifetime, never reused).
    """

    __slots__ = ("seq_id", "index", "prompt_len", "token_ids", "cumulative_logprob",
                 "finish_reason", "stop_reason", "detok", "generator", "sent_text_len",
                 "sent_num_tokens", "logprobs")

    def __init__(self, seq_id: int, index: int, token_ids: list[int], prompt_len: int,
                 detok: IncrementalDetokenizer, generator: Any = None) -> None:
        self.seq_id = seq_id
        self.index = index                    # output index (sample number)
        self.prompt_len = prompt_len
        self.token_ids = token_ids            # prompt + output
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.detok = detok
        self.generator = generator            # torch.Generator for seeded sampling, or None
        self.sent_text_len = 0                # streaming: text already returned in a delta
        self.sent_num_tokens = 0              # streaming: output tokens already returned
        self.logprobs: list[Any] | None = None  # TokenLogprob per output token, when asked

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, index={self.index}, len={len(self.token_ids)}, "
                f"out={self.num_output_tokens}, finish={self.finish_reason})")


class Request:
    """A caller's request and its live and finished sequences.

    Attributes:
        seqs: live sequences, in a stable order (beam search: HF's running-beam order).
        done: finished sequences (samples that stopped; for beams, unused).
        num_cached_tokens / cached_tokens_per_tier: prompt tokens served from the cache at the
            first admission (resumptions after preemption are not counted again).
        beam: the beam-search state (``radixkv.engine.beam_search.BeamSearch``) or None.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 namespace: Namespace, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        #: the copy of the prompt its ``RequestOutput`` s share (made at the first one)
        self.output_prompt_ids: list[int] | None = None
        self.params = params
        self.namespace = namespace
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        #: when the scheduler first admitted it (its time waiting is this minus arrival)
        self.scheduled_time: float | None = None
        self.status = RequestStatus.WAITING
        self.seqs: list[Sequence] = []
        self.done: list[Sequence] = []
        self.admitted = False
        self.num_cached_tokens = 0
        self.cached_tokens_per_tier: tuple[int, ...] = ()
        self.remote_tokens = 0   # of the cached tokens, those the remote tier supplied
        self.cache_points: tuple[Any, ...] = ()   # CachePoints applied once prefilled
        self.session: str | int | None = None     # eviction hints: the client's session id,
        self.end_session = False                  # and whether this is its last request
        self.policy_started = False   # its first allocation told the policy (a turn)
        self.cache_write_tokens = 0   # prompt tokens its prefill added to the cache
        self.num_preemptions = 0
        #: scheduling priority under ``scheduling_policy="priority"`` (lower: sooner; vLLM's)
        self.priority = 0
        self.beam: Any = None
        self.finished_outputs_sent = False
        # response_format: each sequence's grammar matcher by output index (engine/grammar.py)
        self.grammar_state: dict[int, Any] = {}
        #: ``params.thinking_token_budget``: each sequence's scan by output index
        #: (engine/thinking_budget.py)
        self.thinking_state: dict[int, Any] = {}
        #: the seed its samples draw from (``params.seed``, or one from ``EngineConfig.seed``)
        self.seed: int | None = params.seed
        #: ``params.bad_words`` as token sequences (``LLMEngine.add_request`` sets them)
        self.bad_words_ids: tuple[tuple[int, ...], ...] = ()
        #: with ``params.prompt_logprobs``: entry i is prompt token i's ``TokenLogprob`` (None
        #: for token 0), appended in order as the prompt's chunks are computed; else None
        self.prompt_logprobs: list[Any] | None = (
            [None] if params.prompt_logprobs is not None else None)

    def policy_hints(self) -> dict[str, Any]:
        """The eviction policy's hints for allocating one of its sequences: the session, whether
        it is the session's last request, and whether the policy was told of it already (a
        resumption is not a new turn)."""
        return {"session": self.session, "end_session": self.end_session,
                "resumed": self.policy_started}

    @property
    def num_seq_slots(self) -> int:
        """Live sequences this request may hold at once (for ``max_num_seqs``)."""
        return self.params.num_seqs

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, live={len(self.seqs)}, "
                f"done={len(self.done)})")


__all__ = ["Request", "RequestStatus", "Sequence"]


def check_session(session: Any, end_session: Any) -> None:
    """Validate a request's session hints, raising ``InvalidRequestError``: a session id is an
    int or a str of 1 to 256 characters (or None), ``end_session`` a bool (with no session, it
    says the request is a session of its own that ends with it)."""
    from radixkv.errors import InvalidRequestError

    if session is not None:
        if isinstance(session, bool) or not isinstance(session, (str, int)):
            raise InvalidRequestError(
                f"session must be a str or int id, got {type(session).__name__}")
        if isinstance(session, str) and not 0 < len(session) <= 256:
            raise InvalidRequestError(
                f"a session id has 1 to 256 characters, got {len(session)}")
    if type(end_session) is not bool:
        raise InvalidRequestError(f"end_session must be a bool, got {end_session!r}")
