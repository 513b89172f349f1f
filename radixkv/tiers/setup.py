"""The engine's tier glue: building the tiered mover, rebuilding the tree from the disk tier at
start, prefetching waiting requests' disk blocks, the forward's fence against promotions in
flight, and the per-tier statistics. Kept apart from ``llm_engine`` so the step loop reads on
its own; every function here takes the engine (or its parts) explicitly.
"""

from __future__ import annotations

import itertools
from array import array
from typing import TYPE_CHECKING, Any

from radixkv.core.hashing import TOKEN_BYTES, chain_hash, token_bytes
from radixkv.core.tree import RadixTree
from radixkv.engine.batch import SequenceChunk
from radixkv.engine.tiered_mover import TieredKVMover
from radixkv.errors import ConfigError, StorageError
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.integrity import signer_from

if TYPE_CHECKING:
    from radixkv.engine.llm_engine import LLMEngine


def build_mover(engine: LLMEngine, n_host: int, n_disk: int, model_id: str
                ) -> tuple[TieredKVMover, dict[str, Any] | None]:
    """HostPool/DiskStore for the configured lower tiers, the mover over them, and the tree
    rebuilt from the disk tier's files (a previous process's blocks are hits)."""
    host = HostPool(engine.layout, n_host) if n_host else None
    disk = None
    if n_disk:
        # Namespace = model fingerprint (model id, dtype, KV layout); cache salts are inside
        # the chain hashes, so tenants share the directory but never each other's blocks.
        disk = DiskStore(engine.cache_config.disk_dir, engine.layout,
                         engine.layout.fingerprint(model_id), scan=False,
                         signer=signer_from(engine.cache_config.disk_secret))
    mover = TieredKVMover(engine.model_runner.kv_cache, engine.layout, host, disk, engine.tree,
                          async_loads=engine.engine_config.async_loads)
    report = None
    if disk is not None:
        report = restore_from_disk(engine.tree, disk, mover.disk_tier,
                                   engine.cache_config.block_size)
    return mover, report


def build_remote(engine: LLMEngine, model_id: str) -> Any:
    """The engine's remote tier (``CacheConfig.remote_url``), or None. The store connects in
    the background: a server that is down now only costs misses until it is back."""
    cc = engine.cache_config
    if cc.remote_url is None:
        return None
    from radixkv.engine.remote_tier import RemoteTier
    from radixkv.storage.remote import RemoteStore

    mover = engine.kv_mover
    if not isinstance(mover, TieredKVMover) or mover.host is None:
        raise ConfigError("the remote tier needs the engine's own tiered mover with a host "
                          "tier (do not pass kv_mover together with remote_url)")
    store = RemoteStore(cc.remote_url, engine.layout, engine.layout.fingerprint(model_id),
                        signer=signer_from(cc.disk_secret), ttl_s=cc.remote_ttl_s,
                        socket_timeout=cc.remote_timeout_s,
                        connect_timeout=min(0.5, cc.remote_timeout_s), queue_blocks=1024)
    remote = RemoteTier(store, engine.tree, mover.host, engine.tier_names.index("host"),
                        engine.model_runner.kv_cache, cc.block_size, cc.remote_write,
                        cc.remote_timeout_s, unsafe=mover.unsafe_host_block)
    if cc.remote_write != "read_only":
        mover.before_moves = remote.before_moves
    return remote


def restore_from_disk(tree: RadixTree, disk: DiskStore, tier: int, block_size: int
                      ) -> dict[str, Any]:
    """Insert the disk tier's valid files into the tree, parents first.

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
        parent = None
        if e.parent_hash is not None:
            parent = tree.get(e.parent_hash)
            if parent is None:
                orphans += 1
                disk.remove(e.block_hash)
                continue
        ok = len(tokens) == width and (
            parent is None or chain_hash(parent.block_hash, tokens) == e.block_hash)
        node = tree.insert_lower(parent, e.block_hash, tokens, tier) if ok else None
        if node is None:
            skipped += 1
            disk.remove(e.block_hash)
        else:
            restored += 1
    return {"restored_blocks": restored, "orphan_files": orphans, "skipped_files": skipped,
            "corrupt_files": report.corrupt, "foreign_files": report.foreign,
            "forged_files": report.forged,
            "stale_tmp_files": report.stale_tmp, "scan_s": report.seconds}


def fence(mover: Any, tree: RadixTree, chunks: list[SequenceChunk]) -> None:
    """The forward must not read or write a device block a promotion is still writing.
    The scheduler keeps loading requests out of the batch, so this never waits in
    practice; it is the guarantee should that ever fail (and a failed load there is a bug,
    never a wrong block served)."""
    inflight = getattr(mover, "inflight_device_blocks", None)
    busy = inflight() if inflight is not None else None
    if not busy:
        return
    used = {b for c in chunks for b in c.block_table}
    if used.isdisjoint(busy):
        return
    mover.wait_loads()
    bad = {n.slot for n in map(tree.get, mover.failed_loads) if n is not None}
    if not used.isdisjoint(bad):
        raise StorageError("a scheduled sequence reads a KV block whose load failed")


def prefetch(engine: LLMEngine) -> None:
    """Best effort: the disk-tier blocks matched by the first ``prefetch_requests``
    waiting requests are moved disk -> host (``RadixTree.promote_lower``) as a batch that
    runs behind the step; the request's allocation later promotes them host -> device.
    At most the host tier's capacity per step."""
    k = engine.engine_config.prefetch_requests
    mover = engine.kv_mover
    waiting = engine.scheduler.waiting
    names = engine.tier_names
    if not k or not waiting or "host" not in names or "disk" not in names:
        return
    if not isinstance(mover, TieredKVMover):
        return   # a mover passed in may not do disk -> host loads
    host_t, disk_t = names.index("host"), names.index("disk")
    tree, bs = engine.tree, engine.block_manager.block_size
    budget = engine.tier_capacity_blocks[host_t]
    moves: list[Any] = []
    for req in itertools.islice(waiting, k):
        for seq in req.seqs:
            ids = seq.token_ids
            nodes, _ = tree.match_tokens(token_bytes(ids), req.namespace.seed,
                                         (len(ids) - 1) // bs)
            for x in nodes:
                if budget <= 0:
                    break
                if x.tier < disk_t:
                    continue
                if tree.get(x.block_hash) is not x or x.tier != disk_t or (
                        x.parent is not None and x.parent.tier > host_t):
                    break   # dropped or left behind by an earlier prefetch's eviction
                ms = tree.promote_lower(x, host_t)
                if not ms:
                    break
                moves.extend(ms)
                budget -= 1
    if moves:
        mover.apply_moves(moves)


def tier_stats(engine: LLMEngine) -> dict[str, Any]:
    """Per-tier figures: names, capacities, residency; mover traffic and faults."""
    c = engine.scheduler.counters
    out: dict[str, Any] = {
        "tiers": list(engine.tier_names),
        "tier_capacity_blocks": list(engine.tier_capacity_blocks),
        "write_through": list(engine.cache_config.write_through),
        "load_failures": c.load_failures,
        "load_retries": c.load_retries,
        "loading_request_steps": c.loading_steps,
        "load_waits": c.load_waits,
    }
    tree = engine.tree
    if tree.write_through:
        ts = tree.stats
        out.update(copies_per_tier=[tree.num_copies(t) if t else 0
                                    for t in range(tree.num_tiers)],
                   copies_made=ts.copies_made, copies_skipped=ts.copies_skipped,
                   copies_dropped=ts.copies_dropped, free_demotions=ts.free_demotions)
    ms = getattr(engine.kv_mover, "stats", None)
    if ms is not None and hasattr(ms, "as_dict"):
        m = ms.as_dict()
        out.update(bytes_moved=m["bytes_moved"], blocks_moved=m["moves"],
                   write_failures=m["write_failures"],
                   mover_load_failures=m["load_failures"],
                   write_failure_drops=m["invalidated_blocks"],
                   skipped_writes=m["skipped_writes"],
                   async_batches=m["async_batches"],
                   async_load_batches=m["async_loads"],
                   failed_copy_writes=m["dropped_copies"],
                   prefetched_blocks=m["prefetched_blocks"],
                   prefetch_hits=m["prefetch_hits"],
                   prefetch_failures=m["prefetch_failures"])
    remote = getattr(engine, "_remote", None)
    if remote is not None:
        out["remote"] = remote.stats()
    disk = getattr(engine.kv_mover, "disk", None)
    if disk is not None:
        d = disk.stats()
        out["disk"] = {"files": len(disk), "bytes_used": disk.bytes_used,
                       "corrupt": d.corrupt, "foreign": d.foreign, "forged": d.forged,
                       "read_errors": d.read_errors, "put_failures": d.put_failures,
                       "failures_by_errno": dict(d.failures_by_errno),
                       **(engine.restore_report or {})}
    return out


class MoverLoads:
    """The scheduler's view of a mover's promotions in flight (``Scheduler(loads=...)``)."""

    def __init__(self, mover: Any) -> None:
        self._mover = mover

    def poll(self) -> list[bytes]:
        self._mover.poll_loads()
        return self._mover.take_failed_loads()

    def wait(self) -> list[bytes]:
        self._mover.wait_loads()
        return self._mover.take_failed_loads()

    def inflight(self) -> frozenset[int]:
        return self._mover.inflight_device_blocks()


__all__ = ["MoverLoads", "build_mover", "build_remote", "fence", "prefetch", "restore_from_disk", "tier_stats"]
