"""BlockManager: per-sequence block tables over the radix tree, with copy-on-write forks.

The engine talks to the cache only through this class. Life of a sequence::

    alloc = bm.allocate(seq, prompt_tokens, ns)   # match cached prefix, lock it, allocate the rest
    run alloc.moves (promotions/demotions), compute tokens [alloc.num_cached_tokens, len)
    bm.commit(seq, len(prompt))                   # full computed blocks join the tree
    run bm.take_moves()                           # write-through copies of what was committed
    loop: s = bm.append_slot(seq, token)          # slot for the new token's KV (+ CoW copy)
          run s.moves, s.copy, compute the token; bm.commit(seq, n)
    bm.fork(seq, child)                           # n samples / beams share every block
    bm.free(seq)                                  # full blocks stay cached, the rest is freed

A sequence allocated with ``tail=True`` leaves, when freed, its partial last block (the rows it
computed) in the tail cache (``core/tails.py``); a later ``allocate(..., tail=True)`` whose
whole-block match ends where that tail hangs and whose next tokens begin with the tail's takes
the block, its rows counted as cached tokens (so ``num_cached_tokens`` need not be a multiple
of the block size then).

Conventions: a *block table* lists device block ids, one per ``block_size`` tokens; the last
block may be partial and belongs to the sequence (and its forks) only. Full blocks whose KV is
computed are *committed* into the tree and may then be shared by any request. A block's device
refcount is the number of live sequences whose table holds it: for a cached block it is its
node's ``ref`` (every holder of a node holds all of it), for a private block the pool's
refcount. A sequence never writes into a block with refcount > 1: ``append_slot`` copies a
shared partial block first. A sequence refers to the tree by block hash and block id only, so
the tree may cut its nodes at any time.

With write-through tiers (``RadixTree(write_through=...)``) committing a block also copies it
into those tiers: the MoveOps (copies, ``keep_src=True``, and the evictions that made room) are
queued and returned by ``take_moves()``, to be run after the step's commits and before the next
allocation (``allocate`` puts any that were not taken first in its own moves, so running every
returned list in order is always right).

Every public method validates its arguments and capacity before mutating anything, so an
exception (always a ``RadixKVError``) leaves the manager, tree and pool exactly as they were.
Pure Python: imports no torch.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import xxhash

from radixkv.core.events import KVEventQueue
from radixkv.core.hashing import TOKEN_BYTES, BlockHash, Namespace, chain_hash, token_bytes
from radixkv.core.policy_registry import DEFAULT_POLICY
from radixkv.core.pool import BlockId, BlockPool
from radixkv.core.tails import TailCache
from radixkv.core.tree import DEVICE, BlockRef, MoveOp, Node, RadixTree
from radixkv.errors import (
    InvalidRequestError, InvalidTokensError, OutOfBlocks, SequenceExistsError,
    UnknownSequenceError,
)

SeqId = Hashable
#: xxh3-128 of bytes, typed as what it makes here: a chain hash (``hashing.chain_hash``'s
#: arithmetic, inlined on the hot paths)
_xxh3_128 = cast("Callable[[bytes], BlockHash]", xxhash.xxh3_128_digest)
_tuple_new = tuple.__new__


class CopyOp(NamedTuple):
    """Copy device block ``src`` onto device block ``dst`` (copy-on-write of a shared tail)."""

    src: int
    dst: int


class SlotAssignment(NamedTuple):
    """Where the KV of a sequence's newest token goes, and what must run before writing it.

    ``slot = block_id * block_size + offset``. ``moves`` (tier demotions caused by allocating a
    new block) run first, then ``copy`` (if the tail block was shared), then the write.
    """

    slot: int
    copy: CopyOp | None
    moves: tuple[MoveOp, ...]


class Allocation(NamedTuple):
    """Result of ``allocate``: the sequence's block table and what the cache already holds.

    ``num_cached_tokens`` tokens (whole blocks) have valid KV once ``moves`` have run;
    ``cached_tokens_per_tier[t]`` says how many of them came from tier t (0 = device).
    (A NamedTuple, not a dataclass: it is built once per request on the hot path.)
    """

    seq_id: SeqId
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    cached_tokens_per_tier: tuple[int, ...]
    moves: tuple[MoveOp, ...]


class SeqState:
    __slots__ = ("seed", "tokens", "blocks", "last_hash", "num_cached", "num_computed",
                 "keep_tail")

    def __init__(self, seed: bytes, tokens: array[int], blocks: list[BlockId],
                 last_hash: BlockHash | None,
                 num_cached: int, num_computed: int, keep_tail: bool = False) -> None:
        self.seed = seed
        self.tokens = tokens            # every token id so far (array('i'): no int objects)
        self.blocks = blocks            # device block ids, ceil(len(tokens) / B) of them
        self.last_hash = last_hash      # chain hash of block num_cached - 1 (None: none)
        self.num_cached = num_cached    # leading blocks this sequence matched or committed
        self.num_computed = num_computed  # tokens whose KV is written
        self.keep_tail = keep_tail      # free() leaves the partial last block to the tails


class BlockManager:
    """Block tables, copy-on-write and prefix reuse for live sequences.

    A sequence refers to the tree only by block hash (``last_hash``) and by its block table,
    never by node: nodes are cut and merged under it, hashes and block ids stay.

    Args:
        tree: the radix tree (which owns the device pool and any slower tiers).
        tail_blocks: partial last blocks kept for later requests that continue them
            (:attr:`tails`; ``None``: an eighth of the device pool, 0: none).
    """

    def __init__(self, tree: RadixTree, tail_blocks: int | None = None) -> None:
        self.tree = tree
        self.pool: BlockPool = tree.pools[DEVICE]
        self.block_size = tree.block_size
        self._seqs: dict[SeqId, SeqState] = {}
        #: the kept partial tails; each kept block holds one pool reference (the cache's)
        self.tails = TailCache(self.pool.num_blocks // 8 if tail_blocks is None
                               else tail_blocks)
        if tree.hooks:
            tree.policy.bind_manager(self)

    @classmethod
    def create(cls, num_blocks: int, block_size: int = 16, policy: str = DEFAULT_POLICY,
               lower_tier_blocks: Sequence[int] = (), write_through: Sequence[int] = (),
               tail_blocks: int | None = None, **tree_kwargs: Any) -> BlockManager:
        """A manager over a fresh device pool of ``num_blocks`` (+ slower tiers' capacities);
        ``write_through`` lists the slower tiers that get a copy of every committed block;
        ``tail_blocks``: partial tails kept (None: ``num_blocks // 8``)."""
        tree = RadixTree(block_size, BlockPool(num_blocks),
                         [BlockPool(n) for n in lower_tier_blocks], policy=policy,
                         write_through=write_through, **tree_kwargs)
        return cls(tree, tail_blocks)

    def shadow(self, num_blocks: int, policy: str) -> BlockManager:
        """A manager over a fresh device-only tree of ``num_blocks`` blocks with this one's
        block size and clock and eviction by ``policy``: a shadow cache that a policy replays
        requests into (``EvictionPolicy.bind_manager``; ``policy_duel.py``)."""
        tree = self.tree
        return BlockManager(RadixTree(tree.block_size, BlockPool(num_blocks), policy=policy,
                                      clock=tree.clock), tail_blocks=0)

    def _switch_policy(self, policy: str) -> None:
        """Hand eviction to ``policy`` (``auto``'s first session-end hint): the tree re-files
        its nodes, and the new policy meets this manager."""
        self.tree.switch_policy(policy)
        if self.tree.hooks:
            self.tree.policy.bind_manager(self)

    # ------------------------------------------------------------------ queries
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequences(self) -> Iterator[tuple[SeqId, SeqState]]:
        """``(seq_id, state)`` of every live sequence (read-only views: the caller must not
        change them, nor the manager meanwhile). For checks and tests. O(1) per item."""
        return iter(self._seqs.items())

    @staticmethod
    def _check_new_id(seq_id: SeqId) -> None:
        try:
            hash(seq_id)
        except TypeError:
            raise InvalidTokensError(
                f"sequence ids must be hashable (str, int, tuple), got {type(seq_id).__name__}"
            ) from None

    @staticmethod
    def _check_namespace(namespace: Namespace) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidTokensError(
                "namespace must be a radixkv.core.hashing.Namespace, got "
                f"{type(namespace).__name__}")

    def _seq(self, seq_id: SeqId) -> SeqState:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(
                f"sequence {seq_id!r} is not live (never allocated, or already freed)") from None

    def block_table(self, seq_id: SeqId) -> list[BlockId]:
        """The sequence's device block ids (a copy). Runtime complexity: O(blocks)."""
        return list(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: SeqId) -> int:
        return len(self._seq(seq_id).tokens)

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def token_ids(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).tokens)

    def block_refcount(self, block_id: BlockId) -> int:
        """How many live sequences hold device block ``block_id`` (its node's holders if it is
        cached, the pool's count if it is private). Runtime complexity: O(1)."""
        node = self.tree.device_nodes[block_id]
        return self.pool.ref_counts[block_id] if node is None else node.ref

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation could obtain now: free, evictable cached blocks and kept
        tails. O(1)."""
        return self.pool.num_free + self.tree.num_evictable(DEVICE) + len(self.tails)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def _plan(self, tok: bytes, seed: bytes, num_tokens: int
              ) -> tuple[list[Node], int, int, int, int]:
        """Match a prompt: ``(path, k, device nodes, device blocks, unheld device blocks)``.
        At most (n-1)//B blocks: at least one prompt token must be computed to produce logits,
        and the block holding it must be private (no write into a shared block)."""
        path, k = self.tree.match_path(tok, seed, (num_tokens - 1) // self.block_size)
        d = dev = unheld = 0
        last = len(path) - 1
        for node in path:
            if node.tier != DEVICE:
                break
            m = k if d == last else len(node.hashes)
            dev += m
            if not node.ref:
                unheld += m
            d += 1
        return path, k, d, dev, unheld

    def _check_capacity(self, need: int, unheld: int, taken_tail: int = 0) -> None:
        """Locking the matched unheld device blocks takes them out of the evictable count (and
        a tail the allocation takes out of the reclaimable tails)."""
        evictable = self.tree.num_evictable(DEVICE) - unheld + len(self.tails) - taken_tail
        if need > self.pool.num_free + evictable:
            raise OutOfBlocks(need, self.pool.num_free, evictable)

    def _take_blocks(self, n: int, moves: list[MoveOp], held: bool = False) -> list[BlockId]:
        """``n`` device blocks, reclaiming kept tails (oldest first) and then evicting what is
        missing (the caller checked capacity); ``held``: with one reference each already."""
        short = n - self.pool.num_free
        if short > 0 and len(self.tails):
            self._drop_tails(self.tails.reclaim(short))
            short = n - self.pool.num_free
        if short > 0:
            tree = self.tree
            if tree.pending_moves:
                moves.extend(tree.take_moves())
            tree.evict_from(DEVICE, short, moves)
        return self.pool.allocate_held(n) if held else self.pool.allocate(n)

    def _drop_tails(self, blocks: list[BlockId]) -> None:
        """Free tail blocks the tail cache let go of (it held one reference on each)."""
        refs, pool = self.pool.ref_counts, self.pool
        for b in blocks:
            refs[b] = 0
            pool.free_one(b)

    def can_allocate(self, token_ids: Sequence[int], namespace: Namespace,
                     tail: bool = False) -> bool:
        """Whether ``allocate`` would succeed now (no side effects). O(prompt blocks)."""
        self._check_namespace(namespace)
        tok = token_bytes(token_ids)
        n = len(tok) // TOKEN_BYTES
        path, k, d, dev, unheld = self._plan(tok, namespace.seed, n)
        take = self._tail_rows(tok, namespace.seed, n, path, k, d, dev) if tail else 0
        try:
            self._check_capacity(self._blocks_for(n) - dev - (1 if take else 0), unheld,
                                 1 if take else 0)
        except OutOfBlocks:
            return False
        return True

    def tail_tokens_after(self, token_ids: Sequence[int], namespace: Namespace,
                          chain: Sequence[BlockRef]) -> int:
        """Leading tokens of ``token_ids`` past the cached whole blocks ``chain`` (a match of
        its prefix, as ``RadixTree.match_tokens`` returns it) that a kept partial tail holds:
        the rows a request with this prompt would take instead of computing (``core/tails.py``).
        Only after a chain wholly on the device (tails are device-only and follow device
        blocks). No side effects; O(one block)."""
        self._check_namespace(namespace)
        if not len(self.tails) or any(ref.tier != DEVICE for ref in chain):
            return 0
        lo = len(chain) * self.block_size
        if lo >= len(token_ids):
            return 0
        key = (namespace.seed, chain[-1].block_hash if chain else None)
        return self.tails.peek(key, token_bytes(list(token_ids[lo:lo + self.block_size])))

    def _tail_key(self, seed: bytes, path: list[Node], k: int) -> tuple[bytes, Any]:
        return seed, (path[-1].hashes[k - 1] if path else None)

    def _tail_rows(self, tok: bytes, seed: bytes, n: int, path: list[Node], k: int, d: int,
                   dev: int) -> int:
        """Rows a kept tail would serve a prompt matched as ``_plan`` says: only after a
        match held wholly on the device, and never the last prompt token (its logits are
        computed)."""
        if not len(self.tails) or d != len(path):
            return 0
        lo = dev * self.block_size * TOKEN_BYTES
        return self.tails.peek(self._tail_key(seed, path, k), tok[lo:(n - 1) * TOKEN_BYTES])

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], namespace: Namespace,
                 session: Hashable | None = None, end_session: bool = False,
                 resumed: bool = False, tail: bool = False) -> Allocation:
        """Start a sequence: reuse its longest cached prefix and allocate blocks for the rest.

        Matched device blocks are locked; matched host/disk blocks are promoted into fresh
        device blocks (their loads are in ``moves``, after any demotions that made room; a
        slow block that making room evicted is recomputed instead).
        ``session`` (any hashable, e.g. a conversation id) and ``end_session`` (this is the
        session's last request) are hints for a policy that forecasts reuse (``policy.py``'s
        hooks); other policies ignore them. ``resumed``: this allocation continues a request
        the policy was already told of (a preempted request, another sample of it, a retry
        after a failed load), so it is not a new turn of the session. ``tail``: take a kept
        partial tail that continues the matched blocks (its rows count as cached tokens), and
        leave this sequence's own to the tail cache when it is freed.
        All-or-nothing: raises SequenceExistsError, InvalidTokensError, InvalidRequestError or
        OutOfBlocks without changing anything. Runtime complexity: O(prompt blocks) byte
        comparisons + O(nodes) + the evictions.
        """
        self._check_new_id(seq_id)
        self._check_namespace(namespace)
        if type(end_session) is not bool or type(resumed) is not bool or type(tail) is not bool:
            raise InvalidRequestError(f"end_session, resumed and tail must be bools, got "
                                      f"{end_session!r}, {resumed!r}, {tail!r}")
        if session is not None:
            try:
                hash(session)
            except TypeError:
                raise InvalidRequestError("session must be hashable (a str or int id), got "
                                          f"{type(session).__name__}") from None
        if seq_id in self._seqs:
            raise SequenceExistsError(f"sequence {seq_id!r} is already live; free it first")
        tok = token_bytes(token_ids)
        n = len(tok) // TOKEN_BYTES
        seed = namespace.seed
        path, k, d, dev, unheld = self._plan(tok, seed, n)
        take = self._tail_rows(tok, seed, n, path, k, d, dev) if tail else 0
        # the key before anything changes: cutting the matched nodes below renames path[-1]
        tail_key = self._tail_key(seed, path, k) if take else None
        need = self._blocks_for(n) - dev - (1 if take else 0)
        self._check_capacity(need, unheld, 1 if take else 0)
        # --- no exception past this point ---
        tree = self.tree
        now = tree.clock()
        if end_session and tree.policy.on_end_hint is not None:
            self._switch_policy(tree.policy.on_end_hint)    # ``auto``: the first hint
        if tree.hooks:
            tree.policy.on_start(seq_id, n, namespace, session, end_session, now, resumed)
        moves: list[MoveOp] = tree.take_moves()   # write-through moves not taken yet run first
        per_tier = [0] * tree.num_tiers
        per_tier[DEVICE] = dev * self.block_size
        held = path[:d]
        if held:
            if d == len(path):
                held = tree.cut(held, k)
            tree.lock_nodes(held, now)
        blocks = _as_block_ids(held[0].block_ids.tolist() if len(held) == 1 else
                               [b for x in held for b in x.block_ids.tolist()])
        if d < len(path):
            # Promote the slower-tier match block by block: take one device block (making
            # room may demote a device block into the host, and evict from the slower tiers,
            # even part of this match), check that the block is still cached right after the
            # held chain, promote it (which frees its block in the slower tier for the next
            # demotion). Exactly the order a per-block cache takes; the blocks join one run
            # again (coalescing).
            last = len(path) - 1
            wanted = [h for i, x in enumerate(path[d:], d)
                      for h in (x.hashes[:k] if i == last else x.hashes)]
            heads = tree.heads
            prev = held[-1] if held else None
            for h in wanted:
                [b] = self._take_blocks(1, moves)
                node = heads.get(h)
                if node is None or node.tier == DEVICE or node.parent is not prev or \
                        node.hashes[0] != h:
                    self.pool.free([b])   # making room dropped it: recompute from here
                    break
                per_tier[node.tier] += self.block_size
                blocks.append(b)
                if len(node.hashes) > 1:
                    op = None if prev is None else tree.promote_head_block(node, prev, b, now)
                    if op is not None:
                        moves.append(op)
                        continue
                    node = tree.split(node, 1)[0]
                moves.extend(tree.promote_nodes([node], [b], now))
                prev = tree.device_nodes[b]
                assert prev is not None, f"promoted block {b} is not cached"
                held = [prev]
        num_cached = sum(per_tier) // self.block_size
        rows = 0
        if take:   # before _take_blocks, which could reclaim it: the tail's reference is ours
            lo = dev * self.block_size * TOKEN_BYTES
            assert tail_key is not None
            got = self.tails.take(tail_key, tok[lo:(n - 1) * TOKEN_BYTES])
            assert got is not None and got[1] == take, f"tail {got} changed since its peek"
            blocks.append(got[0])
            rows = take
            per_tier[DEVICE] += rows
        blocks += self._take_blocks(self._blocks_for(n) - len(blocks), moves, held=True)
        last_hash = held[-1].hashes[-1] if held else None
        cached = num_cached * self.block_size + rows
        self._seqs[seq_id] = SeqState(seed, array("i", tok), blocks, last_hash, num_cached,
                                      cached, tail)
        return Allocation(seq_id, tuple(blocks), cached, tuple(per_tier), tuple(moves))

    def end_session(self, session: Hashable) -> None:
        """The client says ``session`` (as passed to ``allocate``) is over: a policy that
        forecasts reuse lets its blocks go first (others ignore it). Raises
        InvalidRequestError if ``session`` is None or unhashable.
        Runtime complexity: O(the session's last chain in nodes x log n)."""
        if session is None:
            raise InvalidRequestError("end_session needs the session id given to allocate")
        try:
            hash(session)
        except TypeError:
            raise InvalidRequestError("session must be hashable (a str or int id), got "
                                      f"{type(session).__name__}") from None
        if self.tree.policy.on_end_hint is not None:
            self._switch_policy(self.tree.policy.on_end_hint)    # ``auto``: the first hint
        if self.tree.hooks:
            self.tree.policy.end_session(session)

    # ------------------------------------------------------------------ commit
    def commit(self, seq_id: SeqId, num_computed_tokens: int) -> int:
        """Record that KV of tokens [0, num_computed_tokens) is written; cache full blocks.

        Each newly full block joins the tree under its chain hash; a run the sequence alone
        holds simply grows. If the tree already caches that hash on the device (another
        sequence computed it), this sequence (with any fork sibling holding the same private
        block) switches to the cached block and frees its duplicate; if it caches it in a
        slower tier, the recomputed block becomes that block's device residency (keeping the
        slower one as a copy if that tier is write-through). Write-through copies of the new
        blocks are queued for ``take_moves``. Returns the number of blocks newly cached.
        Runtime complexity: O(new blocks) (+ write-through copies).
        """
        s = self._seq(seq_id)
        if (type(num_computed_tokens) is not int
                or not s.num_computed <= num_computed_tokens <= len(s.tokens)):
            raise InvalidTokensError(
                f"num_computed_tokens must be in [{s.num_computed}, {len(s.tokens)}] for sequence "
                f"{seq_id!r}, got {num_computed_tokens!r}")
        s.num_computed = num_computed_tokens
        bs, tree = self.block_size, self.tree
        first, last = s.num_cached, num_computed_tokens // bs
        if last <= first:
            return 0
        if tree.hooks:
            tree.policy.enter(seq_id)
        blocks = s.blocks
        dn = tree.device_nodes
        c = first
        while c < last and dn[blocks[c]] is not None:
            c += 1
        if c > first:
            # A fork sibling committed blocks this sequence shares (its table holds them):
            # catch up. The cached part of a table is whole nodes, so from here on the
            # sequence's last block is its node's last.
            node = dn[blocks[c - 1]]
            s.last_hash = node.hashes[node.block_ids.index(blocks[c - 1])]   # type: ignore[union-attr]
            s.num_cached = first = c
            if c == last:
                return 0
        tok = s.tokens[first * bs:last * bs].tobytes()
        width = bs * TOKEN_BYTES
        heads = tree.heads
        # the sequence's last cached block is held on the device: its block id names its node
        parent = dn[blocks[first - 1]] if s.last_hash is not None else None
        assert parent is None or parent.hashes[-1] == s.last_hash, (
            f"sequence {seq_id!r}: its last cached block is not its node's last")
        h = s.seed if s.last_hash is None else s.last_hash
        added = 0
        now = tree.clock()
        i = first
        while i < last:
            off = (i - first) * width
            chunk = tok[off:off + width]
            hi = _xxh3_128(h + chunk)
            node = heads.get(hi)
            if node is None:
                # Everything from here is new (a cached block's parent is cached): one pass.
                node, n = tree.insert_run(parent, h, tok[off:], blocks[i:last], now, hi)
                if not n:
                    break   # unreachable unless a hash collides with the index
                added += n
                i += n
                parent, h = node, node.hashes[-1]  # type: ignore[union-attr]
                s.last_hash, s.num_cached = h, i
                continue
            if node.parent is not parent or node.hashes[0] != hi or node.tokens[:width] != chunk:
                tree.stats.collisions += 1   # keep this block private, stop caching the chain
                break
            m = self._run_like(node, tok, off, blocks, i, last)
            if node.tier == DEVICE:
                # Another sequence computed these blocks first: share its copy, free ours.
                node = self._switch_to_cached(i, blocks[i:i + m], node, now)
            else:
                node = tree.adopt(node, blocks[i:i + m])
                added += m
            i += m
            parent, h = node, node.hashes[-1]
            s.last_hash, s.num_cached = h, i
        return added

    def _run_like(self, node: Node, tok: bytes, off: int, blocks: list[BlockId], i: int,
                  last: int) -> int:
        """How many blocks from ``i`` on equal ``node``'s leading blocks (its first already
        does) and are held by as many sequences as block ``i`` (one node per holder set)."""
        w = self.block_size * TOKEN_BYTES
        refs = self.pool.ref_counts
        r = refs[blocks[i]]
        m = 1
        limit = min(len(node.hashes), last - i)
        while m < limit and refs[blocks[i + m]] == r and \
                node.tokens[m * w:(m + 1) * w] == tok[off + m * w:off + (m + 1) * w]:
            m += 1
        return m

    def _switch_to_cached(self, i: int, mine: list[BlockId], node: Node, now: float) -> Node:
        """Every live sequence holding our private blocks ``mine`` at positions ``[i, i+m)``
        (the committing one and its fork siblings: equal refcounts, so the same sequences)
        takes a reference on the cached ``node``'s first ``m`` blocks instead; our duplicates
        are freed. O(live sequences): the rare path of two computations of one block.
        Returns the node now holding them."""
        refs, tree = self.pool.ref_counts, self.tree
        m = len(mine)
        holders = [q for q in self._seqs.values() if len(q.blocks) > i and q.blocks[i] == mine[0]]
        assert len(holders) == refs[mine[0]] and tree.device_nodes[mine[0]] is None, (
            f"block {mine[0]}: {len(holders)} holders at position {i}, refcount {refs[mine[0]]}")
        if m < len(node.hashes):
            node = tree.split(node, m)[0]
        for q in holders:
            q.blocks[i:i + m] = _ids_of(node.block_ids)
        tree.lock_nodes([node] * len(holders), now)
        for b in mine:
            refs[b] = 0
            self.pool.free_one(b)
        return node

    # ------------------------------------------------------------------ fork / free
    def _deepest_cached(self, blocks: list[BlockId]) -> int:
        """Index of the last cached block of a table (cached blocks form a prefix), or -1."""
        dn = self.tree.device_nodes
        i = len(blocks) - 1
        while i >= 0 and dn[blocks[i]] is None:
            i -= 1
        return i

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (n samples, beams). O(blocks)."""
        p = self._seq(parent_id)
        self._check_new_id(child_id)
        if child_id in self._seqs:
            raise SequenceExistsError(f"sequence {child_id!r} is already live")
        blocks = p.blocks
        c = self._deepest_cached(blocks)
        refs = self.pool.ref_counts
        for b in blocks[c + 1:]:
            refs[b] += 1
        if self.tree.hooks:
            self.tree.policy.on_fork(parent_id, child_id)
            self.tree.policy.enter(child_id)
        if c >= 0:
            self.tree.lock_path(self.tree.device_nodes[blocks[c]])   # type: ignore[arg-type]
        self._seqs[child_id] = SeqState(p.seed, p.tokens[:], list(blocks), p.last_hash,
                                        p.num_cached, p.num_computed, p.keep_tail)

    def free(self, seq_id: SeqId) -> None:
        """End a sequence: committed blocks stay cached (evictable once unheld), its private
        blocks return to the pool, except a partial last block a ``tail=True`` sequence alone
        holds, which goes to the tail cache with the tokens of its computed rows. Raises
        UnknownSequenceError on a double free.
        Runtime complexity: O(private blocks + depth in nodes)."""
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        blocks = s.blocks
        c = self._deepest_cached(blocks)
        refs, pool = self.pool.ref_counts, self.pool
        keep = -1
        t = c + 1
        if s.keep_tail and t < len(blocks) and s.num_cached == t and refs[blocks[t]] == 1:
            lo = t * self.block_size
            if lo < s.num_computed < lo + self.block_size:
                keep = blocks[t]
        for b in reversed(blocks[c + 1:]):
            if b == keep:
                continue
            r = refs[b] - 1
            refs[b] = r
            if r == 0:
                pool.free_one(b)
        if keep >= 0:
            self._drop_tails(self.tails.put((s.seed, s.last_hash), BlockId(keep),
                                            s.tokens[lo:s.num_computed].tobytes()))
        hooks = self.tree.hooks
        if hooks:
            self.tree.policy.enter(seq_id)
        if c >= 0:
            self.tree.release_path(self.tree.device_nodes[blocks[c]])   # type: ignore[arg-type]
        if hooks:
            self.tree.policy.on_finish(seq_id, s.tokens)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers that disagree, unless pool, tree and block
        tables agree. Every device
        block is exactly one of free, cached (its holders counted by its node), or held privately
        (counted by the pool); a block's count equals the number of tables holding it; each table's
        cached blocks are a prefix of it made of whole nodes, a chain from a root whose tokens are
        the sequence's own and whose first hash is its namespace's; ``last_hash`` names its block
        ``num_cached - 1``; tables cover their tokens."""
        bm = self
        pool, tree = bm.pool, bm.tree
        pool.check_invariants()
        tree.check_invariants()
        bs = bm.block_size
        w = tree.block_bytes
        dn = tree.device_nodes
        held = [0] * pool.num_blocks
        for sid, s in bm.sequences():
            blocks = s.blocks
            assert len(blocks) == -(-len(s.tokens) // bs), (
                f"seq {sid!r}: {len(blocks)} blocks for {len(s.tokens)} tokens")
            assert len(set(blocks)) == len(blocks), f"seq {sid!r} holds a block twice"
            assert s.num_computed <= len(s.tokens)
            assert s.num_cached <= s.num_computed // bs, (
                f"seq {sid!r}: {s.num_cached} cached blocks, {s.num_computed} computed tokens")
            c = 0
            while c < len(blocks) and dn[blocks[c]] is not None:
                c += 1
            assert all(dn[b] is None for b in blocks[c:]), (
                f"seq {sid!r}: cached blocks not a prefix")
            assert c >= s.num_cached, f"seq {sid!r}: {s.num_cached} cached, table has {c}"
            if s.num_cached:
                node = dn[blocks[s.num_cached - 1]]
                assert node is not None and node.tier == DEVICE, f"seq {sid!r}: last hash uncached"
                assert s.last_hash in node.hashes and \
                    node.block_ids[node.hashes.index(s.last_hash)] == blocks[s.num_cached - 1], (
                    f"seq {sid!r}: last hash is not block {s.num_cached - 1}")
            else:
                assert s.last_hash is None, f"seq {sid!r}: last hash without cached blocks"
            if c:
                chain: list[Node] = []
                node = dn[blocks[c - 1]]
                assert node is not None and node.block_ids[-1] == blocks[c - 1], (
                    f"seq {sid!r} holds part of {node}")
                while node is not None:
                    chain.append(node)
                    node = node.parent
                chain.reverse()
                assert [b for x in chain for b in x.block_ids] == blocks[:c], (
                    f"seq {sid!r}: its cached blocks are not the chain of whole nodes above them")
                assert b"".join(bytes(x.tokens) for x in chain) == s.tokens[:c * bs].tobytes(), (
                    f"seq {sid!r}: cached tokens differ from its own")
                assert chain_hash(s.seed, bytes(chain[0].tokens[:w])) == chain[0].hashes[0], (
                    f"seq {sid!r}: its root block is not of its namespace")
            for b in blocks:
                held[b] += 1
        for (seed, _), tail in bm.tails:
            b = tail.block
            rows = len(tail.tokens) // TOKEN_BYTES
            assert dn[b] is None, f"tail block {b} is also cached in the tree"
            assert 0 < rows < bs and len(tail.tokens) == rows * TOKEN_BYTES, (
                f"tail block {b}: {len(tail.tokens)} token bytes")
            assert isinstance(seed, bytes), f"tail block {b}: key without a namespace seed"
            held[b] += 1
        assert len(bm.tails) <= bm.tails.limit, f"{len(bm.tails)} tails over {bm.tails.limit}"
        for b in map(BlockId, range(pool.num_blocks)):
            node = dn[b]
            refs = node.ref if node is not None else pool.ref_counts[b]
            assert refs == held[b], (
                f"block {b}: refcount {refs} but held by {held[b]} sequences and tails")
            free = pool.is_free(b)
            assert not (free and (node is not None or pool.ref_counts[b])), (
                f"block {b} is free but cached={node is not None} refs={pool.ref_counts[b]}")
            assert free or node is not None or pool.ref_counts[b], (
                f"block {b} leaked: not free, not cached, no references")

    # ============================================================= decode, slots for new tokens
    # Decoding through the block manager: a slot for each new token's KV, and copy-on-write.
    def blocks_needed_to_append(self, seq_id: SeqId) -> int:
        """Device blocks the next ``append_slot`` takes: 1 at a block boundary or CoW, else 0."""
        s = self._seq(seq_id)
        if len(s.tokens) % self.block_size == 0:
            return 1
        return 1 if self.pool.ref_counts[s.blocks[-1]] > 1 else 0

    def append_slot(self, seq_id: SeqId, token_id: int) -> SlotAssignment:
        """Append one token and return the slot for its KV (plus a CoW copy if needed).

        A new block is taken at a block boundary; a shared partial tail (after ``fork``) is
        copied first so that this sequence never writes into a block others read.
        All-or-nothing (OutOfBlocks changes nothing). Runtime complexity: O(1) amortised.
        This is the per-token hot path of decoding: it allocates one tuple in the common case.
        """
        try:
            s = self._seqs[seq_id]
        except (KeyError, TypeError):
            s = self._seq(seq_id)  # raises UnknownSequenceError
        if type(token_id) is not int or not 0 <= token_id <= 0x7FFFFFFF:
            if (not isinstance(token_id, int) or isinstance(token_id, bool)
                    or not 0 <= token_id < 2**31):
                raise InvalidTokensError(f"token id must be an int in [0, 2**31), got {token_id!r}")
        bs = self.block_size
        tokens = s.tokens
        off = len(tokens) % bs
        refs = self.pool.ref_counts
        if off and refs[s.blocks[-1]] == 1:
            tokens.append(token_id)
            return _tuple_new(SlotAssignment, (s.blocks[-1] * bs + off, None, ()))
        if self.pool.num_free == 0 and self.tree.num_evictable(DEVICE) == 0 and \
                not len(self.tails):
            raise OutOfBlocks(1, 0, 0, "preempt a sequence (free it and recompute later)")
        moves: list[MoveOp] = []
        [b] = self._take_blocks(1, moves)
        refs[b] += 1
        copy = None
        if off:
            old = s.blocks[-1]
            refs[old] -= 1   # was > 1: still referenced by a fork, never freed here
            s.blocks[-1] = b
            copy = CopyOp(old, b)
        else:
            s.blocks.append(b)
        tokens.append(token_id)
        return SlotAssignment(b * bs + off, copy, tuple(moves))

    def append_slots(self, seq_id: SeqId, token_ids: Sequence[int]
                     ) -> tuple[list[int], CopyOp | None, tuple[MoveOp, ...]]:
        """Append several tokens at once (a chunk, a replayed reply, speculative tokens).

        Returns ``(slots, copy, moves)``: one KV slot per token, the CoW copy of a shared tail
        (if any) and the demotions that made room; same contract as ``append_slot``.
        All-or-nothing. Runtime complexity: O(tokens + new blocks * log n).
        """
        s = self._seq(seq_id)
        tok = token_bytes(token_ids)  # validates
        n = len(tok) // TOKEN_BYTES
        bs, refs = self.block_size, self.pool.ref_counts
        pos = len(s.tokens)
        cow = pos % bs != 0 and refs[s.blocks[-1]] > 1
        new_blocks = self._blocks_for(pos + n) - len(s.blocks) + (1 if cow else 0)
        if new_blocks > self.num_available_blocks:
            raise OutOfBlocks(new_blocks, self.pool.num_free,
                              self.tree.num_evictable(DEVICE) + len(self.tails),
                              "preempt a sequence (free it and recompute later)")
        moves: list[MoveOp] = []
        fresh = self._take_blocks(new_blocks, moves)
        for b in fresh:
            refs[b] += 1
        copy = None
        if cow:
            old, b = s.blocks[-1], fresh.pop(0)
            refs[old] -= 1
            s.blocks[-1] = b
            copy = CopyOp(old, b)
        s.blocks.extend(fresh)
        s.tokens.extend(array("i", tok))
        # Slots block by block: one range per block instead of a divmod per token; the partial
        # head and tail blocks apart, so a full block costs a multiply and a range.
        slots: list[int] = []
        extend = slots.extend
        blocks = s.blocks
        i, off = divmod(pos, bs)
        left = n
        if off:
            k = left if left < bs - off else bs - off
            base = blocks[i] * bs + off
            extend(range(base, base + k))
            left -= k
            i += 1
        full, tail = divmod(left, bs)
        for b in blocks[i:i + full]:
            base = b * bs
            extend(range(base, base + bs))
        if tail:
            base = blocks[i + full] * bs
            extend(range(base, base + tail))
        return slots, copy, tuple(moves)


    # ================================================================== tier plans
    # The block manager's tier plans: every change the tier components ask of the radix tree.
    def expire(self, now: float | None = None) -> list[MoveOp]:
        """Blocks whose TTL ran out at ``now`` (the TTL policy's, or a per-block ``ttl`` hint
        under any policy, e.g. a cache breakpoint's) leave their tier: the moves to run.
        Runtime complexity: O(expired blocks + nodes * log n)."""
        return self.tree.evict_expired(now)

    def event_queue(self) -> KVEventQueue:
        """The cache's KV event queue (``RadixTree.event_queue``): ``subscribe()`` to it and
        drain with ``take_events()`` on the engine loop."""
        return self.tree.event_queue()

    def take_moves(self) -> list[MoveOp]:
        """The MoveOps of write-through copies made by ``commit`` (and of the evictions that
        made room for them), in execution order; clears them. Empty without write-through.
        Runtime complexity: O(1)."""
        return self.tree.take_moves()

    def get(self, block_hash: BlockHash) -> BlockRef | None:
        """The cached block ``block_hash`` (a snapshot, read only). O(its node's length)."""
        return self.tree.get(block_hash)

    def install_lower(self, parent_hash: BlockHash | None, block_hash: BlockHash, tokens: bytes,
                      tier: int) -> BlockRef | None:
        """Cache a block whose bytes the caller places in slower tier ``tier`` (a disk file
        found at start, a remote block fetched into the host) after ``parent_hash``; None if
        it cannot be placed. A ``BlockStored`` event says so (a block entered the cache; e.g.
        a fleet replica announces it to the router).
        Runtime complexity: O(1) (+ a cut of the parent's node)."""
        return self.tree.insert_lower(parent_hash, block_hash, tokens, tier)

    def promote_lower(self, block_hash: BlockHash, tier: int, max_blocks: int | None = None
                      ) -> list[MoveOp]:
        """Plan moving the slower-tier run starting at ``block_hash`` (up to ``max_blocks``
        blocks) up into slower tier ``tier`` (a prefetch): its moves."""
        return self.tree.promote_lower(block_hash, tier, max_blocks)

    def invalidate(self, block_hash: BlockHash) -> list[MoveOp]:
        """``block_hash`` and everything after it leave the cache (their bytes are bad or
        lost): the drops to run. Runtime complexity: O(dropped blocks)."""
        return self.tree.invalidate(block_hash)

    def reset_cache(self) -> list[MoveOp]:
        """Drop every cached block that no sequence holds, in every tier, and every kept tail
        (vLLM's ``reset_prefix_cache``): the drops to run. Blocks in use stay, so this is safe
        while requests run; each unheld subtree goes whole (a held node's ancestors are held
        too, so those subtrees hang off held nodes or the root). O(nodes + dropped blocks)."""
        self._drop_tails(self.tails.reclaim(len(self.tails)))
        tree = self.tree

        def held(node: Node) -> bool:
            return node.tier == DEVICE and node.ref > 0

        cuts = [n for n in tree.nodes()
                if not held(n) and (n.parent is None or held(n.parent))]
        moves: list[MoveOp] = []
        for node in cuts:
            moves.extend(tree.invalidate(node.hashes[0]))
        return moves

    def drop_copy(self, block_hash: BlockHash, tier: int) -> MoveOp | None:
        """Forget ``block_hash``'s write-through copy in ``tier`` (its write failed)."""
        return self.tree.writes.drop_copy(block_hash, tier)

    def touch(self, block_hash: BlockHash, now: float | None = None, near: Node | None = None
              ) -> None:
        """Mark ``block_hash`` and its prefix used now (so making room next to it does not
        evict it); ``near``: the node holding it, if known (``RadixTree.locate_chain``)."""
        self.tree.touch(block_hash, now, near)

    def evict(self, tier: int, num_blocks: int) -> list[MoveOp]:
        """Make room: ``num_blocks`` unheld blocks leave ``tier`` by the policy's order
        (demoted when a slower tier exists, else dropped); the moves to run."""
        return self.tree.evict(tier, num_blocks)

    def set_hints(self, block_hashes: Sequence[BlockHash], priority: int | None = None,
                  ttl: float | None = None) -> None:
        """Eviction hints (priority, TTL) for cached blocks (cache breakpoints)."""
        self.tree.set_hints(block_hashes, priority=priority, ttl=ttl)




__all__ = ["Allocation", "BlockManager", "CopyOp", "SlotAssignment"]


def _as_block_ids(ids: Sequence[int]) -> list[BlockId]:
    """Device block ids read back from a packed run (``Node.block_ids``) or a list of its ints,
    as a block table holds them: the same ints, typed (no copy)."""
    return cast("list[BlockId]", ids)


def _ids_of(run: array[int]) -> Sequence[BlockId]:
    """A run's packed device block ids (``Node.block_ids``), typed as ids (no copy)."""
    return cast("Sequence[BlockId]", run)
