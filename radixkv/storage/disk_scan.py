"""Index rebuild of the disk tier: ``DiskStore.scan`` walks the fan-out directories and reads
one header per file (see disk.py for the layout and the fault model).

Split out of disk.py: the scan is the only code that lists directories, judges file names and
removes the leftovers of dead writers; the per-block read/write paths never do.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import xxhash

from radixkv.storage.disk_format import (HASH_BYTES, BadBlockFile, BlockHeader, check_header,
                                         check_mac)
from radixkv.storage.integrity import BlockSigner
from radixkv.storage.layout import KVLayout

log = logging.getLogger("radixkv.storage.disk")

SUFFIX = ".kvb"
BLOCK_NAME = re.compile(r"[0-9a-f]{32}\.kvb\Z")


@dataclass(frozen=True)
class ScanTarget:
    """What a scan reads and calls of its :class:`radixkv.storage.disk.DiskStore`, handed over
    by ``DiskStore.scan`` (this module does not import disk.py, which imports it): where the
    files are, what a valid one looks like, and the store's handlers of a bad file
    (``bad_file``: count it, remove or quarantine it), of an I/O error (``fail``) and of a header
    (``decode``)."""

    dir: Path
    layout: KVLayout
    namespace: bytes
    signer: BlockSigner | None
    host_tag: str        # this host's tag in temporary file names (a dead writer's are removed)
    header_len: int      # bytes of a header of this layout (read per file)
    threads: int
    stale_tmp_s: float
    decode: Callable[[int, bytes | bytearray], BlockHeader]
    bad_file: Callable[[Path, BadBlockFile, os.stat_result | None], None]
    fail: Callable[[str, OSError], None]


class DiskEntry(NamedTuple):
    """What the tree needs to re-insert a block found on disk (``num_bytes``: file size).
    A NamedTuple rather than a dataclass: a rebuild makes 10^5 of them."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    num_bytes: int


@dataclass(frozen=True)
class ScanReport:
    """Result of ``DiskStore.scan``: valid entries, parents before children, and what was skipped.

    ``entries`` is in topological order: an entry whose parent is also on disk comes after it;
    entries whose parent is not on disk come first (the tree decides whether they are roots).
    """

    entries: tuple[DiskEntry, ...]
    corrupt: int        # removed / quarantined
    foreign: int        # skipped, left in place
    stale_tmp: int      # leftovers of killed writers, removed
    seconds: float
    forged: int = 0     # signed store, deep scan: MAC mismatch, removed

    @property
    def num_bytes(self) -> int:
        """Bytes of the valid files."""
        return sum(e.num_bytes for e in self.entries)


#: Flags every block-file read uses. O_NONBLOCK: opening a FIFO (or a device) that sits under a
#: block-file name must not wait for a writer; it is judged by its type right after the open.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


def open_block_file(path: str) -> tuple[int, os.stat_result]:
    """Open a block file for reading without ever blocking; returns ``(fd, fstat)``.

    Raises ``FileNotFoundError`` (absent), another ``OSError`` (unreadable) or
    ``BadBlockFile("foreign")`` for anything but a regular file (FIFO, socket, device,
    directory): it is not ours, so it is skipped and left in place, never read."""
    fd = os.open(path, READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadBlockFile("foreign", f"not a regular file (mode {stat.filemode(st.st_mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def scan_store(store: ScanTarget, verify_payload: bool
               ) -> tuple[ScanReport, list[DiskEntry]]:
    """Read the store's files (``DiskStore.scan`` documents the contract): the report and every
    valid entry found (the store's new index)."""
    t0 = time.perf_counter()
    try:
        subdirs = [store.dir / n for n in os.listdir(store.dir) if len(n) == 2]
    except FileNotFoundError:
        subdirs = []
    tally: dict[str, int] = defaultdict(int)
    with ThreadPoolExecutor(max(1, store.threads)) as pool:
        parts = list(pool.map(lambda d: _scan_dir(store, d, verify_payload), subdirs))
    found: list[DiskEntry] = []
    for entries, counts in parts:
        found.extend(entries)
        for k, v in counts.items():
            tally[k] += v
    return ScanReport(_parents_first(found), tally["corrupt"], tally["foreign"],
                      tally["stale_tmp"], time.perf_counter() - t0, tally["forged"]), found


def _scan_dir(store: ScanTarget, d: Path, verify_payload: bool
              ) -> tuple[list[DiskEntry], dict[str, int]]:
    """Entries of one fan-out directory. The hot loop works on str paths: at 10^5 files,
    pathlib objects alone would cost about a second."""
    entries: list[DiskEntry] = []
    counts: dict[str, int] = defaultdict(int)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return entries, counts
    except NotADirectoryError:   # a file or FIFO with a 2-character name: not ours
        counts["foreign"] += 1
        return entries, counts
    prefix = f"{d}{os.sep}"
    for name in names:
        if not BLOCK_NAME.match(name):
            if name.endswith(".tmp"):
                counts["stale_tmp"] += _maybe_drop_tmp(store, d / name)
            elif name.endswith(SUFFIX):
                store.bad_file(d / name, BadBlockFile("corrupt", "not a block file name"), None)
                counts["corrupt"] += 1
            continue
        try:
            entry = _read_entry(store, prefix + name, name, verify_payload)
        except BadBlockFile as bad:
            counts[bad.kind] += 1
            continue
        except OSError as e:
            store.fail("scan", e)
            continue
        if entry is not None:
            entries.append(entry)
    return entries, counts


def _read_entry(store: ScanTarget, path: str, name: str, verify_payload: bool
                ) -> DiskEntry | None:
    """Index entry of one file from its header (and payload checksum if asked)."""
    block_hash = bytes.fromhex(name[:2 * HASH_BYTES])
    try:
        fd, st = open_block_file(path)
    except FileNotFoundError:
        return None  # removed meanwhile
    except BadBlockFile as bad:
        store.bad_file(Path(path), bad, None)
        raise
    try:
        try:
            hdr = store.decode(fd, os.pread(fd, store.header_len, 0))
            check_header(hdr, store.namespace, store.layout, block_hash, st.st_size,
                         store.signer)
            if verify_payload:
                payload = os.pread(fd, hdr.payload_len, hdr.header_len)
                if xxhash.xxh3_64_intdigest(payload) != hdr.payload_checksum:
                    raise BadBlockFile("corrupt", "payload checksum mismatch")
                check_mac(hdr, payload, store.signer)
        except BadBlockFile as bad:
            store.bad_file(Path(path), bad, st)
            raise
    finally:
        os.close(fd)
    return DiskEntry(block_hash, hdr.parent_hash, hdr.token_ids, st.st_size)


def _maybe_drop_tmp(store: ScanTarget, path: Path) -> int:
    """Remove a temporary file whose writer is dead (same host) or that is stale."""
    try:
        _, _, writer = path.name.split(".")[:3]
        host, pid = writer.split("-")[:2]
        dead = host == store.host_tag and not _pid_alive(int(pid))
        if dead or time.time() - path.stat().st_mtime > store.stale_tmp_s:
            path.unlink()
            return 1
    except (ValueError, FileNotFoundError):
        pass
    except OSError as e:
        log.warning("could not remove stale temporary file %s: %s", path, e)
    return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parents_first(entries: list[DiskEntry]) -> tuple[DiskEntry, ...]:
    """Topological order: entries whose parent is absent first, then children breadth-first."""
    by_hash = {e.block_hash: e for e in entries}
    children: dict[bytes, list[DiskEntry]] = defaultdict(list)
    order: list[DiskEntry] = []
    for e in entries:
        if e.parent_hash is not None and e.parent_hash in by_hash and e.parent_hash != e.block_hash:
            children[e.parent_hash].append(e)
        else:
            order.append(e)
    i = 0
    while i < len(order):
        order.extend(children.pop(order[i].block_hash, ()))
        i += 1
    # entries on a parent cycle (impossible with chain hashes) are never reached: dropped
    return tuple(order)


__all__ = ["DiskEntry", "ScanReport", "scan_store", "open_block_file", "READ_FLAGS", "SUFFIX",
           "BLOCK_NAME"]
