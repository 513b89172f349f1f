"""Block moves between the device, host and disk tiers, off the critical path.

The bookkeeping layer decides *what* moves (``Move(DeviceBlock(17), HostBlock(5))``); this engine
moves the bytes on a worker thread (and its own CUDA stream on a GPU) and reports, per move,
whether it happened. Protocol (two-phase, after vLLM's offloading connector)::

    batch  = engine.prepare(moves)  # 1. validate + reserve; raises, reserving nothing, on a
                                    #    bad id or a conflict with a batch in flight. The caller
                                    #    has pinned the blocks/slots involved (refcount) first.
    engine.submit(batch)            # 2. queue (bounded: blocks while full); returns at once
    ...                             #    compute goes on; sources stay pinned, targets invisible
    result = engine.wait(batch)     # 3. or engine.poll() (every finished batch) or
                                    #    engine.complete(batch) (non-blocking, one batch)
    for move, ok in zip(result.moves, result.ok):
        commit(move) if ok else roll_back(move)   # caller: publish target / free target slot

Reservations: while a batch is prepared or running, its sources are *read*-reserved and its
targets *write*-reserved. A new batch may not write anything reserved, nor read anything
write-reserved; reads may overlap (write-through: one device block to host and disk). Inside one
batch no location is both read and written, so the order of its moves does not matter.

Failures never escape the worker: a disk put/get that fails is one failed move, an exception in
a device/host copy fails the moves of that copy group, and the batch still completes. A failed
move's target holds garbage and must not be published; its source is untouched.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar
from concurrent.futures import ThreadPoolExecutor

import torch

from radixkv.errors import ConfigError, InvalidBlockError, StorageError
from radixkv.storage.backend import BlockWrite, StorageBackend
from radixkv.storage.buffers import byte_view, torch_dtype
from radixkv.storage.device import DevicePool
from radixkv.storage.host import HostPool
from radixkv.tiers.moves import (
    Batch, BatchResult, DeviceBlock, DiskBlock, HostBlock, Location, Move, TransferStats, _key,
)

log = logging.getLogger(__name__)

#: What an I/O path catches: the OS's errors, the stores' own (``StorageError``), a block that
#: fails verification, and torch's RuntimeError of a failed device copy. Anything else is a bug
#: and is not caught here.
IO_ERRORS: tuple[type[BaseException], ...] = (OSError, StorageError, InvalidBlockError,
                                              RuntimeError)


_STOP = object()
_T = TypeVar("_T")


def _block_bytes(staged: torch.Tensor) -> list[memoryview]:
    """Per-block byte views of a contiguous CPU staging tensor ``[n, L, 2, bs, h, d]``."""
    view = byte_view(staged)
    n = view.nbytes // staged.shape[0] if staged.shape[0] else 0
    return [view[i * n:(i + 1) * n] for i in range(staged.shape[0])]


def _slot(loc: Location) -> int:
    """The device or host block id of a memory location (disk blocks have none)."""
    if isinstance(loc, DeviceBlock):
        return loc.block_id
    if isinstance(loc, HostBlock):
        return loc.block_id
    raise InvalidBlockError(f"{loc} is not a memory location")


def _as_range(ids: list[int]) -> slice | None:
    """``slice(a, b)`` when ids are ``a, a+1, ..., b-1`` (a view instead of a gather)."""
    if ids and all(b == a + 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return None


class TransferEngine:
    """Executes batches of moves between ``device``, ``host`` and ``disk`` on a worker thread.

    Args:
        device, host, disk: the tiers (any may be None if no move uses it). ``disk`` is any
            hash-keyed :class:`~radixkv.storage.backend.StorageBackend` (the engine's is a
            ``DiskStore``): the engine calls only its ``put_many`` and ``read_into_many``.
        queue_depth: batches that may wait for the worker; ``submit`` blocks beyond that.
        io_threads: threads doing the per-block disk reads/writes of one batch in parallel
            (``None``: 4).
    """

    def __init__(self, device: DevicePool | None = None, host: HostPool | None = None,
                 disk: StorageBackend[bytes] | None = None, queue_depth: int = 8,
                 io_threads: int | None = None) -> None:
        if io_threads is None:
            io_threads = 4
        if queue_depth <= 0 or io_threads <= 0:
            raise ConfigError(f"queue_depth and io_threads must be > 0, got {queue_depth}, "
                              f"{io_threads}")
        layouts = {t.layout for t in (device, host, disk) if t is not None}
        if len(layouts) > 1:
            raise ConfigError(f"tiers disagree on the block layout: {layouts}")
        self.device, self.host, self.disk = device, host, disk
        self._cuda = device is not None and device.device.type == "cuda"
        self._stream = torch.cuda.Stream(device.device) \
            if device is not None and self._cuda else None
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_depth)
        self.io_threads = io_threads
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="radixkv-io")
        self._cond = threading.Condition()
        self._reads: Counter[tuple[str, object]] = Counter()
        self._writes: set[tuple[str, object]] = set()
        self._batches: dict[int, Batch] = {}
        self._results: dict[int, BatchResult] = {}
        self._ids = itertools.count()
        self._stats = TransferStats()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="radixkv-transfer", daemon=True)
        self._worker.start()

    # ---- phase 1: prepare --------------------------------------------------------------------
    def prepare(self, moves: Sequence[Move]) -> Batch:
        """Validate ``moves`` and reserve their locations. Raises ``InvalidBlockError`` (bad id,
        a conflict inside the batch or with a batch in flight) or ``ConfigError`` (a tier
        missing) and then reserves nothing. Runtime: O(len(moves))."""
        moves = tuple(moves)
        for m in moves:
            self._check_move(m)
        reads = [_key(m.src) for m in moves]
        writes = [_key(m.dst) for m in moves]
        if len(set(writes)) != len(writes):
            raise InvalidBlockError(f"two moves write the same location: "
                                    f"{[k for k, n in Counter(writes).items() if n > 1][:5]}")
        if set(writes) & set(reads):
            raise InvalidBlockError(f"locations both read and written in one batch: "
                                    f"{sorted(set(writes) & set(reads), key=str)[:5]}")
        with self._cond:
            if self._closed:
                raise StorageError("TransferEngine is closed")
            busy = [k for k in writes if k in self._writes or k in self._reads]
            busy += [k for k in reads if k in self._writes]
            if busy:
                raise InvalidBlockError(f"locations in flight in another batch: {busy[:5]}; "
                                        "wait for it before moving them again")
            self._reads.update(reads)
            self._writes.update(writes)
            batch = Batch(next(self._ids), moves)
            self._batches[batch.id] = batch
        return batch

    def _check_move(self, m: Move) -> None:
        if not isinstance(m, Move):
            raise InvalidBlockError(f"not a Move: {m!r}")
        for loc in (m.src, m.dst):
            if isinstance(loc, DeviceBlock):
                if self.device is None:
                    raise ConfigError(f"{m}: no device pool")
                if not 0 <= loc.block_id < self.device.num_blocks:
                    raise InvalidBlockError(f"device block {loc.block_id} outside "
                                            f"[0, {self.device.num_blocks})")
            elif isinstance(loc, HostBlock):
                if self.host is None:
                    raise ConfigError(f"{m}: no host pool")
                if not 0 <= loc.block_id < self.host.num_blocks:
                    raise InvalidBlockError(f"host block id {loc.block_id} outside "
                                            f"[0, {self.host.num_blocks})")
            elif isinstance(loc, DiskBlock):
                if self.disk is None:
                    raise ConfigError(f"{m}: no disk store")
                if not isinstance(loc.block_hash, bytes) or len(loc.block_hash) != 16:
                    raise InvalidBlockError(f"disk block hash must be 16 bytes: {loc}")
            else:
                raise InvalidBlockError(f"unknown location {loc!r}")
        if isinstance(m.src, DiskBlock) and isinstance(m.dst, DiskBlock):
            raise ConfigError("disk->disk moves are not supported")

    def abort(self, batch: Batch) -> None:
        """Release a prepared batch that will not be submitted."""
        with self._cond:
            if batch.state != "prepared":
                raise InvalidBlockError(f"batch {batch.id} is {batch.state}, cannot abort")
            batch.state = "aborted"
            self._release(batch)

    # ---- phase 2: submit ---------------------------------------------------------------------
    def submit(self, batch: Batch, timeout: float | None = None) -> Batch:
        """Queue a prepared batch for the worker; blocks while the queue is full (up to
        ``timeout`` s, then raises ``StorageError`` and the batch stays prepared)."""
        if batch.state != "prepared":
            raise InvalidBlockError(f"batch {batch.id} is {batch.state}, not prepared")
        if self._cuda:  # the worker's stream must see what compute wrote to source blocks
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._dev().device))
            batch.ready_event = event
        try:
            batch.state = "queued"
            self._queue.put(batch, timeout=timeout)
        except queue.Full:
            batch.state = "prepared"
            raise StorageError(f"transfer queue full ({self._queue.maxsize} batches) after "
                               f"{timeout} s; poll() results or raise queue_depth") from None
        return batch

    # ---- phase 3: complete ---------------------------------------------------------------------
    def complete(self, batch: Batch) -> BatchResult | None:
        """The batch's result if it has finished (releasing its reservations), else None.
        A result is handed out once."""
        with self._cond:
            return self._take(batch.id)

    def poll(self) -> list[BatchResult]:
        """Results of every finished batch not yet collected (non-blocking), oldest first."""
        with self._cond:
            return [r for r in (self._take(i) for i in sorted(self._results)) if r is not None]

    def wait(self, batch: Batch, timeout: float | None = None) -> BatchResult | None:
        """Block until the batch finishes (None after ``timeout`` s); then as ``complete``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while batch.id not in self._results:
                if batch.state in ("completed", "aborted", "prepared"):
                    raise InvalidBlockError(f"batch {batch.id} is {batch.state}: nothing to wait")
                if not self._worker.is_alive():
                    raise StorageError("transfer worker died; see the log")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(0.1 if left is None else min(left, 0.1))
            return self._take(batch.id)

    def drain(self) -> list[BatchResult]:
        """Wait for every submitted batch; return all uncollected results."""
        with self._cond:
            queued = [b for b in self._batches.values() if b.state in ("queued", "done")]
        for b in queued:
            while b.state == "queued":
                with self._cond:
                    self._cond.wait(0.05)
        return self.poll()

    def _take(self, batch_id: int) -> BatchResult | None:  # caller holds the lock
        result = self._results.pop(batch_id, None)
        if result is not None:
            batch = self._batches.pop(batch_id)
            batch.state = "completed"
            self._release(batch)
        return result

    def _release(self, batch: Batch) -> None:  # caller holds the lock
        self._reads.subtract(_key(m.src) for m in batch.moves)
        self._reads = +self._reads  # drop zero counts
        self._writes.difference_update(_key(m.dst) for m in batch.moves)
        self._batches.pop(batch.id, None)

    @property
    def in_flight(self) -> int:
        """Batches prepared, queued or finished but not yet collected."""
        with self._cond:
            return len(self._batches)

    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers, unless the reservations are exactly those of
        the batches prepared, queued or finished-but-uncollected."""
        with self._cond:
            live = [b for b in self._batches.values() if b.state != "aborted"]
            reads = Counter(_key(m.src) for b in live for m in b.moves)
            writes = {_key(m.dst) for b in live for m in b.moves}
            assert reads == self._reads, f"read reservations {dict(self._reads)} != {dict(reads)}"
            assert writes == self._writes, f"write reservations {len(self._writes)} != " \
                                           f"{len(writes)} of {len(live)} live batches"

    def stats(self) -> TransferStats:
        """A snapshot of the counters."""
        with self._cond:
            s = self._stats
            return TransferStats(s.batches, s.moves_ok, s.moves_failed, dict(s.bytes_moved),
                                 dict(s.seconds), s.batch_errors)

    def close(self) -> None:
        """Finish queued batches and stop the worker (results stay collectable)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._worker.join()
        self._io.shutdown(wait=True)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the worker --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _STOP:
                return
            assert isinstance(batch, Batch)
            t0 = time.perf_counter()
            ok: list[bool] = [False] * len(batch.moves)
            errors: list[str | None] = ["not executed"] * len(batch.moves)
            timing: dict[str, float] = {}
            try:
                self._execute(batch, ok, errors, timing)
            except Exception as e:  # noqa: BLE001 -- not an I/O error: a bug. It fails the
                # batch loudly (traceback logged, every move reported failed, so no block is
                # served from it) instead of killing the worker and hanging every later batch.
                log.exception("transfer batch %d failed (a bug, not an I/O error)", batch.id)
                with self._cond:
                    self._stats.batch_errors += 1
                for i, done in enumerate(ok):
                    if not done:
                        errors[i] = f"{type(e).__name__}: {e}"
            result = BatchResult(batch.id, batch.moves, tuple(ok),
                                 tuple(None if o else e for o, e in zip(ok, errors)),
                                 time.perf_counter() - t0)
            self._record(batch, result, timing)

    def _record(self, batch: Batch, result: BatchResult, timing: dict[str, float]) -> None:
        nbytes = self._block_bytes()
        with self._cond:
            s = self._stats
            s.batches += 1
            for m, ok in zip(batch.moves, result.ok):
                if ok:
                    s.moves_ok += 1
                    s.bytes_moved[m.direction] = s.bytes_moved.get(m.direction, 0) + nbytes
                else:
                    s.moves_failed += 1
            for d, t in timing.items():
                s.seconds[d] = s.seconds.get(d, 0.0) + t
            self._results[batch.id] = result
            batch.state = "done"
            self._cond.notify_all()

    def _block_bytes(self) -> int:
        tier = self.device or self.host or self.disk
        return tier.layout.bytes_per_block if tier is not None else 0

    def _execute(self, batch: Batch, ok: list[bool], errors: list[str | None],
                 timing: dict[str, float]) -> None:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, m in enumerate(batch.moves):
            groups[m.direction].append(i)
        stream = self._stream
        stream_ctx = torch.cuda.stream(stream) if stream is not None \
            else contextlib.nullcontext()
        with stream_ctx:
            if stream is not None and batch.ready_event is not None:
                stream.wait_event(batch.ready_event)
            for direction, idx in groups.items():
                t0 = time.perf_counter()
                moves = [batch.moves[i] for i in idx]
                try:
                    results = self._copy_group(direction, moves)
                    if stream is not None:
                        stream.synchronize()  # done means visible to every stream
                except IO_ERRORS as e:
                    log.warning("transfer %s of %d blocks failed: %s", direction, len(idx), e)
                    results = [f"{type(e).__name__}: {e}"] * len(idx)
                timing[direction] = time.perf_counter() - t0
                for i, r in zip(idx, results):
                    ok[i], errors[i] = r is None, r

    def _dev(self) -> DevicePool:
        if self.device is None:   # prepare() refuses such moves; a bug if reached
            raise ConfigError("a move needs the device pool, and there is none")
        return self.device

    def _host(self) -> HostPool:
        if self.host is None:
            raise ConfigError("a move needs the host pool, and there is none")
        return self.host

    def _copy_group(self, direction: str, moves: list[Move]) -> list[str | None]:
        """Execute moves of one direction; per move None (ok) or the reason it failed."""
        if direction == "host->disk":
            host = self._host()
            return self._puts(moves, [host.block_bytes(_slot(m.src)) for m in moves])
        if direction == "device->disk":
            staged = self._dev().read_blocks([_slot(m.src) for m in moves]).to("cpu")
            return self._puts(moves, _block_bytes(staged))
        dst = [_slot(m.dst) for m in moves]
        if direction == "disk->host":
            host = self._host()
            res = self._gets(moves, [host.block_bytes(s) for s in dst])
            host.mark_filled(s for s, r in zip(dst, res) if r is None)
            return res
        if direction == "disk->device":
            dev = self._dev()
            staged = torch.empty((len(moves), *dev.layout.block_shape),
                                 dtype=torch_dtype(dev.layout.dtype),
                                 pin_memory=self._cuda)
            res = self._gets(moves, _block_bytes(staged))
            good = [i for i, r in enumerate(res) if r is None]
            if len(good) == len(moves):
                dev.write_blocks(dst, staged)  # pinned staging: an asynchronous DMA on a GPU
            elif good:
                dev.write_blocks([dst[i] for i in good], staged[good])
            return res
        src = [_slot(m.src) for m in moves]
        if direction == "host->host":
            host = self._host()
            host.write_blocks(dst, host.read_blocks(src))
            return [None] * len(moves)
        dev = self._dev()
        if direction == "device->device":
            dev.copy_blocks(src, dst)
            return [None] * len(moves)
        host = self._host()
        if direction not in ("device->host", "host->device"):
            raise ConfigError(f"unsupported move direction {direction}")
        if dev.device.type == "cpu" and host.blocks.device.type == "cpu":
            self._cpu_copies(direction, src, dst)
            if direction == "device->host":
                host.mark_filled(dst)
        elif direction == "device->host":
            run = _as_range(dst)
            if run is not None:  # consecutive slots: straight into place (one DMA on a GPU)
                dev.read_blocks_into(src, host.blocks[run])
                host.mark_filled(dst)
            else:
                host.write_blocks(dst, dev.read_blocks(src))
        else:
            run = _as_range(src)
            dev.write_blocks(dst, host.blocks[run] if run is not None else host.read_blocks(src))
        return [None] * len(moves)

    def _puts(self, moves: list[Move], blocks: list[memoryview]) -> list[str | None]:
        """Disk writes through the store's ``put_many``, one batch per I/O thread."""
        disk = self.disk
        assert disk is not None

        def part(a: int, b: int) -> list[str | None]:
            items = []
            for m, buf in zip(moves[a:b], blocks[a:b]):
                d = m.dst
                assert isinstance(d, DiskBlock)
                items.append(BlockWrite(d.block_hash, d.parent_hash, d.token_ids, buf))
            try:
                res = disk.put_many(items)
            except IO_ERRORS as e:  # reported per move; the worker goes on
                return [f"{type(e).__name__}: {e}"] * (b - a)
            return [None if good else "disk write failed (disk full or I/O error; see log)"
                    for good in res]
        return self._spread(part, len(moves))

    def _gets(self, moves: list[Move], outs: list[memoryview]) -> list[str | None]:
        """Disk reads through the store's ``read_into_many``, one batch per I/O thread."""
        disk = self.disk
        assert disk is not None

        def part(a: int, b: int) -> list[str | None]:
            hashes = []
            for m in moves[a:b]:
                assert isinstance(m.src, DiskBlock)
                hashes.append(m.src.block_hash)
            try:
                res = disk.read_into_many(hashes, outs[a:b])
            except IO_ERRORS as e:   # a miss: reported, counted, the block is recomputed
                return [f"{type(e).__name__}: {e}"] * (b - a)
            return [None if good else "disk block missing, corrupt or unreadable"
                    for good in res]
        return self._spread(part, len(moves))

    def _cpu_copies(self, direction: str, src: list[int], dst: list[int]) -> None:
        """device<->host when the device tier is the CPU: one strided copy per block through
        NumPy views, spread over the I/O threads (NumPy releases the GIL for the copy).

        Why not one torch op: the scatter side has no single-pass torch op (``index_copy_`` and
        ``index_put_`` move one element at a time), and per-block torch copies each open an
        OpenMP parallel region, which collapses when other processes hold the cores. Ids were
        range-checked by ``prepare``, and a batch never writes one location twice."""
        kv = self._dev().kv_cache.view(torch.uint8).numpy()  # [L, 2, N, bs, h, d * esize]
        hb = self._host().blocks.view(torch.uint8).numpy()    # [slots, L, 2, bs, h, d * esize]
        if direction == "device->host":
            def part(a: int, b: int) -> None:
                for i in range(a, b):
                    hb[dst[i]] = kv[:, :, src[i]]
        else:
            def part(a: int, b: int) -> None:
                for i in range(a, b):
                    kv[:, :, dst[i]] = hb[src[i]]
        self._chunks(part, len(src))

    def _chunks(self, part: Callable[[int, int], _T], n: int) -> list[_T]:
        """``part(a, b)`` over ``min(io_threads, n)`` contiguous chunks of ``range(n)`` on the
        I/O threads (one hand-off per thread, not per block); results in chunk order."""
        k = min(self.io_threads, n)
        if k <= 1:
            return [part(0, n)]
        bounds = [n * j // k for j in range(k + 1)]
        return list(self._io.map(lambda j: part(bounds[j], bounds[j + 1]), range(k)))

    def _spread(self, part: Callable[[int, int], list[str | None]], n: int
                ) -> list[str | None]:
        """``part(a, b)`` (per-move results of moves ``a..b-1``) over the I/O threads in
        ``io_threads`` contiguous chunks (one hand-off per thread, not per block; file I/O and
        xxhash release the GIL)."""
        parts = self._chunks(part, n)
        return [r for chunk in parts for r in chunk]


__all__ = ["Batch", "BatchResult", "DeviceBlock", "DiskBlock", "HostBlock", "Location", "Move",
           "TransferEngine", "TransferStats"]
