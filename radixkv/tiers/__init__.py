"""Everything that moves KV blocks between tiers (device -> host RAM -> disk -> remote server).

One protocol, :class:`~radixkv.tiers.protocol.KVMover` (its docstring is the contract: what is
asynchronous, who owns a block during a move, what a failed move means), and its
implementations:

* :class:`~radixkv.tiers.protocol.DeviceOnlyMover` -- the device alone (drops, copy-on-write);
* :class:`~radixkv.tiers.mover.TieredKVMover` -- device <-> host <-> disk, over the
  :class:`~radixkv.tiers.transfer.TransferEngine` (batched copies, parallel file I/O);
* :class:`~radixkv.tiers.remote.RemoteTier` -- the Redis/Valkey server replicas share, fed by
  the tiered mover's groups and the tree's listeners as its
  :mod:`~radixkv.tiers.write_policy` decides.

The block manager is the only writer of the radix tree: it plans (``MoveOp``/``CopyOp``) and
the tier components here execute the plans and report failures back to it; they read the tree
but change it only through the block manager. :mod:`~radixkv.tiers.setup` builds the tiers
for an engine. Imports flow one way: ``radixkv.engine`` -> ``radixkv.tiers`` ->
``radixkv.core`` / ``radixkv.storage``.
"""

from radixkv.tiers.protocol import DeviceOnlyMover, KVMover, run_kv_ops
from radixkv.tiers.write_policy import ReadOnly, WriteBack, WritePolicy, WriteThrough

__all__ = ["KVMover", "DeviceOnlyMover", "run_kv_ops", "WritePolicy", "WriteBack",
           "WriteThrough", "ReadOnly"]
