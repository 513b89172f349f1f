"""The disk tier: one checksummed file per KV block under ``<root>/<namespace hex>/``.

Layout on disk::

    <root>/<namespace hex (32)>/<hash hex[:2]>/<hash hex (32)>.kvb     a block (disk_format.py)
    <root>/<namespace hex>/<xx>/.<hash hex>.<host>-<pid>-<n>.tmp       a write in progress
    <root>/<namespace hex>/quarantine/                                 corrupt files (optional)

Why one file per block (not slabs): a block is 0.1-2 MB for real models, so the per-file cost
(open, rename, unlink) is small next to the payload; a file is the unit the kernel makes atomic
(``os.replace``) and removable without compaction; concurrent writers in other processes need
no shared allocator or lock. docs/tiers.md has the numbers.

Fault model (what each failure becomes):
  * a write that fails (ENOSPC, EIO, EDQUOT...) -> ``put`` returns False, a rate-limited warning,
    ``stats().put_failures`` + 1; the temporary file is unlinked, nothing becomes visible.
  * a process killed mid-write -> only a dot-named ``.tmp`` file remains; it is never read and
    ``scan`` removes it once its writer is dead (same host) or it is older than ``stale_tmp_s``.
  * a corrupt file (garbage, truncated, flipped bytes, wrong name) -> ``get`` returns None
    (a miss), ``stats().corrupt`` + 1, the file is removed (or moved to ``quarantine/``).
  * a non-regular file under a block name (FIFO, socket, device, directory) -> foreign: files
    are opened non-blocking and their type checked before any read, so a FIFO never hangs a
    scan or a read.
  * with a ``signer`` (authenticated store): a block whose MAC does not match (payload or header
    swapped and checksums recomputed) -> a miss, ``stats().forged`` + 1, removed like a corrupt
    file; an unsigned block or one signed with another key -> foreign (never served).
  * a foreign file (other format version / namespace / layout) -> a miss, ``stats().foreign``
    + 1, left in place: another version or model may own it.

Concurrency: every file becomes visible only by an atomic rename of a complete file, so a reader
(thread or process) sees either no file or a whole one; an unlink or replace under a reader
leaves its open descriptor on the old, whole inode. The in-memory index is per process and may
lag other processes: ``get`` always asks the file system, ``contains`` only the index.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import xxhash

from radixkv.errors import ConfigError, InvalidBlockError, StorageError
from radixkv.storage.backend import (BlockWrite, Pins, PutResult, StorageBackend, block_view,
                                     check_hash, check_outs)
from radixkv.storage.buffers import byte_view, check_blocks, torch_dtype
from radixkv.storage.disk_format import (HASH_BYTES, MAX_HEADER_LEN, BadBlockFile, BlockHeader,
                                         check_header, check_mac, decode_header, encode_header,
                                         header_len_for)
from radixkv.storage.integrity import BlockSigner
from radixkv.storage.disk_scan import (BLOCK_NAME, SUFFIX, DiskEntry, ScanReport, ScanTarget,
                                       open_block_file, scan_store)
from radixkv.storage.layout import KVLayout

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger(__name__)

_FSYNC_MODES = {False: "none", None: "none", "none": "none", "data": "data", True: "all",
                "all": "all"}
_WARN_EVERY_S = 10.0


@dataclass
class DiskStats:
    """Counters of one DiskStore (a snapshot copy is returned by ``stats()``). Bytes are file
    bytes (header + payload)."""

    puts: int = 0
    put_failures: int = 0
    put_existing: int = 0       # put of a hash already on disk: skipped
    gets: int = 0
    hits: int = 0
    misses: int = 0             # absent files
    corrupt: int = 0
    foreign: int = 0
    forged: int = 0             # signed store: MAC mismatch (tampered), never served
    read_errors: int = 0        # EIO and friends on read
    removed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    failures_by_errno: dict[str, int] = field(default_factory=dict)


class DiskStore:
    """Block files of one namespace under ``root``; thread- and process-safe.

    Args:
        root: directory (created if missing); may be shared by several namespaces and processes.
        layout: block geometry; files of another layout are foreign.
        namespace: 16-byte fingerprint (``KVLayout.fingerprint``); other namespaces' files are
            never served.
        fsync: ``False``/"none" (default; a crash may lose recent blocks, and a torn file is
            caught by its checksum), "data" (fdatasync each file before the rename: blocks
            survive power loss once visible) or ``True``/"all" ("data" + fsync of the directory
            after the rename: a put that returned True survives power loss).
        on_corrupt: "remove" (default) or "quarantine" (move to ``<ns dir>/quarantine/``).
        scan: rebuild the index at construction (``scan()``); else start empty.
        scan_threads: threads reading headers during a scan.
        stale_tmp_s: age after which a temporary file of a live or unknown writer is removed.
        signer: a :class:`~radixkv.storage.integrity.BlockSigner` makes the store
            authenticated: blocks are written signed (format version 2) and a block is served
            only if its MAC, over header and payload, verifies under this key.
    """

    def __init__(self, root: str | os.PathLike[str], layout: KVLayout, namespace: bytes,
                 fsync: bool | str = False, on_corrupt: str = "remove", scan: bool = True,
                 scan_threads: int = 4, stale_tmp_s: float = 600.0,
                 signer: BlockSigner | None = None) -> None:
        if not isinstance(namespace, bytes) or len(namespace) != HASH_BYTES:
            raise ConfigError(f"namespace must be {HASH_BYTES} bytes, got {namespace!r}")
        if fsync not in _FSYNC_MODES:
            raise ConfigError(f"fsync must be False, 'data' or True/'all', got {fsync!r}")
        if on_corrupt not in ("remove", "quarantine"):
            raise ConfigError(f"on_corrupt must be 'remove' or 'quarantine', got {on_corrupt!r}")
        if signer is not None and not isinstance(signer, BlockSigner):
            raise ConfigError(f"signer must be a BlockSigner or None, got {type(signer).__name__}")
        self.signer = signer
        if header_len_for(layout.block_size, signer is not None) > MAX_HEADER_LEN:
            raise ConfigError(f"block_size {layout.block_size} too large for the disk header")
        self.layout, self.namespace = layout, namespace
        self.fsync = _FSYNC_MODES[fsync]
        self.on_corrupt, self.scan_threads, self.stale_tmp_s = on_corrupt, scan_threads, stale_tmp_s
        self.root = Path(root)
        self.dir = self.root / namespace.hex()
        self._dir_s = f"{self.dir}{os.sep}"  # the hot paths build str paths: pathlib costs ~10 us
        self._header_len = header_len_for(layout.block_size, signer is not None)
        self._file_len = self._header_len + layout.bytes_per_block
        self._lock = threading.Lock()
        self._index: dict[bytes, DiskEntry] = {}
        self._bytes_used = 0
        self._stats = DiskStats()
        self._last_warn: dict[str, float] = {}
        self._seq = count()
        self._pins: Pins[bytes] = Pins()
        self._host = f"{xxhash.xxh32_intdigest(socket.gethostname().encode()):08x}"
        try:  # the 256 fan-out subdirectories are created on first use
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create the disk tier directory {self.dir}: {e}") from e
        if scan:
            self.scan()

    # ---- paths -----------------------------------------------------------------------------
    def path_of(self, block_hash: bytes) -> Path:
        """File path of a block (exists only if the block is on disk)."""
        return Path(self._path_str(block_hash.hex()))

    def _path_str(self, h: str) -> str:
        return f"{self._dir_s}{h[:2]}{os.sep}{h}{SUFFIX}"

    def _payload_view(self, block: torch.Tensor | Buffer, what: str) -> memoryview:
        """Flat byte view of one block: a tensor ``[L, 2, block_size, h, d]`` of the layout
        dtype (any device: copied to the CPU when needed), or a bytes-like object of exactly
        ``bytes_per_block`` bytes (the transfer engine passes slices of a pool's byte view, so
        no per-block tensor->bytes conversion is made)."""
        if isinstance(block, torch.Tensor):
            check_blocks(block, self.layout, None, what)
            if block.device.type != "cpu" or not block.is_contiguous():
                block = block.detach().to("cpu").contiguous()
            return byte_view(block)
        return block_view(block, self.layout.bytes_per_block, what)

    def _check_hash(self, block_hash: object, what: str = "block_hash") -> None:
        check_hash(block_hash, what)

    # ---- write -----------------------------------------------------------------------------
    def put(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Iterable[int],
            block: torch.Tensor | Buffer) -> bool:
        """Store one block ``[L, 2, block_size, h, d]`` (layout dtype, any device; or its
        ``bytes_per_block`` raw bytes as a bytes-like object) atomically.

        Returns True once the file is in place (or already was), False when the write failed
        (disk full, I/O error): the failure is counted and warned about, nothing is left visible.
        Raises ``InvalidBlockError`` for a wrong hash length or tensor shape/dtype (caller bugs).
        """
        tokens, payload = self._check_put(block_hash, parent_hash, token_ids, block,
                                          "DiskStore.put")
        return self._put_checked(block_hash, parent_hash, tokens, payload)

    def _check_put(self, block_hash: object, parent_hash: object, token_ids: Iterable[int],
                   block: torch.Tensor | Buffer, what: str
                   ) -> tuple[tuple[int, ...], memoryview]:
        """Validate one block to write (raises ``InvalidBlockError``, writes nothing): its
        token ids as a tuple and its payload as a byte view."""
        self._check_hash(block_hash)
        if parent_hash is not None:
            self._check_hash(parent_hash, "parent_hash")
        tokens = tuple(int(t) for t in token_ids)
        if any(not -2**63 <= t < 2**63 for t in tokens):
            raise InvalidBlockError(f"{what}: token ids must fit in int64")
        if header_len_for(len(tokens), self.signer is not None) > MAX_HEADER_LEN:
            raise InvalidBlockError(f"{len(tokens)} token ids do not fit in a block header")
        return tokens, self._payload_view(block, what)

    def _put_checked(self, block_hash: bytes, parent_hash: bytes | None,
                     tokens: tuple[int, ...], payload: memoryview) -> bool:
        h = block_hash.hex()
        path = self._path_str(h)
        if self.contains(block_hash) and os.path.exists(path):  # content-addressed: same bytes
            with self._lock:
                self._stats.put_existing += 1
                self._remember(DiskEntry(block_hash, parent_hash, tokens, self._file_len))
            return True
        header = encode_header(self.namespace, block_hash, parent_hash, tokens, self.layout,
                               xxhash.xxh3_64_intdigest(payload), self.signer, payload)
        tmp = f"{self._dir_s}{h[:2]}{os.sep}.{h}.{self._host}-{os.getpid()}-{next(self._seq)}.tmp"
        try:
            self._write_file(tmp, path, header, payload)
        except OSError as e:
            self._drop_tmp(tmp)
            self._fail("put", e)
            return False
        nbytes = len(header) + payload.nbytes
        with self._lock:
            self._stats.puts += 1
            self._stats.bytes_written += nbytes
            self._remember(DiskEntry(block_hash, parent_hash, tokens, nbytes))
        return True

    def _write_file(self, tmp: str, path: str, header: bytes, payload: memoryview) -> None:
        """Write ``header || payload`` to ``tmp``, sync it as ``fsync`` asks, rename it to
        ``path``. The fan-out subdirectory is created on the first ENOENT only."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # first block of this fan-out subdirectory
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            for buf in (memoryview(header), payload):
                while buf:  # os.write may write less than asked
                    buf = buf[os.write(fd, buf):]
            if self.fsync != "none":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if self.fsync == "all":
            dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def _drop_tmp(self, tmp: str) -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as e:  # left as a hidden .tmp; the next scan removes it
            log.warning("could not remove temporary file %s: %s", tmp, e)

    def _fail(self, op: str, e: OSError) -> None:
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        now = time.monotonic()
        with self._lock:
            if op == "put":
                self._stats.put_failures += 1
            else:
                self._stats.read_errors += 1
            by = self._stats.failures_by_errno
            by[name] = by.get(name, 0) + 1
            warn = now - self._last_warn.get(name, -_WARN_EVERY_S) >= _WARN_EVERY_S
            if warn:
                self._last_warn[name] = now
        if warn:
            log.warning("disk tier %s failed (%s: %s) in %s; degrading to a miss "
                        "(further %s warnings muted for %.0f s)", op, name, e.strerror,
                        self.dir, name, _WARN_EVERY_S)

    def _remember(self, entry: DiskEntry) -> None:  # caller holds the lock
        old = self._index.get(entry.block_hash)
        self._bytes_used += entry.num_bytes - (old.num_bytes if old else 0)
        self._index[entry.block_hash] = entry

    def _forget(self, block_hash: bytes) -> None:  # caller holds the lock
        old = self._index.pop(block_hash, None)
        if old is not None:
            self._bytes_used -= old.num_bytes

    # ---- read ------------------------------------------------------------------------------
    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The block ``[L, 2, block_size, h, d]`` (CPU, layout dtype), or None on a miss
        (absent, corrupt, foreign or unreadable: never wrong bytes)."""
        out = torch.empty(self.layout.block_shape, dtype=torch_dtype(self.layout.dtype))
        return out if self.read_into(block_hash, out) else None

    def read_into(self, block_hash: bytes, out: torch.Tensor | Buffer) -> bool:
        """Read one block into ``out`` (contiguous CPU ``[L, 2, block_size, h, d]``, e.g. a host
        slot, or a writable bytes-like object of ``bytes_per_block`` bytes). True when ``out``
        now holds the verified block (header and payload checksums checked); on False ``out``
        may hold garbage and must not be used. One ``preadv`` syscall for header + payload."""
        self._check_hash(block_hash)
        if isinstance(out, torch.Tensor):
            check_blocks(out, self.layout, None, "DiskStore.read_into(out=)")
            dst = byte_view(out)
        else:
            dst = block_view(out, self.layout.bytes_per_block, "DiskStore.read_into(out=)",
                             writable=True)
        path = self._path_str(block_hash.hex())
        try:
            fd, st = open_block_file(path)
        except FileNotFoundError:
            with self._lock:
                self._stats.gets += 1
                self._stats.misses += 1
                self._forget(block_hash)
            return False
        except BadBlockFile as bad:   # a FIFO, socket, device or directory: not ours
            self._count_get()
            self._bad_file(Path(path), bad, None)
            return False
        except OSError as e:
            self._count_get()
            self._fail("get", e)
            return False
        try:
            head = bytearray(self._header_len)
            got = os.preadv(fd, [head, dst], 0)
            if got != self._file_len and got >= self._header_len:
                got += _read_rest(fd, dst, got - self._header_len, self._header_len)
            hdr = self._decode(fd, head)
            check_header(hdr, self.namespace, self.layout, block_hash, st.st_size, self.signer)
            if hdr.header_len != self._header_len:  # fewer tokens than block_size: re-read
                got = hdr.header_len + _read_rest(fd, dst, 0, hdr.header_len)
            if got != st.st_size:
                raise BadBlockFile("corrupt", f"read {got} of {st.st_size} bytes")
            if xxhash.xxh3_64_intdigest(dst) != hdr.payload_checksum:  # dst is cache-hot here
                raise BadBlockFile("corrupt", "payload checksum mismatch")
            check_mac(hdr, dst, self.signer)
        except BadBlockFile as bad:
            self._count_get()
            self._bad_file(Path(path), bad, st)
            return False
        except OSError as e:
            self._count_get()
            self._fail("get", e)
            return False
        finally:
            os.close(fd)
        with self._lock:  # one lock round trip per successful read
            s = self._stats
            s.gets += 1
            s.hits += 1
            s.bytes_read += st.st_size
            if block_hash not in self._index:
                self._remember(DiskEntry(block_hash, hdr.parent_hash, hdr.token_ids, st.st_size))
        return True

    def _count_get(self) -> None:
        with self._lock:
            self._stats.gets += 1

    def _decode(self, fd: int, head: bytes | bytearray) -> BlockHeader:
        """Decode a header; a file whose header is longer than ours (another block size) is
        re-read with its own length so that it is classified foreign, not corrupt."""
        try:
            return decode_header(head)
        except BadBlockFile as bad:
            if bad.kind != "corrupt" or len(head) < 12:
                raise
            want = int.from_bytes(head[10:12], "little")
            if head[:8] != b"RDXKVBLK" or want <= len(head):
                raise
            return decode_header(os.pread(fd, want, 0))

    def _bad_file(self, path: Path, bad: BadBlockFile, st: os.stat_result | None) -> None:
        """Count a bad file; remove/quarantine it if corrupt and still the same inode."""
        with self._lock:
            if bad.kind == "foreign":
                self._stats.foreign += 1
            elif bad.kind == "forged":
                self._stats.forged += 1
            else:
                self._stats.corrupt += 1
            if _is_hex_name(path):
                self._forget(bytes.fromhex(path.stem))
        log.info("skipping %s block file %s: %s", bad.kind, path, bad.reason)
        if bad.kind == "foreign":
            return   # not ours: left in place (forged and corrupt files are removed)
        try:
            now = os.stat(path)
            if st is not None and (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                return  # replaced by a writer meanwhile: the new file is not ours to judge
            if self.on_corrupt == "quarantine":
                qdir = self.dir / "quarantine"
                qdir.mkdir(exist_ok=True)
                os.replace(path, qdir / f"{path.name}.{time.time_ns()}")
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove corrupt block file %s: %s", path, e)

    # ---- index -----------------------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        """Whether this process's index lists the block. O(1). A listed block may still miss
        (removed by another process, corrupted); an unlisted one may exist (written by another
        process since the last scan)."""
        with self._lock:
            return block_hash in self._index

    __contains__ = contains

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes_used(self) -> int:
        """Bytes of the block files in the index (headers included)."""
        with self._lock:
            return self._bytes_used

    def entries(self) -> list[DiskEntry]:
        """Snapshot of the index (any order)."""
        with self._lock:
            return list(self._index.values())

    def remove(self, block_hash: bytes) -> bool:
        """Delete a block's file; True if a file was removed. A pinned block (:meth:`pin`) is
        kept (False). I/O errors are warned, not raised."""
        self._check_hash(block_hash)
        if self._pins.pinned(block_hash):
            return False
        with self._lock:
            self._forget(block_hash)
        try:
            self.path_of(block_hash).unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            self._fail("remove", e)
            return False
        with self._lock:
            self._stats.removed += 1
        return True

    # ---- the StorageBackend interface (radixkv/storage/backend.py) -------------------------
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Per hash, whether this process's index lists the block (see :meth:`contains`)."""
        for h in keys:
            self._check_hash(h)
        with self._lock:
            return [h in self._index for h in keys]

    def read_into_many(self, keys: Sequence[bytes], outs: Sequence[Buffer]) -> list[bool]:
        """:meth:`read_into` per block, after validating every hash and buffer (a bad one
        raises ``InvalidBlockError`` and reads nothing)."""
        for h in keys:
            self._check_hash(h)
        views = check_outs(keys, outs, self.layout.bytes_per_block,
                           "DiskStore.read_into_many(outs=)")
        return [self.read_into(h, v) for h, v in zip(keys, views)]

    def put_many(self, blocks: Sequence[BlockWrite[bytes]]) -> PutResult:
        """:meth:`put` per block, after validating all of them (a malformed one raises
        ``InvalidBlockError`` and writes nothing). Failed writes (disk full, I/O error) are
        False, counted in ``stats().put_failures``."""
        checked = [(b[0], b[1], *self._check_put(b[0], b[1], b[2], b[3], "DiskStore.put_many"))
                   for b in blocks]
        return PutResult(self._put_checked(h, p, t, v) for h, p, t, v in checked)

    def pin(self, keys: Iterable[bytes]) -> None:
        """Keep these blocks from :meth:`remove` / :meth:`remove_many` (counted; per
        process: another process may still remove the file, which is then a miss)."""
        keys = list(keys)
        for h in keys:
            self._check_hash(h)
        self._pins.pin(keys)

    def unpin(self, keys: Iterable[bytes]) -> None:
        self._pins.unpin(keys)

    def remove_many(self, keys: Sequence[bytes]) -> int:
        """:meth:`remove` per block (pinned ones are kept); the number of files removed."""
        for h in keys:
            self._check_hash(h)
        return sum(self.remove(h) for h in keys)

    def close(self) -> None:
        """Nothing to release (no file stays open between calls); the files stay."""

    def check_invariants(self) -> None:
        """Raise AssertionError, with the numbers, if the index disagrees with itself."""
        with self._lock:
            total = sum(e.num_bytes for e in self._index.values())
            assert total == self._bytes_used, f"bytes_used {self._bytes_used} != {total} indexed"
            bad = [h for h, e in self._index.items() if e.block_hash != h]
            assert not bad, f"{len(bad)} index keys differ from their entries' hashes"

    def stats(self) -> DiskStats:
        """A snapshot of the counters."""
        with self._lock:
            s = DiskStats(**{k: v for k, v in vars(self._stats).items()})
            s.failures_by_errno = dict(self._stats.failures_by_errno)
            return s

    def scan(self, verify_payload: bool = False) -> ScanReport:
        """Rebuild the index from the files on disk; returns what was found.

        Reads only each file's header (one ``pread`` of header_len bytes), unless
        ``verify_payload`` (then every payload checksum too: as slow as reading the whole tier).
        Corrupt files are removed/quarantined, foreign ones counted and left, temporary files of
        dead writers removed. Runtime: O(files) syscalls, spread over ``scan_threads`` threads.
        """
        target = ScanTarget(self.dir, self.layout, self.namespace, self.signer, self._host,
                            self._header_len, self.scan_threads, self.stale_tmp_s,
                            self._decode, self._bad_file, self._fail)
        report, found = scan_store(target, verify_payload)
        with self._lock:   # the index becomes exactly what the scan found
            self._index = {e.block_hash: e for e in found}
            self._bytes_used = sum(e.num_bytes for e in found)
        return report


def _read_rest(fd: int, dst: memoryview, have: int, offset: int) -> int:
    """Continue a short ``preadv`` into ``dst[have:]`` until EOF or full; bytes added."""
    added = 0
    while have + added < len(dst):
        n = os.preadv(fd, [dst[have + added:]], offset + have + added)
        if n == 0:
            break
        added += n
    return added


def _is_hex_name(path: Path) -> bool:
    return BLOCK_NAME.match(path.name) is not None



if TYPE_CHECKING:   # the type checker proves that DiskStore implements the interface
    def _implements(store: DiskStore) -> StorageBackend[bytes]:
        return store

__all__ = ["DiskStore", "DiskEntry", "DiskStats", "ScanReport"]
