"""Content addressing of KV blocks: namespaces and chained xxh3-128 block hashes.

A block hash names the *content* of a full block of ``block_size`` tokens together with
everything before it::

    seed      = xxh3_128(b"radixkv-ns-v1" || len-prefixed(model, cache_salt, adapter_id, extra))
    h[-1]     = seed
    h[i]      = xxh3_128(h[i-1] || tokens[i*B:(i+1)*B] as little-endian int32 || extra_i)

so two requests share block i only if they share the namespace and all ``(i+1)*B`` tokens.
The encoding is fixed-width and platform independent: hashes name blocks on disk and must agree
across processes and machines. Hashes are 16-byte ``bytes`` (``BlockHash``); a physical slot in a
tier is a ``BlockId`` (an ``int``); the two never mix.

Token ids are validated once, when they are turned into bytes (``token_bytes``): they must be
integers in ``[0, 2**31)``.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import xxhash

from radixkv.errors import ConfigError, InvalidTokensError

BlockHash = NewType("BlockHash", bytes)
HASH_BYTES = 16
TOKEN_BYTES = 4  # int32, little-endian
MAX_TOKEN_ID = 2**31 - 1

_xxh3_128 = xxhash.xxh3_128_digest
_NEED_BYTESWAP = sys.byteorder != "little"


def _field(value: str | None) -> bytes:
    """Length-prefixed field so ("ab", "c") and ("a", "bc") never collide; None != ""."""
    if value is None:
        return b"\xff\xff\xff\xff"
    raw = value.encode("utf-8")
    return len(raw).to_bytes(4, "little") + raw


@dataclass(frozen=True)
class Namespace:
    """What must match, besides tokens, for two requests to share KV blocks.

    ``model`` is a fingerprint of the model (name, revision, dtype, KV layout); ``cache_salt``
    isolates tenants or sessions; ``adapter_id`` isolates LoRA adapters. Blocks of different
    namespaces never match, in memory or on disk.

    >>> a = Namespace("smollm2-135m/fp32")
    >>> a.seed == Namespace("smollm2-135m/fp32").seed
    True
    >>> a.seed == Namespace("smollm2-135m/fp32", cache_salt="tenant-1").seed
    False
    """

    model: str
    cache_salt: str | None = None
    adapter_id: str | None = None
    extra: str | None = None
    seed: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("Namespace.model must be a non-empty string (a model fingerprint)")
        for name in ("cache_salt", "adapter_id", "extra"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ConfigError(f"Namespace.{name} must be a str or None, got {type(v).__name__}")
        payload = b"radixkv-ns-v1" + b"".join(
            _field(v) for v in (self.model, self.cache_salt, self.adapter_id, self.extra))
        object.__setattr__(self, "seed", _xxh3_128(payload))

    def with_salt(self, cache_salt: str | None) -> Namespace:
        """The same model namespace with another tenant salt."""
        return Namespace(self.model, cache_salt, self.adapter_id, self.extra)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Validate token ids and encode them as little-endian int32 bytes.

    Raises InvalidTokensError for an empty sequence, non-integers, negatives or ids >= 2**31.
    Runtime complexity: O(n), in C.

    >>> token_bytes([1, 2]).hex()
    '0100000002000000'
    """
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise InvalidTokensError(
            f"token ids must be a sequence of ints, got {type(tokens).__name__}")
    try:
        arr = array("i", tokens)
    except TypeError as exc:
        bad = next((t for t in tokens if not hasattr(t, "__index__")), None)
        raise InvalidTokensError(
            f"token ids must be integers, got {type(bad).__name__} ({bad!r})") from exc
    except OverflowError as exc:
        raise InvalidTokensError(f"token ids must be in [0, {MAX_TOKEN_ID}]: {exc}") from exc
    if len(arr) == 0:
        raise InvalidTokensError("token ids must not be empty")
    if _NEED_BYTESWAP:
        arr.byteswap()
    raw = arr.tobytes()
    # A negative int32 has the high bit of its last little-endian byte set: check all of them
    # in C (bytes.isascii) instead of a Python-level min() over the ids.
    if not raw[3::4].isascii():
        raise InvalidTokensError(f"token ids must be >= 0, got {min(arr)}")
    return raw


def chain_hash(parent: bytes, block_token_bytes: bytes, extra: bytes = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (or the namespace seed for block 0)."""
    return BlockHash(_xxh3_128(parent + block_token_bytes + extra))


def hash_blocks(tok_bytes: bytes, block_size: int, parent: bytes, start: int = 0,
                stop: int | None = None) -> list[BlockHash]:
    """Chain hashes of full blocks ``start .. stop-1`` of ``tok_bytes``.

    ``parent`` is the hash of block ``start - 1`` (the namespace seed when ``start == 0``).
    Only full blocks are hashed: the partial tail belongs to one sequence and is never shared
    across requests. Runtime complexity: O(number of tokens hashed).

    >>> ns = Namespace("m")
    >>> hs = hash_blocks(token_bytes(range(40)), 16, ns.seed)
    >>> len(hs), len(hs[0])
    (2, 16)
    >>> hash_blocks(token_bytes(range(40)), 16, hs[0], start=1) == hs[1:]
    True
    """
    width = block_size * TOKEN_BYTES
    full = len(tok_bytes) // width
    stop = full if stop is None else min(stop, full)
    out: list[BlockHash] = []
    h = parent
    for i in range(start, stop):
        h = _xxh3_128(h + tok_bytes[i * width:(i + 1) * width])
        out.append(h)  # type: ignore[arg-type]
    return out


def hash_token_blocks(tokens: Sequence[int], block_size: int, namespace: Namespace
                      ) -> list[BlockHash]:
    """Convenience: validate ``tokens`` and return the hashes of all its full blocks."""
    return hash_blocks(token_bytes(tokens), block_size, namespace.seed)
