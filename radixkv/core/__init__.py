"""Pure-Python bookkeeping: hashing, radix tree, block pool, copy-on-write block manager. Imports no torch."""
