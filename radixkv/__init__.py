"""radixkv: never compute the same KV cache twice.

The bookkeeping layer (``radixkv.core``) imports no torch; the engine and API import it lazily so
``import radixkv`` stays cheap.
"""

from __future__ import annotations

from radixkv._lazy import lazy_getattr
from radixkv.errors import (
    ConfigError, EngineClosedError, InvalidBlockError, InvalidRequestError, InvalidTokensError,
    OutOfBlocks, RadixKVError, SequenceExistsError, StorageError, UnknownDocumentError,
    UnknownRequestError, UnknownSequenceError,
)

__version__ = "0.1.0"

_LAZY = {
    # name -> module that defines it (imported on first attribute access; pulls in torch)
    "Engine": "radixkv.api.engine",
    "SamplingParams": "radixkv.engine.sampling",
    "CachePoint": "radixkv.engine.cache_points",
    "CacheConfig": "radixkv.config",
    "ChatSession": "radixkv.api.chat",
    "RAGHelper": "radixkv.api.rag",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "RadixKVError", "ConfigError", "InvalidTokensError", "InvalidRequestError",
    "UnknownSequenceError", "SequenceExistsError", "InvalidBlockError", "OutOfBlocks",
    "StorageError", "UnknownRequestError", "UnknownDocumentError", "EngineClosedError", *_LAZY,
]
