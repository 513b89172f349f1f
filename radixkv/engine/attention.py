"""radixkv's attention as a transformers ``AttentionInterface`` function.

How the hook works (verified against transformers 5.23 for Llama, Qwen2 and Mistral):

* ``AttentionInterface.register(name, fn)`` adds ``fn`` to a class-level mapping shared by every
  model; ``model.set_attn_implementation(name)`` stores ``name`` in
  ``config._attn_implementation``, and each ``*Attention.forward`` looks the function up per call
  and invokes ``fn(module, query, key, value, attention_mask, dropout=..., scaling=...,
  [sliding_window=...], **kwargs)`` after rotary embedding, with ``query`` ``[1, Hq, T, D]`` and
  ``key``/``value`` ``[1, Hkv, T, D]``. It expects ``(out [1, T, Hq, D], weights)`` back.
* Extra keyword arguments given to ``model(...)`` travel unchanged through the CausalLM, the base
  model and every decoder layer into ``**kwargs`` here. That is how :class:`PagedAttentionContext`
  arrives: an explicit argument, no module-level state (STYLE habit 7).
* ``masking_utils.create_causal_mask`` returns ``None`` without building anything when the
  implementation's name is not in ``AttentionMaskInterface`` (the path meant for vLLM/TGI-style
  backends). We therefore register no mask function on purpose: no dense ``[T, T]`` mask is ever
  built, and causality comes from ``cu_seqlens_q``/``seq_lens`` inside the kernels. The function
  below refuses a non-``None`` mask so a later registration cannot silently change the semantics.

Registering mutates transformers' global table; it is idempotent and holds a pure function, so it
is safe to do from any number of runners (see :func:`register`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from radixkv.engine.batch import AttentionMode, ForwardBatch
from radixkv.engine.kv_quant import FORMATS, Workspace

#: Cache tensor dtypes that hold quantized rows (engine/kv_quant.py FORMATS).
_QUANTIZED_STORAGE = frozenset(f.storage for f in FORMATS.values())
QUANTIZED_STORAGE = _QUANTIZED_STORAGE
#: The name under which the attention function is registered with transformers.
ATTN_IMPLEMENTATION = "radixkv_paged"
#: The keyword argument of ``model(...)`` that carries the :class:`PagedAttentionContext`.
CONTEXT_KWARG = "radixkv_context"
#: Attention features some transformers models pass as keyword arguments and what they are;
#: a model that passes one gets an error naming it instead of silently wrong attention.
UNSUPPORTED_ATTENTION_KWARGS = MappingProxyType({
    "s_aux": "learned attention sinks, as in gpt-oss",
    "sinks": "learned attention sinks",
    "attention_chunk_size": "chunked local attention, as in Llama 4",
})


@dataclass(frozen=True)
class PagedAttentionContext:
    """Everything the attention layers need for one forward pass.

    Attributes:
        batch: packing and paging metadata of this step.
        kv_cache: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; layer ``l``
            reads and writes ``kv_cache[l, 0]`` (K) and ``kv_cache[l, 1]`` (V).
    """

    batch: ForwardBatch
    kv_cache: torch.Tensor
    _scratch: list = field(default_factory=list, repr=False, compare=False)
    #: The torch path's per-batch plan (kernels/torch_path.py): derived from the batch at the
    #: first layer, reused by the others. ``"direct"`` is set once the first layer went
    #: through the checked launchers on the torch backend: later layers (same shapes, dtypes
    #: and devices, the model's) then call the torch path without re-checking.
    plan: dict = field(default_factory=dict, repr=False, compare=False)

    def scratch_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids the batch reads, block tables renumbered into them): computed once per
        forward, shared by every layer (quantized KV only)."""
        if not self._scratch:
            tables = self.batch.block_tables.long()
            used = torch.unique(tables.clamp(min=0))
            remap = torch.zeros(int(self.kv_cache.shape[2]), dtype=torch.long,
                                device=tables.device)
            remap[used] = torch.arange(used.numel(), device=tables.device)
            self._scratch.extend([used, remap[tables.clamp(min=0)].to(torch.int32)])
        return self._scratch[0], self._scratch[1]

    def scratch_workspace(self) -> Workspace:
        """The ``kv_quant.Workspace`` the layers of this forward dequantize into (each layer
        reuses the previous one's tensors; quantized KV only)."""
        if len(self._scratch) < 3:
            self.scratch_tables()
            self._scratch.append(Workspace())
        return self._scratch[2]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write this step's K/V into the paged cache of ``module.layer_idx``, then attend.

    Args:
        module: the model's attention module; ``module.layer_idx`` picks the cache layer.
        query: ``[1, Hq, T, D]`` after rotary embedding (T = all sequences' new tokens, packed).
        key, value: ``[1, Hkv, T, D]``, this step's new K/V only (no HF cache is used).
        attention_mask: must be ``None``; causality and packing come from the context.
        scaling: softmax scale chosen by the model (``head_dim ** -0.5`` for Llama).
        sliding_window: the layer's window (Mistral, Gemma local layers): a query sees itself
            and the ``sliding_window - 1`` keys before it.
        softcap: Gemma-2's attention logit cap: scores become ``softcap * tanh(scores /
            softcap)``.
        kwargs: must hold ``radixkv_context`` (a :class:`PagedAttentionContext`).

    Returns:
        ``(out, None)`` with ``out`` ``[1, T, Hq, D]``, the layout of transformers' sdpa path.
    """
    ctx = kwargs.get(CONTEXT_KWARG)
    if not isinstance(ctx, PagedAttentionContext):
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs model(..., "
            f"{CONTEXT_KWARG}=PagedAttentionContext(...)); call the model through "
            "radixkv.engine.model_runner.ModelRunner, or set_attn_implementation('sdpa') to use "
            "it as an ordinary transformers model")
    if attention_mask is not None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION} got a {tuple(attention_mask.shape)} attention mask: do not "
            "pass attention_mask to the model nor register a mask function for this "
            "implementation; the kernels derive causality from the batch metadata")
    if dropout and module.training:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION} does not support attention dropout "
                                  "(training); put the model in eval mode")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION} only supports causal attention")
    unknown = sorted(set(kwargs) & UNSUPPORTED_ATTENTION_KWARGS.keys())
    if unknown:
        raise NotImplementedError(
            f"{type(module).__name__} passes {unknown} to its attention function "
            f"({UNSUPPORTED_ATTENTION_KWARGS[unknown[0]]}), which radixkv's paged attention "
            "does not implement")
    t = ctx.batch.num_tokens
    if query.shape[0] != 1 or query.shape[2] != t:
        raise RuntimeError(
            f"expected packed query [1, Hq, {t}, D], got {tuple(query.shape)}: the model must "
            "be called with batch size 1 (ModelRunner does this)")
    out = attend(ctx, module.layer_idx, _token_major(query), _token_major(key),
                 _token_major(value), scaling, sliding_window, softcap)
    return out.unsqueeze(0), None  # [T, Hq, D] -> [1, T, Hq, D]


def attend(ctx: PagedAttentionContext, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, scaling: float | None, sliding_window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """Write this step's K/V of layer ``layer_idx`` into the paged cache, then attend.

    The layout-free core of :func:`paged_attention_forward`, also called directly by
    :mod:`radixkv.engine.decoder_forward` (which builds ``q``/``k``/``v`` token-major and so
    skips the transposes). ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]``, all contiguous;
    returns ``[T, Hq, D]``.
    """
    from radixkv import kernels  # imported late: the package may pick a backend on import

    batch = ctx.batch
    k_cache = ctx.kv_cache[layer_idx, 0]  # [num_blocks, block_size, Hkv, D]
    v_cache = ctx.kv_cache[layer_idx, 1]
    if k_cache.dtype in _QUANTIZED_STORAGE:   # int8/fp8 KV: write quantized rows, then attend
        return _quantized(ctx, kernels, q, k, v, ctx.kv_cache[layer_idx], scaling,
                          sliding_window, softcap)
    # check=False: ForwardBatch.build validated slots, tables and lengths once for the step and
    # ModelRunner.execute checked block ids against the pool; the launchers still check shapes,
    # dtypes and devices (on the first layer; see PagedAttentionContext.plan), but skip
    # re-reading tensor values on every layer.
    plan = ctx.plan
    windowed = sliding_window is not None and batch.max_seq_len > sliding_window
    if windowed or softcap is not None:
        # A window that no sequence reaches changes nothing: those layers keep the fast path.
        kernels.write_kv(k, v, k_cache, v_cache, batch.slot_mapping, check=False, plan=plan)
        out = kernels.paged_attention_windowed(
            q, k_cache, v_cache, batch.block_tables, batch.host_cu_seqlens_q,
            batch.host_seq_lens, scaling if scaling is not None else q.shape[-1] ** -0.5,
            torch.empty_like(q), window=sliding_window if windowed else None, softcap=softcap)
    elif plan.get("direct"):
        out = _torch_path_direct(ctx, q, k, v, k_cache, v_cache, scaling)
    else:
        kernels.write_kv(k, v, k_cache, v_cache, batch.slot_mapping, check=False, plan=plan)
        if batch.mode is AttentionMode.DECODE:
            out = kernels.paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, scale=scaling,
                check=False, plan=plan)
        else:
            out = kernels.paged_prefill_attention(
                q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
                scale=scaling, check=False, plan=plan)
        from radixkv.kernels.backend import resolve_backend
        plan["direct"] = resolve_backend(None, q.device) == "torch"
    return out


def _torch_path_direct(ctx: PagedAttentionContext, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       scaling: float | None) -> torch.Tensor:
    """Layers after the first of a forward on the torch backend: the same calls as the checked
    launchers make, without their per-call argument checks (the first layer passed them with
    tensors of the same shapes, dtypes and devices; only the layer's cache slice differs)."""
    from radixkv.kernels import torch_path

    batch, plan = ctx.batch, ctx.plan
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    torch_path.write_kv(k, v, k_cache, v_cache, batch.slot_mapping, plan)
    out = torch.empty_like(q)
    if batch.mode is AttentionMode.DECODE:
        return torch_path.paged_decode_attention(q, k_cache, v_cache, batch.block_tables,
                                                 batch.seq_lens, scale, out, plan)
    return torch_path.paged_prefill_attention(q, k_cache, v_cache, batch.block_tables,
                                              batch.cu_seqlens_q, batch.seq_lens, scale, out,
                                              plan)


def _quantized(ctx: PagedAttentionContext, kernels: Any, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, kv_layer: torch.Tensor, scaling: float | None,
               sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention over an int8 or fp8 cache (``engine/kv_quant.py``): this step's K/V are
    quantized as they are written (once), then the blocks the batch reads are scaled back into a
    compact scratch cache and the ordinary kernels run on it with remapped block tables. The
    stored rows are Hadamard-rotated and stay so: the query is rotated before the kernel and
    the output after it (``q . k`` and the softmax are unchanged by an orthonormal rotation).
    The scratch is a gather the torch path does anyway (it copies each sequence's K/V per
    layer); it is written into tensors of the forward's ``kv_quant.Workspace``, K and V of a
    layer in one go (freshly allocated megabytes per layer cost more than the arithmetic on
    the CPU). Where the kernels run on Triton, int8 and fp8 blocks are read in place instead
    (the kernels dequantize in registers; no scratch), unless a window or a softcap needs the
    windowed kernel, which reads float caches only. On the CPU, decode reads them in place too,
    through the native kernel, when it is available."""
    from radixkv.engine.kv_quant import dequantize_blocks, format_of, rotate, write_quantized
    from radixkv.kernels.backend import resolve_backend

    batch = ctx.batch
    k_cache, v_cache = kv_layer[0], kv_layer[1]   # [num_blocks, block_size, Hkv, D + 2] each
    write_quantized(k, v, k_cache, v_cache, batch.slot_mapping)
    rotated = format_of(k_cache.dtype).rotated
    if rotated:
        q = rotate(q)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    windowed = sliding_window is not None and batch.max_seq_len > sliding_window
    if not windowed and softcap is None and resolve_backend(None, q.device) == "triton":
        if batch.mode is AttentionMode.DECODE:
            out = kernels.paged_decode_attention(q, k_cache, v_cache, batch.block_tables,
                                                 batch.seq_lens, scale=scale, check=False)
        else:
            out = kernels.paged_prefill_attention(q, k_cache, v_cache, batch.block_tables,
                                                  batch.cu_seqlens_q, batch.seq_lens,
                                                  scale=scale, check=False)
        return rotate(out) if rotated else out
    used = ctx.plan.get("native_quantized")   # the first layer's answer, for the others
    if used is not False and batch.mode is AttentionMode.DECODE and not windowed \
            and softcap is None and q.device.type == "cpu":
        # The native CPU decode kernel reads int8 / fp8 rows in place (kernels/native.py),
        # widening each exactly as the scratch below would hold it, without the gather.
        from radixkv.kernels import native

        parts = used or native.decode_parts(batch.seq_lens, k_cache.shape[2])
        out = torch.empty_like(q)
        ran = native.paged_decode_quantized(q, k_cache, v_cache, batch.block_tables,
                                            batch.seq_lens, scale, out, parts=parts,
                                            checked=bool(used))
        ctx.plan["native_quantized"] = parts if ran else False
        if ran:
            return rotate(out) if rotated else out
    if windowed or softcap is not None:   # reads only the window's quantized blocks, in place
        out = kernels.paged_attention_windowed(
            q, k_cache, v_cache, batch.block_tables, batch.host_cu_seqlens_q,
            batch.host_seq_lens, scale, torch.empty_like(q),
            window=sliding_window if windowed else None, softcap=softcap)
        return rotate(out) if rotated else out
    if batch.mode is not AttentionMode.DECODE and q.device.type == "cpu" \
            and ctx.plan.get("native_prefill_quantized") is not False:
        # Prefill / extend over the cached prefix: the native kernel packs its K/V tiles
        # straight from the int8 / fp8 rows (kernels/native.py), no scratch.
        from radixkv.kernels import native

        out = torch.empty_like(q)
        ran = native.paged_prefill_quantized(q, k_cache, v_cache, batch.block_tables,
                                             batch.cu_seqlens_q, batch.seq_lens,
                                             batch.max_seq_len, scale, out)
        ctx.plan["native_prefill_quantized"] = ran
        if ran:
            return rotate(out) if rotated else out
    used, tables = ctx.scratch_tables()
    ks, vs = dequantize_blocks(kv_layer, used, q.dtype, ctx.scratch_workspace(), "kv")
    if batch.mode is AttentionMode.DECODE:
        out = kernels.paged_decode_attention(q, ks, vs, tables, batch.seq_lens, scale=scale,
                                             check=False)
    else:
        out = kernels.paged_prefill_attention(q, ks, vs, tables, batch.cu_seqlens_q,
                                              batch.seq_lens, scale=scale, check=False)
    if rotated:
        out = rotate(out)
    return out


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, T, D]`` -> contiguous ``[T, H, D]``, the packed layout the kernels take.

    The models build K/V as ``proj(x).view(1, T, H, D).transpose(1, 2)``, so the transpose back
    is usually free. With one head (MQA) ``contiguous()`` keeps a meaningless stride on the
    size-1 axis that strict stride checks reject, so the strides are restated (no copy).
    """
    y = x[0].transpose(0, 1).contiguous()
    t, h, d = y.shape
    return y.as_strided((t, h, d), (h * d, d, 1))


def register() -> str:
    """Register :func:`paged_attention_forward` with transformers; return its name.

    Idempotent. Deliberately registers nothing in ``AttentionMaskInterface`` (see module doc).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
