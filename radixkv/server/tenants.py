"""API keys and the cache namespace each request runs in.

The guarantee (docs/serve.md, "Tenants"): with ``--api-key`` set, a request's cache salt always
starts with a salt derived from its key, so two keys never share a KV block in any tier and a
request can neither reuse another key's cached prefix nor observe, by timing, that it exists.
A request's own ``cache_salt`` / ``prompt_cache_key`` is appended to its key's salt: it narrows
the namespace further (separate users of one key), never widens it. Without keys there is one
tenant and the request fields alone choose the namespace.

The key itself never becomes part of a salt (salts reach the disk tier's file headers); a keyed
hash of it does, keyed by a per-server secret so salts are not guessable across servers.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from radixkv.errors import ConfigError


#: The environment variable ``vllm serve`` reads its API key from when ``--api-key`` is not
#: given: a deployment that sets it must not get an open server by switching to radixkv.
API_KEY_ENV = "VLLM_API_KEY"


def read_keys(keys: Iterable[str], key_files: Iterable[str],
              environ: Mapping[str, str] | None = None) -> list[str]:
    """Keys from the command line plus one key per non-empty, non-``#`` line of each file;
    with neither, ``$VLLM_API_KEY`` (``environ``, default the process's) when it is set and
    not empty, as vLLM's."""
    keys, key_files = list(keys), list(key_files)
    if not keys and not key_files:
        env = (os.environ if environ is None else environ).get(API_KEY_ENV, "")
        keys = [env.strip()] if env.strip() else []
    out = [k for k in keys]
    for f in key_files:
        try:
            text = Path(f).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read API key file {f!r}: {exc}") from exc
        out += [ln.strip() for ln in text.splitlines() if ln.strip() and
                not ln.strip().startswith("#")]
    bad = [k for k in out if not k or any(c.isspace() for c in k)]
    if bad:
        raise ConfigError("API keys must be non-empty and contain no whitespace")
    return out


@dataclass(frozen=True)
class Tenants:
    """Which keys may call the server and which cache salt each request gets.

    ``secret`` keys the salt derivation; a server started with the same keys and the same
    ``--salt-secret`` reuses its disk-tier cache across restarts (default: random per start).
    """

    keys: tuple[str, ...] = ()
    secret: bytes = b""

    @classmethod
    def create(cls, keys: Iterable[str], secret: str | None = None) -> Tenants:
        raw = secret.encode() if secret else secrets.token_bytes(32)
        return cls(tuple(dict.fromkeys(keys)), raw)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def authenticate(self, authorization: str | None) -> str | None:
        """The key of an ``Authorization: Bearer <key>`` header, or None if it is not valid.
        Without configured keys every request is accepted (returns "")."""
        if not self.keys:
            return ""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].strip().encode()
        for key in self.keys:   # constant time per key: no timing hint about valid prefixes
            if hmac.compare_digest(given, key.encode()):
                return key
        return None

    def cache_salt(self, key: str, request_salt: str | None) -> str | None:
        """The engine's ``cache_salt`` for a request by ``key`` (see the module docstring)."""
        if not self.keys:
            return request_salt
        tenant = hmac.new(self.secret, key.encode(), hashlib.sha256).hexdigest()[:32]
        return f"tenant:{tenant}" + (f"|{request_salt}" if request_salt else "")


__all__ = ["Tenants", "read_keys"]
