"""``radixkv serve --replicas N``: engine replicas on Ray Serve behind one OpenAI endpoint.

The Serve application has two deployments and one actor:

* ``RadixkvEngine`` (:class:`~radixkv.fleet.replica.EngineReplica`), ``N`` replicas, each an
  engine with its own tiers (and, with ``--remote-url``, the shared remote tier);
* ``RadixkvIngress`` (:class:`~radixkv.fleet.ingress.FleetIngress`), the HTTP app of the single
  server over a backend that streams from the engine deployment through a handle routed by
  :class:`~radixkv.fleet.router.KVAwareRouter` (``--router kv``, default) or Serve's default
  power-of-two-choices router (``--router pow2``);
* the :class:`~radixkv.fleet.events.KVEventBus` actor that carries the replicas' KV events to
  the router and their stats to ``/metrics``.

Locally (no ``--ray-address``) a Ray instance is started for the process with ``--ray-cpus``
CPUs and a small object store; with ``--ray-address`` the fleet deploys onto that cluster (how a
user grows to many machines). The command blocks until SIGINT/SIGTERM, then shuts Serve down.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import time
from typing import Any

from radixkv.engine.grammar import DEFAULT_MAX_WHITESPACE

RAY_NAMESPACE = "radixkv"
APP_NAME = "radixkv"
#: A local Ray instance's object store (bytes): outputs are small, weights are loaded per
#: replica from disk, so the store only carries request/response objects.
LOCAL_OBJECT_STORE = 128 * 1024 * 1024


def bus_name(app_name: str = APP_NAME) -> str:
    return f"{app_name}-kv-event-bus"


def graceful_shutdown_s(shutdown_timeout_s: float, cache_config: Any) -> float:
    """Serve's ``graceful_shutdown_timeout_s`` for the engine replicas: the requests'
    ``--shutdown-timeout``, the remote flush's bound (``--shutdown-flush``) and 5 s for the
    rest of the close. Before 2026-12-07 it was the last two only, so a replica Serve stopped
    by itself cut a stream after ~10 s whatever ``--shutdown-timeout`` said."""
    return float(shutdown_timeout_s or 0.0) + 5.0 + float(cache_config.remote_shutdown_flush_s
                                                           or 0.0)


def build_app(*, replicas: int, cache_config: Any, engine_config: Any, model: str | None = None,
              gguf_file: str | None = None, threads: int | None = None, router: str = "kv",
              load_tokens: int | None = None, replica_cpus: float = 1.0,
              model_name: str | None = None, api_keys: list[str] | None = None,
              max_queued: int = 256, default_max_tokens: int | None = None,
              salt_secret: str | None = None, app_name: str = APP_NAME,
              model_impl: str = "auto", reasoning_parser: str | None = None,
              generation_config: str = "auto",
              override_generation_config: str | None = None, max_logprobs: int = 20,
              responses_store_size: int = 1024, cache_reset: bool = False,
              stream_interval: int = 1,
              json_max_whitespace: int | None = DEFAULT_MAX_WHITESPACE,
              max_conversation_bytes: int | None = None,
              frontend: dict[str, Any] | None = None, tokenizer: str | None = None,
              shutdown_timeout_s: float = 0.0) -> Any:
    """The Serve application (``serve.run`` it after :func:`start_bus`). ``frontend``:
    :class:`~radixkv.server.frontend.FrontendOptions` as a dict (``as_dict``), for the
    ingress's app. ``tokenizer``: ``--tokenizer``, for the replicas' engines and the ingress
    (which tokenizes every request) alike."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from radixkv.errors import ConfigError
    from radixkv.fleet.ingress import FleetIngress
    from radixkv.fleet.replica import EngineReplica, ReplicaSpec
    from radixkv.fleet.router import LOAD_TOKENS, KVAwareRouter

    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    if router not in ("kv", "pow2"):
        raise ConfigError(f"--router must be 'kv' or 'pow2', got {router!r}")
    spec = ReplicaSpec(model=model, gguf_file=gguf_file, cache_config=cache_config,
                       engine_config=engine_config, threads=threads, model_impl=model_impl,
                       tokenizer=tokenizer,
                       bus_name=bus_name(app_name), bus_namespace=RAY_NAMESPACE)
    opts: dict[str, Any] = dict(
        name="RadixkvEngine", num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus},
        # the engine batches: let Serve send it a full batch plus the server's queue
        max_ongoing_requests=engine_config.max_num_seqs + max_queued,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        # a replica Serve stops on its own (a scale-down, an update of its options) may finish
        # its requests for --shutdown-timeout, as the ingress's drain lets them, then has room
        # for the remote-tier flush at close (EngineReplica.close); 5 s of slack for the rest
        graceful_shutdown_timeout_s=graceful_shutdown_s(shutdown_timeout_s, cache_config))
    if router == "kv":
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=KVAwareRouter,
            request_router_kwargs={"bus_name": bus_name(app_name),
                                   "bus_namespace": RAY_NAMESPACE,
                                   "block_size": cache_config.block_size,
                                   "load_tokens": LOAD_TOKENS if load_tokens is None
                                   else load_tokens})
    engines = serve.deployment(EngineReplica).options(**opts)
    ingress = serve.deployment(serve.ingress()(FleetIngress)).options(
        name="RadixkvIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000)   # admission is the app's (--max-queued -> 429)
    options = {"model": model, "gguf_file": gguf_file, "tokenizer": tokenizer,
               "model_name": model_name,
               "api_keys": api_keys or [], "max_queued": max_queued,
               "default_max_tokens": default_max_tokens,
               "reasoning_parser": reasoning_parser, "generation_config": generation_config,
               "override_generation_config": override_generation_config,
               "max_logprobs": max_logprobs, "responses_store_size": responses_store_size,
               "max_conversation_bytes": max_conversation_bytes,
               "frontend": frontend or {},
               "cache_reset": cache_reset, "stream_interval": stream_interval,
               "json_max_whitespace": json_max_whitespace,
               # one secret for every ingress replica: a tenant's salt must not depend on
               # which ingress parsed its request
               "salt_secret": salt_secret or secrets.token_hex(16),
               "bus_name": bus_name(app_name), "bus_namespace": RAY_NAMESPACE,
               "router": router, "num_replicas": replicas}
    return ingress.bind(engines.bind(spec), options)


def start_bus(app_name: str = APP_NAME) -> Any:
    """The fleet's event bus actor (one per app; reused if it exists)."""
    import ray

    from radixkv.fleet.events import KVEventBus

    return ray.remote(KVEventBus).options(
        name=bus_name(app_name), namespace=RAY_NAMESPACE, get_if_exists=True, num_cpus=0,
        max_restarts=-1, max_concurrency=1000).remote()


def init_ray(address: str | None, num_cpus: int | None) -> None:
    import ray

    if ray.is_initialized():
        return
    kw: dict[str, Any] = dict(namespace=RAY_NAMESPACE, include_dashboard=False,
                              log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, **kw)
    else:
        ray.init(num_cpus=num_cpus, object_store_memory=LOCAL_OBJECT_STORE, **kw)


def run(args: Any, cache_config: Any, engine_config: Any, api_keys: list[str],
        model_name: str) -> int:
    """The ``radixkv serve --replicas`` command (blocks until a signal)."""
    import ray
    from ray import serve

    from radixkv.errors import ConfigError

    if args.port == 0:
        raise ConfigError("--port 0 (any free port) is not supported with --replicas: Ray "
                          "Serve's proxy needs the port up front; give one")
    replicas = args.replicas if args.replicas is not None else 1
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    cpus = args.ray_cpus or max(os.cpu_count() or 1, int(replicas * args.replica_cpus + 0.999))
    t0 = time.perf_counter()
    print(f"radixkv serve: starting {replicas} replica(s) on "
          f"{'Ray at ' + args.ray_address if args.ray_address else f'a local Ray ({cpus} CPUs)'}"
          f", router {args.router}", file=sys.stderr, flush=True)
    init_ray(args.ray_address, cpus)
    # HTTPS is the proxy's (uvicorn under Ray Serve): the key, certificate and CA file, as a
    # single server takes them (cli.py refuses the other --ssl-* flags with --replicas)
    tls = {k: v for k, v in (("ssl_keyfile", args.ssl_keyfile),
                             ("ssl_certfile", args.ssl_certfile),
                             ("ssl_ca_certs", args.ssl_ca_certs)) if v}
    serve.start(http_options={"host": args.host, "port": args.port, **tls})
    bus = start_bus()   # held until shutdown: an actor dies with its last handle
    ray.get(bus.holders.remote())
    threads = args.threads or max(1, int(args.replica_cpus))
    from radixkv.server.frontend import FrontendOptions

    app = build_app(replicas=replicas, cache_config=cache_config, engine_config=engine_config,
                    model=args.model, gguf_file=args.gguf_file, threads=threads,
                    shutdown_timeout_s=args.shutdown_timeout or 0.0,
                    router=args.router, load_tokens=args.route_load_tokens,
                    replica_cpus=args.replica_cpus, model_name=model_name, api_keys=api_keys,
                    max_queued=args.max_queued, default_max_tokens=args.default_max_tokens,
                    salt_secret=args.salt_secret, model_impl=args.model_impl,
                    tokenizer=args.tokenizer,
                    reasoning_parser=args.reasoning_parser,
                    generation_config=args.generation_config,
                    override_generation_config=args.override_generation_config,
                    max_logprobs=args.max_logprobs,
                    responses_store_size=args.responses_store_size,
                    max_conversation_bytes=args.max_conversation_bytes,
                    stream_interval=args.stream_interval,
                    json_max_whitespace=args.structured_outputs_max_whitespace,
                    cache_reset=args.enable_cache_reset
                    or os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
                    frontend=FrontendOptions.from_args(args).as_dict())
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"radixkv serve: fleet ready in {time.perf_counter() - t0:.1f} s at "
          f"{'https' if tls else 'http'}://{args.host}:{args.port} (model name "
          f"{model_name!r}, {replicas} replicas)",
          file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    drain_s = args.shutdown_timeout or 0.0
    print(f"radixkv serve: shutting the fleet down (draining for up to {drain_s:g} s)",
          file=sys.stderr, flush=True)
    try:   # the ingress refuses new requests and ends those in flight by the deadline
        drained = serve.get_app_handle(APP_NAME).drain.remote(drain_s).result(
            timeout_s=drain_s + 30.0)
        print(f"radixkv serve: drained: {drained['finished_sequences']} sequence(s) finished, "
              f"{drained['aborted_requests']} request(s) ended at the deadline",
              file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 (shutting down whatever happened to the drain)
        print(f"radixkv serve: the drain failed ({type(exc).__name__}: {exc}); stopping",
              file=sys.stderr, flush=True)
    serve.shutdown()
    del bus
    ray.shutdown()
    return 0


__all__ = ["build_app", "graceful_shutdown_s", "run", "start_bus", "init_ray", "bus_name"]
