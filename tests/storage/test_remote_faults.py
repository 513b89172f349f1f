"""The remote tier's store when the server is down, dies, hangs or answers with errors.

Every case runs against a real redis-server (started, killed with SIGKILL, paused with SIGSTOP);
a fake client appears only for an error a real server does not produce on demand."""

from __future__ import annotations

import logging
import os
import time

import pytest
import redis

from radixkv.storage.remote import RemoteStore
from test_remote import block, chain

FAST = dict(socket_timeout=0.3, connect_timeout=0.3, backoff_s=(0.05, 0.2))


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_down_at_start_then_started(make_redis, layout, namespace, caplog):
    server = make_redis()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "radixkv.storage.remote"):
        store = RemoteStore(server.url, layout, namespace, **FAST)
    try:
        assert time.monotonic() - t0 < 2.0 and not store.available
        assert sum("unavailable at start" in r.message for r in caplog.records) == 1
        h = os.urandom(16)
        t0 = time.monotonic()
        assert store.get_many([h]) == [None] and store.contains_many([h]) == [False]
        assert store.put(h, None, [1], block(layout, 1)) is False
        assert time.monotonic() - t0 < 0.1          # no network while down
        s = store.stats()
        assert s.unavailable_misses == 1 and s.put_skipped == 1 and s.connection_errors == 1
        server.start()
        assert wait_for(lambda: store.available), "the store did not reconnect"
        assert store.put(h, None, [1], block(layout, 1), wait=True)
        assert bytes(store.get_many([h])[0].payload) == block(layout, 1)
        assert store.stats().reconnects == 1
        store.check_invariants()
    finally:
        store.close()


def test_killed_mid_run_bounded_then_back(make_redis, layout, namespace, caplog):
    server = make_redis().start()
    store = RemoteStore(server.url, layout, namespace, **FAST)
    try:
        hs = chain(8)
        assert all(store.put_many([(h, None, [i], block(layout, i)) for i, h in enumerate(hs)],
                                  wait=True))
        server.kill()
        with caplog.at_level(logging.WARNING, "radixkv.storage.remote"):
            t0 = time.monotonic()
            assert store.get_many(hs) == [None] * 8
            assert store.contains_many(hs) == [False] * 8
            assert store.put_many([(h, None, [1], block(layout, 1)) for h in hs[:2]],
                                  wait=True) == [False, False]
            assert store.put(hs[0], None, [1], block(layout, 1)) is False
            elapsed = time.monotonic() - t0
        assert elapsed < 1.5, f"calls against a dead server took {elapsed:.2f} s"
        assert not store.available
        s = store.stats()
        assert s.connection_errors >= 1 and s.outages == 1
        assert sum("failed during" in r.message for r in caplog.records) == 1  # one warning
        server.start()                                # same port, empty (no persistence)
        assert wait_for(lambda: store.available)
        assert store.get_many(hs) == [None] * 8       # the data died with the server: misses
        assert store.put(hs[0], None, [0], block(layout, 0), wait=True)
        assert bytes(store.get_many(hs[:1])[0].payload) == block(layout, 0)
        store.check_invariants()
    finally:
        store.close()


def test_hung_server_times_out(make_redis, layout, namespace):
    """SIGSTOP: connections are accepted by the kernel but nothing answers (a slow server)."""
    server = make_redis().start()
    store = RemoteStore(server.url, layout, namespace, **FAST)
    try:
        h = os.urandom(16)
        assert store.put(h, None, [1], block(layout, 1), wait=True)
        server.pause()
        t0 = time.monotonic()
        assert store.get_many([h]) == [None]
        assert store.get_many([h]) == [None]          # now down: answered without the network
        assert time.monotonic() - t0 < 1.0
        assert store.stats().timeouts == 1 and not store.available
        server.resume()
        assert wait_for(lambda: store.available)
        assert bytes(store.get_many([h])[0].payload) == block(layout, 1)
    finally:
        store.close()


def test_queued_writes_never_block_and_full_queue_drops(make_redis, layout, namespace):
    server = make_redis().start()
    store = RemoteStore(server.url, layout, namespace, queue_blocks=4, write_batch=2, **FAST)
    try:
        server.pause()                                # the writer hangs on its first batch
        hs = chain(40, salt=1)
        t0 = time.monotonic()
        queued = store.put_many([(h, None, [i], block(layout, i)) for i, h in enumerate(hs)])
        assert time.monotonic() - t0 < 0.2            # the caller never waited for the server
        assert queued.count(False) >= 40 - 4 - 2      # queue + one batch in flight at most
        assert store.stats().put_dropped == queued.count(False)
        assert store.flush(3.0)                       # the hung batch times out, the rest fail
        server.resume()
        s = store.stats()
        assert s.puts + s.put_failures + s.put_skipped == queued.count(True), s
        store.check_invariants()
    finally:
        store.close()


class _BrokenPipeline:
    def __init__(self, exc):
        self.exc = exc

    def get(self, *a, **kw):
        pass

    exists = set = delete = get

    def execute(self, raise_on_error=True):
        raise self.exc


class _FakeClient:
    """Error paths a real single server will not produce on demand (cluster redirections)."""

    def __init__(self, exc):
        self.exc = exc

    def ping(self):
        return True

    def mget(self, keys):
        raise self.exc

    def pipeline(self, transaction=None):
        return _BrokenPipeline(self.exc)

    def close(self):
        pass


@pytest.mark.parametrize("exc", [redis.exceptions.ClusterDownError("CLUSTERDOWN"),
                                 redis.exceptions.ReadOnlyError("READONLY")])
def test_error_replies_are_counted_not_raised(make_redis, layout, namespace, exc, caplog):
    server = make_redis().start()
    store = RemoteStore(server.url, layout, namespace, **FAST)
    try:
        store._client = _FakeClient(exc)
        h = os.urandom(16)
        with caplog.at_level(logging.WARNING, "radixkv.storage.remote"):
            assert store.get_many([h]) == [None]
            assert store.put(h, None, [1], block(layout, 1), wait=True) is False
        s = store.stats()
        assert s.error_replies == 2 and s.put_failures == 1 and store.available
        assert sum("error reply" in r.message for r in caplog.records) == 2
    finally:
        store._client = None
        store.close()
