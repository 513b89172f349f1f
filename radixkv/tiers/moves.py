"""The vocabulary of the transfer engine: block locations, moves, batches and their results.

Plain dataclasses (no torch), kept apart from ``transfer.py`` (the engine that executes them)
so that callers building moves need not read the worker's code. ``transfer.py`` re-exports
every name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:   # (a type only: this module stays torch-free)
    import torch


@dataclass(frozen=True)
class DeviceBlock:
    """A block id of the device pool."""

    block_id: int


@dataclass(frozen=True)
class HostBlock:
    """A block id of the host pool."""

    block_id: int


@dataclass(frozen=True)
class DiskBlock:
    """A block file, by content hash; parent hash and token ids are needed to *write* one."""

    block_hash: bytes
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


Location = Union[DeviceBlock, HostBlock, DiskBlock]
_TIER = {DeviceBlock: "device", HostBlock: "host", DiskBlock: "disk"}


@dataclass(frozen=True)
class Move:
    """Copy one block from ``src`` to ``dst`` (the source keeps its copy)."""

    src: Location
    dst: Location

    @property
    def direction(self) -> str:
        """``"device->host"``, ``"host->disk"``, ...: the key of ``TransferStats``."""
        return f"{_TIER[type(self.src)]}->{_TIER[type(self.dst)]}"


def _key(loc: Location) -> tuple[str, object]:
    if isinstance(loc, DeviceBlock):
        return ("device", loc.block_id)
    if isinstance(loc, HostBlock):
        return ("host", loc.block_id)
    return ("disk", loc.block_hash)


@dataclass
class Batch:
    """A prepared batch of moves; the handle passed to submit/complete/wait."""

    id: int
    moves: tuple[Move, ...]
    state: str = "prepared"  # prepared -> queued -> done -> completed (or aborted)
    ready_event: torch.cuda.Event | None = None  # recorded on the caller's stream at submit


@dataclass(frozen=True)
class BatchResult:
    """Per-move outcome of a batch: ``ok[i]`` is True when ``moves[i]`` landed intact;
    ``errors[i]`` says why not. ``seconds``: worker time for the batch."""

    batch_id: int
    moves: tuple[Move, ...]
    ok: tuple[bool, ...]
    errors: tuple[str | None, ...]
    seconds: float

    @property
    def all_ok(self) -> bool:
        """Whether every move succeeded."""
        return all(self.ok)

    @property
    def failed(self) -> tuple[Move, ...]:
        """The moves the caller must roll back."""
        return tuple(m for m, ok in zip(self.moves, self.ok) if not ok)


@dataclass
class TransferStats:
    """Counters of one engine. ``bytes_moved``/``seconds`` keyed by ``Move.direction``;
    bytes are payload bytes of successful moves."""

    batches: int = 0
    moves_ok: int = 0
    moves_failed: int = 0
    bytes_moved: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    batch_errors: int = 0   # batches failed by a bug (not an I/O error): logged with traceback

    def gbps(self, direction: str) -> float:
        """Achieved GB/s (1e9 bytes/s) of a direction, worker time only."""
        s = self.seconds.get(direction, 0.0)
        return self.bytes_moved.get(direction, 0) / s / 1e9 if s > 0 else 0.0


__all__ = ["Batch", "BatchResult", "DeviceBlock", "DiskBlock", "HostBlock", "Location", "Move",
           "TransferStats"]
