"""One engine replica of the fleet: a Ray Serve deployment around a :class:`radixkv.Engine`.

The replica does what ``radixkv serve`` does below HTTP: it owns an engine and its loop thread
and streams a request's outputs back (``generate``, an async generator Serve streams to the
caller). HTTP, tokenization and validation happen once, in the ingress
(:mod:`radixkv.fleet.ingress`), with the single server's code.

It also publishes, every :data:`~radixkv.fleet.events.PUBLISH_PERIOD_S`, the block hashes that
entered and left its cache, and about once a second its engine stats (for the fleet's
``/metrics``), to the fleet's :class:`~radixkv.fleet.events.KVEventBus`. Its first batch is a
reset: a replica starts with an empty cache (or what its own disk tier restored), whatever an
earlier replica of the same name held.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from radixkv.fleet.events import PUBLISH_PERIOD_S, EventRecorder

log = logging.getLogger("radixkv.fleet")

#: Engine stats are shipped to the bus at most this often (seconds).
STATS_PERIOD_S = 1.0


@dataclass
class ReplicaSpec:
    """What every replica builds: the model and the engine's configs (plain, picklable)."""

    model: str | None = None
    gguf_file: str | None = None
    cache_config: Any = None
    engine_config: Any = None
    threads: int | None = None
    model_impl: str = "auto"
    tokenizer: str | None = None
    bus_name: str = ""
    bus_namespace: str = ""


def replica_cache_config(cc: Any, rank: int) -> Any:
    """The cache config of the replica of ``rank``: its own disk tier directory
    (``<disk_dir>/replica-<rank>``). A disk tier is one process's (its files are exactly its
    tree's disk blocks: a second engine in the directory would remove the first's files); the
    replica that replaces a dead one gets its rank, so it restores what that one wrote."""
    if cc is None or not getattr(cc, "disk_dir", None):
        return cc
    import dataclasses

    return dataclasses.replace(cc, disk_dir=os.path.join(str(cc.disk_dir), f"replica-{rank}"))


def _register_grammars(engine: Any) -> None:
    """Let grammars the ingress compiled (response_format, structured outputs, forced tool
    calls) arrive here: they travel as recipes and are compiled again with this engine's
    tokenizer on the first one (``engine.grammar.register_compiler``)."""
    from radixkv.engine import grammar

    core = engine.core
    grammar.register_compiler(core.vocab_size, lambda: grammar.GrammarCompiler(
        engine.tokenizer, core.vocab_size, core.eos_token_ids or None))


class EngineReplica:
    """The engine deployment's class (Serve instantiates one per replica)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import ray
        from ray import serve

        import radixkv

        if spec.threads:
            import torch

            torch.set_num_threads(spec.threads)
        t0 = time.perf_counter()
        ctx = serve.get_replica_context()
        cache_config = replica_cache_config(spec.cache_config, ctx.rank.rank)
        engine = radixkv.Engine.from_pretrained(spec.model, spec.gguf_file, cache_config,
                                                spec.engine_config, model_impl=spec.model_impl,
                                                tokenizer=spec.tokenizer)
        bus = ray.get_actor(spec.bus_name, namespace=spec.bus_namespace) \
            if spec.bus_name else None
        self._attach(engine, ctx.replica_id.unique_id, bus, time.perf_counter() - t0)
        # this actor's process is the replica: its start-up heap leaves the GC's full passes
        # (radixkv/server/heap.py)
        from radixkv.server.heap import freeze_startup_heap

        frozen, _ = freeze_startup_heap()
        log.info("radixkv replica %s ready in %.1f s (%d objects frozen)", self.replica_id,
                 self.load_s, frozen)

    @classmethod
    def from_engine(cls, engine: Any, replica_id: str, bus: Any = None) -> EngineReplica:
        """A replica around an engine built elsewhere (outside Serve: tests, embedding);
        ``bus``: the fleet's ``KVEventBus`` actor handle, None to publish nothing."""
        self = cls.__new__(cls)
        self._attach(engine, replica_id, bus, 0.0)
        return self

    def _attach(self, engine: Any, replica_id: str, bus: Any, load_s: float) -> None:
        self.engine, self.replica_id, self.load_s = engine, replica_id, load_s
        _register_grammars(engine)
        # the fleet's /metrics radixkv_kv_blocks_{stored,removed}_total, as the server's
        engine.loop.call(engine.core.count_kv_events)
        self._recorder = EventRecorder(engine.core.tree)
        self._bus = bus
        self._stop = threading.Event()
        self._publisher: threading.Thread | None = None
        if bus is not None:
            self._publisher = threading.Thread(target=self._publish_loop,
                                               name="radixkv-kv-events", daemon=True)
            self._publisher.start()

    # ------------------------------------------------------------------ events
    def _publish_loop(self) -> None:
        """Ship events (and now and then stats) to the bus; the first batch resets this
        replica's entry. A failed publish keeps its events for the next one."""
        import ray

        reset, pending_add, pending_rm = True, {}, {}
        next_stats = 0.0
        seen_epoch = None   # the fleet's reset epoch when this replica joined: not for it
        while not self._stop.wait(PUBLISH_PERIOD_S):
            added, removed = self._recorder.drain()
            for h in added:
                if pending_rm.pop(h, None) is None:
                    pending_add[h] = None
            for h in removed:
                if pending_add.pop(h, None) is None:
                    pending_rm[h] = None
            stats = None
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + STATS_PERIOD_S
                stats = self.stats()
            if not (pending_add or pending_rm or reset or stats):
                continue
            try:
                _, epoch = ray.get(self._bus.publish.remote(
                    self.replica_id, list(pending_add), list(pending_rm), reset, stats),
                    timeout=5)
            except Exception as exc:  # noqa: BLE001 (publisher thread must not die: keep batch, retry)
                log.warning("radixkv replica %s: publishing KV events failed (%s)",
                            self.replica_id, exc)
                continue
            reset, pending_add, pending_rm = False, {}, {}
            if seen_epoch is not None and epoch > seen_epoch:
                self._reset_cache(epoch)
            seen_epoch = epoch

    def _reset_cache(self, epoch: int) -> None:
        """The fleet's ``/reset_prefix_cache`` reached this replica (a new reset epoch): drop
        every unheld cached block and report how many to the bus (the removals go out as KV
        events with the next publish, so the routers forget them)."""
        import ray

        try:
            dropped = self.engine.loop.call(self.engine.core.reset_prefix_cache)
            ray.get(self._bus.reset_done.remote(self.replica_id, epoch, dropped), timeout=5)
        except Exception as exc:  # noqa: BLE001 (publisher thread must not die)
            log.warning("radixkv replica %s: prefix cache reset failed (%s)", self.replica_id,
                        exc)

    # ------------------------------------------------------------------ calls
    def info(self) -> dict[str, Any]:
        """Facts the ingress needs to validate and hash requests as this engine does."""
        eng, core = self.engine, self.engine.core
        return {"model_id": eng.model_id, "vocab_size": core.vocab_size,
                "max_model_len": core.max_model_len,
                "output_tier_names": list(core.output_tier_names),
                "max_num_seqs": eng.engine_config.max_num_seqs,
                "block_size": eng.cache_config.block_size,
                "namespace_model": core.namespace.model,
                "prefix_caching": eng.cache_config.enable_prefix_caching,
                "eos_token_ids": sorted(core.eos_token_ids),
                "scheduling_policy": eng.engine_config.scheduling_policy,
                "replica_id": self.replica_id, "pid": os.getpid(), "load_s": self.load_s}

    def stats(self) -> dict[str, Any]:
        st = self.engine.loop.call(self.engine.core.stats)
        st["replica_pid"] = os.getpid()
        return st

    async def generate(self, request_id: str, prompt_ids: list[int], params: Any,
                       cache_salt: str | None, cache_points: Any = None,
                       hints: dict[str, Any] | None = None,
                       route: dict[str, Any] | None = None) -> Any:
        """Stream one request's outputs. ``hints``: the engine's eviction hints (``session``,
        ``end_session``). ``route`` is for the router only. If the caller goes away (Serve
        cancels this generator) the request is aborted in the engine."""
        loop = self.engine.loop
        stream = await loop.acall(loop.add_request(request_id, prompt_ids, params, cache_salt,
                                                   cache_points, **(hints or {})))
        finished = False
        try:
            while not finished:
                out = await stream.aget()
                finished = bool(out.finished)
                yield out
        finally:
            if not finished:
                loop.call_future(loop.abort_op(request_id))

    def close(self) -> dict[str, Any] | None:
        """Shut down gracefully: stop publishing, then close the engine, which first writes
        the cached blocks its remote tier lacks (``CacheConfig.remote_shutdown_flush_s``), so
        the replica that replaces this one finds them. Returns that flush's counts
        (``Engine.close``), None without one. Idempotent."""
        stop = getattr(self, "_stop", None)
        if stop is None:   # __init__ failed before the engine was attached
            return None
        stop.set()
        if self._publisher is not None:
            self._publisher.join(timeout=10)
            self._publisher = None
        report = self.engine.close()
        if report is not None:
            log.info("radixkv replica %s: shutdown: wrote %d cached blocks to the remote tier "
                     "in %.2f s (%d there already, %d not reached in time)", self.replica_id,
                     report["written"], report["seconds"], report["present"], report["left"])
        return report

    def __del__(self) -> None:
        """Ray Serve calls it at a graceful replica shutdown (``graceful_shutdown_timeout_s``
        bounds it; ``deploy.py`` leaves room for the remote flush)."""
        self.close()


__all__ = ["EngineReplica", "ReplicaSpec"]
