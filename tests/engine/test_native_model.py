"""radixkv's own module tree (engine/native_model.py) loads a checkpoint into exactly what the
lean forward computes over transformers' model of it, and falls back where it does not apply.

Each family is built from a tiny random config, saved with ``save_pretrained`` and loaded twice
from the same files: by transformers (``AutoModelForCausalLM.from_pretrained``, what radixkv
loaded before) and by :func:`native_model.load`. Both run through the lean forward for the same
cold chunks, cached extends and decode steps; logits and every KV slot must be bit-identical.
The embedded model's tokenizer is checked against ``AutoTokenizer``'s, and a start of the
embedded engine must not import the transformers and torch modules whose import time this is
for (what the time itself is goes to ``radixkv bench engine``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixkv.engine import native_model
from radixkv.engine.model_runner import ModelRunner
from radixkv.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import hf_generate  # noqa: E402
from test_model_families import COMMON, FAMILIES, make_family_model  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
NATIVE_CASES = ["llama", "llama_bias_llama3", "qwen2", "qwen2_window", "qwen3",
                "mistral_window"]


def _build(case: str) -> torch.nn.Module:
    if case == "llama_bias_llama3":
        import transformers

        config = transformers.LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True,
                                          tie_word_embeddings=True,
                                          rope_parameters=dict(LLAMA3_ROPE))
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return make_family_model(case)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> directory of its saved tiny checkpoint (float32 safetensors)."""
    out = {}
    for case in NATIVE_CASES + ["phi3"]:
        path = tmp_path_factory.mktemp(case)
        _build(case).save_pretrained(str(path))
        out[case] = path
    return out


def _hf(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", NATIVE_CASES)
def test_native_model_is_bit_identical_to_transformers_model(case, dtype, saved, toy_pager):
    native = native_model.load(saved[case], dtype)
    hf = _hf(saved[case], dtype)
    assert type(native) is native_model.NativeCausalLM
    assert torch.equal(native.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert native.model.rotary_emb.inv_freq.dtype == hf.model.rotary_emb.inv_freq.dtype
    for (name, a), (name_b, b) in zip(sorted(native.state_dict().items()),
                                      sorted(hf.state_dict().items())):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a, b), name
    assert (native.lm_head.weight is native.model.embed_tokens.weight) == \
        (hf.lm_head.weight is hf.model.embed_tokens.weight)
    runners = [ModelRunner.for_model(m, 256, 4, lean_forward=True) for m in (native, hf)]
    assert [lay.window for lay in runners[0].lean.layers] == \
        [lay.window for lay in runners[1].lean.layers]
    assert runners[0].sliding_window == runners[1].sliding_window
    pagers = [toy_pager(256, 4, seed=1), toy_pager(256, 4, seed=1)]
    g = torch.Generator().manual_seed(5)
    lengths = {0: 23, 1: 9, 2: 31}
    prompts = {s: torch.randint(0, 256, (n,), generator=g).tolist() for s, n in lengths.items()}
    for pager in pagers:
        for s, p in prompts.items():
            pager.add(s, p)

    def step(plan):
        outs = [r.execute(r.build_batch([p.chunk(s, n) for s, n in plan]))
                for r, p in zip(runners, pagers)]
        assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()

    step([(0, 12), (1, None), (2, 16)])       # cold chunks
    step([(0, None), (2, None)])              # extends of a cached prefix
    for i in range(4):                        # decode
        for pager in pagers:
            for s in lengths:
                pager.append(s, 3 + 7 * s + i)
        step([(0, None), (1, None), (2, None)])
    assert torch.equal(runners[0].kv_cache, runners[1].kv_cache)


def test_engine_on_a_native_checkpoint_matches_transformers_generate(saved):
    from radixkv import CacheConfig, Engine, SamplingParams
    from radixkv.config import EngineConfig

    engine = Engine.from_pretrained(
        str(saved["qwen2_window"]), cache_config=CacheConfig(block_size=4, num_device_blocks=64),
        engine_config=EngineConfig(max_num_seqs=4), dtype=torch.float32, progress=False)
    try:
        assert isinstance(engine.model, native_model.NativeCausalLM)
        assert engine.model.config._name_or_path == str(saved["qwen2_window"])
        hf = _hf(saved["qwen2_window"], torch.float32)
        prompts = [[5, 9, 31, 7, 8, 100, 3, 4, 22, 17, 1], [5, 9, 31, 7, 8, 100, 3, 4, 60]]
        outs = engine.generate(prompts, SamplingParams(max_tokens=8))
        assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf, p, 8) for p in prompts]
    finally:
        engine.close()


def test_model_impl_choices(saved):
    from radixkv import models

    src = models.resolve_source(str(saved["llama"]))
    assert isinstance(models.load_model(source=src, model_impl="auto"),
                      native_model.NativeCausalLM)
    assert not isinstance(models.load_model(source=src, model_impl="transformers"),
                          native_model.NativeCausalLM)
    phi = models.resolve_source(str(saved["phi3"]))
    assert type(models.load_model(source=phi, model_impl="auto")).__name__ == "Phi3ForCausalLM"
    with pytest.raises(ConfigError, match="model_type 'phi3'"):
        models.load_model(source=phi, model_impl="radixkv")
    with pytest.raises(ConfigError, match="model_impl must be one of"):
        models.load_model(source=src, model_impl="vllm")
    from radixkv import Engine

    calls = []
    with pytest.MonkeyPatch.context() as mp:     # refused before any source is resolved
        mp.setattr(models, "prepare_source", lambda *a, **k: calls.append(1))
        with pytest.raises(ConfigError, match="model_impl must be one of"):
            Engine.from_pretrained(str(saved["llama"]), model_impl="vllm")
    assert not calls


@pytest.mark.parametrize("change, reason", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_configs_it_cannot_reproduce_fall_back(change, reason, saved, tmp_path):
    raw = json.loads((saved["llama"] / "config.json").read_text())
    raw.update(change)
    with pytest.raises(native_model.NativeUnsupported, match=reason):
        native_model.parse_config(raw)


def test_checkpoint_tensors_must_match_the_layout(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((saved["llama"] / name).read_bytes())
    state = load_file(str(saved["llama"] / "model.safetensors"))
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(native_model.NativeUnsupported, match="unexpected .*q_proj.bias"):
        native_model.load(tmp_path)


def test_native_model_runs_only_through_the_lean_forward(saved):
    model = native_model.load(saved["llama"])
    with pytest.raises(ConfigError, match="only through the lean forward"):
        ModelRunner.for_model(model, 16, 4, lean_forward=False)
    with pytest.raises(TypeError, match="model_impl='transformers'"):
        model(torch.tensor([[1, 2]]))


def test_embedded_tokenizer_fast_path_equals_autotokenizer():
    from transformers import AutoTokenizer

    from radixkv import models

    source = models.prepare_source(progress=False)
    assert models._plain_tokenizer_dir(source) is not None
    fast = models._load_tokenizer(source)
    auto = AutoTokenizer.from_pretrained(source.name_or_path, **source.hf_kwargs())
    assert type(fast) is type(auto)
    texts = ["Hello, world!", "  leading spaces\n\ttabs", "<|im_start|>user\nhi<|im_end|>",
             "émoji 🚀 and 数字 123", ""]
    for t in texts:
        assert fast(t)["input_ids"] == auto(t)["input_ids"]
        ids = auto(t)["input_ids"]
        assert fast.decode(ids, skip_special_tokens=True) == \
            auto.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    assert fast.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert fast.all_special_ids == auto.all_special_ids
    assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id) == \
        (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    assert len(fast) == len(auto)


def test_embedded_start_does_not_import_transformers_model_stack():
    """The cause of the start time (issue 17 goal 3): a default start must not import
    transformers' model classes or the torch modules they pull in (the converted copy is made
    here first: converting the GGUF file does use transformers' classes, once)."""
    from radixkv import models

    models.prepare_source(progress=False)
    code = ("import sys, radixkv; e = radixkv.Engine.from_pretrained(progress=False); "
            "print(type(e.model).__name__, sorted(m for m in ('torch.distributed.tensor', "
            "'torch._dynamo', 'sympy', 'transformers.modeling_utils') if m in sys.modules)); "
            "e.close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "NativeCausalLM []", out.stdout + out.stderr


@pytest.mark.parametrize("case", ["qwen2_window", "qwen3", "mistral_window", "llama"])
def test_windows_without_layer_types_follow_transformers_config(case, saved):
    """Older configs state use_sliding_window / max_window_layers but no layer_types: the
    native config derives each layer's window as transformers' config class does."""
    import transformers

    raw = json.loads((saved[case] / "config.json").read_text())
    raw.pop("layer_types", None)
    if case == "qwen3":
        raw.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    native = native_model.parse_config(raw)
    hf = getattr(transformers, FAMILIES[case][0])(**raw)
    assert getattr(native, "sliding_window", None) == getattr(hf, "sliding_window", None)
    assert getattr(native, "layer_types", None) == getattr(hf, "layer_types", None)
    assert native.head_dim == (getattr(hf, "head_dim", None)
                               or hf.hidden_size // hf.num_attention_heads)
    assert native.rope_parameters == hf.rope_parameters


def test_hub_model_in_the_local_cache_loads_natively(saved, tmp_path, monkeypatch):
    """A hub id whose files are in the Hugging Face cache (snapshot of symlinks to blobs, as
    huggingface_hub lays it out) loads into the native tree from there, named by its id; one
    with a shard missing falls back."""
    import huggingface_hub.constants

    from radixkv import models

    repo = tmp_path / "models--tiny--llama"
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for f in saved["llama"].iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(blob)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    source = models.resolve_source("tiny/llama")
    assert source.name_or_path == "tiny/llama" and models.local_dir(source) == snap
    model = models.load_model(source=source, model_impl="radixkv")
    assert isinstance(model, native_model.NativeCausalLM)
    assert model.config._name_or_path == "tiny/llama"
    ref = native_model.load(saved["llama"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 ref.state_dict().values()))
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="shards"):
        models.load_model(source=source, model_impl="radixkv")
