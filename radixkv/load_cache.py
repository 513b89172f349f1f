"""A converted copy of a GGUF model on local disk, so that only the first start pays for it.

transformers de-quantizes every tensor of a GGUF file on every load (and builds its tokenizer
from the GGUF vocabulary): for the embedded SmolLM2 that was 17-20 s per start on a 2-core CPU.
The first load of a GGUF file therefore saves the converted model (float32 safetensors, exactly
the de-quantized weights) and its tokenizer under the user's cache folder, keyed by the GGUF
file's SHA-256; later starts load that checkpoint (memory-mapped safetensors) instead.

Where: :func:`models_root` (``$RADIXKV_MODEL_CACHE_DIR``, ``$RADIXKV_CACHE_DIR/models``,
``$XDG_CACHE_HOME/radixkv/models`` or ``~/.cache/radixkv/models``, the first that is set). A
folder is published only when complete (written under a temporary
name, then renamed), so a crash mid-write or a second process converting at the same time never
leaves a half copy that a later start would load. Hashing a 100 MB file takes a fraction of a
second; the digest is remembered per (path, size, mtime, ctime, inode) in ``digests.json``
beside the copies.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import dataclasses
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar


class _Source(Protocol):
    """A model source as this module reads it (``models.ModelSource`` is the one; declared here
    so that this module imports no ``models``, which imports it)."""

    @property
    def name_or_path(self) -> str: ...

    @property
    def embedded(self) -> bool: ...

    @property
    def gguf_path(self) -> Path | None: ...

    def hf_kwargs(self) -> dict[str, Any]: ...


_S = TypeVar("_S", bound=_Source)

_COMPLETE = "radixkv-converted.json"   # written last: its presence means the copy is whole


def models_root() -> Path:
    """Folder of converted copies: ``$RADIXKV_MODEL_CACHE_DIR``, else
    ``$RADIXKV_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/radixkv/models``, else
    ``~/.cache/radixkv/models``."""
    env = os.environ.get("RADIXKV_MODEL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    env = os.environ.get("RADIXKV_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "radixkv" / "models"


def file_digest(path: Path) -> str:
    """SHA-256 of ``path``'s bytes, remembered per (path, size, mtime, ctime, inode) in
    ``digests.json``: a file replaced by one of the same size and copied mtime (``cp -p``,
    ``rsync -a``) still has a new ctime or inode, so it is hashed again."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
    index_path = models_root() / "digests.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if isinstance(index, dict) and isinstance(index.get(key), str):
        return index[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    index = index if isinstance(index, dict) else {}
    index[key] = digest
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, index_path)
    except OSError as exc:  # a read-only cache only costs the next start a re-hash
        say(f"could not record the digest in {index_path}: {exc}")
    return digest


def converted_dir(gguf: Path) -> Path:
    """Where the converted copy of GGUF file ``gguf`` lives (whether or not it exists yet)."""
    return models_root() / f"{gguf.stem}-{file_digest(gguf)[:16]}"


def say(msg: str) -> None:
    """One progress line on stderr, prefixed with radixkv."""
    print(f"radixkv: {msg}", file=sys.stderr, flush=True)


def cached_source(source: _S, *, progress: bool = True, create: bool = True) -> _S:
    """``source`` itself, or for a GGUF file the local converted checkpoint, made on first use
    (``create=False``: used only if it exists; a tokenizer alone is not worth converting for).

    Never raises for a cache problem (a full or read-only disk): it says so and returns
    ``source`` unchanged, so the model loads from the GGUF file as before.
    """
    gguf = source.gguf_path
    if gguf is None:
        return source
    target = converted_dir(gguf)
    if (target / _COMPLETE).is_file():
        if progress:
            say(f"loading {gguf.name} from its converted copy in {target}")
        return _converted(source, target)
    if not create:
        return source
    if progress:
        say(f"first load of {gguf.name}: de-quantizing the GGUF file and saving a converted "
             f"copy to {target} (once; later starts load that copy in seconds)")
    try:
        _convert(source, gguf, target)
    except OSError as exc:
        say(f"could not save the converted copy ({exc}); loading from the GGUF file")
        return source
    return _converted(source, target)


def _converted(source: _S, target: Path) -> _S:
    """``source`` pointed at its converted checkpoint in ``target``: a local directory of
    safetensors (no GGUF file name, nothing to download), the same ``embedded`` flag."""
    return dataclasses.replace(source, name_or_path=str(target),  # type: ignore[type-var]
                               gguf_file=None, local_files_only=True)


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` of the same file and ``gguf.get_tensor_name_map``
    of the same arguments are built once and shared.

    Why: transformers parses the GGUF file's metadata anew for the tokenizer, the config and
    the weights (a ``GGUFReader`` per load: ~11 s each for the embedded model's 49,152-entry
    vocabulary on the project's 2-core EPYC), and builds gguf's tensor-name table once per
    submodule of the model (397 times, ~8 s in all). Both are pure functions of their inputs
    and the reader only reads its memory map, so sharing them changes no byte of the
    converted copy (``tests/engine/test_load_cache.py`` compares it with a direct load); the
    first conversion of the embedded model went from 44 to 24 s (2-core AVX2 EPYC); a direct
    load (``cache_converted=False``, :meth:`radixkv.Engine.from_pretrained`) shares the parse
    between the tokenizer and the model the same way. transformers
    imports both names from ``gguf`` inside its functions, so the module attributes are what
    it sees; they are put back on exit. One block at a time in a process (a lock), so that two
    threads converting cannot put back each other's wrappers. Without ``gguf`` the block does
    nothing."""
    try:
        import gguf
    except ImportError:
        yield
        return
    with _GGUF_PATCH_LOCK:
        reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: Any, mode: str = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = reader_cls(path, mode)
            return readers[key]

        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


_GGUF_PATCH_LOCK = threading.Lock()


def _convert(source: _Source, gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        kwargs = source.hf_kwargs()
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(source.name_or_path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(source.name_or_path,
                                                         dtype=torch.float32, **kwargs)
        # The weights are plain float32 now; transformers still marks the model as "quantized
        # with gguf" and refuses to save it, so drop the marker (nothing else depends on it).
        model.hf_quantizer = None
        if "quantization_config" in model.config.__dict__:
            delattr(model.config, "quantization_config")
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / _COMPLETE).write_text(json.dumps(
            {"gguf": str(gguf), "sha256": file_digest(gguf), "dtype": "float32"}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _COMPLETE).is_file():   # not another process's finished copy
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
