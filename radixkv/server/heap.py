"""The garbage collector of a long-running server: the start-up heap frozen out of its passes.

Why: CPython's cyclic collector now and then runs a full pass (its oldest generation) over every
object it tracks, holding the GIL throughout, so the engine thread stops too. A loaded
``radixkv serve`` tracks ~240,000 objects that live as long as the process (the model's modules
and parameters, the tokenizer, transformers', torch's and FastAPI's module state), and a full
pass over them took 84-93 ms on the project's Zen 5 EPYC (``gc.collect()`` on the loaded
embedded engine, five times), added to whichever request is running. Such passes are rare: in
issue 33's replay (~300 chat requests, one server without the freeze) the collector ran 15
young and 1 middle collection and no full pass, so the replay's TTFTs did not move with it;
they come after thousands of requests' surviving objects, and each is a tail latency of ~0.1 s.
``gc.freeze()`` moves every object alive at that moment into a permanent generation that later
passes skip (vLLM's server does the same after start-up); what requests allocate afterwards is
collected as before, so a full pass then costs what the objects made since start-up cost.

Frozen objects are never freed by the collector, so this runs once, after loading and warm-up,
when everything alive is meant to stay, and only in a process that is the server: ``radixkv
serve`` (``create_app(freeze_heap=True)``), the fleet's ingress and each fleet replica. An app
embedded in another program keeps that program's collector as it is.

:class:`PauseRecorder` times every collection (``gc.callbacks``) for ``/metrics``
(``radixkv_gc_pause_seconds`` by generation), so an operator sees what the collector costs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any


def freeze_startup_heap() -> tuple[int, float]:
    """Collect once (so that start-up's garbage is not kept forever), then freeze what is left.
    Returns how many objects are frozen and the seconds the collection took."""
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    gc.freeze()
    return gc.get_freeze_count(), took


class PauseRecorder:
    """Calls ``observe(generation, seconds)`` after every collection of the cyclic GC, whatever
    thread triggered it (collections never overlap: they hold the GIL). :meth:`install` /
    :meth:`remove` add and take away the ``gc.callbacks`` hook."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._t0: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            took, self._t0 = time.perf_counter() - self._t0, None
            self._observe(int(info["generation"]), took)

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


__all__ = ["PauseRecorder", "freeze_startup_heap"]
