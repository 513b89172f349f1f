"""The remote tier's two roles on their own, over a real BlockManager, HostPool, mover and a real
redis-server on 127.0.0.1 and a free port: the worker side (RemoteWriter) writes back what
leaves one replica's host tier, the scheduler side (RemoteLookup) of another replica finds it,
installs it into its host tier and admits the request."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, token_bytes
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.storage.remote import RemoteStore
from radixkv.tiers.mover import TieredKVMover
from radixkv.tiers.remote import RemoteTier
from radixkv.tiers.remote_lookup import RemoteLookup
from radixkv.tiers.remote_writer import RemoteWriter
from radixkv.tiers.write_policy import RemoteReadOnly, RemoteWriteBack

sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer  # noqa: E402

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS, dtype="float32")
NS = Namespace("tiny-model")


@dataclass
class Seq:
    token_ids: list[int]


@dataclass
class Req:
    request_id: str
    namespace: Namespace
    seqs: list[Seq] = field(default_factory=list)


@dataclass
class Replica:
    bm: BlockManager
    kv: torch.Tensor
    host: HostPool
    mover: TieredKVMover
    store: RemoteStore


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")).start() as srv:
        yield srv


@pytest.fixture
def replica(server):
    server.client().flushall()
    made: list[Replica] = []

    def make() -> Replica:
        bm = BlockManager.create(8, BS, lower_tier_blocks=[4])
        kv = torch.zeros(LAYOUT.cache_shape(8))
        host = HostPool(LAYOUT, 4, pin_memory=False)
        mover = TieredKVMover(kv, LAYOUT, host, None, bm.tree, writer=bm)
        store = RemoteStore(server.url, LAYOUT, LAYOUT.fingerprint("tiny-model"))
        made.append(Replica(bm, kv, host, mover, store))
        return made[-1]
    yield make
    for r in made:
        r.store.close()
        r.mover.close()


PROMPT = list(range(100, 113))   # 3 full blocks + 1 token


def _compute(r: Replica, tokens: list[int]) -> list[bytes]:
    """Allocate, 'compute' (block i of the sequence filled with i + 1), commit and free a
    sequence; the chain hashes of its full blocks."""
    r.bm.allocate("s", tokens, NS)
    for i, b in enumerate(r.bm.block_table("s")):
        r.kv[:, :, b] = float(i + 1)
    r.bm.commit("s", len(tokens))
    r.bm.free("s")
    return r.bm.tree.match_hashes(token_bytes(tokens), NS.seed, (len(tokens) - 1) // BS)


def test_writer_writes_back_what_leaves_the_host_and_lookup_installs_it(replica):
    a = replica()
    writer = RemoteWriter(a.store, a.bm.tree, a.host, 1, a.kv, BS)
    RemoteWriteBack().attach(writer, a.bm.tree, a.mover)
    hashes = _compute(a, PROMPT)
    assert len(hashes) == 3
    a.mover.apply_moves(a.bm.evict(0, 3))         # device -> host: nothing written yet
    a.store.flush(5.0)
    assert a.store.contains_many(hashes) == [False] * 3
    a.mover.apply_moves(a.bm.evict(1, 3))         # dropped from the host: written back
    assert a.store.flush(5.0)
    assert a.store.contains_many(hashes) == [True] * 3
    assert writer.counts.blocks_written == 3
    got = a.store.get_many(hashes)
    assert [g.parent_hash for g in got] == [None, hashes[0], hashes[1]]   # type: ignore[union-attr]

    # another replica's scheduler side alone finds them and installs them in its host tier
    b = replica()
    lookup = RemoteLookup(b.store, b.bm.tree, b.host, 1, b.bm, BS, timeout_s=2.0)
    req = Req("r1", NS, [Seq(PROMPT)])
    lookup.lookup(req)
    assert lookup.has_arrivals() and lookup.is_arriving("r1")
    assert lookup.admit(b.mover.apply_moves, wait=True) == [req]
    assert lookup.take_remote_tokens("r1") == 3 * BS
    refs = b.bm.tree.match_tokens(token_bytes(PROMPT), NS.seed, 3)
    assert [r.block_hash for r in refs] == hashes and {r.tier for r in refs} == {1}
    for i, r in enumerate(refs):
        assert torch.equal(b.host.block_tensor(r.block_id), torch.full(LAYOUT.block_shape, i + 1.0))
    assert b.host.contains_many([r.block_id for r in refs]) == [True] * 3
    assert lookup.counts.blocks_installed == 3 and lookup.counts.lookups == 1
    lookup.close()


def test_a_read_only_tier_reads_but_never_writes(replica):
    a = replica()
    tier = RemoteTier(a.store, a.bm.tree, a.host, 1, a.kv, BS, RemoteReadOnly(), 2.0, a.mover,
                      writer=a.bm)
    assert a.bm.tree.events is None            # no event reader was attached
    hashes = _compute(a, PROMPT)
    a.mover.apply_moves(a.bm.evict(0, 3))
    a.mover.apply_moves(a.bm.evict(1, 3))
    tier.after_step()
    tier.persist(hashes, 60.0)
    assert tier.flush_resident(1.0)["written"] == 0
    a.store.flush(5.0)
    assert a.store.contains_many(hashes) == [False] * 3
    stats = tier.stats()
    assert stats["blocks_written"] == 0 and stats["persist_skipped"] == 3
    assert set(stats) >= {"lookups", "blocks_installed", "server", "available"}
    tier.close()


def test_an_aborted_lookup_is_forgotten_and_a_miss_admits_at_once(replica):
    a = replica()
    lookup = RemoteLookup(a.store, a.bm.tree, a.host, 1, a.bm, BS, timeout_s=2.0)
    req = Req("r2", NS, [Seq(PROMPT)])
    lookup.lookup(req)
    assert lookup.forget("r2") is req and not lookup.has_arrivals()
    lookup.lookup(req)
    assert lookup.admit(a.mover.apply_moves, wait=True) == [req]   # empty server: a miss
    assert lookup.take_remote_tokens("r2") == 0
    assert lookup.counts.blocks_found == 0
    lookup.close()


def test_admit_now_installs_one_lookup_and_leaves_the_others_waiting(replica, monkeypatch):
    """``admit_now`` (the RAG blend's document entries): one lookup waited for and installed
    now; other requests' lookups stay for ``admit``; a failed or timed-out lookup is 0."""
    import time

    from radixkv.errors import StorageError

    a = replica()
    writer = RemoteWriter(a.store, a.bm.tree, a.host, 1, a.kv, BS)
    RemoteWriteBack().attach(writer, a.bm.tree, a.mover)
    hashes = _compute(a, PROMPT)
    a.mover.apply_moves(a.bm.evict(0, 3))
    a.mover.apply_moves(a.bm.evict(1, 3))
    assert a.store.flush(5.0)

    b = replica()
    lookup = RemoteLookup(b.store, b.bm.tree, b.host, 1, b.bm, BS, timeout_s=0.3)
    other = Req("other", NS, [Seq(list(range(500, 509)))])
    lookup.lookup(other)
    lookup.lookup(Req("doc", NS, [Seq(PROMPT)]))
    assert lookup.admit_now("doc", b.mover.apply_moves) == 3 * BS
    assert lookup.counts.hit_tokens == 3 * BS and not lookup.is_arriving("doc")
    refs = b.bm.tree.match_tokens(token_bytes(PROMPT), NS.seed, 3)
    assert [r.block_hash for r in refs] == hashes and {r.tier for r in refs} == {1}
    assert lookup.is_arriving("other")                      # not taken by admit_now
    assert lookup.admit(b.mover.apply_moves, wait=True) == [other]
    assert lookup.admit_now("unknown", b.mover.apply_moves) == 0

    c = replica()
    lookup = RemoteLookup(c.store, c.bm.tree, c.host, 1, c.bm, BS, timeout_s=0.3)

    def broken(keys):
        raise StorageError("server gone")

    monkeypatch.setattr(c.store, "contains_many", broken)
    lookup.lookup(Req("f", NS, [Seq(PROMPT)]))
    assert lookup.admit_now("f", c.mover.apply_moves) == 0
    assert lookup.counts.lookup_failures == 1

    def slow(keys):
        time.sleep(1.0)
        return [False] * len(keys)

    monkeypatch.setattr(c.store, "contains_many", slow)
    lookup.lookup(Req("t", NS, [Seq(PROMPT)]))
    assert lookup.admit_now("t", c.mover.apply_moves) == 0
    assert lookup.counts.lookup_timeouts == 1 and not lookup.has_arrivals()
    assert c.bm.tree.match_tokens(token_bytes(PROMPT), NS.seed, 3) == []
    lookup.close()


def test_fetch_now_looks_several_chains_up_in_one_round_and_one_timeout(replica, monkeypatch):
    """``fetch_now`` (the RAG blend's document entries, which share a lead): one EXISTS batch
    and one MGET for all chains, the shared lead asked and installed once, each chain's blocks
    installed after it; a failed or slow server costs one ``timeout_s`` in all, not one per
    chain, and installs nothing."""
    import time

    from radixkv.errors import StorageError

    lead = list(range(100, 100 + BS))
    chains = [lead + list(range(200 + 10 * i, 200 + 10 * i + BS)) + [7] for i in range(2)]
    a = replica()
    writer = RemoteWriter(a.store, a.bm.tree, a.host, 1, a.kv, BS)
    RemoteWriteBack().attach(writer, a.bm.tree, a.mover)
    for c in chains:
        _compute(a, c)
    a.mover.apply_moves(a.bm.evict(0, 3))
    a.mover.apply_moves(a.bm.evict(1, 3))
    assert a.store.flush(5.0)

    b = replica()
    lookup = RemoteLookup(b.store, b.bm.tree, b.host, 1, b.bm, BS, timeout_s=5.0)
    trips = b.store.stats().round_trips
    got = lookup.fetch_now([Req(f"d{i}", NS, [Seq(c)]) for i, c in enumerate(chains)],
                           b.mover.apply_moves)
    assert b.store.stats().round_trips - trips == 2
    assert got == {"d0": 2 * BS, "d1": BS}            # the lead came with the first chain
    assert lookup.counts.lookups == 2 and lookup.counts.hit_tokens == 3 * BS
    for c in chains:
        refs = b.bm.tree.match_tokens(token_bytes(c), NS.seed, 2)
        assert len(refs) == 2 and {r.tier for r in refs} == {1}
    assert lookup.fetch_now([Req("again", NS, [Seq(chains[0])])], b.mover.apply_moves) == \
        {"again": 0} and b.store.stats().round_trips - trips == 2   # cached: nothing asked
    lookup.close()

    c = replica()
    lookup = RemoteLookup(c.store, c.bm.tree, c.host, 1, c.bm, BS, timeout_s=0.5)
    reqs = [Req(f"e{i}", NS, [Seq(ch)]) for i, ch in enumerate(chains + [PROMPT])]

    def broken(keys):
        raise StorageError("server gone")

    monkeypatch.setattr(c.store, "contains_many", broken)
    assert set(lookup.fetch_now(reqs, c.mover.apply_moves).values()) == {0}
    assert lookup.counts.lookup_failures == 3

    def slow(keys):
        time.sleep(3.0)
        return [False] * len(keys)

    monkeypatch.setattr(c.store, "contains_many", slow)
    t0 = time.perf_counter()
    assert set(lookup.fetch_now(reqs, c.mover.apply_moves).values()) == {0}
    # one deadline for the three chains (one lookup each would wait 3 x 0.5 s)
    assert time.perf_counter() - t0 < 1.4
    assert lookup.counts.lookup_timeouts == 3
    assert all(c.bm.tree.match_tokens(token_bytes(ch), NS.seed, 1) == [] for ch in chains)
    lookup.close()
