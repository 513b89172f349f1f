"""The remote tier inside the engine: a Redis/Valkey store that replicas share.

Why a *look-aside* tier rather than a fourth tier of the radix tree: the server is shared.
Other replicas add blocks to it, and its ``maxmemory`` policy or a key TTL removes them, without
telling this process. A tree residency "this block is remote" would be a guess that goes stale
on its own, so the tree never records one: what the server holds is learned by asking it, once
per new request, and a block found there becomes an ordinary host-tier block of the tree.

The tier has two roles, as vLLM's KV connectors and LMCache's storage backends do, each its own
object over the one :class:`~radixkv.storage.remote.RemoteStore`:

* :class:`~radixkv.tiers.remote_lookup.RemoteLookup`, the **scheduler side**: looks a new
  request's missing blocks up (``lookup``) and installs the hits in the host tier before the
  scheduler sees the request (``admit``);
* :class:`~radixkv.tiers.remote_writer.RemoteWriter`, the **worker side**: writes blocks to the
  server (write-back of blocks leaving the host tier, write-through of computed blocks,
  retention, the shutdown flush), draining the tree's KV event queue with ``take_events()``.

:class:`RemoteTier` builds both, attaches the write policy (:mod:`~radixkv.tiers.write_policy`)
to the writer, and is what the engine holds: each method below forwards to the part that owns
it. Accounting: ``stats()`` merges both parts' counters and the store's (``server``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic

import torch

from radixkv.core.node import MoveOp
from radixkv.tiers.protocol import CacheWriter, KVMover, TreeCacheWriter
from radixkv.tiers.remote_lookup import LookupCounters, R, RemoteLookup
from radixkv.tiers.remote_writer import RemoteWriter, WriteCounters
from radixkv.tiers.write_policy import RemoteWritePolicy, write_policy

if TYPE_CHECKING:
    from radixkv.core.tree import RadixTree
    from radixkv.storage.host import HostPool
    from radixkv.storage.remote import RemoteStore

log = logging.getLogger(__name__)


class RemoteTier(Generic[R]):
    """The engine's remote tier: a :class:`RemoteLookup` (``lookups``) and a
    :class:`RemoteWriter` (``writer``) over one store (see the module docstring).

    Args:
        store: the shared store (closed by :meth:`close`).
        tree: the radix tree; ``writer`` (the block manager) makes every change to it
            (None: the tree itself, for unit tests).
        host_pool: the host tier's pool (tree tier ``host_tier``), where hits land.
        device_cache: ``[L, 2, num_blocks, block_size, kv_heads, head_dim]``, read by
            write-through and retention.
        write: the write policy (or its name), attached here to the writer, ``tree`` and
            ``mover``.
        timeout_s: how long a request may wait for its lookup.
        mover: the tiered mover, which shows the writer each group of moves.
        unsafe: ``unsafe(block_hash)`` is True for a host block whose slot may not hold its
            bytes (a prefetch load in flight or failed, in the mover): never written.
    """

    def __init__(self, store: RemoteStore, tree: RadixTree, host_pool: HostPool,
                 host_tier: int, device_cache: torch.Tensor, block_size: int,
                 write: str | RemoteWritePolicy, timeout_s: float, mover: KVMover,
                 unsafe: Callable[[bytes], bool] | None = None,
                 writer: CacheWriter | None = None) -> None:
        self.store = store
        self.write = write_policy(write)
        cache = writer if writer is not None else TreeCacheWriter(tree)
        self.lookups: RemoteLookup[R] = RemoteLookup(store, tree, host_pool, host_tier, cache,
                                                     block_size, timeout_s)
        self.writer = RemoteWriter(store, tree, host_pool, host_tier, device_cache, block_size,
                                   read_only=self.write.name == "read_only", unsafe=unsafe)
        self.write.attach(self.writer, tree, mover)
        if store.signer is None:
            log.warning(
                "radixkv: the remote tier's values are not authenticated: anyone who can write "
                "to the server can make this engine serve forged KV (checksums are "
                "recomputable). Give every replica the same secret: radixkv serve "
                "--kv-secret-file PATH, $RADIXKV_KV_SECRET or CacheConfig(disk_secret=...)")

    # ---- scheduler side (RemoteLookup) -----------------------------------------------------
    def lookup(self, req: R) -> None:
        self.lookups.lookup(req)

    def has_arrivals(self) -> bool:
        return self.lookups.has_arrivals()

    def is_arriving(self, request_id: str) -> bool:
        return self.lookups.is_arriving(request_id)

    def forget(self, request_id: str) -> R | None:
        return self.lookups.forget(request_id)

    def admit(self, run_ops: Callable[[list[MoveOp]], object], wait: bool
              ) -> list[R]:
        """:meth:`RemoteLookup.admit` (the engine's own requests come back)."""
        return self.lookups.admit(run_ops, wait)

    def take_remote_tokens(self, request_id: str) -> int:
        return self.lookups.take_remote_tokens(request_id)

    def admit_now(self, request_id: str, run_ops: Callable[[list[MoveOp]], object]) -> int:
        """:meth:`RemoteLookup.admit_now` (one lookup, waited for and installed now)."""
        return self.lookups.admit_now(request_id, run_ops)

    def fetch_now(self, reqs: Sequence[R], run_ops: Callable[[list[MoveOp]], object]
                  ) -> dict[str, int]:
        """:meth:`RemoteLookup.fetch_now` (several lookups as one, installed now)."""
        return self.lookups.fetch_now(reqs, run_ops)

    # ---- worker side (RemoteWriter) --------------------------------------------------------
    def apply_moves(self, moves: Sequence[MoveOp]) -> None:
        self.writer.apply_moves(moves)

    def after_step(self) -> None:
        self.writer.after_step()

    def persist(self, hashes: Sequence[bytes], ttl_s: float | None = None) -> None:
        self.writer.persist(hashes, ttl_s)

    def flush_retained(self) -> set[bytes]:
        return self.writer.flush_retained()

    def flush_resident(self, timeout_s: float) -> dict[str, Any]:
        """:meth:`RemoteWriter.flush_resident`, as a dict (``written``, ``present``,
        ``skipped``, ``left``, ``seconds``)."""
        return self.writer.flush_resident(timeout_s).as_dict()

    # ---- both ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Both parts' counters, ``server`` (the store's) and ``available``."""
        out: dict[str, Any] = {**self.lookups.counts.__dict__, **self.writer.counts.__dict__}
        out["server"] = dict(self.store.stats().__dict__)
        out["available"] = self.store.available
        return out

    def close(self) -> None:
        self.lookups.close()
        self.store.close()


__all__ = ["RemoteTier", "RemoteLookup", "RemoteWriter", "LookupCounters", "WriteCounters"]
