"""vLLM's priority scheduling through the real server (``radixkv serve --scheduling-policy
priority`` subprocess on 127.0.0.1): requests queued behind a running one are served by their
``priority`` field or ``X-Vllm-Priority`` header, lower first, whatever their arrival order.

One server for the module, one sequence at a time (``--max-num-seqs 1``), so the order in
which queued requests finish is the order in which the scheduler admitted them.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from tests.server.test_openai_server import MODEL, Server, _value, running_server  # noqa: E402
from tests.server.test_serve_limits import LONG, _idle, _post, _running  # noqa: E402


@pytest.fixture(scope="module")
def srv() -> Any:
    with running_server(["--scheduling-policy", "priority", "--max-num-seqs", "1",
                         "--max-queued", "8", "--device-blocks", "256", "--threads", "1",
                         "--device", "cpu", "--dtype", "float32"]) as server:
        yield server


def _waiting(srv: Server, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _value(srv.metrics(), "radixkv_num_requests_waiting") < n:
        assert time.monotonic() < deadline, f"never {n} waiting"
        time.sleep(0.02)


@pytest.mark.model
def test_queued_requests_are_served_by_priority_not_arrival(srv: Server) -> None:
    """A long request runs; four short ones queue behind it in the order normal (0), batch (5,
    in the body), urgent (-5, in the header, which overrides the body's 9) and urgent2 (-5,
    later). Once the long one is gone they finish urgent, urgent2, normal, batch."""
    _idle(srv, 60)
    long_conn = _post(srv.port, "/v1/completions", json.dumps(LONG).encode())
    _running(srv, 1)
    done: dict[str, float] = {}
    results: dict[str, Any] = {}

    def send(name: str, priority: int | None, header: str | None = None) -> None:
        body = {"model": MODEL, "prompt": f"Request {name} says", "max_tokens": 2,
                "temperature": 0, "ignore_eos": True}
        if priority is not None:
            body["priority"] = priority
        results[name] = srv.raw("POST", "/v1/completions", body, key=None,
                                headers={"X-Vllm-Priority": header} if header else None)
        done[name] = time.monotonic()

    threads = []
    for i, (name, prio, header) in enumerate((("normal", None, None), ("batch", 5, None),
                                              ("urgent", 9, "-5"), ("urgent2", -5, None))):
        threads.append(threading.Thread(target=send, args=(name, prio, header)))
        threads[-1].start()
        _waiting(srv, i + 1)
    long_conn.sock.shutdown(socket.SHUT_RDWR)   # the long request is aborted: the queue runs
    long_conn.close()
    for t in threads:
        t.join(120)
    assert all(r[0] == 200 for r in results.values()), results
    assert sorted(done, key=done.get) == ["urgent", "urgent2", "normal", "batch"], done
    _idle(srv, 30)
