"""``radixkv serve --kv-events-endpoint``: the engine's KV events over ZMQ in vLLM's wire format,
read by a real ZMQ ``SUB`` socket while the openai client sends a completion to a real
``radixkv serve`` subprocess (127.0.0.1, free ports); and the ``/metrics`` counters fed by the
same events (``radixkv_kv_blocks_{stored,removed}_total``)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from tests.fleet.test_zmq_events import BlockStored, KVEventBatch  # noqa: E402
from tests.server.test_openai_server import (MODEL, Server, _free_port,  # noqa: E402
                                             _value, _wait_ready)

BLOCK = 16
DEVICE_BLOCKS = 24
PROMPT = [(7 * i + 100) % 4000 + 50 for i in range(3 * BLOCK + 5)]   # token ids, 3 full blocks


@pytest.fixture(scope="module")
def srv() -> Any:
    port, zport = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "radixkv.server.cli", "--port", str(port),
           "--kv-events-endpoint", f"tcp://127.0.0.1:{zport}", "--block-size", str(BLOCK),
           "--device-blocks", str(DEVICE_BLOCKS), "--threads", "1", "--device", "cpu",
           "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = Server(port, proc)
    server.zmq_endpoint = f"tcp://127.0.0.1:{zport}"  # type: ignore[attr-defined]
    try:
        _wait_ready(server)
        yield server
    finally:
        proc.terminate()
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    log = proc.stdout.read()
    # uvicorn re-raises the SIGTERM once its graceful shutdown is done
    assert rc in (0, -15) and "Traceback" not in log, log   # the publisher stopped cleanly
    assert f"KV events on tcp://127.0.0.1:{zport}" in log


def test_a_completion_publishes_its_prompt_blocks(srv: Server) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(srv.zmq_endpoint)  # type: ignore[attr-defined]
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        time.sleep(0.5)   # PUB drops messages until the subscription has arrived (slow joiner)
        out = srv.client("none").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                    temperature=0)
        assert out.choices[0].text is not None
        stored: list[BlockStored] = []
        seqs: list[int] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.parent_block_hash is None
                                                      for e in stored):
            if not sub.poll(500):
                continue
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            seqs.append(int.from_bytes(seq, "big"))
            stored += [e for e in decoder.decode(payload).events if isinstance(e, BlockStored)]
        assert seqs == sorted(seqs)
        first = [e for e in stored if e.parent_block_hash is None]
        assert first, f"no root BlockStored in {stored}"
        e = first[0]
        assert e.block_size == BLOCK and e.medium == "GPU"
        assert e.token_ids[:BLOCK] == PROMPT[:BLOCK]
        assert len(e.token_ids) == BLOCK * len(e.block_hashes)
        assert all(isinstance(h, bytes) and len(h) == 16 for h in e.block_hashes)
    finally:
        sub.close()


def test_metrics_count_the_blocks_stored_and_removed(srv: Server) -> None:
    client = srv.client("none")
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    fams = srv.metrics()
    stored = _value(fams, "radixkv_kv_blocks_stored", tier="device")
    assert stored >= 3   # at least the prompt's three full blocks (cached by the other test)
    for i in range(8):   # 8 new prompts of 4 blocks: more than the device tier holds
        prompt = [t + 1 + i for t in PROMPT[:3 * BLOCK]] + [11 + i] * 10
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    fams = srv.metrics()
    stored = _value(fams, "radixkv_kv_blocks_stored", tier="device")
    removed = _value(fams, "radixkv_kv_blocks_removed", tier="device")
    assert stored >= 3 * 9 and removed > 0
    # one tier and no moves: what is cached is exactly what was stored and not removed
    cached = _value(fams, "radixkv_engine_cached_blocks_per_tier", tier="device")
    assert stored - removed == cached <= DEVICE_BLOCKS


def test_a_taken_endpoint_is_an_error_exit() -> None:
    port = _free_port()
    with zmq.Context.instance().socket(zmq.PUB) as taken:
        taken.setsockopt(zmq.LINGER, 0)
        taken.bind("tcp://127.0.0.1:*")
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        cmd = [sys.executable, "-m", "radixkv.server.cli", "--port", str(port),
               "--kv-events-endpoint", endpoint, "--device-blocks", "16", "--threads", "1",
               "--device", "cpu", "--dtype", "float32"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "--kv-events-endpoint" in proc.stderr and endpoint in proc.stderr


def test_kv_events_are_refused_with_a_fleet(capsys, monkeypatch) -> None:
    from radixkv.server.cli import main

    monkeypatch.setenv("OMP_WAIT_POLICY", "")
    assert main(["--replicas", "2", "--kv-events-endpoint", "tcp://127.0.0.1:1"]) == 2
    assert "single server" in capsys.readouterr().err
