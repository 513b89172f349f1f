"""Storage tiers: the bytes of KV blocks in device memory, CPU RAM and disk files, and the
engine that moves them. See docs/tiers.md.

``radixkv.storage.layout`` is torch-free (the bookkeeping layer sizes its pools with it); the
other modules import torch, so they are loaded lazily on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkv.storage.layout import KVLayout, parse_capacity, parse_size

_LAZY = {
    "DevicePool": "device", "HostPool": "host",
    "DiskStore": "disk", "DiskEntry": "disk", "DiskStats": "disk", "ScanReport": "disk",
    "TransferEngine": "transfer", "Move": "transfer", "DeviceBlock": "transfer",
    "HostSlot": "transfer", "DiskBlock": "transfer", "BatchResult": "transfer",
    "TransferStats": "transfer", "BlockSigner": "integrity",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"radixkv.storage.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'radixkv.storage' has no attribute {name!r}")


__all__ = ["KVLayout", "parse_capacity", "parse_size", *_LAZY]
