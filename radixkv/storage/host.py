"""The host tier: CPU RAM, block-major, pinned when CUDA is present.

``blocks: [num_slots, num_layers, 2, block_size, kv_heads, head_dim]``. Block-major (unlike the
device pool) because every host transfer moves whole blocks: one slot is one contiguous run of
``bytes_per_block`` bytes, which the disk store writes and reads in place (``slot_view``) and
which a device copy moves as a single DMA when the memory is pinned.

Slots are addressed by index; which slot is free or holds which block hash is the bookkeeping
layer's business. As a :class:`~radixkv.storage.backend.StorageBackend` the pool's key is the
slot: ``contains_many`` tells which slots hold a block written since their last
``remove_many`` (by ``put_many``, ``write_slots`` or a transfer that called ``mark_filled``).
RAM has no stored form to corrupt or truncate, so a read of a filled slot always verifies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from radixkv.errors import ConfigError, InvalidBlockError
from radixkv.storage.backend import BlockWrite, Pins, PutResult, block_view, check_outs
from radixkv.storage.buffers import byte_view, check_blocks, index_tensor, torch_dtype
from radixkv.storage.layout import KVLayout

if TYPE_CHECKING:
    from typing_extensions import Buffer


class HostPool:
    """Byte storage of the host tier: ``num_slots`` blocks of ``layout`` in CPU RAM.

    Args:
        layout: block geometry and dtype.
        num_slots: capacity in blocks (slots ``0 .. num_slots-1``).
        pin_memory: page-lock the buffer; ``None`` (auto) pins exactly when CUDA is available,
            since pinned memory is what lets host<->device copies run asynchronously at full
            bandwidth, and pinning without CUDA is not possible.
    """

    def __init__(self, layout: KVLayout, num_slots: int, pin_memory: bool | None = None) -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ConfigError(f"HostPool needs num_slots > 0, got {num_slots!r}")
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.layout = layout
        self.num_slots = num_slots
        self.pinned = bool(pin_memory)
        self.blocks = torch.zeros((num_slots, *layout.block_shape),
                                  dtype=torch_dtype(layout.dtype), pin_memory=self.pinned)
        self._bytes: memoryview | None = None  # byte view of ``blocks``, made on first use
        self._filled = bytearray(num_slots)     # 1: the slot holds a block (StorageBackend)
        self._pins: Pins[int] = Pins()

    @property
    def num_bytes(self) -> int:
        """Bytes held by the pool."""
        return self.num_slots * self.layout.bytes_per_block

    def slot_view(self, slot: int) -> torch.Tensor:
        """The live ``[L, 2, block_size, h, d]`` view of one slot (writes go into the pool)."""
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"host slot {slot} outside [0, {self.num_slots})")
        return self.blocks[slot]

    def slot_bytes(self, slot: int) -> memoryview:
        """Writable flat byte view of one slot (aliases the pool, like ``slot_view``): what the
        disk store reads into and writes from. A slice of one view of the whole pool, so it
        costs a slice (~0.1 us), not a tensor->bytes conversion per block."""
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"host slot {slot} outside [0, {self.num_slots})")
        if self._bytes is None:
            self._bytes = byte_view(self.blocks)
        n = self.layout.bytes_per_block
        return self._bytes[slot * n:(slot + 1) * n]

    def read_slots(self, slots: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy of slots as ``[n, L, 2, block_size, h, d]`` (into ``out`` when given, e.g. a
        pinned staging buffer)."""
        idx = index_tensor(slots, self.num_slots, "host slots")
        if out is not None:
            check_blocks(out, self.layout, len(idx), "HostPool.read_slots(out=)")
            return torch.index_select(self.blocks, 0, idx, out=out)
        return self.blocks.index_select(0, idx)

    def write_slots(self, slots: Sequence[int], blocks: torch.Tensor) -> None:
        """Write ``blocks [n, L, 2, block_size, h, d]`` (any device) into distinct ``slots``.

        A CUDA source is copied synchronously here; the transfer engine does the asynchronous
        version on its own stream.
        """
        idx = index_tensor(slots, self.num_slots, "host slots", unique=True)
        check_blocks(blocks, self.layout, len(idx), "HostPool.write_slots")
        self.blocks.index_copy_(0, idx, blocks.to("cpu"))
        self.mark_filled(slots)

    # ---- the StorageBackend interface (radixkv/storage/backend.py); keys are slots ----------
    def _check_slots(self, slots: Iterable[object], what: str) -> list[int]:
        out = []
        for s in slots:
            if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < self.num_slots:
                raise InvalidBlockError(f"{what}: host slot {s!r} is not an int in "
                                        f"[0, {self.num_slots})")
            out.append(s)
        return out

    def mark_filled(self, slots: Iterable[int]) -> None:
        """Record that ``slots`` now hold blocks (the transfer engine calls it after writing
        slots through ``blocks`` directly). O(len(slots))."""
        filled = self._filled
        for s in slots:
            filled[s] = 1

    def contains_many(self, keys: Sequence[int]) -> list[bool]:
        """Per slot, whether it holds a block written since its last :meth:`remove_many`."""
        return [bool(self._filled[s]) for s in self._check_slots(keys, "HostPool.contains_many")]

    def read_into_many(self, keys: Sequence[int], outs: Sequence[Buffer]) -> list[bool]:
        """Copy filled slots into ``outs`` (``bytes_per_block`` writable bytes each); an
        unfilled slot is a miss and leaves its buffer untouched."""
        slots = self._check_slots(keys, "HostPool.read_into_many")
        views = check_outs(slots, outs, self.layout.bytes_per_block,
                           "HostPool.read_into_many(outs=)")
        ok = []
        for s, v in zip(slots, views):
            if self._filled[s]:
                v[:] = self.slot_bytes(s)
            ok.append(bool(self._filled[s]))
        return ok

    def put_many(self, blocks: Sequence[BlockWrite[int]]) -> PutResult:
        """Copy each payload into its slot (``BlockWrite.key``; parent hash and token ids are
        the tree's, ignored here). Validates every item first (slots in range and distinct,
        payloads ``bytes_per_block`` bytes); a memory copy cannot fail, so all are True."""
        n = self.layout.bytes_per_block
        slots = self._check_slots((b[0] for b in blocks), "HostPool.put_many")
        if len(set(slots)) != len(slots):
            raise InvalidBlockError(f"HostPool.put_many: duplicate slots {sorted(slots)[:10]}")
        views = [block_view(b[3], n, "HostPool.put_many") for b in blocks]
        for s, v in zip(slots, views):
            self.slot_bytes(s)[:] = v
        self.mark_filled(slots)
        return PutResult([True] * len(slots))

    def pin(self, keys: Iterable[int]) -> None:
        """Keep these slots from :meth:`remove_many` (the tree's residency is unaffected)."""
        self._pins.pin(self._check_slots(keys, "HostPool.pin"))

    def unpin(self, keys: Iterable[int]) -> None:
        self._pins.unpin(keys)

    def remove_many(self, keys: Sequence[int]) -> int:
        """Mark unpinned slots empty (the bytes stay until overwritten); how many were
        filled."""
        slots = self._check_slots(keys, "HostPool.remove_many")
        removed = 0
        for s in slots:
            if self._filled[s] and not self._pins.pinned(s):
                self._filled[s] = 0
                removed += 1
        return removed

    def close(self) -> None:
        """Nothing to release: the memory goes with the pool object."""


__all__ = ["HostPool"]
