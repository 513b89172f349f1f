"""A real ``redis-server`` on 127.0.0.1 and a free port, in a temporary directory (tests only).

The remote tier's tests claim it works against a real server, so a missing binary is a test
FAILURE with the fix in the message, never a skip. ``RADIXKV_REDIS_SERVER`` may name another
binary (a Valkey ``valkey-server`` speaks the same protocol and takes the same flags).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

MISSING = ("redis-server not found: the remote tier's tests need a real server. Install it with "
           "`apt-get install redis-server` (scripts/dev.sh setup does this where it runs as "
           "root) or set RADIXKV_REDIS_SERVER to a redis-server/valkey-server binary.")


def server_binary() -> str:
    path = os.environ.get("RADIXKV_REDIS_SERVER") or shutil.which("redis-server")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(MISSING, pytrace=False)
    return path


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also ``port + 10000`` (its cluster bus), which
    redis-server requires to be <= 65535."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisServer:
    """One redis-server process; ``start``/``stop``/``kill``/``pause``/``resume`` for faults.
    The port stays the same across restarts, so a client's URL stays valid."""

    def __init__(self, workdir: Path, *args: str, port: int | None = None) -> None:
        self.workdir, self.args = Path(workdir), args
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster="--cluster-enabled" in args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout: float = 10.0) -> RedisServer:
        cmd = [server_binary(), "--bind", "127.0.0.1", "--port", str(self.port),
               "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
               "--daemonize", "no", "--logfile", str(self.workdir / "redis.log"), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                log = (self.workdir / "redis.log")
                err += log.read_text()[-2000:] if log.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}: {err}")
            time.sleep(0.02)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to clients."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the socket accepts and buffers but nothing answers (a hung server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
