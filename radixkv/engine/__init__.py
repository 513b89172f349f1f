"""The engine: ``LLMEngine``'s step loop (``Scheduler`` -> ``ModelRunner`` -> sampling); see
docs/architecture.md. The public surface is ``__all__`` (each name imported on first use)."""

from __future__ import annotations

from radixkv._lazy import lazy_getattr

_LAZY = {
    "LLMEngine": "radixkv.engine.llm_engine",
    "Scheduler": "radixkv.engine.scheduler",
    "ModelRunner": "radixkv.engine.model_runner",
    "SamplingParams": "radixkv.engine.sampling",
    "RequestOutput": "radixkv.engine.outputs",
    "CompletionOutput": "radixkv.engine.outputs",
    "TokenLogprob": "radixkv.engine.outputs",
    "CachePoint": "radixkv.engine.cache_points",
}
"""name -> module that defines it: imported on first attribute access, so importing one
submodule of this package does not import the others (nor torch, where they need it)."""

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
