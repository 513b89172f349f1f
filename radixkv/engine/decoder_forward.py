"""A lean forward for Llama-family decoders: the model's own weights, fewer and fused ops.

Why: on the CPU a decode step of a small model is dominated by what surrounds the GEMMs, not by
the GEMMs alone. transformers' modules spend ~40 small tensor ops and a dozen Python calls per
layer (module dispatch, keyword plumbing, the rotary's ``cat``/``neg``, transposes in and out of
the attention function), and they run q/k/v and gate/up as five GEMMs where two would do: a
576 x 192 K or V projection of the embedded model streams its weight at about half the rate of
the wide ones. This module runs the same arithmetic as transformers' ``*ForCausalLM`` forward
for the architectures it knows, with

* q/k/v as one GEMM and gate/up as one GEMM: over weights concatenated once (the parts'
  parameters re-pointed as row views of them, :class:`_Concat`), or, for bf16 on a CPU with
  native bf16, over a oneDNN-packed copy of the concatenation (:class:`_Fused`);
* the residual add fused with the next RMSNorm, the rotary embedding fused with the K/V write,
  decode attention as one op and SiLU x up as one op: the ``radixkv::`` custom ops of
  :mod:`radixkv.kernels.fused` (torch references on the CPU, one Triton kernel each on CUDA),
  so a decode layer is nine launches with no dtype conversion and no host read
  (tests/engine/test_decode_ops.py; docs/gpu.md);
* token-major tensors throughout;
* the last layer: every row's q/k/v, rope, K/V write and attention, then only the rows whose
  logits are wanted go through its output projection, norm and MLP (a prompt's last token, or
  none for a prefill chunk before the prompt's end; every row for prompt log-probabilities),
  as llama.cpp does. A chunk's other rows there feed nothing: their K/V is already written and
  no later layer reads them. On the embedded model (30 layers) a 243-token turn over 68 cached
  tokens took 0.978x the time at one thread and 0.977x at two, a 60-token one 0.983x / 1.001x
  (paired medians of 30, 2026-12-07, Zen 5 EPYC, bf16). A row's bits do not change: its GEMM
  rows do not depend on the rows beside them (packed CPU GEMMs; test_packed_linear.py);
* the final norm and the output head on those rows only.

Numerics: every op computes what transformers' op computes, in the same dtype, element by
element (``a + (-b)`` is ``a - b``, a product with a broadcast ``cos`` is the same product, a
row's norm does not depend on the other rows, a GEMM's output column does not depend on the
columns computed beside it). ``tests/engine/test_decoder_forward.py`` checks that the logits are
bit-identical to the transformers-module path (which stays available: ``ModelRunner(...,
lean_forward=False)``) for every supported architecture, fp32 and bf16, prefill, cached extends
and decode.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` and
``Qwen3ForCausalLM`` (q/k norms) with SiLU MLPs, exactly those classes (a subclass may change the
forward), and radixkv's own module tree of the same families
(:mod:`radixkv.engine.native_model`, loaded without transformers' model classes). Anything else,
Gemma's scaled embeddings and soft-capping, Phi-3's fused projections,
runs through transformers' modules with radixkv's attention hooked in, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from radixkv import kernels
from radixkv.kernels import native, native_fused
from radixkv.engine import attention, native_model, packed_linear
from radixkv.engine.batch import AttentionMode
from radixkv.kernels import fused

#: Architectures with a lean forward, and where each layer's attention window comes from.
_WINDOW_SOURCE = {
    "LlamaForCausalLM": "none",
    "MistralForCausalLM": "config",     # MistralAttention passes config.sliding_window
    "Qwen2ForCausalLM": "layer",        # *Attention.sliding_window (None on full layers)
    "Qwen3ForCausalLM": "layer",
}
_RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})
_LINEARS = (torch.nn.Linear, packed_linear.PackedLinear)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take the lean forward (``None``: it can)."""
    if isinstance(model, native_model.NativeCausalLM):
        return None          # built for it (native_model.parse_config checked the config)
    name = type(model).__name__
    if name not in _WINDOW_SOURCE or not type(model).__module__.startswith("transformers."):
        return f"{name} is not one of {sorted(_WINDOW_SOURCE)}"
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the lean forward runs SiLU MLPs)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return "its modules carry accelerate hooks (device_map offloading)"
    base = model.model
    norms = [base.norm]
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        # Exactly nn.Linear (or its pre-packed form): subclasses such as quantized linears
        # keep other data in .weight, which the fused GEMMs would concatenate as floats.
        if not all(type(m) in _LINEARS for m in linears):
            return f"layer {layer.self_attn.layer_idx} has projections other than nn.Linear"
        if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            return f"activation {type(mlp.act_fn).__name__}"
    odd = sorted({type(n).__name__ for n in norms} - _RMS_NORMS)
    if odd:
        return f"norm layers {odd}"
    return None


class _Concat:
    """q/k/v (or gate/up) weights in one tensor, the parts' parameters re-pointed as row views
    of it ("packed at load", as vLLM's ``QKVParallelLinear``): one GEMM instead of three with
    no second copy of the weights; transformers' modules, the state dict and in-place weight
    loads see the same memory. A part whose parameter is replaced later (a new tensor, so a new
    pointer) is noticed at the next call and the concatenation is rebuilt around it.
    """

    __slots__ = ("parts", "ptrs", "weight", "bias")

    def __init__(self, parts: list[torch.nn.Linear]) -> None:
        self.parts = parts
        self.ptrs: tuple = ()
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _current(self) -> tuple:
        return tuple(m.weight.data_ptr() for m in self.parts) + tuple(
            -1 if m.bias is None else m.bias.data_ptr() for m in self.parts)

    def build(self) -> None:
        """(Re)concatenate the parts' current tensors and re-point the parts at row views."""
        # Ordinary tensors even when called inside the runner's inference mode: the model's
        # parameters must stay loadable (in-place copies) and usable with autograd outside it.
        with torch.inference_mode(False), torch.no_grad():
            for name in ("weight", "bias"):
                tensors = [getattr(m, name) for m in self.parts]
                if tensors[0] is None:
                    setattr(self, name, None)
                    continue
                whole = torch.cat([t.detach() for t in tensors])
                row = 0
                for m, t in zip(self.parts, tensors):
                    n = t.shape[0]
                    if whole.device.type != "meta":
                        setattr(m, name, torch.nn.Parameter(whole[row:row + n],
                                                            requires_grad=t.requires_grad))
                    row += n
                setattr(self, name, whole)
        self.ptrs = self._current()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._current() != self.ptrs:
            self.build()
        return F.linear(x, self.weight, self.bias)


def _paged_decode_planned(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          plan: dict) -> torch.Tensor:
    """What the ``radixkv::paged_decode`` op runs on the CPU, called directly. ``plan``: one
    dict per forward (``{"host_seq_lens": [...]}`` at first), so that once the first layer has
    run the native kernel (``plan["native"]``: its split), later layers of the same batch call
    it without the launcher's checks: their operands have the same shapes, dtypes and
    layout."""
    parts = plan.get("native")
    if parts:
        out = torch.empty_like(q)
        if native.paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out,
                               checked=True, parts=parts):
            return out
    return kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                          scale=scale, check=False, plan=plan)


def _paged_decode_direct(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         host_seq_lens: list[int]) -> torch.Tensor:
    """The op's CPU implementation with its signature (a plan of its own per call)."""
    return _paged_decode_planned(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                 {"host_seq_lens": list(host_seq_lens)})


class _Ops(NamedTuple):
    """The per-layer ops a forward calls: the ``radixkv::`` custom ops, or on the CPU their
    implementations called as plain functions (:func:`_layer_ops` says when)."""

    rms_norm: Any
    add_rms_norm: Any
    silu_mul: Any
    rope_write_kv: Any
    paged_decode: Any


_CUSTOM_OPS = _Ops(fused.rms_norm, fused.add_rms_norm, fused.silu_mul, fused.rope_write_kv,
                   fused.paged_decode)
_DIRECT_OPS = _Ops(fused.rms_norm_cpu, fused.add_rms_norm_cpu, fused.silu_mul_cpu,
                   fused.rope_write_kv_cpu, _paged_decode_direct)
#: The torch references one op at a time (what the direct path ran before the native norm and
#: rope): :func:`use_native_cpu_ops` ``(False)`` selects them, for A/B measurements.
_REFERENCE_OPS = _Ops(fused.rms_norm_ref, fused.add_rms_norm_ref, fused.silu_mul_ref,
                      fused.rope_write_kv_ref, _paged_decode_direct)
_native_cpu_ops = [True]


def use_native_cpu_ops(enabled: bool) -> bool:
    """Process-wide switch between the native CPU norm/rope with per-forward plans (default)
    and the torch references one op at a time, for ``radixkv bench decode-ops``'s paired
    runs; both compute the same bits. Returns the previous setting."""
    previous = _native_cpu_ops[0]
    _native_cpu_ops[0] = bool(enabled)
    return previous


def _layer_ops(x: torch.Tensor) -> _Ops:
    """The custom ops where they do something their implementations do not: on CUDA (one
    Triton kernel each, CUDA graphs), under ``torch.compile`` or a dispatch mode (a
    ``FakeTensorMode``, the launch counter of tests/engine/test_decode_ops.py: one op per
    call); on the CPU otherwise their CPU implementations, the same functions, called directly.

    Why: a ``torch.library.custom_op`` call costs ~25 us of Python dispatch (argument
    defaults, the autograd and in-place wrappers, the dynamo guard) on top of its work; a
    decode step of the embedded 30-layer model makes 150 of them: calling the functions
    directly takes a step from 19.0 to 16.5 ms at one thread, batch 1 (docs/serve.md,
    radixkv vs vLLM). Same functions, same arithmetic: the logits are bit-identical
    (tests/engine/test_decoder_forward.py)."""
    if (x.device.type != "cpu" or torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack() > 0):
        return _CUSTOM_OPS
    return _DIRECT_OPS


class _CpuForwardOps:
    """The direct CPU ops of one forward (see :func:`_layer_ops`), remembering what the first
    layer's call of each found: whether the native kernel applies (:mod:`radixkv.kernels.
    native_fused`, bit-identical to the reference where it runs) and the attention plan. Later
    layers of the same batch have operands of the same kinds (same shapes, dtypes, strides;
    the final norm's rows are a subset), so they skip the checks: ~5 us a call, three calls
    a layer, at batch 1."""

    __slots__ = ("plan", "norm_variant", "rope_native", "silu_native")

    def __init__(self, host_lens: list[int]) -> None:
        self.plan: dict = {"host_seq_lens": host_lens}
        self.norm_variant: tuple | None = None    # () once known not to apply
        self.rope_native: bool | None = None
        self.silu_native: bool | None = None

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        ok = self.silu_native
        if ok is None:
            ok = self.silu_native = native_fused.silu_mul_supported(gate_up)
        return native_fused.run_silu_mul(gate_up) if ok else fused.silu_mul_ref(gate_up)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        variant = self.norm_variant
        if variant is None:
            variant = self.norm_variant = native_fused.norm_variant(x, weight, residual) or ()
        if variant:
            return native_fused.run_norm(x, residual, weight, eps, variant)
        return fused.add_rms_norm_ref(x, residual, weight, eps)

    def rope_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      has_pad: bool) -> torch.Tensor:
        ok = self.rope_native
        if ok is None:
            ok = self.rope_native = native_fused.rope_supported(q, k, v, cos, sin, k_cache,
                                                                v_cache, slot_mapping)
        if ok:
            return native_fused.run_rope(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
        return fused.rope_write_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
                                       has_pad)

    def paged_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     host_seq_lens: list[int]) -> torch.Tensor:
        return _paged_decode_planned(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                     self.plan)

    def ops(self) -> _Ops:
        return _Ops(fused.rms_norm_cpu, self.add_rms_norm, self.silu_mul,
                    self.rope_write_kv, self.paged_decode)


class _Fused:
    """One GEMM for several ``nn.Linear`` of the same input, packed for oneDNN.

    The concatenated, packed weight (and bias) is built on first use and rebuilt when any part's
    weight changes (its storage pointer or version, as :class:`packed_linear.PackedLinear`
    checks); only the packed copy is kept, so the memory is what packing the parts separately
    would take.
    """

    __slots__ = ("parts", "params", "key", "weight", "bias", "pad_one")

    def __init__(self, parts: list[torch.nn.Linear]) -> None:
        self.parts = parts
        # The parts' parameter dicts: the check runs twice a layer per step, and a dict lookup
        # costs a fraction of ``Module.__getattr__`` (the tuple of attribute reads this
        # replaced took ~4.4 us a call, ~0.2 ms of a ~12 ms decode step on the embedded model).
        self.params = [m._parameters for m in parts]
        self.key: list[int] = []   # (data_ptr, version) of each part's weight, flattened
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.pad_one = False   # packed_linear.single_row_differs for the packed weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        version = packed_linear.weight_version
        key = self.key
        stale = not key
        if not stale:
            i = 0
            for params in self.params:
                w = params["weight"]
                if w.data_ptr() != key[i] or version(w) != key[i + 1]:
                    stale = True
                    break
                i += 2
        if stale:
            self._pack(version)
        return packed_linear.packed_matmul(x, self.weight, self.bias, self.pad_one)

    def _pack(self, version: Callable[[torch.Tensor], int]) -> None:
        """Concatenate and pack the parts' current weights (and biases); remember their key."""
        with torch.no_grad():
            weights = [params["weight"] for params in self.params]
            self.weight = torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([w.detach() for w in weights]), packed_linear.PACK_HINT_ROWS)
            self.pad_one = packed_linear.single_row_differs(
                self.weight, weights[0].shape[1], weights[0].dtype)
            biases = [m.bias for m in self.parts]
            self.bias = (None if biases[0] is None
                         else torch.cat([b.detach() for b in biases]))
        self.key = [v for w in weights for v in (w.data_ptr(), version(w))]


def _module_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward (packed where it is a PackedLinear)."""
    return module.forward(x)


def _plain_linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` on the module's weight, even where it is a PackedLinear (one-token
    forwards only: the attribute reads cost ~1 us against a ~70 ms float32 step)."""
    return F.linear(x, module.weight, module.bias)


class _Layer:
    """What one decoder layer's forward reads, resolved once."""

    __slots__ = ("idx", "in_norm", "in_eps", "post_norm", "post_eps", "q", "k", "v", "o",
                 "q_norm", "k_norm", "gate", "up", "down", "qkv", "gate_up", "qkv_cat",
                 "gate_up_cat", "window",
                 "scaling")

    def __init__(self, layer: torch.nn.Module, window_source: str, config: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.idx = int(attn.layer_idx)
        self.in_norm = layer.input_layernorm.weight
        self.in_eps = float(layer.input_layernorm.variance_epsilon)
        self.post_norm = layer.post_attention_layernorm.weight
        self.post_eps = float(layer.post_attention_layernorm.variance_epsilon)
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.qkv = _Fused([self.q, self.k, self.v])
        self.gate_up = _Fused([self.gate, self.up])
        self.qkv_cat = _Concat([self.q, self.k, self.v])
        self.gate_up_cat = _Concat([self.gate, self.up])
        if self.q.weight.device.type != "meta":   # concatenate now, not in the first step
            self.qkv_cat.build()
            self.gate_up_cat.build()
        self.scaling = attn.scaling
        if window_source == "config":
            self.window = getattr(config, "sliding_window", None)
        elif window_source == "layer":
            self.window = getattr(attn, "sliding_window", None)
        else:
            self.window = None


class DecoderForward:
    """The lean forward of one supported model (see the module docstring).

    Holds references to the model's modules, not copies: the weights are read where they are
    at every call (the fused packed copies follow them, see :class:`_Fused`).
    """

    def __init__(self, model: torch.nn.Module, pack: bool) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        cfg = model.config
        base = model.model
        self.embed = model.get_input_embeddings()
        self.rotary = base.rotary_emb
        self.norm = base.norm.weight
        self.norm_eps = float(base.norm.variance_epsilon)
        self.head = model.get_output_embeddings()
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None)
                            or cfg.hidden_size // cfg.num_attention_heads)
        # the native model sets every layer's window on its attention module
        source = ("layer" if isinstance(model, native_model.NativeCausalLM)
                  else _WINDOW_SOURCE[type(model).__name__])
        self.layers = [_Layer(layer, source, cfg)
                       for layer in base.layers[: cfg.num_hidden_layers]]
        #: fused GEMMs run only where the separate projections would take the packed path
        self.pack = pack
        #: a one-token float32 forward takes ``F.linear`` instead of the packed GEMMs (set by
        #: the runner when it is configured with one thread): on one thread oneDNN's packed
        #: float32 GEMMs of a single row took 1.25x MKL's (``radixkv bench linears``; decode
        #: of one sequence 82 against 74 ms a step on the AVX2 EPYC), while from two rows, or
        #: on two threads, the packed one wins. Only with one configured thread, so that a
        #: runner whose thread count follows the load (ModelRunner.thread_invariant) never
        #: mixes the two for the same batch.
        self.plain_single_row = False

    def layer_gemms(self) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor], int]]:
        """Layer 0's four GEMMs as the forward calls them: (name, the call, its input width)
        for q/k/v, o, gate/up and down, every weight shape of a layer."""
        lay = self.layers[0]
        return [("q/k/v", lay.qkv, lay.q.in_features), ("o", lay.o.forward, lay.o.in_features),
                ("gate/up", lay.gate_up, lay.gate.in_features),
                ("down", lay.down.forward, lay.down.in_features)]

    def warm_gemms(self, rows: int, head: bool) -> None:
        """Run :meth:`layer_gemms` and, with ``head``, the output head on ``rows`` rows of
        zeros, so that oneDNN has built its kernel for that row count (at the calling thread's
        count) before a request needs it (``ModelRunner.warm_up``). Only meaningful for packed
        CPU GEMMs; harmless elsewhere."""
        dtype = self.layers[0].o.weight.dtype
        with torch.inference_mode():
            for _, gemm, width in self.layer_gemms():
                gemm(torch.zeros(rows, width, dtype=dtype))
            if head:
                self.head(torch.zeros(rows, self.head.in_features, dtype=dtype))

    def thread_variance(self, threads: int, row_counts: Sequence[int]) -> str | None:
        """Where :meth:`layer_gemms` give other bits on ``threads`` threads than on one (None:
        nowhere); see :func:`packed_linear.thread_variance`. Builds the packed copies if no
        forward has."""
        return packed_linear.thread_variance(self.layer_gemms(), self.layers[0].o.weight.dtype,
                                             threads, row_counts)

    def __call__(self, ctx: attention.PagedAttentionContext) -> torch.Tensor:
        """Logits (float32 ``[num_logits, vocab]``) of ``ctx.batch``, writing its K/V.

        Per layer (the launches of a decode step; ``fused`` = :mod:`radixkv.kernels.fused`)::

            h, x = fused.add_rms_norm(delta, x)      residual add + input norm (layer 0: norm)
            qkv  = h @ Wqkv^T (+ b)                   one GEMM
            q    = fused.rope_write_kv(q, k, v)       rope, K/V into their slots
            out  = fused.paged_decode(q)              attention (prefill: the prefill kernel)
            delta = out @ Wo^T
            h, x = fused.add_rms_norm(delta, x)      residual add + post-attention norm
            act  = fused.silu_mul(h @ Wgate_up^T)     one GEMM, one activation
            delta = act @ Wdown^T                     (added at the next layer's norm)

        No op inside a layer reads a tensor's value on the host or converts a dtype.
        """
        batch = ctx.batch
        ids = batch.input_ids[0]
        t = ids.shape[0]
        x = self.embed(ids)                                        # [T, hidden]
        cos, sin = self.rotary(x, batch.position_ids)              # [1, T, D] each
        cos, sin = cos[0], sin[0]                                  # [T, D]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        single_plain = t == 1 and self.plain_single_row and x.dtype is torch.float32
        packed = (self.pack and x.dtype in packed_linear.PACKED_DTYPES
                  and x.device.type == "cpu" and not single_plain)
        linear = _plain_linear if single_plain else _module_linear
        host_lens = list(batch.host_seq_lens)    # the decode op's CPU planning input
        ops = _layer_ops(x)
        if ops is _DIRECT_OPS:
            ops = _CpuForwardOps(host_lens).ops() if _native_cpu_ops[0] else _REFERENCE_OPS
        rows = batch.logits_indices
        r = int(rows.shape[0])
        last = self.layers[-1]
        delta = None
        for lay in self.layers:
            if delta is None:
                h = ops.rms_norm(x, lay.in_norm, lay.in_eps)
            else:
                h, x = ops.add_rms_norm(delta, x, lay.in_norm, lay.in_eps)
            qkv = (lay.qkv(h) if packed else lay.qkv_cat(h)).view(t, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
            if lay.q_norm is not None:
                q = ops.rms_norm(q, lay.q_norm.weight, float(lay.q_norm.variance_epsilon))
                k = ops.rms_norm(k, lay.k_norm.weight, float(lay.k_norm.variance_epsilon))
            out = self._attention(ctx, lay, q, k, v, cos, sin, host_lens, ops)
            n = t
            if lay is last and r < t:
                # Every row's K/V is written; past the last layer's attention only the rows
                # whose logits are wanted matter (module doc: "the last layer")
                if r == 0:
                    return x.new_empty((0, self.head.out_features), dtype=torch.float32)
                out, x, n = out.index_select(0, rows), x.index_select(0, rows), r
            delta = linear(lay.o, out.view(n, hq * d))
            h, x = ops.add_rms_norm(delta, x, lay.post_norm, lay.post_eps)
            gate_up = lay.gate_up(h) if packed else lay.gate_up_cat(h)
            delta = linear(lay.down, ops.silu_mul(gate_up))
        if r < t:
            final, _ = ops.add_rms_norm(delta, x, self.norm, self.norm_eps)
        else:
            final, _ = ops.add_rms_norm(delta.index_select(0, rows), x.index_select(0, rows),
                                        self.norm, self.norm_eps)
        return linear(self.head, final).float()

    @staticmethod
    def _attention(ctx: attention.PagedAttentionContext, lay: _Layer, q: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, host_lens: list[int], ops: _Ops) -> torch.Tensor:
        """Rope, the K/V write and attention of one layer; ``[T, Hq, D]`` out."""
        batch = ctx.batch
        kv = ctx.kv_cache[lay.idx]                  # [2, num_blocks, block_size, Hkv, D]
        if kv.dtype in attention.QUANTIZED_STORAGE:
            # int8 / fp8 rows: kv_quant writes them (quantizing once); attend reads them.
            return attention.attend(ctx, lay.idx, fused.rope_ref(q, cos, sin),
                                    fused.rope_ref(k, cos, sin), v.contiguous(), lay.scaling,
                                    lay.window)
        k_cache, v_cache = kv[0], kv[1]
        q = ops.rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, batch.slot_mapping,
                              batch.has_pad_slots)
        scale = lay.scaling if lay.scaling is not None else q.shape[-1] ** -0.5
        if lay.window is not None and batch.max_seq_len > lay.window:
            # A window that no sequence reaches changes nothing: those layers keep the fast path.
            return kernels.paged_attention_windowed(
                q, k_cache, v_cache, batch.block_tables, batch.host_cu_seqlens_q,
                batch.host_seq_lens, scale, torch.empty_like(q), window=lay.window,
                softcap=None)
        if batch.mode is AttentionMode.DECODE:
            return ops.paged_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                    scale, host_lens)
        return kernels.paged_prefill_attention(
            q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, batch.seq_lens,
            scale=scale, check=False, plan=ctx.plan)
