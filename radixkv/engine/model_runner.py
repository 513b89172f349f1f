"""Run a Hugging Face causal LM with its K/V in radixkv's paged block pool.

The model's own code (Llama, Qwen2, Mistral, ... anything that dispatches attention through
transformers' ``AttentionInterface``) runs unchanged; only its attention function is swapped for
:func:`radixkv.engine.attention.paged_attention_forward`. Every step packs all sequences into one
row (batch size 1, explicit ``position_ids``), so there is no padding and no HF cache object: the
paged ``kv_cache`` tensor is the only KV state, and the block manager decides what lives where.

KV-cache tensor (one for the whole model)::

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
              layer l: K = kv_cache[l, 0], V = kv_cache[l, 1]
              token at slot s = block_id * block_size + offset lives at [l, :, block_id, offset]
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from radixkv.engine import (attention, cuda_graphs, decoder_forward, kv_quant, native_model,
                            packed_linear)
from radixkv.engine.batch import AttentionMode, ForwardBatch, SequenceChunk
from radixkv.engine.cpu_contention import RunQueueProbe
from radixkv.config import openmp_spin_count
from radixkv.errors import ConfigError, InvalidBlockError, InvalidTokensError
from radixkv.storage.device import DevicePool
from radixkv.storage.layout import KVLayout

#: On the CPU, a forward whose GEMM work per layer (tokens x the layer's linear weights) is below
#: this runs on one torch thread whatever the configured count (see ModelRunner._cpu_threads).
SMALL_FORWARD_WORK = 32_000_000
#: For a model whose layers are small (under :data:`SMALL_LAYER_WEIGHTS` linear weights per
#: layer, e.g. the embedded 135M model's 3.5M), the limit is this instead: 72 tokens of the
#: embedded model (see ModelRunner._cpu_threads).
SMALL_MODEL_FORWARD_WORK = 256_000_000
SMALL_LAYER_WEIGHTS = 16_000_000
#: Idle OpenMP threads that poll at least this many iterations before they sleep
#: (:func:`radixkv.config.openmp_spin_count`) catch a small forward's next parallel region
#: without a wake-up, and then every forward runs on the configured threads (see
#: ModelRunner._cpu_threads). ``radixkv serve`` sets ``GOMP_SPINCOUNT`` to it.
SPIN_FOR_SMALL_FORWARDS = 2000
#: The start-up check of :attr:`ModelRunner.thread_invariant` multiplies layer 0's packed
#: weights by inputs of 1 and 37 rows, and of 160 rows too where that is at most this much work
#: (rows x the layer's linear weights): the embedded 135M model (3.5M) gets all three, an 8B
#: model (218M) the first two (~33 GFLOP at both thread counts together).
THREAD_CHECK_WORK = 1_000_000_000
#: :meth:`ModelRunner.warm_up` has oneDNN build its packed-GEMM kernels for forwards of 1 to
#: this many rows (the output head's up to :data:`WARM_HEAD_ROWS`), at one thread and at the
#: configured count, stopping once :data:`WARM_GEMMS_S` seconds have gone: a kernel is built
#: per (shape, row count, thread count) the first time one is needed, ~0.3-0.45 ms each, and a
#: forward of a row count not seen before paid ~2 ms for its four shapes (docs/architecture.md).
#: ``$RADIXKV_WARM_GEMM_ROWS`` replaces it (0: none; the test suite sets 0, one test excepted,
#: so that its hundreds of engines do not each spend the budget).
WARM_GEMM_ROWS = 128
WARM_ROWS_VAR = "RADIXKV_WARM_GEMM_ROWS"
WARM_HEAD_ROWS = 16
WARM_GEMMS_S = 0.5


def model_kv_layout(model: torch.nn.Module, block_size: int, kv_dtype: str = "auto"
                    ) -> KVLayout:
    """The single place the runner reads KV geometry: the model's (text) config and dtype.

    Delegates to :meth:`KVLayout.from_model_config` (``head_dim`` absent from the config falls
    back to ``hidden_size // num_attention_heads``; ``num_key_value_heads`` absent means no GQA);
    the dtype is the model's parameter dtype, which is what its K/V projections produce.
    """
    dtype = next(model.parameters()).dtype if kv_dtype == "auto" else kv_dtype
    return KVLayout.from_model_config(_text_config(model.config), block_size, dtype=dtype)


def sliding_window(config: Any) -> int | None:
    """Smallest attention window of any layer, ``None`` when every layer attends globally.

    Qwen2 keeps ``sliding_window`` set but marks layers ``full_attention`` unless
    ``use_sliding_window``; Mistral applies its window to every layer.
    """
    cfg = _text_config(config)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window) if window else None


def unsupported_features(config: Any) -> list[str]:
    """What a model's config asks of attention that the paged kernels do not do (empty: none).

    Sliding windows (Mistral, Qwen2 with ``use_sliding_window``, Gemma local layers) and
    Gemma-2's logit soft-capping are supported; these are not.
    """
    cfg = _text_config(config)
    missing = []
    if getattr(cfg, "attention_chunk_size", None):
        missing.append(f"chunked attention (attention_chunk_size={cfg.attention_chunk_size})")
    if getattr(cfg, "alibi", False) or getattr(cfg, "use_alibi", False):
        missing.append("ALiBi position biases")
    if getattr(cfg, "is_encoder_decoder", False):
        missing.append("an encoder-decoder (cross) attention")
    kinds = set(getattr(cfg, "layer_types", None) or ())
    odd = sorted(kinds - {"full_attention", "sliding_attention"})
    if odd:
        missing.append(f"attention layer types {odd}")
    return missing


def _text_config(config: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class ModelRunner:
    """Executes :class:`ForwardBatch` steps of one model against one paged KV cache.

    The runner switches ``model``'s attention implementation to radixkv's (the model object is
    shared, not copied); to use it as a plain transformers model again, call
    ``model.set_attn_implementation("sdpa")``.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor | DevicePool,
                 pack_weights: bool | None = None, lean_forward: bool | None = None) -> None:
        """Wrap a ready model and a cache allocated for it.

        Args:
            model: a transformers ``*ForCausalLM`` whose ``forward`` accepts ``logits_to_keep``
                and whose attention goes through ``AttentionInterface``; put in eval mode.
            kv_cache: the device tier's :class:`DevicePool`, or its tensor
                ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, on the
                model's device in the model's dtype.
            pack_weights: pre-pack the linear layers' weights for oneDNN
                (:mod:`radixkv.engine.packed_linear`: faster GEMMs, a second copy of the
                weights in memory; bf16 bit-identical to ``F.linear`` up to 256 rows, float32
                within rounding of it and independent of the row and thread counts);
                ``None`` = where supported (bf16 on a CPU with native bf16, float32 on x86-64).
            lean_forward: run the model through :mod:`radixkv.engine.decoder_forward` (its
                own weights, fused q/k/v and gate/up GEMMs, fewer ops; bit-identical logits)
                instead of transformers' modules; ``None`` = where the architecture is
                supported, ``True`` = required (:class:`ConfigError` naming why not).
        """
        tensor = kv_cache.kv_cache if isinstance(kv_cache, DevicePool) else kv_cache
        param = next(model.parameters())
        if tensor.dim() != 6:
            raise ConfigError(f"kv_cache must have 6 dims, got shape {tuple(tensor.shape)}")
        self.model = model
        fmt = kv_quant.format_of(tensor.dtype)   # int8 / fp8 rows + per-row scales
        quantized = fmt is not None
        self.layout = model_kv_layout(model, int(tensor.shape[3]),
                                      fmt.name if quantized else "auto")
        self.sliding_window = sliding_window(model.config)
        self.device = param.device
        want = self.layout.cache_shape(int(tensor.shape[2]))
        if tuple(tensor.shape) != want:
            raise ConfigError(f"kv_cache shape {tuple(tensor.shape)} does not fit the model: "
                              f"expected [L, 2, blocks, block_size, Hkv, D] = {want}")
        if (tensor.dtype != param.dtype and not quantized) or tensor.device != param.device:
            raise ConfigError(f"kv_cache is {tensor.dtype} on {tensor.device}, the model is "
                              f"{param.dtype} on {param.device}")
        missing = unsupported_features(model.config)
        if missing:
            raise ConfigError(f"{type(model).__name__} needs {'; '.join(missing)}, which "
                              "radixkv's paged attention does not implement")
        self.kv_cache = tensor
        if isinstance(model, native_model.NativeCausalLM):
            # radixkv's own module tree: no transformers forward to hook, the lean forward is
            # the only one it has.
            if lean_forward is False:
                raise ConfigError("radixkv's native model runs only through the lean forward; "
                                  "load it with model_impl='transformers' for transformers' "
                                  "modules")
        else:
            self._hook_transformers(model)
        model.eval()
        if pack_weights is None:
            pack_weights = packed_linear.packing_supported(param.dtype, self.device)
        # False also unpacks a model an earlier runner packed (its layers would pack again)
        packed_linear.pack_linears(model, enable=bool(pack_weights))
        reason = decoder_forward.unsupported_reason(model) if lean_forward is not False else ""
        if lean_forward and reason:
            raise ConfigError(f"lean_forward=True but {reason}")
        #: the lean forward, or None: transformers' modules with radixkv's attention hooked in
        self.lean = (decoder_forward.DecoderForward(model, pack=bool(pack_weights))
                     if reason is None else None)
        self._vocab_rows = model.get_input_embeddings().num_embeddings
        #: decode steps replayed from per-bucket graphs (:meth:`enable_decode_graphs`), or None
        self.graphs: cuda_graphs.DecodeGraphRunner | None = None
        layers = max(1, int(getattr(model.config, "num_hidden_layers", 1) or 1))
        head = model.get_output_embeddings()
        linear = sum(m.weight.numel() for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and m is not head)
        #: weights of one layer's linears (the GEMM work of one token in one layer)
        self.layer_work = max(1, linear // layers)
        #: the torch thread count in effect at the first CPU forward (the configured one)
        self._configured_threads: int | None = None
        #: whether idle OpenMP threads poll long enough for small forwards to use them all
        self.threads_poll = openmp_spin_count() >= SPIN_FOR_SMALL_FORWARDS
        #: the lean forward with packed linears (bf16 or float32): rows come out the same at
        #: any thread count (tests/engine/test_cpu_threads.py), so the count may follow the
        #: machine's load without changing a bit; elsewhere it stays a function of the batch
        self.thread_invariant = (self.device.type == "cpu" and self.lean is not None
                                 and bool(pack_weights)
                                 and param.dtype in packed_linear.PACKED_DTYPES)
        #: the row counts :meth:`warm_up` had oneDNN build GEMM kernels for (1 to this; 0: none)
        self.warm_gemm_rows = 0
        #: what the first CPU forward's check of :attr:`thread_invariant` found on this CPU:
        #: None (not run: not claimed, or one configured thread), "" (the packed GEMMs gave the
        #: same bits on one thread and on the configured count), else where they differed
        #: (then :attr:`thread_invariant` is False); :attr:`thread_check_s` the seconds it took
        self.thread_check: str | None = None
        self.thread_check_s = 0.0
        #: whether this process's threads wait for a CPU (other processes on its cores)
        self.contention = RunQueueProbe() if self.device.type == "cpu" else None
        if self.device.type == "cpu":
            # Build (first time on this machine, ~7 s) or load the native attention kernels now, so
            # that the first decode step neither waits for it nor runs another kernel than the
            # later ones (kernels/native.py; without a compiler the torch path is used).
            from radixkv.kernels import native
            native.available()
            if self.lean is not None:
                # likewise the lean forward's native norm and rope, and their bit-identity
                # checks for this model's row lengths (kernels/native_fused.py)
                from radixkv.kernels import native_fused
                lean = self.lean
                sizes = {int(lean.norm.shape[0])}
                sizes.update(int(lay.q_norm.weight.shape[0]) for lay in lean.layers
                             if lay.q_norm is not None)
                native_fused.prepare(tuple(sorted(sizes)), lean.head_dim, param.dtype,
                                     (int(lean.layers[0].gate.out_features),))

    def warm_up(self) -> float:
        """Run one short prefill and one decode step on the first blocks of the cache, which
        the caller guarantees no sequence holds (the engine calls it before its pool hands out
        a block); returns the seconds it took.

        Why: a runner's first forward pays one-time costs that would otherwise land on the
        first request: packing and concatenating the weights for oneDNN (the lean forward's
        fused GEMMs), the native kernels' first calls, oneDNN's kernel generation, Triton's
        compilation on CUDA. Measured on the embedded model (bf16, two threads, CPU): the first
        forward of a prompt took 125-139 ms against 17-22 ms for the next one, and the first
        request through ``radixkv serve`` 196 ms against 34-40 ms for the next four. One
        forward of any length warms most of what later ones need, so one prefill of a block
        and one decode step cover both attention paths; what is left is oneDNN's kernel per
        GEMM row count (~2 ms the first time a prompt length is met, measured 2026-12-07),
        which :meth:`_warm_gemms` builds for the small row counts.

        The blocks keep the warm-up's K/V: a block is written by the sequence it is allocated
        to before anything reads it, as after any sequence that freed it."""
        import time

        bs = self.block_size
        n = max(1, bs - 1)               # prefill tokens; the decode token takes slot n
        blocks = list(range(-(-(n + 1) // bs)))
        if len(blocks) > self.num_blocks:
            return 0.0
        vocab = self._vocab_rows
        t0 = time.perf_counter()
        ids = [i % vocab for i in range(1, n + 1)]
        table = blocks[: -(-n // bs)]
        self.execute(self.build_batch([SequenceChunk(ids, 0, table, list(range(n)))]))
        self.execute(self.build_batch([SequenceChunk([ids[-1]], n, blocks, [n])]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warm_gemm_rows = self._warm_gemms()
        return time.perf_counter() - t0

    def _warm_gemms(self) -> int:
        """oneDNN's packed-GEMM kernels for forwards of 1, 2, ... rows (up to
        :data:`WARM_GEMM_ROWS`, within :data:`WARM_GEMMS_S`), at one thread and at the
        configured count (a kernel is built per thread count, and :meth:`_cpu_threads` runs
        small forwards on one); returns the rows reached (0: nothing to warm: not the CPU's
        packed lean forward).

        Why: one forward warms everything else of its kind, but oneDNN builds a kernel per row
        count the first time it meets one, ~0.3-0.45 ms per weight shape; a prompt of a length
        not seen before paid ~2 ms more than its second run (median of 18 lengths, 20-139 new
        tokens over 64 cached, bf16, one thread: 51.0 against 49.4 ms, and 0.3 ms with these
        kernels built first; 2026-12-07, Zen 5 EPYC). Every new turn of a chat has a new
        length, so without this the first few hundred requests of a server pay it. Numerics
        are untouched: which forward built a kernel does not change what it computes."""
        import os
        import time

        lean = self.lean
        limit = WARM_GEMM_ROWS
        raw = os.environ.get(WARM_ROWS_VAR, "").strip()
        if raw:
            try:
                limit = int(raw)
            except ValueError:
                limit = -1
            if limit < 0:
                raise ConfigError(f"${WARM_ROWS_VAR} must be a row count (0: none), got "
                                  f"{raw!r}")
        if (limit == 0 or self.device.type != "cpu" or lean is None or not lean.pack
                or lean.layers[0].o.weight.dtype not in packed_linear.PACKED_DTYPES):
            return 0

        configured = torch.get_num_threads()
        counts = sorted({1, configured})
        deadline = time.perf_counter() + WARM_GEMMS_S
        reached = 0
        try:
            for rows in range(1, limit + 1):
                for n in counts:
                    torch.set_num_threads(n)
                    lean.warm_gemms(rows, head=rows <= WARM_HEAD_ROWS)
                reached = rows
                if time.perf_counter() > deadline:
                    break
        finally:
            torch.set_num_threads(configured)
        return reached

    def decode_graphs_unsupported(self) -> str | None:
        """Why this runner's decode steps cannot be replayed from a graph (None: they can):
        the step must read no host value that changes between steps."""
        if self.lean is None:
            return "the model runs through transformers' modules (no lean forward)"
        if kv_quant.format_of(self.kv_cache.dtype) is not None:
            return "the KV cache is quantized (its attention path plans on the host)"
        if any(lay.window is not None for lay in self.lean.layers):
            return "a sliding window (decided per step from host lengths)"
        return None

    def enable_decode_graphs(self, max_num_seqs: int, max_blocks: int,
                             use_cuda_graphs: bool = True) -> None:
        """Capture one decode graph per batch-size bucket up to ``max_num_seqs`` sequences of
        at most ``max_blocks`` blocks (:mod:`radixkv.engine.cuda_graphs`); later decode
        steps that fit replay them. ``use_cuda_graphs=False`` runs the same buffers and
        padding eagerly (the CPU check of that logic). Raises :class:`ConfigError` naming
        why when the model cannot take them."""
        reason = self.decode_graphs_unsupported()
        if reason is not None:
            raise ConfigError(f"decode graphs need a step without host-side decisions: {reason}")
        self.graphs = None
        self.graphs = cuda_graphs.DecodeGraphRunner(
            self._forward, self.block_size, max_num_seqs, max(1, min(max_blocks,
                                                                     self.num_blocks)),
            self.device, use_cuda_graphs)

    @staticmethod
    def _hook_transformers(model: torch.nn.Module) -> None:
        """Route a transformers model's attention through radixkv's paged attention."""
        if "logits_to_keep" not in inspect.signature(model.forward).parameters:
            raise ConfigError(f"{type(model).__name__}.forward has no logits_to_keep argument")
        name = attention.register()
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            # transformers only logs a warning for models that hard-code their attention.
            raise ConfigError(f"{type(model).__name__} does not dispatch attention through "
                              "transformers' AttentionInterface; radixkv cannot page its KV")

    # -- construction helpers -------------------------------------------------------------

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_blocks: int, block_size: int,
                  kv_dtype: str = "auto", commit_pool: bool = False,
                  **runner_options: Any) -> ModelRunner:
        """Allocate a zeroed :class:`DevicePool` of ``num_blocks`` blocks for ``model`` (its
        dtype, or ``kv_dtype="int8"``/``"fp8_e4m3"``: quantized rows, on its device; its pages
        written at once with ``commit_pool``) and wrap both; ``runner_options`` go to the
        constructor (``pack_weights``, ``lean_forward``)."""
        param = next(model.parameters())
        pool = DevicePool(model_kv_layout(model, block_size, kv_dtype), num_blocks,
                          device=param.device, commit=commit_pool)
        return cls(model, pool, **runner_options)

    @classmethod
    def from_pretrained(cls, model_dir: str | None = None, gguf_file: str | None = None, *,
                        num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                        device: str | None = None) -> ModelRunner:
        """Load a model with :func:`radixkv.models.load_model` (default: the embedded SmolLM2)
        and allocate its cache."""
        from radixkv.models import load_model

        model = load_model(model_dir, gguf_file, dtype=dtype, device=device)
        return cls.for_model(model, num_blocks, block_size)

    # -- geometry -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return int(self.kv_cache.shape[2])

    @property
    def block_size(self) -> int:
        return int(self.kv_cache.shape[3])

    @property
    def vocab_size(self) -> int:
        """Width of the logits rows :meth:`execute` returns."""
        return int(self.model.get_output_embeddings().out_features)

    # -- execution ------------------------------------------------------------------------

    def build_batch(self, chunks: Sequence[SequenceChunk],
                    mode: AttentionMode | None = None) -> ForwardBatch:
        """:meth:`ForwardBatch.build` with this runner's block size and device."""
        return ForwardBatch.build(chunks, self.block_size, self.device, mode)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step: write every chunk's K/V into the cache, return the requested logits.

        Returns:
            float32 ``[batch.num_logits, vocab_size]``; row ``r`` is the next-token distribution
            (unnormalised) after packed token ``batch.logits_indices[r]``.
        """
        self._check(batch)
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        return self._forward(batch)

    def _cpu_threads(self, tokens: int) -> int | None:
        """The torch thread count for a CPU forward of ``tokens`` tokens (None: leave it).

        Why: a forward of a few tokens through a small model is ~150 small parallel regions
        (GEMMs of a few rows, norms), each too small to split; with a second thread each pays a
        wake-up and a join, and the step gets slower, not faster. Measured on the embedded
        135M model (2-core EPYC, quiet, bf16): decode batch 1 14.2 ms a step on one thread
        against 17.5 on two, batch 4 19.8 against 21.3, an 8-token extend 21.0 against 27.5;
        two threads win from batch 16 (40.9 against 44.8 ms) and for chunks from ~32 tokens
        (512 tokens: 266 against 412 ms). So a forward whose GEMM work per layer (tokens x
        the layer's linear weights, :attr:`layer_work`) is under :data:`SMALL_FORWARD_WORK`
        (32M: never, even at one token, for a 1B or larger model) runs on one thread, and
        larger ones on the configured count (the count in effect at the first forward).

        A model with small layers (< :data:`SMALL_LAYER_WEIGHTS` linear weights per layer)
        gets the higher limit :data:`SMALL_MODEL_FORWARD_WORK` (256M: 72 tokens of the
        embedded model). Its regions are short at any batch a server sees between long
        prefills, and a second thread gains little on them quiet (~10% at batch 16) but loses
        a lot where the cores are shared: in ``bench serve`` at two threads and four clients
        (the clients and the HTTP thread on the same two cores) the 32M limit measured TTFT
        p50 1.28-1.33x vLLM's, and 256M 1.03x (docs/serve.md). A large model's layers are
        long enough that splitting them pays at every batch (a 1B model's decode is bound by
        reading 134 MB of weights per layer), so its limit stays 32M.

        All of the above holds where idle OpenMP threads sleep at once (``OMP_WAIT_POLICY=
        PASSIVE`` alone, as ``radixkv serve`` started before 2026-11-28): the wake-up is what a
        small region cannot pay for. Threads that poll a little before they sleep
        (:data:`SPIN_FOR_SMALL_FORWARDS` iterations or more of ``GOMP_SPINCOUNT``, or the
        runtime's default of 300,000 where no policy is set; :attr:`threads_poll`) catch
        each region at once, and then every forward runs on the configured count: one core
        reads the weights at ~24 GB/s (oneDNN's GEMMs of 1-4 rows reach 23-24 GB/s on this
        EPYC, its read bandwidth) and two at ~54, so a decode step is bound by the cores, not
        the wake-ups. Measured in one process on the embedded model, two threads, quiet:
        decode batch 1 / 4 at 11.0 / 12.7 ms a step with ``GOMP_SPINCOUNT=2000`` (PASSIVE) on
        both threads, against 12.9 / 14.8 on one; 9.7 / 11.2 against 12.7 / 14.5 with the
        runtime's default spin; 500 iterations are too few (15.6 / 17.0). Through
        ``radixkv serve`` at two threads see docs/serve.md ("CPU threads on a shared
        machine"). Only while the process's threads are not kept waiting for a CPU
        (:mod:`radixkv.engine.cpu_contention`): beside processes that take the cores, two
        threads lose, as above, and then every forward runs on one (:meth:`load_mode`).

        The choice depends on the batch and, where the forward's bits do not depend on the
        thread count (:attr:`thread_invariant`: the packed forward), on that contention;
        so outputs stay a function of the batch. The calling thread's count is set back after
        the forward."""
        if self._configured_threads is None:
            self._configured_threads = torch.get_num_threads()
            if self.lean is not None and self.lean.pack:
                # one configured thread: a single-row float32 forward is faster on MKL's
                # F.linear than on the packed GEMMs (DecoderForward.plain_single_row)
                self.lean.plain_single_row = self._configured_threads <= 1
            if self.thread_invariant and self._configured_threads > 1:
                self._check_thread_invariance(self._configured_threads)
        n = self._configured_threads
        if n <= 1:
            return None
        mode = self.load_mode()
        if mode == "split":
            return n
        if mode == "contended":
            return 1
        limit = SMALL_MODEL_FORWARD_WORK if self.layer_work < SMALL_LAYER_WEIGHTS \
            else SMALL_FORWARD_WORK
        return 1 if tokens * self.layer_work < limit else n

    def _check_thread_invariance(self, threads: int) -> None:
        """Check on this CPU, before the first forward, that the packed GEMMs give the same
        bits on one thread as on ``threads`` (what :attr:`thread_invariant` promises; the tests
        show it on the CPUs they run on, this shows it where the engine runs); where they do
        not, clear :attr:`thread_invariant` (thread counts stay a function of the batch) and
        warn. Layer 0's four weight shapes at 1, 37 and (small models) 160 rows: what the
        packed forward's GEMMs are, the kernel oneDNN picks depending on the shape and rows.
        0.13 s for the embedded model in float32 on two threads of an AVX2 EPYC (docs/serve.md,
        "CPU threads on a shared machine")."""
        import time
        import warnings

        assert self.lean is not None
        rows = (1, 37, 160) if 160 * self.layer_work <= THREAD_CHECK_WORK else (1, 37)
        t0 = time.perf_counter()
        found = self.lean.thread_variance(threads, rows)
        self.thread_check_s = time.perf_counter() - t0
        self.thread_check = found or ""
        if found:
            self.thread_invariant = False
            warnings.warn(f"oneDNN's packed GEMMs on this CPU are not thread-invariant ({found}):"
                          " CPU forwards choose their thread count by the batch alone, not by "
                          "the machine's load", RuntimeWarning, stacklevel=2)

    def load_mode(self) -> str:
        """How CPU forwards pick their threads now. ``"batch"``: by the batch alone (the
        sleeping-threads rule above), wherever idle OpenMP threads do not poll
        (:attr:`threads_poll`), the forward's bits could depend on the thread count (not
        :attr:`thread_invariant`) or the process's run-queue waiting cannot be read
        (:attr:`contention`). Else by the machine's load (read at most every half second):
        ``"split"``, every forward on every configured thread, while this process's threads
        are not kept waiting for CPUs; ``"contended"``, every forward on one thread, while
        they are (polling threads that wait at each region for a descheduled one made even
        long prefills slower than one thread: docs/serve.md)."""
        probe = self.contention
        if not (self.threads_poll and self.thread_invariant and probe is not None
                and probe.available):
            return "batch"
        return "contended" if probe.contended() else "split"

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The eager step of :meth:`execute` (also what a decode graph captures)."""
        if self.device.type == "cpu":
            threads = self._cpu_threads(int(batch.input_ids.shape[-1]))
            current = torch.get_num_threads()
            if threads is not None and threads != current:
                torch.set_num_threads(threads)
                try:
                    return self._forward_at(batch)
                finally:
                    torch.set_num_threads(current)   # the calling thread's count as it was
        return self._forward_at(batch)

    def _forward_at(self, batch: ForwardBatch) -> torch.Tensor:
        ctx = attention.PagedAttentionContext(batch=batch, kv_cache=self.kv_cache)
        # What the torch path would otherwise read back from the tensors (a device sync on
        # CUDA): the batch's host lengths, and that no slot is PAD (None: every slot is live).
        ctx.plan["host_seq_lens"] = list(batch.host_seq_lens)
        if not batch.has_pad_slots:
            ctx.plan["write_keep"] = None
        with torch.inference_mode():
            if self.lean is not None:
                return self.lean(ctx)
            out = self.model(
                input_ids=batch.input_ids,           # [1, T]
                position_ids=batch.position_ids,     # [1, T]
                use_cache=False,
                logits_to_keep=batch.logits_indices,  # [R] -> logits [1, R, V]
                **{attention.CONTEXT_KWARG: ctx},
            )
        return out.logits[0].float()

    def _check(self, batch: ForwardBatch) -> None:
        """Reject a batch that would index outside the model or the cache (host ints only)."""
        if batch.block_size != self.block_size:
            raise InvalidBlockError(f"batch built for block size {batch.block_size}, "
                                    f"the cache has {self.block_size}")
        if batch.max_block_id >= self.num_blocks:
            raise InvalidBlockError(f"block id {batch.max_block_id} outside the cache's "
                                    f"{self.num_blocks} blocks")
        if batch.min_token_id < 0 or batch.max_token_id >= self._vocab_rows:
            raise InvalidTokensError(
                f"token ids span [{batch.min_token_id}, {batch.max_token_id}], the model's "
                f"embedding has {self._vocab_rows} rows")
        if batch.input_ids.device != self.device:
            raise ConfigError(f"batch on {batch.input_ids.device}, model on {self.device}")
