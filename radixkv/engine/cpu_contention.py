"""Whether this process's threads are waiting for a CPU: the run-queue share of their time.

Why: a forward of a few tokens on two OpenMP threads is faster than on one while both threads
have a core (decode step 12.7 against 14.8 ms at batch 4 on the project's EPYC), but every
parallel region waits for both, so where other processes take the cores each of its ~150
regions waits for a descheduled thread: beside two busy processes on two cores the server's
requests took 0.93 s end to end against 0.68 with small forwards on one thread
(docs/serve.md, "CPU threads on a shared machine"). The engine therefore asks, before each
forward, whether its threads have lately been kept waiting, and if so runs it on one thread
(long prefills too: polling threads that wait at each region for a descheduled one lost to one
thread there as well; ``ModelRunner.load_mode``).

The signal is the kernel's own: ``/proc/self/task/<tid>/schedstat`` holds, per thread, the
nanoseconds it ran and the nanoseconds it was runnable but waited on a run queue. Over a
window of :data:`PERIOD_S`, the share ``waited / (ran + waited)`` summed over the process's
threads is ~0.07 (median) for a server at two threads whose four benchmark clients share its
two cores, and ~0.49 beside two processes that spin on those cores; the line is drawn at
:data:`CONTENDED_SHARE`. A window in which the threads were hardly runnable (an idle server)
says nothing and keeps the last verdict.

A "contended" verdict is held for a while (:data:`HOLD_S`, doubled each time a window run with
the split choice comes out contended again, up to :data:`MAX_HOLD_S`): while small forwards
run on one thread the waiting may look low only because the process stopped asking for the
second core, and beside one busy process on two cores the choice would otherwise flip every
window (measured in one process: 20 of 117 decode steps on both threads, their p90 24 ms
against 17). A split window that holds up resets the hold.

Reads ~15 small files every :data:`PERIOD_S` at most; between reads a call costs a clock read.
Where the files do not exist (not Linux, or a kernel without scheduler statistics) the probe
is not :attr:`~RunQueueProbe.available` and callers keep their contention-safe choice.
Pure Python, no torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

#: Seconds between two reads of the threads' statistics.
PERIOD_S = 0.5
#: The share of runnable time spent waiting for a CPU from which the threads count as contended.
CONTENDED_SHARE = 0.25
#: A window counts only if the threads were runnable this many CPU-seconds per wall second.
MIN_RUNNABLE = 0.1
#: Seconds a contended verdict is kept at first, and at most (see the module docstring).
HOLD_S = 1.0
MAX_HOLD_S = 32.0


class RunQueueProbe:
    """Run-queue waiting of the threads of this process (see the module docstring).

    Args:
        root: the folder of per-thread folders (``/proc/self/task``); tests pass another.
        period_s, threshold: :data:`PERIOD_S`, :data:`CONTENDED_SHARE`.
        clock: seconds (monotonic); tests inject one.
    """

    def __init__(self, root: str = "/proc/self/task", period_s: float = PERIOD_S,
                 threshold: float = CONTENDED_SHARE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.period_s = period_s
        self.threshold = threshold
        self.clock = clock
        first = self._read()
        #: whether the statistics can be read here
        self.available = first is not None
        self._last = (clock(), first or (0, 0))
        self._contended = False
        self._hold = HOLD_S
        self._hold_until = float("-inf")
        #: the last window's share of runnable time spent waiting (None before one counted)
        self.last_share: float | None = None

    def _read(self) -> tuple[int, int] | None:
        """(ran, waited) nanoseconds summed over the threads, or None when unreadable."""
        try:
            tids = os.listdir(self.root)
        except OSError:
            return None
        ran = waited = 0
        seen = False
        for tid in tids:
            try:
                with open(os.path.join(self.root, tid, "schedstat")) as f:
                    fields = f.read().split()
                ran += int(fields[0])
                waited += int(fields[1])
                seen = True
            except (OSError, ValueError, IndexError):
                continue   # a thread that ended meanwhile, or a malformed line
        return (ran, waited) if seen else None

    def contended(self) -> bool:
        """Whether the threads spent :attr:`threshold` or more of their runnable time waiting
        for a CPU in the last window that said anything (False until one did)."""
        if not self.available:
            return False
        now = self.clock()
        t0, (ran0, waited0) = self._last
        wall = now - t0
        if wall < self.period_s:
            return self._contended
        cur = self._read()
        if cur is None:
            return self._contended
        self._last = (now, cur)
        ran, waited = cur[0] - ran0, cur[1] - waited0
        if ran < 0 or waited < 0:
            return self._contended   # threads that ended took their counts along: skip
        runnable = (ran + waited) / 1e9
        if runnable < MIN_RUNNABLE * wall:
            return self._contended   # hardly runnable: says nothing
        self.last_share = share = waited / (ran + waited)
        split = not self._contended   # what this window ran with
        if share >= self.threshold:
            if split:   # the split choice failed (again): wait longer before the next try
                self._hold_until = now + self._hold
                self._hold = min(2 * self._hold, MAX_HOLD_S)
            else:
                self._hold_until = max(self._hold_until, now + HOLD_S)
            self._contended = True
        elif now >= self._hold_until:
            if split:
                self._hold = HOLD_S   # the split choice held up: forget the backoff
            self._contended = False
        return self._contended


__all__ = ["CONTENDED_SHARE", "HOLD_S", "MAX_HOLD_S", "MIN_RUNNABLE", "PERIOD_S",
           "RunQueueProbe"]
