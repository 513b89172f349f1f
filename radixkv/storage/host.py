"""The host tier: CPU RAM, block-major, pinned when CUDA is present.

``blocks: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``. Block-major (unlike the
device pool) because every host transfer moves whole blocks: one block is one contiguous run of
``bytes_per_block`` bytes, which the disk store writes and reads in place (``block_bytes``) and
which a device copy moves as a single DMA when the memory is pinned.

Blocks are addressed by block id (the host tier's ``BlockId``, ``0 .. num_blocks-1``; "slot"
means a token slot elsewhere); which id is free or holds which block hash is the bookkeeping
layer's business. As a :class:`~radixkv.storage.backend.StorageBackend` the pool's key is the
block id: ``contains_many`` tells which ids hold a block written since their last
``remove_many`` (by ``put_many``, ``write_blocks`` or a transfer that called ``mark_filled``).
RAM has no stored form to corrupt or truncate, so a read of a filled block always verifies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from radixkv.errors import ConfigError, InvalidBlockError
from radixkv.storage.backend import (BlockWrite, Pins, PutResult, StorageBackend, block_view,
                                     check_outs)
from radixkv.storage.buffers import byte_view, check_blocks, index_tensor, torch_dtype
from radixkv.storage.layout import KVLayout

if TYPE_CHECKING:
    from typing_extensions import Buffer


class HostPool:
    """Byte storage of the host tier: ``num_blocks`` blocks of ``layout`` in CPU RAM.

    Args:
        layout: block geometry and dtype.
        num_blocks: capacity in blocks (block ids ``0 .. num_blocks-1``).
        pin_memory: page-lock the buffer; ``None`` (auto) pins exactly when CUDA is available,
            since pinned memory is what lets host<->device copies run asynchronously at full
            bandwidth, and pinning without CUDA is not possible.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, pin_memory: bool | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"HostPool needs num_blocks > 0, got {num_blocks!r}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.layout = layout
        self.num_blocks = num_blocks
        self.pinned = bool(pin_memory)
        self.blocks = torch.zeros((num_blocks, *layout.block_shape),
                                  dtype=torch_dtype(layout.dtype), pin_memory=self.pinned)
        self._bytes: memoryview | None = None  # byte view of ``blocks``, made on first use
        self._filled = bytearray(num_blocks)     # 1: the block id holds a block (StorageBackend)
        self._pins: Pins[int] = Pins()

    @property
    def num_bytes(self) -> int:
        """Bytes held by the pool."""
        return self.num_blocks * self.layout.bytes_per_block

    def block_tensor(self, block_id: int) -> torch.Tensor:
        """The live ``[L, 2, block_size, h, d]`` view of one block (writes go into the pool)."""
        if not 0 <= block_id < self.num_blocks:
            raise ConfigError(f"host block id {block_id} outside [0, {self.num_blocks})")
        return self.blocks[block_id]

    def block_bytes(self, block_id: int) -> memoryview:
        """Writable flat byte view of one block (aliases the pool, like ``block_tensor``): what the
        disk store reads into and writes from. A slice of one view of the whole pool, so it
        costs a slice (~0.1 us), not a tensor->bytes conversion per block."""
        if not 0 <= block_id < self.num_blocks:
            raise ConfigError(f"host block id {block_id} outside [0, {self.num_blocks})")
        if self._bytes is None:
            self._bytes = byte_view(self.blocks)
        n = self.layout.bytes_per_block
        return self._bytes[block_id * n:(block_id + 1) * n]

    def read_blocks(self, block_ids: Sequence[int], out: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """Copy of blocks ``block_ids`` as ``[n, L, 2, block_size, h, d]`` (into ``out`` when
        given, e.g. a pinned staging buffer)."""
        idx = index_tensor(block_ids, self.num_blocks, "host block ids")
        if out is not None:
            check_blocks(out, self.layout, len(idx), "HostPool.read_blocks(out=)")
            return torch.index_select(self.blocks, 0, idx, out=out)
        return self.blocks.index_select(0, idx)

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write ``blocks [n, L, 2, block_size, h, d]`` (any device) into distinct ``block_ids``.

        A CUDA source is copied synchronously here; the transfer engine does the asynchronous
        version on its own stream.
        """
        idx = index_tensor(block_ids, self.num_blocks, "host block ids", unique=True)
        check_blocks(blocks, self.layout, len(idx), "HostPool.write_blocks")
        self.blocks.index_copy_(0, idx, blocks.to("cpu"))
        self.mark_filled(block_ids)

    # ---- the StorageBackend interface (radixkv/storage/backend.py); keys are block ids ----------
    def _check_ids(self, block_ids: Iterable[object], what: str) -> list[int]:
        out = []
        for s in block_ids:
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < self.num_blocks:
                raise InvalidBlockError(f"{what}: host block id {s!r} is not an int in "
                                        f"[0, {self.num_blocks})")
            out.append(s)
        return out

    def mark_filled(self, block_ids: Iterable[int]) -> None:
        """Record that ``block_ids`` now hold blocks (the transfer engine calls it after writing
        them through ``blocks`` directly). O(len(block_ids))."""
        filled = self._filled
        for s in block_ids:
            filled[s] = 1

    def contains_many(self, keys: Sequence[int]) -> list[bool]:
        """Per block id, whether it holds a block written since its last :meth:`remove_many`."""
        return [bool(self._filled[s]) for s in self._check_ids(keys, "HostPool.contains_many")]

    def read_into_many(self, keys: Sequence[int], outs: Sequence[Buffer]) -> list[bool]:
        """Copy filled blocks into ``outs`` (``bytes_per_block`` writable bytes each); an
        unfilled block id is a miss and leaves its buffer untouched."""
        block_ids = self._check_ids(keys, "HostPool.read_into_many")
        views = check_outs(block_ids, outs, self.layout.bytes_per_block,
                           "HostPool.read_into_many(outs=)")
        ok = []
        for s, v in zip(block_ids, views):
            if self._filled[s]:
                v[:] = self.block_bytes(s)
            ok.append(bool(self._filled[s]))
        return ok

    def put_many(self, blocks: Sequence[BlockWrite[int]]) -> PutResult:
        """Copy each payload into its block id (``BlockWrite.key``; parent hash and token ids are
        the tree's, ignored here). Validates every item first (block ids in range and distinct,
        payloads ``bytes_per_block`` bytes); a memory copy cannot fail, so all are True."""
        n = self.layout.bytes_per_block
        block_ids = self._check_ids((b[0] for b in blocks), "HostPool.put_many")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidBlockError(f"HostPool.put_many: duplicate block ids "
                                    f"{sorted(block_ids)[:10]}")
        views = [block_view(b[3], n, "HostPool.put_many") for b in blocks]
        for s, v in zip(block_ids, views):
            self.block_bytes(s)[:] = v
        self.mark_filled(block_ids)
        return PutResult([True] * len(block_ids))

    def pin(self, keys: Iterable[int]) -> None:
        """Keep these blocks from :meth:`remove_many` (the tree's residency is unaffected)."""
        self._pins.pin(self._check_ids(keys, "HostPool.pin"))

    def unpin(self, keys: Iterable[int]) -> None:
        self._pins.unpin(keys)

    def remove_many(self, keys: Sequence[int]) -> int:
        """Mark unpinned blocks empty (the bytes stay until overwritten); how many were
        filled."""
        block_ids = self._check_ids(keys, "HostPool.remove_many")
        removed = 0
        for s in block_ids:
            if self._filled[s] and not self._pins.pinned(s):
                self._filled[s] = 0
                removed += 1
        return removed

    def close(self) -> None:
        """Nothing to release: the memory goes with the pool object."""



if TYPE_CHECKING:   # the type checker proves that HostPool implements the interface
    def _implements(store: HostPool) -> StorageBackend[int]:
        return store

__all__ = ["HostPool"]
