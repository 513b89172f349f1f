"""Shared helpers of the core property tests (imported by the test modules and conftest.py).

``snapshot_manager`` / ``snapshot_tree`` / ``snapshot_pool`` capture *every* piece of state a
failed operation could corrupt (block tables, refcounts, free list order, the tree index with
parents/tiers/slots/child counts/access stamps, evictable sets, residency, hints, copies and
queued write-through moves), as plain
values, so a test can assert that an operation that raised changed nothing.
"""

from __future__ import annotations

from radixkv.core.block_manager import BlockManager
from radixkv.core.pool import BlockPool
from radixkv.core.tree import RadixTree


class FakeClock:
    """A deterministic monotonic clock: time moves only when a test calls ``advance``."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float = 1.0) -> float:
        assert seconds >= 0
        self.now += seconds
        return self.now


class StepCounter:
    """Counts state-machine steps across the session (reported in the terminal summary)."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}
        self.programs: dict[str, int] = {}
        self.events: dict[str, dict[str, int]] = {}

    def step(self, name: str) -> None:
        self.steps[name] = self.steps.get(name, 0) + 1

    def program(self, name: str) -> None:
        self.programs[name] = self.programs.get(name, 0) + 1

    def event(self, name: str, what: str, count: int = 1) -> None:
        """Count something a machine did (e.g. free demotions), to show the rules reach it."""
        ev = self.events.setdefault(name, {})
        ev[what] = ev.get(what, 0) + count


STEPS = StepCounter()


def snapshot_pool(pool: BlockPool) -> tuple:
    return (pool.num_blocks, tuple(pool.ref_counts), tuple(pool._free), bytes(pool._is_free))


def snapshot_tree(tree: RadixTree) -> tuple:
    nodes = {id(n): n for n in tree.block_index().values()}
    nodes_t = tuple(sorted(
        (tuple(n.hashes), None if n.parent is None else n.parent.hashes[-1], bytes(n.tokens),
         n.tier, tuple(n.block_ids), n.ref, n.children, n.last_access, n.hits, n.hints,
         tuple(c.hashes[0] for c in n.iter_children()))
        for n in nodes.values()))
    return (
        nodes_t,
        tuple(tuple(e) for e in tree.evictable),
        tuple(tree.resident),
        tree.unreferenced,
        tuple(tuple(None if n is None else n.hashes[n.block_ids.index(b)] for b, n in enumerate(sn))
              for sn in tree.block_nodes),
        tuple(sorted((h, n.hashes[-1]) for h, n in tree.heads.items())),
        tuple(sorted((h, n.hashes[0]) for h, n in tree.tails.items())),
        tuple(snapshot_pool(p) for p in tree.pools),
        tuple(tuple(sorted(tree.writes.copies(u).items())) for u in range(tree.num_tiers)),
        tuple(tree.pending_moves),
        tuple(sorted(tree.ttl_heap)),
    )


def snapshot_manager(bm: BlockManager) -> tuple:
    seqs = tuple(sorted(
        ((repr(sid), tuple(s.tokens), tuple(s.blocks), s.last_hash, s.num_cached,
          s.num_computed, s.seed)
         for sid, s in bm._seqs.items())))
    tails = tuple((repr(k), t.block, t.tokens) for k, t in bm.tails)
    return (seqs, snapshot_tree(bm.tree), tails)


def assert_unchanged(before: tuple, after: tuple, what: str) -> None:
    """Fail with the first differing component (readable for big snapshots)."""
    if before == after:
        return
    def diff(a, b, path):
        if type(a) is tuple and type(b) is tuple and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return diff(x, y, f"{path}[{i}]")
        return f"{path}: {a!r} -> {b!r}"
    raise AssertionError(f"{what} raised but changed state at {diff(before, after, 'state')}")


def removed_in_order(cursor) -> list[bytes]:
    """The hashes of the blocks removed since the reader's last take, in the order they left
    (each ``BlockRemoved`` is a chain that leaves from its deepest block)."""
    from radixkv.core.events import BlockRemoved

    out: list[bytes] = []
    for e in cursor.take_events():
        if type(e) is BlockRemoved:
            out.extend(reversed(e.block_hashes))
    return out
