"""Paged-attention kernels (installed as radixkv.kernels). See docs/kernels.md.

Each operation has three implementations behind one checked launcher: a Triton kernel
(``triton_attention``, ``triton_cache``; used on CUDA), an efficient torch path (``torch_path``;
used on the CPU) and a plain reference (``reference``; for tests).

This folder sits at the top of the source tree, so wherever the tree's root is on ``sys.path``
(``python -m pytest`` or ``python -c`` run there) ``import kernels`` would find it first.
transformers imports a top-level ``kernels`` (Hugging Face's hub kernels package, a hard
dependency from transformers 5.25) when it is installed: ``from kernels import CUDAProperties``
then failed on this folder. So, imported under that name, this file loads the real ``kernels``
from the rest of ``sys.path`` in its place, or, where there is none, raises
``ModuleNotFoundError`` as if this folder were not there.
"""

if __name__ == "kernels":
    import os as _os
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec

    def _other_kernels() -> object:
        here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
        rest = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != here]
        spec = _PathFinder.find_spec("kernels", rest)
        if spec is None or spec.loader is None:
            del _sys.modules["kernels"]
            raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
        module = _module_from_spec(spec)
        _sys.modules["kernels"] = module  # the import statement returns what is here at the end
        try:
            spec.loader.exec_module(module)
        except BaseException:
            _sys.modules.pop("kernels", None)
            raise
        return module

    _other_kernels()
else:
    from .ops import (
        copy_blocks,
        gather_blocks,
        paged_decode_attention,
        paged_prefill_attention,
        scatter_blocks,
        write_kv,
    )
    from .reference import PAD_SLOT
    from .windowed import paged_attention_windowed

    __all__ = [
        "PAD_SLOT", "write_kv", "paged_decode_attention", "paged_prefill_attention", "copy_blocks",
        "gather_blocks", "scatter_blocks", "paged_attention_windowed",
    ]
