"""RunQueueProbe: the share of the threads' runnable time spent waiting for a CPU, from
per-thread schedstat files (a fake /proc/self/task here, the real one at the end)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from radixkv.engine.cpu_contention import (
    CONTENDED_SHARE, HOLD_S, MAX_HOLD_S, MIN_RUNNABLE, RunQueueProbe,
)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _write(root, stats: dict[str, tuple[int, int]]) -> None:
    for name in os.listdir(root):
        if name not in stats:
            os.remove(root / name / "schedstat")
            os.rmdir(root / name)
    for tid, (ran, waited) in stats.items():
        (root / tid).mkdir(exist_ok=True)
        (root / tid / "schedstat").write_text(f"{ran} {waited} 7\n")


def test_contended_when_the_threads_wait_a_quarter_of_their_runnable_time(tmp_path):
    clock = _Clock()
    _write(tmp_path, {"1": (0, 0), "2": (0, 0)})
    probe = RunQueueProbe(str(tmp_path), period_s=0.5, clock=clock)
    assert probe.available and not probe.contended()
    # 0.5 s: ran 0.9 s and waited 0.1 s over two threads (the co-located-clients case)
    _write(tmp_path, {"1": (500_000_000, 50_000_000), "2": (400_000_000, 50_000_000)})
    clock.t += 0.5
    assert not probe.contended() and probe.last_share == pytest.approx(0.1)
    # next 0.5 s: ran 0.35, waited 0.35 (beside processes that spin on the cores)
    _write(tmp_path, {"1": (700_000_000, 250_000_000), "2": (550_000_000, 200_000_000)})
    clock.t += 0.2
    assert not probe.contended()          # within the period: the last verdict, no read
    clock.t += 0.3
    assert probe.contended() and probe.last_share == pytest.approx(0.5)
    # an idle window (hardly runnable) says nothing: still contended
    _write(tmp_path, {"1": (701_000_000, 250_000_000), "2": (550_000_000, 200_000_000)})
    clock.t += 0.5
    assert probe.contended()
    # the line itself counts as contended
    ran, waited = 1000 * (1 - CONTENDED_SHARE), 1000 * CONTENDED_SHARE
    scale = 1_000_000
    _write(tmp_path, {"1": (701_000_000 + int(ran * scale), 250_000_000 + int(waited * scale)),
                      "2": (550_000_000, 200_000_000)})
    clock.t += 0.5
    assert probe.contended()


def test_threads_that_end_skip_a_window_and_a_quiet_one_clears_it(tmp_path):
    clock = _Clock()
    _write(tmp_path, {"1": (0, 0), "2": (10**9, 10**9)})
    probe = RunQueueProbe(str(tmp_path), period_s=0.5, clock=clock)
    _write(tmp_path, {"1": (2 * 10**8, 3 * 10**8), "2": (10**9, 10**9)})
    clock.t += 0.5
    assert probe.contended()
    _write(tmp_path, {"1": (4 * 10**8, 3 * 10**8)})   # thread 2 ended: its counts left the sum
    clock.t += 0.5
    assert probe.contended()                          # skipped (negative), verdict kept
    runnable = int(MIN_RUNNABLE * 0.5 * 1e9) + 10**7
    _write(tmp_path, {"1": (4 * 10**8 + runnable, 3 * 10**8)})
    clock.t += 0.5
    assert not probe.contended() and probe.last_share == 0.0


class _Windows:
    """Feeds a probe windows of a given waiting share (0.5 s each, 0.8 CPU-s runnable)."""

    def __init__(self, root, clock) -> None:
        self.root, self.clock, self.ran, self.waited = root, clock, 0, 0
        _write(root, {"1": (0, 0)})

    def window(self, probe: RunQueueProbe, share: float) -> bool:
        runnable = 800_000_000
        self.waited += int(runnable * share)
        self.ran += runnable - int(runnable * share)
        _write(self.root, {"1": (self.ran, self.waited)})
        self.clock.t += 0.5
        return probe.contended()


def test_a_failed_split_is_retried_after_a_hold_that_doubles(tmp_path):
    """Contended while split: hold one thread HOLD_S, then try again; each failed try doubles
    the hold (up to MAX_HOLD_S); low waiting seen while holding does not end the hold; a try
    that holds up resets it."""
    clock = _Clock()
    w = _Windows(tmp_path, clock)
    probe = RunQueueProbe(str(tmp_path), period_s=0.5, clock=clock)
    assert not w.window(probe, 0.1)
    assert w.window(probe, 0.5)                    # split, contended: hold 1 s
    held = 0
    while w.window(probe, 0.05):                   # one thread: waiting looks low
        held += 1
    assert held == int(HOLD_S / 0.5) - 1           # the hold ran out: trying split again
    assert w.window(probe, 0.5)                    # the try failed: hold 2 s now
    held = 0
    while w.window(probe, 0.05):
        held += 1
    assert held == int(2 * HOLD_S / 0.5) - 1
    assert not w.window(probe, 0.1)                # the try held up: backoff forgotten
    assert w.window(probe, 0.5)
    held = 0
    while w.window(probe, 0.05):
        held += 1
    assert held == int(HOLD_S / 0.5) - 1
    for _ in range(12):                            # failures in a row: capped
        assert w.window(probe, 0.5)
        while w.window(probe, 0.05):
            pass
    assert probe._hold == MAX_HOLD_S


def test_contended_while_holding_extends_the_hold(tmp_path):
    clock = _Clock()
    w = _Windows(tmp_path, clock)
    probe = RunQueueProbe(str(tmp_path), period_s=0.5, clock=clock)
    assert w.window(probe, 0.6)
    for _ in range(10):                            # still contended on one thread
        assert w.window(probe, 0.6)
    assert w.window(probe, 0.05)                   # the hold ends HOLD_S after the last one
    assert not w.window(probe, 0.05)


def test_unavailable_without_the_files(tmp_path):
    probe = RunQueueProbe(str(tmp_path / "missing"))
    assert not probe.available and not probe.contended()
    (tmp_path / "empty").mkdir()
    assert not RunQueueProbe(str(tmp_path / "empty")).available


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not os.path.exists("/proc/self/task/%d/schedstat" % os.getpid()),
                    reason="needs Linux scheduler statistics (/proc/self/task/*/schedstat)")
def test_the_real_probe_sees_threads_that_wait():
    """A thread of this process spinning beside twice as many spinning processes as it has
    CPUs waits on a run queue, and the probe says so."""
    cpus = len(os.sched_getaffinity(0))
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(2 * cpus)]
    t = threading.Thread(target=spin)
    shares = []
    try:
        time.sleep(0.5)                   # the processes are past start-up and spinning
        t.start()
        probe = RunQueueProbe(period_s=0.25)
        assert probe.available
        verdict = False
        deadline = time.monotonic() + 5.0
        while not verdict and time.monotonic() < deadline:
            time.sleep(0.3)
            verdict = probe.contended()
            shares.append(probe.last_share)
        assert verdict, shares
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        for p in procs:
            p.kill()
            p.wait()
