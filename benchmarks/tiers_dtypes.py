"""Tier bandwidth per KV dtype, in blocks/s (issue 16): ``radixkv bench tiers --parts dtypes``.

Question: a quantized block (int8 or fp8_e4m3 rows of ``head_dim`` bytes + a 2-byte fp16 scale)
is 0.516x of a bf16 block at head_dim 64; how many more blocks per second does each tier move
then, and at what GB/s? Every move goes through the same code as the engine's
(``TransferEngine``: device<->host gathers/scatters, host<->disk ``DiskStore`` files with header
and checksum; the remote tier's ``RemoteStore`` against a redis-server this run starts on
loopback), with ``n`` blocks of the SmolLM2 layout (30 layers, 3 KV heads, 16 tokens) per batch,
per dtype. The quantized bytes move as they are (nothing is dequantized on the way down).

The dtypes of one direction run round-robin in the same rounds (one warm-up round, then
``repeat``), so a busy machine slows them alike. Per dtype: median wall time -> blocks/s and
GB/s (payload bytes / s, 1e9 B/s), median CPU time of this process (all threads), and
``vs bf16``: the median over rounds of (bf16's time / this dtype's time) for the same number of
blocks, i.e. the ratio of blocks per second. The device tier is the CPU on a machine without a
GPU (the moves are then memory copies on both sides).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixkv.storage.device import DevicePool, default_device
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.tiers.transfer import DeviceBlock, DiskBlock, HostBlock, Move, TransferEngine

DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")
BASELINE = "bfloat16"


def layout(kv_dtype: str) -> KVLayout:
    """SmolLM2-135M's block of 16 tokens in ``kv_dtype``."""
    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=kv_dtype)


def _random_bytes(t: torch.Tensor, seed: int) -> None:
    """Fill ``t`` with random bytes (bandwidth does not depend on the values; the read-back
    checks compare bytes, so fp8 NaN codes or float NaNs do not matter)."""
    g = torch.Generator().manual_seed(seed)
    flat = t.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=g))


def _run_batch(eng: TransferEngine, moves: list[Move]) -> None:
    result = eng.wait(eng.submit(eng.prepare(moves)))
    assert result is not None and result.all_ok, result and result.errors[:3]


def _evict_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


Case = tuple[str, Callable[[], Any], Callable[[], Any]]   # (dtype, timed fn, untimed setup)


def _rounds(cases: list[Case], repeat: int, n: int, **labels: Any) -> list[dict[str, Any]]:
    """Run the dtypes' cases round-robin; one row per dtype (see the module doc)."""
    wall: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for rnd in range(repeat + 1):
        for name, fn, setup in cases:
            setup()
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            w1, c1 = time.perf_counter(), time.process_time()
            if rnd:
                wall[name].append(w1 - w0)
                cpu[name].append(c1 - c0)
    rows = []
    for kv in wall:
        t = statistics.median(wall[kv])
        nbytes = n * layout(kv).bytes_per_block
        row = {**labels, "kv_dtype": kv, "blocks": n, "block_bytes": layout(kv).bytes_per_block,
               "blocks/s": n / t, "GB/s": nbytes / t / 1e9, "ms": t * 1e3,
               "cpu ms": statistics.median(cpu[kv]) * 1e3}
        if BASELINE in wall:
            row["vs bf16"] = statistics.median(b / x for b, x in zip(wall[BASELINE], wall[kv]))
        rows.append(row)
    return rows


def bench_device_host(n: int, repeat: int, dtypes: tuple[str, ...]) -> list[dict[str, Any]]:
    """device->host and host->device through TransferEngine, scattered block ids."""
    ids = list(range(n))
    scattered = ids[::2] + ids[1::2]
    d2h: list[Case] = []
    h2d: list[Case] = []
    keep: list[Any] = []
    for j, kv in enumerate(dtypes):
        dev = DevicePool(layout(kv), n, device=default_device())
        _random_bytes(dev.kv_cache, j)
        host = HostPool(layout(kv), n)
        eng = TransferEngine(device=dev, host=host)
        keep.append((dev, host, eng))
        down = [Move(DeviceBlock(b), HostBlock(i)) for i, b in enumerate(scattered)]
        up = [Move(HostBlock(i), DeviceBlock(b)) for i, b in enumerate(scattered)]
        d2h.append((kv, lambda e=eng, m=down: _run_batch(e, m), _nothing))
        h2d.append((kv, lambda e=eng, m=up: _run_batch(e, m), _nothing))
    rows = _rounds(d2h, repeat, n, direction="device->host", mode=str(default_device()))
    rows += _rounds(h2d, repeat, n, direction="host->device", mode=str(default_device()))
    for dev, host, eng in keep:   # the round trip left every block where it started
        assert torch.equal(dev.read_blocks(scattered).view(torch.uint8),
                           host.blocks.view(torch.uint8))
        eng.close()
    return rows


def bench_host_disk(root: Path, n: int, repeat: int, dtypes: tuple[str, ...],
                    threads: int | None = None) -> list[dict[str, Any]]:
    """host->disk (page cache, no fsync) and disk->host (warm page cache and cold), through
    TransferEngine + DiskStore (header, checksums, temp file + rename)."""
    writes: list[Case] = []
    warm: list[Case] = []
    cold: list[Case] = []
    keep: list[Any] = []
    for j, kv in enumerate(dtypes):
        lay = layout(kv)
        host = HostPool(lay, n)
        _random_bytes(host.blocks, 100 + j)
        dst = HostPool(lay, n)
        store = DiskStore(root / kv, lay, lay.fingerprint("bench"), fsync=False, scan=False)
        eng = TransferEngine(host=host, disk=store, io_threads=threads)
        reader = TransferEngine(host=dst, disk=store, io_threads=threads)
        hashes = [os.urandom(16) for _ in range(n)]
        tokens = tuple(range(lay.block_size))
        keep.append((host, dst, eng, reader))

        def clear(store: DiskStore = store, hashes: list[bytes] = hashes) -> None:
            for h in hashes:
                store.remove(h)

        put = [Move(HostBlock(i), DiskBlock(hashes[i], None, tokens)) for i in range(n)]
        get = [Move(DiskBlock(hashes[i]), HostBlock(i)) for i in range(n)]
        files = [store.path_of(h) for h in hashes]
        writes.append((kv, lambda e=eng, m=put: _run_batch(e, m), clear))
        warm.append((kv, lambda e=reader, m=get: _run_batch(e, m), _nothing))
        cold.append((kv, lambda e=reader, m=get: _run_batch(e, m),
                     lambda f=files: _evict_page_cache(f)))
    rows = _rounds(writes, repeat, n, direction="host->disk", mode="fsync=none")
    rows += _rounds(warm, repeat, n, direction="disk->host", mode="warm")
    rows += _rounds(cold, repeat, n, direction="disk->host", mode="cold")
    for host, dst, eng, reader in keep:
        assert torch.equal(dst.blocks.view(torch.uint8), host.blocks.view(torch.uint8))
        eng.close()
        reader.close()
    return rows


def bench_remote_dtypes(n: int, repeat: int, dtypes: tuple[str, ...],
                        batch: int = 16) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """host->remote (``put_many(wait=True)`` in batches) and remote->host
    (``read_into_many`` into host slots) against one local redis-server."""
    import redis

    from radixkv.benchmarks.bench_remote import LocalRedis
    from radixkv.storage.remote import RemoteStore

    server = LocalRedis()
    try:
        puts: list[Case] = []
        gets: list[Case] = []
        keep: list[Any] = []
        flush = redis.Redis.from_url(server.url)
        for j, kv in enumerate(dtypes):
            lay = layout(kv)
            host = HostPool(lay, n, pin_memory=False)
            _random_bytes(host.blocks, 200 + j)
            dst = HostPool(lay, n, pin_memory=False)
            store = RemoteStore(server.url, lay, lay.fingerprint(f"bench-{kv}"), queue_blocks=n,
                                write_batch=batch)
            hashes = [os.urandom(16) for _ in range(n)]
            items = [(h, None, range(i * lay.block_size, (i + 1) * lay.block_size),
                      host.block_bytes(i)) for i, h in enumerate(hashes)]
            outs = [dst.block_bytes(i) for i in range(n)]
            runs = [range(i, min(i + batch, n)) for i in range(0, n, batch)]
            keep.append((host, dst, store))

            def put(store: RemoteStore = store, items: list = items,
                    runs: list[range] = runs) -> None:
                for r in runs:
                    assert all(store.put_many([items[i] for i in r], wait=True))

            def get(store: RemoteStore = store, hashes: list[bytes] = hashes,
                    outs: list = outs, runs: list[range] = runs) -> None:
                for r in runs:
                    assert all(store.read_into_many([hashes[i] for i in r],
                                                    [outs[i] for i in r]))

            puts.append((kv, put, _nothing))
            gets.append((kv, get, _nothing))
        rows = _rounds(puts, repeat, n, direction="host->remote", mode="put_many, batches of "
                                                                        f"{batch}")
        rows += _rounds(gets, repeat, n, direction="remote->host", mode="read_into_many, "
                                                                        f"batches of {batch}")
        for host, dst, store in keep:
            assert torch.equal(dst.blocks.view(torch.uint8), host.blocks.view(torch.uint8))
            s = store.stats()
            assert (s.corrupt, s.put_failures, s.connection_errors) == (0, 0, 0), s
            store.close()
        flush.close()
        return rows, {"redis_server": server.version(), "redis_py": redis.__version__}
    finally:
        server.close()


def _nothing() -> None:
    return None


COLUMNS = ["direction", "mode", "kv_dtype", "block_bytes", "blocks/s", "GB/s", "ms", "cpu ms",
           "vs bf16"]

__all__ = ["bench_device_host", "bench_host_disk", "bench_remote_dtypes", "layout", "DTYPES",
           "COLUMNS"]
