"""The byte stores of KV blocks: the device pool, host RAM, disk files and a shared Redis/Valkey
server. See docs/tiers.md.

Every store but the device pool implements one interface, :class:`StorageBackend`
(``storage/backend.py``); what moves blocks between them is the ``radixkv.tiers`` package.
``radixkv.storage.layout`` and ``radixkv.storage.backend`` are torch-free (the bookkeeping layer
sizes its pools with ``KVLayout``); the other modules import torch (or ``redis``, the remote
store), so they are loaded lazily on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkv.storage.backend import BlockWrite, PutResult, StorageBackend, block_view
from radixkv.storage.layout import KVLayout, parse_capacity, parse_size

_LAZY = {
    "DevicePool": "device", "HostPool": "host",
    "DiskStore": "disk", "DiskEntry": "disk", "DiskStats": "disk", "ScanReport": "disk",
    "RemoteStore": "remote", "RemoteStats": "remote", "RemoteBlock": "remote",
    "BlockSigner": "integrity",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"radixkv.storage.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'radixkv.storage' has no attribute {name!r}")


__all__ = ["KVLayout", "parse_capacity", "parse_size", "StorageBackend", "BlockWrite",
           "PutResult", "block_view", *_LAZY]
