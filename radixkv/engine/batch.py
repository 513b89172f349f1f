"""The forward-batch metadata: where lists of ints from the scheduler become tensors, once.

The scheduler and block manager are pure Python (no torch). For one model step they hand the
runner one :class:`SequenceChunk` per sequence: the tokens to compute now, where they start, the
sequence's block table and the slot each new token's K/V goes to. :meth:`ForwardBatch.build`
validates those lists and turns them into the tensors the model and the paged kernels read.
Nothing else in radixkv converts scheduler lists to tensors (STYLE habit 1).

Packing (varlen, batch size 1). Sequences are concatenated along one token axis; a worked example
with ``block_size = 4`` and two sequences::

    seq 0: 6 tokens cached, computes 3 more   start_position=6  token_ids=[a, b, c]
           block_table=[7, 2, 5]   (positions 0-3 in block 7, 4-7 in block 2, 8 in block 5)
           slot_mapping=[10, 11, 20]   (2*4+2, 2*4+3, 5*4+0)
    seq 1: nothing cached, computes 2         start_position=0  token_ids=[x, y]
           block_table=[3], slot_mapping=[12, 13]

    input_ids     [[a, b, c, x, y]]          int64 [1, num_tokens]
    position_ids  [[6, 7, 8, 0, 1]]          int64 [1, num_tokens]
    slot_mapping  [10, 11, 20, 12, 13]       int64 [num_tokens]
    cu_seqlens_q  [0, 3, 5]                  int32 [num_seqs + 1]
    seq_lens      [9, 2]                     int32 [num_seqs]   (cached + new tokens)
    block_tables  [[7, 2, 5], [3, 0, 0]]     int32 [num_seqs, max_blocks]  (padding never read)
    logits_indices [2, 4]                    int64 [num_logits] (rows of the packed axis)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixkv.errors import InvalidBlockError, InvalidTokensError

#: Value written into the unused tail of a block-table row. The kernels read a row only up to
#: ``ceil(seq_len / block_size)`` entries, so the value is never dereferenced; 0 keeps it a valid
#: block id should a kernel bug ever read it (a wrong answer the tests catch, not a fault).
BLOCK_TABLE_PAD = 0


class AttentionMode(enum.Enum):
    """Which paged kernel the attention layers call for a batch."""

    #: ``paged_prefill_attention``: any number of new tokens per sequence (chunked prefill too).
    PREFILL = "prefill"
    #: ``paged_decode_attention``: exactly one new token per sequence.
    DECODE = "decode"


class SequenceChunk(NamedTuple):
    """The work for one sequence in one model step, as plain Python lists (immutable: a
    NamedTuple, made once per sequence per step, half the cost of a frozen dataclass).

    Attributes:
        token_ids: tokens whose K/V and hidden states are computed now (``num_new >= 1``).
        start_position: number of tokens of this sequence already in the KV cache; also the
            position of ``token_ids[0]``.
        block_table: block ids holding positions ``[0, start_position + num_new)`` in order;
            entry ``j`` covers positions ``[j * block_size, (j + 1) * block_size)``.
        slot_mapping: for each new token, ``block_id * block_size + offset`` where its K/V goes;
            it must agree with ``block_table`` (checked in :meth:`ForwardBatch.build`).
        logit_offsets: offsets into ``token_ids`` whose next-token logits are wanted; ``None``
            means the last token only (ordinary generation), ``()`` means none (a prefill chunk
            that does not end the prompt).
    """

    token_ids: Sequence[int]
    start_position: int
    block_table: Sequence[int]
    slot_mapping: Sequence[int]
    logit_offsets: Sequence[int] | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the cache once this chunk is written: cached prefix + new tokens."""
        return self.start_position + len(self.token_ids)

    def resolved_logit_offsets(self) -> tuple[int, ...]:
        """``logit_offsets`` with ``None`` resolved to the last token."""
        if self.logit_offsets is None:
            return (len(self.token_ids) - 1,)
        return tuple(self.logit_offsets)


def _check_chunk(index: int, chunk: SequenceChunk, block_size: int) -> None:
    """Raise with the numbers that disagree if ``chunk`` is not internally consistent.

    Runtime complexity: O(num_new_tokens + len(block_table)).
    """
    n = len(chunk.token_ids)
    if n == 0:
        raise InvalidTokensError(f"sequence {index}: no tokens to compute")
    if chunk.start_position < 0:
        raise InvalidTokensError(f"sequence {index}: start_position {chunk.start_position} < 0")
    if len(chunk.slot_mapping) != n:
        raise InvalidBlockError(
            f"sequence {index}: {n} new tokens but {len(chunk.slot_mapping)} slots")
    blocks_needed = -(-chunk.seq_len // block_size)
    if len(chunk.block_table) < blocks_needed:
        raise InvalidBlockError(
            f"sequence {index}: {chunk.seq_len} tokens need {blocks_needed} blocks of "
            f"{block_size}, block table has {len(chunk.block_table)}")
    for i, slot in enumerate(chunk.slot_mapping):
        pos = chunk.start_position + i
        want = chunk.block_table[pos // block_size] * block_size + pos % block_size
        if slot != want:
            raise InvalidBlockError(
                f"sequence {index}: token {i} (position {pos}) maps to slot {slot}, but block "
                f"table entry {pos // block_size} = block {chunk.block_table[pos // block_size]} "
                f"puts it at slot {want}")
    for off in chunk.resolved_logit_offsets():
        if not 0 <= off < n:
            raise InvalidTokensError(
                f"sequence {index}: logit offset {off} outside the chunk's {n} tokens")


@dataclass(frozen=True)
class ForwardBatch:
    """Device tensors and host-side sizes for one packed model step (see the module docstring).

    Attributes (``T`` = num_tokens, ``S`` = num_seqs, ``R`` = num_logits):
        mode: which paged attention kernel the layers call.
        input_ids: int64 ``[1, T]``, all sequences' new tokens concatenated.
        position_ids: int64 ``[1, T]``, each token's position within its own sequence.
        slot_mapping: int64 ``[T]``, the KV-cache slot each new token is written to.
        cu_seqlens_q: int32 ``[S + 1]``, sequence ``s`` owns packed rows
            ``[cu_seqlens_q[s], cu_seqlens_q[s+1])``.
        seq_lens: int32 ``[S]``, tokens in the cache per sequence after this step.
        block_tables: int32 ``[S, max_blocks]``, rows padded with ``BLOCK_TABLE_PAD``.
        logits_indices: int64 ``[R]``, packed rows whose logits the caller wants, in sequence
            order and, within a sequence, in the order of its ``logit_offsets``.
        logits_per_seq: ``R`` split by sequence (host ints), to map logits rows back.
        block_size: tokens per block the slots and tables were computed with.
        num_tokens, num_seqs, max_seq_len, max_block_id, max_token_id, min_token_id: host ints
            so the runner and the attention function validate without a device sync.
        host_cu_seqlens_q, host_seq_lens: ``cu_seqlens_q`` and ``seq_lens`` as host ints, for
            the paths that decide per sequence (windowed / soft-capped attention) and the CPU
            decode planning (no read-back of the tensors).
        has_pad_slots: ``slot_mapping`` may hold ``PAD_SLOT`` rows (a CUDA-graph batch padded
            to its bucket); :meth:`build` never makes them, so the K/V write needs no mask.
    """

    mode: AttentionMode
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    logits_per_seq: tuple[int, ...]
    block_size: int
    num_tokens: int
    num_seqs: int
    max_seq_len: int
    max_block_id: int
    max_token_id: int
    min_token_id: int
    host_cu_seqlens_q: tuple[int, ...] = ()
    host_seq_lens: tuple[int, ...] = ()
    has_pad_slots: bool = False

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], block_size: int,
              device: torch.device | str = "cpu",
              mode: AttentionMode | None = None) -> ForwardBatch:
        """Validate the per-sequence lists and pack them into tensors on ``device``.

        ``mode=None`` picks DECODE when every sequence computes exactly one token, else PREFILL.
        Asking for DECODE with a multi-token chunk raises; PREFILL is always allowed (a decode
        step through the prefill kernel gives the same result, which the tests check).

        Runtime complexity: O(T + S * max_blocks) Python work, two host-to-device copies (the
        int64 fields, the int32 fields: each field is a view of one of them).
        """
        if not chunks:
            raise InvalidTokensError("a forward batch needs at least one sequence")
        if block_size <= 0:
            raise InvalidBlockError(f"block_size {block_size} must be positive")
        all_single = all(len(c.token_ids) == 1 for c in chunks)
        if mode is None:
            mode = AttentionMode.DECODE if all_single else AttentionMode.PREFILL
        elif mode is AttentionMode.DECODE and not all_single:
            for i, chunk in enumerate(chunks):
                _check_chunk(i, chunk, block_size)
            sizes = [len(c.token_ids) for c in chunks]
            raise InvalidTokensError(f"decode mode needs one token per sequence, got {sizes}")
        if all_single:
            return cls._build_single(chunks, block_size, torch.device(device), mode)
        return cls._build_packed(chunks, block_size, torch.device(device), mode)

    @classmethod
    def _build_packed(cls, chunks: Sequence[SequenceChunk], block_size: int,
                      dev: torch.device, mode: AttentionMode) -> ForwardBatch:
        """:meth:`build` for any chunk sizes: check each chunk, then pack."""
        for i, chunk in enumerate(chunks):
            _check_chunk(i, chunk, block_size)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        logits_per_seq: list[int] = []
        max_blocks = max(len(c.block_table) for c in chunks)
        tables: list[list[int]] = []
        for chunk in chunks:
            n = len(chunk.token_ids)
            row0 = cu_seqlens[-1]
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.start_position + n))
            slots.extend(chunk.slot_mapping)
            cu_seqlens.append(row0 + n)
            seq_lens.append(chunk.seq_len)
            offsets = chunk.resolved_logit_offsets()
            logits_indices.extend(row0 + off for off in offsets)
            logits_per_seq.append(len(offsets))
            table = list(chunk.block_table)
            tables.append(table + [BLOCK_TABLE_PAD] * (max_blocks - len(table)))

        flat_tables = [b for row in tables for b in row]
        max_block_id = max(max(c.block_table[: -(-c.seq_len // block_size)]) for c in chunks)
        return cls._pack(mode, dev, block_size, max_blocks, input_ids, positions, slots,
                         logits_indices, logits_per_seq, cu_seqlens, seq_lens, flat_tables,
                         max_block_id)

    @classmethod
    def _pack(cls, mode: AttentionMode, dev: torch.device, block_size: int, max_blocks: int,
              input_ids: list[int], positions: list[int], slots: list[int],
              logits_indices: list[int], logits_per_seq: list[int], cu_seqlens: list[int],
              seq_lens: list[int], flat_tables: list[int], max_block_id: int) -> ForwardBatch:
        """The batch from its host fields (both build paths end here): two host buffers (the
        int64 and the int32 fields), each copied to the device once; the fields are views of
        them. Pageable memory: pinning a fresh buffer per step costs more than the copy of a
        few kilobytes."""
        t, s, r = len(input_ids), len(seq_lens), len(logits_indices)
        wide = torch.tensor(input_ids + positions + slots + logits_indices,
                            dtype=torch.int64).to(dev, non_blocking=True)
        narrow = torch.tensor(cu_seqlens + seq_lens + flat_tables,
                              dtype=torch.int32).to(dev, non_blocking=True)
        return cls(
            mode=mode,
            input_ids=wide[:t].view(1, t),
            position_ids=wide[t:2 * t].view(1, t),
            slot_mapping=wide[2 * t:3 * t],
            cu_seqlens_q=narrow[:s + 1],
            seq_lens=narrow[s + 1:2 * s + 1],
            block_tables=narrow[2 * s + 1:].view(s, max_blocks),
            logits_indices=wide[3 * t:3 * t + r],
            logits_per_seq=tuple(logits_per_seq),
            block_size=block_size,
            num_tokens=t,
            num_seqs=s,
            max_seq_len=max(seq_lens),
            max_block_id=max_block_id,
            max_token_id=max(input_ids),
            min_token_id=min(input_ids),
            host_cu_seqlens_q=tuple(cu_seqlens),
            host_seq_lens=tuple(seq_lens),
        )

    @classmethod
    def _build_single(cls, chunks: Sequence[SequenceChunk], block_size: int, dev: torch.device,
                      mode: AttentionMode) -> ForwardBatch:
        """:meth:`build` of a batch where every chunk computes one token (a decode step):
        the same checks and tensors, in one pass per chunk without the general packing's
        per-token loops (the host's cost per sequence per decode step is what bounds a large
        decode batch). A chunk that fails a check is handed to ``_check_chunk``, which raises
        with its numbers.

        Runtime complexity: O(S * max_blocks), two host-to-device copies.
        """
        bs = block_size
        s = len(chunks)
        positions = [c.start_position for c in chunks]
        tables = [c.block_table for c in chunks]
        slot_lists = [c.slot_mapping for c in chunks]
        max_blocks = max(map(len, tables))
        exact = True   # every table holds exactly the blocks its sequence reads
        for i, (pos, table, slot) in enumerate(zip(positions, tables, slot_lists)):
            j = pos // bs   # the block of the new token: the last one the kernels read
            if pos < 0 or len(slot) != 1 or len(table) <= j or slot[0] != table[j] * bs + pos % bs:
                _check_chunk(i, chunks[i], bs)   # raises with the numbers that disagree
                raise AssertionError(f"chunk {i} failed the decode checks only: {chunks[i]}")
            if len(table) != j + 1:
                exact = False
        input_ids = [c.token_ids[0] for c in chunks]
        slots = [slot[0] for slot in slot_lists]
        seq_lens = [pos + 1 for pos in positions]
        if all(c.logit_offsets is None for c in chunks):   # ordinary generation
            logits_indices = list(range(s))
            logits_per_seq = [1] * s
        else:
            logits_indices, logits_per_seq = [], []
            for i, c in enumerate(chunks):
                offsets = c.logit_offsets
                if offsets is None:
                    offsets = (0,)
                elif any(off != 0 for off in offsets):
                    _check_chunk(i, c, bs)
                    raise AssertionError(f"chunk {i} failed the decode checks only: {c}")
                logits_indices.extend([i] * len(offsets))
                logits_per_seq.append(len(offsets))
        if all(len(t) == max_blocks for t in tables):
            flat_tables = [b for t in tables for b in t]
        else:
            pad = [BLOCK_TABLE_PAD] * max_blocks
            flat_tables = []
            for t in tables:
                flat_tables.extend(t)
                flat_tables.extend(pad[:max_blocks - len(t)])
        # the highest block a kernel reads (pads are 0, never above a real id)
        max_block_id = (max(flat_tables) if exact else
                        max(max(t[:p // bs + 1]) for t, p in zip(tables, positions)))
        return cls._pack(mode, dev, bs, max_blocks, input_ids, positions, slots,
                         logits_indices, logits_per_seq, list(range(s + 1)), seq_lens,
                         flat_tables, max_block_id)
