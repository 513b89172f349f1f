"""Two ``radixkv serve`` replicas sharing one real ``redis-server`` (issue 12): a conversation
prefilled on replica A is a remote hit on replica B, reported in ``usage`` under "remote", with
the same greedy answer. Both servers load the model in parallel (one load's time)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("redis")

sys.path.insert(0, str(Path(__file__).parent.parent / "storage"))
from redis_server import RedisServer, free_port  # noqa: E402

pytestmark = pytest.mark.model
MODEL = "SmolLM2-135M-Instruct"


def _start(port: int, url: str, write: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "radixkv.server.cli", "--port", str(port), "--device", "cpu",
           "--threads", "1", "--device-blocks", "256", "--remote-url", url,
           "--remote-write", write, "--remote-timeout", "5"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    raise TimeoutError("server not ready")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Any:
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    ports = [free_port(), free_port()]
    # A writes through; B writes back (the default): only what leaves its host tier, or what
    # a request asks to retain, reaches the server from B
    procs = [_start(p, srv.url, w) for p, w in zip(ports, ("write_through", "write_back"))]
    try:
        for p, proc in zip(ports, procs):
            _wait_ready(p, proc)
        yield [openai.OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="none",
                             max_retries=0, timeout=300) for p in ports]
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        srv.stop()


def test_replica_b_is_served_from_what_replica_a_computed(replicas) -> None:
    a, b = replicas
    msgs = [{"role": "system", "content": "You answer questions about a long manual. " * 12},
            {"role": "user", "content": "What is the first step?"}]
    ra = a.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    assert ra.usage.prompt_tokens_details.cached_tokens == 0
    time.sleep(0.5)   # the write-through queue drains in the background
    rb = b.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    tiers = rb.usage.model_extra["radixkv"]["cached_tokens_per_tier"]
    assert tiers["remote"] > 0 and tiers["remote"] == rb.usage.prompt_tokens_details.cached_tokens
    assert rb.choices[0].message.content == ra.choices[0].message.content
    # and the next turn on B is a device hit there, as on a single server
    rb2 = b.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    assert rb2.usage.model_extra["radixkv"]["cached_tokens_per_tier"]["device"] > 0
    # and /metrics tells the remote hits apart from host ones
    from prometheus_client.parser import text_string_to_metric_families

    base = str(b.base_url).rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    remote_hits = [s.value for s in fams["radixkv_prefix_cache_hits_by_tier"].samples
                   if s.labels.get("tier") == "remote"]
    assert remote_hits and remote_hits[0] == tiers["remote"]
    assert [s.value for s in fams["radixkv_remote_available"].samples] == [1.0]


def test_24h_retention_reaches_the_other_replica_in_memory_does_not(replicas) -> None:
    """``prompt_cache_retention: "24h"`` on write-back replica B writes the prompt to the
    shared server at once (B's memory is far from full: write-back alone would write nothing),
    so replica A is served from it; ``"in_memory"`` keeps it in B only."""
    a, b = replicas
    kept = [{"role": "system", "content": "Retained manual, chapter one. " * 12},
            {"role": "user", "content": "Summarise it."}]
    local = [{"role": "system", "content": "Volatile notes, kept in memory. " * 12},
             {"role": "user", "content": "Summarise it."}]
    rk = b.chat.completions.create(model=MODEL, messages=kept, temperature=0, max_tokens=4,
                                   extra_body={"prompt_cache_retention": "24h"})
    b.chat.completions.create(model=MODEL, messages=local, temperature=0, max_tokens=4,
                              extra_body={"prompt_cache_retention": "in_memory"})
    time.sleep(0.5)   # the write queue drains in the background
    ra = a.chat.completions.create(model=MODEL, messages=kept, temperature=0, max_tokens=4)
    tiers = ra.usage.model_extra["radixkv"]["cached_tokens_per_tier"]
    assert tiers["remote"] > 0 and tiers["remote"] == ra.usage.prompt_tokens_details.cached_tokens
    assert ra.choices[0].message.content == rk.choices[0].message.content
    rl = a.chat.completions.create(model=MODEL, messages=local, temperature=0, max_tokens=4)
    assert rl.usage.prompt_tokens_details.cached_tokens == 0
    from prometheus_client.parser import text_string_to_metric_families

    base = str(b.base_url).rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    assert [s.value for s in fams["radixkv_remote_blocks_persisted"].samples
            if s.name.endswith("_total")] == [tiers["remote"] // 16]


def test_a_rolling_restart_with_default_flags_keeps_the_cache(tmp_path) -> None:
    """Issue 33, item 2: replica A (default write-back; its memory never fills) serves a
    conversation and gets SIGTERM; it writes its cached blocks to the server on the way out
    (``--shutdown-flush``, default 5 s) and says so; replica B, started after A is gone, is
    served the conversation from the server with A's greedy answer."""
    srv = RedisServer(tmp_path / "redis").start()
    msgs = [{"role": "system", "content": "A rolling restart must keep the cache. " * 12},
            {"role": "user", "content": "What survives?"}]
    try:
        answers, outputs = [], []
        for _ in range(2):
            port = free_port()
            cmd = [sys.executable, "-m", "radixkv.server.cli", "--port", str(port),
                   "--device", "cpu", "--threads", "1", "--device-blocks", "256",
                   "--remote-url", srv.url]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            try:
                _wait_ready(port, proc)
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                       max_retries=0, timeout=300)
                answers.append(client.chat.completions.create(
                    model=MODEL, messages=msgs, temperature=0, max_tokens=8))
                if len(answers) == 1:
                    assert srv.client().dbsize() == 0   # write-back wrote nothing yet
            finally:
                proc.terminate()                        # SIGTERM: a graceful shutdown
                try:
                    outputs.append(proc.communicate(timeout=60)[0])
                except subprocess.TimeoutExpired:
                    proc.kill()
                    raise
            # uvicorn re-raises the SIGTERM once its graceful shutdown is done
            assert proc.returncode in (0, -15), outputs[-1]
        ra, rb = answers
        assert ra.usage.prompt_tokens_details.cached_tokens == 0
        written = int(outputs[0].split("shutdown: wrote ")[1].split()[0])
        # the start-up line says how threads wait (issue 33, item 4)
        assert "1 CPU threads (--threads); OMP_WAIT_POLICY PASSIVE" in outputs[0]
        assert written >= ra.usage.prompt_tokens // 16 > 0
        tiers = rb.usage.model_extra["radixkv"]["cached_tokens_per_tier"]
        assert tiers["remote"] == rb.usage.prompt_tokens_details.cached_tokens > 0
        assert tiers["remote"] == ra.usage.prompt_tokens // 16 * 16 - \
            (16 if ra.usage.prompt_tokens % 16 == 0 else 0)
        assert rb.choices[0].message.content == ra.choices[0].message.content
    finally:
        srv.stop()
