"""When blocks are written to the remote tier: write policies as strategy objects.

A policy decides which hooks of the tree and the mover feed the remote tier's writer, once, at
attachment; the remote tier then writes whatever those hooks hand it, with no policy checks on
its paths. ``CacheConfig.remote_write`` names one (``write_back``, ``write_through``,
``read_only``); :func:`write_policy` turns the name into the object.

* :class:`WriteBack` (default): a block is written when it leaves the host tier (demoted to disk
  or dropped): the mover shows the remote tier each group of moves while the host slots still
  hold the blocks, and the tree's KV events (``BlockRemoved``, read from the tree's event queue)
  give the parent hash and tokens of a block whose node is unlinked before its group runs.
* :class:`WriteThrough`: also every block as soon as it is computed (the events'
  ``BlockStored`` on the device), copied off the device after the step: another replica finds it
  at once.
* :class:`ReadOnly`: never writes (a replica that only consumes a shared cache).
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from radixkv.errors import ConfigError


class WritePolicy(abc.ABC):
    """Wires a remote tier's write path into the tree and the mover."""

    name: ClassVar[str]

    @abc.abstractmethod
    def attach(self, tier: Any, tree: Any, mover: Any) -> None:
        """Install the hooks that make ``tier`` write under this policy."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReadOnly(WritePolicy):
    name = "read_only"

    def attach(self, tier: Any, tree: Any, mover: Any) -> None:
        pass


class WriteBack(WritePolicy):
    name = "write_back"

    def attach(self, tier: Any, tree: Any, mover: Any) -> None:
        tier.read_events(tree.event_queue().subscribe(), computed=False)
        mover.add_observer(tier.apply_moves)


class WriteThrough(WriteBack):
    name = "write_through"

    def attach(self, tier: Any, tree: Any, mover: Any) -> None:
        tier.read_events(tree.event_queue().subscribe(), computed=True)
        mover.add_observer(tier.apply_moves)


POLICIES: dict[str, type[WritePolicy]] = {p.name: p for p in (WriteBack, WriteThrough, ReadOnly)}


def write_policy(policy: str | WritePolicy) -> WritePolicy:
    """The policy object for a name (or the object itself)."""
    if isinstance(policy, WritePolicy):
        return policy
    cls = POLICIES.get(policy)
    if cls is None:
        raise ConfigError(f"unknown remote write policy {policy!r}; expected one of "
                          f"{sorted(POLICIES)}")
    return cls()


__all__ = ["WritePolicy", "WriteBack", "WriteThrough", "ReadOnly", "POLICIES", "write_policy"]
