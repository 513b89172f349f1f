"""Engine threads end before the interpreter finalizes.

On CUDA a daemon thread that is inside a CUDA call (a step's device sync, a tier copy) when
the interpreter finalizes re-takes the GIL, is unwound through C++ frames and aborts the
process with ``terminate called without an active exception``. The engine loop and the engine
therefore stop their threads from ``atexit``; this checks, in a child process that exits with
a generation still running, that the loop thread is gone and the engine closed by then.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import atexit, sys, threading
    sys.path.insert(0, {tests!r})
    from conftest import make_tiny_model
    import radixkv
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.sampling import SamplingParams

    def report():   # registered first, so it runs after the engine's own hooks
        alive = [t.name for t in threading.enumerate() if t.name == "radixkv-engine-loop"]
        print("loop threads at exit:", alive, "closed:", engine.core._closed, flush=True)

    atexit.register(report)
    engine = radixkv.Engine(make_tiny_model("llama"), None,
                            CacheConfig(block_size=4, num_device_blocks=64),
                            EngineConfig(device="cpu"))
    rid = engine.submit([1, 2, 3, 4], SamplingParams(max_tokens=400, ignore_eos=True))
    outputs = engine.stream_request(rid)
    next(outputs)   # the loop thread is generating
    print("exiting with the generation running", flush=True)
""")


def test_loop_thread_is_stopped_and_engine_closed_at_exit():
    tests = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exiting with the generation running" in proc.stdout
    assert "loop threads at exit: [] closed: True" in proc.stdout, proc.stdout + proc.stderr
