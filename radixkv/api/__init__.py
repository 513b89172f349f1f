"""The API users call: ``Engine`` (+ its ``EngineLoop`` thread), ``ChatSession``, ``RAGHelper``;
see docs/api.md. The public surface is ``__all__`` (each name imported on first use)."""

from __future__ import annotations

from radixkv._lazy import lazy_getattr

_LAZY = {
    "Engine": "radixkv.api.engine",
    "ChatSession": "radixkv.api.chat",
    "ChatTemplate": "radixkv.api.chat",
    "ChatReply": "radixkv.api.chat",
    "RAGHelper": "radixkv.api.rag",
    "RAGAnswer": "radixkv.api.rag",
    "EngineLoop": "radixkv.api.engine_loop",
    "RequestStream": "radixkv.api.engine_loop",
    "EngineLoopClosed": "radixkv.api.engine_loop",
    "default_model_id": "radixkv.api.engine",
}
"""name -> module that defines it: imported on first attribute access, so importing one
submodule of this package does not import the others (nor torch, where they need it)."""

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
