"""The remote tier's store against a real redis-server: round trips, isolation, verification,
batching, TTL, maxmemory, sharing between replicas and processes. Faults: test_remote_faults.py."""

from __future__ import annotations

import hashlib
import hmac
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from radixkv.errors import ConfigError, InvalidBlockError
from radixkv.storage.layout import KVLayout
from radixkv.storage.remote import RemoteStore
from radixkv.storage.remote_client import parse_url
from radixkv.storage.remote_format import FIXED_LEN, decode_value, header_len

REPO = Path(__file__).resolve().parents[2]


def block(layout: KVLayout, seed: int) -> bytes:
    """Deterministic pseudo-random payload of one block."""
    out = bytearray()
    i = 0
    while len(out) < layout.bytes_per_block:
        out += hashlib.blake2b(f"{seed}/{i}".encode()).digest()
        i += 1
    return bytes(out[:layout.bytes_per_block])


def chain(n: int, salt: int = 0) -> list[bytes]:
    return [hashlib.blake2b(f"{salt}/{i}".encode(), digest_size=16).digest() for i in range(n)]


class HmacSigner:
    """A keyed MAC with the BlockSigner interface (mac/verify/key_id)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.key_id = hashlib.blake2b(key, digest_size=8).digest()

    def mac(self, *parts) -> bytes:
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(p)
        return h.digest()

    def verify(self, tag, *parts) -> bool:
        return hmac.compare_digest(tag, self.mac(*parts))


@pytest.fixture
def open_store(redis_url, layout, namespace):
    made: list[RemoteStore] = []

    def make(url: str = redis_url, lay: KVLayout = layout, ns: bytes = namespace, **kw):
        made.append(RemoteStore(url, lay, ns, **kw))
        return made[-1]
    yield make
    for s in made:
        s.check_invariants()
        s.close()


def test_round_trip_bit_exact(open_store, layout):
    store = open_store()
    hs = chain(5)
    items = [(h, hs[i - 1] if i else None, range(i * 4, i * 4 + 4), block(layout, i))
             for i, h in enumerate(hs)]
    assert store.put_many(items[:3], wait=True) == [True] * 3
    assert store.put_many(items[3:]) == [True, True]          # through the background writer
    assert store.flush(5.0)
    got = store.get_many(hs)
    for i, b in enumerate(got):
        assert b is not None and bytes(b.payload) == block(layout, i)
        assert b.token_ids == tuple(range(i * 4, i * 4 + 4))
        assert b.parent_hash == (hs[i - 1] if i else None) and b.block_hash == hs[i]
    outs = [bytearray(layout.bytes_per_block) for _ in range(6)]
    assert store.read_into_many(hs + [os.urandom(16)], outs) == [True] * 5 + [False]
    assert [bytes(o) for o in outs[:5]] == [block(layout, i) for i in range(5)]
    assert outs[5] == bytearray(layout.bytes_per_block)      # a miss leaves the buffer alone
    assert store.contains_many(hs + [os.urandom(16)]) == [True] * 5 + [False]
    s = store.stats()
    assert (s.puts, s.hits, s.misses, s.put_dropped, s.corrupt) == (5, 10, 1, 0, 0)


def test_caller_errors_raise_and_change_nothing(open_store, layout):
    store = open_store()
    with pytest.raises(InvalidBlockError):
        store.put(b"short", None, [1], block(layout, 0))
    with pytest.raises(InvalidBlockError):
        store.put(os.urandom(16), None, [1], b"x" * 10)
    with pytest.raises(InvalidBlockError):
        store.read_into_many([os.urandom(16)], [bytes(layout.bytes_per_block)])  # read-only
    with pytest.raises(ConfigError):
        RemoteStore("http://x", layout, bytes(16))
    with pytest.raises(ConfigError):
        RemoteStore("redis://127.0.0.1:1", layout, b"ns")
    assert store.stats().puts == 0


def test_namespace_isolation(open_store, layout):
    """Other tenant, other model, other layout, other signer: same chain hash, still a miss."""
    mine = open_store()
    h = os.urandom(16)
    assert mine.put(h, None, [1, 2, 3, 4], block(layout, 1), wait=True)
    other_layout = KVLayout(2, 2, 8, 4, "float16")
    others = [open_store(ns=layout.fingerprint("test-model@rev0", salt="tenant-2")),
              open_store(ns=layout.fingerprint("other-model@rev0")),
              open_store(lay=other_layout, ns=other_layout.fingerprint("test-model@rev0")),
              open_store(signer=HmacSigner(b"k" * 32))]
    for o in others:
        assert o.get_many([h]) == [None] and o.contains_many([h]) == [False]
        assert o.key_of(h) != mine.key_of(h)
    assert mine.get_many([h])[0] is not None            # and nobody deleted it


def test_replicas_share_blocks(open_store, layout):
    """Two stores (two replicas of one model) on one server: what one writes the other reads."""
    a, b = open_store(), open_store()
    hs = chain(8)
    a.put_many([(h, None, [i], block(layout, i)) for i, h in enumerate(hs)])
    assert a.flush(5.0)
    assert [bytes(x.payload) for x in b.get_many(hs)] == [block(layout, i) for i in range(8)]


def test_second_process_reads_what_the_first_wrote(open_store, layout, namespace, redis_url):
    store = open_store()
    hs = chain(4, salt=7)
    assert store.put_many([(h, None, [i], block(layout, i)) for i, h in enumerate(hs)],
                          wait=True) == [True] * 4
    code = (
        "import sys, hashlib; sys.path.insert(0, %r)\n"
        "from test_remote import block, chain\n"
        "from radixkv.storage.layout import KVLayout\n"
        "from radixkv.storage.remote import RemoteStore\n"
        "lay = KVLayout(**%r)\n"
        "s = RemoteStore(%r, lay, bytes.fromhex(%r))\n"
        "got = s.get_many(chain(4, salt=7))\n"
        "assert [bytes(b.payload) for b in got] == [block(lay, i) for i in range(4)], got\n"
        "print('ok', s.stats().hits)\n"
    ) % (str(Path(__file__).parent), vars(layout), redis_url, namespace.hex())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "4"]


def raw_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend",
                                    "garbage", "empty", "stale_version", "other_block",
                                    "other_namespace"])
def test_bad_values_are_misses_counted_and_deleted(open_store, layout, redis_url, damage):
    store = open_store()
    h, h2 = os.urandom(16), os.urandom(16)
    assert store.put_many([(h, None, [1, 2, 3, 4], block(layout, 1)),
                           (h2, None, [5, 6, 7, 8], block(layout, 2))], wait=True) == [True] * 2
    r = raw_client(redis_url)
    key = store.key_of(h)
    v = bytearray(r.get(key))
    if damage == "flip_payload":
        v[header_len(4) + 100] ^= 1
    elif damage == "flip_header":
        v[FIXED_LEN] ^= 1                              # a token id
    elif damage == "truncate":
        v = v[:len(v) // 2]
    elif damage == "extend":
        v += b"\0"
    elif damage == "garbage":
        v = bytearray(os.urandom(len(v)))
    elif damage == "empty":
        v = bytearray()
    elif damage == "stale_version":
        v[8:10] = (2).to_bytes(2, "little")
    elif damage == "other_block":
        v = bytearray(r.get(store.key_of(h2)))       # a valid value under the wrong key
    elif damage == "other_namespace":
        other = open_store(ns=layout.fingerprint("other-model@rev0"))
        other.put(h, None, [1, 2, 3, 4], block(layout, 1), wait=True)
        v = bytearray(r.get(other.key_of(h)))
    r.set(key, bytes(v))
    got = store.get_many([h, h2])
    assert got[0] is None and bytes(got[1].payload) == block(layout, 2)
    assert r.exists(key) == 0 and r.exists(store.key_of(h2)) == 1
    s = store.stats()
    kind = {"stale_version": "stale", "other_block": "foreign", "other_namespace": "foreign"}
    assert getattr(s, kind.get(damage, "corrupt")) == 1 and s.deleted == 1, s
    assert s.corrupt + s.stale + s.foreign == 1


def test_signed_values_resist_recomputed_checksums(open_store, layout, namespace, redis_url):
    """With a signer, a value whose payload was swapped and checksums recomputed is a miss."""
    signer = HmacSigner(b"s" * 32)
    store = open_store(signer=signer)
    h = os.urandom(16)
    assert store.put(h, None, [1, 2, 3, 4], block(layout, 1), wait=True)
    assert bytes(store.get_many([h])[0].payload) == block(layout, 1)
    r = raw_client(redis_url)
    # forge: a valid *unsigned-format* value re-signed with another key, under our key
    forger = open_store(signer=HmacSigner(b"f" * 32))
    forger.put(h, None, [1, 2, 3, 4], block(layout, 9), wait=True)
    forged = bytearray(r.get(forger.key_of(h)))
    forged[104:112] = signer.key_id                         # claim our key id...
    import struct
    import xxhash
    hl = header_len(4)
    forged[hl - 8:hl] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(forged[:hl - 8])))
    r.set(store.key_of(h), bytes(forged))                   # ...with valid checksums
    assert store.get_many([h]) == [None]
    assert store.stats().corrupt == 1 and r.exists(store.key_of(h)) == 0
    with pytest.raises(Exception):
        decode_value(bytes(forged), namespace, h, layout, signer)


def test_one_round_trip_per_batch(open_store, layout, redis_url, monkeypatch):
    """contains_many / get_many of 64 blocks: one request write each (counted at the client's
    socket) and, on the server, one MGET and no GET (INFO commandstats)."""
    store = open_store()
    hs = chain(64, salt=3)
    assert all(store.put_many([(h, None, [i], block(layout, i)) for i, h in enumerate(hs)],
                              wait=True))
    sends = []
    real = redis.connection.Connection.send_packed_command
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command",
                        lambda self, *a, **k: (sends.append(1), real(self, *a, **k))[1])
    r = raw_client(redis_url)
    r.config_resetstat()
    sends.clear()
    assert store.contains_many(hs) == [True] * 64
    assert len(sends) == 1
    sends.clear()
    got = store.get_many(hs)
    assert len(sends) == 1 and all(g is not None for g in got)
    monkeypatch.undo()
    stats = r.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
    assert stats["cmdstat_exists"]["calls"] == 64       # pipelined: 64 commands, 1 round trip


def test_ttl_expires(open_store, layout):
    store = open_store(ttl_s=0.3)
    h = os.urandom(16)
    assert store.put(h, None, [1], block(layout, 1), wait=True)
    assert store.get_many([h])[0] is not None
    time.sleep(0.6)
    assert store.get_many([h]) == [None] and store.stats().corrupt == 0



def test_a_retention_outlives_the_store_ttl_and_refreshes_without_the_payload(
        open_store, layout, redis_server):
    """``put_many(ttl_s=)`` keeps a key the longer of its retention and the store's TTL;
    ``refresh_many`` restarts it with a PEXPIRE (no value sent); a refresh of a key the server
    lost is counted and handed back by ``take_lost`` (so the caller writes it again)."""
    store = open_store(ttl_s=0.3)
    r = redis_server.client()
    kept, plain = chain(2, salt=7)
    assert store.put_many([(kept, None, [1], block(layout, 1))], wait=True, ttl_s=3600) == [True]
    assert store.put(plain, None, [2], block(layout, 2), wait=True)
    (kkey, pkey) = store._keys([kept, plain])
    assert 3_500_000 < r.pttl(kkey) <= 3_600_000 and r.pttl(pkey) <= 300
    time.sleep(0.5)
    assert store.get_many([kept, plain]) == [store.get_many([kept])[0], None]
    written = store.stats().bytes_written
    r.pexpire(kkey, 1000)
    assert store.refresh_many([kept], ttl_s=3600, wait=True) == [True]
    assert r.pttl(kkey) > 3_500_000 and store.stats().bytes_written == written
    r.delete(kkey)
    assert store.refresh_many([kept], ttl_s=3600) == [True]   # queued
    assert store.flush(5.0)
    s = store.stats()
    assert (s.refreshes, s.refresh_missed) == (1, 1)
    assert store.take_lost() == [kept] and store.take_lost() == []
    with pytest.raises(InvalidBlockError):
        store.put_many([(kept, None, [1], block(layout, 1))], ttl_s=-1)
    assert not r.exists(kkey)
    store.check_invariants()


def test_refresh_is_a_no_op_without_a_store_ttl(open_store, layout, redis_server):
    store = open_store()
    h = os.urandom(16)
    assert store.put_many([(h, None, [1], block(layout, 1))], wait=True, ttl_s=60) == [True]
    assert redis_server.client().pttl(store._keys([h])[0]) == -1   # no expiry: kept longest
    assert store.refresh_many([h], ttl_s=60, wait=True) == [True]
    assert store.stats().refreshes == 0

BIG = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float32")


def test_maxmemory_eviction_is_a_miss(make_redis, open_store):
    """allkeys-lru with 2 MiB for 8 MiB of blocks: many misses, every hit exact, no errors."""
    server = make_redis("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru").start()
    store = open_store(url=server.url, lay=BIG, ns=BIG.fingerprint("m"))
    hs = chain(256, salt=5)
    for i in range(0, 256, 16):
        assert all(store.put_many([(h, None, [j], block(BIG, j))
                                   for j, h in enumerate(hs[i:i + 16], i)], wait=True))
    got = store.get_many(hs)
    hits = [i for i, g in enumerate(got) if g is not None]
    assert 0 < len(hits) < 200
    assert all(bytes(got[i].payload) == block(BIG, i) for i in hits)
    s = store.stats()
    assert (s.corrupt, s.connection_errors, s.put_failures) == (0, 0, 0) and store.available


def test_maxmemory_noeviction_fails_puts_and_stays_up(make_redis, open_store):
    server = make_redis("--maxmemory", "2mb", "--maxmemory-policy", "noeviction").start()
    store = open_store(url=server.url, lay=BIG, ns=BIG.fingerprint("m"))
    hs = chain(128, salt=6)
    ok = []
    for i in range(0, 128, 16):
        ok += store.put_many([(h, None, [j], block(BIG, j))
                              for j, h in enumerate(hs[i:i + 16], i)], wait=True)
    assert any(ok) and not all(ok)
    s = store.stats()
    assert s.put_failures == ok.count(False) and s.error_replies >= 1 and store.available
    got = store.get_many(hs)
    assert [g is not None for g in got] == ok


def test_url_schemes():
    assert parse_url("valkey://h:1/3").url == "redis://h:1/3"
    assert parse_url("valkeys://h:1").url == "rediss://h:1"
    assert parse_url("rediss://u:p@h:1").display == "rediss://***@h:1"
    c = parse_url("valkey+cluster://h:7000")
    assert c.cluster and c.url == "redis://h:7000"
    assert parse_url("redis://h:1", cluster=True).cluster
    with pytest.raises(ConfigError):
        parse_url("memcached://h:1")


def test_valkey_url_reaches_the_server(open_store, layout, redis_url):
    store = open_store(url=redis_url.replace("redis://", "valkey://"))
    h = os.urandom(16)
    assert store.put(h, None, [1], block(layout, 3), wait=True)
    assert bytes(open_store().get_many([h])[0].payload) == block(layout, 3)


def test_single_node_cluster(make_redis, open_store, layout):
    """Cluster mode through the client's RedisCluster, on a one-node cluster owning every slot
    (multi-node slot moves and failover are not tested here: see docs/tiers.md)."""
    server = make_redis("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf").start()
    c = server.client()
    c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 10
    while c.cluster("info")["cluster_state"] != "ok":
        assert time.monotonic() < deadline, "single-node cluster did not come up"
        time.sleep(0.05)
    store = open_store(url=server.url.replace("redis://", "redis+cluster://").removesuffix("/0"))
    hs = chain(20, salt=9)
    assert store.put_many([(h, None, [i], block(layout, i)) for i, h in enumerate(hs)],
                          wait=True) == [True] * 20
    got = store.get_many(hs + [os.urandom(16)])
    assert [bytes(g.payload) for g in got[:20]] == [block(layout, i) for i in range(20)]
    assert got[20] is None and store.contains_many(hs[:3]) == [True] * 3
    assert store.delete_many(hs[:2]) == 2 and store.get_many(hs[:2]) == [None, None]


def test_threads_share_one_store(open_store, layout):
    """Four threads putting (queued and waited) and reading overlapping blocks: every hit is
    the exact block, the counters add up."""
    import threading
    store = open_store()
    hs = chain(24, salt=11)
    errors: list[str] = []

    def work(t: int) -> None:
        for rnd in range(6):
            mine = [(t * 6 + i) % 24 for i in range(6)]
            store.put_many([(hs[i], None, [i], block(layout, i)) for i in mine],
                           wait=rnd % 2 == 0)
            for i, got in zip(range(24), store.get_many(hs)):
                if got is not None and bytes(got.payload) != block(layout, i):
                    errors.append(f"thread {t} read a wrong block {i}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert store.flush(10) and not errors
    assert all(g is not None for g in store.get_many(hs))
    s = store.stats()
    assert s.corrupt == 0 and s.put_failures == 0 and s.hits + s.misses == s.gets
