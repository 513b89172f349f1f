"""What the HTTP layer needs from whatever computes: one seam for the single server and the fleet.

The routes in :mod:`radixkv.server.app` are written once against :class:`Backend`. The single
server (``radixkv serve``) uses :class:`LocalBackend`, an :class:`radixkv.Engine` in this
process; the fleet (:mod:`radixkv.fleet`) implements the same protocol over Ray Serve replicas.
So both answer with the same routes, fields and errors, and a fix in one is a fix in both.

A backend owns tokenization (the chat template, encode/decode: they run in the HTTP process so
that a fleet's router can hash a request's blocks before choosing a replica), the model's limits,
request streams, and the engine statistics that ``/metrics`` renders.
"""

from __future__ import annotations

import abc
import sys
from types import MappingProxyType
from collections.abc import Mapping, Sequence
from typing import Any


class RequestHandle(abc.ABC):
    """One submitted request's outputs, consumed by one reader on the event loop."""

    #: ``perf_counter`` when the request was submitted (the engine's TTFT is measured from it).
    submitted: float

    @abc.abstractmethod
    async def aget(self) -> Any:
        """The next ``RequestOutput`` (its last one has ``finished``). Raises the request's
        error, e.g. :class:`radixkv.server.errors.APIError` when the replica serving it died."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop the request (fire and forget; called when the client is gone)."""

    @property
    @abc.abstractmethod
    def prefilling(self) -> bool:
        """True until the request produced its first token or ended: its prompt counts in the
        server's prefill backlog (``--max-num-queued-tokens``) while this holds. Read on the
        event loop; cheap."""


class Backend(abc.ABC):
    """The compute behind the routes. Attributes are read-only facts of the served model."""

    model_id: str
    vocab_size: int
    max_model_len: int
    #: Tier names of ``RequestOutput.cached_tokens_per_tier`` (e.g. device, host, disk, remote).
    output_tier_names: Sequence[str]
    #: Requests one engine runs at once (admission holds this many plus ``--max-queued``).
    max_num_seqs: int
    #: Tokens per KV block (chat ``documents`` are padded to whole blocks).
    block_size: int
    #: Sampling defaults from the model's generation config for what a request leaves unset
    #: (``radixkv.models.generation_defaults``; empty with ``--generation-config vllm``).
    sampling_defaults: Mapping[str, Any] = MappingProxyType({})
    #: The model's end-of-sequence token ids (a grammar allows them once its value is done).
    eos_token_ids: frozenset[int] = frozenset()
    #: The engines' ``EngineConfig.scheduling_policy`` (a request's non-zero ``priority`` is
    #: a 400 unless it is ``"priority"``).
    scheduling_policy: str = "lpm"

    @property
    @abc.abstractmethod
    def chat_template(self) -> Any:
        """The model's :class:`radixkv.api.chat.ChatTemplate`."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @abc.abstractmethod
    async def open(self, request_id: str, prompt_ids: list[int], params: Any,
                   cache_salt: str | None, cache_points: Any = None,
                   restartable: bool = False, **hints: Any) -> RequestHandle:
        """Submit one validated request; its outputs come from the returned handle.
        ``restartable``: nothing of it reaches the client before it finishes (a non-streamed
        answer), so a backend may run it again from the start after a failure. ``hints``:
        the eviction hints ``session``/``end_session`` (a backend may ignore them)."""

    @abc.abstractmethod
    async def snapshots(self) -> list[tuple[Mapping[str, str], Mapping[str, Any]]]:
        """Engine statistics for ``/metrics``: ``(extra labels, engine.stats())`` per engine
        (one with no labels for the single server; one per replica, labelled, for a fleet)."""

    async def reset_prefix_cache(self) -> int:
        """Drop every cached block no running request holds; how many went. A backend that
        cannot answers a 400."""
        from radixkv.server.errors import APIError

        raise APIError(400, "/reset_prefix_cache is not supported by this server's backend "
                       "(--replicas) yet", code="unsupported_parameter")

    def abort_open(self, error: Any) -> int:
        """End every request this backend has open with ``error`` (an ``APIError``) and stop
        its work: a draining server's last step once its ``--shutdown-timeout`` is spent
        (:meth:`radixkv.server.app.ServerState.drain`). Returns how many. Default: none (the
        single server's uvicorn cancels its handlers itself)."""
        return 0

    def health(self) -> str | None:
        """None when the backend serves, else why not (``/health`` and ``/ping`` answer 503
        with it). Default: healthy (a fleet's replicas have Serve's own health checks)."""
        return None

    def close(self) -> None:
        """Release what the backend holds (at server shutdown)."""


class _LocalHandle(RequestHandle):
    def __init__(self, loop: Any, stream: Any, request_id: str) -> None:
        self._loop, self._stream, self._rid = loop, stream, request_id
        self.submitted = stream.submitted

    @property
    def prefilling(self) -> bool:
        # the engine's own record (a non-streamed request's outputs stay in the engine until
        # it ends, so the handler cannot see its first token)
        return bool(self._loop.core.is_prefilling(self._rid))

    async def aget(self) -> Any:
        return await self._stream.aget()

    def abort(self) -> None:
        self._loop.call_future(self._loop.abort_op(self._rid))


#: Seconds a server's engine loop thread stays parked without work before it exits (the
#: library's default is 2 s, so that an idle ``Engine`` holds no thread). A request that finds
#: no thread starts one first: 0.26 ms at p50 and 4.4 ms at p90 on the loaded 2-core box
#: against 0.03 / 0.16 ms for a parked one, and a chat whose user thinks for more than 2 s
#: (13% of turns at a 1 s mean) would pay it on its time to first token.
SERVER_LOOP_IDLE_S = 600.0


class LocalBackend(Backend):
    """An :class:`radixkv.Engine` in this process, stepped by its loop thread (handlers never
    step it: they submit to the loop and await outputs)."""

    def __init__(self, engine: Any, kv_events: Any = None) -> None:
        """``kv_events``: a started publisher of the engine's KV events (``close()``d after
        the engine, so it sends the last events first), e.g. ``ZmqEventPublisher``."""
        self.engine = engine
        self.kv_events = kv_events
        engine.loop.idle_exit_s = max(engine.loop.idle_exit_s, SERVER_LOOP_IDLE_S)
        # /metrics' radixkv_kv_blocks_{stored,removed}_total: a KV-event reader on the loop
        engine.loop.call(engine.core.count_kv_events)
        core = engine.core
        self.model_id = engine.model_id
        self.vocab_size = core.vocab_size
        self.max_model_len = core.max_model_len
        self.output_tier_names = core.output_tier_names
        self.max_num_seqs = engine.engine_config.max_num_seqs
        self.block_size = engine.cache_config.block_size   # server-placed RAG documents pad to it
        self.eos_token_ids = core.eos_token_ids
        self.scheduling_policy = engine.engine_config.scheduling_policy

    @property
    def chat_template(self) -> Any:
        return self.engine.chat_template

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.engine.encode(text)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self.engine.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    async def open(self, request_id: str, prompt_ids: list[int], params: Any,
                   cache_salt: str | None, cache_points: Any = None,
                   restartable: bool = False, **hints: Any) -> RequestHandle:
        loop = self.engine.loop
        stream = await loop.acall(loop.add_request(request_id, prompt_ids, params, cache_salt,
                                                   cache_points, **hints))
        return _LocalHandle(loop, stream, request_id)

    async def snapshots(self) -> list[tuple[Mapping[str, str], Mapping[str, Any]]]:
        loop = self.engine.loop
        return [({}, await loop.acall(self.engine.core.stats))]

    def health(self) -> str | None:
        why: str | None = self.engine.loop.health()
        return why

    async def reset_prefix_cache(self) -> int:
        loop = self.engine.loop
        return int(await loop.acall(self.engine.core.reset_prefix_cache))

    def close(self) -> None:
        """Stop the engine; with a remote tier, first write what it caches that the server
        lacks (``--shutdown-flush`` bounds it), and say how much went."""
        report = self.engine.close()
        if report is not None:
            print(f"radixkv serve: shutdown: wrote {report['written']} cached blocks to the "
                  f"remote tier in {report['seconds']:.2f} s ({report['present']} there "
                  f"already, {report['left']} not reached in time)", file=sys.stderr,
                  flush=True)
        if self.kv_events is not None:
            self.kv_events.close()


__all__ = ["Backend", "LocalBackend", "RequestHandle"]
