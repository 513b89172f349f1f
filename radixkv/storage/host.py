"""The host tier: CPU RAM, block-major, pinned when CUDA is present.

``blocks: [num_slots, num_layers, 2, block_size, kv_heads, head_dim]``. Block-major (unlike the
device pool) because every host transfer moves whole blocks: one slot is one contiguous run of
``bytes_per_block`` bytes, which the disk store writes and reads in place (``slot_view``) and
which a device copy moves as a single DMA when the memory is pinned.

Slots are addressed by index; which slot is free or holds which block hash is the bookkeeping
layer's business.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.errors import ConfigError
from radixkv.storage.buffers import byte_view, check_blocks, index_tensor, torch_dtype
from radixkv.storage.layout import KVLayout


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


__all__ = ["HostPool"]
