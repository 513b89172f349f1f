"""How close does the remote store come to the raw ``redis`` client moving the same bytes?

The ``remote`` part of ``radixkv bench tiers``. It starts its own ``redis-server`` on 127.0.0.1
(a free port, a temporary directory, no persistence) and moves ``n`` SmolLM2 blocks (720 KiB
each) between host-pool slots and the server:

* put: ``RemoteStore.put_many(wait=True)`` in batches of ``batch`` blocks (header, checksum, one
  copy into the value, a pipelined batch of SET) and ``put_many`` + ``flush`` through the
  background writer, vs the raw client's pipelined SET of the same payload bytes, same batches.
* get: ``RemoteStore.get_many`` (one MGET per batch + verification, zero-copy payload views) and
  ``read_into_many`` (+ one copy into the host slots), vs the raw client's MGET and pipelined
  GET of the same bytes, same batches.

Bandwidth = payload bytes / median wall time (GB/s, 1e9 B/s); ``vs raw`` is the median over
rounds of (fastest raw path's time / this path's time) in the same round. Target >= 0.7.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import redis

from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.storage.remote import RemoteStore

Interleaved = Callable[..., list[dict[str, Any]]]


class LocalRedis:
    """A throw-away redis-server on loopback (``RADIXKV_REDIS_SERVER`` overrides the binary)."""

    def __init__(self) -> None:
        binary = os.environ.get("RADIXKV_REDIS_SERVER") or shutil.which("redis-server")
        if not binary:
            raise SystemExit("bench tiers --parts remote needs redis-server: "
                             "apt-get install redis-server (scripts/dev.sh setup does it as root)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="radixkv-bench-redis-")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", self.dir, "--logfile", f"{self.dir}/redis.log"],
            stdout=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"redis-server did not start (see {self.dir}/redis.log)")
                time.sleep(0.02)

    def version(self) -> str:
        return str(redis.Redis(port=self.port).info("server")["redis_version"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def bench_remote(layout: KVLayout, n: int, repeat: int, interleaved: Interleaved,
                 batch: int = 16) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of the put/get comparison and facts about the server, for ``n`` blocks."""
    server = LocalRedis()
    try:
        return _bench(server, layout, n, repeat, interleaved, batch), {
            "redis_server": server.version(), "redis_py": redis.__version__,
            "batch_blocks": batch}
    finally:
        server.close()


def _bench(server: LocalRedis, lay: KVLayout, n: int, repeat: int, interleaved: Interleaved,
           batch: int) -> list[dict[str, Any]]:
    host = HostPool(lay, n, pin_memory=False)
    for i in range(n):
        host.block_tensor(i).normal_()
    ns = lay.fingerprint("bench-model@rev0")
    store = RemoteStore(server.url, lay, ns, queue_blocks=n, write_batch=batch)
    raw = redis.Redis.from_url(server.url)
    hashes = [os.urandom(16) for _ in range(n)]
    raw_keys = [b"raw:" + h.hex().encode() for h in hashes]
    items = [(h, None, range(i * lay.block_size, (i + 1) * lay.block_size), host.block_bytes(i))
             for i, h in enumerate(hashes)]
    runs = [range(i, min(i + batch, n)) for i in range(0, n, batch)]
    nbytes = n * lay.bytes_per_block

    def flush() -> None:
        raw.flushdb()

    def store_put_sync() -> None:
        for r in runs:
            assert all(store.put_many([items[i] for i in r], wait=True))

    def store_put_queued() -> None:
        assert all(store.put_many(items))
        assert store.flush(60)

    def raw_set() -> None:
        for r in runs:
            pipe = raw.pipeline(transaction=False)
            for i in r:
                pipe.set(raw_keys[i], host.block_bytes(i))
            assert all(pipe.execute())

    rows = interleaved([("raw redis SET (pipelined)", raw_set, flush),
                        ("store put (caller thread)", store_put_sync, flush),
                        ("store put (background writer)", store_put_queued, flush)],
                       repeat, nbytes, direction="host->remote")
    assert store.stats().put_dropped == 0, store.stats()
    raw_set()
    store_put_sync()
    outs = [host.block_bytes(i) for i in range(n)]

    def store_get() -> None:
        for r in runs:
            got = store.get_many([hashes[i] for i in r])
            assert all(g is not None for g in got)

    def store_read_into() -> None:
        for r in runs:
            assert all(store.read_into_many([hashes[i] for i in r], [outs[i] for i in r]))

    def raw_mget() -> None:
        for r in runs:
            assert all(v is not None for v in raw.mget([raw_keys[i] for i in r]))

    def raw_get() -> None:
        for r in runs:
            pipe = raw.pipeline(transaction=False)
            for i in r:
                pipe.get(raw_keys[i])
            assert all(v is not None for v in pipe.execute())

    def nothing() -> None:
        return None

    rows += interleaved([("raw redis MGET", raw_mget, nothing),
                         ("raw redis GET (pipelined)", raw_get, nothing),
                         ("store get_many (verified views)", store_get, nothing),
                         ("store read_into_many (host slots)", store_read_into, nothing)],
                        repeat, nbytes, direction="remote->host")
    s = store.stats()
    assert (s.corrupt, s.put_failures, s.connection_errors) == (0, 0, 0), s
    store.close()
    raw.close()
    return rows


__all__ = ["bench_remote", "LocalRedis"]
