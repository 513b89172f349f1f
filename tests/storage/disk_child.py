"""Child process of the restart test (run as a script, not collected by pytest).

    python disk_child.py write ROOT N      write a chain of N blocks, print their hashes, exit

Block i has hash ``block_hash(i)`` and content ``block_of(i, layout)``, so any process can tell
what the right bytes for a hash are.
"""

from __future__ import annotations

import sys

import torch
import xxhash

from radixkv.storage.disk import DiskStore
from radixkv.storage.layout import KVLayout

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
MODEL = "test-model@rev0"


def block_hash(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"block-{i}".encode())


def tokens_of(i: int, layout: KVLayout) -> tuple[int, ...]:
    return tuple(range(i * layout.block_size, (i + 1) * layout.block_size))


def block_of(i: int, layout: KVLayout) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(layout.block_shape, generator=g).to(getattr(torch, layout.dtype))


def open_store(root: str, layout: KVLayout) -> DiskStore:
    return DiskStore(root, layout, layout.fingerprint(MODEL))


def main(argv: list[str]) -> int:
    mode, root = argv[0], argv[1]
    if mode != "write":
        return 2
    store = open_store(root, SMALL)
    for i in range(int(argv[2])):
        parent = block_hash(i - 1) if i else None
        assert store.put(block_hash(i), parent, tokens_of(i, SMALL), block_of(i, SMALL))
        print(block_hash(i).hex(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
