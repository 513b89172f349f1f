"""radixkv's OpenAI-compatible HTTP server (``radixkv serve``); see docs/serve.md.

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client): ``pip install radixkv[serve]``.
"""
