"""LFU with a ghost history: a block that comes back after it left the cache keeps its count.

Plain LFU forgets a block's count the moment the block is dropped. On RAG traffic (popular
documents, one-off combinations of them) that is what costs it: a popular document that was
squeezed out once comes back with a count of 0, below every old entry, and is the next victim
again, while one-off continuations that happened to be hit once outlive it. ARC keeps ghost
lists of recently evicted blocks for the same reason (a block found in a ghost was evicted too
early). ``LFUGhostPolicy`` keeps the ghost as a *count table*, as TinyLFU-style admission
filters do: a direct-mapped array of ``2**k`` slots (``ghost_factor`` times the capacity of
all tiers, rounded up to a power of two), each a 16-bit fingerprint of a dropped block's hash
and the block's count when it left (saturating at 255). A new node whose first block is found
there starts at that count + 1 (it was used again), not at 0; the slot is cleared.

Why a table and not a dict of hashes: 3 bytes a slot, no object per remembered block, O(1)
with no resizing, and a fingerprint collision (1 in 65,535 per occupied slot) only
misjudges one block's popularity, never a block's contents. Measured in the block simulator on
the RAG workload (``docs/eviction.md``): 0.85 of Belady's hit rate at the worst capacity of the
zone with a table of 4x the capacity, against 0.76 for plain LFU, 0.80 for ARC and 0.82-0.84
for an exact FIFO ghost of 2-4x the capacity's hashes (the table's random replacement keeps
some old popular entries longer than a FIFO).

Key: ``(base + hits, last_access)`` with ``base`` (the restored count) in ``node.aux``; counts
per block as in a per-block cache (``fresh_counts``). The new blocks of a node that were in the
table leave it. Blocks are remembered when they leave the *last* tier (a demotion keeps them
cached, and their count with them). Runtime complexity: O(1) per block inserted or dropped,
O(1) per node event; filing is the ``FrequencyIndex``'s (O(1) within a count bucket).

Pure Python: this module imports no torch.
"""

from __future__ import annotations

import struct
from array import array
from itertools import islice
from typing import TYPE_CHECKING

from radixkv.core.evict_index import FrequencyIndex
from radixkv.core.policy import EvictionPolicy, Key, NodeHints, PolicyHost
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from radixkv.core.node import Node

_MAX_COUNT = 255

#: The first 8 bytes and the next 2 of a hash, little-endian, in one C call: what the hot paths
#: read instead of ``ghost_slot``'s two slices and two ``int.from_bytes`` (2x cheaper per block;
#: a run's hashes joined and unpacked at once only pays off from about 10 blocks, and most
#: nodes this policy makes are 1-3 blocks). Needs hashes of 10 bytes or more (the tree's are
#: 16-byte xxh3-128 digests).
_unpack_slot = struct.Struct("<QH").unpack_from


def ghost_slot(block_hash: bytes, mask: int) -> tuple[int, int]:
    """``(slot, fingerprint)`` of a block hash in a table of ``mask + 1`` slots: the slot from
    its first 8 bytes, the fingerprint (never 0: 0 marks an empty slot) from the next two.
    (The definition; the policy's hot paths compute the same with ``_unpack_slot``.)"""
    return (int.from_bytes(block_hash[:8], "little") & mask,
            int.from_bytes(block_hash[8:10], "little") | 1)


class LFUGhostPolicy(EvictionPolicy):
    """Least frequently used first, ties by LRU, counts surviving a drop in a ghost table.

    Args:
        ghost_factor: slots of the ghost table per block of capacity (all tiers together),
            rounded up to a power of two; 0 turns the ghost off (plain per-block LFU).
    """

    name = "lfu-ghost"
    hooks = True
    key_size = 2
    fresh_counts = True

    def __init__(self, ghost_factor: float = 4.0) -> None:
        if isinstance(ghost_factor, bool) or not isinstance(ghost_factor, (int, float)) or \
                not 0 <= ghost_factor <= 64:
            raise ConfigError(f"ghost_factor must be a number in [0, 64], got {ghost_factor!r}")
        self.ghost_factor = ghost_factor
        self._mask = -1
        self._fp = array("H")
        self._count = bytearray()
        self._last_tier = 0
        self.restored = 0      # new nodes that started from a remembered count (statistics)

    def bind(self, tree: PolicyHost) -> None:
        super().bind(tree)
        self._last_tier = tree.num_tiers - 1
        want = self.ghost_factor * sum(p.num_blocks for p in tree.pools)
        if want <= 0:
            # no ghost: new blocks are all alike (plain LFU); an instance attribute over the
            # method, as the seam says (``EvictionPolicy.insert_key``: None = no insert keys)
            self.insert_key = None  # type: ignore[method-assign, assignment]
            return
        n = 1
        while n < want:
            n <<= 1
        self._mask = n - 1
        self._fp = array("H", bytes(2 * n))
        self._count = bytearray(n)

    # The hooks run once per node event in the real tree and in the duel's shadow of this
    # policy, and most nodes here are 1-3 blocks (counts are per block): ``_aux`` is inlined
    # and a single block takes no iterator. (aux: the restored count ``base``, an int, set by
    # ``on_insert``: the ``type: ignore``s below mark that read, policy.py says why.)

    def key(self, node: Node, hints: NodeHints) -> Key:
        i = self.aux_slot
        return ((node.aux if i is None else node.aux[i])  # type: ignore[index, operator]
                + node.hits, node.last_access)

    def new_index(self) -> FrequencyIndex:
        return FrequencyIndex()

    def insert_key(self, block_hash: bytes) -> int:
        """The count a block would be cached with: its remembered count + 1, else 0. The tree
        cuts a run of new blocks where this changes (so each node's blocks share it, as
        counts are per block) and lets new blocks join a run only if it has the same count
        (``can_extend``). A pure read, called per new block."""
        a, f = _unpack_slot(block_hash)
        s = a & self._mask
        return self._count[s] + 1 if self._fp[s] == f | 1 else 0

    def can_extend(self, node: Node, block_hash: bytes) -> bool:
        a, f = _unpack_slot(block_hash)
        s = a & self._mask
        i = self.aux_slot
        return (node.aux if i is None else node.aux[i]) == (  # type: ignore[index]
            self._count[s] + 1 if self._fp[s] == f | 1 else 0)

    def on_insert(self, node: Node, start: int, now: float) -> None:
        """The new blocks leave the table; a new node starts from its first block's count
        (the tree gave every block of it the same one: ``insert_key``)."""
        mask = self._mask
        base = 0
        if mask >= 0:
            fp = self._fp
            hashes = node.hashes
            rest = start
            if start == 0:
                a, f = _unpack_slot(hashes[0])
                s = a & mask
                if fp[s] == f | 1:
                    base = self._count[s] + 1
                    self.restored += 1
                    fp[s] = 0
                rest = 1
            if len(hashes) > rest:
                for a, f in map(_unpack_slot, islice(hashes, rest, None)):
                    s = a & mask
                    if fp[s] == f | 1:
                        fp[s] = 0
        if start == 0:
            self._set_aux(node, base)

    def on_leave(self, node: Node, k: int) -> None:
        """Blocks dropped from the last tier are remembered with their count."""
        mask = self._mask
        if node.tier != self._last_tier or mask < 0:
            return
        i = self.aux_slot
        c: int = ((node.aux if i is None else node.aux[i])  # type: ignore[index, operator]
                  + node.hits)
        if c > _MAX_COUNT:
            c = _MAX_COUNT
        fp, count = self._fp, self._count
        if k == 1:
            a, f = _unpack_slot(node.hashes[-1])
            s = a & mask
            fp[s] = f | 1
            count[s] = c
            return
        # deepest first, as they go (where two share a slot, the shallower one stays)
        for a, f in map(_unpack_slot, islice(reversed(node.hashes), k)):
            s = a & mask
            fp[s] = f | 1
            count[s] = c

    def remembered(self, block_hash: bytes) -> int | None:
        """The count the table holds for ``block_hash`` (None: not there). For tests."""
        if self._mask < 0:
            return None
        s, f = ghost_slot(block_hash, self._mask)
        return self._count[s] if self._fp[s] == f else None
