"""DiskStore across processes: restart persistence, SIGKILL mid-write, concurrent processes.

The restart test runs a fresh interpreter (the point is a second, unrelated process). The kill
and churn tests fork this process instead, to skip a 3-5 s torch import per child: the children
only do file I/O on tensors made before the fork.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from radixkv.storage.buffers import byte_view
from radixkv.storage.layout import KVLayout

CHILD = Path(__file__).with_name("disk_child.py")
sys.path.insert(0, str(CHILD.parent))
import disk_child  # noqa: E402  (block/hash definitions shared with the child)

# 256 KiB payload: large enough that a SIGKILL often lands inside a write
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32")


def test_second_process_rebuilds_index_and_reads_identical_bytes(tmp_path):
    """One process caches a conversation's prefix (a chain of blocks) and exits; a second one
    rebuilds the index from the files and gets byte-identical KV."""
    n = 10
    child = subprocess.run([sys.executable, str(CHILD), "write", str(tmp_path), str(n)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    written = [bytes.fromhex(line) for line in child.stdout.split()]
    assert written == [disk_child.block_hash(i) for i in range(n)]

    lay = disk_child.SMALL
    store = disk_child.open_store(str(tmp_path), lay)  # scans at construction
    assert len(store) == n and store.bytes_used == sum(e.num_bytes for e in store.entries())
    report = store.scan()
    # parents first: the chain comes back in prefix order, with its token ids
    assert [e.block_hash for e in report.entries] == written
    assert [e.parent_hash for e in report.entries] == [None, *written[:-1]]
    assert [e.token_ids for e in report.entries] == [disk_child.tokens_of(i, lay)
                                                     for i in range(n)]
    for i, h in enumerate(written):
        got = store.get(h)
        assert got is not None
        assert bytes(byte_view(got)) == bytes(byte_view(disk_child.block_of(i, lay)))
    assert store.stats().hits == n and store.stats().corrupt == 0


def _fork(fn) -> int:
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    return pid


def test_sigkill_mid_write_leaves_nothing_servable(tmp_path):
    """SIGKILL a writer at random moments (5 times); a fresh store serves only whole blocks with
    exactly the bytes their hash stands for, and removes the dead writers' temp files."""
    blocks = [torch.randn(BIG.block_shape) for _ in range(24)]
    hashes = [os.urandom(16) for _ in blocks]
    caught_tmp, rng = 0, random.Random(0)

    def writer() -> int:
        store = disk_child.open_store(str(tmp_path), BIG)
        i = 0
        while True:  # rewrite forever: every put is a fresh file written and renamed
            store.remove(hashes[i % 24])
            store.put(hashes[i % 24], None, range(16), blocks[i % 24])
            i += 1

    for _ in range(5):
        pid = _fork(writer)
        time.sleep(rng.uniform(0.05, 0.3))
        caught_tmp += len(list(tmp_path.rglob("*.tmp")))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    store = disk_child.open_store(str(tmp_path), BIG)
    assert len(store) >= 1
    assert not list(tmp_path.rglob("*.tmp")), "temp files of dead writers must be removed"
    for e in store.entries():
        assert torch.equal(store.get(e.block_hash), blocks[hashes.index(e.block_hash)])
    assert store.stats().corrupt == 0
    print(f"temp files present at kill time: {caught_tmp} of 5 kills")


def test_concurrent_processes_never_serve_wrong_bytes(tmp_path):
    """Three processes put/get/remove the same 16 blocks at once; every served block is right
    (exit code 3 = wrong bytes, 4 = a whole file judged corrupt)."""
    blocks = [torch.randn(disk_child.SMALL.block_shape) for _ in range(16)]
    hashes = [os.urandom(16) for _ in blocks]

    def churn(seed: int) -> int:
        store = disk_child.open_store(str(tmp_path), disk_child.SMALL)
        rng, served = random.Random(seed), 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            i, op = rng.randrange(16), rng.random()
            if op < 0.4:
                store.put(hashes[i], None, range(4), blocks[i])
            elif op < 0.9:
                got = store.get(hashes[i])
                if got is not None:
                    served += 1
                    if not torch.equal(got, blocks[i]):
                        return 3
            else:
                store.remove(hashes[i])
        return 4 if store.stats().corrupt else (0 if served > 20 else 5)

    pids = [_fork(lambda s=s: churn(s)) for s in range(3)]
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, os.WEXITSTATUS(status)
    store = disk_child.open_store(str(tmp_path), disk_child.SMALL)
    for e in store.entries():
        assert torch.equal(store.get(e.block_hash), blocks[hashes.index(e.block_hash)])
