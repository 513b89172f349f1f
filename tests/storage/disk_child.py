"""Child process for the multi-process disk tests (run as a script, not collected by pytest).

    python disk_child.py write ROOT N            write a chain of N blocks, print their hashes
    python disk_child.py loop ROOT               write blocks 0,1,2... forever (to be SIGKILLed)
    python disk_child.py churn ROOT SECONDS ID   random put/get/remove on 16 shared hashes,
                                                 exit 3 if a get ever returns wrong bytes

Block i has hash ``block_hash(i)`` and content ``block_of(i, layout)``, so any process can tell
what the right bytes for a hash are.
"""

from __future__ import annotations

import random
import sys
import time

import torch
import xxhash

from radixkv.storage.disk import DiskStore
from radixkv.storage.layout import KVLayout

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
# 256 KiB payload: large enough that a SIGKILL often lands inside a write
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32")
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
    if mode == "write":
        store = open_store(root, SMALL)
        for i in range(int(argv[2])):
            parent = block_hash(i - 1) if i else None
            assert store.put(block_hash(i), parent, tokens_of(i, SMALL), block_of(i, SMALL))
            print(block_hash(i).hex(), flush=True)
        return 0
    if mode == "loop":
        store = open_store(root, BIG)
        i = 0
        while True:
            store.put(block_hash(i), None, tokens_of(i, BIG), block_of(i, BIG))
            i += 1
            if i == 5:
                print("started", flush=True)
    if mode == "churn":
        store = open_store(root, SMALL)
        rng = random.Random(int(argv[3]))
        expected = {block_hash(i): block_of(i, SMALL) for i in range(16)}
        deadline = time.monotonic() + float(argv[2])
        served = 0
        while time.monotonic() < deadline:
            i = rng.randrange(16)
            op = rng.random()
            if op < 0.4:
                store.put(block_hash(i), None, tokens_of(i, SMALL), expected[block_hash(i)])
            elif op < 0.9:
                got = store.get(block_hash(i))
                if got is not None:
                    served += 1
                    if not torch.equal(got, expected[block_hash(i)]):
                        print(f"WRONG BYTES for block {i}", flush=True)
                        return 3
            else:
                store.remove(block_hash(i))
        s = store.stats()
        print(f"served={served} corrupt={s.corrupt} put_failures={s.put_failures}", flush=True)
        return 0 if s.corrupt == 0 else 4
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
