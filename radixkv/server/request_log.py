"""Request and output logging, as ``vllm serve --enable-log-requests --enable-log-outputs``.

Why: an operator debugging a deployment (which parameters did that client send, what did the
model answer) needs a log line per request that names it by the id its response carries. The
lines follow vLLM's, so log pipelines that parse them keep working:

* ``Received request ID: params: SamplingParams(...), prompt_tokens: N.`` (INFO) when a request
  reaches the engine, and at DEBUG its prompt's token ids and text;
* ``Generated response ID: output: 'text', finish_reason: R`` (INFO, ``--enable-log-outputs``)
  when it finishes, and at DEBUG its output token ids.

ID is the response's ``id`` (``chatcmpl-<X-Request-Id>`` when the request carries a usable
header, as vLLM names it; the engine's own id adds a random suffix there, so two requests with
one header both run, and the log keeps the name the client and its proxy know); a non-streamed
completion runs each prompt as ``ID-0``, ``ID-1``, ... and a chat is ``ID`` (as vLLM names
them). ``--max-log-len N``
cuts every prompt, output text and id list to N characters / ids. The lines go to the
``radixkv.requests`` logger, which ``radixkv serve`` sends to stderr at INFO (DEBUG with
``--log-level debug``) when the flag is on; off, nothing here runs (one attribute test a
request).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("radixkv.requests")


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`install` adds (its own class, so a second call finds it)."""


def install(debug: bool) -> None:
    """Send ``radixkv.requests`` to stderr (``radixkv serve`` with ``--enable-log-requests``):
    INFO, or DEBUG (prompt and output ids) with ``debug``. Idempotent."""
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.DEBUG if debug else logging.INFO)
    log.propagate = False


def _cut(items: Any, limit: int | None) -> Any:
    return items if limit is None or items is None else items[:limit]


def received(request_id: str, prompt_ids: Sequence[int], params: Any, limit: int | None,
             decode: Callable[[list[int]], str]) -> None:
    """The request reached the engine (``decode`` runs only at DEBUG)."""
    if log.isEnabledFor(logging.DEBUG):
        ids = list(_cut(prompt_ids, limit))
        log.debug("Request %s details: prompt: %r, prompt_token_ids: %s.", request_id,
                  _cut(decode(list(prompt_ids)), limit), ids)
    log.info("Received request %s: params: %r, prompt_tokens: %d.", request_id, params,
             len(prompt_ids))


def generated(request_id: str, out: Any, limit: int | None) -> None:
    """The request finished: each sequence's text and finish reason (``out``: its final
    ``RequestOutput``)."""
    for c in out.outputs:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("Generated response %s details: output_token_ids: %s", request_id,
                      list(_cut(list(c.token_ids), limit)))
        log.info("Generated response %s%s: output: %r, finish_reason: %s", request_id,
                 f" (sequence {c.index})" if len(out.outputs) > 1 else "",
                 _cut(c.text, limit), c.finish_reason)
