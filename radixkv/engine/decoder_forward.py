"""A lean forward for Llama-family decoders: the model's own weights, fewer and fused ops.

Why: on the CPU a decode step of a small model is dominated by what surrounds the GEMMs, not by
the GEMMs alone. transformers' modules spend ~40 small tensor ops and a dozen Python calls per
layer (module dispatch, keyword plumbing, the rotary's ``cat``/``neg``, transposes in and out of
the attention function), and they run q/k/v and gate/up as five GEMMs where two would do: a
576 x 192 K or V projection of the embedded model streams its weight at about half the rate of
the wide ones. This module runs the same arithmetic as transformers' ``*ForCausalLM`` forward
for the architectures it knows, with

* q/k/v as one GEMM and gate/up as one GEMM over pre-packed, concatenated bf16 weights
  (:mod:`radixkv.engine.packed_linear`'s oneDNN path, up to its row limit; larger inputs run the
  separate projections, exactly as transformers does);
* the rotary embedding applied to q and k together in five elementwise ops;
* token-major tensors throughout, handed straight to :func:`radixkv.engine.attention.attend`;
* the final norm and the output head on the rows whose logits are wanted only.

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
(:mod:`radixkv.engine.native_model`, loaded without transformers' model classes). Anything else, Gemma's scaled embeddings and soft-capping, Phi-3's fused projections,
runs through transformers' modules with radixkv's attention hooked in, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from radixkv.engine import attention, native_model, packed_linear

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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, op for op (float32 statistics, scale in the
    input dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype)


class _Fused:
    """One GEMM for several ``nn.Linear`` of the same input, packed for oneDNN.

    The concatenated, packed weight (and bias) is built on first use and rebuilt when any part's
    weight changes (its storage pointer or version, as :class:`packed_linear.PackedLinear`
    checks); only the packed copy is kept, so the memory is what packing the parts separately
    would take.
    """

    __slots__ = ("parts", "key", "weight", "bias")

    def __init__(self, parts: list[torch.nn.Linear]) -> None:
        self.parts = parts
        self.key: tuple = ()
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = tuple((m.weight.data_ptr(), packed_linear._version(m.weight)) for m in self.parts)
        if key != self.key:
            with torch.no_grad():
                w = torch.cat([m.weight.detach() for m in self.parts])
                self.weight = torch.ops.mkldnn._reorder_linear_weight(
                    w, packed_linear._PACK_HINT_ROWS)
                biases = [m.bias for m in self.parts]
                self.bias = (None if biases[0] is None
                             else torch.cat([b.detach() for b in biases]))
            self.key = key
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class _Layer:
    """What one decoder layer's forward reads, resolved once."""

    __slots__ = ("idx", "in_norm", "in_eps", "post_norm", "post_eps", "q", "k", "v", "o",
                 "q_norm", "k_norm", "gate", "up", "down", "qkv", "gate_up", "window",
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

    def __call__(self, ctx: attention.PagedAttentionContext) -> torch.Tensor:
        """Logits (float32 ``[num_logits, vocab]``) of ``ctx.batch``, writing its K/V."""
        batch = ctx.batch
        ids = batch.input_ids[0]
        t = ids.shape[0]
        x = self.embed(ids)                                        # [T, hidden]
        cos, sin = self.rotary(x, batch.position_ids)              # [1, T, D] each
        half = self.head_dim // 2
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]          # [T, 1, D]
        c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        fused = (self.pack and x.dtype is torch.bfloat16 and x.device.type == "cpu"
                 and t <= packed_linear.MAX_PACKED_ROWS)
        for lay in self.layers:
            h = _rms_norm(x, lay.in_norm, lay.in_eps)
            if fused:
                qkv = lay.qkv(h).view(t, hq + 2 * hkv, d)
                q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
            else:
                q = lay.q.forward(h).view(t, hq, d)
                k = lay.k.forward(h).view(t, hkv, d)
                v = lay.v.forward(h).view(t, hkv, d)
            if lay.q_norm is not None:
                q = _rms_norm(q, lay.q_norm.weight, float(lay.q_norm.variance_epsilon))
                k = _rms_norm(k, lay.k_norm.weight, float(lay.k_norm.variance_epsilon))
            q = _rope(q, cos, c1, c2, s1, s2, half)
            k = _rope(k, cos, c1, c2, s1, s2, half)
            out = attention.attend(ctx, lay.idx, q, k, v.contiguous(), lay.scaling, lay.window)
            h = lay.o.forward(out.view(t, hq * d))
            x = h.add_(x)                       # residual + attention (addition commutes)
            h = _rms_norm(x, lay.post_norm, lay.post_eps)
            if fused:
                gu = lay.gate_up(h)
                inter = gu.shape[1] // 2
                act = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
            else:
                act = F.silu(lay.gate.forward(h)).mul_(lay.up.forward(h))
            x = lay.down.forward(act).add_(x)  # residual + MLP
        rows = x.index_select(0, batch.logits_indices)
        rows = _rms_norm(rows, self.norm, self.norm_eps)
        return self.head.forward(rows).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
          s1: torch.Tensor, s2: torch.Tensor, half: int) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (``rotate_half(x) = [-x2, x1]``) in
    five ops instead of seven, rounding exactly as it does: ``x1*c1 + (-x2)*s1`` is
    ``x1*c1 - x2*s1`` in IEEE arithmetic, product by product. Returns a new contiguous
    ``[T, H, D]`` tensor (``x`` may be a strided view of the fused q/k/v output)."""
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half].sub_(x2 * s1)
    out[..., half:].add_(x1 * s2)
    return out
