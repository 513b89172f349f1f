"""``engine.stats()`` in the Prometheus text exposition format (0.0.4), with no dependency.

Serve it from any HTTP handler with content type ``text/plain; version=0.0.4``::

    radixkv_prompt_tokens_total{model="m"} 1024
    radixkv_hit_rate{model="m"} 0.75
    radixkv_evictions_total{model="m",tier="host"} 128

Mapping: every numeric leaf of the (nested) stats dict becomes one sample named by its key path
joined with ``_``. A list of numbers is per tier (that is what every list in ``engine.stats()``
is) and becomes one sample per element with a ``tier`` label from ``TIER_NAMES``. Monotonic
counts (names containing one of ``COUNTER_WORDS`` and none of ``GAUGE_WORDS``) are typed
``counter`` and get the ``_total`` suffix; everything else is a ``gauge``. Non-numeric leaves
(strings, None) are skipped.

>>> print(prometheus_text({"hits": 3, "hit_rate": 0.5, "cached_tokens": [8, 4]},
...                       labels={"model": "m"}), end="")
# HELP radixkv_hit_rate radixkv engine stat 'hit_rate'
# TYPE radixkv_hit_rate gauge
radixkv_hit_rate{model="m"} 0.5
# HELP radixkv_cached_tokens_total radixkv engine stat 'cached_tokens'
# TYPE radixkv_cached_tokens_total counter
radixkv_cached_tokens_total{model="m",tier="device"} 8
radixkv_cached_tokens_total{model="m",tier="host"} 4
# HELP radixkv_hits_total radixkv engine stat 'hits'
# TYPE radixkv_hits_total counter
radixkv_hits_total{model="m"} 3
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

TIER_NAMES = ("device", "host", "disk")
#: Substrings of a stat name that mark a monotonic count (a Prometheus counter).
COUNTER_WORDS = ("hits", "misses", "evictions", "promotions", "demotions", "preemptions",
                 "requests", "tokens", "saved", "steps", "forwards", "collisions", "dropped",
                 "aborted", "finished", "unschedulable", "admissions", "forged")
#: Substrings that override COUNTER_WORDS: these are instantaneous values (gauges).
GAUGE_WORDS = ("rate", "ratio", "utilization", "running", "waiting", "free", "resident",
               "num_", "blocks", "stored", "allocated", "capacity")
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def _name(parts: Sequence[str]) -> str:
    name = _NAME_RE.sub("_", "_".join(p for p in parts if p))
    return name if not name[:1].isdigit() else "_" + name


def _is_counter(name: str) -> bool:
    if any(w in name for w in GAUGE_WORDS):
        return False
    return name.endswith("_total") or any(w in name for w in COUNTER_WORDS)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float | int | bool) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, complex)


def _flatten(obj: Any, path: list[str], labels: dict[str, str],
             out: dict[str, list[tuple[dict[str, str], Any]]]) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, [*path, str(k)], labels, out)
    elif isinstance(obj, (list, tuple)):
        # Every list in engine.stats() is indexed by tier (0 = device, 1 = host, 2 = disk).
        for i, v in enumerate(obj):
            if _is_number(v):
                tier = TIER_NAMES[i] if i < len(TIER_NAMES) else str(i)
                out.setdefault(_name(path), []).append(({**labels, "tier": tier}, v))
    elif _is_number(obj):
        out.setdefault(_name(path), []).append((labels, obj))


def prometheus_text(stats: Mapping[str, Any], prefix: str = "radixkv",
                    labels: Mapping[str, str] | None = None) -> str:
    """Render a (nested) stats dict as Prometheus text; see the module docstring."""
    groups: dict[str, list[tuple[dict[str, str], Any]]] = {}
    _flatten(stats, [], dict(labels or {}), groups)
    lines: list[str] = []
    for base in sorted(groups, key=lambda n: (_is_counter(n), n)):  # gauges, then counters
        samples = groups[base]
        counter = _is_counter(base)
        name = _name([prefix, base])
        if counter and not name.endswith("_total"):
            name += "_total"
        lines.append(f"# HELP {name} {prefix} engine stat '{base}'")
        lines.append(f"# TYPE {name} {'counter' if counter else 'gauge'}")
        for lab, value in samples:
            lab_txt = ",".join(f'{k}="{_escape(str(v))}"' for k, v in lab.items())
            lines.append(f"{name}{{{lab_txt}}} {_fmt(value)}" if lab_txt else f"{name} {_fmt(value)}")
    return "\n".join(lines) + "\n" if lines else ""


__all__ = ["prometheus_text", "TIER_NAMES"]
