"""radixkv's own module tree for the Llama-family decoders the lean forward runs.

Why: a start of the embedded model spent ~1.4 s of its ~4 s importing parts of transformers that
radixkv never runs. Building a ``LlamaForCausalLM`` (its config class included) imports
transformers' hub-kernel, tensor-parallel and mask modules, which import
``torch.distributed.tensor``, ``torch._dynamo`` and sympy. The lean forward
(:mod:`radixkv.engine.decoder_forward`) reads only the weights, the norms' epsilons and the
rotary frequencies, so for the architectures it supports radixkv defines those itself: plain
``nn.Linear``/``nn.Embedding`` modules under transformers' parameter names, loaded straight from
the checkpoint's safetensors. This is what vLLM and SGLang do for every model; transformers'
classes stay the path for everything else (``model_impl="transformers"``, and ``"auto"`` when a
config asks for something this module does not define).

Exactness: the module tree and the rotary frequencies are transformers' (same shapes, same
float32 ``inv_freq`` buffer, same cos/sin arithmetic), so the lean forward over a native model
computes bit for bit what it computes over transformers' model of the same checkpoint
(``tests/engine/test_native_model.py`` checks logits and KV for every supported type, fp32 and
bf16). A config is accepted only when every field the forward depends on is present or has the
same default in all four transformers config classes; otherwise :func:`parse_config` says which
field is missing and the caller falls back to transformers.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

#: model_type -> the transformers class whose forward the native model reproduces
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
#: fields with no default shared by the four config classes: a config must state them
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "rms_norm_eps")


class NativeUnsupported(ValueError):
    """The checkpoint asks for something the native model does not define (the message says
    what); loaders fall back to transformers' classes."""


class NativeConfig(SimpleNamespace):
    """Every field of ``config.json`` as an attribute (as transformers' configs give them),
    plus the normalised ones the model and the engine read: ``head_dim``, ``rope_parameters``,
    ``sliding_window`` and ``layer_types`` as transformers' config class would set them, and
    the module tree's own: ``layer_windows`` and which projections have biases (``has_*``)."""


def parse_config(raw: dict[str, Any], name_or_path: str = "") -> NativeConfig:
    """The native config of ``raw`` (a parsed ``config.json``), or :class:`NativeUnsupported`
    naming the first thing it cannot reproduce exactly."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise NativeUnsupported(f"model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[model_type]
    if raw.get("architectures") not in (None, [arch]):
        raise NativeUnsupported(f"architectures {raw['architectures']} (expected [{arch!r}])")
    for key in ("quantization_config", "auto_map"):
        if raw.get(key):
            raise NativeUnsupported(f"the config has {key}")
    missing = [k for k in _REQUIRED if raw.get(k) is None]
    if model_type == "qwen3" and raw.get("head_dim") is None:
        missing.append("head_dim")          # Qwen3Config's default (128) is not hidden / heads
    if missing:
        raise NativeUnsupported(f"the config does not state {missing}")
    if raw.get("hidden_act", "silu") != "silu":
        raise NativeUnsupported(f"hidden_act {raw['hidden_act']!r}")
    if raw.get("pretraining_tp", 1) not in (None, 1):
        raise NativeUnsupported("pretraining_tp > 1")
    cfg = NativeConfig(**raw)
    cfg._name_or_path = name_or_path
    cfg.head_dim = int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])
    cfg.tie_word_embeddings = bool(raw.get("tie_word_embeddings", False))
    cfg.rope_parameters = _rope_parameters(raw)
    layers = int(raw["num_hidden_layers"])
    if model_type in ("qwen2", "qwen3"):
        # Qwen*Config.__post_init__: the window exists only with use_sliding_window, and then
        # only on the layers from max_window_layers up (unless layer_types says otherwise).
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        cfg.sliding_window = window
        types = raw.get("layer_types")
        if types is None:
            if window is not None and raw.get("max_window_layers") is None:
                raise NativeUnsupported("use_sliding_window without max_window_layers")
            types = ["sliding_attention" if window is not None and i >= raw["max_window_layers"]
                     else "full_attention" for i in range(layers)]
        cfg.layer_types = list(types)
        windows = [window if t == "sliding_attention" else None for t in cfg.layer_types]
    elif model_type == "mistral":
        if "layer_types" in raw:
            raise NativeUnsupported("a Mistral config with layer_types")
        cfg.sliding_window = raw.get("sliding_window")
        windows = [cfg.sliding_window] * layers
    else:
        windows = [None] * layers
    if len(windows) != layers or any(t not in ("full_attention", "sliding_attention")
                                     for t in getattr(cfg, "layer_types", ())):
        raise NativeUnsupported(f"layer_types {getattr(cfg, 'layer_types', None)}")
    cfg.layer_windows = windows
    bias = {"llama": (raw.get("attention_bias", False),) * 2 + (raw.get("mlp_bias", False),),
            "mistral": (False, False, False),
            "qwen2": (True, False, False),
            "qwen3": (raw.get("attention_bias", False),) * 2 + (False,)}[model_type]
    cfg.has_qkv_bias, cfg.has_o_bias, cfg.has_mlp_bias = (bool(b) for b in bias)
    cfg.qk_norm = model_type == "qwen3"
    cfg.architectures = [arch]
    cfg._attn_implementation = "radixkv-native"
    return cfg


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` as transformers standardises it, for the two types defined here."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise NativeUnsupported("the config does not state rope_theta")
    if raw.get("partial_rotary_factor") is not None or "partial_rotary_factor" in params:
        raise NativeUnsupported("partial_rotary_factor")
    rope_type = params.get("rope_type", params.get("type", "default"))
    params.update(rope_type=rope_type, rope_theta=float(theta))
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings",
                                  raw.get("max_position_embeddings")))
        need = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
        if any(params.get(k) is None for k in need):
            raise NativeUnsupported(f"llama3 rope parameters lack one of {need}")
    elif rope_type != "default":
        raise NativeUnsupported(f"rope_type {rope_type!r} (defined here: default, llama3)")
    return params


def inv_freq(cfg: NativeConfig) -> torch.Tensor:
    """Rotary inverse frequencies (float32, ``[head_dim // 2]``), computed with transformers'
    operations in transformers' order (so equal to its buffer bit for bit)."""
    p = cfg.rope_parameters
    dim = cfg.head_dim
    inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64)
                                     .to(dtype=torch.float) / dim))
    if p["rope_type"] == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RMSNorm(nn.Module):
    """Weights and epsilon of an RMS norm (the lean forward applies it)."""

    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory))
        self.variance_epsilon = float(eps)


class Rotary(nn.Module):
    """Rotary cos/sin for given positions, as transformers' default-type rotary modules
    compute them (float32 products and cos/sin, cast to the activations' dtype)."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        freq = inv_freq(cfg)
        self.inv_freq = nn.Buffer(freq, persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device,
                                                                   dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: NativeConfig, idx: int, **factory: Any) -> None:
        super().__init__()
        d, hq, hkv, hidden = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
            cfg.hidden_size
        self.layer_idx = idx
        self.head_dim = d
        self.scaling = d ** -0.5
        self.sliding_window = cfg.layer_windows[idx]
        self.q_proj = nn.Linear(hidden, hq * d, bias=cfg.has_qkv_bias, **factory)
        self.k_proj = nn.Linear(hidden, hkv * d, bias=cfg.has_qkv_bias, **factory)
        self.v_proj = nn.Linear(hidden, hkv * d, bias=cfg.has_qkv_bias, **factory)
        self.o_proj = nn.Linear(hq * d, hidden, bias=cfg.has_o_bias, **factory)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, **factory)


class MLP(nn.Module):
    def __init__(self, cfg: NativeConfig, **factory: Any) -> None:
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.has_mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b, **factory)
        self.up_proj = nn.Linear(h, i, bias=b, **factory)
        self.down_proj = nn.Linear(i, h, bias=b, **factory)
        self.act_fn = nn.SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: NativeConfig, idx: int, **factory: Any) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, idx, **factory)
        self.mlp = MLP(cfg, **factory)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)


class Decoder(nn.Module):
    def __init__(self, cfg: NativeConfig, **factory: Any) -> None:
        super().__init__()
        # _weight: no random init (on the meta device, normal_ would import torch._dynamo)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(
            cfg.vocab_size, cfg.hidden_size, **factory), _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, **factory)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **factory)


class NativeCausalLM(nn.Module):
    """A supported decoder's weights under transformers' names (``model.layers.3.mlp.up_proj
    .weight``, ...), its config and generation config. It has no forward of its own: the
    engine runs it through :class:`radixkv.engine.decoder_forward.DecoderForward`."""

    def __init__(self, cfg: NativeConfig, generation_config: Any = None,
                 device: Any = "meta", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.generation_config = generation_config
        factory = {"device": device, "dtype": dtype}
        self.model = Decoder(cfg, **factory)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, **factory)
        self.model.rotary_emb = Rotary(cfg)     # float32 on the CPU, like transformers'

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("radixkv's native model runs only inside the engine (its lean forward); "
                        "load with model_impl='transformers' for a transformers model")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (one, or the shards its index names); raises
    :class:`NativeUnsupported` when there are none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise NativeUnsupported(f"shards {missing[:3]} of the index are not in {model_dir}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise NativeUnsupported(f"no model.safetensors in {model_dir}")


def load(model_dir: str | Path, dtype: torch.dtype = torch.float32,
         name_or_path: str | None = None,
         progress: Callable[[str], None] | None = None) -> NativeCausalLM:
    """Build the native model of the checkpoint in ``model_dir`` (``config.json``, safetensors,
    optional ``generation_config.json``) in ``dtype`` on the CPU; ``progress`` gets a line per
    safetensors file read and one when the model is built.

    Raises:
        NativeUnsupported: the config or the checkpoint's tensors are not what the native model
            defines (nothing has been loaded then, so the caller can fall back).
    """
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    cfg = parse_config(json.loads((model_dir / "config.json").read_text()),
                       name_or_path if name_or_path is not None else str(model_dir))
    files = safetensors_files(model_dir)
    model = NativeCausalLM(cfg, _generation_config(model_dir, cfg), dtype=dtype)
    state: dict[str, torch.Tensor] = {}
    t0 = time.perf_counter()
    for i, f in enumerate(files, 1):
        if progress is not None:
            progress(f"reading weights {i}/{len(files)}: {f.name} "
                     f"({f.stat().st_size / 2**20:.0f} MiB)")
        state.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    want = set(model.state_dict())
    if set(state) != want:
        extra, lack = sorted(set(state) - want), sorted(want - set(state))
        raise NativeUnsupported(f"checkpoint tensors differ from the native layout "
                                f"(unexpected {extra[:3]}, missing {lack[:3]})")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    odd = [k for k, v in state.items() if tuple(v.shape) != shapes[k]]
    if odd:
        raise NativeUnsupported(f"tensor shapes differ from the config: {odd[:3]}")
    state = {k: v.to(dtype) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if progress is not None:
        progress(f"{ARCHITECTURES[cfg.model_type]} weights loaded into radixkv's modules in "
                 f"{time.perf_counter() - t0:.1f} s ({str(dtype).replace('torch.', '')})")
    return model.eval().requires_grad_(False)


def _generation_config(model_dir: Path, cfg: NativeConfig) -> Any:
    """transformers' ``GenerationConfig`` from ``generation_config.json`` when there is one,
    else from the model config's special tokens (what ``from_pretrained`` sets)."""
    from transformers.generation.configuration_utils import GenerationConfig

    if (model_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(model_dir))
    return GenerationConfig(**{k: getattr(cfg, k) for k in
                               ("bos_token_id", "eos_token_id", "pad_token_id")
                               if getattr(cfg, k, None) is not None})
