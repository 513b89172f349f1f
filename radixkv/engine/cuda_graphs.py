"""Decode steps replayed from CUDA graphs, one per batch-size bucket (vLLM / SGLang's
``cuda_graph_runner``, nano-vllm's ``capture_cudagraph``).

Why: a decode step of a small batch launches a few hundred kernels whose host-side cost
(Python, dispatch, Triton's launcher: tens of microseconds each) is far above their GPU time.
A CUDA graph records the launches of one step once and replays them with one call.

How:

* Persistent input buffers sized for the largest bucket (``max_num_seqs`` rows) hold what a
  decode step reads: ``input_ids``, ``position_ids``, ``slot_mapping``, ``seq_lens``,
  ``block_tables`` (``max_blocks`` columns: ``ceil(max_model_len / block_size)``), and
  ``logits_indices`` (``0..rows-1``, constant). A graph reads its inputs from fixed addresses,
  so each step copies its batch into the first ``n`` rows.
* Buckets ``1, 2, 4, 8, 16, 24, 32, ...`` (multiples of 8 from 8) up to ``max_num_seqs``; a
  batch of ``n`` sequences replays the smallest bucket ``>= n``. Rows ``n..bucket-1`` are
  padding: ``slot = PAD_SLOT`` (the K/V write skips them: they never touch the cache),
  ``seq_len = 1`` over block 0 (a valid block: their attention reads something and is thrown
  away), token 0 at position 0.
* One graph per bucket is captured at start-up (after a warm-up run), all from one memory
  pool; their outputs are the logits rows ``[bucket, vocab]``, of which the first ``n`` are
  returned.
* Prefill and mixed steps, batches wider than the buffers, and models whose decode reads host
  values (sliding windows decided per step on the host, soft-capping, quantized KV, the
  transformers-module path) run eagerly.

What a graph bakes in: everything host-side in the captured step. In the lean forward on CUDA
that is nothing the step depends on: the Triton decode kernel's grid and split count come from
the buffers' shapes, the rotary tables from ``position_ids``, and no op reads a value back
(tests/engine/test_decode_ops.py). The capture is abstracted (:class:`EagerGraph`) so the
same runner, buffers, bucketing and padding run on the CPU, replaying the step eagerly with the
step's own host metadata: tests/engine/test_cuda_graphs.py checks logits and KV there.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from radixkv.engine.batch import AttentionMode, ForwardBatch
from radixkv.errors import ConfigError

PAD_SLOT = -1   # kernels skip this slot (radixkv.kernels.reference.PAD_SLOT)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """``1, 2, 4, 8, 16, 24, ...`` (multiples of 8 from 8) up to and including
    ``max_num_seqs``.

    >>> bucket_sizes(20)
    [1, 2, 4, 8, 16, 20]
    """
    if max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class Graph(Protocol):
    """A captured step: ``replay(batch)`` reruns it on the persistent buffers' contents and
    returns its output tensor (the same tensor every time for a CUDA graph)."""

    def replay(self, batch: ForwardBatch) -> torch.Tensor: ...


class EagerGraph:
    """Stands in for a CUDA graph where there is none (tests on the CPU): ``replay`` runs the
    step again, reading the same persistent buffers, with the replayed batch's host metadata
    (which the CUDA path does not read on the device)."""

    def __init__(self, fn: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch) -> None:
        self.fn = fn
        fn(batch)   # the warm-up run a capture does too

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        return self.fn(batch)


class CudaGraph:
    """One captured ``torch.cuda.CUDAGraph`` of ``fn(batch)`` (after a warm-up run on a side
    stream, as torch's documentation asks)."""

    def __init__(self, fn: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch,
                 pool: object) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(batch)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(batch)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        self.graph.replay()
        return self.out


class DecodeGraphRunner:
    """Replays decode steps of one :class:`ModelRunner` from per-bucket graphs (module doc).

    Args:
        forward: the runner's eager step, ``ForwardBatch -> logits [rows, vocab]``.
        block_size: the pool's tokens per block.
        max_num_seqs: the largest bucket.
        max_blocks: block-table columns of the buffers (batches with wider tables run eagerly).
        device: where the buffers live (the model's device).
        use_cuda_graphs: capture CUDA graphs (needs CUDA); False: :class:`EagerGraph`.
    """

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], block_size: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device,
                 use_cuda_graphs: bool) -> None:
        if use_cuda_graphs and device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device, the model is on {device}")
        self.forward = forward
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.device = device
        self.buckets = bucket_sizes(max_num_seqs)
        rows = self.buckets[-1]
        dev = device
        self.input_ids = torch.zeros(1, rows, dtype=torch.int64, device=dev)
        self.position_ids = torch.zeros(1, rows, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((rows,), PAD_SLOT, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=dev)
        self.graphs: dict[int, Graph] = {}
        pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None
        for b in reversed(self.buckets):   # largest first: the pool then fits the others
            batch = self._bucket_batch(b, (1,) * b)
            self.graphs[b] = (CudaGraph(self.forward, batch, pool) if use_cuda_graphs
                              else EagerGraph(self.forward, batch))
        #: replays per bucket (for tests and stats)
        self.replays: dict[int, int] = {b: 0 for b in self.buckets}

    def _bucket_batch(self, rows: int, host_seq_lens: tuple[int, ...]) -> ForwardBatch:
        """A decode ForwardBatch over the first ``rows`` rows of the buffers."""
        return ForwardBatch(
            mode=AttentionMode.DECODE, input_ids=self.input_ids[:, :rows],
            position_ids=self.position_ids[:, :rows], slot_mapping=self.slot_mapping[:rows],
            cu_seqlens_q=self.cu_seqlens_q[:rows + 1], seq_lens=self.seq_lens[:rows],
            block_tables=self.block_tables[:rows], logits_indices=self.logits_indices[:rows],
            logits_per_seq=(1,) * rows, block_size=self.block_size, num_tokens=rows,
            num_seqs=rows, max_seq_len=max(host_seq_lens), max_block_id=0, max_token_id=0,
            min_token_id=0, host_cu_seqlens_q=tuple(range(rows + 1)),
            host_seq_lens=host_seq_lens, has_pad_slots=True)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences (None: more than the largest)."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode batches of at most the largest bucket's rows and ``max_blocks`` columns."""
        return (batch.mode is AttentionMode.DECODE and batch.num_logits == batch.num_seqs
                and self.bucket_for(batch.num_seqs) is not None
                and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Copy ``batch`` into the buffers (padding the bucket), replay its graph, return the
        logits of its ``num_seqs`` rows (``[num_seqs, vocab]``; a view of the graph's output,
        valid until the next replay)."""
        n, width = batch.num_seqs, batch.block_tables.shape[1]
        bucket = self.bucket_for(n)
        assert bucket is not None and self.can_run(batch), (n, width, self.buckets)
        # real rows: one device copy per tensor (no host read); padding rows: reset
        self.input_ids[:, :n].copy_(batch.input_ids, non_blocking=True)
        self.position_ids[:, :n].copy_(batch.position_ids, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.block_tables, non_blocking=True)
        if bucket > n:
            self.input_ids[:, n:bucket].zero_()
            self.position_ids[:, n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(PAD_SLOT)
            self.seq_lens[n:bucket].fill_(1)
            self.block_tables[n:bucket, 0].zero_()
        host_lens = tuple(batch.host_seq_lens) + (1,) * (bucket - n)
        replayed = dataclasses.replace(self._bucket_batch(bucket, host_lens),
                                       max_block_id=batch.max_block_id,
                                       max_token_id=batch.max_token_id)
        self.replays[bucket] += 1
        return self.graphs[bucket].replay(replayed)[:n]
