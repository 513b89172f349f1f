"""Decoding through the block manager: a slot for each new token's KV, and copy-on-write.

``DecodeOps`` is a mixin of ``BlockManager``: ``append_slot`` (the per-token hot path of a
decode step), ``append_slots`` (a chunk, a replayed reply, speculative tokens) and
``blocks_needed_to_append`` (what the scheduler reserves before a step). A sequence's last
block may be partial and belongs to it (and to its fork siblings) only; a new block is taken at
a block boundary, and a shared partial tail is copied first (``CopyOp``), so that a sequence
never writes into a block another one reads (invariant 4). Committing full blocks to the tree
is ``BlockManager.commit``.

Pure Python: this module imports no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from radixkv.core.hashing import TOKEN_BYTES, token_bytes
from radixkv.core.node import DEVICE, MoveOp
from radixkv.errors import InvalidTokensError, OutOfBlocks

if TYPE_CHECKING:
    from radixkv.core.pool import BlockPool
    from radixkv.core.tree import RadixTree

SeqId = Hashable
_tuple_new = tuple.__new__


class CopyOp(NamedTuple):
    """Copy device block ``src`` onto device block ``dst`` (copy-on-write of a shared tail)."""

    src: int
    dst: int


class SlotAssignment(NamedTuple):
    """Where the KV of a sequence's newest token goes, and what must run before writing it.

    ``slot = block_id * block_size + offset``. ``moves`` (tier demotions caused by allocating a
    new block) run first, then ``copy`` (if the tail block was shared), then the write.
    """

    slot: int
    copy: CopyOp | None
    moves: tuple[MoveOp, ...]


class DecodeOps:
    """Decode-time slots of ``BlockManager`` (a mixin; see the module docstring)."""

    tree: RadixTree
    pool: BlockPool
    block_size: int

    if TYPE_CHECKING:  # BlockManager's own helpers, used here
        def _seq(self, seq_id: SeqId) -> object: ...
        def _take_blocks(self, n: int, moves: list[MoveOp], held: bool = False) -> list[int]: ...
        def _blocks_for(self, num_tokens: int) -> int: ...
        @property
        def num_available_blocks(self) -> int: ...

    def blocks_needed_to_append(self, seq_id: SeqId) -> int:
        """Device blocks the next ``append_slot`` takes: 1 at a block boundary or CoW, else 0."""
        s = self._seq(seq_id)
        if len(s.tokens) % self.block_size == 0:
            return 1
        return 1 if self.pool.ref_counts[s.blocks[-1]] > 1 else 0

    def append_slot(self, seq_id: SeqId, token_id: int) -> SlotAssignment:
        """Append one token and return the slot for its KV (plus a CoW copy if needed).

        A new block is taken at a block boundary; a shared partial tail (after ``fork``) is
        copied first so that this sequence never writes into a block others read.
        All-or-nothing (OutOfBlocks changes nothing). Runtime complexity: O(1) amortised.
        This is the per-token hot path of decoding: it allocates one tuple in the common case.
        """
        try:
            s = self._seqs[seq_id]
        except (KeyError, TypeError):
            s = self._seq(seq_id)  # raises UnknownSequenceError
        if type(token_id) is not int or not 0 <= token_id <= 0x7FFFFFFF:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < 2**31:
                raise InvalidTokensError(f"token id must be an int in [0, 2**31), got {token_id!r}")
        bs = self.block_size
        tokens = s.tokens
        off = len(tokens) % bs
        refs = self.pool.ref_counts
        if off and refs[s.blocks[-1]] == 1:
            tokens.append(token_id)
            return _tuple_new(SlotAssignment, (s.blocks[-1] * bs + off, None, ()))
        if self.pool.num_free == 0 and self.tree.num_evictable(DEVICE) == 0:
            raise OutOfBlocks(1, 0, 0, "preempt a sequence (free it and recompute later)")
        moves: list[MoveOp] = []
        [b] = self._take_blocks(1, moves)
        refs[b] += 1
        copy = None
        if off:
            old = s.blocks[-1]
            refs[old] -= 1   # was > 1: still referenced by a fork, never freed here
            s.blocks[-1] = b
            copy = CopyOp(old, b)
        else:
            s.blocks.append(b)
        tokens.append(token_id)
        return SlotAssignment(b * bs + off, copy, tuple(moves))

    def append_slots(self, seq_id: SeqId, token_ids: Sequence[int]) -> tuple[list[int], CopyOp | None, tuple[MoveOp, ...]]:
        """Append several tokens at once (a chunk, a replayed reply, speculative tokens).

        Returns ``(slots, copy, moves)``: one KV slot per token, the CoW copy of a shared tail
        (if any) and the demotions that made room; same contract as ``append_slot``.
        All-or-nothing. Runtime complexity: O(tokens + new blocks * log n).
        """
        s = self._seq(seq_id)
        tok = token_bytes(token_ids)  # validates
        n = len(tok) // TOKEN_BYTES
        bs, refs = self.block_size, self.pool.ref_counts
        pos = len(s.tokens)
        cow = pos % bs != 0 and refs[s.blocks[-1]] > 1
        new_blocks = self._blocks_for(pos + n) - len(s.blocks) + (1 if cow else 0)
        if new_blocks > self.num_available_blocks:
            raise OutOfBlocks(new_blocks, self.pool.num_free, self.tree.num_evictable(DEVICE),
                              "preempt a sequence (free it and recompute later)")
        moves: list[MoveOp] = []
        fresh = self._take_blocks(new_blocks, moves)
        for b in fresh:
            refs[b] += 1
        copy = None
        if cow:
            old, b = s.blocks[-1], fresh.pop(0)
            refs[old] -= 1
            s.blocks[-1] = b
            copy = CopyOp(old, b)
        s.blocks.extend(fresh)
        s.tokens.extend(array("i", tok))
        # Slots block by block: one range per block instead of a divmod per token; the partial
        # head and tail blocks apart, so a full block costs a multiply and a range.
        slots: list[int] = []
        extend = slots.extend
        blocks = s.blocks
        i, off = divmod(pos, bs)
        left = n
        if off:
            k = left if left < bs - off else bs - off
            base = blocks[i] * bs + off
            extend(range(base, base + k))
            left -= k
            i += 1
        full, tail = divmod(left, bs)
        for b in blocks[i:i + full]:
            b *= bs
            extend(range(b, b + bs))
        if tail:
            b = blocks[i + full] * bs
            extend(range(b, b + tail))
        return slots, copy, tuple(moves)
