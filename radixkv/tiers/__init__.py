"""Everything that moves KV blocks between tiers (device -> host RAM -> disk -> remote server).

One protocol, :class:`~radixkv.tiers.protocol.KVMover` (its docstring is the contract: what is
asynchronous, who owns a block during a move, what a failed move means), and its
implementations:

* :class:`~radixkv.tiers.protocol.DeviceOnlyMover` -- the device alone (drops, copy-on-write);
* :class:`~radixkv.tiers.mover.TieredKVMover` -- device <-> host <-> disk, over the
  :class:`~radixkv.tiers.transfer.TransferEngine` (batched copies, parallel file I/O);
* :class:`~radixkv.tiers.remote.RemoteTier` -- the Redis/Valkey server replicas share, in two
  roles: :class:`~radixkv.tiers.remote_lookup.RemoteLookup` (scheduler side: look a request's
  blocks up, install the hits in the host tier) and
  :class:`~radixkv.tiers.remote_writer.RemoteWriter` (worker side, a ``KVMover``: write blocks
  as the :mod:`~radixkv.tiers.write_policy` decides, fed by the tiered mover's groups and the
  tree's KV event queue).

The bytes live in the stores of ``radixkv.storage``, which the code here calls through one
interface, :class:`~radixkv.storage.backend.StorageBackend`.

The block manager is the only writer of the radix tree: it plans (``MoveOp``/``CopyOp``) and
the tier components here execute the plans and report failures back to it; they read the tree
but change it only through the block manager. :mod:`~radixkv.tiers.setup` builds the tiers
for an engine. Imports flow one way: ``radixkv.engine`` -> ``radixkv.tiers`` ->
``radixkv.core`` / ``radixkv.storage``.
"""

from radixkv.tiers.protocol import CacheWriter, DeviceOnlyMover, KVMover, run_kv_ops
from radixkv.tiers.write_policy import (ReadOnly, RemoteReadOnly, RemoteWriteBack,
                                        RemoteWritePolicy, RemoteWriteThrough, WriteBack,
                                        WritePolicy, WriteThrough, write_policy)

__all__ = ["KVMover", "CacheWriter", "DeviceOnlyMover", "run_kv_ops", "RemoteWritePolicy",
           "RemoteWriteBack", "RemoteWriteThrough", "RemoteReadOnly", "write_policy",
           "WritePolicy", "WriteBack", "WriteThrough", "ReadOnly"]
