"""How close do the storage tiers come to the raw bandwidth of the same bytes, how long does the
disk index take to rebuild at 10^5 blocks, and how much of the infinite-cache hit rate do the
tiers recover on a real chat trace?

Four questions, each against a baseline measured in the same run:

1. host<->disk: ``TransferEngine`` moves (HostBlock <-> DiskBlock through ``DiskStore``: header,
   checksums, temp file + rename) vs plain file I/O of the same bytes (one ``open/write/close``
   per block, and one big slab file), warm (page cache) and cold (``fadvise(DONTNEED)`` before
   reading). Target: >= 70% of raw per-file I/O.
2. device<->host: ``TransferEngine`` moves (DeviceBlock <-> HostBlock: gather/scatter + copy) vs a
   single contiguous ``torch`` copy of the same number of bytes between the same devices.
3. index rebuild: ``DiskStore.scan()`` over 10^5 block files (headers only) vs a bare
   ``listdir + open + pread + close`` of the same files.

4. hit rate: the ShareGPT chat trace (``traces.load_trace("chat")``) replayed through the real
   tree and block manager (``benchmarks/replay.py``, LRU, 16-token blocks) with a small device
   tier, device + host, and device + host + disk whose total capacity equals the working set,
   vs the infinite cache (every repeated full block a hit). Target: three tiers >= 98% of
   infinite. Capacities are fractions of the working set (distinct full prompt blocks).

5. remote (``--parts remote``, not in the default set): ``RemoteStore`` puts/gets against a
   redis-server this run starts on loopback vs the raw ``redis`` client's pipelined SET/GET
   (and MGET) of the same bytes (``benchmarks/bench_remote.py``). Target: >= 70% of raw.

6. per KV dtype (``--parts dtypes``, not in the default set; issue 16): blocks/s and GB/s of
   float32, bf16, int8 and fp8_e4m3 blocks through the same moves (device<->host, host<->disk,
   and the remote tier with ``--kv-remote``), the dtypes interleaved in the same rounds and
   compared with bf16 (``benchmarks/tiers_dtypes.py``).

Bandwidth = bytes moved / median wall time, in GB/s (1e9 bytes/s).

    radixkv bench tiers [--parts bandwidth,rebuild,hit-rate,remote,dtypes] [--blocks N]
                        [--rebuild-blocks N] [--quick] [--dir PATH]
                        [--kv-dtypes float32,bfloat16,int8,fp8_e4m3] [--kv-remote]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import xxhash

from radixkv.benchmarks._common import plain_doc, print_table, run_header, write_results
from radixkv.storage.buffers import byte_view
from radixkv.storage.device import DevicePool, default_device
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.tiers.transfer import DeviceBlock, DiskBlock, HostBlock, Move, TransferEngine

# SmolLM2-135M (the embedded model) in fp32, 16-token blocks: 720 KiB per block
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
# for the rebuild: the header is what a scan reads, so a small payload keeps 10^5 files cheap
TINY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, block_size=16, dtype="float16")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _evict_page_cache(paths: list[Path]) -> None:
    """Drop the page-cache pages of these files only (flushing them first), so the next read
    comes from the device; other processes' caches are left alone."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_batch(eng: TransferEngine, moves: list[Move]) -> None:
    result = eng.wait(eng.submit(eng.prepare(moves)))
    assert result is not None and result.all_ok, result and result.errors[:3]


Case = tuple[str, Callable[[], Any], Callable[[], Any]]  # (path name, timed fn, untimed setup)


def _interleaved(cases: list[Case], repeat: int, nbytes: int, **labels: Any
                 ) -> list[dict[str, Any]]:
    """Run the cases round-robin (``repeat`` rounds after one warm-up round), so that a busy
    machine slows every path alike. Per path: median wall time -> GB/s, median CPU time of this
    process (all threads; robust to other load), and ``vs raw``: the median over rounds of
    (fastest raw path's time / this path's time) in the same round."""
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
    raw = [n for n in wall if n.startswith(("raw files", "raw redis")) or n == "torch copy"]
    best = max(raw, key=lambda n: -statistics.median(wall[n]))
    rows = []
    for name in wall:
        t = statistics.median(wall[name])
        ratio = statistics.median(b / x for b, x in zip(wall[best], wall[name]))
        rows.append({**labels, "path": name, "GB/s": _gbps(nbytes, t), "ms": t * 1e3,
                     "cpu ms": statistics.median(cpu[name]) * 1e3, "vs raw": ratio})
    return rows


def _nothing() -> None:
    return None


def bench_host_disk(root: Path, n: int, repeat: int, threads: int | None = None
                    ) -> list[dict[str, Any]]:
    """host->disk (fsync none / data) and disk->host (warm / cold), store vs raw files/slab."""
    lay = SMOLLM2
    host = HostPool(lay, n)
    host.blocks.normal_()
    nbytes = n * lay.bytes_per_block
    hashes = [os.urandom(16) for _ in range(n)]
    raw_dir = root / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    raw_files = [raw_dir / f"{i}.bin" for i in range(n)]
    rows: list[dict[str, Any]] = []
    tokens = tuple(range(lay.block_size))
    pool = ThreadPoolExecutor(4)

    for fsync in (False, "data"):
        store = DiskStore(root / "store", lay, lay.fingerprint("bench"), fsync=fsync, scan=False)
        eng = TransferEngine(host=host, disk=store, io_threads=threads)

        def clear() -> None:  # untimed: every timed write creates fresh files
            for h in hashes:
                store.remove(h)
            for p in raw_dir.iterdir():
                p.unlink()

        def engine_write() -> None:
            _run_batch(eng, [Move(HostBlock(i), DiskBlock(hashes[i], None, tokens))
                             for i in range(n)])

        def raw_files_write() -> None:
            for i in range(n):
                fd = os.open(raw_files[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, byte_view(host.blocks[i]))
                if fsync:
                    os.fdatasync(fd)
                os.close(fd)

        def raw_files_write_mt() -> None:  # 4 threads, whatever the engine's io_threads
            list(pool.map(lambda i: _raw_write(raw_files[i], host.blocks[i], fsync), range(n)))

        def raw_slab_write() -> None:
            fd = os.open(raw_dir / "slab.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            view, off = byte_view(host.blocks), 0
            while off < len(view):
                off += os.write(fd, view[off:off + (64 << 20)])
            if fsync:
                os.fdatasync(fd)
            os.close(fd)

        rows += _interleaved(
            [("raw files", raw_files_write, clear), ("raw files x4", raw_files_write_mt, clear),
             ("raw slab", raw_slab_write, clear), ("DiskStore+engine", engine_write, clear)],
            repeat, nbytes, direction="host->disk", mode=f"fsync={fsync or 'none'}")
        eng.close()

    # reads: the files of the last write round (engine) stay; the raw ones are rewritten
    assert all(store.put(h, None, tokens, host.blocks[i]) for i, h in enumerate(hashes))
    raw_files_write()
    raw_slab_write()
    dst = HostPool(lay, n)
    eng = TransferEngine(host=dst, disk=store, io_threads=threads)

    def engine_read() -> None:
        _run_batch(eng, [Move(DiskBlock(hashes[i]), HostBlock(i)) for i in range(n)])

    def raw_files_read() -> None:
        for i in range(n):
            with open(raw_files[i], "rb", buffering=0) as f:
                f.readinto(byte_view(dst.blocks[i]))

    def raw_files_read_mt() -> None:
        def one(i: int) -> None:
            with open(raw_files[i], "rb", buffering=0) as f:
                f.readinto(byte_view(dst.blocks[i]))
        list(pool.map(one, range(n)))

    def raw_slab_read() -> None:
        with open(raw_dir / "slab.bin", "rb", buffering=0) as f:
            f.readinto(byte_view(dst.blocks))

    store_files = [store.path_of(h) for h in hashes]
    for cold in (False, True):
        def evict(files: list[Path]) -> Callable[[], None]:
            return (lambda: _evict_page_cache(files)) if cold else _nothing
        rows += _interleaved(
            [("raw files", raw_files_read, evict(raw_files)),
             ("raw files x4", raw_files_read_mt, evict(raw_files)),
             ("raw slab", raw_slab_read, evict([raw_dir / "slab.bin"])),
             ("DiskStore+engine", engine_read, evict(store_files))],
            repeat, nbytes, direction="disk->host", mode="cold" if cold else "warm")
    assert torch.equal(dst.blocks, host.blocks), "bytes read back differ from bytes written"
    eng.close()
    pool.shutdown()
    return rows


def _raw_write(path: Path, block: torch.Tensor, fsync: bool | str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, byte_view(block))
        if fsync:
            os.fdatasync(fd)
    finally:
        os.close(fd)


def bench_device_host(n: int, repeat: int) -> list[dict[str, Any]]:
    lay = SMOLLM2
    dev = DevicePool(lay, n, device=default_device())
    dev.kv_cache.normal_()
    host = HostPool(lay, n)
    nbytes = n * lay.bytes_per_block
    eng = TransferEngine(device=dev, host=host)
    src_flat = torch.empty(nbytes // lay.element_size, dtype=dev.kv_cache.dtype,
                           device=dev.device).normal_()
    dst_flat = torch.empty_like(src_flat, device="cpu", pin_memory=host.pinned)
    sync = torch.cuda.synchronize if dev.device.type == "cuda" else (lambda: None)
    ids = list(range(n))
    # scattered ids: what a real demotion looks like (every other block, then the rest)
    scattered = ids[::2] + ids[1::2]
    rows = []

    def torch_d2h() -> None:
        dst_flat.copy_(src_flat, non_blocking=False)
        sync()

    def torch_h2d() -> None:
        src_flat.copy_(dst_flat, non_blocking=host.pinned)
        sync()

    d2h = [Move(DeviceBlock(b), HostBlock(i)) for i, b in enumerate(scattered)]
    h2d = [Move(HostBlock(i), DeviceBlock(b)) for i, b in enumerate(scattered)]
    for direction, cases in [
            ("device->host", [("torch copy", torch_d2h, _nothing),
                              ("engine", lambda: _run_batch(eng, d2h), _nothing)]),
            ("host->device", [("torch copy", torch_h2d, _nothing),
                              ("engine", lambda: _run_batch(eng, h2d), _nothing)])]:
        rows += _interleaved(cases, repeat, nbytes, direction=direction, mode=str(dev.device))
    eng.close()
    return rows


def bench_rebuild(root: Path, n: int) -> list[dict[str, Any]]:
    lay = TINY
    ns = lay.fingerprint("bench-rebuild")
    store = DiskStore(root / "rebuild", lay, ns, scan=False)
    block = torch.randn(lay.block_shape).to(torch.float16)
    t0 = time.perf_counter()
    parent = None
    for i in range(n):
        h = i.to_bytes(16, "little")
        assert store.put(h, parent, range(i * 16, i * 16 + 16), block)
        parent = h if i % 64 else None  # chains of 64 blocks
    t_fill = time.perf_counter() - t0
    hl = store._header_len

    def bare() -> None:
        for sub in os.listdir(store.dir):
            d = store.dir / sub
            for name in os.listdir(d):
                fd = os.open(d / name, os.O_RDONLY)
                os.fstat(fd)
                os.pread(fd, hl, 0)
                os.close(fd)

    rows = [{"what": "fill (put)", "blocks": n, "threads": 1, "s": t_fill,
             "us/block": t_fill / n * 1e6, "cpu us/block": None}]

    def timed(what: str, threads: int, fn: Callable[[], Any]) -> None:
        fn()  # warm-up: dentries, inodes and headers in the page cache
        wall, cpu = [], []
        for _ in range(3):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
        t, c = statistics.median(wall), statistics.median(cpu)
        rows.append({"what": what, "blocks": n, "threads": threads, "s": t,
                     "us/block": t / n * 1e6, "cpu us/block": c / n * 1e6})

    timed("bare listdir+open+fstat+pread", 1, bare)
    for threads in (1, 4, 8):
        fresh = DiskStore(root / "rebuild", lay, ns, scan=False, scan_threads=threads)

        def scan(fresh: DiskStore = fresh) -> None:
            report = fresh.scan()
            assert len(report.entries) == n and report.corrupt == 0

        timed("DiskStore.scan", threads, scan)
    return rows


#: device tiers (fractions of the working set; "min" = the largest request + 2 blocks), the
#: host tier's fraction, and the disk tier sized so that the three tiers hold the working set
HIT_DEVICE_FRACTIONS = ("min", 0.01, 0.05)
HIT_HOST_FRACTION = 0.10


def bench_hit_rate(quick: bool = False, block_size: int = 16) -> dict[str, Any]:
    """Hit rate of tier configurations on the chat trace vs the infinite cache."""
    from radixkv.benchmarks.bounds import infinite, prepare
    from radixkv.benchmarks.replay import ReplayConfig, replay
    from radixkv.benchmarks.traces import Trace, load_trace

    trace = load_trace("chat", progress=False)
    if quick:
        trace = Trace(trace[:800], trace.header)
    bt = prepare(trace, block_size)
    work = bt.num_blocks
    inf = infinite(bt).hit_rate
    rows: list[dict[str, Any]] = []
    for frac in HIT_DEVICE_FRACTIONS:
        dev = bt.min_capacity + 2 if frac == "min" else max(int(frac * work), bt.min_capacity + 2)
        host = int(HIT_HOST_FRACTION * work)
        disk = max(work - dev - host, 1)
        for h, d in ((0, 0), (host, 0), (host, disk)):
            res = replay(trace, ReplayConfig(block_size, dev, "lru", h, d))
            r = res.as_dict()
            rows.append({"tiers": r["tiers"], "device": frac, "device_blocks": dev,
                         "host_blocks": h, "disk_blocks": d,
                         "capacity/working set": (dev + h + d) / work,
                         "hit_rate": r["hit_rate"], "of_infinite": r["hit_rate"] / inf,
                         "device/host/disk": "/".join(f"{x:.3f}" for x in r["hit_rate_per_tier"]),
                         "hit_rate_per_tier": r["hit_rate_per_tier"],
                         "promotions_per_tier": r["promotions_per_tier"],
                         "evictions_per_tier": r["evictions_per_tier"], "replay_s": r["wall_s"]})
    three = [r for r in rows if r["tiers"] == "device+host+disk"]
    return {"trace": "chat", "requests": len(trace), "prompt_tokens": bt.total_prompt_tokens,
            "block_size": block_size, "working_set_blocks": work,
            "min_capacity_blocks": bt.min_capacity, "infinite": inf, "rows": rows,
            "three_tier_min_of_infinite": min(r["of_infinite"] for r in three),
            "three_tier_ge_98pct_of_infinite": min(r["of_infinite"] for r in three) >= 0.98}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench tiers", description=plain_doc(__doc__))
    ap.add_argument("--blocks", type=int, default=256,
                    help="blocks per bandwidth batch (720 KiB each)")
    ap.add_argument("--rebuild-blocks", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="the engine's io_threads for host<->disk (default: the engine's "
                         "default); the raw baseline always runs 1 and 4 threads")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--parts", default="bandwidth,rebuild,hit-rate",
                    help="comma-separated subset of bandwidth, rebuild, hit-rate, remote, "
                         "remote-engines")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a "
                                                "temporary directory under $TMPDIR)")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16,int8,fp8_e4m3",
                    help="--parts dtypes: the KV dtypes compared (bfloat16 is the baseline)")
    ap.add_argument("--kv-remote", action="store_true",
                    help="--parts dtypes: also the remote tier (starts a local redis-server)")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.rebuild_blocks, args.repeat = 16, 2_000, 2
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    bad = parts - {"bandwidth", "rebuild", "hit-rate", "remote", "remote-engines", "dtypes"}
    if bad:
        ap.error(f"unknown parts {sorted(bad)}")
    root = Path(tempfile.mkdtemp(prefix="radixkv-bench-tiers-", dir=args.dir))
    header = run_header(seed=None, quick=args.quick, xxhash_lib=xxhash.VERSION,
                        blocks=args.blocks,
                        rebuild_blocks=args.rebuild_blocks, io_threads=args.threads,
                        block_bytes=SMOLLM2.bytes_per_block,
                        dir=str(root), parts=sorted(parts))
    print("radixkv bench tiers", header)
    results: dict[str, Any] = {}
    try:
        if "bandwidth" in parts:
            bw = bench_host_disk(root, args.blocks, args.repeat, args.threads)
            bw += bench_device_host(args.blocks, args.repeat)
            print_table(bw, ["direction", "mode", "path", "GB/s", "ms", "cpu ms", "vs raw"],
                        title=f"bandwidth, {args.blocks} blocks x {SMOLLM2.bytes_per_block} B")
            results["bandwidth"] = bw
        if "dtypes" in parts:
            from radixkv.benchmarks import tiers_dtypes as td
            kvs = tuple(x.strip() for x in args.kv_dtypes.split(",") if x.strip())
            dt = td.bench_device_host(args.blocks, args.repeat, kvs)
            dt += td.bench_host_disk(root / "dtypes", args.blocks, args.repeat, kvs,
                                     args.threads)
            if args.kv_remote:
                rm_rows, facts = td.bench_remote_dtypes(args.blocks, args.repeat, kvs)
                dt += rm_rows
                header.update(facts)
            print_table(dt, td.COLUMNS, title=f"bandwidth per KV dtype, {args.blocks} blocks "
                                              f"per batch (SmolLM2, 16 tokens a block)")
            results["dtypes"] = dt
        if "rebuild" in parts:
            rb = bench_rebuild(root, args.rebuild_blocks)
            print_table(rb, title=f"disk index rebuild, {args.rebuild_blocks} block files")
            results["rebuild"] = rb
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "remote" in parts:
        from radixkv.benchmarks.bench_remote import bench_remote  # needs the 'remote' extra
        rm, facts = bench_remote(SMOLLM2, args.blocks, args.repeat, _interleaved)
        header.update(facts)
        print_table(rm, ["direction", "path", "GB/s", "ms", "cpu ms", "vs raw"],
                    title=f"remote (redis-server {facts['redis_server']}, loopback), "
                          f"{args.blocks} blocks x {SMOLLM2.bytes_per_block} B")
        results["remote"] = rm
    if "remote-engines" in parts:
        from radixkv.benchmarks.bench_remote_engines import bench_remote_engines
        re_ = bench_remote_engines(args.quick)
        print_table(re_["rows"], ["device", "run", "engines", "device_blocks_each",
                                  "host_blocks_each",
                                  "hit_rate", "remote_share", "of_single", "of_single+remote",
                                  "seconds"],
                    title=f"replicas sharing a remote tier: chat trace, {re_['requests']} "
                          f"requests, working set {re_['working_set_blocks']} blocks, infinite "
                          f"{re_['infinite']:.4f}")
        print(f"pair+remote / single, worst capacity = {re_['pair_remote_of_single_min']:.3f} "
              f"(target >= 0.98); / single+remote = "
              f"{re_['pair_remote_of_single_remote_min']:.3f}")
        results["remote_engines"] = re_
    if "hit-rate" in parts:
        hr = bench_hit_rate(args.quick)
        print_table(hr["rows"], ["tiers", "device", "device_blocks", "host_blocks", "disk_blocks",
                                 "capacity/working set", "hit_rate", "device/host/disk",
                                 "of_infinite"],
                    title=f"chat trace hit rate ({hr['requests']} requests, working set "
                          f"{hr['working_set_blocks']} blocks, infinite {hr['infinite']:.4f})")
        results["hit_rate"] = hr
    name = "tiers_quick" if args.quick else "tiers"
    if parts != {"bandwidth", "rebuild", "hit-rate"}:
        name += "_" + "_".join(sorted(parts))
    write_results(name, header, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
