"""The fleet: radixkv replicas on Ray Serve, routed by what each has cached (docs/fleet.md).
The public surface is ``__all__`` (each name imported on first use: Ray loads only then)."""

from __future__ import annotations

from radixkv._lazy import lazy_getattr

_LAZY = {
    "EngineReplica": "radixkv.fleet.replica",
    "ReplicaSpec": "radixkv.fleet.replica",
    "KVAwareRouter": "radixkv.fleet.router",
    "PrefixIndex": "radixkv.fleet.index",
    "KVEventBus": "radixkv.fleet.events",
    "EventRecorder": "radixkv.fleet.events",
    "FleetBackend": "radixkv.fleet.ingress",
    "FleetIngress": "radixkv.fleet.ingress",
    "ZmqEventPublisher": "radixkv.fleet.zmq_events",
    "build_app": "radixkv.fleet.deploy",
}
"""name -> module that defines it: imported on first attribute access, so importing one
submodule of this package does not import the others (nor torch, where they need it)."""

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
