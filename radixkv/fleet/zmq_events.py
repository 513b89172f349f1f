"""A replica's KV events over ZMQ, in vLLM's wire format, for routers outside the fleet.

External KV-aware routers (llm-d's KV-cache manager, NVIDIA Dynamo's KV router) subscribe to
vLLM's KV event stream: a ZMQ ``PUB`` socket whose every message is three frames, the topic,
an 8-byte big-endian sequence number, and a msgpack ``KVEventBatch`` (``msgspec`` structs,
``array_like``, events ``tag``\\ ged by class name). :class:`ZmqEventPublisher` reads one
engine's KV events (a reader of ``RadixTree.event_queue()``, ``radixkv.core.events``) and
publishes them in that format, so such a router can route to radixkv replicas unchanged:

* ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)``;
* ``BlockRemoved(block_hashes, medium)``;
* ``AllBlocksCleared()`` (a reader that starts from a snapshot sends it first).

Block hashes are radixkv's 16-byte chain hashes (vLLM's ``ExternalBlockHash`` is ``bytes |
int``); ``medium`` is ``"GPU"``, ``"CPU"`` or ``"DISK"`` for tiers 0, 1, 2. Not built: vLLM's
replay socket (a ``ROUTER`` that re-sends missed batches by sequence number); a subscriber that
sees a gap in the sequence numbers can only resynchronise from a fresh replica snapshot.

Needs the ``events`` extra (``pyzmq``, ``msgspec``).
"""

from __future__ import annotations

import sys
import threading
import time
from array import array
from typing import Any

import msgspec
import zmq

from radixkv.core.events import AllCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["MEDIA", "ZmqEventPublisher", "KVEventBatch", "VBlockStored", "VBlockRemoved",
           "VAllBlocksCleared", "to_vllm"]

#: vLLM's ``medium`` per radixkv tier
MEDIA = ("GPU", "CPU", "DISK")
DEFAULT_TOPIC = "kv-events"


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's ``KVCacheEvent``: tagged by class name, encoded as an array."""


class VBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class VAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: a timestamp (seconds since the epoch) and the events."""

    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


def to_vllm(event: KVEvent, block_size: int) -> VBlockStored | VBlockRemoved | VAllBlocksCleared:
    """One radixkv event in vLLM's shape."""
    if type(event) is BlockStored:
        ids = array("i")
        ids.frombytes(event.tokens)   # int32 little-endian
        if sys.byteorder != "little":
            ids.byteswap()
        return VBlockStored(list(event.block_hashes), event.parent_hash, ids.tolist(),
                            block_size, None, MEDIA[event.tier])
    if type(event) is BlockRemoved:
        return VBlockRemoved(list(event.block_hashes), MEDIA[event.tier])
    if type(event) is AllCleared:
        return VAllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


class ZmqEventPublisher:
    """Publishes one engine's KV events on a ZMQ ``PUB`` socket (see the module docstring).

    Args:
        tree: the engine's ``RadixTree`` (read through its event queue, from a snapshot).
        endpoint: where to bind, e.g. ``tcp://*:5557`` (vLLM's default port).
        block_size: tokens per block (sent with every ``BlockStored``).
        topic: the first frame of every message (vLLM's default ``kv-events``).
        period_s: how often the background thread drains and publishes (``start``).
    """

    def __init__(self, tree: Any, endpoint: str, block_size: int,
                 topic: str = DEFAULT_TOPIC, period_s: float = 0.05) -> None:
        self.block_size = block_size
        self.topic = topic.encode()
        self.period_s = period_s
        self.seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._cursor = tree.event_queue().subscribe(tree.snapshot_events())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def publish(self) -> int:
        """Drain the events since the last call and send them as one batch (none: nothing
        sent). Returns the number of events sent. Call it from one thread only (a ZMQ socket
        is not thread-safe): either yourself or through ``start``.
        Runtime complexity: O(events + tokens)."""
        events = self._cursor.take_events()
        if not events:
            return 0
        bs = self.block_size
        batch = KVEventBatch(time.time(), [to_vllm(e, bs) for e in events])
        self._sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"),
                                   self._encoder.encode(batch)])
        self.seq += 1
        return len(events)

    def start(self) -> ZmqEventPublisher:
        """Publish every ``period_s`` from a background thread (the queue is thread-safe)."""
        def loop() -> None:
            while not self._stop.wait(self.period_s):
                self.publish()

        self._thread = threading.Thread(target=loop, name="radixkv-kv-events-zmq", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (after a last publish) and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.publish()
        self._cursor.close()
        self._sock.close()
