"""Sizing the device KV pool from the GPU's memory, as vLLM's ``gpu_memory_utilization`` does.

On CUDA, when the cache config names no pool size (neither ``num_device_blocks`` nor
``device_memory``), the pool gets what is left of ``utilization`` x the card's memory once the
weights are loaded and a forward at the largest batch the scheduler can form
(``max_num_batched_tokens`` tokens over ``max_num_seqs`` sequences) has run::

    budget    = utilization * total - in_use - activation_peak
    in_use    = total - free          (this process's weights and allocator cache, CUDA context,
                                       other processes), read after the profiled forward
    activation_peak = peak allocated during the profiled forward - allocated before it
    blocks    = budget // bytes_per_block      (bytes_per_block: all layers, K and V)

The profiled forward runs with a pool just large enough for its batch, which is freed before
the real pool is allocated. On the CPU the default stays ``DEFAULT_DEVICE_MEMORY`` (the host's
RAM is shared with everything else; a fixed default is the safer guess there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixkv.errors import ConfigError

_GIB = float(1 << 30)


@dataclass(frozen=True)
class PoolSizing:
    """How the device pool was sized (all byte counts are bytes of device memory).

    Attributes:
        total_bytes, free_bytes: ``torch.cuda.mem_get_info`` after the profiled forward.
        activation_peak_bytes: what the profiled forward allocated at its peak beyond what
            was allocated before it.
        utilization: the fraction of ``total_bytes`` radixkv may use in all.
        budget_bytes: what that leaves for the pool.
        bytes_per_block, block_size: one block's bytes (all layers, K and V) and tokens.
        num_blocks: ``budget_bytes // bytes_per_block``.
    """

    total_bytes: int
    free_bytes: int
    activation_peak_bytes: int
    utilization: float
    budget_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """The start-up line: blocks, tokens and where the bytes went."""
        return (f"device KV pool: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens ({self.num_blocks * self.bytes_per_block / _GIB:.2f} "
                f"GiB) = {self.utilization:g} x {self.total_bytes / _GIB:.1f} GiB - "
                f"{(self.total_bytes - self.free_bytes) / _GIB:.2f} GiB in use - "
                f"{self.activation_peak_bytes / _GIB:.2f} GiB activation peak")


def plan_pool(total_bytes: int, free_bytes: int, activation_peak_bytes: int,
              utilization: float, bytes_per_block: int, block_size: int) -> PoolSizing:
    """The arithmetic of the module docstring; :class:`ConfigError` when no block fits,
    naming the numbers and what to change."""
    in_use = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - in_use - activation_peak_bytes
    blocks = max(0, budget) // bytes_per_block
    if blocks < 1:
        raise ConfigError(
            f"no room for a KV block on the device: {utilization:g} x "
            f"{total_bytes / _GIB:.2f} GiB - {in_use / _GIB:.2f} GiB in use - "
            f"{activation_peak_bytes / _GIB:.2f} GiB activation peak = {budget / _GIB:.2f} GiB, "
            f"a block takes {bytes_per_block} bytes: raise gpu_memory_utilization, lower "
            "max_num_batched_tokens, or set num_device_blocks / device_memory")
    return PoolSizing(total_bytes, free_bytes, activation_peak_bytes, utilization,
                      max(0, budget), bytes_per_block, block_size, blocks)


def profile_batch_chunks(num_tokens: int, num_seqs: int, block_size: int):
    """The largest batch the scheduler can form, as :class:`SequenceChunk` s over fresh blocks
    ``0, 1, ...``: ``num_tokens`` prompt tokens (token id 0) split as evenly as possible over
    ``min(num_seqs, num_tokens)`` sequences, each wanting its last token's logits. Returns
    (chunks, blocks they use)."""
    from radixkv.engine.batch import SequenceChunk

    seqs = max(1, min(num_seqs, num_tokens))
    chunks, next_block = [], 0
    for s in range(seqs):
        n = num_tokens // seqs + (1 if s < num_tokens % seqs else 0)
        nb = -(-n // block_size)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        chunks.append(SequenceChunk([0] * n, 0, table, slots))
    return chunks, next_block


def measure_activation_peak(run, device: torch.device) -> int:
    """Bytes ``run()`` allocates on ``device`` at its peak beyond what was allocated before
    (CUDA's caching allocator statistics)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def size_device_pool(model: torch.nn.Module, layout, block_size: int, kv_dtype: str,
                     utilization: float, max_num_batched_tokens: int, max_num_seqs: int,
                     device: torch.device) -> PoolSizing:
    """Profile a forward of the largest batch with a pool just big enough for it, free that
    pool, and size the real one (module docstring). ``model`` is wrapped by a temporary
    :class:`ModelRunner` (its packing of fused weights is what the real runner finds)."""
    from radixkv.engine.model_runner import ModelRunner

    chunks, blocks = profile_batch_chunks(max_num_batched_tokens, max_num_seqs, block_size)

    def profile() -> int:
        # The temporary runner (and its pool) lives only in this frame: gone when it returns.
        runner = ModelRunner.for_model(model, blocks, block_size, kv_dtype)
        return measure_activation_peak(lambda: runner.execute(runner.build_batch(chunks)), device)

    peak = profile()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return plan_pool(total, free, peak, utilization, layout.bytes_per_block, block_size)
