"""``radixkv serve --enable-ssl-refresh``: a rotated certificate is served without a restart.

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


def _stamp(paths: list[str]) -> tuple[Any, ...]:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class RefreshingServer(uvicorn.Server):
    """uvicorn's server, plus a task that reloads the TLS files when they change."""

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
