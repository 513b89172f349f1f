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

Conventions: a *block table* lists device block ids, one per ``block_size`` tokens; the last
block may be partial and belongs to the sequence (and its forks) only. Full blocks whose KV is
computed are *committed* into the tree and may then be shared by any request. A block's device
refcount is the number of live sequences whose table holds it. A sequence never writes into a
block with refcount > 1: ``append_slot`` copies a shared partial block first.

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
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from radixkv.core.hashing import TOKEN_BYTES, Namespace, token_bytes
from radixkv.core.pool import BlockPool
from radixkv.core.tier_plans import TierPlans
from radixkv.core.tree import DEVICE, MoveOp, Node, RadixTree
from radixkv.errors import (
    InvalidTokensError, OutOfBlocks, SequenceExistsError, UnknownSequenceError,
)

SeqId = Hashable
_xxh3_128 = xxhash.xxh3_128_digest
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


@dataclass(frozen=True)
class Allocation:
    """Result of ``allocate``: the sequence's block table and what the cache already holds.

    ``num_cached_tokens`` tokens (whole blocks) have valid KV once ``moves`` have run;
    ``cached_tokens_per_tier[t]`` says how many of them came from tier t (0 = device).
    """

    seq_id: SeqId
    block_ids: tuple[int, ...]
    num_cached_tokens: int
    cached_tokens_per_tier: tuple[int, ...]
    moves: tuple[MoveOp, ...]


class _Seq:
    __slots__ = ("seed", "tokens", "blocks", "hashes", "nodes", "num_computed")

    def __init__(self, seed: bytes, tokens: array, blocks: list[int], hashes: list[bytes],
                 nodes: list[Node], num_computed: int) -> None:
        self.seed = seed
        self.tokens = tokens            # every token id so far (array('i'): no int objects)
        self.blocks = blocks            # device block ids, ceil(len(tokens) / B) of them
        self.hashes = hashes            # chain hashes of the committed blocks
        self.nodes = nodes              # tree nodes of the committed blocks (same length)
        self.num_computed = num_computed  # tokens whose KV is written


class BlockManager(TierPlans):
    """Block tables, copy-on-write and prefix reuse for live sequences.

    Args:
        tree: the radix tree (which owns the device pool and any slower tiers).
    """

    def __init__(self, tree: RadixTree) -> None:
        self.tree = tree
        self.pool: BlockPool = tree._pools[DEVICE]
        self.block_size = tree.block_size
        self._seqs: dict[SeqId, _Seq] = {}

    @classmethod
    def create(cls, num_blocks: int, block_size: int = 16, policy: str = "lru",
               lower_tier_blocks: Sequence[int] = (), write_through: Sequence[int] = (),
               **tree_kwargs) -> BlockManager:
        """A manager over a fresh device pool of ``num_blocks`` (+ slower tiers' capacities);
        ``write_through`` lists the slower tiers that get a copy of every committed block."""
        tree = RadixTree(block_size, BlockPool(num_blocks),
                         [BlockPool(n) for n in lower_tier_blocks], policy=policy,
                         write_through=write_through, **tree_kwargs)
        return cls(tree)

    # ------------------------------------------------------------------ queries
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @staticmethod
    def _check_new_id(seq_id: SeqId) -> None:
        try:
            hash(seq_id)
        except TypeError:
            raise InvalidTokensError(
                f"sequence ids must be hashable (str, int, tuple), got {type(seq_id).__name__}") from None

    @staticmethod
    def _check_namespace(namespace: Namespace) -> None:
        if not isinstance(namespace, Namespace):
            raise InvalidTokensError(
                f"namespace must be a radixkv.core.hashing.Namespace, got {type(namespace).__name__}")

    def _seq(self, seq_id: SeqId) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(
                f"sequence {seq_id!r} is not live (never allocated, or already freed)") from None

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The sequence's device block ids (a copy). Runtime complexity: O(blocks)."""
        return list(self._seq(seq_id).blocks)

    def num_tokens(self, seq_id: SeqId) -> int:
        return len(self._seq(seq_id).tokens)

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def token_ids(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation could obtain now: free plus evictable cached blocks. O(1)."""
        return self.pool.num_free + self.tree.num_evictable(DEVICE)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocation
    def _match(self, tok: bytes, seed: bytes, num_tokens: int) -> tuple[list[Node], list[bytes]]:
        # Match at most (n-1)//B blocks: at least one prompt token must be computed to produce
        # logits, and the block holding it must be private (no write into a shared block).
        return self.tree.match_tokens(tok, seed, (num_tokens - 1) // self.block_size)

    def _check_capacity(self, need: int, matched: Sequence[Node]) -> None:
        # Locking a matched unreferenced device node takes it out of the evictable count.
        evictable = self.tree.num_evictable(DEVICE)
        if need <= self.pool.num_free + evictable - len(matched):
            return   # fits even if every matched block were evictable now: skip the count
        refs = self.pool.ref_counts
        locked_now = sum(1 for n in matched if n.tier == DEVICE and refs[n.slot] == 0)
        evictable -= locked_now
        if need > self.pool.num_free + evictable:
            raise OutOfBlocks(need, self.pool.num_free, evictable)

    def _take_blocks(self, n: int, moves: list[MoveOp]) -> list[int]:
        short = n - self.pool.num_free
        if short > 0:
            moves.extend(self.tree.evict(DEVICE, short))
        return self.pool.allocate(n)

    def can_allocate(self, token_ids: Sequence[int], namespace: Namespace) -> bool:
        """Whether ``allocate`` would succeed now (no side effects). O(prompt blocks)."""
        self._check_namespace(namespace)
        tok = token_bytes(token_ids)
        n = len(tok) // TOKEN_BYTES
        nodes, _ = self._match(tok, namespace.seed, n)
        on_device = sum(1 for x in nodes if x.tier == DEVICE)
        try:
            self._check_capacity(self._blocks_for(n) - on_device, nodes)
        except OutOfBlocks:
            return False
        return True

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int], namespace: Namespace) -> Allocation:
        """Start a sequence: reuse its longest cached prefix and allocate blocks for the rest.

        Matched device blocks are locked; matched host/disk blocks are promoted into fresh
        device blocks (their loads are in ``moves``, after any demotions that made room).
        All-or-nothing: raises SequenceExistsError, InvalidTokensError or OutOfBlocks without
        changing anything. Runtime complexity: O(prompt tokens + evictions * log n).
        """
        self._check_new_id(seq_id)
        self._check_namespace(namespace)
        if seq_id in self._seqs:
            raise SequenceExistsError(f"sequence {seq_id!r} is already live; free it first")
        tok = token_bytes(token_ids)
        n = len(tok) // TOKEN_BYTES
        nodes, hashes = self._match(tok, namespace.seed, n)
        tree = self.tree
        # Device nodes form a prefix of the chain (tiers are non-decreasing along it).
        k = len(nodes)
        if tree.num_tiers > 1:
            k = next((i for i, x in enumerate(nodes) if x.tier != DEVICE), k)
        need = self._blocks_for(n) - k
        self._check_capacity(need, nodes)
        # --- no exception past this point ---
        now = tree.clock()
        blocks = [x.slot for x in nodes[:k]] if k < len(nodes) else [x.slot for x in nodes]
        tree.lock_blocks(blocks, now)
        per_tier = [0] * tree.num_tiers
        per_tier[DEVICE] = k * self.block_size
        moves: list[MoveOp] = tree.take_moves()   # write-through moves not taken yet run first
        if k == len(nodes):
            kept = nodes
        else:
            kept = nodes[:k]
        for x in nodes[k:]:
            [b] = self._take_blocks(1, moves)
            if tree.get(x.block_hash) is not x or (x.parent is not None and x.parent.tier != DEVICE):
                # Making room dropped this block from the slow tiers: recompute from here.
                self.pool.free([b])
                break
            tier = x.tier
            moves.append(tree.promote(x, b))  # type: ignore[arg-type]
            tree.lock(x, now)
            per_tier[tier] += self.block_size
            blocks.append(b)
            kept.append(x)
        fresh = self._take_blocks(self._blocks_for(n) - len(blocks), moves)
        refs = self.pool.ref_counts
        for b in fresh:
            refs[b] += 1
        blocks.extend(fresh)
        num_cached = len(kept) * self.block_size
        self._seqs[seq_id] = _Seq(namespace.seed, array("i", tok), blocks,
                                  hashes if len(kept) == len(hashes) else hashes[:len(kept)],
                                  kept, num_cached)
        return Allocation(seq_id, tuple(blocks), num_cached, tuple(per_tier), tuple(moves))

    # ------------------------------------------------------------------ decode
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
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < 2**31:
                raise InvalidTokensError(f"token id must be an int in [0, 2**31), got {token_id!r}")
        bs = self.block_size
        tokens = s.tokens
        off = len(tokens) % bs
        refs = self.pool.ref_counts
        if off and refs[s.blocks[-1]] == 1:
            tokens.append(token_id)
            return _tuple_new(SlotAssignment, (s.blocks[-1] * bs + off, None, ()))
        if self.pool.num_free == 0 and self.tree.num_evictable(DEVICE) == 0:
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

    def append_slots(self, seq_id: SeqId, token_ids: Sequence[int]) -> tuple[list[int], CopyOp | None, tuple[MoveOp, ...]]:
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
            raise OutOfBlocks(new_blocks, self.pool.num_free, self.tree.num_evictable(DEVICE),
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
            b *= bs
            extend(range(b, b + bs))
        if tail:
            b = blocks[i + full] * bs
            extend(range(b, b + tail))
        return slots, copy, tuple(moves)

    def commit(self, seq_id: SeqId, num_computed_tokens: int) -> int:
        """Record that KV of tokens [0, num_computed_tokens) is written; cache full blocks.

        Each newly full block joins the tree under its chain hash. If the tree already caches
        that hash on the device (another sequence computed it), this sequence switches to the
        cached block and frees its duplicate; if it caches it in a slower tier, the recomputed
        block becomes that node's device copy (keeping the slower one as a copy if that tier is
        write-through). Write-through copies of the new blocks are queued for ``take_moves``.
        Returns the number of blocks newly cached.
        Runtime complexity: O(new blocks * log n).
        """
        s = self._seq(seq_id)
        if type(num_computed_tokens) is not int or not s.num_computed <= num_computed_tokens <= len(s.tokens):
            raise InvalidTokensError(
                f"num_computed_tokens must be in [{s.num_computed}, {len(s.tokens)}] for sequence "
                f"{seq_id!r}, got {num_computed_tokens!r}")
        s.num_computed = num_computed_tokens
        bs, tree = self.block_size, self.tree
        first, last = len(s.nodes), num_computed_tokens // bs
        if last <= first:
            return 0
        tok = s.tokens[first * bs:last * bs].tobytes()
        width = bs * TOKEN_BYTES
        parent = s.nodes[-1] if s.nodes else None
        h = s.hashes[-1] if s.hashes else s.seed
        added = 0
        now = tree.clock()
        index_get = tree._index.get
        blocks = s.blocks
        i = first
        while i < last:
            off = (i - first) * width
            chunk = tok[off:off + width]
            hi = _xxh3_128(h + chunk)
            node = index_get(hi)
            if node is None:
                # Everything from here is new (a cached block's parent is cached): one pass.
                run = tree.insert_run(parent, h, tok[off:], blocks[i:last], now, hi)
                if run:
                    s.nodes.extend(run)
                    s.hashes.extend([x.block_hash for x in run])
                    added += len(run)
                    i += len(run)
                    parent, h = run[-1], run[-1].block_hash
                    continue
                node = index_get(hi)   # unreachable unless a hash collides with the index
                if node is None:
                    break
            b = blocks[i]
            if node.parent is not parent or node.tokens != chunk:
                tree.stats.collisions += 1   # keep this block private, stop caching the chain
                break
            if node.tier == DEVICE and node.slot != b:
                # Another sequence computed this block first: share its copy, free ours. Fork
                # siblings holding our duplicate switch too (same block id, same position), so
                # the chain stays cached for all of them and nobody holds a child without its
                # parent (refcount monotonicity).
                self._switch_to_cached(i, b, node, now)
            elif node.tier != DEVICE:
                tree.promote(node, b, copy=False)
                added += 1
            s.nodes.append(node)
            s.hashes.append(hi)
            parent, h = node, hi
            i += 1
        return added

    def _switch_to_cached(self, i: int, b: int, node: Node, now: float) -> None:
        """Every live sequence holding private device block ``b`` at position ``i`` (the
        committing one and its fork siblings) takes a reference on cached ``node`` instead;
        ``b`` is freed. O(live sequences): the rare path of two computations of one block."""
        refs = self.pool.ref_counts
        holders = [q for q in self._seqs.values() if len(q.blocks) > i and q.blocks[i] == b]
        assert len(holders) == refs[b] and self.tree.device_node(b) is None, (
            f"block {b}: {len(holders)} holders at position {i}, refcount {refs[b]}")
        for q in holders:
            self.tree.lock(node, now)
            q.blocks[i] = node.slot
        refs[b] = 0
        self.pool.free_one(b)

    # ------------------------------------------------------------------ fork / free
    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (n samples, beams). O(blocks)."""
        p = self._seq(parent_id)
        self._check_new_id(child_id)
        if child_id in self._seqs:
            raise SequenceExistsError(f"sequence {child_id!r} is already live")
        self.tree.lock_blocks(p.blocks)
        self._seqs[child_id] = _Seq(p.seed, p.tokens[:], list(p.blocks), list(p.hashes),
                                    list(p.nodes), p.num_computed)

    def free(self, seq_id: SeqId) -> None:
        """End a sequence: committed blocks stay cached (evictable once unreferenced), its
        private blocks return to the pool. Raises UnknownSequenceError on a double free.
        Runtime complexity: O(blocks * log n)."""
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        self.tree.release_blocks(s.blocks[::-1])

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Pool, tree and tables agree: refcounts = table occurrences; every device block is
        exactly one of free, cached, or held privately; tables cover their tokens."""
        self.pool.check_invariants()
        self.tree.check_invariants()
        bs = self.block_size
        held = [0] * self.pool.num_blocks
        for sid, s in self._seqs.items():
            assert len(s.blocks) == self._blocks_for(len(s.tokens)), (
                f"seq {sid!r}: {len(s.blocks)} blocks for {len(s.tokens)} tokens")
            assert len(set(s.blocks)) == len(s.blocks), f"seq {sid!r} holds a block twice"
            assert len(s.nodes) == len(s.hashes) <= s.num_computed // bs, (
                f"seq {sid!r}: {len(s.nodes)} nodes, {len(s.hashes)} hashes, {s.num_computed} computed")
            assert s.num_computed <= len(s.tokens)
            for i, node in enumerate(s.nodes):
                assert node.tier == DEVICE and node.slot == s.blocks[i], (
                    f"seq {sid!r} block {i}: table has {s.blocks[i]}, node {node}")
                assert self.tree.get(node.block_hash) is node, f"seq {sid!r} holds an uncached node"
            for b in s.blocks:
                held[b] += 1
        for b in range(self.pool.num_blocks):
            refs = self.pool.ref_counts[b]
            assert refs == held[b], f"block {b}: refcount {refs} but held by {held[b]} sequences"
            free = self.pool.is_free(b)
            cached = self.tree.device_node(b) is not None
            assert free + cached + (refs > 0 and not cached) == 1 or (cached and refs > 0 and not free), (
                f"block {b}: free={free} cached={cached} refs={refs}")
            assert not (free and (cached or refs)), f"block {b} is free but cached={cached} refs={refs}"
            assert free or cached or refs, f"block {b} leaked: not free, not cached, no references"
