"""Eviction policies: strategy objects that turn a cached node into a sort key.

The tree keeps, per tier, the *evictable leaves* (unheld nodes with no child in that tier) in an
eviction index (``evict_index.py``) of ``(*policy.key(node, hints), hash of its last block)``;
the smallest entry is evicted first, block by block from the node's tail. A node is a run of
blocks that share their key (``node.py``), so a key is the key of each of its blocks. LRU and
TTL use the O(1) ``RecencyIndex``, LFU a ``FrequencyIndex`` (buckets of those), the others a
``SortedIndex`` (O(log n)). The trailing hash makes entries unique and deterministic. A
policy's key may only read fields that the tree changes while the node is *out* of the index
(``last_access``, ``hits``, the node's hints): the tree removes a node, mutates it, re-adds it.

Because a parent is accessed whenever a child is, ``parent.last_access >= child.last_access``
always holds, so evicting leaves in LRU order is exactly LRU over the whole tree.

``hits`` counts the requests that locked the node. A run grows when its only holder commits
more blocks after it, and the new blocks join the run's count: under LFU a conversation's
newest blocks count as often used as its oldest (a per-block cache would give them 0).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixkv.core.evict_index import EvictionIndex, FrequencyIndex, RecencyIndex, SortedIndex
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.core.node import Node


@dataclass(frozen=True)
class NodeHints:
    """Per-node scheduling hints set by callers (e.g. pin a system prompt).

    ``priority``: higher survives longer under PriorityPolicy (default 0).
    ``ttl``: seconds a block is kept after its last use under TTLPolicy (None: the policy's).
    """

    priority: int = 0
    ttl: float | None = None


DEFAULT_HINTS = NodeHints()


class EvictionPolicy(abc.ABC):
    """Order of eviction among evictable leaves: smallest key first."""

    name: str

    @abc.abstractmethod
    def key(self, node: Node, hints: NodeHints) -> tuple:
        """Sort key of an evictable node (of each of its blocks). Must be cheap: called on
        every (re)filing."""

    def expired(self, key: tuple, now: float) -> bool:
        """Whether an entry with this key may leave its tier with no memory pressure at
        ``now`` (only TTL-like policies say yes)."""
        return False

    def new_index(self) -> EvictionIndex:
        """The per-tier ordered set the tree keeps this policy's entries in: a ``SortedIndex``
        (O(log n), any key) unless the policy knows its keys arrive in order."""
        return SortedIndex()


class LRUPolicy(EvictionPolicy):
    """Least recently used first (the default). Key: ``(last_access,)``."""

    name = "lru"

    def key(self, node: Node, hints: NodeHints) -> tuple:
        return (node.last_access,)

    def new_index(self) -> RecencyIndex:
        """Keys are times that mostly arrive in order: O(1) adds, removes and evictions."""
        return RecencyIndex()


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, ties by LRU. Key: ``(hits, last_access)``."""

    name = "lfu"

    def key(self, node: Node, hints: NodeHints) -> tuple:
        return (node.hits, node.last_access)

    def new_index(self) -> FrequencyIndex:
        """Frequency buckets, each in time order: O(1) within a bucket."""
        return FrequencyIndex()


class MRUPolicy(EvictionPolicy):
    """Most recently used first. Key: ``(-last_access,)``.

    The classic answer to a loop larger than the cache (the block used last is the one needed
    last). Measured on the chat trace it is far below LRU (docs/benchmarks.md): real chat is no
    pure loop. Kept selectable by name for comparisons; eviction stays leaf-first.
    """

    name = "mru"

    def key(self, node: Node, hints: NodeHints) -> tuple:
        return (-node.last_access,)


class PriorityPolicy(EvictionPolicy):
    """Lowest caller priority first, ties by LRU. Key: ``(priority, last_access)``.

    Give a system prompt or popular documents a high priority to keep them cached under
    pressure; hard pinning (never evict) is a lock, see ``RadixTree.lock``.
    """

    name = "priority"

    def key(self, node: Node, hints: NodeHints) -> tuple:
        return (hints.priority, node.last_access)


class TTLPolicy(EvictionPolicy):
    """Keep each block for ``ttl`` seconds after its last use; evict soonest expiry first.

    Key: ``(last_access + ttl,)`` with a per-node override from hints (like hosted prompt
    caches' 5-minute and 1-hour tiers). ``RadixTree.evict_expired(now)`` drops expired blocks
    even without memory pressure.
    """

    name = "ttl"

    def __init__(self, ttl: float = 300.0) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (ttl > 0 and math.isfinite(ttl)):
            raise ConfigError(f"ttl must be a positive number of seconds, got {ttl!r}")
        self.ttl = ttl

    def key(self, node: Node, hints: NodeHints) -> tuple:
        return (node.last_access + (self.ttl if hints.ttl is None else hints.ttl),)

    def new_index(self) -> RecencyIndex:
        """Expiry times arrive in order while TTLs are equal; per-node TTLs go to the side list."""
        return RecencyIndex()

    def expired(self, key: tuple, now: float) -> bool:
        return key[0] <= now


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "mru": MRUPolicy, "priority": PriorityPolicy,
            "ttl": TTLPolicy}


def make_policy(name: str | EvictionPolicy, **kwargs) -> EvictionPolicy:
    """A policy by name (``lru``, ``lfu``, ``priority``, ``ttl``) or an instance passed through."""
    if not isinstance(name, str):
        return name
    if name not in POLICIES:
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError as exc:
        raise ConfigError(f"bad options for the {name!r} policy: {exc}") from None
