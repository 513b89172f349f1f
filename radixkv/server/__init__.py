"""radixkv's OpenAI-compatible HTTP server (``radixkv serve``); see docs/serve.md.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client): ``pip install radixkv[serve]``.
The public surface is ``__all__`` (each name imported on first use).
"""

from __future__ import annotations

from radixkv._lazy import lazy_getattr

_LAZY = {
    "create_app": "radixkv.server.app",
    "ServerState": "radixkv.server.app",
    "Backend": "radixkv.server.backend",
    "LocalBackend": "radixkv.server.backend",
    "RequestHandle": "radixkv.server.backend",
}
"""name -> module that defines it: imported on first attribute access, so importing one
submodule of this package does not import the others (nor FastAPI, where they need it)."""

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
