"""Remote-tier URLs -> a ``redis`` client: the one place that knows URL schemes and timeouts.

Schemes: ``redis://host:port/db`` and ``rediss://`` (TLS) as the ``redis`` client reads them,
``valkey://`` / ``valkeys://`` (Valkey speaks the same protocol: mapped to redis/rediss), and
``redis+cluster://`` / ``rediss+cluster://`` / ``valkey+cluster://`` for a Redis or Valkey Cluster
through the client's cluster mode (``cluster=True`` does the same for a plain URL). ``unix://``
sockets pass through.

Timeouts are always set and the client's own retries are off: the store does its own reconnect
with backoff, so one call waits at most about ``socket_timeout`` (plus ``connect_timeout`` when
it opens a connection), never a retry loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.errors import ConfigError

_SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss",
            "unix": "unix"}


@dataclass(frozen=True)
class RemoteURL:
    """A parsed remote-tier URL: the URL the ``redis`` client reads, and whether it is a
    cluster. ``display`` hides any password (for logs)."""

    url: str
    cluster: bool
    display: str


def parse_url(url: str, cluster: bool = False) -> RemoteURL:
    """Map a remote-tier URL to the ``redis`` client's.

    >>> parse_url("valkey://10.0.0.5:6379/2")
    RemoteURL(url='redis://10.0.0.5:6379/2', cluster=False, display='redis://10.0.0.5:6379/2')
    >>> parse_url("redis+cluster://:pw@node1:7000").cluster
    True
    >>> parse_url("redis+cluster://:pw@node1:7000").display
    'redis://***@node1:7000'
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"remote URL must look like redis://host:port/db, got {url!r}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme.endswith("+cluster"):
        scheme, cluster = scheme.removesuffix("+cluster"), True
    if scheme not in _SCHEMES:
        raise ConfigError(f"unknown remote URL scheme {scheme!r} in {url!r}; use redis://, "
                          "rediss://, valkey://, valkeys:// (+cluster) or unix://")
    mapped = f"{_SCHEMES[scheme]}://{rest}"
    host = rest.rsplit("@", 1)[-1]
    display = f"{_SCHEMES[scheme]}://{'***@' if '@' in rest else ''}{host}"
    return RemoteURL(mapped, cluster, display)


def make_client(remote: RemoteURL, socket_timeout: float, connect_timeout: float,
                max_connections: int) -> Any:
    """A ``redis.Redis`` (or ``redis.cluster.RedisCluster``) for ``remote``. A cluster client
    connects at construction (it reads the slot map), so it raises
    ``redis.exceptions.RedisError`` when no node answers; a plain client connects lazily."""
    import redis  # remote.py already checked that it is installed
    from redis.backoff import NoBackoff
    from redis.retry import Retry
    kw: dict[str, Any] = dict(socket_timeout=socket_timeout,
                              socket_connect_timeout=connect_timeout,
                              retry=Retry(NoBackoff(), 0), health_check_interval=0)
    if remote.cluster:
        from redis.cluster import RedisCluster
        return RedisCluster.from_url(remote.url, max_connections=max_connections, **kw)
    return redis.Redis.from_url(remote.url, max_connections=max_connections,
                                retry_on_timeout=False, **kw)


__all__ = ["RemoteURL", "parse_url", "make_client"]
