"""The fleet's HTTP front: the single server's app over a backend that calls replicas.

:class:`FleetIngress` is a Ray Serve ingress deployment whose ASGI app is
:func:`radixkv.server.app.create_app` (the same routes, fields and errors as ``radixkv serve``)
built over :class:`FleetBackend`. The backend tokenizes here, hashes the prompt's blocks in the
engines' namespace (so the router can match them against what each replica caches) and streams
each request from the engine deployment through a Serve handle whose router is
:class:`~radixkv.fleet.router.KVAwareRouter` (or Serve's default, for comparison).

Failure: a request whose replica dies is sent again to another replica (the router no longer
offers the dead one; the prompt is recomputed, or read from the shared remote tier) when nothing
of it has reached the client: a non-streamed request always, a streamed one until its first
token. A stream that already sent tokens ends with an ``error`` event (503 ``replica_failed``):
tokens delivered cannot be taken back, and a second sample would not continue them. Attempts are
bounded by :data:`FAILOVER_ATTEMPTS`; past them the answer is the same 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from radixkv.engine.grammar import DEFAULT_MAX_WHITESPACE
from radixkv.server.backend import Backend, RequestHandle
from radixkv.server.errors import APIError

log = logging.getLogger("radixkv.fleet")

#: Times one request is sent again after its replica died before answering.
FAILOVER_ATTEMPTS = 2
#: How long the fleet's /reset_prefix_cache waits for every replica to answer (they see a
#: reset within a publish period, <= ~1 s).
RESET_TIMEOUT_S = 30.0


def _replica_failures() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the replica is gone", as Ray raises them to a caller."""
    import ray.exceptions as rex

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
             "NodeDiedError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


def _own_serve_request_context() -> None:
    """Give the calling task's Ray Serve request context an internal request id of its own.

    Ray Serve copies the ingress request's context into every handle call made while serving
    it, internal id included, and its request router indexes the calls it is routing by that
    id (``_pending_requests_by_id``, ray 2.60): two concurrent calls from one HTTP request (the
    conversations of a batched chat, the prompts of a multi-prompt completion) share it, the
    second is taken for a retry of the first and is never assigned a replica, so the HTTP
    request hangs. Each request's pump runs in its own task (its own copy of the context), so
    the fresh id is that call's alone; the user-visible ``request_id`` (Serve's logs) stays.
    Ray's cancel-with-parent bookkeeping, keyed by the same id, is not needed here: the server
    aborts each request itself when its client goes away (:func:`serving.stream`)."""
    import dataclasses
    import uuid

    try:
        from ray.serve import context as serve_context
    except ImportError:   # another Ray: its own behaviour
        return
    current = serve_context._serve_request_context.get()
    if current is not None and hasattr(current, "_internal_request_id"):
        serve_context._serve_request_context.set(dataclasses.replace(
            current, _internal_request_id=str(uuid.uuid4())))


class _FleetHandle(RequestHandle):
    """Pumps one request's stream from a replica into a queue; fails over while nothing was
    delivered."""

    def __init__(self, backend: FleetBackend, args: tuple, route: dict[str, Any],
                 restartable: bool) -> None:
        self.submitted = time.perf_counter()
        self._backend, self._args, self._route = backend, args, route
        self._restartable = restartable
        self._queue: asyncio.Queue = asyncio.Queue()
        self._delivered = False   # an output came back (the replica is past the prompt)
        self._task = asyncio.get_running_loop().create_task(self._pump())
        backend.open_handles.add(self)

    async def _pump(self) -> None:
        failures = _replica_failures()
        handle = self._backend.handle.options(stream=True)
        delivered = False
        for attempt in range(FAILOVER_ATTEMPTS + 1):
            _own_serve_request_context()   # (before each call: a retry is a new call too)
            try:
                gen = handle.generate.remote(*self._args, route=self._route)
                async for out in gen:
                    delivered = self._delivered = True
                    self._queue.put_nowait(out)
                return
            except asyncio.CancelledError:
                raise
            except failures as exc:
                self._backend.failovers += 1
                if (delivered and not self._restartable) or attempt == FAILOVER_ATTEMPTS:
                    log.warning("radixkv fleet: request %s lost its replica (%s)",
                                self._args[0], type(exc).__name__)
                    self._queue.put_nowait(APIError(
                        503, "the replica serving this request failed"
                        + (" after it had sent tokens" if delivered else "") + "; retry it",
                        code="replica_failed"))
                    return
                log.warning("radixkv fleet: replica failed before answering %s (%s); routing "
                            "it again", self._args[0], type(exc).__name__)
            except Exception as exc:  # noqa: BLE001 (any engine error goes to the caller, as in one server)
                self._queue.put_nowait(exc)
                return

    @property
    def prefilling(self) -> bool:
        # until the replica's first output: a non-streamed request's only output is its
        # last, so it counts until it ends (as conservative as vLLM's own count)
        return not self._delivered and not self._task.done()

    async def aget(self) -> Any:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        self._task.cancel()   # cancels the replica's generator: it aborts the request

    def end(self, error: APIError) -> bool:
        """Abort the request and hand ``error`` to its reader (a drain's end); False when it
        had already finished."""
        if self._task.done():
            return False
        self._task.cancel()
        self._queue.put_nowait(error)
        return True


class FleetBackend(Backend):
    """:class:`~radixkv.server.backend.Backend` over the engine deployment's handle."""

    def __init__(self, handle: Any, tokenizer: Any, info: Mapping[str, Any], bus: Any) -> None:
        from radixkv.core.hashing import Namespace

        self.handle, self.tokenizer, self.bus = handle, tokenizer, bus
        self.model_id = info["model_id"]
        self.vocab_size = info["vocab_size"]
        self.max_model_len = info["max_model_len"]
        self.output_tier_names = list(info["output_tier_names"])
        self.max_num_seqs = info["max_num_seqs"] * max(1, info.get("num_replicas", 1))
        self.block_size = info["block_size"]
        self.hash_prefixes = bool(info.get("prefix_caching", True))
        self.eos_token_ids = frozenset(info.get("eos_token_ids", ()))
        self.scheduling_policy = info.get("scheduling_policy", "lpm")
        self._namespace = Namespace(info["namespace_model"])
        self._template: Any = None
        self.failovers = 0
        #: requests whose reader still holds them (a drain ends those left at its deadline)
        self.open_handles: weakref.WeakSet[_FleetHandle] = weakref.WeakSet()

    def abort_open(self, error: Any) -> int:
        return sum(h.end(error) for h in list(self.open_handles))

    @property
    def chat_template(self) -> Any:
        if self._template is None:
            from radixkv.api.chat import ChatTemplate

            self._template = ChatTemplate(self.tokenizer)
        return self._template

    def encode(self, text: str) -> list[int]:
        from radixkv.api.engine import encode_text

        return encode_text(self.tokenizer, text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def block_hashes(self, prompt_ids: Sequence[int], cache_salt: str | None) -> list[bytes]:
        """The chain hashes the engines give this prompt's full blocks."""
        from radixkv.core.hashing import hash_token_blocks

        if not self.hash_prefixes:
            return []
        return hash_token_blocks(prompt_ids, self.block_size,
                                 self._namespace.with_salt(cache_salt))

    def document_hashes(self, prompt_ids: Sequence[int], spans: Sequence[Any],
                        cache_salt: str | None) -> tuple[list[tuple[int, Sequence[bytes]]], int]:
        """Per document (its first token's position): the chain hashes of its entry's full
        blocks, its lead's included, as the replicas' blends name them
        (:mod:`radixkv.engine.blend`: lead + document tokens in the document namespace); and
        the lead's length in blocks. Raises ``InvalidRequestError`` for spans the engine
        would refuse (before the request is routed)."""
        from radixkv.core.hashing import hash_token_blocks
        from radixkv.engine.blend import check_spans, document_namespace, entry_lead

        docs = check_spans(spans, len(prompt_ids))
        if not self.hash_prefixes:
            return [], 0
        lead = entry_lead(docs, self.block_size)
        ns = document_namespace(self._namespace.with_salt(cache_salt))
        head = list(prompt_ids[:lead])
        return [(d.start, hash_token_blocks(head + list(prompt_ids[d.start:d.end]),
                                            self.block_size, ns)) for d in docs], \
            lead // self.block_size

    async def open(self, request_id: str, prompt_ids: list[int], params: Any,
                   cache_salt: str | None, cache_points: Any = None,
                   restartable: bool = False, **hints: Any) -> RequestHandle:
        # ``hints`` (session, end_session; a RAG request's documents and blend_ratio) go to the
        # replica's engine; the router routes by cached blocks: the prompt's prefix and, for
        # documents, their entries (radixkv.fleet.router)
        route: dict[str, Any] = {"hashes": self.block_hashes(prompt_ids, cache_salt)}
        if hints.get("documents"):
            route["documents"], route["lead_blocks"] = self.document_hashes(
                prompt_ids, hints["documents"], cache_salt)
        return _FleetHandle(self, (request_id, prompt_ids, params, cache_salt, cache_points,
                                   hints), route, restartable)

    async def reset_prefix_cache(self) -> int:
        """Every replica drops its unheld cached blocks: a new reset epoch on the bus, which
        each replica sees within a publish (<= ~1 s) and answers; waits for every replica that
        reports (``RESET_TIMEOUT_S``). Returns the blocks dropped in all; a 503 naming the
        replicas that did not answer in time."""
        import asyncio
        import time

        from radixkv.server.errors import APIError

        if self.bus is None:
            return await super().reset_prefix_cache()
        epoch, expected = await self.bus.request_reset.remote()
        deadline = time.monotonic() + RESET_TIMEOUT_S
        while True:
            done = await self.bus.reset_report.remote(epoch)
            missing = [r for r in expected if r not in done]
            if not missing:
                return sum(done.values())
            if time.monotonic() > deadline:
                raise APIError(503, f"replicas {', '.join(missing)} did not reset their prefix "
                               f"cache within {RESET_TIMEOUT_S:.0f} s (the others did)",
                               code="reset_incomplete")
            await asyncio.sleep(0.05)

    async def snapshots(self) -> list[tuple[Mapping[str, str], Mapping[str, Any]]]:
        if self.bus is None:
            return []
        stats = await self.bus.replica_stats.remote()
        return [({"replica": r}, st) for r, st in sorted(stats.items())]


class FleetIngress:
    """The ingress deployment's class: builds the app once the engines answer (Serve calls
    ``__serve_build_asgi_app__`` after the constructor, and awaits it)."""

    def __init__(self, engines: Any, options: dict[str, Any]) -> None:
        self._engines, self._options = engines, options
        self._app: Any = None

    async def drain(self, timeout_s: float) -> dict[str, int]:
        """The fleet's graceful shutdown, called by ``radixkv serve --replicas`` at SIGTERM
        before Serve stops the deployments: refuse new requests (503), let those in flight
        finish for up to ``timeout_s`` (``--shutdown-timeout``), then end the rest with a 503
        (their replicas abort them). The replicas are idle after it, so Serve's own drain of
        them is immediate and each one's remote-tier flush runs within its budget."""
        if self._app is None:
            return {"finished_sequences": 0, "aborted_requests": 0}
        return dict(await self._app.state.drain(timeout_s))

    async def __serve_build_asgi_app__(self) -> Any:
        import ray

        from radixkv.fleet.router import RouterStats
        from radixkv.models import tokenizer_of
        from radixkv.server import conversations as cv
        from radixkv.server.app import create_app
        from radixkv.server.frontend import FrontendOptions

        o = self._options
        frontend = FrontendOptions(**(o.get("frontend") or {}))
        if frontend.log_requests:   # this actor's stderr: Ray's worker log
            from radixkv.server import request_log

            request_log.install(debug=False)
        info = dict(await self._engines.info.remote())
        info["num_replicas"] = o.get("num_replicas", 1)
        tokenizer = await asyncio.to_thread(tokenizer_of, o.get("model"), o.get("gguf_file"),
                                            o.get("tokenizer"))
        bus = ray.get_actor(o["bus_name"], namespace=o["bus_namespace"]) \
            if o.get("bus_name") else None
        backend = FleetBackend(self._engines, tokenizer, info, bus)
        from radixkv.models import (generation_defaults, generation_defaults_in,
                                    parse_generation_overrides)

        defaults = {}   # as the single server's
        source = o.get("generation_config", "auto")
        if source == "auto":
            defaults = await asyncio.to_thread(generation_defaults, o.get("model"),
                                               o.get("gguf_file"))
        elif source != "vllm":   # a folder of its own
            defaults = await asyncio.to_thread(generation_defaults_in, source)
        defaults.update(parse_generation_overrides(o.get("override_generation_config")))
        backend.sampling_defaults = defaults
        self.backend = backend

        async def extra() -> bytes:
            text = b""
            if bus is not None and o.get("router") == "kv":
                text = RouterStats.total(await bus.router_reports.remote()).prometheus()
            return text + (
                "# HELP radixkv_fleet_failovers Requests sent again after their replica died.\n"
                "# TYPE radixkv_fleet_failovers counter\n"
                f"radixkv_fleet_failovers_total {backend.failovers}\n").encode()

        self._app = create_app(
            backend, model_name=o.get("model_name") or info["model_id"],
            api_keys=o.get("api_keys") or [], max_queued=o.get("max_queued", 256),
            default_max_tokens=o.get("default_max_tokens"),
            salt_secret=o.get("salt_secret"), extra_metrics=extra,
            reasoning_parser=o.get("reasoning_parser"),
            max_logprobs=o.get("max_logprobs", 20),
            cache_reset=o.get("cache_reset", False),
            stream_interval=o.get("stream_interval", 1),
            responses_store_size=o.get("responses_store_size", 1024),
            max_conversation_bytes=o.get("max_conversation_bytes") or cv.DEFAULT_MAX_BYTES,
            frontend=frontend,
            json_max_whitespace=o.get("json_max_whitespace", DEFAULT_MAX_WHITESPACE),
            freeze_heap=True)   # the ingress replica's own process
        return self._app


__all__ = ["FleetBackend", "FleetIngress", "FAILOVER_ATTEMPTS"]
