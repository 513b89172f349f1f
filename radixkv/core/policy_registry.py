"""Every eviction policy by name: ``POLICIES`` and ``make_policy`` (what ``RadixTree``,
``BlockManager.create`` and ``CacheConfig`` take), and the default.

The table is the single policies of ``policy_members.py`` plus the composite ``duel``
(``policy_duel.py``, which picks its members from ``policy_members``): kept apart so that the
imports go one way, registry -> duel -> members -> policies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixkv.core.policy import EvictionPolicy
from radixkv.core.policy_duel import DuelPolicy
from radixkv.core.policy_members import AUTO_THEN, MEMBER_POLICIES, auto_policy, build_policy

__all__ = ["AUTO_THEN", "DEFAULT_POLICY", "POLICIES", "auto_policy", "make_policy"]

#: The default eviction policy of ``CacheConfig``, ``RadixTree`` and ``BlockManager.create``.
DEFAULT_POLICY = "auto"

#: name -> class (or factory) of every policy. Read-only by convention.
POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    **{name: f for name, f in MEMBER_POLICIES.items() if name != "auto"},
    "duel": DuelPolicy, "auto": auto_policy,   # the order benchmarks list them in
}


def make_policy(name: str | EvictionPolicy, **kwargs: Any) -> EvictionPolicy:
    """A policy by name (one of ``POLICIES``) or an instance passed through. Raises
    ConfigError for an unknown name or bad options."""
    return build_policy(POLICIES, name, **kwargs)
