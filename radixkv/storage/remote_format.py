"""Keys and values of the remote tier (format version 1); see docs/tiers.md, "Remote tier".

Key (ASCII)::

    <prefix>:1:<namespace hex (32)>[:k<signer key id hex>]:<block hash hex (32)>

The namespace is ``KVLayout.fingerprint(model, salt)``, the same 16 bytes that name a disk
tier's directory: model + KV layout + dtype + tenant salt. Replicas of one model and layout share
keys; another tenant, model or layout never reads them. A store with a signer adds its public key
id, so replicas holding different secrets (or none) never fight over one key. The ``1`` is the
format version: a future format writes other keys instead of overwriting these.

Value = ``header || payload || tag`` (integers little-endian)::

    offset size field
         0    8  magic  b"RDXKVRMT"
         8    2  format version (u16) = 1
        10    2  flags (u16): bit 0 = has parent hash, bit 1 = signed
        12    4  num_tokens (u32, T)
        16   16  namespace fingerprint
        32   16  block hash
        48   16  parent hash (zeros when bit 0 is clear)
        64    1  dtype code (layout.DTYPE_CODES)
        65    1  ndim = 5
        66    2  tag_len (u16; 0 unsigned)
        68   20  shape, 5 x u32
        88    8  payload_len (u64)
        96    8  payload checksum: xxh3_64 of the payload
       104    8  signer key id (zeros unsigned)
       112  4*T  token ids (u32 each)
    112+4T    8  header checksum: xxh3_64 of bytes [0, 112+4T)
    120+4T  ...  payload (payload_len bytes), then tag (tag_len bytes)

The tag, when a signer is configured, is ``signer.mac(header, payload)``: a keyed MAC over every
byte before it. The checksums catch accidents (bit rot, truncation); only the tag stops a writer
who recomputes them.

``decode_value`` classifies a value that must not be served (``BadValue.kind``):
  * ``"corrupt"``: bad magic, truncated or too long, a checksum or tag mismatch.
  * ``"stale"``: another format version under this version's key.
  * ``"foreign"``: well-formed but not this key's block: another namespace, layout, block hash or
    signer. Under our key it can only be a bug or tampering, so it is deleted like the others.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple, Protocol

import xxhash

from radixkv.storage.layout import DTYPE_CODES, KVLayout

MAGIC = b"RDXKVRMT"
FORMAT_VERSION = 1
HASH_BYTES = 16
KEY_ID_BYTES = 8
FLAG_HAS_PARENT = 1
FLAG_SIGNED = 2

_FIXED = struct.Struct("<8sHHI16s16s16sBBH5IQQ8s")
FIXED_LEN = _FIXED.size  # 112
_PREFIX = struct.Struct("<8sH")
_U64 = struct.Struct("<Q")
_ZERO_HASH = bytes(HASH_BYTES)
_ZERO_KEY_ID = bytes(KEY_ID_BYTES)
_CODE_DTYPES = {code: name for name, code in DTYPE_CODES.items()}


class Signer(Protocol):
    """A keyed MAC over a block record (``radixkv.storage.integrity.BlockSigner`` fits).

    ``key_id`` is a short public id of the key (never the key); ``mac(*parts)`` returns the tag
    of the concatenation of ``parts``; ``verify(tag, *parts)`` compares in constant time.
    """

    key_id: bytes

    def mac(self, *parts: bytes | bytearray | memoryview) -> bytes: ...

    def verify(self, tag: bytes, *parts: bytes | bytearray | memoryview) -> bool: ...


class BadValue(Exception):
    """A stored value that must not be served; ``kind`` is "corrupt", "stale" or "foreign"."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind, self.reason = kind, reason


class RemoteBlock(NamedTuple):
    """A verified block read from the remote tier. ``payload`` is a read-only view of exactly
    ``layout.bytes_per_block`` bytes (C order ``[L, 2, block_size, kv_heads, head_dim]``)."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    payload: memoryview


def key_prefix(prefix: str, namespace: bytes, signer: Signer | None) -> bytes:
    """The part of every key before the block hash (see the module docstring)."""
    kid = f":k{bytes(signer.key_id).hex()}" if signer is not None else ""
    return f"{prefix}:{FORMAT_VERSION}:{namespace.hex()}{kid}:".encode()


def header_len(num_tokens: int) -> int:
    """Bytes before the payload for a block of ``num_tokens`` token ids."""
    return FIXED_LEN + 4 * num_tokens + 8


@functools.lru_cache(maxsize=64)
def _tokens_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")


def encode_value(namespace: bytes, block_hash: bytes, parent_hash: bytes | None,
                 token_ids: tuple[int, ...], layout: KVLayout, payload: memoryview,
                 signer: Signer | None) -> bytes:
    """The whole value of one block (one copy of ``payload``; the caller's buffer may be reused
    as soon as this returns)."""
    flags = (FLAG_HAS_PARENT if parent_hash is not None else 0) | (FLAG_SIGNED if signer else 0)
    tag_len = len(signer.mac(b"")) if signer is not None else 0
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, flags, len(token_ids), namespace, block_hash,
                        parent_hash if parent_hash is not None else _ZERO_HASH,
                        DTYPE_CODES[layout.dtype], 5, tag_len, *layout.block_shape,
                        payload.nbytes, xxhash.xxh3_64_intdigest(payload),
                        bytes(signer.key_id) if signer is not None else _ZERO_KEY_ID)
    head = fixed + _tokens_struct(len(token_ids)).pack(*token_ids)
    head += _U64.pack(xxhash.xxh3_64_intdigest(head))
    if signer is None:
        return b"".join((head, payload))
    return b"".join((head, payload, signer.mac(head, payload)))


def decode_value(value: bytes, namespace: bytes, block_hash: bytes, layout: KVLayout,
                 signer: Signer | None) -> RemoteBlock:
    """Verify ``value`` as block ``block_hash`` of this namespace/layout/signer; raise
    ``BadValue`` otherwise. Checks, in order: magic, version, header checksum, lengths,
    namespace/hash/layout/signer, payload checksum, tag. Zero-copy: the payload is a view."""
    mv = memoryview(value)
    if len(mv) < _PREFIX.size:
        raise BadValue("corrupt", f"value of {len(mv)} bytes is shorter than a header prefix")
    magic, version = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadValue("corrupt", "bad magic (not a radixkv remote block)")
    if version != FORMAT_VERSION:
        raise BadValue("stale", f"format version {version}, this reader knows {FORMAT_VERSION}")
    if len(mv) < FIXED_LEN:
        raise BadValue("corrupt", f"header truncated at {len(mv)} bytes")
    (_, _, flags, n, ns, bh, parent, dcode, ndim, tag_len, *rest) = _FIXED.unpack_from(mv, 0)
    shape, (payload_len, payload_sum, key_id) = tuple(rest[:5]), rest[5:]
    hl = header_len(n)
    if len(mv) < hl:
        raise BadValue("corrupt", f"header of {hl} bytes truncated at {len(mv)}")
    (stored,) = _U64.unpack_from(mv, hl - 8)
    if stored != xxhash.xxh3_64_intdigest(mv[:hl - 8]):
        raise BadValue("corrupt", "header checksum mismatch")
    if len(mv) != hl + payload_len + tag_len:
        raise BadValue("corrupt", f"value has {len(mv)} bytes, header says "
                                  f"{hl + payload_len + tag_len}")
    if flags & ~(FLAG_HAS_PARENT | FLAG_SIGNED) or ndim != 5:
        raise BadValue("corrupt", f"unknown flags {flags:#x} or ndim {ndim} != 5")
    if ns != namespace or bh != block_hash:
        raise BadValue("foreign", f"value names block {bh.hex()[:12]}.. of namespace "
                                  f"{ns.hex()[:12]}.., not this key's")
    if _CODE_DTYPES.get(dcode) != layout.dtype or shape != layout.block_shape \
            or payload_len != layout.bytes_per_block:
        raise BadValue("foreign", f"layout {_CODE_DTYPES.get(dcode)}{list(shape)} is not "
                                  f"{layout.dtype}{list(layout.block_shape)}")
    want_kid = bytes(signer.key_id) if signer is not None else _ZERO_KEY_ID
    if bool(flags & FLAG_SIGNED) != (signer is not None) or key_id != want_kid:
        raise BadValue("foreign", "signed by another key (or signed/unsigned mismatch)")
    payload = mv[hl:hl + payload_len]
    if xxhash.xxh3_64_intdigest(payload) != payload_sum:
        raise BadValue("corrupt", "payload checksum mismatch")
    if signer is not None and not signer.verify(bytes(mv[hl + payload_len:]), mv[:hl], payload):
        raise BadValue("corrupt", "authentication tag mismatch (altered or forged)")
    return RemoteBlock(bh, parent if flags & FLAG_HAS_PARENT else None,
                       _tokens_struct(n).unpack_from(mv, FIXED_LEN), payload)


__all__ = ["MAGIC", "FORMAT_VERSION", "Signer", "BadValue", "RemoteBlock", "key_prefix",
           "header_len", "encode_value", "decode_value"]
