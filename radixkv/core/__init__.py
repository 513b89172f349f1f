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
from radixkv.core.evictable import EvictableSet
from radixkv.core.hashing import BlockHash, Namespace, chain_hash, hash_token_blocks, token_bytes
from radixkv.core.move_planner import MovePlanner
from radixkv.core.node import DEVICE, MAX_TIERS, BlockRef, MoveOp, Node, TreeStats
from radixkv.core.policy import EvictionPolicy, NodeHints
from radixkv.core.policy_registry import make_policy
from radixkv.core.pool import BlockId, BlockPool
from radixkv.core.tree import RadixTree
from radixkv.core.writes import TreeWriteBack, TreeWrites, TreeWriteThrough

__all__ = [
    "DEVICE", "MAX_TIERS", "AllCleared", "Allocation", "BlockHash", "BlockId", "BlockManager",
    "BlockPool", "BlockRef", "BlockRemoved", "BlockStored", "CopyOp", "EventCursor",
    "EvictableSet", "EvictionPolicy", "KVEvent", "KVEventQueue", "MoveOp", "MovePlanner",
    "Namespace", "Node", "NodeHints", "RadixTree", "SlotAssignment", "TreeStats", "TreeWrites",
    "TreeWriteBack", "TreeWriteThrough", "chain_hash", "hash_token_blocks", "make_policy",
    "token_bytes",
]
