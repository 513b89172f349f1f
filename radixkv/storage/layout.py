"""The shape of one KV block in every tier, and sizing helpers ("how many blocks fit in 4 GiB").

Torch-free on purpose: the bookkeeping layer sizes its pools from a ``KVLayout`` without importing
torch; dtypes are carried as names (``"float16"``) and turned into ``torch.dtype`` only in
``device.py`` / ``host.py`` / ``disk.py``.

A block holds ``block_size`` tokens of every layer's keys and values. Its staging shape, used by
the host pool, the disk payload and the transfer engine, is block-major::

    block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)      # 2 = (K, V)

while the device pool stores ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``
(``cache_shape``), the layout the attention kernels read.

>>> lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype="float32")
>>> lay.bytes_per_token, lay.bytes_per_block
(46080, 737280)
>>> lay.blocks_in(parse_size("1GiB"))
1456
>>> parse_capacity("512MiB", lay), parse_capacity(100, lay)
(728, 100)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import xxhash

from radixkv.errors import ConfigError

# Bytes per element of the dtypes a KV cache may hold. The code is the dtype's id in the on-disk
# header (never renumber: files written by older versions carry it).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    # quantized: rows of head_dim 1-byte values + a 2-byte fp16 scale (engine/kv_quant)
    "int8": 1, "fp8_e4m3": 1,
}
#: Dtypes whose rows carry a per-row scale after ``head_dim`` values (``KVLayout.row_dim``).
QUANTIZED: dict[str, int] = {"int8": 2, "fp8_e4m3": 2}
#: torch dtype name of a layout dtype whose name is not torch's own (the scaled fp8 format is
#: stored in ``float8_e4m3fn`` tensors; plain ``float8_e4m3fn`` stays a layout without scales).
TORCH_NAMES: dict[str, str] = {"fp8_e4m3": "float8_e4m3fn"}
#: What the namespace fingerprint says of a quantized dtype's bytes: the rows are stored
#: Hadamard-rotated (engine/kv_quant.py), so files and remote values of the first, unrotated
#: int8 format (same name, same dtype code) are foreign to every engine of this version.
FORMAT_TAGS: dict[str, str] = {"int8": "int8+hadamard", "fp8_e4m3": "fp8_e4m3+hadamard"}
DTYPE_CODES: dict[str, int] = {
    "float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "float8_e4m3fn": 5, "float8_e5m2": 6,
    "int8": 7, "fp8_e4m3": 8,
}
_DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
    "bf16": "bfloat16", "fp64": "float64", "double": "float64",
}

# Binary (KiB = 1024) and decimal (KB = 1000) units; a bare number is bytes for parse_size.
_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name ("float16") from a name, an alias ("bf16") or a ``torch.dtype``.

    >>> dtype_name("bf16"), dtype_name("torch.float16")
    ('bfloat16', 'float16')
    """
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unsupported KV dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one KV block; identical in every tier (only the block axis moves).

    ``dtype`` is normalised to a canonical name, so ``KVLayout(..., dtype="fp16")`` equals
    ``KVLayout(..., dtype="float16")`` and both fingerprint the same.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: str

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVLayout.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def row_dim(self) -> int:
        """Elements per (token, head) row: ``head_dim``, plus the per-row scale's bytes for a
        quantized dtype (``int8``, ``fp8_e4m3``: ``head_dim + 2``)."""
        return self.head_dim + QUANTIZED.get(self.dtype, 0)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Staging shape of one block: ``(num_layers, 2, block_size, num_kv_heads, row_dim)``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.row_dim)

    def cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        """Device pool shape: ``(num_layers, 2, num_blocks, block_size, kv_heads, row_dim)``."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.row_dim)

    @property
    def elements_per_block(self) -> int:
        """Elements in one block (product of ``block_shape``)."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_dim * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's payload (= ``bytes_per_token * block_size``)."""
        return self.bytes_per_token * self.block_size

    def blocks_in(self, num_bytes: int) -> int:
        """How many whole blocks fit in ``num_bytes`` bytes (floor)."""
        if num_bytes < 0:
            raise ConfigError(f"a capacity cannot be negative, got {num_bytes} bytes")
        return int(num_bytes) // self.bytes_per_block

    @classmethod
    def from_model_config(cls, hf_config: Any, block_size: int,
                          dtype: Any = None) -> KVLayout:
        """Layout for a Hugging Face model config (``LlamaConfig``, ``Qwen2Config``...).

        ``head_dim`` falls back to ``hidden_size // num_attention_heads`` when the config has none
        (or None); ``num_key_value_heads`` falls back to ``num_attention_heads`` (no GQA). ``dtype``
        defaults to the config's ``torch_dtype``/``dtype``, else float32.
        """
        heads = getattr(hf_config, "num_attention_heads", None)
        layers = getattr(hf_config, "num_hidden_layers", None)
        if not heads or not layers:
            raise ConfigError("model config lacks num_attention_heads / num_hidden_layers")
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None)
        if not head_dim:
            hidden = getattr(hf_config, "hidden_size", None)
            if not hidden or hidden % heads:
                raise ConfigError(f"cannot derive head_dim: hidden_size={hidden}, heads={heads}")
            head_dim = hidden // heads
        if dtype is None:
            dtype = (getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
                     or "float32")
        return cls(num_layers=int(layers), num_kv_heads=int(kv_heads), head_dim=int(head_dim),
                   block_size=int(block_size), dtype=dtype_name(dtype))

    def fingerprint(self, model_id: str, salt: str | bytes = b"") -> bytes:
        """16-byte namespace fingerprint of ``model_id`` (name@revision) + this layout + ``salt``.

        Two caches may share blocks only if their fingerprints are equal: any change of model,
        layout, dtype or salt (tenant) yields a different namespace on disk.

        >>> lay = KVLayout(2, 1, 8, 4, "float16")
        >>> len(lay.fingerprint("m")), lay.fingerprint("m") == lay.fingerprint("m", salt="t")
        (16, False)
        """
        salt_b = salt.encode() if isinstance(salt, str) else bytes(salt)
        text = (f"radixkv-namespace-v1|{model_id}|L{self.num_layers}|H{self.num_kv_heads}"
                f"|D{self.head_dim}|B{self.block_size}|{FORMAT_TAGS.get(self.dtype, self.dtype)}|")
        return xxhash.xxh3_128_digest(text.encode() + salt_b)


def parse_size(spec: int | str) -> int:
    """Bytes from ``"4GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4g"`` or a bare number of bytes.

    >>> parse_size("4GiB"), parse_size("1.5 KB"), parse_size(10)
    (4294967296, 1500, 10)
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise ConfigError(f"a size cannot be negative, got {spec}")
        return spec
    m = _SIZE_RE.match(str(spec))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"cannot parse size {spec!r}; write e.g. '4GiB', '512MiB' or '1.5GB'")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_capacity(spec: int | str, layout: KVLayout) -> int:
    """Number of blocks for a tier capacity: an int (or digit string) is a block count, a string
    with a unit (``"4GiB"``, ``"512MiB"``) is bytes, floored to whole blocks of ``layout``.

    >>> lay = KVLayout(2, 1, 8, 4, "float16")          # 256 bytes per block
    >>> parse_capacity("1KiB", lay), parse_capacity("7", lay), parse_capacity("7 blocks", lay)
    (4, 7, 7)
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise ConfigError(f"a capacity cannot be negative, got {spec} blocks")
        return spec
    text = str(spec).strip()
    m = re.match(r"^([0-9]+)\s*(blocks?)?$", text, re.IGNORECASE)
    if m:
        return int(m.group(1))
    return layout.blocks_in(parse_size(text))


__all__ = ["KVLayout", "DTYPE_BYTES", "DTYPE_CODES", "QUANTIZED", "TORCH_NAMES",
           "FORMAT_TAGS", "dtype_name", "parse_size",
           "parse_capacity"]
