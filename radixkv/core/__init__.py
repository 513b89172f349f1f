"""Pure-Python bookkeeping of the KV cache: hashing, the radix tree and its parts, block pools and
the copy-on-write block manager. Imports no torch.

The engine talks to :class:`BlockManager` (block tables, copy-on-write, commits, tier plans).
Below it, :class:`RadixTree` is the structure (nodes as runs of blocks, match, insert, split),
with one :class:`EvictableSet` per tier (the eviction order) and a :class:`MovePlanner` (every
change of residency, as :class:`MoveOp` lists); :class:`BlockPool` holds one tier's block ids.
Blocks entering and leaving the cache are :mod:`KV events <radixkv.core.events>` that readers
drain from the tree's :class:`KVEventQueue`. ``docs/architecture.md`` draws the parts.
"""

from radixkv.core.block_manager import Allocation, BlockManager, CopyOp, SlotAssignment
from radixkv.core.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventCursor,
    KVEvent,
    KVEventQueue,
)
from radixkv.core.evict_index import Entry, EvictionIndex, FrequencyIndex, RecencyIndex, SortedIndex
from radixkv.core.evictable import EvictableSet
from radixkv.core.hashing import BlockHash, Namespace, chain_hash, hash_token_blocks, token_bytes
from radixkv.core.move_planner import MovePlanner, PlannerHost
from radixkv.core.node import DEVICE, MAX_TIERS, BlockRef, MoveOp, Node, NodeHints, TreeStats
from radixkv.core.policy import CacheMaker, EvictionPolicy, PolicyHost, ShadowCache
from radixkv.core.policy_registry import DEFAULT_POLICY, POLICIES, make_policy
from radixkv.core.pool import BlockId, BlockPool
from radixkv.core.tree import RadixTree
from radixkv.core.writes import TreeWriteBack, TreeWrites, TreeWriteThrough, WritesHost

__all__ = [
    "DEFAULT_POLICY", "DEVICE", "MAX_TIERS", "POLICIES", "AllCleared", "Allocation", "BlockHash",
    "BlockId", "BlockManager", "BlockPool", "BlockRef", "BlockRemoved", "BlockStored",
    "CacheMaker", "CopyOp", "Entry", "EventCursor", "EvictableSet", "EvictionIndex",
    "EvictionPolicy", "FrequencyIndex", "KVEvent", "KVEventQueue", "MoveOp", "MovePlanner",
    "Namespace", "Node", "NodeHints", "PlannerHost", "PolicyHost", "RadixTree", "RecencyIndex",
    "ShadowCache", "SlotAssignment", "SortedIndex", "TreeStats", "TreeWriteBack",
    "TreeWriteThrough", "TreeWrites", "WritesHost", "chain_hash", "hash_token_blocks",
    "make_policy", "token_bytes",
]
