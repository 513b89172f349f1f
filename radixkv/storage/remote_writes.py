"""The remote store's write path: encoding, the bounded queue, the writer thread, key TTLs.

``RemoteWrites`` is a mixin of :class:`~radixkv.storage.remote.RemoteStore` (one owner: what
reaches the server and when). Writes are queued and sent by one background thread in pipelined
batches (``SET`` with the key's expiry; ``PEXPIRE`` for a refresh, which sends no payload), so
the caller never waits on the network unless it asks (``wait=True``). A full queue or a server
that is down drops the write and counts it: a write is only a future hit.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from radixkv.errors import InvalidBlockError
from radixkv.storage.backend import PutResult, check_hash
from radixkv.storage.remote_format import Signer, encode_value

if TYPE_CHECKING:
    from radixkv.storage.layout import KVLayout
    from radixkv.storage.remote import RemoteStats

log = logging.getLogger(__name__)

PutItem = tuple[bytes, bytes | None, Sequence[int], Any]  # (hash, parent, token ids, payload)


class RemoteWrites:
    """The write path of ``RemoteStore`` (a mixin; see the module docstring)."""

    layout: KVLayout
    namespace: bytes
    signer: Signer | None
    ttl_ms: int | None
    _prefix: bytes
    _lock: threading.Lock
    _stats: RemoteStats
    _available: bool
    _retry_at: float
    _write_batch: int
    _queue: queue.Queue[tuple[bytes, bytes | None, int | None]]
    _lost: list[bytes]
    _pending: int
    _idle: threading.Condition
    _closed: threading.Event

    if TYPE_CHECKING:  # RemoteStore's own helpers, used here
        def _keys(self, hashes: Sequence[bytes]) -> list[bytes]: ...
        def _view(self, buf: Any, what: str, writable: bool = False) -> memoryview: ...
        def _pipeline(self) -> Any: ...
        def _probe(self, first: bool = False) -> bool: ...
        def _fail(self, op: str, e: RedisError) -> None: ...

    def encode(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
               payload: Any) -> tuple[bytes, bytes]:
        """(key, value) of a block; copies ``payload`` (the caller may reuse its buffer)."""
        (key,) = self._keys([block_hash])
        if parent_hash is not None:
            check_hash(parent_hash, "parent_hash")
        tokens = tuple(int(t) for t in token_ids)
        if any(not 0 <= t < 2**32 for t in tokens):
            raise InvalidBlockError("token ids must be in [0, 2**32)")
        view = self._view(payload, "RemoteStore.put")
        return key, encode_value(self.namespace, block_hash, parent_hash, tokens, self.layout,
                                 view, self.signer)

    def put(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
            payload: Any, wait: bool = False) -> bool:
        """Store one block (``payload``: bytes-like of ``bytes_per_block`` bytes). Returns
        whether it was queued (``wait=False``) or written (``wait=True``)."""
        return self.put_many([(block_hash, parent_hash, token_ids, payload)], wait)[0]

    def put_many(self, blocks: Iterable[PutItem], wait: bool = False,
                 ttl_s: float | None = None) -> PutResult:
        """Store blocks: queued for the background writer (never blocks; a full queue or an
        unavailable server drops the write and counts it), or with ``wait=True`` written in
        this thread as one pipelined batch (True once the server acknowledged).

        ``ttl_s``: a retention these blocks must have at least (a 24-hour prompt cache): their
        keys expire after the longer of it and the store's ``ttl_s``; a store without a key TTL
        keeps every key until the server's own eviction anyway, so it changes nothing there."""
        # Encode the whole call first (it validates every block: a caller bug raises before
        # anything is queued), then queue: the writer then sees full batches. Queueing each
        # value as soon as it is encoded was tried: no faster on two shared cores (the GIL
        # alternates between encoder and writer, and the writer sends 1-value pipelines).
        px = self._px(ttl_s)
        return PutResult(self._enqueue([(*self.encode(*b), px) for b in blocks], wait))

    def refresh_many(self, hashes: Sequence[bytes], ttl_s: float | None = None,
                     wait: bool = False) -> list[bool]:
        """Restart the expiry clock of blocks already written (``PEXPIRE``, no payload sent):
        a block kept for a retention is used again. A key the server no longer has is counted
        (``refresh_missed``) and its hash handed out by :meth:`take_lost`, so the caller writes
        it again. A store without a key TTL has nothing to refresh: a no-op."""
        px = self._px(ttl_s)
        if px is None:
            return [True] * len(hashes)
        keys = self._keys(hashes)
        return self._enqueue([(k, None, px) for k in keys], wait)

    def take_lost(self) -> list[bytes]:
        """Block hashes whose refresh found no key since the last call (thread-safe)."""
        with self._lock:
            lost, self._lost = self._lost, []
        n = len(self._prefix)
        return [bytes.fromhex(k[n:].decode()) for k in lost]

    def _px(self, ttl_s: float | None) -> int | None:
        if ttl_s is not None and not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise InvalidBlockError(f"ttl_s must be a positive, finite time, got {ttl_s!r}")
        if self.ttl_ms is None or ttl_s is None:
            return self.ttl_ms
        return max(self.ttl_ms, int(ttl_s * 1000))

    def _enqueue(self, items: list[tuple[bytes, bytes | None, int | None]],
                 wait: bool) -> list[bool]:
        if wait:
            return self._write(items)
        if not self._available:
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

    def _write(self, items: list[tuple[bytes, bytes | None, int | None]]) -> list[bool]:
        if not items:
            return []
        if not self._available:
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

    def _write_loop(self) -> None:
        """Background writer: batches queued values into pipelines; probes while down."""
        while not self._closed.is_set():
            if not self._available and time.monotonic() >= self._retry_at:
                self._probe()
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
                self._write(batch)
            finally:
                with self._lock:
                    self._pending -= len(batch)
                    self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued value was written or failed; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)


__all__ = ["PutItem", "RemoteWrites"]
