"""HTTPS details of ``radixkv serve``: a bounded TLS close, and ``--enable-ssl-refresh`` (a
rotated certificate served without a restart).

**The TLS close.** Closing a TLS connection sends ``close_notify`` and waits for the peer's
(asyncio's ``ssl_shutdown_timeout``, 30 s by default, uvicorn gives no other). At SIGTERM with
``--shutdown-timeout N`` uvicorn closes the idle keep-alive connections and waits until every
connection is gone; a client that keeps an idle connection open and never reads from it (a
pooled HTTP client between requests) answers no ``close_notify``, so the drain took the whole
N s (measured: 20.3 s with N = 20 and one idle ``http.client`` connection, and before this, 10.3 s
with 10). :class:`TLSServer` creates the listening socket with :data:`TLS_CLOSE_S` instead: the
response bytes are all sent before the ``close_notify``, and a peer that does not answer it
within that is dropped.

Why: certificates are short-lived where they are automated (cert-manager, ACME: 60-90 days,
often renewed weekly) and a restart drops the engine's device and host cache. The files are
polled once a second (their modification time, size and inode, so an atomic rename counts),
and on a change the server's ``SSLContext`` loads them again: handshakes from then on present
the new certificate, connections already open keep theirs. The reload runs on the server's
event loop, between handshakes (an ``SSLContext`` is not safe to change under a handshake on
another thread). A half-written or mismatched pair fails to load: the old certificate stays,
the error is printed, and the next change is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from typing import Any

import uvicorn

#: Seconds between two looks at the files.
POLL_S = 1.0
#: Seconds a closing TLS connection waits for the peer's ``close_notify`` (module doc).
TLS_CLOSE_S = 1.0


def _stamp(paths: list[str]) -> tuple[Any, ...]:
    out: list[tuple[int, int, int] | None] = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class TLSServer(uvicorn.Server):
    """uvicorn's server whose TLS connections wait :data:`TLS_CLOSE_S` at most for the peer's
    ``close_notify`` when they close (module doc). uvicorn calls ``loop.create_server`` without
    that (public, Python >= 3.11) argument, so the call is given it on its way."""

    async def startup(self, sockets: Any = None) -> None:
        loop = asyncio.get_running_loop()
        create = loop.create_server

        async def create_server(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("ssl") is not None:
                kwargs.setdefault("ssl_shutdown_timeout", TLS_CLOSE_S)
            return await create(*args, **kwargs)

        loop.create_server = create_server  # type: ignore[method-assign]
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server   # the loop's own method again


class RefreshingServer(TLSServer):
    """:class:`TLSServer`, plus a task that reloads the TLS files when they change."""

    def __init__(self, config: uvicorn.Config, keyfile: str | None, certfile: str,
                 ca_certs: str | None = None) -> None:
        super().__init__(config)
        self.keyfile, self.certfile, self.ca_certs = keyfile, certfile, ca_certs
        self.reloads = 0
        self._watch: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self._watch = asyncio.ensure_future(self._watch_files())

    async def shutdown(self, sockets: Any = None) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await super().shutdown(sockets)

    async def _watch_files(self) -> None:
        paths = [p for p in (self.certfile, self.keyfile, self.ca_certs) if p]
        seen = _stamp(paths)
        while True:
            await asyncio.sleep(POLL_S)
            now = _stamp(paths)
            if now == seen or None in now:
                continue
            seen = now
            self.reload()

    def reload(self) -> bool:
        """Load the files into the live context now; False (the old ones kept) on failure."""
        ctx = self.config.ssl
        if ctx is None:
            return False
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile,
                                self.config.ssl_keyfile_password)
            if self.ca_certs:
                ctx.load_verify_locations(self.ca_certs)
        except (OSError, ValueError) as exc:   # ssl.SSLError is an OSError
            print(f"radixkv serve: TLS files changed but did not load ({exc}); still serving "
                  "the previous certificate", file=sys.stderr, flush=True)
            return False
        self.reloads += 1
        print(f"radixkv serve: reloaded the TLS certificate {self.certfile}", file=sys.stderr,
              flush=True)
        return True
