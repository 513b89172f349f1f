"""``engine.stats()`` as Prometheus metrics, through ``prometheus-client`` (no hand-written format).

:class:`StatsCollector` is a ``prometheus_client`` custom collector: at every scrape it calls a
function that returns the (nested) stats dict and turns each numeric leaf into a metric family.
:func:`prometheus_text` renders one stats dict once (what ``Engine.metrics_text`` serves)::

    radixkv_prompt_tokens_total{model="m"} 1024.0
    radixkv_hit_rate{model="m"} 0.75
    radixkv_evictions_total{model="m",tier="host"} 128.0

Mapping: every numeric leaf becomes one family named by its key path joined with ``_``. A list of
numbers is per tier (that is what every list in ``engine.stats()`` is) and becomes one sample per
element with a ``tier`` label from ``TIER_NAMES``. Monotonic counts (names containing one of
``COUNTER_WORDS`` and none of ``GAUGE_WORDS``) are counters (exposed with the ``_total`` suffix);
everything else is a gauge. Non-numeric leaves (strings, None) are skipped.

Needs ``prometheus-client`` (the ``serve`` extra, which ``scripts/dev.sh`` installs).

>>> print(prometheus_text({"hits": 3, "hit_rate": 0.5}, labels={"model": "m"}), end="")
# HELP radixkv_hit_rate radixkv engine stat 'hit_rate'
# TYPE radixkv_hit_rate gauge
radixkv_hit_rate{model="m"} 0.5
# HELP radixkv_hits_total radixkv engine stat 'hits'
# TYPE radixkv_hits_total counter
radixkv_hits_total{model="m"} 3.0
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from radixkv.errors import ConfigError

TIER_NAMES = ("device", "host", "disk")
#: Substrings of a stat name that mark a monotonic count (a Prometheus counter).
COUNTER_WORDS = ("hits", "misses", "evictions", "promotions", "demotions", "preemptions",
                 "requests", "tokens", "saved", "steps", "forwards", "collisions", "dropped",
                 "aborted", "finished", "unschedulable", "admissions", "forged")
#: Substrings that override COUNTER_WORDS: these are instantaneous values (gauges).
GAUGE_WORDS = ("rate", "ratio", "utilization", "running", "waiting", "free", "resident",
               "num_", "blocks", "stored", "allocated", "capacity")
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigError("metrics need prometheus-client: pip install 'radixkv[serve]' "
                          "(or bash scripts/dev.sh setup)") from exc
    return prometheus_client


def _name(parts: Sequence[str]) -> str:
    name = _NAME_RE.sub("_", "_".join(p for p in parts if p))
    return name if not name[:1].isdigit() else "_" + name


def _is_counter(name: str) -> bool:
    if any(w in name for w in GAUGE_WORDS):
        return False
    return name.endswith("_total") or any(w in name for w in COUNTER_WORDS)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, complex)


def _flatten(obj: Any, path: list[str], tier: str | None,
             out: dict[str, list[tuple[str | None, float]]]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, [*path, str(k)], tier, out)
    elif isinstance(obj, (list, tuple)):
        # Every list in engine.stats() is indexed by tier (0 = device, 1 = host, 2 = disk).
        for i, v in enumerate(obj):
            if _is_number(v):
                name = TIER_NAMES[i] if i < len(TIER_NAMES) else str(i)
                out.setdefault(_name(path), []).append((name, float(v)))
    elif _is_number(obj):
        out.setdefault(_name(path), []).append((tier, float(obj)))


class StatsCollector:
    """A ``prometheus_client`` collector over a function returning a stats dict.

    Args:
        stats: called at every scrape (keep it cheap; it runs on the scraping thread).
        prefix: metric name prefix.
        labels: constant labels on every sample (e.g. ``{"model": model_id}``).
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]], prefix: str = "radixkv",
                 labels: Mapping[str, str] | None = None) -> None:
        self.stats, self.prefix, self.labels = stats, prefix, dict(labels or {})

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        groups: dict[str, list[tuple[str | None, float]]] = {}
        _flatten(self.stats(), [], None, groups)
        for base in sorted(groups, key=lambda n: (_is_counter(n), n)):  # gauges, then counters
            counter = _is_counter(base)
            name = _name([self.prefix, base])
            if counter and name.endswith("_total"):
                name = name[:-len("_total")]   # the client adds it back
            family_type = CounterMetricFamily if counter else GaugeMetricFamily
            names = list(self.labels)
            if any(t is not None for t, _ in groups[base]):
                names.append("tier")
            fam = family_type(name, f"{self.prefix} engine stat '{base}'", labels=names)
            for tier, value in groups[base]:
                values = list(self.labels.values()) + ([tier or ""] if "tier" in names else [])
                fam.add_metric(values, value)
            yield fam

    def describe(self) -> list[Any]:
        return []   # unchecked collector: its families depend on the engine's tiers


def prometheus_text(stats: Mapping[str, Any], prefix: str = "radixkv",
                    labels: Mapping[str, str] | None = None) -> str:
    """Render one (nested) stats dict in the Prometheus text format; see the module docstring."""
    client = _client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(lambda: stats, prefix, labels))
    return client.generate_latest(registry).decode()


__all__ = ["prometheus_text", "StatsCollector", "TIER_NAMES"]
