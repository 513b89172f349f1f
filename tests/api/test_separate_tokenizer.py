"""``Engine.from_pretrained(tokenizer=...)`` / ``radixkv serve --tokenizer`` (vLLM's): the
tokenizer comes from another place than the model. Checked up front (a missing or empty
location is a ConfigError before anything loads) and after loading (a tokenizer with more
tokens than the model embeds is another model's)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from radixkv import models
from radixkv.errors import ConfigError

pytestmark = pytest.mark.model


def _embedded_tokenizer_copy(where: Path, *, extra_tokens: int = 0) -> Path:
    """The embedded model's tokenizer saved to ``where`` with a marker (model_max_length
    12345) and a chat template of its own, plus ``extra_tokens`` added tokens."""
    try:   # a copy: load_tokenizer's object is cached for the whole process
        tok = copy.deepcopy(models.load_tokenizer())
    except ConfigError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"embedded model unavailable: {exc}")
    tok.model_max_length = 12345
    tok.chat_template = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + "
                         "m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                         "{%- endif %}{# separate-tokenizer marker #}")
    if extra_tokens:
        tok.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    tok.save_pretrained(str(where))
    return where


def test_a_missing_or_wrong_tokenizer_location_is_refused_before_loading(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        models.resolve_tokenizer(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has none of tokenizer.json"):
        models.resolve_tokenizer(empty)
    stray = tmp_path / "notes.txt"
    stray.write_text("x")
    with pytest.raises(ConfigError, match="not a directory or a GGUF file"):
        models.resolve_tokenizer(stray)
    with pytest.raises(ConfigError, match="Hugging Face cache"):
        models.resolve_tokenizer("no-such-owner/no-such-tokenizer")
    with pytest.raises(ConfigError, match="must be a path or a hub id"):
        models.resolve_tokenizer(42)   # type: ignore[arg-type]
    from radixkv.api.engine import Engine

    with pytest.raises(ConfigError, match="does not exist"):   # from_pretrained checks first
        Engine.from_pretrained(tokenizer=str(tmp_path / "nope"), progress=False)


def test_the_engine_uses_the_separate_tokenizer_and_refuses_a_larger_one(tmp_path) -> None:
    from radixkv.api.engine import Engine
    from radixkv.config import CacheConfig

    own = _embedded_tokenizer_copy(tmp_path / "tok")
    eng = Engine.from_pretrained(cache_config=CacheConfig(num_device_blocks=64),
                                 tokenizer=str(own), progress=False)
    try:
        assert eng.tokenizer.init_kwargs.get("model_max_length") == 12345
        assert "separate-tokenizer marker" in eng.tokenizer.chat_template
        out = eng.generate("The capital of France is", {"max_tokens": 3, "temperature": 0})
        assert out[0].outputs[0].token_ids                       # it runs with it
        assert models.tokenizer_of(tokenizer=str(own)).init_kwargs.get(
            "model_max_length") == 12345                          # what the fleet ingress loads
    finally:
        eng.close()
    bigger = _embedded_tokenizer_copy(tmp_path / "bigger", extra_tokens=3)
    with pytest.raises(ConfigError, match="the tokenizer has 49155 tokens but the model "
                                          "embeds 49152"):
        Engine.from_pretrained(cache_config=CacheConfig(num_device_blocks=64),
                               tokenizer=str(bigger), progress=False)


def test_the_copies_leave_the_processs_cached_tokenizer_alone(tmp_path) -> None:
    """load_tokenizer's object is shared by the whole process (every later engine and test
    gets it): the helper above must work on a copy."""
    before = models.load_tokenizer()
    size, limit = len(before), before.model_max_length
    _embedded_tokenizer_copy(tmp_path / "t", extra_tokens=2)
    assert models.load_tokenizer() is before
    assert len(before) == size and before.model_max_length == limit
