"""The engine's hook into KV storage: run the block manager's moves and copies on real memory.

The bookkeeping layer decides *what* happens to blocks; a ``KVMover`` makes it so, before the
forward that depends on it. The engine calls it with operations in the exact order the block
manager produced them (tier moves of an allocation or append first, then its copy-on-write copy):

* ``apply_moves(moves)``: ``MoveOp(block_hash, src_tier, src_slot, dst_tier, dst_slot)``;
  ``dst_tier None`` means the block left the cache (nothing to copy). Device -> host/disk is a
  demotion, host/disk -> device a promotion (the device block must hold the bytes on return).
* ``copy_blocks(copies)``: ``CopyOp(src, dst)`` device block copies (copy-on-write of a shared
  partial tail after ``fork``).

``DeviceOnlyMover`` is the mover of an engine without host/disk tiers. A tiered mover (host RAM,
NVMe) implements the same protocol over ``radixkv.storage``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from radixkv.core.block_manager import CopyOp
from radixkv.core.tree import DEVICE, MoveOp
from radixkv.errors import ConfigError


@runtime_checkable
class KVMover(Protocol):
    """Executes block moves and copies on the KV memory (see module docstring)."""

    def apply_moves(self, moves: Sequence[MoveOp]) -> None: ...

    def copy_blocks(self, copies: Sequence[CopyOp]) -> None: ...


def _copy_blocks_kernel():
    """``radixkv.kernels.copy_blocks`` when the kernels package provides it, else the torch
    reference (the kernels land separately; both have the same signature)."""
    from radixkv import kernels

    fn = getattr(kernels, "copy_blocks", None)
    if fn is None:
        from radixkv.kernels import reference

        fn = reference.copy_blocks
    return fn


class DeviceOnlyMover:
    """Mover for a device-only cache: moves can only be drops; copies run on the pool tensor.

    Args:
        kv_cache: ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.num_copies = 0
        self.num_drops = 0

    def apply_moves(self, moves: Sequence[MoveOp]) -> None:
        for m in moves:
            if m.dst_tier is not None or m.src_tier != DEVICE:
                raise ConfigError(
                    f"device-only KV mover got a tier move {m}: configure host/disk tiers "
                    "with a tiered mover (LLMEngine(kv_mover=...))")
            self.num_drops += 1

    def copy_blocks(self, copies: Sequence[CopyOp]) -> None:
        if not copies:
            return
        dev = self.kv_cache.device
        src = torch.tensor([c.src for c in copies], dtype=torch.long, device=dev)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=dev)
        _copy_blocks_kernel()(self.kv_cache, src, dst)
        self.num_copies += len(copies)


def run_kv_ops(mover: KVMover, ops: Sequence[MoveOp | CopyOp]) -> None:
    """Dispatch ``ops`` to ``mover`` in order, batching consecutive ops of the same kind."""
    i = 0
    while i < len(ops):
        j = i
        kind = type(ops[i])
        while j < len(ops) and type(ops[j]) is kind:
            j += 1
        if kind is CopyOp:
            mover.copy_blocks(ops[i:j])  # type: ignore[arg-type]
        else:
            mover.apply_moves(ops[i:j])  # type: ignore[arg-type]
        i = j


__all__ = ["KVMover", "DeviceOnlyMover", "run_kv_ops"]
