"""KV events: replicas say which blocks enter and leave their cache; routers listen.

Three pieces, the first two pure Python (tested without Ray):

* :class:`EventRecorder` reads one engine's KV events (``radixkv.core.events``: the tree's
  event queue) and collects the chain hashes of blocks that entered or left the replica's cache
  since the last :meth:`~EventRecorder.drain` (an entry and a later exit of the same block
  cancel out).
* :class:`EventLog` is the fleet's ordered log of those batches, with each replica's current
  set so that a listener that fell behind (or just started) gets a snapshot instead of history.
* :class:`KVEventBus` is that log as a Ray actor: replicas ``publish`` a batch every
  ``PUBLISH_PERIOD_S``; each router long-polls ``poll(cursor)`` and applies what it gets to its
  :class:`~radixkv.fleet.index.PrefixIndex`.

Why a log with cursors rather than Serve's ``record_routing_stats`` snapshots: a replica's cache
is thousands of blocks and changes by a few per step; shipping deltas costs what changed, and a
cursor makes a dropped poll harmless. This is the shape of llm-d's and Dynamo's KV event streams,
on the Ray runtime the fleet already has instead of a separate broker.

A block counts as cached on a replica while it is in that replica's tree, whatever the tier
(device, host, disk): a hit in any of them saves the prefill.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Any

from radixkv.core.events import BlockRemoved, BlockStored

#: How often a replica ships its events and load (seconds): the router's view lags by this much.
PUBLISH_PERIOD_S = 0.05
#: Batches the log keeps; a listener further behind gets a snapshot.
LOG_BATCHES = 4096
_ABSENT = object()


class EventRecorder:
    """Collects the block hashes entering and leaving one engine's tree.

    A reader of the tree's KV event queue (``RadixTree.event_queue()``; other readers, e.g.
    the remote tier, read the same events independently), started from a snapshot of the
    tree's current content (blocks restored from disk at start-up). The tree appends events on
    the engine's loop thread; :meth:`drain` may run on any thread (the queue is locked).
    """

    def __init__(self, tree: Any) -> None:
        self._cursor = tree.event_queue().subscribe(tree.snapshot_events())

    def drain(self) -> tuple[list[bytes], list[bytes]]:
        """(added, removed) since the last drain, each hash at most once, disjoint: a block
        that entered and left (or left and came back) in between is in neither."""
        added: dict[bytes, None] = {}
        removed: dict[bytes, None] = {}
        for e in self._cursor.take_events():
            if type(e) is BlockStored:
                for h in e.block_hashes:
                    if removed.pop(h, _ABSENT) is _ABSENT:   # else: left, came back
                        added[h] = None
            elif type(e) is BlockRemoved:
                for h in e.block_hashes:
                    if added.pop(h, _ABSENT) is _ABSENT:     # else: came, left
                        removed[h] = None
            else:   # AllCleared: what follows describes the whole cache (the first batch
                added.clear()   # resets this replica's entry in the log anyway)
                removed.clear()
        return list(added), list(removed)

    def close(self) -> None:
        """Stop reading the tree's events."""
        self._cursor.close()


class EventLog:
    """The fleet's ordered event log and each replica's current block set.

    Every batch gets the next sequence number. A reader at ``cursor`` gets the batches after
    it, or, when those are no longer in the log (it fell behind, or the log restarted), a
    snapshot of every replica's set plus the cursor to continue from.
    """

    def __init__(self, max_batches: int = LOG_BATCHES) -> None:
        self.seq = 0
        self._log: deque[tuple[int, str, bool, list[bytes], list[bytes]]] = deque(
            maxlen=max_batches)
        self._sets: dict[str, set[bytes]] = {}

    def publish(self, replica: str, added: Iterable[bytes], removed: Iterable[bytes],
                reset: bool = False) -> int:
        """Record one batch; ``reset``: the replica (re)started, forget what it held before."""
        added, removed = list(added), list(removed)
        s = self._sets.setdefault(replica, set())
        if reset:
            s.clear()
        if not (added or removed or reset):
            return self.seq
        s.update(added)
        s.difference_update(removed)
        self.seq += 1
        self._log.append((self.seq, replica, reset, added, removed))
        return self.seq

    def remove(self, replica: str) -> None:
        """The replica is gone: readers drop it (a reset with nothing added)."""
        if self._sets.pop(replica, None) is not None:
            self.seq += 1
            self._log.append((self.seq, replica, True, [], []))

    def read(self, cursor: int) -> tuple[int, list[tuple[str, bool, list[bytes], list[bytes]]],
                                         bool]:
        """``(new cursor, batches, is_snapshot)``. A snapshot's batches are one reset per
        replica carrying its whole set; apply them to an empty index."""
        first = self._log[0][0] if self._log else self.seq + 1
        if cursor > self.seq or cursor < first - 1:
            return self.seq, [(r, True, list(s), []) for r, s in self._sets.items()], True
        return self.seq, [(r, reset, a, d) for seq, r, reset, a, d in self._log
                          if seq > cursor], False

    def holders(self) -> dict[str, int]:
        return {r: len(s) for r, s in self._sets.items()}


class KVEventBus:
    """:class:`EventLog` as an async Ray actor (one per fleet, named). Also keeps each
    replica's latest engine stats and each router's decision counters for ``/metrics``."""

    def __init__(self, max_batches: int = LOG_BATCHES) -> None:
        self.log = EventLog(max_batches)
        self.stats: dict[str, dict[str, Any]] = {}
        self.routers: dict[str, dict[str, Any]] = {}
        self._changed = asyncio.Event()
        #: ``POST /reset_prefix_cache`` under a fleet: the ingress raises the epoch; each
        #: replica sees it in its next :meth:`publish` answer, drops its cache and reports
        #: ``(epoch, blocks dropped)`` with :meth:`reset_done`
        self.reset_epoch = 0
        self.resets: dict[str, tuple[int, int]] = {}

    async def publish(self, replica: str, added: list[bytes], removed: list[bytes],
                      reset: bool = False, stats: dict[str, Any] | None = None
                      ) -> tuple[int, int]:
        """Append a replica's batch; returns ``(log sequence, reset epoch)``."""
        before = self.log.seq
        seq = self.log.publish(replica, added, removed, reset)
        if stats is not None:
            self.stats[replica] = stats
        if seq != before:
            self._changed.set()
            self._changed = asyncio.Event()
        return seq, self.reset_epoch

    async def request_reset(self) -> tuple[int, list[str]]:
        """A new reset epoch, and the replicas expected to answer it (those that report)."""
        self.reset_epoch += 1
        return self.reset_epoch, sorted(self.stats)

    async def reset_done(self, replica: str, epoch: int, dropped: int) -> None:
        self.resets[replica] = (epoch, dropped)

    async def reset_report(self, epoch: int) -> dict[str, int]:
        """Blocks dropped per replica that has reset at ``epoch`` (or a later one)."""
        return {r: n for r, (e, n) in self.resets.items() if e >= epoch}

    async def remove(self, replica: str) -> None:
        self.log.remove(replica)
        self.stats.pop(replica, None)
        self.resets.pop(replica, None)
        self._changed.set()
        self._changed = asyncio.Event()

    async def poll(self, cursor: int, timeout_s: float = 1.0) -> tuple[int, list[Any], bool]:
        """Batches after ``cursor``; waits up to ``timeout_s`` for one when there are none."""
        if cursor == self.log.seq:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.log.read(cursor)

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        return dict(self.stats)

    async def report_router(self, router: str, stats: dict[str, Any]) -> None:
        """A router's decision counters (see :class:`radixkv.fleet.router.RouterStats`)."""
        self.routers[router] = stats

    async def router_reports(self) -> list[dict[str, Any]]:
        return list(self.routers.values())

    async def holders(self) -> dict[str, int]:
        return self.log.holders()


__all__ = ["EventLog", "EventRecorder", "KVEventBus", "PUBLISH_PERIOD_S"]
