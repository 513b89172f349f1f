"""TailCache: the partial last blocks of finished sequences, kept for the next turn.

Why: the radix tree caches whole blocks only, so a chat's next turn recomputed the tokens of
the previous turn's last partial block: up to ``block_size - 1`` tokens (7.5 on average with
16-token blocks), in a cached turn whose new tokens are often only 20-40. SGLang matches at
token granularity; vLLM recomputes up to a block too. Here a sequence that ends leaves its
partial tail block (the rows whose KV it computed) under the key of the whole-block chain it
hangs from, ``(namespace seed, chain hash of the last cached block or None)``; a new sequence
whose cached whole blocks end at that chain and whose next tokens begin with some of the
tail's tokens *takes* the block: those rows are its KV already, it writes its own from there.

Taking, not sharing: the taker will write rows past the common prefix into the block, so the
entry leaves the cache (no copy, no reference count): one later sequence per tail, which is
the chat, agent-loop and preemption case (the next turn extends the previous one). Entries
are few and cheap to lose: at most ``limit`` of them (the oldest goes first), one per key (a
newer tail of the same chain replaces the older), and the block manager reclaims them (oldest
first) before it evicts a cached whole block. Only the device tier holds tails: they are never
demoted, written through or shared with other replicas.

Pure Python bookkeeping: block ids and token bytes, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Hashable, NamedTuple

from radixkv.core.hashing import TOKEN_BYTES
from radixkv.core.pool import BlockId

#: A tail's key: (namespace seed, chain hash of the whole block it follows, or None at the root).
TailKey = tuple[bytes, Hashable]


class Tail(NamedTuple):
    """A kept tail: its device block and the token bytes (``TOKEN_BYTES`` each) of the rows
    whose KV the block holds, in position order from the block's start."""

    block: BlockId
    tokens: bytes


class TailCache:
    """At most ``limit`` tails, one per key, oldest first out.

    The owner (the block manager) holds one pool reference per kept block: :meth:`put`,
    :meth:`take` and :meth:`reclaim` return the blocks whose reference it must move or drop.

    >>> tc = TailCache(2)
    >>> tc.put((b"s", None), BlockId(5), bytes(8))
    []
    >>> tc.take((b"s", None), bytes(12))
    (5, 2)
    >>> len(tc)
    0
    """

    __slots__ = ("limit", "_tails", "hits", "hit_tokens")

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit))
        self._tails: OrderedDict[TailKey, Tail] = OrderedDict()
        self.hits = 0          # tails taken
        self.hit_tokens = 0    # tokens they served

    def __len__(self) -> int:
        return len(self._tails)

    def __iter__(self) -> Iterator[tuple[TailKey, Tail]]:
        return iter(self._tails.items())

    def put(self, key: TailKey, block: BlockId, tokens: bytes) -> list[BlockId]:
        """Keep ``block`` (its first ``len(tokens) // TOKEN_BYTES`` rows computed) under ``key``.
        Returns the blocks no longer kept (an older tail of the key, the oldest beyond
        ``limit``; ``block`` itself when ``limit`` is 0): the owner drops their references."""
        if not self.limit:
            return [block]
        tails = self._tails
        dropped = []
        old = tails.pop(key, None)
        if old is not None:
            dropped.append(old.block)
        tails[key] = Tail(block, tokens)
        while len(tails) > self.limit:
            dropped.append(tails.popitem(last=False)[1].block)
        return dropped

    def take(self, key: TailKey, following: bytes) -> tuple[BlockId, int] | None:
        """The tail under ``key`` if ``following`` (token bytes after the key's chain) begins
        with at least one of its tokens: ``(block, rows it serves)``, the entry removed (the
        caller now holds the block's reference). ``None`` (nothing changed) otherwise."""
        tail = self._tails.get(key)
        if tail is None:
            return None
        m = _common_tokens(tail.tokens, following)
        if not m:
            return None
        del self._tails[key]
        self.hits += 1
        self.hit_tokens += m
        return tail.block, m

    def peek(self, key: TailKey, following: bytes) -> int:
        """Rows :meth:`take` would serve now (0: none), changing nothing."""
        tail = self._tails.get(key)
        return 0 if tail is None else _common_tokens(tail.tokens, following)

    def reclaim(self, n: int) -> list[BlockId]:
        """Drop the ``n`` oldest tails (fewer if fewer are kept); returns their blocks."""
        tails = self._tails
        out = []
        while n > 0 and tails:
            out.append(tails.popitem(last=False)[1].block)
            n -= 1
        return out

    def blocks(self) -> list[BlockId]:
        """Every kept block (for checks and capacity)."""
        return [t.block for t in self._tails.values()]


def _common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens (``TOKEN_BYTES`` each) ``a`` and ``b`` share."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[:n * TOKEN_BYTES] == b[:n * TOKEN_BYTES]:
        return n
    lo, hi = 0, n            # a[:lo] == b[:lo] (in tokens); they differ within [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo * TOKEN_BYTES:mid * TOKEN_BYTES] == b[lo * TOKEN_BYTES:mid * TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["Tail", "TailCache", "TailKey"]
