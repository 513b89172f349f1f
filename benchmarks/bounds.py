"""Hit-rate bounds of a trace: infinite cache, Belady's offline optimum, and a block-level LRU.

Model (the same one the replay through the real radixkv structures uses):

* Requests are served one at a time, in trace order. Request j's prompt P_j and reply R_j are cut
  into blocks of B tokens; only **full** blocks are cached. Block i of a sequence is named by the
  chained hash of blocks 0..i, so a cached block implies its whole prefix chain (a radix tree).
* **Hit** of request j = B x (number of leading *matchable* blocks of P_j cached when j arrives),
  where the matchable blocks are the first (len(P_j) - 1) // B: as in ``BlockManager.allocate``,
  at least one prompt token is always computed (to produce logits), and a partial last block is
  never shared. **Hit rate** = sum of hits / sum of len(P_j) (prompt tokens served from cache /
  prompt tokens requested).
* While j is served, every full block of P_j + R_j is resident and **locked** (an engine holds
  the KV of the whole sequence), plus one transient slot for the partial tail block if
  len(P_j + R_j) is not a multiple of B. After j, its full blocks stay cached and unlocked.
* Capacity C counts blocks (locked + cached + the tail slot). When a new block needs room, one
  unlocked **leaf** (a cached block with no cached child) is evicted, so the cached set stays
  closed under prefixes. ``C`` must be at least the largest single request.

Policies simulated here (per victim choice, among unlocked leaves):

``belady``
    Evict the block whose next use as a prompt block is farthest in the future (never = +inf);
    ties go to the deepest block. Because a request that uses a block uses its whole prefix
    chain, a parent's next use is never later than its child's, so the farthest-next-use block
    can always be taken at a leaf: "leaves only" costs Belady nothing here. Belady's MIN is
    optimal for demand paging of uniform-size pages; this model adds whole-chain locking
    (identical for every policy, since it depends only on the trace), multi-block requests and
    prefix-closed hit counting. Treat it as a strong reference point: the tests compare it with an
    exhaustive search over all eviction choices on small random traces and it matched on every
    one (``tests/benchmarks/test_bounds.py``), but we do not claim a proof. One known gap: a
    block that will be re-generated for free (as part of a later reply) before its next prompt
    use is keyed by that prompt use, which can keep it longer than needed.
``lru``
    Evict the least recently used leaf (last request whose chain contained it); ties deepest first.
``cost-belady``
    Belady weighted by recomputation cost (``benchmarks/prefill_cost.py``: a block at depth d
    costs more than one near the start). At each eviction the ``COST_SAMPLE`` evictable leaves
    with the farthest next uses are taken from Belady's order and the one with the least cost
    per request it would stay idle, ``block_cost / (next_use - now)``, is evicted (never used
    again: cost 0). This is a **heuristic reference, not a bound**: offline caching with
    non-uniform costs has no simple optimal rule (weighted paging needs a min-cost-flow
    solution even without prefix chains), and on cost-weighted savings it can fall below plain
    Belady. Reports therefore use the better of the two as the cost reference, and the tests
    measure both against an exhaustive cost-weighted search on tiny traces.
``end-blind``
    Belady that knows every return time but not which sessions have ended: a reference for
    what an online policy could reach if it forecast every return exactly and learned of an
    end only from a session's silence. The blocks of a session's last request that are never
    used again get a *phantom* next use, one turn gap of that session later (``phantoms``, see
    :func:`session_phantoms`); once the phantom has passed without a return they are known
    dead and go first (deepest first), as an online forecast writes off an overdue session.
    Everything else is keyed as in ``belady``. Without phantoms it is ``belady``.
``infinite``
    No eviction: the most any cache can hit on the trace.

Every result also carries the cost-weighted figures: ``hit_cost`` (prefill cost saved, the sum
of ``prefix_cost(hit tokens)`` per request) and ``prompt_cost``.

Block hashing: ``radixkv.core.hashing`` (chained ``xxh3_128`` over the parent hash and the block's
token ids as little-endian int32, rooted in a namespace seed), the same hashes the replay's tree
uses; any collision-free chain hash would give identical figures.

Runtime: O(total blocks referenced x log(cached blocks)); the 2,000-conversation chat trace
(about 5 M prompt tokens) prepares in a few seconds and simulates in a few seconds per capacity.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixkv.benchmarks.prefill_cost import SMOLLM2_L0, block_cost, prefix_cost
from radixkv.core.hashing import Namespace, hash_blocks, token_bytes

INF = sys.maxsize
#: Candidates (farthest next uses first) the cost-aware Belady weighs at each eviction.
COST_SAMPLE = 8
POLICIES = ("belady", "cost-belady", "lru", "end-blind")


class HasTokens(Protocol):
    prompt: Sequence[int]
    reply: Sequence[int]


#: Namespace of the hit-rate benchmarks (bounds and replay hash with the same seed).
NAMESPACE = Namespace("smollm2-135m-instruct/hit-rate-bench")


def chain_hashes(tokens: Sequence[int], block_size: int,
                 namespace: Namespace = NAMESPACE) -> list[bytes]:
    """Chained 16-byte hashes of the full blocks of ``tokens`` (``radixkv.core.hashing``).

    >>> len(chain_hashes(list(range(40)), 16))
    2
    >>> chain_hashes([1, 2, 3, 4], 2)[0] == chain_hashes([1, 2, 9, 9], 2)[0]
    True
    """
    if len(tokens) < block_size:
        return []
    return hash_blocks(token_bytes(tokens), block_size, namespace.seed)


@dataclass(frozen=True)
class BlockTrace:
    """A trace turned into block ids, ready for the simulators (built by :func:`prepare`).

    ``chains[j]``: dense ids of the full blocks of prompt+reply of request j (root first);
    ``n_prompt_blocks[j]``: how many of them can be hits ((len(prompt) - 1) // B);
    ``tails[j]``: 1 if the sequence has a partial last block; ``prompt_tokens[j]``: len(prompt);
    ``next_use[j][i]``: the next request index > j whose prompt contains chains[j][i] (INF if none);
    ``parent[b]``/``depth[b]``: the chain predecessor (-1 for a root block) and its depth.
    """

    block_size: int
    chains: list[list[int]]
    n_prompt_blocks: list[int]
    tails: list[int]
    prompt_tokens: list[int]
    next_use: list[list[int]]
    parent: list[int]
    depth: list[int]

    @property
    def num_blocks(self) -> int:
        """Distinct full blocks in the trace: its working set in blocks."""
        return len(self.parent)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def min_capacity(self) -> int:
        """The largest single request in blocks (full blocks + tail slot): the smallest C."""
        return max((len(c) + t for c, t in zip(self.chains, self.tails)), default=0)


def prepare(requests: Iterable[HasTokens], block_size: int) -> BlockTrace:
    """Hash every request's prompt+reply into block ids and precompute next uses.

    Runtime complexity: O(total tokens) hashing + O(total blocks) bookkeeping.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids: dict[bytes, int] = {}
    parent: list[int] = []
    depth: list[int] = []
    chains, npb, tails, ptoks = [], [], [], []
    for r in requests:
        seq = list(r.prompt) + list(r.reply)
        chain = []
        prev = -1
        for d, h in enumerate(chain_hashes(seq, block_size)):
            b = ids.get(h)
            if b is None:
                b = ids[h] = len(parent)
                parent.append(prev)
                depth.append(d)
            chain.append(b)
            prev = b
        chains.append(chain)
        npb.append(max(len(r.prompt) - 1, 0) // block_size)
        tails.append(1 if len(seq) % block_size else 0)
        ptoks.append(len(r.prompt))
    # Next prompt use of each referenced block, scanning backwards.
    nxt: list[list[int]] = [[]] * len(chains)
    last: dict[int, int] = {}
    for j in range(len(chains) - 1, -1, -1):
        chain = chains[j]
        nxt[j] = [last.get(b, INF) for b in chain]
        for b in chain[:npb[j]]:
            last[b] = j
    return BlockTrace(block_size, chains, npb, tails, ptoks, nxt, parent, depth)


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulation. Token counts are prompt tokens."""

    policy: str
    block_size: int
    capacity_blocks: int | None  # None = infinite
    hit_tokens: int
    prompt_tokens: int
    evictions: int
    inserted_blocks: int
    hit_cost: float = 0.0
    prompt_cost: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cost_rate(self) -> float:
        """Fraction of prefill compute saved (``prefill_cost.py``'s model)."""
        return self.hit_cost / self.prompt_cost if self.prompt_cost else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "block_size": self.block_size,
                "capacity_blocks": self.capacity_blocks, "hit_rate": self.hit_rate,
                "cost_rate": self.cost_rate, "hit_tokens": self.hit_tokens,
                "prompt_tokens": self.prompt_tokens, "hit_cost": self.hit_cost,
                "prompt_cost": self.prompt_cost, "evictions": self.evictions,
                "inserted_blocks": self.inserted_blocks}


def prompt_cost(bt: BlockTrace, l0: float = SMOLLM2_L0) -> float:
    """Prefill cost of every prompt of the trace with nothing cached."""
    return sum(prefix_cost(n, l0) for n in bt.prompt_tokens)


def infinite(bt: BlockTrace, l0: float = SMOLLM2_L0) -> SimResult:
    """Hit rate of a cache that never evicts (``l0``: the cost model's, ``prefill_cost.py``)."""
    seen = bytearray(bt.num_blocks)
    hit = inserted = 0
    hit_cost = 0.0
    for chain, npb in zip(bt.chains, bt.n_prompt_blocks):
        m = 0
        while m < npb and seen[chain[m]]:
            m += 1
        hit += m
        hit_cost += prefix_cost(m * bt.block_size, l0)
        for b in chain:
            if not seen[b]:
                seen[b] = 1
                inserted += 1
    return SimResult("infinite", bt.block_size, None, hit * bt.block_size,
                     bt.total_prompt_tokens, 0, inserted, hit_cost, prompt_cost(bt, l0))


def simulate(bt: BlockTrace, capacity_blocks: int, policy: str = "belady",
             check: bool = False, l0: float = SMOLLM2_L0,
             phantoms: Sequence[int] | None = None) -> SimResult:
    """Simulate a leaves-only cache of ``capacity_blocks`` with ``policy`` (one of POLICIES).

    ``phantoms`` (``end-blind`` only; :func:`session_phantoms`): per request, the request
    index at which its session would have come back had it not ended (INF: not a session's
    last request, or nothing to guess from).

    ``check=True`` verifies after every request that the cached set is prefix-closed and within
    capacity (O(cached blocks) per request: tests only).

    Runtime complexity: O(sum of chain lengths + evictions x log(heap size)).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
    if capacity_blocks < bt.min_capacity:
        raise ValueError(f"capacity {capacity_blocks} blocks < largest request "
                         f"({bt.min_capacity} blocks at block size {bt.block_size})")
    if (policy == "end-blind") != (phantoms is not None):
        raise ValueError("phantoms are given with the 'end-blind' policy and only with it")
    if phantoms is not None and len(phantoms) != len(bt.chains):
        raise ValueError(f"{len(phantoms)} phantoms for {len(bt.chains)} requests")
    belady = policy != "lru"
    weigh = policy == "cost-belady"
    bs = bt.block_size
    n = bt.num_blocks
    dead: list[tuple[int, int, int, int]] = []  # end-blind: (phantom, -depth, block, version)
    dead_at = [INF] * n if phantoms is not None else []
    next_use = [INF] * n if weigh else []  # cost-belady: each block's next prompt use
    parent, depth = bt.parent, bt.depth
    resident = bytearray(n)
    locked = bytearray(n)
    nchild = [0] * n  # resident children
    version = [0] * n
    key = [0] * n  # belady: -next prompt use; lru: last use. Smaller = evicted first.
    heap: list[tuple[int, int, int, int]] = []  # (key, -depth, block, version)
    push, pop = heapq.heappush, heapq.heappop
    used = hit = evictions = inserted = 0
    hit_cost = 0.0
    for j, chain in enumerate(bt.chains):
        npb = bt.n_prompt_blocks[j]
        r = 0  # resident blocks of the chain form a prefix chain[:r] (prefix-closed cache)
        while r < len(chain) and resident[chain[r]]:
            r += 1
        hit += min(r, npb)
        hit_cost += prefix_cost(min(r, npb) * bs, l0)
        for b in chain:
            locked[b] = 1
        over = used + (len(chain) - r) + bt.tails[j] - capacity_blocks
        while over > 0:
            if dead and dead[0][0] < j:  # end-blind: a phantom return has not come
                k, _, b, v = pop(dead)
            else:
                k, _, b, v = pop(heap)  # never empty: capacity >= the largest request
            if v != version[b] or not resident[b] or locked[b] or nchild[b]:
                continue  # stale entry
            if weigh and next_use[b] != INF:
                b = _cheapest(heap, (k, -depth[b], b, v), j, next_use, version, resident,
                              locked, nchild, depth, bs, l0)
            resident[b] = 0
            used -= 1
            over -= 1
            evictions += 1
            p = parent[b]
            if p >= 0:
                nchild[p] -= 1
                if nchild[p] == 0 and not locked[p]:
                    version[p] += 1
                    push(heap, (key[p], -depth[p], p, version[p]))
                    if phantoms is not None and dead_at[p] != INF:
                        push(dead, (dead_at[p], -depth[p], p, version[p]))
        for b in chain[r:]:
            resident[b] = 1
            p = parent[b]
            if p >= 0:
                nchild[p] += 1
        used += len(chain) - r
        inserted += len(chain) - r
        nu = bt.next_use[j]
        ph = INF if phantoms is None else phantoms[j]
        for i, b in enumerate(chain):
            locked[b] = 0
            key[b] = -nu[i] if belady else j
            version[b] += 1
            if weigh:
                next_use[b] = nu[i]
            if phantoms is not None:
                dead_at[b] = ph if nu[i] == INF else INF
                if dead_at[b] != INF:
                    key[b] = -ph
        last = chain[-1] if chain else -1
        if last >= 0 and nchild[last] == 0:
            push(heap, (key[last], -depth[last], last, version[last]))
            if phantoms is not None and dead_at[last] != INF:
                push(dead, (dead_at[last], -depth[last], last, version[last]))
        if check:
            _check(bt, resident, nchild, used, capacity_blocks)
    return SimResult(policy, bt.block_size, capacity_blocks, hit * bt.block_size,
                     bt.total_prompt_tokens, evictions, inserted, hit_cost, prompt_cost(bt, l0))


def session_phantoms(requests: Sequence[Any]) -> list[int]:
    """Per request, the request index at which its session would come back if it went on:
    for a session's last request, that index + the session's last turn gap in requests (or
    the mean turn gap of all sessions, for a one-turn session); INF for every other request,
    and for every request when no session has two turns (nothing to guess a gap from).
    Sessions are ``conv`` attributes (a request without one is its own session)."""
    convs = [getattr(r, "conv", ("req", j)) for j, r in enumerate(requests)]
    final = {c: j for j, c in enumerate(convs)}
    prev: dict[Any, int] = {}
    gap: dict[Any, int] = {}
    total = count = 0
    for j, c in enumerate(convs):
        if c in prev:
            gap[c] = j - prev[c]
            total += gap[c]
            count += 1
        prev[c] = j
    if not count:
        return [INF] * len(convs)
    mean = max(1, round(total / count))
    return [j + gap.get(c, mean) if final[c] == j else INF for j, c in enumerate(convs)]


def _cheapest(heap: list, first: tuple, now: int, next_use: list[int], version: list[int],
              resident: bytearray, locked: bytearray, nchild: list[int], depth: list[int],
              bs: int, l0: float) -> int:
    """Cost-aware Belady's victim: of ``first`` and up to COST_SAMPLE - 1 more valid leaves
    from the heap (farthest next use first), the one of least cost per idle request; the
    others go back on the heap unchanged."""
    cands = [first]
    while heap and len(cands) < COST_SAMPLE:
        e = heapq.heappop(heap)
        b = e[2]
        if e[3] == version[b] and resident[b] and not locked[b] and not nchild[b]:
            cands.append(e)

    def score(e: tuple) -> float:
        nu = next_use[e[2]]
        return 0.0 if nu == INF else block_cost(depth[e[2]], bs, l0) / (nu - now)

    best = min(cands, key=score)
    for e in cands:
        if e is not best:
            heapq.heappush(heap, e)
    return best[2]


def _check(bt: BlockTrace, resident: bytearray, nchild: list[int], used: int, cap: int) -> None:
    count = 0
    children = [0] * bt.num_blocks
    for b in range(bt.num_blocks):
        if resident[b]:
            count += 1
            p = bt.parent[b]
            if p >= 0:
                assert resident[p], f"block {b} cached without its parent {p}"
                children[p] += 1
    assert count == used, f"{count} resident blocks, bookkeeping says {used}"
    assert used <= cap, f"{used} resident blocks > capacity {cap}"
    for b in range(bt.num_blocks):
        if resident[b]:
            assert children[b] == nchild[b], f"block {b}: {children[b]} children != {nchild[b]}"


def exhaustive_optimum(bt: BlockTrace, capacity_blocks: int, l0: float | None = None) -> float:
    """Best possible hit tokens over *all* leaves-only eviction sequences (tiny traces only);
    with ``l0``, the best prefill cost saved instead (``prefill_cost.prefix_cost``).

    Exponential: a depth-first search over every choice of victims, memoised on
    (request index, cached set). Used by the tests to check :func:`simulate` with 'belady'.
    """
    from functools import lru_cache

    parent = bt.parent

    @lru_cache(maxsize=None)
    def best(j: int, cached: frozenset[int]) -> float:
        if j == len(bt.chains):
            return 0
        chain = bt.chains[j]
        r = 0
        while r < len(chain) and chain[r] in cached:
            r += 1
        gain = min(r, bt.n_prompt_blocks[j])
        if l0 is not None:
            gain = prefix_cost(gain * bt.block_size, l0)
        locked = set(chain)
        need = len(cached) + (len(chain) - r) + bt.tails[j] - capacity_blocks
        chain_set = frozenset(chain)
        outcomes: list[frozenset[int]] = []

        def evict(cur: frozenset[int], k: int) -> None:
            if k <= 0:
                outcomes.append(cur)
                return
            kids = {parent[b] for b in cur}
            for b in sorted(cur):  # any unlocked leaf
                if b not in locked and b not in kids:
                    evict(cur - {b}, k - 1)

        evict(cached, need)
        return gain + max((best(j + 1, out | chain_set) for out in set(outcomes)), default=-10**9)

    return best(0, frozenset()) * (bt.block_size if l0 is None else 1)


def working_set_blocks(bt: BlockTrace) -> int:
    """Distinct full blocks referenced by the trace (prompt and reply)."""
    return bt.num_blocks


def main(argv: list[str] | None = None) -> int:
    import argparse
    import time

    from radixkv.benchmarks._common import print_table
    from radixkv.benchmarks.traces import KINDS, load_trace

    ap = argparse.ArgumentParser(description="Infinite / Belady / LRU hit rates of a trace.")
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--fractions", default="0.02,0.05,0.1,0.2,0.3,0.5,0.75,1.0")
    args = ap.parse_args(argv)
    tr = load_trace(args.kind, args.quick)
    t0 = time.perf_counter()
    bt = prepare(tr, args.block_size)
    t_prep = time.perf_counter() - t0
    inf = infinite(bt)
    print(f"{len(tr)} requests, {bt.total_prompt_tokens} prompt tokens, working set "
          f"{bt.num_blocks} blocks; prepare {t_prep:.1f} s; infinite hit rate {inf.hit_rate:.4f}")
    rows = []
    for f in map(float, args.fractions.split(",")):
        cap = max(int(f * bt.num_blocks), bt.min_capacity)
        row: dict[str, Any] = {"fraction": f, "capacity": cap}
        for pol in ("belady", "lru"):
            t1 = time.perf_counter()
            res = simulate(bt, cap, pol)
            row[pol] = res.hit_rate
            row[f"{pol}_s"] = time.perf_counter() - t1
        row["lru/belady"] = row["lru"] / row["belady"] if row["belady"] else float("nan")
        rows.append(row)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
