"""When blocks are written to the remote tier: write policies as strategy objects.

A policy decides which hooks of the tree and the mover feed the remote tier's writer
(:class:`~radixkv.tiers.remote_writer.RemoteWriter`), once, at attachment; the writer then
writes whatever those hooks hand it, with no policy checks on its paths.
``CacheConfig.remote_write`` names one (``write_back``, ``write_through``, ``read_only``);
:func:`write_policy` turns the name into the object.

* :class:`RemoteWriteBack` (default): a block is written when it leaves the host tier (demoted
  to disk or dropped): the mover shows the writer each group of moves while the host blocks still
  hold the blocks, and the tree's KV events (``BlockRemoved``, drained from the writer's cursor
  on the tree's event queue) give the parent hash and tokens of a block whose node is unlinked
  before its group runs.
* :class:`RemoteWriteThrough`: also every block as soon as it is computed (the events'
  ``BlockStored`` on the device), copied off the device after the step: another replica finds it
  at once.
* :class:`RemoteReadOnly`: never writes (a replica that only consumes a shared cache).

The names say *remote*: the tree's own write policy between its local tiers is another thing,
``radixkv.core.writes.TreeWriteThrough``. ``WriteBack``, ``WriteThrough``, ``ReadOnly`` and
``WritePolicy`` remain importable as aliases of these classes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

from radixkv.core.events import EventCursor, KVEventQueue
from radixkv.core.node import MoveOp
from radixkv.errors import ConfigError


class _Writer(Protocol):
    """What a policy wires of the remote writer."""

    def read_events(self, cursor: EventCursor, computed: bool) -> None: ...

    def apply_moves(self, moves: Sequence[MoveOp]) -> None: ...


class _Tree(Protocol):
    def event_queue(self) -> KVEventQueue: ...


class _Mover(Protocol):
    def add_observer(self, fn: Callable[[Sequence[MoveOp]], None]) -> None: ...


class RemoteWritePolicy(abc.ABC):
    """Wires a remote tier's write path into the tree and the mover."""

    name: ClassVar[str]

    @abc.abstractmethod
    def attach(self, tier: _Writer, tree: _Tree, mover: _Mover) -> None:
        """Install the hooks that make ``tier`` (the remote writer) write under this policy."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RemoteReadOnly(RemoteWritePolicy):
    name = "read_only"

    def attach(self, tier: _Writer, tree: _Tree, mover: _Mover) -> None:
        pass


class RemoteWriteBack(RemoteWritePolicy):
    name = "write_back"

    def attach(self, tier: _Writer, tree: _Tree, mover: _Mover) -> None:
        tier.read_events(tree.event_queue().subscribe(), computed=False)
        mover.add_observer(tier.apply_moves)


class RemoteWriteThrough(RemoteWriteBack):
    name = "write_through"

    def attach(self, tier: _Writer, tree: _Tree, mover: _Mover) -> None:
        tier.read_events(tree.event_queue().subscribe(), computed=True)
        mover.add_observer(tier.apply_moves)


POLICIES: dict[str, type[RemoteWritePolicy]] = {
    p.name: p for p in (RemoteWriteBack, RemoteWriteThrough, RemoteReadOnly)}


def write_policy(policy: str | RemoteWritePolicy) -> RemoteWritePolicy:
    """The policy object for a name (or the object itself)."""
    if isinstance(policy, RemoteWritePolicy):
        return policy
    cls = POLICIES.get(policy)
    if cls is None:
        raise ConfigError(f"unknown remote write policy {policy!r}; expected one of "
                          f"{sorted(POLICIES)}")
    return cls()


# The former names (tests and user code import them); one class each, not a second meaning.
WritePolicy = RemoteWritePolicy
WriteBack = RemoteWriteBack
WriteThrough = RemoteWriteThrough
ReadOnly = RemoteReadOnly

__all__ = ["RemoteWritePolicy", "RemoteWriteBack", "RemoteWriteThrough", "RemoteReadOnly",
           "POLICIES", "write_policy", "WritePolicy", "WriteBack", "WriteThrough", "ReadOnly"]
