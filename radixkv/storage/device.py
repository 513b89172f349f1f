"""The device tier: one KV tensor in the layout the attention kernels read.

``kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` lives on CUDA when
present, else on the CPU (tests, CPU-only serving). Per layer ``k_cache = kv_cache[l, 0]`` and
``v_cache = kv_cache[l, 1]`` are views of shape ``[num_blocks, block_size, kv_heads, head_dim]``.

Moving blocks in and out goes through a block-major staging tensor
``[n, num_layers, 2, block_size, kv_heads, head_dim]`` (the host pool's and the disk payload's
layout), so one gather/scatter moves n whole blocks. This pool owns the bytes only; which block
id is free, cached or pinned is the block pool's business.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.errors import ConfigError
from radixkv.storage.buffers import check_blocks, index_tensor, torch_dtype
from radixkv.storage.layout import KVLayout


def default_device() -> torch.device:
    """CUDA device 0 when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gather(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[n, L, 2, bs, h, d]`` contiguous copy of blocks ``ids`` (int64 on kv_cache's device):
    the kernels' ``gather_blocks`` (a Triton/torch kernel behind a checked launcher)."""
    from radixkv.kernels import gather_blocks  # lazy: keeps `import radixkv.storage` light
    out: torch.Tensor = gather_blocks(kv_cache, ids)
    return out


def _scatter(kv_cache: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write ``blocks [n, L, 2, bs, h, d]`` (same device) into block slots ``ids`` (distinct)."""
    from radixkv.kernels import scatter_blocks
    scatter_blocks(kv_cache, ids, blocks)


#: Pools at least this large get their own mapping (smaller ones stay below numpy's huge-page
#: threshold of 4 MiB, and test pools are tiny).
MMAP_MIN_BYTES = 1 << 20


def lazy_cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are committed only when first written, 4 KiB at a
    time.

    ``torch.zeros`` writes every byte, so a 512 MiB pool made the process 512 MiB larger at
    construction even for a job that uses ten blocks. Fresh anonymous memory is zero pages
    the kernel commits on first write, so resident memory grows with the blocks written.

    Where Linux lets it (``MADV_NOHUGEPAGE``), the memory is a private anonymous mapping
    advised *against* transparent huge pages (:func:`_small_page_buffer`). The previous
    allocator, numpy's ``zeros`` (``calloc``), advises huge pages on allocations of 4 MiB and
    more, and the layout spreads one block over ``2 x num_layers`` regions (each layer's K and
    V), so the first block written into a region faulted in a whole 2 MiB there: 120 MiB
    resident after one block on SmolLM2, each fault zeroing 512 pages (which a virtual machine
    may first have to get from its host: 0.1 to 5 ms per fault here). Now a first write
    commits and zeroes only the 4 KiB pages the block covers. Elsewhere, and for pools under
    ``MMAP_MIN_BYTES``: numpy's ``zeros``. The tensor keeps its buffer alive.
    """
    import math

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = _small_page_buffer(nbytes) if nbytes >= MMAP_MIN_BYTES else None
    if raw is None:
        import numpy as np

        raw = torch.from_numpy(np.zeros(max(nbytes, 1), dtype=np.uint8))[:nbytes]
    return raw.view(dtype).view(shape)


def _small_page_buffer(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of zeros in a private anonymous mapping advised ``MADV_NOHUGEPAGE``, as a
    uint8 tensor that holds the mapping; None where :mod:`mmap` lacks the flags or the advice
    (not Linux) or the kernel refuses it.

    Private, not Python's default ``MAP_SHARED`` (shmem: shared with children after a fork,
    and counted as shared memory)."""
    import mmap

    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    private, anon = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if advice is None or private is None or anon is None:
        return None
    try:
        m = mmap.mmap(-1, nbytes, flags=private | anon)
        m.madvise(advice)
    except (OSError, ValueError):
        return None
    return torch.frombuffer(m, dtype=torch.uint8)   # holds a reference to the mapping


def mapping_info(addr: int) -> dict[str, str]:
    """The ``/proc/self/smaps`` entry of the mapping that holds ``addr`` (its fields, e.g.
    ``Rss``, ``VmFlags``; the whole mapping, which the kernel may have merged with a neighbour
    of the same kind); empty where there is none (not Linux, or no such mapping). Why: what a
    pool's pages are (committed or not, huge pages or not) is only visible there."""
    info: dict[str, str] = {}
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    if inside:
                        break
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside:
                    key, _, value = line.partition(":")
                    info[key] = value.strip()
    except OSError:
        return {}
    return info


def resident_bytes(tensor: torch.Tensor) -> int | None:
    """Resident bytes of the mapping holding ``tensor``'s data (:func:`mapping_info`'s
    ``Rss``), or None where it cannot be read: e.g. whether a CPU pool was committed
    (``DevicePool(commit=True)``) or is still lazy."""
    rss = mapping_info(tensor.data_ptr()).get("Rss")
    return int(rss.split()[0]) << 10 if rss else None


class DevicePool:
    """Byte storage of the device tier: ``num_blocks`` blocks of ``layout`` in one tensor.

    Args:
        layout: block geometry and dtype.
        num_blocks: capacity in blocks (block ids are ``0 .. num_blocks-1``).
        device: torch device; default CUDA when available, else CPU.
        zero: fill with zeros (default) rather than leaving memory uninitialised. On the CPU
            the pool is always zeros, mapped lazily: memory becomes resident as blocks are
            written, not at construction (see :func:`lazy_cpu_zeros`).
        commit: on the CPU, write every page once now (``CacheConfig.commit_device_pool``):
            the whole pool is resident from the start and no later block write faults a
            fresh page in (each write into a never-written block had faulted two 4 KiB pages
            per layer's K and V: ~2,000 faults, ~3 ms, for a 250-token prefill of the
            embedded model). Ignored on CUDA (``torch.zeros`` there already writes it).
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str | None = None,
                 zero: bool = True, commit: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"DevicePool needs num_blocks > 0, got {num_blocks!r}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device) if device is not None else default_device()
        shape, dtype = layout.cache_shape(num_blocks), torch_dtype(layout.dtype)
        if self.device.type == "cpu":
            self.kv_cache = lazy_cpu_zeros(shape, dtype)
            if commit:
                self.kv_cache.zero_()   # zeros over zeros: commits every page (all threads)
        else:
            alloc = torch.zeros if zero else torch.empty
            self.kv_cache = alloc(shape, dtype=dtype, device=self.device)

    @property
    def num_bytes(self) -> int:
        """Bytes held by ``kv_cache``."""
        return self.num_blocks * self.layout.bytes_per_block

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` views of one layer, each ``[num_blocks, block_size, h, d]``."""
        if not 0 <= layer < self.layout.num_layers:
            raise ConfigError(f"layer {layer} outside [0, {self.layout.num_layers})")
        return self.kv_cache[layer, 0], self.kv_cache[layer, 1]

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Copy of blocks ``block_ids`` as contiguous ``[n, L, 2, block_size, h, d]`` on
        ``self.device``. Runtime: one gather of ``n * bytes_per_block`` bytes on the current
        stream."""
        ids = index_tensor(block_ids, self.num_blocks, "device block ids", self.device)
        return _gather(self.kv_cache, ids)

    def read_blocks_into(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` into ``out [n, L, 2, block_size, h, d]`` (any device, e.g.
        a run of pinned host blocks), asynchronously on the current stream when ``out`` is pinned.

        On CUDA: one gather kernel, then one DMA. On the CPU: one ``index_select`` over the
        block axis of a block-major view, written straight into ``out`` (a single pass over
        memory; per-block copies cost a dispatch each and a temporary + copy costs two passes).
        """
        ids = index_tensor(block_ids, self.num_blocks, "device block ids", self.device)
        check_blocks(out, self.layout, len(ids), "DevicePool.read_blocks_into(out=)")
        if self.device.type == "cpu":
            if out.device.type == "cpu" and out.is_contiguous():
                torch.index_select(self._block_major(), 0, ids, out=out)
            else:
                for i, b in enumerate(ids.tolist()):
                    out[i].copy_(self.kv_cache[:, :, b])
        else:
            out.copy_(_gather(self.kv_cache, ids), non_blocking=out.is_pinned())

    def write_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write ``blocks [n, L, 2, block_size, h, d]`` (any device) into block ids ``block_ids``
        (distinct). Validates everything before writing anything.

        On the CPU: one strided copy per run of consecutive block ids, straight from ``blocks``
        (measured faster there than ``index_copy_``, which moves one element at a time)."""
        ids = index_tensor(block_ids, self.num_blocks, "device block ids", self.device,
                           unique=True)
        check_blocks(blocks, self.layout, len(ids), "DevicePool.write_blocks")
        if self.device.type == "cpu":
            blocks = blocks.to("cpu")
            dst = self._block_major()
            id_list = ids.tolist()
            i = 0
            while i < len(id_list):
                j = i + 1
                while j < len(id_list) and id_list[j] == id_list[j - 1] + 1:
                    j += 1
                dst[id_list[i]:id_list[i] + j - i].copy_(blocks[i:j])
                i = j
        else:
            _scatter(self.kv_cache, ids, blocks.to(self.device, non_blocking=True))

    def _block_major(self) -> torch.Tensor:
        """``kv_cache`` viewed as ``[num_blocks, L, 2, block_size, h, d]`` (a view, no copy)."""
        return self.kv_cache.permute(2, 0, 1, 3, 4, 5)

    def copy_blocks(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Device-to-device copy of blocks ``src_ids`` into ``dst_ids`` (copy-on-write, tests)."""
        if len(src_ids) != len(dst_ids):
            raise ConfigError(f"{len(src_ids)} sources for {len(dst_ids)} destinations")
        self.write_blocks(dst_ids, self.read_blocks(src_ids))


__all__ = ["DevicePool", "default_device", "mapping_info", "resident_bytes"]
