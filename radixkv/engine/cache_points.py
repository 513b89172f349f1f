"""Cache breakpoints: a request marks the end of a prefix to keep, with a TTL and/or priority.

Hosted prompt caches let a client say which prefix matters and for how long (Anthropic's
``cache_control: {"type": "ephemeral", "ttl": "1h"}`` on a message, OpenAI's
``prompt_cache_retention``). Here a :class:`CachePoint` names a token position of the prompt;
once the request's prompt is computed, the full blocks up to that position get the point's hints
(``RadixTree.set_hints``): ``ttl`` makes them expire that long after their last use under any
eviction policy (``LLMEngine`` drives expiry lazily), ``priority`` ranks them under the priority
policy, ``persist`` also keeps them in the remote tier that replicas share, for at least the TTL
after their last use (OpenAI's ``"24h"`` retention: the prefix outlives this replica's memory, a
restart, and is found by every replica). Blocks are whole: a point inside a block covers the
blocks before it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from typing import Any

from radixkv.core.hashing import token_bytes
from radixkv.errors import InvalidRequestError

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_ttl(value: float | int | str) -> float:
    """Seconds from ``300``, ``"300"``, ``"30s"``, ``"5m"``, ``"1h"`` or ``"1d"``.

    >>> parse_ttl("5m"), parse_ttl("1h"), parse_ttl(90)
    (300.0, 3600.0, 90.0)
    """
    if isinstance(value, bool):
        raise InvalidRequestError(f"a TTL must be seconds or like '5m'/'1h', got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", value)
        if m is None:
            raise InvalidRequestError(f"a TTL must be seconds or like '5m'/'1h', got {value!r}")
        seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    else:
        raise InvalidRequestError(f"a TTL must be seconds or like '5m'/'1h', got {value!r}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidRequestError(f"a TTL must be a positive, finite time, got {value!r}")
    return seconds


@dataclass(frozen=True)
class CachePoint:
    """Keep the prompt's first ``position`` tokens (whole blocks of them) with these hints.

    ``ttl``: seconds (or ``"5m"``, ``"1h"``) after the last use at which the blocks expire;
    None keeps the policy's default. ``priority``: an int for the priority policy; None keeps it.
    ``persist``: also write the blocks to the remote tier (when the engine has one that
    writes) and keep them there at least ``ttl`` after their last use, whatever its write
    policy; without a remote tier it changes nothing.
    """

    position: int
    ttl: float | str | None = None
    priority: int | None = None
    persist: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.position, int) or isinstance(self.position, bool) \
                or self.position < 1:
            raise InvalidRequestError(
                f"CachePoint.position must be an int >= 1 (a prompt length), got {self.position!r}")
        if self.ttl is not None:
            object.__setattr__(self, "ttl", parse_ttl(self.ttl))
        if self.priority is not None and (not isinstance(self.priority, int)
                                          or isinstance(self.priority, bool)):
            raise InvalidRequestError(f"CachePoint.priority must be an int, got {self.priority!r}")
        if not isinstance(self.persist, bool):
            raise InvalidRequestError(f"CachePoint.persist must be a bool, got {self.persist!r}")


def check_points(points: object, prompt_len: int) -> tuple[CachePoint, ...]:
    """``points`` as a tuple of CachePoints within a prompt of ``prompt_len`` tokens (dicts
    are accepted: ``{"position": 120, "ttl": "1h"}``)."""
    if points is None:
        return ()
    if isinstance(points, (str, bytes, dict)) or not hasattr(points, "__iter__"):
        raise InvalidRequestError("cache_points must be a list of CachePoint (or dicts)")
    out = []
    for p in points:
        if isinstance(p, dict):
            try:
                p = CachePoint(**p)
            except TypeError as exc:
                raise InvalidRequestError(f"bad cache point {p!r}: {exc}") from None
        if not isinstance(p, CachePoint):
            raise InvalidRequestError(f"cache_points items must be CachePoint, got {p!r}")
        if p.position > prompt_len:
            raise InvalidRequestError(
                f"cache point at token {p.position} is past the prompt ({prompt_len} tokens)")
        out.append(p)
    return tuple(out)


def cached_chain(bm: Any, req: Any, ids: list[int]) -> list[bytes]:
    """The chain hashes of ``ids``' cached full blocks in ``req``'s namespace (a pure read)."""
    bs = bm.block_size
    return bm.tree.match_hashes(token_bytes(ids), req.namespace.seed, len(ids) // bs)


def prefilled(bm: Any, req: Any) -> list[tuple[list[bytes], float | None]]:
    """``req``'s prompt is computed: count the tokens it wrote to the cache, give the blocks
    up to each of its cache points their hints (through the block manager, the tree's writer),
    and let unmarked blocks below a TTL'd prefix inherit it. Returns what the points ask to
    persist: ``(chain hashes, ttl)`` per ``persist`` point, for the engine's remote tier."""
    bs = bm.block_size
    nodes = cached_chain(bm, req, req.prompt_token_ids)
    req.cache_write_tokens = max(0, len(nodes) * bs - req.num_cached_tokens)
    keep = []
    for p in req.cache_points:
        k = min(p.position // bs, len(nodes))
        if k and (p.ttl is not None or p.priority is not None):
            bm.set_hints(nodes[:k], priority=p.priority, ttl=p.ttl)
        if k and p.persist:
            keep.append((nodes[:k], p.ttl))
    inherit_ttl(bm, nodes)
    return keep


def retain_remote(remote: Any, hashes: Any, ttl: float | None, now: bool = False) -> int:
    """Hand ``hashes`` (cached device blocks) to the engine's remote tier to keep for at least
    ``ttl`` after their last use (``RemoteTier.persist``): written after the step, or at once
    with ``now`` (an idle engine's caller, e.g. a pin). Returns how many it took: 0 without a
    remote tier, or with a read-only one."""
    if remote is None:
        return 0
    remote.persist(list(hashes), ttl)   # a read-only tier counts them as skipped
    if now:
        remote.flush_retained()
    return 0 if remote.write.name == "read_only" else len(hashes)


def inherit_ttl(bm: Any, nodes: list[bytes]) -> None:
    """Blocks cached below a prefix with a TTL get that TTL unless they have their own: a
    prefix cannot leave the cache before its descendants (prefix closure), so unmarked blocks
    under it would otherwise keep an expired prefix alive indefinitely."""
    tree = bm.tree
    if tree.next_expiry() is None:
        return   # no TTL hint anywhere: nothing to inherit
    ttl, groups = None, {}
    for n, hints in zip(nodes, tree.chain_hints(nodes)):
        own = hints.ttl
        if own is not None:
            ttl = own
        elif ttl is not None:
            groups.setdefault(ttl, []).append(n)
    for t, group in groups.items():
        bm.set_hints(group, ttl=t)


__all__ = ["cached_chain", "prefilled", "retain_remote", "inherit_ttl", "CachePoint",
           "parse_ttl", "check_points"]
