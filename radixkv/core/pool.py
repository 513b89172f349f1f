"""BlockPool: the physical block_ids of one tier, with reference counts and a free list.

Pure bookkeeping: a block id is an index into the tier's storage tensor (or file set); the pool
never touches bytes. Per-block state is packed (``array``: 4 bytes a reference count, 4 a free-list
entry, 1 a free flag) and the tree keeps its runs' block ids packed too (``Node.block_ids``), so no
block id costs a Python ``int`` object anywhere while it is cached: the metadata per cached block is
what issue 14 counts, and 36 of its bytes were a list of canonical ids.

Invariant (checked by ``check_invariants``): every block is either free (refcount 0, on the free
list exactly once) or allocated (off the free list). Allocated blocks are owned by the caller
(the tree caches them; sequences reference them with refcounts).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import NewType, TypeVar

from radixkv.errors import ConfigError, InvalidBlockError, OutOfBlocks

_T = TypeVar("_T")

BlockId = NewType("BlockId", int)


class BlockPool:
    """Fixed number of blocks, a LIFO free list and per-block reference counts.

    >>> pool = BlockPool(4)
    >>> pool.allocate(2)
    [0, 1]
    >>> pool.num_free
    2
    """

    __slots__ = ("num_blocks", "ref_counts", "_free", "_is_free")

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ConfigError(
                f"a pool needs a positive integer number of blocks, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.ref_counts = array("i", bytes(4 * num_blocks))
        self._free = array("i", range(num_blocks - 1, -1, -1))  # pop() from the end: lowest first
        self._is_free = bytearray(b"\x01") * num_blocks

    @property
    def num_free(self) -> int:
        """Number of free blocks. Runtime complexity: O(1)."""
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[BlockId]:
        """Take ``num_blocks`` free blocks (refcount stays 0; the caller increfs).

        All-or-nothing: raises OutOfBlocks and changes nothing if fewer are free.
        Eviction is the caller's job (the tree frees evicted blocks into the pool).
        Runtime complexity: O(num_blocks).
        """
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidBlockError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_blocks > len(self._free):
            raise OutOfBlocks(num_blocks, len(self._free), 0)
        if num_blocks == 0:
            return []
        taken = self._free[-num_blocks:].tolist()   # the ints made once
        del self._free[-num_blocks:]
        taken.reverse()
        is_free = self._is_free
        for b in taken:
            is_free[b] = 0
        return taken  # type: ignore[return-value]

    def allocate_held(self, num_blocks: int) -> list[BlockId]:
        """``allocate`` for a caller that takes one reference on each block at once (a new
        sequence's private blocks): one pass instead of two. The caller checked there are
        enough free blocks. Runtime complexity: O(num_blocks)."""
        if not num_blocks:
            return []
        free = self._free
        taken = free[-num_blocks:].tolist()   # the ints made once
        del free[-num_blocks:]
        taken.reverse()
        is_free, refs = self._is_free, self.ref_counts
        for b in taken:
            is_free[b] = 0
            refs[b] = 1
        return taken  # type: ignore[return-value]

    def allocate_one(self) -> BlockId:
        """Take one free block. Runtime complexity: O(1)."""
        if not self._free:
            raise OutOfBlocks(1, 0, 0)
        b = self._free.pop()
        self._is_free[b] = 0
        return b  # type: ignore[return-value]

    def free(self, block_ids: Iterable[int]) -> None:
        """Return unreferenced blocks to the free list (all-or-nothing validation first)."""
        ids = list(block_ids)
        seen: set[int] = set()
        for b in ids:
            self._check_id(b)
            if self._is_free[b] or b in seen:
                raise InvalidBlockError(f"block {b} is already free (double free)")
            if self.ref_counts[b]:
                raise InvalidBlockError(f"block {b} still has {self.ref_counts[b]} references")
            seen.add(b)
        for b in ids:
            self._is_free[b] = 1
            self._free.append(b)

    def free_one(self, block_id: int) -> None:
        """Return one unreferenced allocated block (internal fast path; asserts its state)."""
        assert not self._is_free[block_id] and self.ref_counts[block_id] == 0, (
            f"free_one({block_id}): is_free={self._is_free[block_id]} "
            f"refs={self.ref_counts[block_id]}")
        self._is_free[block_id] = 1
        self._free.append(block_id)

    def take_top(self, num_blocks: int) -> array[int]:
        """Take the top ``num_blocks`` of the free list (the caller checked there are that
        many), as an ``array("i")`` in free-list order: its *last* entry is the block
        ``allocate_one`` would have returned first. Refcounts stay 0. Internal fast path of
        the tree's demotions (no int object per block). Runtime complexity: O(num_blocks)."""
        free = self._free
        taken = free[-num_blocks:]
        del free[-num_blocks:]
        is_free = self._is_free
        for b in taken:
            is_free[b] = 0
        return taken

    def free_run(self, block_ids: array[int], owners: list[_T | None] | None = None) -> None:
        """Return unreferenced allocated blocks, pushed in the order given (the last one is
        allocated first next). ``owners``: a list indexed by block id (the tree's block id -> node
        map) whose entries for these blocks are reset to None in the same pass: one loop over
        the blocks instead of two, on the eviction path. Internal fast path: no validation
        (``check_invariants`` catches a misuse). Runtime complexity: O(len(block_ids))."""
        is_free = self._is_free
        if owners is None:
            for b in block_ids:
                is_free[b] = 1
        else:
            for b in block_ids:
                is_free[b] = 1
                owners[b] = None
        self._free.extend(block_ids)

    def is_free(self, block_id: int) -> bool:
        self._check_id(block_id)
        return bool(self._is_free[block_id])

    def _check_id(self, b: object) -> None:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
            raise InvalidBlockError(f"block id {b!r} is outside [0, {self.num_blocks})")

    def check_invariants(self) -> None:
        """Raise AssertionError with the numbers that disagree if the pool is inconsistent."""
        free = self._free
        assert len(set(free)) == len(free), f"free list has {len(free) - len(set(free))} duplicates"
        flagged = sum(self._is_free)
        assert flagged == len(free), f"{flagged} blocks flagged free but free list has {len(free)}"
        for b in free:
            assert self._is_free[b], f"block {b} on the free list is not flagged free"
            assert self.ref_counts[b] == 0, f"free block {b} has refcount {self.ref_counts[b]}"
        bad = [b for b, r in enumerate(self.ref_counts) if r < 0]
        assert not bad, f"negative refcounts on blocks {bad[:10]}"
