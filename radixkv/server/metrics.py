"""The server's Prometheus metrics (``prometheus-client``), named like vLLM's where they mean the
same thing (``vllm:prefix_cache_hits`` -> ``radixkv_prefix_cache_hits_total`` ...).

Everything lives in one :class:`ServerMetrics` per app, on its own ``CollectorRegistry`` (no
module-level state: two apps in one process, e.g. in tests, do not share counters).

Two sources:

* **Request latencies** are observed by the HTTP layer as requests finish (histograms with
  explicit buckets): TTFT, end-to-end latency, inter-token latency; plus request and token
  counters.
* **Engine state** comes from ``engine.stats()``: a snapshot taken on the engine loop by the
  ``/metrics`` handler just before rendering (:meth:`ServerMetrics.render`), exposed by a custom
  collector: prefix-cache queries and hits (tokens, hits per tier), running/waiting requests,
  cache usage per tier, evictions/promotions/demotions per tier, preemptions, blocks stored and
  removed per tier (from the engine's KV events, counted on its loop); and, under
  ``radixkv_engine_*``, every other engine stat (see :mod:`radixkv.api.metrics`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixkv.api.metrics import TIER_NAMES, StatsCollector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0)
#: Pauses of the cyclic GC: a young collection takes microseconds, a full pass over a loaded
#: server's unfrozen heap ~85 ms (radixkv/server/heap.py).
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
#: Token counts per request, vLLM's 1-2-5 series (vLLM stops it at the model's context; the
#: server's metrics exist before the model is loaded, so it runs to a million here).
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5)) + (1_000_000,)
#: A request's ``n`` (vLLM's buckets).
N_BUCKETS = (1, 2, 5, 10, 20)


class _EngineCollector:
    """vLLM-named families over the latest engine stats snapshot."""

    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        yield from _merged(self._families(extra, st) for extra, st in self.owner.snapshots)

    def _families(self, extra: Mapping[str, str], st: Mapping[str, Any]) -> Iterator[Any]:
        if not st:
            return
        lab = {**self.owner.labels, **extra}
        names, values = list(lab), list(lab.values())
        tiers = list(st.get("tiers") or TIER_NAMES[:len(st.get("cached_blocks_per_tier", [1]))])

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, doc, labels=names)
            fam.add_metric(values, float(value))
            return fam

        def per_tier(cls: Any, name: str, doc: str, per: list[float]) -> Any:
            fam = cls(name, doc, labels=[*names, "tier"])
            for t, v in zip(tiers, per):
                fam.add_metric([*values, t], float(v))
            return fam

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=names)
            fam.add_metric(values, float(value))
            return fam

        yield counter("radixkv_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache (vllm:prefix_cache_queries).", st["prompt_tokens"])
        yield counter("radixkv_prefix_cache_hits", "Prompt tokens served from the prefix cache, "
                      "all tiers (vllm:prefix_cache_hits).", st["cached_prompt_tokens"])
        hits = CounterMetricFamily(
            "radixkv_prefix_cache_hits_by_tier",
            "Prompt tokens served from the prefix cache, by the tier they were in (remote: "
            "looked up in the shared server).", labels=[*names, "tier"])
        per_hit = list(st["cached_prompt_tokens_per_tier"])
        remote = st.get("remote")
        if remote is not None and "host" in tiers:   # remote hits were staged in the host tier
            h = tiers.index("host")
            per_hit[h] -= min(per_hit[h], remote["hit_tokens"])
        for t, v in zip(tiers, per_hit):
            hits.add_metric([*values, t], float(v))
        if remote is not None:
            hits.add_metric([*values, "remote"], float(remote["hit_tokens"]))
        yield hits
        if remote is not None:
            yield counter("radixkv_remote_blocks_written", "Blocks queued to the remote tier.",
                          remote["blocks_written"])
            yield counter("radixkv_remote_blocks_persisted", "Blocks written to the remote tier "
                          "for a retention (prompt_cache_retention 24h, a persisted pin).",
                          remote.get("blocks_persisted", 0))
            yield counter("radixkv_remote_lookup_timeouts", "Remote lookups abandoned at their "
                          "deadline (the request was computed).", remote["lookup_timeouts"])
            yield gauge("radixkv_remote_available", "1 while the remote server answers.",
                        1.0 if remote["available"] else 0.0)
        yield counter("radixkv_session_ends", "Sessions the client said had ended "
                      "(end_session: an eviction hint for the forecast and duel policies).",
                      st.get("session_ends", 0))
        yield gauge("radixkv_num_requests_running", "Requests in the running batch.",
                    st["num_running_requests"])
        yield gauge("radixkv_num_requests_waiting", "Requests waiting to be scheduled.",
                    st["num_waiting"])
        caps = list(st.get("tier_capacity_blocks") or [st["device_blocks"]])
        used = [st["device_blocks"] - st["device_blocks_free"],
                *st["cached_blocks_per_tier"][1:]]
        yield per_tier(GaugeMetricFamily, "radixkv_kv_cache_usage_perc",
                       "Fraction of each tier's KV blocks in use (device: held or cached; "
                       "host/disk: cached).", [u / c if c else 0.0 for u, c in zip(used, caps)])
        for key, doc in (("evictions", "Blocks evicted out of each tier."),
                         ("promotions", "Blocks promoted into the device from each tier."),
                         ("demotions", "Blocks demoted into each tier.")):
            yield per_tier(CounterMetricFamily, f"radixkv_{key}", doc, st[key])
        yield counter("radixkv_num_preemptions", "Requests preempted (vllm:num_preemptions).",
                      st["preemptions"])
        if "kv_blocks_stored" in st:   # the engine counts its KV events (the server asks)
            yield per_tier(CounterMetricFamily, "radixkv_kv_blocks_stored",
                           "Blocks entering the cache in each tier (KV events BlockStored: a "
                           "device commit, a block written into a slower tier).",
                           st["kv_blocks_stored"])
            yield per_tier(CounterMetricFamily, "radixkv_kv_blocks_removed",
                           "Blocks leaving the cache from each tier (KV events BlockRemoved: "
                           "dropped from the last tier, invalidated, expired).",
                           st["kv_blocks_removed"])
        # vLLM's own names for the same figures, so its dashboards work unchanged
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache (= radixkv_prefix_cache_queries).", st["prompt_tokens"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache "
                      "(= radixkv_prefix_cache_hits).", st["cached_prompt_tokens"])
        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    st["num_running_requests"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    st["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the device KV blocks in use.",
                    used[0] / caps[0] if caps and caps[0] else 0.0)
        yield counter("vllm:num_preemptions", "Requests preempted.", st["preemptions"])

    def describe(self) -> list[Any]:
        return []


def _same(stats: Mapping[str, Any]) -> Mapping[str, Any]:
    """A collector's stats function for a snapshot already taken."""
    return stats


def _merged(groups: Iterable[Iterable[Any]]) -> list[Any]:
    """Families of several engines (a fleet's replicas) as one family per name: the text
    format allows a name once, so the samples of each replica join the first family's."""
    out: dict[str, Any] = {}
    for fams in groups:
        for fam in fams:
            if fam.name in out:
                out[fam.name].samples.extend(fam.samples)
            else:
                out[fam.name] = fam
    return list(out.values())


class _GenericCollector:
    """Every number of ``engine.stats()`` as ``radixkv_engine_*``, per engine."""

    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        lab = self.owner.labels
        yield from _merged(
            StatsCollector(functools.partial(_same, st), prefix="radixkv_engine",
                           labels={**lab, **extra}).collect()
            for extra, st in self.owner.snapshots if st)

    def describe(self) -> list[Any]:
        return []


class _HeapCollector:
    """``radixkv_gc_frozen_objects``: the start-up objects frozen out of the collector's passes
    (0 where the server does not own its process or has not loaded yet)."""

    def __init__(self, owner: ServerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("radixkv_gc_frozen_objects", "Objects alive at start-up that "
                              "the cyclic garbage collector's passes skip (gc.freeze).",
                              labels=list(self.owner.labels))
        g.add_metric(list(self.owner.labels.values()), float(self.owner.frozen_objects))
        yield g

    def describe(self) -> list[Any]:
        return []


class _Twin:
    """Observations sent to two metrics at once: radixkv's and vLLM's name for the same one."""

    def __init__(self, *metrics: Any) -> None:
        self.metrics = metrics
        # label values -> the pair of children: prometheus_client's labels() validates and
        # takes a lock on every call (~20 us for the pair), and the handlers call it per
        # request and per token gap on the event loop
        self._children: dict[tuple[str, ...], _Twin] = {}

    def labels(self, *values: str) -> _Twin:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Twin(*(m.labels(*values) for m in self.metrics))
        return child

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)

    def inc(self, amount: float = 1.0) -> None:
        for m in self.metrics:
            m.inc(amount)


class ServerMetrics:
    """All metrics of one server app. ``labels``: constant labels (``model_name``)."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.registry = CollectorRegistry(auto_describe=False)
        #: ``(extra labels, engine.stats())`` per engine, set by :meth:`render`.
        self.snapshots: list[tuple[Mapping[str, str], Mapping[str, Any]]] = []
        names = ["model_name"]
        reg = self.registry
        ttft = Histogram("radixkv_time_to_first_token_seconds",
                         "Time to first token, measured in the engine.", names,
                         buckets=TTFT_BUCKETS, registry=reg)
        e2e = Histogram("radixkv_e2e_request_latency_seconds",
                        "Request latency from arrival at the server to its last token.",
                        names, buckets=E2E_BUCKETS, registry=reg)
        itl = Histogram("radixkv_inter_token_latency_seconds",
                        "Time between two output tokens of a request (streamed requests).",
                        names, buckets=ITL_BUCKETS, registry=reg)
        success = Counter("radixkv_request_success", "Finished engine requests (one per "
                          "prompt, whatever its n) by the finish reason of its first "
                          "choice.", [*names, "finished_reason"], registry=reg)
        prompt_tokens = Counter("radixkv_prompt_tokens", "Prompt tokens of served requests.",
                                names, registry=reg)
        generation_tokens = Counter("radixkv_generation_tokens", "Tokens generated.",
                                    names, registry=reg)
        # The same series under vLLM's names (prometheus allows ':' in names; vLLM uses it).
        self.ttft = _Twin(ttft, Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", names,
            buckets=TTFT_BUCKETS, registry=reg))
        self.e2e = _Twin(e2e, Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", names,
            buckets=E2E_BUCKETS, registry=reg))
        self.itl = _Twin(itl, Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", names,
            buckets=ITL_BUCKETS, registry=reg))
        self.success = _Twin(success, Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            [*names, "finished_reason"], registry=reg))
        self.prompt_tokens = _Twin(prompt_tokens, Counter(
            "vllm:prompt_tokens", "Prompt tokens.", names, registry=reg))
        self.generation_tokens = _Twin(generation_tokens, Counter(
            "vllm:generation_tokens", "Generated tokens.", names, registry=reg))
        # Per finished request, as vLLM's dashboards chart them (its Grafana example's heatmaps
        # and phase panels): token counts and parameters, and the time in each phase.
        def twin(name: str, doc: str, buckets: tuple[float, ...]) -> _Twin:
            return _Twin(Histogram(f"radixkv_{name}", doc, names, buckets=buckets, registry=reg),
                         Histogram(f"vllm:{name}", doc, names, buckets=buckets, registry=reg))

        self.request_prompt_tokens = twin(
            "request_prompt_tokens", "Prompt tokens of a finished request.", TOKEN_BUCKETS)
        self.request_generation_tokens = twin(
            "request_generation_tokens", "Tokens a finished request generated (every choice).",
            TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = twin(
            "request_max_num_generation_tokens", "The most tokens one sample of a finished "
            "request generated (its longest of n).", TOKEN_BUCKETS)
        self.request_params_n = twin("request_params_n", "The n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = twin(
            "request_params_max_tokens", "The max_tokens request parameter.", TOKEN_BUCKETS)
        self.request_queue_time = twin(
            "request_queue_time_seconds", "Time from submission to the engine to the "
            "scheduler's first admission (waiting).", E2E_BUCKETS)
        self.request_prefill_time = twin(
            "request_prefill_time_seconds", "Time from first admission to the first token.",
            E2E_BUCKETS)
        self.request_decode_time = twin(
            "request_decode_time_seconds", "Time from the first token to the last output.",
            E2E_BUCKETS)
        self.request_inference_time = twin(
            "request_inference_time_seconds", "Time from first admission to the last output "
            "(prefill + decode).", E2E_BUCKETS)
        self.rejected = Counter("radixkv_request_rejected", "Requests answered with an error "
                                "before reaching the engine, by HTTP status.",
                                [*names, "status"], registry=reg)
        #: --max-num-queued-reqs / --max-num-queued-tokens refusals (503), by the limit
        self.admission_rejections = _Twin(Counter(
            "radixkv_admission_rejections", "Requests refused by a queue limit "
            "(--max-num-queued-reqs, --max-num-queued-tokens), by reason.",
            [*names, "reason"], registry=reg), Counter(
            "vllm:admission_rejections", "Number of admission attempts rejected by a queue "
            "limit, by reason.", [*names, "reason"], registry=reg))
        #: CPython's cyclic GC (radixkv/server/heap.py; only where the server owns its
        #: process): each collection's pause, and the start-up objects frozen out of them
        self.gc_pauses = Histogram("radixkv_gc_pause_seconds", "Pauses of Python's cyclic "
                                   "garbage collector (every thread, the engine's included, "
                                   "waits), by generation (2: a full pass).",
                                   [*names, "generation"], buckets=GC_BUCKETS, registry=reg)
        self._gc_children = [self.gc_pauses.labels(model_name, str(g)) for g in range(3)]
        self.frozen_objects = 0
        reg.register(_EngineCollector(self))
        reg.register(_GenericCollector(self))
        reg.register(_HeapCollector(self))

    def label(self) -> dict[str, str]:
        return self.labels

    def gc_pause(self, generation: int, seconds: float) -> None:
        """One collection's pause (:class:`radixkv.server.heap.PauseRecorder`'s observer; the
        label children are made once: this runs at every collection, in any thread)."""
        self._gc_children[min(max(generation, 0), 2)].observe(seconds)

    def render(self, snapshots: Sequence[tuple[Mapping[str, str], Mapping[str, Any]]]
               | Mapping[str, Any]) -> bytes:
        """The text exposition with ``snapshots`` as the engines' state: ``(extra labels,
        engine.stats())`` per engine, or one ``engine.stats()`` for a single engine."""
        if isinstance(snapshots, Mapping):
            snapshots = [({}, snapshots)]
        self.snapshots = list(snapshots)
        return generate_latest(self.registry)


__all__ = ["ServerMetrics"]
