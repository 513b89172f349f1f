"""Argument checks of the public launchers: shapes, dtypes, devices, contiguity, values.

Every check raises :class:`radixkv.errors.InvalidRequestError` naming the argument and the numbers
that disagree. Structural checks (shape, dtype, device, strides) never touch tensor data. Checks of
values (lengths, slot and block ranges) read the data, which costs a host sync on CUDA; they run
when the tensors are on the CPU (where they are nearly free) and are skipped on CUDA for the
attention launchers, which run once per layer per step. ``copy_blocks`` always checks values: a
duplicate destination would race.
"""

from __future__ import annotations

import torch

from radixkv.errors import InvalidRequestError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: int8 elements after the values of a quantized row: its fp16 scale's two bytes.
QUANT_SCALE_ELEMS = 2
#: Cache dtypes of quantized rows (1-byte values, then the fp16 scale: engine/kv_quant.py).
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
HEAD_DIMS_TRITON = (64, 128)


def fail(msg: str) -> None:
    raise InvalidRequestError(msg)


def check_tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...],
                 contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if t.dim() != ndim:
        fail(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        fail(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        fail(f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        fail(f"all tensors must be on one device, got {devices}")
    return first


def check_caches(k_cache: object, v_cache: object, quantized: bool = False
                 ) -> tuple[int, int, int, int]:
    """k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same shape and dtype.
    With ``quantized``, int8 and float8_e4m3fn caches of rows ``head_dim + 2`` (values, then
    the row's fp16 scale; ``head_dim`` even) are accepted too (the attention launchers read them
    in place).

    Returns (num_blocks, block_size, num_kv_heads, head_dim).
    """
    dtypes = FLOAT_DTYPES + (QUANT_DTYPES if quantized else ())
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes)
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=dtypes)
    if k.shape != v.shape or k.dtype != v.dtype:
        fail(f"k_cache and v_cache must match: {tuple(k.shape)} {k.dtype} vs "
             f"{tuple(v.shape)} {v.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k.shape
    if k.dtype in QUANT_DTYPES:
        head_dim -= QUANT_SCALE_ELEMS
        if head_dim < 2 or head_dim % 2:
            fail(f"a {k.dtype} cache needs rows of an even head_dim + {QUANT_SCALE_ELEMS} "
                 f"(fp16 scale), got rows of {k.shape[3]}")
    if min(num_blocks, block_size, num_kv_heads, head_dim) < 1:
        fail(f"k_cache has an empty dimension: {tuple(k.shape)}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query(q: object, cache_dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                leading: str) -> torch.Tensor:
    """q: [leading, num_q_heads, head_dim], cache dtype, num_q_heads % num_kv_heads == 0."""
    qt = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    if qt.dtype != cache_dtype and cache_dtype not in QUANT_DTYPES:   # any float query
        fail(f"q has dtype {qt.dtype} but the cache has {cache_dtype}")
    if qt.shape[2] != head_dim:
        fail(f"q head_dim {qt.shape[2]} != cache head_dim {head_dim}")
    if qt.shape[1] < 1 or qt.shape[1] % num_kv_heads:
        fail(f"num_q_heads ({qt.shape[1]}) must be a positive multiple of num_kv_heads "
             f"({num_kv_heads})")
    return qt


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        fail(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        fail(f"out must be {tuple(like.shape)} {like.dtype} on {like.device}, got "
             f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if not out.is_contiguous():
        fail("out must be contiguous")


def check_seq_lens(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                   *, min_len: int = 1) -> None:
    """Value check (CPU only): min_len <= seq_lens <= max_blocks_per_seq * block_size."""
    if seq_lens.device.type != "cpu" or seq_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * block_size
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < min_len or hi > capacity:
        fail(f"seq_lens must lie in [{min_len}, {capacity}] (max_blocks_per_seq "
             f"{block_tables.shape[1]} x block_size {block_size}), got min {lo} max {hi}")


def check_block_ids_in_range(name: str, ids: torch.Tensor, num_blocks: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        fail(f"{name} must lie in [0, {num_blocks}), got min {int(ids.min())} "
             f"max {int(ids.max())}")


def check_used_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            block_size: int, num_blocks: int) -> None:
    """Value check (CPU only): the entries a sequence uses name blocks of the pool."""
    if block_tables.device.type != "cpu" or seq_lens.numel() == 0:
        return
    used_blocks = (seq_lens.long() + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1])
    used = block_tables[cols[None, :] < used_blocks[:, None]]
    check_block_ids_in_range("block_tables (entries within seq_lens)", used, num_blocks)
