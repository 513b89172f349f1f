"""On-disk format of one KV block file (format versions 1 and 2); see docs/tiers.md.

A block file is ``header || payload``. The header is self-describing and checksummed on its own,
so an index rebuild reads one small prefix per file and never touches payloads; the payload is the
block's raw tensor bytes (``[L, 2, block_size, kv_heads, head_dim]``, C order, little-endian)
with its own checksum, verified on every read.

Header (all integers little-endian)::

    offset size field
         0    8  magic  b"RDXKVBLK"
         8    2  format version (u16) = 1
        10    2  header_len (u16): bytes before the payload, a multiple of 64
        12    4  flags (u32): bit 0 = has parent hash; other bits 0
        16   16  namespace fingerprint
        32   16  block hash
        48   16  parent hash (zeros when flag bit 0 is clear)
        64    4  num_tokens (u32)
        68    1  dtype code (u8, layout.DTYPE_CODES)
        69    1  ndim (u8) = 5
        70    2  zero
        72   20  shape, 5 x u32
        92    4  zero
        96    8  payload_len (u64, bytes)
       104    8  payload checksum: xxh3_64 of the payload (u64)
       112  8*T  token ids (i64 each, T = num_tokens)
    112+8T    8  header checksum: xxh3_64 of bytes [0, 112+8T) (u64)
    120+8T  ...  zero padding up to header_len

Version 2 is a *signed* block (``DiskStore(signer=...)``, see ``integrity.py``): the same fields,
flag bit 1 set, and after the token ids::

    112+8T    8  key id of the signer (public; tells "another key" from "forged")
    120+8T   32  MAC: HMAC-SHA256 of bytes [0, 120+8T) followed by the payload
    152+8T    8  header checksum: xxh3_64 of bytes [0, 152+8T) (u64)
    160+8T  ...  zero padding up to header_len

Unsigned stores keep writing version 1 (so older readers still read them) and read both
versions (checksums only); a signed store reads only version 2 files signed with its key.
Older readers see a version-2 file as foreign and leave it alone.

Classification of a file that fails to decode (``BadBlockFile.kind``):
  * ``"corrupt"``: not a radixkv block (bad magic, truncated, checksum mismatch, non-zero padding,
    stored hash differs from the file name, size differs from header_len + payload_len).
  * ``"foreign"``: a well-formed file this store must not serve but does not own either: another
    format version, another namespace, or another layout/dtype; in a signed store, an unsigned
    file or one signed with another key; anything that is not a regular file (FIFO, socket...).
  * ``"forged"``: signed with this store's key id but the MAC does not match (the header or the
    payload was altered and the checksums recomputed).
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

import xxhash

from radixkv.storage.integrity import KEY_ID_BYTES, MAC_BYTES, BlockSigner
from radixkv.storage.layout import DTYPE_CODES, KVLayout

MAGIC = b"RDXKVBLK"
FORMAT_VERSION = 1          # unsigned blocks
SIGNED_VERSION = 2          # blocks with a key id and a MAC
HASH_BYTES = 16
HEADER_ALIGN = 64
MAX_HEADER_LEN = 65535  # header_len is a u16
FLAG_HAS_PARENT = 1
FLAG_SIGNED = 2
_SIG_LEN = KEY_ID_BYTES + MAC_BYTES

_FIXED = struct.Struct("<8sHHI16s16s16sIBB2x5I4xQQ")
FIXED_LEN = _FIXED.size  # 112
_PREFIX = struct.Struct("<8sHH")  # magic, version, header_len: readable for any version
_U64 = struct.Struct("<Q")
_ZERO_HASH = bytes(HASH_BYTES)
_CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}


def header_len_for(num_tokens: int, signed: bool = False) -> int:
    """Bytes before the payload for a block of ``num_tokens`` tokens (multiple of 64)."""
    raw = FIXED_LEN + 8 * num_tokens + (_SIG_LEN if signed else 0) + 8
    return -(-raw // HEADER_ALIGN) * HEADER_ALIGN


class BadBlockFile(Exception):
    """A block file that must not be served; ``kind`` is "corrupt" or "foreign"."""

    def __init__(self, kind: str, reason: str) -> None:  # kind: corrupt, foreign or forged
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason


class BlockHeader(NamedTuple):
    """Decoded header of a block file. ``payload_len`` in bytes; ``shape`` = block_shape.
    (A NamedTuple: cheap to build 10^5 times during an index rebuild.)"""

    namespace: bytes
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    header_len: int
    payload_len: int
    payload_checksum: int
    key_id: bytes | None = None     # signed (version 2) blocks only
    mac: bytes | None = None
    signed_part: bytes = b""        # the header bytes the MAC covers (before the payload)

    @property
    def file_len(self) -> int:
        """Exact size in bytes of a well-formed file carrying this header."""
        return self.header_len + self.payload_len


def encode_header(namespace: bytes, block_hash: bytes, parent_hash: bytes | None,
                  token_ids: tuple[int, ...] | list[int], layout: KVLayout,
                  payload_checksum: int, signer: BlockSigner | None = None,
                  payload: bytes | memoryview | None = None) -> bytes:
    """The ``header_len`` header bytes of a block of ``layout`` (payload checksum given).
    With a ``signer``, a version-2 header whose MAC covers the header fields and ``payload``."""
    n = len(token_ids)
    signed = signer is not None
    flags = (FLAG_HAS_PARENT if parent_hash is not None else 0) | (FLAG_SIGNED if signed else 0)
    hlen = header_len_for(n, signed)
    fixed = _FIXED.pack(MAGIC, SIGNED_VERSION if signed else FORMAT_VERSION, hlen, flags,
                        namespace, block_hash,
                        parent_hash if parent_hash is not None else _ZERO_HASH, n,
                        DTYPE_CODES[layout.dtype], len(layout.block_shape), *layout.block_shape,
                        layout.bytes_per_block, payload_checksum)
    body = fixed + _tokens_struct(n).pack(*token_ids)
    if signer is not None:
        if payload is None:
            raise ValueError("a signed header needs the payload")
        body += signer.key_id
        body += signer.mac(body, payload)
    body += _U64.pack(xxhash.xxh3_64_intdigest(body))
    return body + bytes(hlen - len(body))


def peek_header_len(buf: bytes | bytearray | memoryview) -> int:
    """``header_len`` field of a version-1/2 file prefix (>= 12 bytes); raises BadBlockFile."""
    if len(buf) < _PREFIX.size:
        raise BadBlockFile("corrupt", f"file shorter than {_PREFIX.size} bytes")
    magic, version, header_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadBlockFile("corrupt", "bad magic (not a radixkv block file)")
    if version not in (FORMAT_VERSION, SIGNED_VERSION):
        raise BadBlockFile("foreign", f"format version {version}, this reader knows "
                                      f"{FORMAT_VERSION} and {SIGNED_VERSION}")
    return int(header_len)


def decode_header(buf: bytes | bytearray) -> BlockHeader:
    """Decode and verify a header (``buf`` holds at least ``header_len`` bytes).

    Checks magic, version, the header checksum and zero padding; not the namespace, layout or
    payload (see ``check_header``). Raises ``BadBlockFile``.
    """
    header_len = peek_header_len(buf)
    if len(buf) < FIXED_LEN:
        raise BadBlockFile("corrupt", f"header truncated at {len(buf)} bytes")
    (_, version, _, flags, namespace, block_hash, parent, n, dcode, ndim, *rest) = \
        _FIXED.unpack_from(buf, 0)
    shape, (payload_len, payload_sum) = tuple(rest[:5]), rest[5:]
    signed = version == SIGNED_VERSION
    if header_len != header_len_for(n, signed) or header_len > len(buf):
        raise BadBlockFile("corrupt", f"header_len {header_len} inconsistent with {n} tokens "
                                      f"or with the {len(buf)} bytes read")
    tok_end = FIXED_LEN + 8 * n
    end = tok_end + (_SIG_LEN if signed else 0)
    (stored,) = _U64.unpack_from(buf, end)
    if stored != xxhash.xxh3_64_intdigest(memoryview(buf)[:end]):
        raise BadBlockFile("corrupt", "header checksum mismatch")
    known = FLAG_HAS_PARENT | (FLAG_SIGNED if signed else 0)
    if buf.count(0, end + 8, header_len) != header_len - end - 8 \
            or flags & ~known or ndim != 5 or signed != bool(flags & FLAG_SIGNED):
        raise BadBlockFile("corrupt", "non-zero padding, unknown flags or ndim != 5")
    if dcode not in _CODE_DTYPES:
        raise BadBlockFile("foreign", f"unknown dtype code {dcode}")
    key_id = mac = None
    signed_part = b""
    if signed:
        key_id = bytes(buf[tok_end:tok_end + KEY_ID_BYTES])
        mac = bytes(buf[tok_end + KEY_ID_BYTES:end])
        signed_part = bytes(buf[:tok_end + KEY_ID_BYTES])
    return BlockHeader(namespace, block_hash, parent if flags & FLAG_HAS_PARENT else None,
                       _tokens_struct(n).unpack_from(buf, FIXED_LEN), _CODE_DTYPES[dcode],
                       shape, header_len, payload_len, payload_sum, key_id, mac, signed_part)


@functools.lru_cache(maxsize=64)
def _tokens_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def check_header(hdr: BlockHeader, namespace: bytes, layout: KVLayout,
                 expected_hash: bytes | None, file_len: int,
                 signer: BlockSigner | None = None) -> None:
    """Raise ``BadBlockFile`` unless the header belongs to this store and matches the file.
    With a ``signer`` the block must be signed with its key (the MAC itself needs the payload:
    :func:`check_mac`)."""
    if signer is not None and hdr.key_id != signer.key_id:
        raise BadBlockFile("foreign", "unsigned block in a signed store" if hdr.key_id is None
                           else f"signed with another key ({hdr.key_id.hex()})")
    if hdr.namespace != namespace:
        raise BadBlockFile("foreign", f"namespace {hdr.namespace.hex()[:12]}.. is not "
                                      f"{namespace.hex()[:12]}..")
    if hdr.dtype != layout.dtype or hdr.shape != layout.block_shape \
            or hdr.payload_len != layout.bytes_per_block:
        raise BadBlockFile("foreign", f"layout {hdr.dtype}{list(hdr.shape)} is not "
                                      f"{layout.dtype}{list(layout.block_shape)}")
    if expected_hash is not None and hdr.block_hash != expected_hash:
        raise BadBlockFile("corrupt", "block hash in header differs from the file name")
    if file_len != hdr.file_len:
        raise BadBlockFile("corrupt", f"file has {file_len} bytes, header says {hdr.file_len}")


def check_mac(hdr: BlockHeader, payload: bytes | memoryview, signer: BlockSigner | None) -> None:
    """With a ``signer``: raise ``BadBlockFile("forged")`` unless the header's MAC matches its
    fields and ``payload`` (call after :func:`check_header`)."""
    if signer is not None and (hdr.mac is None
                               or not signer.verify(hdr.mac, hdr.signed_part, payload)):
        raise BadBlockFile("forged", "MAC mismatch: header or payload altered")


__all__ = ["MAGIC", "FORMAT_VERSION", "SIGNED_VERSION", "HASH_BYTES", "check_mac",
           "BlockHeader", "BadBlockFile",
           "encode_header", "decode_header", "check_header", "header_len_for", "peek_header_len"]
