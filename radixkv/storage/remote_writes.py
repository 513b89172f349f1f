"""The remote store's write path: the bounded queue, the writer thread, pipelined batches.

:class:`RemoteWriteQueue` is a part of :class:`~radixkv.storage.remote.RemoteStore` (it owns the
queue, the thread and what they count; the store owns the connection and encodes values).
Writes are queued and sent by one background thread in pipelined batches (``SET`` with the
key's expiry; ``PEXPIRE`` for a refresh, which sends no payload), so the caller never waits on
the network unless it asks (``wait=True``). A full queue or a server that is down drops the
write and counts it: a write is only a future hit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from redis.exceptions import RedisError

#: One queued write: ``(key, value, px)`` is a ``SET`` of ``value`` with expiry ``px`` ms (None:
#: none); ``(key, None, px)`` a ``PEXPIRE`` (a refresh).
WriteItem = tuple[bytes, bytes | None, int | None]


class WriteCounters(Protocol):
    """The counters of ``RemoteStats`` the write path updates (declared here so that this
    module does not import remote.py, which imports it)."""

    puts: int
    put_failures: int
    put_dropped: int
    put_skipped: int
    round_trips: int
    bytes_written: int
    refreshes: int
    refresh_missed: int


class RemoteWriteQueue:
    """The write path of one ``RemoteStore`` (see the module docstring); thread-safe.

    Args:
        lock, stats: the store's lock and counters (``puts``, ``put_failures``,
            ``put_dropped``, ``put_skipped``, ``round_trips``, ``bytes_written``,
            ``refreshes``, ``refresh_missed``), updated under the lock.
        available: whether the server is up (the store's view).
        pipeline: a new non-transactional pipeline on the store's client.
        fail: the store's handler of a client error (counts it; may take the store down).
        probe_if_due: the store's reconnect attempt, called by the thread while the server is
            down (it backs off by itself).
        queue_blocks: values the queue may hold; a put beyond it is dropped.
        write_batch: values per pipelined batch.
        name: the writer thread's name.
    """

    def __init__(self, *, lock: threading.Lock, stats: WriteCounters,
                 available: Callable[[], bool], pipeline: Callable[[], Any],
                 fail: Callable[[str, RedisError], None], probe_if_due: Callable[[], None],
                 queue_blocks: int, write_batch: int, name: str) -> None:
        self._lock, self._stats = lock, stats
        self._available, self._pipeline, self._fail = available, pipeline, fail
        self._probe_if_due = probe_if_due
        self._write_batch = write_batch
        self._queue: queue.Queue[WriteItem] = queue.Queue(queue_blocks)
        self._lost: list[bytes] = []   # keys a refresh found gone, for take_lost_keys
        self._pending = 0   # values queued or being written
        self._idle = threading.Condition(lock)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._thread.start()

    def submit(self, items: list[WriteItem], wait: bool) -> list[bool]:
        """Queue ``items`` (never blocks: a full queue or an unavailable server drops the write
        and counts it), or with ``wait`` write them in this thread as one pipelined batch
        (True once the server acknowledged)."""
        if wait:
            return self.write(items)
        if not self._available():
            with self._lock:
                self._stats.put_skipped += len(items)
            return [False] * len(items)
        queued = []
        for item in items:
            with self._lock:
                self._pending += 1
            try:
                self._queue.put_nowait(item)
                queued.append(True)
            except queue.Full:
                with self._lock:
                    self._pending -= 1
                    self._stats.put_dropped += 1
                queued.append(False)
        return queued

    def write(self, items: list[WriteItem]) -> list[bool]:
        """Send ``items`` now as one pipelined batch; per item whether the server did it."""
        if not items:
            return []
        if not self._available():
            with self._lock:
                self._stats.put_skipped += len(items)
            return [False] * len(items)
        pipe = self._pipeline()
        for key, value, px in items:
            if value is None:
                pipe.pexpire(key, px)
            else:
                pipe.set(key, value, px=px)
        try:
            replies = pipe.execute(raise_on_error=False)
        except RedisError as e:
            self._fail("put", e)
            with self._lock:
                self._stats.put_failures += len(items)
            return [False] * len(items)
        ok = [r is True or (v is None and r == 1) for r, (_, v, _) in zip(replies, items)]
        errors = [r for r in replies if isinstance(r, RedisError)]
        with self._lock:
            s = self._stats
            s.round_trips += 1
            for (key, v, _), r, good in zip(items, replies, ok):
                if v is not None:
                    s.puts += good
                    s.put_failures += not good
                    s.bytes_written += len(v) if good else 0
                elif good:
                    s.refreshes += 1
                elif not isinstance(r, RedisError):
                    s.refresh_missed += 1
                    self._lost.append(key)
                else:
                    s.put_failures += 1
        if errors:
            self._fail("put", errors[0])
        return ok

    def take_lost_keys(self) -> list[bytes]:
        """Keys whose refresh found them gone since the last call."""
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def _loop(self) -> None:
        """Background writer: batches queued values into pipelines; probes while down."""
        while not self._closed.is_set():
            if not self._available():
                self._probe_if_due()
            try:
                first = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self._write_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self.write(batch)
            finally:
                with self._lock:
                    self._pending -= len(batch)
                    self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued value was written or failed; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float) -> None:
        """Stop the thread (after the batch in hand), waiting up to ``timeout`` s."""
        self._closed.set()
        self._thread.join(timeout=timeout)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers, if the queue and its count disagree."""
        with self._lock:
            assert self._pending >= 0, f"pending {self._pending} < 0"
            assert self._queue.qsize() <= self._pending, \
                f"{self._queue.qsize()} queued > {self._pending} pending"


__all__ = ["RemoteWriteQueue", "WriteCounters", "WriteItem"]
