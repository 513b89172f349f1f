"""Which replica caches which block: the router's index, fed by the replicas' KV events.

A block is named by its chain hash (:mod:`radixkv.core.hashing`): the hash of block ``i``
covers the namespace (model, KV layout, tenant salt) and every token of blocks ``0..i``. So the
index needs no tree: a replica holds a request's first ``k`` blocks exactly when it holds the
hashes ``h[0..k-1]``, and because a replica's tree evicts leaves first, holding ``h[k-1]`` means
holding its ancestors too. The longest cached prefix on each replica is therefore the position
of its first missing hash, found in one pass over the request's hashes for all replicas at
once: each hash maps to a bitmask of the replicas that hold it.

Routed but not yet computed: when the router sends a request to a replica, the blocks that
request will compute there are entered at once as *tentative* (:meth:`PrefixIndex.speculate`),
so that a second request with the same new prefix, arriving before the replica's events, follows
the first instead of computing the prefix again elsewhere (SGLang's router inserts on routing the
same way). A tentative entry becomes real when the replica's event confirms the block, and
disappears at its deadline if none does (the request was aborted, or evicted it first).

Pure Python and single-threaded: the router owns one instance (its event loop thread).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence


class PrefixIndex:
    """Block hash -> set of replicas (a bitmask over small replica slots).

    Replicas are named by strings (Ray Serve replica ids); each gets a bit while it is known.
    Memory: one dict entry (hash -> int) per distinct cached block, whatever the replica count.
    """

    def __init__(self) -> None:
        self._bits: dict[bytes, int] = {}
        self._slot: dict[str, int] = {}          # replica -> bit position
        self._blocks: dict[str, int] = {}        # replica -> blocks it holds (per the events)
        self._free_slots: list[int] = []
        # tentative entries: replica -> {hash: deadline}, and a heap of (deadline, replica,
        # hash) with lazy deletion (confirmed or replaced entries are skipped when popped)
        self._tentative: dict[str, dict[bytes, float]] = {}
        self._deadlines: list[tuple[float, str, bytes]] = []

    # ------------------------------------------------------------------ replicas
    @property
    def replicas(self) -> list[str]:
        return list(self._slot)

    def num_blocks(self, replica: str) -> int:
        return self._blocks.get(replica, 0)

    def __len__(self) -> int:
        return len(self._bits)

    def _bit(self, replica: str) -> int:
        slot = self._slot.get(replica)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[replica] = slot
            self._blocks[replica] = 0
        return 1 << slot

    def remove_replica(self, replica: str) -> int:
        """Forget ``replica`` (it died, restarted empty, or left): O(index size). Returns the
        number of blocks it held."""
        slot = self._slot.pop(replica, None)
        if slot is None:
            return 0
        held = self._blocks.pop(replica, 0)
        self._tentative.pop(replica, None)
        keep = ~(1 << slot)
        bits = self._bits
        for h in [h for h, b in bits.items() if b >> slot & 1]:
            rest = bits[h] & keep
            if rest:
                bits[h] = rest
            else:
                del bits[h]
        self._free_slots.append(slot)
        return held

    # ------------------------------------------------------------------ events
    def apply(self, replica: str, added: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """One batch of a replica's events: blocks that entered its cache, then blocks that left
        it. Idempotent per hash (adding a held block or removing an absent one changes nothing),
        so a batch replayed after a reconnect is harmless."""
        bit = self._bit(replica)
        bits = self._bits
        tentative = self._tentative.get(replica) or {}
        n = 0
        for h in added:
            b = bits.get(h, 0)
            if not b & bit:
                bits[h] = b | bit
                n += 1
            elif tentative and tentative.pop(h, None) is not None:
                n += 1                         # a tentative entry confirmed: now it counts
        for h in removed:
            b = bits.get(h, 0)
            if tentative and tentative.pop(h, None) is not None:
                n += 1                         # it was never counted: undo the -1 below
            if b & bit:
                b &= ~bit
                if b:
                    bits[h] = b
                else:
                    del bits[h]
                n -= 1
        self._blocks[replica] += n

    def speculate(self, replica: str, hashes: Sequence[bytes], deadline: float) -> int:
        """Enter the blocks a request routed to ``replica`` will compute there, tentatively
        until ``deadline`` (see the module docstring). Returns how many were new."""
        bit = self._bit(replica)
        bits = self._bits
        tentative = self._tentative.setdefault(replica, {})
        new = 0
        for h in hashes:
            b = bits.get(h, 0)
            if b & bit:
                continue
            bits[h] = b | bit
            tentative[h] = deadline
            heapq.heappush(self._deadlines, (deadline, replica, h))
            new += 1
        return new

    def expire(self, now: float) -> int:
        """Drop the tentative entries whose deadline passed unconfirmed. O(log n) per entry."""
        dropped = 0
        q = self._deadlines
        while q and q[0][0] <= now:
            deadline, replica, h = heapq.heappop(q)
            tentative = self._tentative.get(replica)
            if not tentative or tentative.get(h) != deadline:
                continue                       # confirmed, re-speculated, or replica gone
            del tentative[h]
            slot = self._slot.get(replica)
            b = self._bits.get(h, 0) & ~(1 << slot) if slot is not None else 0
            if b:
                self._bits[h] = b
            else:
                self._bits.pop(h, None)
            dropped += 1
        return dropped

    def num_tentative(self, replica: str) -> int:
        return len(self._tentative.get(replica) or ())

    # ------------------------------------------------------------------ queries
    def match(self, hashes: Sequence[bytes], replicas: Iterable[str]) -> dict[str, int]:
        """Cached prefix length, in blocks, of a request (its chain hashes, in order) on each
        of ``replicas`` (unknown replicas: 0). One dict lookup per block until every replica
        has missed."""
        out: dict[str, int] = {}
        alive = 0
        for r in replicas:
            slot = self._slot.get(r)
            out[r] = 0
            if slot is not None:
                alive |= 1 << slot
        if not alive:
            return out
        by_slot = {s: r for r, s in self._slot.items()}
        get = self._bits.get
        i = 0
        for i, h in enumerate(hashes):
            b = get(h, 0)
            lost = alive & ~b
            if lost:
                while lost:
                    low = lost & -lost
                    out[by_slot[low.bit_length() - 1]] = i
                    lost ^= low
                alive &= b
                if not alive:
                    return out
        else:
            i = len(hashes)
        while alive:
            low = alive & -alive
            out[by_slot[low.bit_length() - 1]] = i
            alive ^= low
        return out


__all__ = ["PrefixIndex"]
