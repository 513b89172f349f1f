"""Every eviction policy that runs on its own, by name: all of ``policy_registry.POLICIES`` but
``duel``, whose members are picked from this table (so the duel imports this module and the
registry imports the duel: one way).

``auto`` is here too: it is an ``LRUPolicy`` that hands over to ``AUTO_THEN`` at the first
session-end hint (``auto_policy``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixkv.core.policy import (
    EvictionPolicy, FIFOPolicy, LFUDAPolicy, LFUPolicy, LRUPolicy, MRUPolicy, PriorityPolicy,
    TTLPolicy,
)
from radixkv.core.policy_forecast import ForecastPolicy
from radixkv.core.policy_ghost import LFUGhostPolicy
from radixkv.errors import ConfigError

#: What ``auto`` turns into once clients send session-end hints (see ``auto_policy``).
AUTO_THEN = "forecast"


def auto_policy(then: str = AUTO_THEN) -> LRUPolicy:
    """The default: LRU, with LRU's cost (the same key, index and fast paths: the tree sees an
    ``LRUPolicy``), until the first request that says its session ends; then the tree hands
    eviction to ``then`` (``RadixTree.switch_policy``: every node re-filed once).

    Why: without hints no policy measured beats LRU on every workload, held-out traces
    included, at a cost near LRU's (``duel`` gains up to 53 points on round-robin chat but
    falls up to 0.81 points below LRU on open-loop chat and 0.71 on a held-out trace, for 6-13x
    LRU's bookkeeping); told of session ends, ``forecast`` stays above LRU at every capacity of the
    five traces measured, for 1.1-1.2x LRU's bookkeeping (docs/eviction.md). ``then`` must
    keep runs as LRU cut them (no ``insert_key``, no ``fresh_counts``): ``forecast``,
    ``fifo``, ``priority``, ``mru``, ``ttl``. Runtime complexity: the switch is O(nodes) once
    (``RadixTree.switch_policy``); before it, LRU's.
    """
    if not isinstance(then, str) or then not in MEMBER_POLICIES or then == "auto":
        raise ConfigError(f"auto's 'then' must be a policy name other than 'auto', one of "
                          f"{sorted(n for n in MEMBER_POLICIES if n != 'auto')}; got {then!r}")
    probe = MEMBER_POLICIES[then]()
    if probe.insert_key is not None or probe.fresh_counts:
        raise ConfigError(f"auto cannot hand over to {then!r}: it cuts runs differently from "
                          "LRU (fresh counts or per-block insert keys); choose forecast, fifo, "
                          "priority, mru or ttl, or select it by name from the start")
    pol = LRUPolicy()
    pol.name = "auto"
    pol.on_end_hint = then
    return pol


#: name -> class (or factory) of every policy but ``duel``. Read-only by convention.
MEMBER_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy, "lfu": LFUPolicy, "mru": MRUPolicy, "priority": PriorityPolicy,
    "ttl": TTLPolicy, "fifo": FIFOPolicy, "lfu-da": LFUDAPolicy, "forecast": ForecastPolicy,
    "lfu-ghost": LFUGhostPolicy, "auto": auto_policy,
}


def build_policy(table: dict[str, Callable[..., EvictionPolicy]], name: str | EvictionPolicy,
                 **kwargs: Any) -> EvictionPolicy:
    """``table[name](**kwargs)``, or ``name`` itself if it is a policy object; ConfigError
    for an unknown name or bad options."""
    if not isinstance(name, str):
        return name
    if name not in table:
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(table)}")
    try:
        return table[name](**kwargs)
    except TypeError as exc:
        raise ConfigError(f"bad options for the {name!r} policy: {exc}") from None


def make_member(name: str | EvictionPolicy, **kwargs: Any) -> EvictionPolicy:
    """A policy that runs on its own, by name (one of ``MEMBER_POLICIES``), or an instance
    passed through."""
    return build_policy(MEMBER_POLICIES, name, **kwargs)
