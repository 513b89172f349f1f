"""Fixtures of the storage tests: a tiny layout (fault tests use small tensors to stay fast)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from radixkv.storage.disk import DiskStore
from radixkv.storage.layout import KVLayout

# 2 layers x (K,V) x 4 tokens x 2 heads x 8 dims x 4 bytes = 1 KiB per block
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


@pytest.fixture
def layout() -> KVLayout:
    return SMALL


@pytest.fixture
def namespace(layout: KVLayout) -> bytes:
    return layout.fingerprint("test-model@rev0")


@pytest.fixture
def store(tmp_path, layout, namespace) -> DiskStore:
    return DiskStore(tmp_path / "kv", layout, namespace)


@pytest.fixture
def make_block(layout) -> Callable[[int], torch.Tensor]:
    """A deterministic random block ``[L, 2, bs, h, d]`` for a seed."""
    def make(seed: int, lay: KVLayout = layout) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(lay.block_shape, generator=g).to(getattr(torch, lay.dtype))
    return make


@pytest.fixture
def rand_hash() -> Callable[[], bytes]:
    return lambda: os.urandom(16)


# ---- the remote tier: real redis-server processes (tests/storage/redis_server.py) -----------
@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """One real redis-server per test module (tests flush it through ``redis_url``)."""
    from redis_server import RedisServer
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the module's server, emptied before the test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def make_redis(tmp_path):
    """Factory of extra servers (not started) for fault tests; all stopped at teardown."""
    from redis_server import RedisServer
    made: list = []

    def make(*args: str) -> RedisServer:
        made.append(RedisServer(tmp_path / f"redis{len(made)}", *args))
        return made[-1]
    yield make
    for s in made:
        s.stop()
