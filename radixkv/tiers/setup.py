"""Tier set-up and glue for the engine: building the tiered mover and the remote tier,
rebuilding the tree from the disk tier at start, planning prefetches of waiting requests' disk
blocks, the forward's fence against promotions in flight, and the per-tier statistics.

Every function takes the parts it uses (tree, mover, configs), never the engine: the engine
imports this package, not the other way round.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixkv.core.hashing import TOKEN_BYTES, BlockHash, chain_hash, token_bytes
from radixkv.core.node import MoveOp
from radixkv.core.tree import RadixTree
from radixkv.tiers.mover import TieredKVMover
from radixkv.tiers.protocol import KVMover
from radixkv.errors import ConfigError, StorageError
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.integrity import signer_from
from radixkv.storage.layout import KVLayout
from radixkv.tiers.remote_lookup import LookupRequest

if TYPE_CHECKING:
    from radixkv.config import CacheConfig
    from radixkv.core.block_manager import BlockManager
    from radixkv.tiers.remote import RemoteTier


def build_mover(kv_cache: torch.Tensor, layout: KVLayout, cc: CacheConfig, bm: BlockManager,
                async_loads: bool, n_host: int, n_disk: int, model_id: str
                ) -> tuple[TieredKVMover, dict[str, Any] | None]:
    """HostPool/DiskStore for the configured lower tiers, the mover over them, and the tree
    rebuilt from the disk tier's files (a previous process's blocks are hits)."""
    host = HostPool(layout, n_host) if n_host else None
    disk = None
    if n_disk:
        if cc.disk_dir is None:
            raise ConfigError("a disk tier needs CacheConfig.disk_dir")
        # Namespace = model fingerprint (model id, dtype, KV layout); cache salts are inside
        # the chain hashes, so tenants share the directory but never each other's blocks.
        disk = DiskStore(cc.disk_dir, layout, layout.fingerprint(model_id), scan=False,
                         signer=signer_from(cc.disk_secret))
    mover = TieredKVMover(kv_cache, layout, host, disk, bm.tree, async_loads=async_loads,
                          writer=bm)
    report = None
    if disk is not None and mover.disk_tier is not None:
        report = restore_from_disk(bm, disk, mover.disk_tier, cc.block_size)
    return mover, report


def build_remote(cc: CacheConfig, layout: KVLayout, bm: BlockManager, mover: KVMover,
                 tier_names: Sequence[str], kv_cache: torch.Tensor, model_id: str
                 ) -> RemoteTier[Any] | None:
    """The engine's remote tier (``CacheConfig.remote_url``), or None. The store connects in
    the background: a server that is down now only costs misses until it is back."""
    if cc.remote_url is None:
        return None
    from radixkv.storage.remote import RemoteStore
    from radixkv.tiers.remote import RemoteTier

    if not isinstance(mover, TieredKVMover) or mover.host is None:
        raise ConfigError("the remote tier needs the engine's own tiered mover with a host "
                          "tier (do not pass kv_mover together with remote_url)")
    store = RemoteStore(cc.remote_url, layout, layout.fingerprint(model_id),
                        signer=signer_from(cc.disk_secret), ttl_s=cc.remote_ttl_s,
                        socket_timeout=cc.remote_timeout_s,
                        connect_timeout=min(0.5, cc.remote_timeout_s), queue_blocks=1024)
    return RemoteTier(store, bm.tree, mover.host, list(tier_names).index("host"), kv_cache,
                      cc.block_size, cc.remote_write, cc.remote_timeout_s, mover,
                      unsafe=mover.unsafe_host_block, writer=bm)


def restore_from_disk(bm: BlockManager, disk: DiskStore, tier: int, block_size: int
                      ) -> dict[str, Any]:
    """Insert the disk tier's valid files into the tree (through the block manager ``bm``),
    parents first.

    A file written for a root block has no parent hash and becomes a root. A file whose
    parent hash names a block that is not cached (its parent was still on the device or
    host when the writer exited, or its file was corrupt) is an *orphan*: no request can
    reach it, and as a root it would be worse than useless (a request recomputing the
    chain could not cache its own block under that hash until the orphan is evicted), so
    it is skipped. Skipped files -- orphans, entries beyond the tier's capacity, entries
    whose tokens do not chain-hash to their name -- are removed: the files on disk are
    exactly the disk tier's blocks."""
    report = disk.scan()
    width = block_size * TOKEN_BYTES
    restored = orphans = skipped = 0
    for e in report.entries:
        tokens = array("i", e.token_ids).tobytes()
        parent = None if e.parent_hash is None else BlockHash(e.parent_hash)
        if parent is not None and bm.get(parent) is None:
            orphans += 1
            disk.remove_many([e.block_hash])
            continue
        ok = len(tokens) == width and (
            parent is None or chain_hash(parent, tokens) == e.block_hash)
        node = bm.install_lower(parent, BlockHash(e.block_hash), tokens, tier) if ok else None
        if node is None:
            skipped += 1
            disk.remove_many([e.block_hash])
        else:
            restored += 1
    return {"restored_blocks": restored, "orphan_files": orphans, "skipped_files": skipped,
            "corrupt_files": report.corrupt, "foreign_files": report.foreign,
            "forged_files": report.forged,
            "stale_tmp_files": report.stale_tmp, "scan_s": report.seconds}


class _Chunk(Protocol):
    @property
    def block_table(self) -> Sequence[int]: ...


def fence(mover: KVMover, tree: RadixTree, chunks: Sequence[_Chunk]) -> None:
    """The forward must not read or write a device block a promotion is still writing.
    The scheduler keeps loading requests out of the batch, so this never waits in
    practice; it is the guarantee should that ever fail (and a failed load there is a bug,
    never a wrong block served)."""
    busy = mover.inflight_device_blocks()
    if not busy:
        return
    used = {b for c in chunks for b in c.block_table}
    if used.isdisjoint(busy):
        return
    mover.wait_loads()
    bad = {n.block_id for n in (tree.get(BlockHash(h)) for h in mover.failed_loads)
           if n is not None}
    if not used.isdisjoint(bad):
        raise StorageError("a scheduled sequence reads a KV block whose load failed")


def prefetch(bm: BlockManager, mover: KVMover, waiting: Iterable[LookupRequest],
             names: Sequence[str], capacity: Sequence[int], k: int) -> None:
    """Best effort: the disk-tier blocks matched by the first ``k`` waiting requests are
    moved disk -> host (planned by the block manager) as a batch that runs behind the step;
    the request's allocation later promotes them host -> device. At most the host tier's
    capacity per step."""
    if not k or not waiting or "host" not in names or "disk" not in names:
        return
    if not isinstance(mover, TieredKVMover):
        return   # a mover passed in may not do disk -> host loads
    names = list(names)
    host_t, disk_t = names.index("host"), names.index("disk")
    tree, bs = bm.tree, bm.block_size
    budget = capacity[host_t]
    moves: list[MoveOp] = []
    for req in itertools.islice(waiting, k):
        for seq in req.seqs:
            ids = seq.token_ids
            refs = tree.match_tokens(token_bytes(ids), req.namespace.seed, (len(ids) - 1) // bs)
            i = next((j for j, x in enumerate(refs) if x.tier >= disk_t), len(refs))
            while i < len(refs) and budget > 0:
                # the disk part of the match, a run at a time (its first block starts a node)
                x = tree.get(refs[i].block_hash, scan=False)   # a node's first block
                parent = None if x is None or x.parent_hash is None else \
                    tree.get(x.parent_hash, scan=False)         # its parent's last
                if x is None or x.tier != disk_t or (parent is not None and parent.tier > host_t):
                    break   # dropped or left behind by an earlier prefetch's eviction
                ms = bm.promote_lower(x.block_hash, host_t, budget)
                loaded = sum(1 for m in ms if m.src_tier == disk_t and m.dst_tier == host_t)
                if not loaded:
                    break
                moves.extend(ms)
                budget -= loaded
                i += loaded
    if moves:
        mover.apply_moves(moves)


class MoverLoads:
    """The scheduler's view of a mover's promotions in flight (``Scheduler(loads=...)``)."""

    def __init__(self, mover: KVMover) -> None:
        self._mover = mover

    def poll(self) -> list[bytes]:
        self._mover.poll_loads()
        return self._mover.take_failed_loads()

    def wait(self) -> list[bytes]:
        self._mover.wait_loads()
        return self._mover.take_failed_loads()

    def inflight(self) -> frozenset[int]:
        return self._mover.inflight_device_blocks()


__all__ = ["MoverLoads", "build_mover", "build_remote", "fence", "prefetch", "restore_from_disk"]
