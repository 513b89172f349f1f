"""KV events (``core/events.py``): replaying what a reader took reproduces the cache exactly.

A reader that applies every ``BlockStored`` / ``BlockRemoved`` / ``AllCleared`` it takes to a
set of block hashes must hold exactly the tree's cached blocks after every step, however the
blocks came and went (commits, dedupe, evictions that demote through host and disk or drop,
write-through copies, prefetch, adoption, invalidation, TTL expiry, installs in a slower tier);
every event's chain must hash to its blocks from its parent and tokens; a reader that starts
late from a snapshot agrees with one that was there from the start.
"""

from __future__ import annotations

import random

import pytest
from core_helpers import FakeClock

from radixkv.core.block_manager import BlockManager
from radixkv.core.events import AllCleared, BlockRemoved, BlockStored, KVEventQueue
from radixkv.core.hashing import TOKEN_BYTES, Namespace, chain_hash, token_bytes
from radixkv.core.tree import DEVICE

NS = Namespace("events")
B = 2


class Replay:
    """A reader's view of the cache, built only from the events it takes."""

    def __init__(self, cursor, block_size: int) -> None:
        self.cursor = cursor
        self.width = block_size * TOKEN_BYTES
        self.cached: dict[bytes, int] = {}   # hash -> tier it entered (stored) in

    def apply(self) -> None:
        for e in self.cursor.take_events():
            if type(e) is AllCleared:
                self.cached.clear()
                continue
            assert type(e) in (BlockStored, BlockRemoved), e
            assert len(e.tokens) == len(e.block_hashes) * self.width, e
            assert e.num_tokens * TOKEN_BYTES == len(e.tokens)
            parent = e.parent_hash
            for i, h in enumerate(e.block_hashes):   # a chain after its parent
                tokens = e.tokens[i * self.width:(i + 1) * self.width]
                if parent is not None:
                    assert chain_hash(parent, tokens) == h, "event chain does not hash"
                parent = h
            if type(e) is BlockStored:
                assert len(e.block_ids) == len(e.block_hashes)
                for h in e.block_hashes:
                    assert h not in self.cached, f"{h.hex()[:8]} stored twice"
                    self.cached[h] = e.tier
            else:
                for h in e.block_hashes:
                    assert h in self.cached, f"{h.hex()[:8]} removed but never stored"
                    del self.cached[h]


def _drive(bm: BlockManager, rng: random.Random, clock: FakeClock, steps: int, check) -> None:
    live: list[str] = []
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(2, 9))] for _ in range(4)]
    tree = bm.tree
    for step in range(steps):
        clock.advance(rng.choice([0, 1]))
        op = rng.random()
        if op < 0.55 or not live:
            sid = f"s{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(1, 7))]
            if not bm.can_allocate(prompt, NS):
                continue
            bm.allocate(sid, prompt, NS)
            bm.commit(sid, len(prompt))
            bm.take_moves()
            live.append(sid)
        elif op < 0.8:
            bm.free(live.pop(rng.randrange(len(live))))
        elif op < 0.9:
            t = rng.randrange(tree.num_tiers)
            n = min(rng.randrange(1, 5), tree.num_evictable(t))
            tree.evict(t, n)
        elif op < 0.95 and tree.num_tiers > 1:
            # a block installed in a slower tier (a disk file found, a remote block fetched)
            tok = token_bytes([rng.randrange(6, 9) for _ in range(B)])
            bm.install_lower(None, chain_hash(NS.seed, tok), tok, tree.num_tiers - 1)
        else:
            idle = [n for n in tree.nodes() if n.tier != DEVICE or n.ref == 0]
            if idle:
                node = rng.choice(idle)
                if all(x.tier != DEVICE or x.ref == 0 for x in _subtree(node)):
                    bm.invalidate(node.hashes[rng.randrange(len(node.hashes))])
        if rng.random() < 0.1:
            clock.advance(400.0)   # past the TTL policy's default: whatever is idle expires
        tree.evict_expired()
        check()


def _subtree(node):
    stack = [node]
    while stack:
        x = stack.pop()
        yield x
        stack.extend(x.iter_children())


CONFIGS = [
    dict(num_blocks=12, policy="lru"),
    dict(num_blocks=12, policy="ttl"),
    dict(num_blocks=10, policy="lru", lower_tier_blocks=(6, 8)),
    dict(num_blocks=10, policy="lfu", lower_tier_blocks=(6, 8), write_through=(1, 2)),
    dict(num_blocks=10, policy="priority", lower_tier_blocks=(8,), write_through=(1,)),
]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "{}-{}t".format(
    c["policy"], len(c.get("lower_tier_blocks", ())) + 1))
def test_replayed_events_equal_the_cache(config, seed) -> None:
    clock = FakeClock()
    bm = BlockManager.create(block_size=B, clock=clock, **config)
    rng = random.Random(seed)
    early = Replay(bm.event_queue().subscribe(), B)
    late: list[Replay] = []

    def check() -> None:
        cached = set(bm.tree.block_index())
        early.apply()
        assert set(early.cached) == cached
        for r in late:
            r.apply()
            assert r.cached == early.cached
        if not late and len(cached) > 4:   # a reader that joins now, from a snapshot
            late.append(Replay(bm.event_queue().subscribe(bm.tree.snapshot_events()), B))
        bm.check_invariants()

    _drive(bm, rng, clock, 120, check)
    assert bm.tree.stats.evicted[DEVICE] > 0, "the program never evicted"
    assert len(bm.tree.events) == 0, "events every reader took are still kept"


def test_no_reader_no_events() -> None:
    """Until someone subscribes the tree builds no event; a queue without readers keeps none."""
    bm = BlockManager.create(4, B)
    bm.allocate("a", [1, 1, 2, 2, 3], NS)
    bm.commit("a", 5)
    assert bm.tree.events is None
    q = bm.event_queue()
    bm.free("a")
    bm.tree.evict(DEVICE, 2)
    assert len(q) == 0 and q.num_readers == 0


def test_stored_event_names_the_device_blocks_and_the_parent() -> None:
    bm = BlockManager.create(8, B)
    reader = bm.event_queue().subscribe()
    a = bm.allocate("a", [1, 1, 2, 2, 3], NS)
    bm.commit("a", 5)
    [e] = reader.take_events()
    h = [chain_hash(NS.seed, token_bytes([1, 1]))]
    h.append(chain_hash(h[0], token_bytes([2, 2])))
    assert e == BlockStored(tuple(h), None, token_bytes([1, 1, 2, 2]), DEVICE,
                            tuple(a.block_ids[:2]))
    assert e.num_tokens == 4
    bm.allocate("b", [1, 1, 2, 2, 4, 4, 5], NS)   # extends the chain after its second block
    bm.commit("b", 6)
    [e] = reader.take_events()
    assert e.parent_hash == h[1] and e.tokens == token_bytes([4, 4])


def test_readers_each_get_every_event_once_and_the_queue_trims() -> None:
    q = KVEventQueue()
    a = q.subscribe()
    events = [AllCleared(), BlockRemoved((b"x",), None, b"\0" * 8, 0)]
    q.append(events[0])
    b = q.subscribe()
    q.extend(events[1:])
    assert a.take_events() == events and len(q) == 1   # b has not taken the second one
    assert b.take_events() == events[1:] and len(q) == 0
    assert a.take_events() == [] and b.take_events() == []
    b.close()
    q.append(events[0])
    assert a.take_events() == [events[0]] and q.num_readers == 1 and len(q) == 0
