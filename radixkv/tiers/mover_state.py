"""The tiered mover's small types: its counters (``MoverStats``), the batches it leaves running
(``_Pending``), the outcome of a batch of staged file writes, and a ``DevicePool`` view of the
model runner's cache tensor. Kept apart from ``tiered_mover.py`` (the move logic)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from radixkv.core.tree import MoveOp
from radixkv.errors import ConfigError, StorageError
from radixkv.storage.device import DevicePool
from radixkv.storage.layout import KVLayout
from radixkv.tiers.transfer import Batch


class _Outcome(NamedTuple):
    """Per-move outcome of a batch of staged file writes (like ``BatchResult``)."""

    ok: tuple[bool, ...]
    errors: tuple[str | None, ...]


@dataclass
class _Pending:
    """A batch left running past ``apply_moves``: ``kind`` is ``"write"`` (staged file writes:
    ``writes`` holds their futures, each the move's error or None), ``"prefetch"`` (disk ->
    host) or ``"load"`` (host/disk -> device, with ``async_loads``; ``dev``/``host_src``:
    device blocks it writes, host blocks it reads); those two are a transfer engine ``batch``."""

    ops: list[MoveOp]
    direction: str
    kind: str
    batch: Batch | None = None
    writes: list[Future[str | None]] = field(default_factory=list)
    dev: frozenset[int] = frozenset()
    host_src: frozenset[int] = frozenset()

    @property
    def transfer(self) -> Batch:
        """The transfer engine batch of a prefetch or a load."""
        if self.batch is None:
            raise StorageError(f"a pending {self.kind} of {len(self.ops)} moves has no batch")
        return self.batch


def wrap_device_pool(kv_cache: torch.Tensor, layout: KVLayout) -> DevicePool:
    """A :class:`DevicePool` over an existing cache tensor (the model runner's), no copy."""
    want = layout.cache_shape(int(kv_cache.shape[2]))
    if tuple(kv_cache.shape) != want:
        raise ConfigError(f"kv_cache shape {tuple(kv_cache.shape)} does not match {want}")
    pool = DevicePool.__new__(DevicePool)
    pool.layout = layout
    pool.num_blocks = int(kv_cache.shape[2])
    pool.device = kv_cache.device
    pool.kv_cache = kv_cache
    return pool


@dataclass
class MoverStats:
    """Counters of a TieredKVMover. Directions are ``"device->host"``, ``"disk->device"``, ...;
    bytes are block payload bytes of moves that landed."""

    moves: dict[str, int] = field(default_factory=dict)
    bytes_moved: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    drops: int = 0
    files_removed: int = 0
    load_failures: int = 0       # promotions from disk whose read failed (block recomputed)
    write_failures: int = 0      # demotions to disk whose write failed (block dropped)
    skipped_writes: int = 0      # demotions of blocks dropped later in the same list
    invalidated_blocks: int = 0  # nodes dropped because of a failed write (with subtrees)
    copies: int = 0
    async_batches: int = 0       # batches left running past apply_moves (write-behind, prefetch)
    prefetched_blocks: int = 0   # blocks loaded disk -> host ahead of their request
    prefetch_hits: int = 0       # prefetched blocks later promoted host -> device
    prefetch_failures: int = 0   # prefetch loads that failed (block dropped, recomputed)
    async_loads: int = 0         # promotion batches left running past apply_moves
    dropped_copies: int = 0      # write-through copies dropped because their write failed

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self).items()}


__all__ = ["MoverStats", "wrap_device_pool"]
