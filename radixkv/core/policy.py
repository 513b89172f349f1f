"""Eviction policies: strategy objects that turn a cached node into a sort key.

The tree keeps, per tier, the *evictable leaves* (unheld nodes with no child in that tier) in an
eviction index (``evict_index.py``) of ``(*policy.key(node, hints), hash of its last block)``;
the smallest entry is evicted first, block by block from the node's tail. A node is a run of
blocks that share their key (``node.py``), so a key is the key of each of its blocks. LRU and
TTL use the O(1) ``RecencyIndex``, LFU a ``FrequencyIndex`` (buckets of those), the others a
``SortedIndex`` (O(log n)). The trailing hash makes entries unique and deterministic. A
policy's key may only read fields that the tree changes while the node is *out* of the index
(``last_access``, ``hits``, the node's hints): the tree removes a node, mutates it, re-adds it.

Because a parent is accessed whenever a child is, ``parent.last_access >= child.last_access``
always holds, so evicting leaves in LRU order is exactly LRU over the whole tree.

``hits`` counts the requests that locked the node. A run grows when its only holder commits
more blocks after it, and the new blocks join the run's count, unless the policy says
``fresh_counts`` (LFU, LFU-DA, the duel): then they start a node of their own at 0, as in a
per-block cache.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from radixkv.core.evict_index import (
    AgingIndex, Entry, EvictionIndex, FrequencyIndex, RecencyIndex, SortedIndex,
)
from radixkv.core.node import NodeHints as NodeHints  # re-exported: it lived here
from radixkv.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from radixkv.core.hashing import BlockHash, Namespace
    from radixkv.core.node import Node
    from radixkv.core.pool import BlockPool


class PolicyHost(Protocol):
    """The tree as a policy sees it in ``bind`` (``RadixTree`` is one): what a policy may read
    and the one change it may ask for (``rekey``). Declared here so that policies import no
    tree (the tree imports them)."""

    block_size: int
    num_tiers: int
    pools: list[BlockPool]
    clock: Callable[[], float]

    def find(self, block_hash: BlockHash, near: Node | None = None) -> Node | None: ...

    def rekey(self, node: Node, aux: object) -> None: ...


class ShadowCache(Protocol):
    """A cache a policy replays requests into (``BlockManager`` is one; ``policy_duel.py``)."""

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], namespace: Namespace,
                 session: Hashable | None = None, end_session: bool = False,
                 resumed: bool = False) -> CachedPrefix: ...

    def commit(self, seq_id: Hashable, num_computed_tokens: int) -> int: ...

    def append_slots(self, seq_id: Hashable, token_ids: Sequence[int]) -> object: ...

    def free(self, seq_id: Hashable) -> None: ...

    def end_session(self, session: Hashable) -> None: ...


class CachedPrefix(Protocol):
    """What a ``ShadowCache.allocate`` tells: the prompt tokens it had cached."""

    @property
    def num_cached_tokens(self) -> int: ...


class CacheMaker(Protocol):
    """The block manager as a policy sees it in ``bind_manager``: a maker of shadow caches
    (``BlockManager.shadow``: a manager over a fresh device-only tree of ``num_blocks`` blocks,
    the same block size and clock, eviction by ``policy``)."""

    def shadow(self, num_blocks: int, policy: str) -> ShadowCache: ...


DEFAULT_HINTS = NodeHints()

#: A policy's sort key (``EvictionPolicy.key``): numbers (times, counts, priorities), compared
#: lexicographically; the index entry is this plus the tail block's hash (``Entry``).
Key = tuple[float, ...]

# ``node.aux`` is typed ``object`` for the tree, which only copies and compares it; a policy
# reads back the value its own hooks stored there (a composite's members: their slot of its
# tuple). That read is the one unchecked step, marked where it happens with
# ``# type: ignore[<code>]  # aux: ...`` rather than ``cast`` (a call per read, and the reads
# are on the hot path of every node event and filing).


class EvictionPolicy(abc.ABC):
    """Order of eviction among evictable leaves: smallest key first.

    **The seam (issue 15).** A plain policy is a key function over fields the tree keeps per
    node (``last_access``, ``hits``, ``hints``) and pays for nothing else: LRU, LFU, MRU,
    priority and TTL. A policy that needs its own state sets ``hooks = True``; the tree then
    calls it once per *node* event (never per block), always while the node is out of every
    eviction index, so the hook may change what ``key()`` will return:

    ``on_insert(node, start, now)``
        blocks ``node.hashes[start:]`` were just cached (``start == 0``: a new node, whose
        ``aux`` is None; ``start > 0``: appended to a run its only holder writes on, which
        then share the run's state).
    ``on_hit(node, prev_access, now)``
        a request locked (or promoted) the node: ``hits`` and ``last_access`` are updated,
        ``prev_access`` is the access before.
    ``on_release(node, now)``
        the node's last holder let go (``last_access = now``); it becomes evictable.
    ``on_leave(node, k)``
        the last ``k`` blocks of ``node`` are about to leave its tier (demoted, dropped or
        expired; not ``invalidate``: bad bytes say nothing about reuse).

    and the block manager calls, per *request*: ``on_start(seq_id, num_tokens, namespace,
    session, end_session, now)`` before a sequence's match is locked (``session``: the
    conversation it belongs to, if the client said; ``end_session``: the client says it is the
    session's last request), ``on_fork(parent_id, child_id)``, ``enter(seq_id)`` before the
    manager commits or frees on behalf of a sequence (so node events know whose they are),
    ``on_finish(seq_id, token_ids)`` after a sequence is freed (its every token), and
    ``end_session(session)`` when a client closes a session after its last request (a policy
    re-keys nodes then through ``RadixTree.rekey``, which re-files them). With ``hooks``
    False none of these is called (the tree and manager test one bool per operation).

    Per-node state lives in ``node.aux`` (one slot, the policy's; None until ``on_insert``),
    which a cut copies to both halves, so it must be an immutable value (a number, a tuple);
    two nodes coalesce back into one run only if their ``aux`` and key agree. A key computed
    from state that moves while the node is filed (a learned statistic) must be snapshotted
    into ``aux`` by a hook: the tree removes entries by recomputing them.

    A policy may also own its index (``new_index``): the victim is whatever ``pop_min``
    returns, so an index can choose between orders (``policy_forecast.py``: overdue first,
    else farthest forecast; ``policy_duel.py``: the order of whichever member policy is
    winning). Whatever it returns, eviction stays leaf-first and never touches a held block:
    only evictable leaves are ever filed. ``key_size`` is the length of ``key()`` (so that a
    composite policy can concatenate its members' keys).
    """

    name: str
    hooks: bool = False
    key_size: int = 1
    #: True: blocks a sequence commits after a run that requests have hit start a node of
    #: their own with 0 hits (as in a per-block cache) instead of joining the run and its
    #: count. For policies that rank by ``hits``: a one-off continuation must not inherit the
    #: popularity of the prefix it extends. (Costs a node per turn of a conversation.)
    fresh_counts: bool = False
    #: index of this policy's part of ``node.aux`` inside a composite policy (None: all of it)
    aux_slot: int | None = None
    #: A policy that tells newly cached blocks apart by something other than their holders
    #: (``policy_ghost.py``: the count each block had before it was dropped) sets this to a
    #: pure function ``block_hash -> value``: the tree cuts a run of new blocks wherever the
    #: value changes, and lets new blocks join an existing run only if ``can_extend(run,
    #: first new hash)``. None (the default) costs nothing.
    insert_key: Callable[[bytes], object] | None = None
    #: The policy a tree hands eviction over to the first time a client says a session has
    #: ended (a request's ``end_session``, or ``BlockManager.end_session``): a name in
    #: ``POLICIES``. None (every policy but ``auto``): never.
    on_end_hint: str | None = None
    #: the tree given to ``bind`` (unset before it; the hooks only run once bound)
    _tree: PolicyHost

    def can_extend(self, node: Node, block_hash: bytes) -> bool:
        """Whether new block ``block_hash`` may join the end of run ``node`` (only asked when
        ``insert_key`` is set). A pure read."""
        return True

    @abc.abstractmethod
    def key(self, node: Node, hints: NodeHints) -> Key:
        """Sort key of an evictable node (of each of its blocks). Must be cheap: called on
        every (re)filing."""

    def expired(self, key: Entry, now: float) -> bool:
        """Whether an entry with this key may leave its tier with no memory pressure at
        ``now`` (only TTL-like policies say yes)."""
        return False

    def new_index(self) -> EvictionIndex:
        """The per-tier ordered set the tree keeps this policy's entries in: a ``SortedIndex``
        (O(log n), any key) unless the policy knows its keys arrive in order."""
        return SortedIndex()

    # ---------------------------------------------------------------- hooks (hooks = True)
    def bind(self, tree: PolicyHost) -> None:
        """Attach to the tree that calls the hooks (once: a hooked policy's state belongs to
        one tree)."""
        if getattr(self, "_tree", None) is not None and self._tree is not tree:
            raise ConfigError(f"a {self.name!r} policy object belongs to one tree; "
                              "pass the policy's name (or a fresh object) to each tree")
        self._tree = tree

    def bind_manager(self, manager: CacheMaker) -> None:
        """The block manager that drives the request hooks (``on_start`` ... ``on_finish``)
        introduces itself (after ``bind``, and again after a ``switch_policy``); a policy that
        simulates other caches makes them here. Default: nothing."""

    def on_insert(self, node: Node, start: int, now: float) -> None:
        pass

    def on_hit(self, node: Node, prev_access: float, now: float) -> None:
        pass

    def on_release(self, node: Node, now: float) -> None:
        pass

    def on_leave(self, node: Node, k: int) -> None:
        pass

    def on_start(self, seq_id: Hashable, num_tokens: int, namespace: Namespace,
                 session: Hashable | None, end_session: bool, now: float,
                 resumed: bool = False) -> None:
        pass

    def on_fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        pass

    def enter(self, seq_id: Hashable) -> None:
        pass

    def on_finish(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        pass

    def end_session(self, session: Hashable) -> None:
        """The client says ``session`` is over (after its last request): a policy may re-key
        its nodes through ``tree.rekey`` (the block manager's ``end_session``)."""


    # ---------------------------------------------------------------- aux helpers
    def _aux(self, node: Node) -> object:
        """This policy's part of ``node.aux``."""
        a = node.aux
        # aux: with ``aux_slot`` set, the composite's tuple (one slot per member)
        return a if self.aux_slot is None or a is None else a[self.aux_slot]  # type: ignore[index]

    def _set_aux(self, node: Node, value: object) -> None:
        node.aux = self._aux_with(node, value)

    def _aux_with(self, node: Node, value: object) -> object:
        """``node.aux`` with this policy's part replaced by ``value`` (a list round trip: half
        the cost of slicing and splicing the tuple; the duel's members call it on every node
        event)."""
        i = self.aux_slot
        if i is None:
            return value
        a = list(node.aux)   # type: ignore[call-overload]  # aux: the composite's tuple
        a[i] = value
        return tuple(a)


class LRUPolicy(EvictionPolicy):
    """Least recently used first. Key: ``(last_access,)``. (``auto``, the default, is this
    policy until a client sends a session-end hint: ``auto_policy``.)"""

    name = "lru"

    def key(self, node: Node, hints: NodeHints) -> Key:
        return (node.last_access,)

    def new_index(self) -> RecencyIndex:
        """Keys are times that mostly arrive in order: O(1) adds, removes and evictions."""
        return RecencyIndex()


class LFUPolicy(EvictionPolicy):
    """Least frequently used first, ties by LRU. Key: ``(hits, last_access)``.

    Counts are per block as in a per-block cache (``fresh_counts``): blocks committed after a
    run that requests have hit start at 0 in a node of their own. (Letting them join the run,
    and its count, cost 4 to 22 points of hit rate on the RAG workload: a one-off document
    combination inherited the popularity of the prefix it extended.)
    """

    name = "lfu"
    key_size = 2
    fresh_counts = True

    def key(self, node: Node, hints: NodeHints) -> Key:
        return (node.hits, node.last_access)

    def new_index(self) -> FrequencyIndex:
        """Frequency buckets, each in time order: O(1) within a bucket."""
        return FrequencyIndex()


class MRUPolicy(EvictionPolicy):
    """Most recently used first. Key: ``(-last_access,)``.

    The classic answer to a loop larger than the cache (the block used last is the one needed
    last). Measured on the chat trace it is far below LRU (docs/benchmarks.md): real chat is no
    pure loop. Kept selectable by name for comparisons; eviction stays leaf-first.
    """

    name = "mru"

    def key(self, node: Node, hints: NodeHints) -> Key:
        return (-node.last_access,)


class PriorityPolicy(EvictionPolicy):
    """Lowest caller priority first, ties by LRU. Key: ``(priority, last_access)``.

    Give a system prompt or popular documents a high priority to keep them cached under
    pressure; hard pinning (never evict) is a lock, see ``RadixTree.lock``.
    """

    name = "priority"
    key_size = 2

    def key(self, node: Node, hints: NodeHints) -> Key:
        return (hints.priority, node.last_access)


class TTLPolicy(EvictionPolicy):
    """Keep each block for ``ttl`` seconds after its last use; evict soonest expiry first.

    Key: ``(last_access + ttl,)`` with a per-node override from hints (like hosted prompt
    caches' 5-minute and 1-hour tiers). ``RadixTree.evict_expired(now)`` drops expired blocks
    even without memory pressure.
    """

    name = "ttl"

    def __init__(self, ttl: float = 300.0) -> None:
        if (isinstance(ttl, bool) or not isinstance(ttl, (int, float))
                or not (ttl > 0 and math.isfinite(ttl))):
            raise ConfigError(f"ttl must be a positive number of seconds, got {ttl!r}")
        self.ttl = ttl

    def key(self, node: Node, hints: NodeHints) -> Key:
        return (node.last_access + (self.ttl if hints.ttl is None else hints.ttl),)

    def new_index(self) -> RecencyIndex:
        """Expiry times arrive in order while TTLs are equal; per-node TTLs go to the side list."""
        return RecencyIndex()

    def expired(self, key: Entry, now: float) -> bool:
        return key[0] <= now  # type: ignore[no-any-return]  # a TTL key's expiry: a float


class FIFOPolicy(EvictionPolicy):
    """First cached, first evicted (leaves only), ties by LRU. Key: ``(time the run was
    cached, last_access)`` (the access time also keeps runs with different access times from
    coalescing: every other policy's key has it).

    The insertion time is per node (``aux``, set by ``on_insert``): blocks a sequence appends
    to the run it holds alone share the run's time, as they share its LRU and LFU inputs, so a
    conversation that goes on turn after turn keeps its first turn's time. A hit does not
    change it. Runtime complexity: O(1) per node event; the ``RecencyIndex`` (times arrive in
    order) makes filing O(1).
    """

    name = "fifo"
    hooks = True
    key_size = 2

    def key(self, node: Node, hints: NodeHints) -> Key:
        return (self._aux(node), node.last_access)  # type: ignore[return-value]  # aux: a time

    def new_index(self) -> RecencyIndex:
        return RecencyIndex()

    def on_insert(self, node: Node, start: int, now: float) -> None:
        if start == 0:
            self._set_aux(node, now)


class LFUDAPolicy(EvictionPolicy):
    """LFU with dynamic aging (Arlitt et al. 2000): key ``K = L + hits`` set at each hit, where
    ``L`` is the largest key evicted so far. Key: ``(K, last_access)``.

    Plain LFU never forgets: a block used often long ago outlives everything new. Aging lifts
    every new key by the victims' level, so old counts lose their weight as the cache turns
    over. ``K`` is computed when the node is hit (or cached: ``L + 0``) and kept in ``aux`` as
    ``(K, hits)`` (with the count, so that only runs with equal counts coalesce); ``L`` is one
    number for the whole tree, raised by every victim the index pops in any tier (a leaf that
    was inner for a long time can have a key below ``L``: ``L`` never goes down).
    Runtime complexity: O(1) per node event, O(log n) per filing (``SortedIndex``).
    """

    name = "lfu-da"
    hooks = True
    key_size = 2
    fresh_counts = True

    def __init__(self) -> None:
        self.L = 0.0

    def key(self, node: Node, hints: NodeHints) -> Key:
        return (self._aux(node)[0], node.last_access)  # type: ignore[index]  # aux: (K, hits)

    def new_index(self) -> AgingIndex:
        return AgingIndex(self._popped)

    def _popped(self, entry: Entry) -> None:
        if entry[0] > self.L:
            self.L = entry[0]

    def on_insert(self, node: Node, start: int, now: float) -> None:
        if start == 0:
            self._set_aux(node, (self.L + node.hits, node.hits))

    def on_hit(self, node: Node, prev_access: float, now: float) -> None:
        self._set_aux(node, (self.L + node.hits, node.hits))
