"""Replay a trace through the real radixkv bookkeeping (BlockManager, RadixTree, BlockPool, tiers).

For each request, in trace order and one at a time, the replay does what an engine that
generated the trace's reply would do::

    alloc = bm.allocate(seq, prompt, ns)    # match the cached prefix (any tier), lock it,
                                            # promote host/disk hits, allocate the rest
    bm.commit(seq, len(prompt))             # the prompt's full blocks join the tree
    bm.append_slots(seq, reply)             # the generated tokens' slots
    bm.commit(seq, len(prompt) + len(reply))
    bm.free(seq)                            # full blocks stay cached, the partial tail is freed

and counts ``alloc.num_cached_tokens`` (split per tier by ``alloc.cached_tokens_per_tier``) as
hits. The tree's clock is the trace's time (seconds), so TTL policies see real think times.
This is the same model as ``benchmarks/bounds.py`` (the tests check that the block-level LRU there
and the real tree's LRU agree), so every figure can be set against the infinite-cache and
Belady bounds at the same device capacity.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import xxhash

from radixkv.core.block_manager import BlockManager
from radixkv.core.hashing import Namespace, token_bytes
from radixkv.core.policy import EvictionPolicy
from radixkv.core.policy_registry import make_policy
from radixkv.core.pool import BlockPool
from radixkv.core.tree import RadixTree

from radixkv.benchmarks.bounds import NAMESPACE
from radixkv.benchmarks.prefill_cost import SMOLLM2_L0, prefix_cost


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: device capacity and block size, the eviction policy, optional slower tiers.

    ``policy``: ``lru`` (default), ``lfu``, ``priority`` (leading ``priority_tokens(request)``
    tokens of each prompt get priority 1, e.g. a shared system prompt), ``ttl`` (blocks expire
    ``ttl_s`` seconds after their last use, dropped even without memory pressure, like hosted
    prompt caches' 5-minute tier) or an ``EvictionPolicy`` instance.
    ``host_blocks``/``disk_blocks``: capacities of the slower tiers (0 = absent).
    A policy name may end with ``+end-hint``: each session's last request then says so
    (``allocate(..., end_session=True)``, as a client closing a chat would). Every request
    carries its conversation as its ``session`` (``sessions=False``: none, as anonymous
    requests); only policies with hooks read either.
    """

    block_size: int
    device_blocks: int
    policy: str | EvictionPolicy = "lru"
    host_blocks: int = 0
    disk_blocks: int = 0
    ttl_s: float = 300.0
    sessions: bool = True

    @property
    def policy_name(self) -> str:
        return self.policy if isinstance(self.policy, str) else self.policy.name

    @property
    def end_hint(self) -> bool:
        return isinstance(self.policy, str) and self.policy.endswith("+end-hint")

    @property
    def tiers(self) -> str:
        return "+".join(["device"] + (["host"] if self.host_blocks else [])
                        + (["disk"] if self.disk_blocks else []))


@dataclass
class ReplayResult:
    """Counters of one replay. Token counts are prompt tokens; tiers are device, host, disk.

    ``hit_cost``/``prompt_cost``: prefill compute saved / needed with nothing cached, in the
    units of ``benchmarks/prefill_cost.py`` (a deep block costs more than a shallow one).
    ``hits_digest``: xxh64 of the prompt tokens hit by each request in order (two replays
    with equal digests hit the same tokens request by request).
    """

    config: ReplayConfig
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_cost: float = 0.0
    prompt_cost: float = 0.0
    hit_tokens_per_tier: list[int] = field(default_factory=lambda: [0, 0, 0])
    requests: int = 0
    evictions_per_tier: list[int] = field(default_factory=list)
    promotions_per_tier: list[int] = field(default_factory=list)
    dropped: int = 0
    expired: int = 0
    inserted: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    hits_digest: str = ""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def cost_rate(self) -> float:
        """Fraction of prefill compute saved."""
        return self.hit_cost / self.prompt_cost if self.prompt_cost else 0.0

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        pt = max(self.prompt_tokens, 1)
        return {
            "policy": c.policy_name, "block_size": c.block_size, "device_blocks": c.device_blocks,
            "host_blocks": c.host_blocks, "disk_blocks": c.disk_blocks, "tiers": c.tiers,
            "hit_rate": self.hit_rate, "cost_rate": self.cost_rate,
            "hit_cost": self.hit_cost, "prompt_cost": self.prompt_cost,
            "hit_rate_per_tier": [h / pt for h in self.hit_tokens_per_tier],
            "prompt_tokens": self.prompt_tokens, "hit_tokens": self.hit_tokens,
            "prefill_tokens_saved": self.hit_tokens,
            "hit_tokens_per_tier": self.hit_tokens_per_tier,
            "evictions_per_tier": self.evictions_per_tier,
            "promotions_per_tier": self.promotions_per_tier,
            "dropped": self.dropped, "expired": self.expired, "inserted": self.inserted,
            "requests": self.requests, "wall_s": self.wall_s, "cpu_s": self.cpu_s,
            "hits_digest": self.hits_digest,
            "us_per_request": 1e6 * self.wall_s / max(self.requests, 1),
            "cpu_us_per_request": 1e6 * self.cpu_s / max(self.requests, 1),
        }


class _TraceClock:
    """The tree's clock: the current request's arrival time (seconds)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


#: What ``build_manager`` builds a manager from by default: this checkout's core.
THIS_CORE = SimpleNamespace(commit=None, BlockManager=BlockManager, RadixTree=RadixTree,
                            BlockPool=BlockPool, make_policy=make_policy)


def build_manager(cfg: ReplayConfig, clock: Callable[[], float],
                  core: SimpleNamespace = THIS_CORE) -> BlockManager:
    """A fresh manager for ``cfg``, built from ``core``'s ``BlockManager``, ``RadixTree``,
    ``BlockPool`` and ``make_policy`` (``_core_baseline.load_core_parts``: an earlier
    commit's, for before/after runs in one process)."""
    BlockPool, make_policy = core.BlockPool, core.make_policy   # noqa: N806
    lower = [BlockPool(n) for n in (cfg.host_blocks, cfg.disk_blocks) if n]
    if cfg.disk_blocks and not cfg.host_blocks:
        raise ValueError("a disk tier needs a host tier in front of it")
    policy: str | EvictionPolicy = cfg.policy
    if isinstance(policy, str) and policy.endswith("+end-hint"):
        policy = policy[:-len("+end-hint")]
    if policy == "ttl":
        policy = make_policy("ttl", ttl=cfg.ttl_s)
    elif isinstance(policy, str) and policy.startswith("duel:"):
        # the duel with options: "duel:sample=<k>" (sampled shadows), "duel:members=a/b/c"
        opt, val = policy[len("duel:"):].split("=", 1)
        policy = make_policy("duel", **{"sample": val if val == "auto" else int(val)}
                             if opt == "sample" else {"members": tuple(val.split("/"))})
    tree = core.RadixTree(cfg.block_size, BlockPool(cfg.device_blocks), lower, policy=policy,
                          clock=clock)
    return core.BlockManager(tree)


def replay(requests: Sequence[Any], cfg: ReplayConfig, namespace: Namespace = NAMESPACE,
           priority_tokens: Callable[[Any], int] | None = None, progress: Any = None,
           check_every: int = 0, l0: float = SMOLLM2_L0,
           core: SimpleNamespace = THIS_CORE) -> ReplayResult:
    """Replay ``requests`` (objects with ``t``, ``prompt``, ``reply``) through a fresh manager
    (built from ``core``'s classes if given: ``build_manager``).

    ``progress``: an object with ``update(n)`` (a tqdm bar), called every 256 requests.
    ``check_every``: run ``BlockManager.check_invariants`` every that many requests (tests).
    Raises OutOfBlocks if one request does not fit in ``device_blocks``.
    """
    clock = _TraceClock()
    bm = build_manager(cfg, clock, core)
    tree = bm.tree
    res = ReplayResult(cfg)
    per_tier = res.hit_tokens_per_tier
    use_priority = cfg.policy == "priority" and priority_tokens is not None
    expire = cfg.policy == "ttl"
    bs = cfg.block_size
    final: dict[Any, int] = {}
    if cfg.end_hint:
        final = {getattr(r, "conv", j): j for j, r in enumerate(requests)}
    hits = array("q")
    t0, c0 = time.perf_counter(), time.process_time()
    for j, r in enumerate(requests):
        clock.now = r.t
        if expire:
            tree.evict_expired(r.t)
        prompt, reply = r.prompt, r.reply
        conv = getattr(r, "conv", j)
        alloc = bm.allocate(j, prompt, namespace, session=conv if cfg.sessions else None,
                            end_session=final.get(conv) == j)
        res.hit_tokens += alloc.num_cached_tokens
        hits.append(alloc.num_cached_tokens)
        res.hit_cost += prefix_cost(alloc.num_cached_tokens, l0)
        res.prompt_cost += prefix_cost(len(prompt), l0)
        for t, n in enumerate(alloc.cached_tokens_per_tier):
            per_tier[t] += n
        res.prompt_tokens += len(prompt)
        bm.commit(j, len(prompt))
        if use_priority:
            k = priority_tokens(r) // bs  # type: ignore[misc]
            if k:
                hashes = tree.match_hashes(token_bytes(prompt), namespace.seed, k)
                tree.set_hints([h for h in hashes if tree.hints(h).priority != 1], priority=1)
        if reply:
            bm.append_slots(j, reply)
            bm.commit(j, len(prompt) + len(reply))
        bm.free(j)
        if check_every and j % check_every == 0:
            bm.check_invariants()
        if progress is not None and j % 256 == 255:
            progress.update(256)
    if progress is not None:
        progress.update(len(requests) % 256)
    res.wall_s = time.perf_counter() - t0
    res.cpu_s = time.process_time() - c0
    res.requests = len(requests)
    res.hits_digest = xxhash.xxh64_hexdigest(hits.tobytes())
    st = tree.stats
    res.evictions_per_tier = list(st.evicted)
    res.promotions_per_tier = list(st.promoted)
    res.dropped, res.expired, res.inserted = st.dropped, st.expired, st.inserted
    return res


def system_prefix_tokens(header: dict[str, Any]) -> Callable[[Any], int]:
    """The length of a request's shared prefix, for priority hints: a ``system`` trace's
    few-shot prefix, an ``agent`` trace's system prompt with tools; 0 for other traces."""
    stats = header.get("stats", {})
    lengths = stats.get("prefix_lengths", [])
    if header.get("kind") == "agent" and stats.get("prefix_tokens"):
        n = int(stats["prefix_tokens"])
        return lambda r: n
    return lambda r: lengths[r.meta["prefix"]] if "prefix" in r.meta and lengths else 0
