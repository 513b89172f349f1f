"""A replica's KV events over ZMQ in vLLM's wire format (``radixkv/fleet/zmq_events.py``).

A real ZMQ ``SUB`` socket on 127.0.0.1 receives what the publisher sends and decodes it with
the struct definitions of vLLM's own subscriber example (written out here, not imported from
radixkv: the subscriber must not share the publisher's types), then replays the events into a
set that must equal the tree's cached blocks.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, hash_token_blocks
from radixkv.fleet.zmq_events import ZmqEventPublisher


# --- vLLM's subscriber types (examples/online_serving/kv_events_subscriber.py) ---------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
# ----------------------------------------------------------------------------------------------


def _receive(sub: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> tuple[int, KVEventBatch]:
    assert sub.poll(5000), "no message within 5 s"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv-events"
    return int.from_bytes(seq, "big"), decoder.decode(payload)


def test_a_vllm_subscriber_decodes_the_events_and_rebuilds_the_cache() -> None:
    ns = Namespace("zmq")
    bm = BlockManager.create(6, 2, lower_tier_blocks=[4])
    bm.allocate("a", [1, 1, 2, 2, 9], ns)
    bm.commit("a", 5)
    bm.free("a")                               # two blocks cached before the publisher starts
    pub = ZmqEventPublisher(bm.tree, "tcp://127.0.0.1:*", block_size=2)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub.endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        time.sleep(0.3)   # PUB drops messages until the subscription has arrived (slow joiner)
        cached: dict[bytes, str] = {}

        def apply(batch: KVEventBatch) -> None:
            for e in batch.events:
                if isinstance(e, AllBlocksCleared):
                    cached.clear()
                elif isinstance(e, BlockStored):
                    assert e.block_size == 2 and len(e.token_ids) == 2 * len(e.block_hashes)
                    cached.update(dict.fromkeys(e.block_hashes, e.medium))
                else:
                    for h in e.block_hashes:
                        del cached[h]

        assert pub.publish() == 2               # AllCleared + the snapshot's one node
        seq, batch = _receive(sub, decoder)
        assert seq == 0 and isinstance(batch.events[0], AllBlocksCleared)
        first = batch.events[1]
        assert isinstance(first, BlockStored) and first.token_ids == [1, 1, 2, 2]
        assert first.parent_block_hash is None and first.medium == "GPU"
        assert first.block_hashes == hash_token_blocks([1, 1, 2, 2], 2, ns)
        apply(batch)
        for i in range(4):                      # more prompts: the device evicts into the host
            bm.allocate(f"r{i}", [3 + i] * 4 + [9], ns)
            bm.commit(f"r{i}", 5)
            bm.free(f"r{i}")
        bm.tree.evict(1, bm.tree.num_evictable(1))   # and the host drops what it holds
        assert pub.publish() > 0
        seq, batch = _receive(sub, decoder)
        assert seq == 1
        assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in batch.events)
        apply(batch)
        assert set(cached) == set(bm.tree.block_index())
        assert pub.publish() == 0               # nothing new: nothing sent
        assert not sub.poll(200)
    finally:
        sub.close()
        pub.close()
