"""The tier protocol: one contract for everything that moves KV blocks between tiers.

The bookkeeping (block manager, radix tree) decides *what* happens to blocks and returns a plan:
``MoveOp(block_hash, src_tier, src_block_id, dst_tier, dst_block_id, keep_src)`` tier moves and
``CopyOp(src, dst)`` device copies, in the order they must happen. A :class:`KVMover` makes the
bytes follow. Every mover -- :class:`DeviceOnlyMover` (the device alone), the tiered mover over
host RAM and disk (:mod:`radixkv.tiers.mover`), and the remote tier
(:mod:`radixkv.tiers.remote`), which sees every plan first -- implements this one contract:

**Order.** Ops are applied in list order; a slot vacated by one op may be refilled by a later op
of the same list, so a mover lands each op before a later one touches the same memory.

**Ownership during a move.** When ``apply_moves`` returns, every *source* slot it vacated is free
for reuse (a mover that writes in the background has copied the bytes out first), and every
*destination* device block holds its bytes -- except promotions a mover with ``async_loads``
leaves running: their device blocks are named by :meth:`KVMover.inflight_device_blocks` and
belong to the mover until :meth:`KVMover.poll_loads` / :meth:`KVMover.wait_loads` settles them;
nothing may read or write them before (the scheduler keeps their requests out of the forward).

**What is asynchronous.** Demotions to slow tiers (disk, remote) and prefetches may complete
after ``apply_moves`` returns; :meth:`KVMover.drain` settles them (the engine drains every step
and when idle). Promotions into the device are synchronous unless ``async_loads``.

**What a failed move means.** A failed *load* is a miss, never a wrong block: its hash is
reported by :meth:`KVMover.take_failed_loads`, the block manager invalidates the node (and its
subtree) and the request recomputes it. A failed *write* drops the block from the tier it was
written to (the bookkeeping never claims bytes a tier does not hold). Both are logged and
counted (:meth:`KVMover.counters`); I/O errors are caught narrowly (``OSError``,
:class:`StorageError`, bad
blocks), a bug is not swallowed.

Observers: a mover may let another component see each group of moves before it runs
(:meth:`KVMover.add_observer`): the remote tier writes blocks leaving the host back to the shared
server while their host blocks still hold them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from radixkv.core.block_manager import CopyOp
from radixkv.core.hashing import BlockHash
from radixkv.core.node import BlockRef, Node
from radixkv.core.tree import DEVICE, MoveOp, RadixTree
from radixkv.errors import ConfigError


class CacheWriter(Protocol):
    """The changes tier code asks of the cache (the block manager, the tree's only writer;
    unit tests may pass the tree itself). Each returns the moves to run, if any."""

    def install_lower(self, parent_hash: BlockHash | None, block_hash: BlockHash,
                      tokens: bytes, tier: int) -> BlockRef | None:
        """Cache a block whose bytes the caller places in slower tier ``tier``."""
        ...

    def touch(self, block_hash: BlockHash, now: float | None = None,
              near: Node | None = None) -> None:
        """Mark ``block_hash`` and its prefix used now."""
        ...

    def evict(self, tier: int, num_blocks: int) -> list[MoveOp]:
        """Make room in ``tier``: the moves to run."""
        ...

    def invalidate(self, block_hash: BlockHash) -> list[MoveOp]:
        """``block_hash`` and everything after it leave the cache: the drops to run."""
        ...

    def drop_copy(self, block_hash: BlockHash, tier: int) -> MoveOp | None:
        """Forget ``block_hash``'s write-through copy in ``tier`` (its write failed)."""
        ...


class TreeCacheWriter:
    """A :class:`CacheWriter` straight over a ``RadixTree``, for tier components built without
    a block manager (unit tests of the mover); the engine always passes its block manager."""

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree

    def install_lower(self, parent_hash: BlockHash | None, block_hash: BlockHash,
                      tokens: bytes, tier: int) -> BlockRef | None:
        return self.tree.insert_lower(parent_hash, block_hash, tokens, tier)

    def touch(self, block_hash: BlockHash, now: float | None = None,
              near: Node | None = None) -> None:
        self.tree.touch(block_hash, now, near)

    def evict(self, tier: int, num_blocks: int) -> list[MoveOp]:
        return self.tree.evict(tier, num_blocks)

    def invalidate(self, block_hash: BlockHash) -> list[MoveOp]:
        return self.tree.invalidate(block_hash)

    def drop_copy(self, block_hash: BlockHash, tier: int) -> MoveOp | None:
        return self.tree.writes.drop_copy(block_hash, tier)


class KVMover(abc.ABC):
    """Executes the bookkeeping's moves and copies on real memory (see the module docstring).

    Subclasses implement :meth:`apply_moves` and :meth:`copy_blocks`; the other members have the
    behaviour of a mover whose every move completes inside ``apply_moves`` (no loads in flight,
    nothing to drain), so the engine calls them on any mover without probing for them.
    """

    #: True if promotions into the device may still run when ``apply_moves`` returns.
    async_loads: bool = False

    @abc.abstractmethod
    def apply_moves(self, moves: Sequence[MoveOp]) -> None:
        """Apply tier moves in order (``dst_tier`` None: the block left the cache)."""

    @abc.abstractmethod
    def copy_blocks(self, copies: Sequence[CopyOp]) -> None:
        """Device block copies (copy-on-write of a shared partial tail)."""

    def add_observer(self, fn: Callable[[Sequence[MoveOp]], None]) -> None:
        """Call ``fn(group)`` before each group of moves runs, while source slots still hold
        their blocks. A mover without lower tiers has no groups worth observing."""

    def poll_loads(self) -> None:
        """Settle the promotions that finished (non-blocking)."""

    def wait_loads(self) -> None:
        """Settle every promotion in flight."""

    def inflight_device_blocks(self) -> frozenset[int]:
        """Device blocks that promotions in flight are still writing."""
        return frozenset()

    @property
    def failed_loads(self) -> tuple[bytes, ...]:
        """Hashes of failed loads not yet taken (read-only view)."""
        return ()

    def take_failed_loads(self) -> list[bytes]:
        """Hashes of blocks whose load failed since the last call (each once)."""
        return []

    def drain(self, loads: bool = True) -> None:
        """Settle background work (writes, prefetches; promotions too unless ``loads`` is
        False), filing its failures."""

    def counters(self) -> dict[str, Any] | None:
        """Traffic and fault counters, or None for a mover that keeps none."""
        return None

    def close(self) -> None:
        """Finish background work and release threads and files."""


class DeviceOnlyMover(KVMover):
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
        # Host ids: the kernels check them on the host and move them in one transfer (ids
        # built on a GPU would cost host syncs for the same checks).
        src = torch.tensor([c.src for c in copies], dtype=torch.long)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.long)
        from radixkv.kernels import copy_blocks   # lazy: kernels load Triton where present

        copy_blocks(self.kv_cache, src, dst)
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


__all__ = ["CacheWriter", "TreeCacheWriter", "KVMover", "DeviceOnlyMover", "run_kv_ops"]
