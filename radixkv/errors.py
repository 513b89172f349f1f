"""One error hierarchy for everything radixkv raises at its public edge.

Every public operation validates its input before it mutates anything, so catching one of these
means the structure it came from is exactly as it was before the call.
"""

from __future__ import annotations


class RadixKVError(Exception):
    """Base class of every error radixkv raises on purpose."""


class ConfigError(RadixKVError, ValueError):
    """An impossible or inconsistent configuration (zero blocks, block size not a power of 2...)."""


class InvalidTokensError(RadixKVError, ValueError):
    """Token ids that cannot be cached: empty, not integers, negative or too large."""


class InvalidRequestError(RadixKVError, ValueError):
    """A request the engine refuses: empty prompt, too long, bad sampling options."""


class UnknownSequenceError(RadixKVError, KeyError):
    """A sequence id that is not live (never allocated, or already freed)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown sequence"


class UnknownRequestError(RadixKVError, KeyError):
    """A request id the engine does not know: never submitted, or finished and returned."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class UnknownDocumentError(RadixKVError, KeyError):
    """A document id the RAG helper does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown document"


class EngineClosedError(RadixKVError, RuntimeError):
    """The engine was closed (its tier worker threads are stopped); build a new one."""


class SequenceExistsError(RadixKVError, ValueError):
    """Allocating or forking into a sequence id that is already live."""


class InvalidBlockError(RadixKVError, ValueError):
    """A block id outside the pool, or an operation on a block in the wrong state."""


class OutOfBlocks(RadixKVError):
    """Not enough free or evictable blocks for an all-or-nothing allocation.

    The message says how many blocks were needed, free and evictable, and what to change.
    """

    def __init__(self, needed: int, free: int, evictable: int, hint: str = "") -> None:
        self.needed, self.free, self.evictable = needed, free, evictable
        msg = f"need {needed} blocks, {free} free, {evictable} evictable"
        msg += (f": {hint}" if hint
                else ": raise the number of device blocks or lower the batch size")
        super().__init__(msg)


class StorageError(RadixKVError):
    """An I/O failure in a storage tier that could not be degraded to a miss."""


__all__ = [
    "RadixKVError", "ConfigError", "InvalidTokensError", "InvalidRequestError",
    "UnknownSequenceError", "SequenceExistsError", "InvalidBlockError", "OutOfBlocks",
    "StorageError", "UnknownRequestError", "UnknownDocumentError", "EngineClosedError",
]
