"""The remote tier's store: KV blocks in a Redis (>= 6) or Valkey server that replicas share.

One ``RemoteStore`` per (server, namespace). Keys and values are defined in
``remote_format.py``; URLs and the client in ``remote_client.py``; the write queue and its
thread in ``remote_writes.py`` (a part the store owns, not a base class). The store is
torch-free: blocks go in and out as byte views (``buffers.byte_view(tensor)`` of a host
slot), like the disk tier's.

What costs a round trip:
  * ``contains_many(hashes)``: one pipelined batch of ``EXISTS`` (one write, one read).
  * ``get_many`` / ``read_into_many``: one ``MGET`` (a cluster: one pipelined batch per node).
  * ``put``/``put_many``: queued; a background writer sends up to ``write_batch`` values per
    pipelined batch of ``SET``. ``wait=True`` writes in the caller's thread instead.
    ``ttl_s=`` gives these blocks a longer key expiry than the store's (a retention).
  * ``refresh_many(hashes, ttl_s)``: queued like puts, one ``PEXPIRE`` per key and no payload
    (a retained block used again); keys found gone come back through ``take_lost``.

Fault model (what each failure becomes; nothing raises to the caller, nothing blocks it longer
than about ``socket_timeout`` + ``connect_timeout``):
  * server down at construction -> the store is built, warns once, ``available`` is False, reads
    are misses and puts are dropped (counted) without touching the network; the writer thread
    reconnects with exponential backoff (``backoff_s``) and logs when the server is back.
  * server killed or unreachable mid-run -> the call in flight fails within the socket timeout
    (``connection_errors`` / ``timeouts`` + 1), returns misses / False, and the store goes to the
    unavailable state above (one warning per outage, not per call).
  * a value that fails verification (corrupt, truncated, stale format, foreign) -> a miss,
    counted by kind, and deleted (one more round trip, only when a batch held bad values).
  * a server error reply (``OOM`` under ``maxmemory`` with ``noeviction``, ``READONLY``...) ->
    the put fails and is counted; the store stays available. A key evicted by ``maxmemory`` or
    expired by the TTL is a plain miss.
  * a full write queue -> the put is dropped and counted (``put_dropped``), decode never waits.
Only ``redis.exceptions.RedisError`` (the client's error hierarchy; socket errors arrive wrapped
in it) is caught; anything else is a bug and propagates.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

try:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the remote tier needs the 'redis' package: "
                      "pip install 'radixkv[remote]'") from e

from radixkv.errors import ConfigError, InvalidBlockError
from radixkv.storage.backend import (Pins, PutResult, StorageBackend, block_view, check_hash,
                                     check_outs)
from radixkv.storage.layout import KVLayout
from radixkv.storage.remote_client import make_client, parse_url
from radixkv.storage.remote_format import (HASH_BYTES, BadValue, RemoteBlock, Signer,
                                           decode_value, encode_value, key_prefix)
from radixkv.storage.remote_writes import RemoteWriteQueue, WriteItem

log = logging.getLogger(__name__)



@dataclass
class RemoteStats:
    """Counters of one RemoteStore (``stats()`` returns a copy). Bytes are value bytes."""

    gets: int = 0               # blocks asked for by get_many/read_into_many
    hits: int = 0
    misses: int = 0             # absent keys (never written, expired, evicted) + bad values
    unavailable_misses: int = 0  # blocks answered as misses without asking (server down)
    corrupt: int = 0
    stale: int = 0              # another format version under our key
    foreign: int = 0
    deleted: int = 0            # bad values removed
    puts: int = 0               # blocks written (server acknowledged)
    put_failures: int = 0       # batches' blocks lost to an error reply or connection error
    put_dropped: int = 0        # write queue full
    put_skipped: int = 0        # store unavailable at put time
    round_trips: int = 0
    connection_errors: int = 0
    timeouts: int = 0
    error_replies: int = 0
    outages: int = 0            # available -> unavailable transitions (one warning each)
    reconnects: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    refreshes: int = 0          # key TTLs extended (retention of a block that was written)
    refresh_missed: int = 0     # refreshes of a key the server no longer had


#: One block to put: ``(block_hash, parent_hash, token_ids, payload)`` (a ``BlockWrite``).
PutItem = tuple[bytes, bytes | None, Sequence[int], Any]


class RemoteStore:
    """Blocks of one namespace in a Redis/Valkey server; thread-safe.

    Args:
        url: ``redis://host:port/db``, ``rediss://``, ``valkey://``, ``*+cluster://``, ``unix://``.
        layout: block geometry; values of another layout are foreign.
        namespace: 16-byte fingerprint (``KVLayout.fingerprint(model, salt)``), as the disk tier.
        signer: optional keyed MAC (``mac``/``verify``/``key_id``, e.g. ``integrity.BlockSigner``);
            without one, values carry only unkeyed xxh3 checksums.
        ttl_s: optional key TTL in seconds (refreshed by every put of the block).
        prefix: first component of every key (several deployments may share one server).
        cluster: treat ``url`` as a cluster seed node (same as a ``+cluster`` scheme).
        socket_timeout, connect_timeout: seconds; bound every call.
        queue_blocks: values the background writer may hold; a put beyond it is dropped.
        write_batch: values per pipelined SET batch.
        backoff_s: (first, max) seconds between reconnect attempts while the server is down.
        max_connections: sockets the client may open (one per concurrent call); more threads
            than this calling at once would see "too many connections", counted as an outage.
    """

    def __init__(self, url: str, layout: KVLayout, namespace: bytes, *,
                 signer: Signer | None = None, ttl_s: float | None = None,
                 prefix: str = "rdxkv", cluster: bool = False, socket_timeout: float = 2.0,
                 connect_timeout: float = 0.5, queue_blocks: int = 64, write_batch: int = 16,
                 backoff_s: tuple[float, float] = (0.05, 5.0), max_connections: int = 64) -> None:
        if not isinstance(namespace, bytes) or len(namespace) != HASH_BYTES:
            raise ConfigError(f"namespace must be {HASH_BYTES} bytes, got {namespace!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ConfigError(f"ttl_s must be > 0 seconds or None, got {ttl_s!r}")
        if queue_blocks < 1 or write_batch < 1:
            raise ConfigError("queue_blocks and write_batch must be >= 1")
        if not 0 < backoff_s[0] <= backoff_s[1]:
            raise ConfigError(f"backoff_s must be (first, max) with 0 < first <= max: {backoff_s}")
        self.layout, self.namespace, self.signer = layout, namespace, signer
        self.remote = parse_url(url, cluster)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._prefix = key_prefix(prefix, namespace, signer)
        self._timeouts = (socket_timeout, connect_timeout, max_connections)
        self._backoff_s = backoff_s
        self._lock = threading.Lock()
        self._pins: Pins[bytes] = Pins()
        self._stats = RemoteStats()
        self._client: Any = None
        self._available = False
        self._backoff = backoff_s[0]
        self._retry_at = 0.0
        self._probe(first=True)
        self._writes = RemoteWriteQueue(
            lock=self._lock, stats=self._stats, available=lambda: self._available,
            pipeline=self._pipeline, fail=self._fail, probe_if_due=self._probe_if_due,
            queue_blocks=queue_blocks, write_batch=write_batch,
            name=f"radixkv-remote-writer-{self.remote.display}")

    # ---- keys and state --------------------------------------------------------------------
    def key_of(self, block_hash: bytes) -> bytes:
        """The server key of a block (see remote_format.py)."""
        return self._prefix + block_hash.hex().encode()

    def _keys(self, hashes: Sequence[bytes]) -> list[bytes]:
        for h in hashes:
            check_hash(h, "block hashes")
        p = self._prefix
        return [p + h.hex().encode() for h in hashes]

    @property
    def available(self) -> bool:
        """Whether the last contact with the server succeeded (False while reconnecting)."""
        return self._available

    def _probe(self, first: bool = False) -> bool:
        """Connect (build the client if needed) and PING; on failure schedule the next try."""
        try:
            if self._client is None:
                self._client = make_client(self.remote, *self._timeouts)
            self._client.ping()
        except RedisError as e:
            with self._lock:
                self._retry_at = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self._backoff_s[1])
            if first:
                self._count_error(e)
                self._stats.outages += 1
                log.warning("remote tier %s unavailable at start (%s); serving without it and "
                            "reconnecting in the background", self.remote.display, e)
            return False
        with self._lock:
            was_down = not self._available and not first
            self._available, self._backoff = True, self._backoff_s[0]
            if was_down:
                self._stats.reconnects += 1
        if was_down:
            log.warning("remote tier %s is back", self.remote.display)
        return True

    def _probe_if_due(self) -> None:
        """Reconnect attempt of the writer thread while the server is down (backed off)."""
        if not self._available and time.monotonic() >= self._retry_at:
            self._probe()

    def _count_error(self, e: RedisError) -> None:
        if isinstance(e, RedisTimeoutError):
            self._stats.timeouts += 1
        elif isinstance(e, RedisConnectionError):
            self._stats.connection_errors += 1
        else:
            self._stats.error_replies += 1

    def _fail(self, op: str, e: RedisError) -> None:
        """Count an error; a connection error or timeout takes the store down until a probe
        succeeds (one warning per outage); an error reply is logged and the store stays up."""
        down = isinstance(e, (RedisConnectionError, RedisTimeoutError))
        with self._lock:
            self._count_error(e)
            warn = down and self._available
            if warn:
                self._available = False
                self._stats.outages += 1
                self._retry_at = time.monotonic() + self._backoff
        if warn:
            log.warning("remote tier %s failed during %s (%s: %s); serving misses and "
                        "reconnecting in the background", self.remote.display, op,
                        type(e).__name__, e)
        elif not down:
            log.warning("remote tier %s: %s got an error reply: %s", self.remote.display, op, e)
        else:
            log.debug("remote tier %s: %s failed while down: %s", self.remote.display, op, e)

    def _pipeline(self) -> Any:
        if self.remote.cluster:
            return self._client.pipeline()
        return self._client.pipeline(transaction=False)

    # ---- reads -----------------------------------------------------------------------------
    def contains_many(self, hashes: Sequence[bytes]) -> list[bool]:
        """Which blocks the server holds now (one round trip; all False while unavailable).
        A True may still miss on read (evicted, expired, or bad bytes)."""
        keys = self._keys(hashes)
        if not keys or not self._available:
            return [False] * len(keys)
        pipe = self._pipeline()
        for k in keys:
            pipe.exists(k)
        try:
            found = pipe.execute()
        except RedisError as e:
            self._fail("contains", e)
            return [False] * len(keys)
        with self._lock:
            self._stats.round_trips += 1
        return [bool(n) for n in found]

    def get_many(self, hashes: Sequence[bytes]) -> list[RemoteBlock | None]:
        """Verified blocks (None = miss: absent, bad, or server unavailable), in one round trip.
        Bad values are deleted (one more round trip, only when there are some)."""
        keys = self._keys(hashes)
        if not keys:
            return []
        if not self._available:
            with self._lock:
                self._stats.gets += len(keys)
                self._stats.misses += len(keys)
                self._stats.unavailable_misses += len(keys)
            return [None] * len(keys)
        try:
            if self.remote.cluster:
                pipe = self._pipeline()
                for k in keys:
                    pipe.get(k)
                values = pipe.execute()
            else:
                values = self._client.mget(keys)
        except RedisError as e:
            self._fail("get", e)
            with self._lock:
                self._stats.gets += len(keys)
                self._stats.misses += len(keys)
            return [None] * len(keys)
        out: list[RemoteBlock | None] = []
        bad: list[bytes] = []
        kinds = {"corrupt": 0, "stale": 0, "foreign": 0}
        nbytes = 0
        for h, k, v in zip(hashes, keys, values):
            if v is None:
                out.append(None)
                continue
            try:
                out.append(decode_value(v, self.namespace, h, self.layout, self.signer))
                nbytes += len(v)
            except BadValue as b:
                kinds[b.kind] += 1
                bad.append(k)
                out.append(None)
                log.info("remote tier: %s value at %r: %s", b.kind, k, b.reason)
        hits = sum(b is not None for b in out)
        with self._lock:
            s = self._stats
            s.round_trips += 1
            s.gets += len(keys)
            s.hits += hits
            s.misses += len(keys) - hits
            s.bytes_read += nbytes
            s.corrupt += kinds["corrupt"]
            s.stale += kinds["stale"]
            s.foreign += kinds["foreign"]
        if bad:
            self._delete_keys(bad, "delete bad values")
        return out

    def read_into_many(self, hashes: Sequence[bytes], outs: Sequence[Any]) -> list[bool]:
        """Read blocks into caller buffers (writable bytes-like, ``bytes_per_block`` bytes each,
        e.g. ``buffers.byte_view`` of host blocks); True where ``outs[i]`` now holds the verified
        block. One round trip plus one copy per hit; a False buffer is left untouched."""
        self._keys(hashes)   # validates the hashes before any buffer is touched
        views = check_outs(hashes, outs, self.layout.bytes_per_block,
                           "RemoteStore.read_into_many(outs=)")
        ok = []
        for blk, dst in zip(self.get_many(hashes), views):
            if blk is not None:
                dst[:] = blk.payload
            ok.append(blk is not None)
        return ok

    def _view(self, buf: Any, what: str, writable: bool = False) -> memoryview:
        return block_view(buf, self.layout.bytes_per_block, what, writable)

    # ---- writes (queued to RemoteWriteQueue) ----------------------------------------------
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
        """Store blocks (``BlockWrite`` items or plain tuples): queued for the background
        writer (never blocks; a full queue or an unavailable server drops the write and counts
        it), or with ``wait=True`` written in this thread as one pipelined batch (True once
        the server acknowledged).

        ``ttl_s``: a retention these blocks must have at least (a 24-hour prompt cache): their
        keys expire after the longer of it and the store's ``ttl_s``; a store without a key TTL
        keeps every key until the server's own eviction anyway, so it changes nothing there."""
        # Encode the whole call first (it validates every block: a caller bug raises before
        # anything is queued), then queue: the writer then sees full batches. Queueing each
        # value as soon as it is encoded was tried: no faster on two shared cores (the GIL
        # alternates between encoder and writer, and the writer sends 1-value pipelines).
        px = self._px(ttl_s)
        items: list[WriteItem] = [(*self.encode(*b), px) for b in blocks]
        return PutResult(self._writes.submit(items, wait))

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
        return self._writes.submit([(k, None, px) for k in keys], wait)

    def take_lost(self) -> list[bytes]:
        """Block hashes whose refresh found no key since the last call (thread-safe)."""
        n = len(self._prefix)
        return [bytes.fromhex(k[n:].decode()) for k in self._writes.take_lost_keys()]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued value was written or failed; False on timeout."""
        return self._writes.flush(timeout)

    def _px(self, ttl_s: float | None) -> int | None:
        if ttl_s is not None and not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise InvalidBlockError(f"ttl_s must be a positive, finite time, got {ttl_s!r}")
        if self.ttl_ms is None or ttl_s is None:
            return self.ttl_ms
        return max(self.ttl_ms, int(ttl_s * 1000))

    # ---- removal, stats, lifetime ----------------------------------------------------------
    def remove_many(self, keys: Sequence[bytes]) -> int:
        """Delete blocks from the server, except those pinned here (:meth:`pin`); the number
        of keys removed (0 on failure, counted and logged)."""
        keys = [h for h, k in zip(keys, self._keys(keys)) if not self._pins.pinned(h)]
        return self._delete_keys(self._keys(keys), "delete", count=False) if keys else 0

    delete_many = remove_many

    def pin(self, keys: Iterable[bytes]) -> None:
        """Keep these blocks from this process's :meth:`remove_many` (counted). Local only:
        the server's ``maxmemory`` eviction, a TTL or another replica may still remove
        them (a miss)."""
        keys = list(keys)
        self._keys(keys)
        self._pins.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self._pins.unpin(keys)

    def _delete_keys(self, keys: list[bytes], op: str, count: bool = True) -> int:
        if not self._available:
            return 0
        try:
            if self.remote.cluster:
                pipe = self._pipeline()
                for k in keys:
                    pipe.delete(k)
                n = sum(int(r) for r in pipe.execute())
            else:
                n = int(self._client.delete(*keys))
        except RedisError as e:
            self._fail(op, e)
            return 0
        with self._lock:
            self._stats.round_trips += 1
            if count:
                self._stats.deleted += n
        return n

    def stats(self) -> RemoteStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers, if the counters disagree with each other."""
        self._writes.check_invariants()
        with self._lock:
            s = self._stats
            assert s.hits + s.misses == s.gets, f"hits {s.hits} + misses {s.misses} != {s.gets}"
            bad = s.corrupt + s.stale + s.foreign
            assert bad <= s.misses, f"{bad} bad values > {s.misses} misses"

    def close(self, flush_timeout: float = 1.0) -> None:
        """Write what is queued (up to ``flush_timeout`` s), stop the writer, close sockets."""
        if self._writes.closed:
            return
        self.flush(flush_timeout)
        self._writes.close(flush_timeout + 1.0)
        if self._client is not None:
            try:
                self._client.close()
            except RedisError as e:
                log.debug("remote tier: closing the client failed: %s", e)

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



if TYPE_CHECKING:   # the type checker proves that RemoteStore implements the interface
    def _implements(store: RemoteStore) -> StorageBackend[bytes]:
        return store

__all__ = ["RemoteStore", "RemoteStats", "RemoteBlock", "PutItem"]
