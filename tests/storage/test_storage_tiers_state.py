"""Model-based test of the data layer: random moves between the three tiers with faults injected
(full disk at the syscall, corrupted files), beside a naive model (location -> expected bytes).

Checked after every step: every location the model knows holds exactly the bytes last moved
there; a failed move leaves its source intact; a disk read returns the bytes written or a miss,
never other bytes; reservations and the disk index are consistent (check_invariants).
"""

from __future__ import annotations

import errno
import os

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixkv.storage.device import DevicePool
from radixkv.storage.disk import DiskStore
from radixkv.storage.host import HostPool
from radixkv.storage.layout import KVLayout
from radixkv.tiers.transfer import DeviceBlock, DiskBlock, HostBlock, Move, TransferEngine

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32")
N_DEV, N_HOST, HASHES = 4, 4, [bytes([i]) * 16 for i in range(6)]

locations = st.one_of(st.builds(DeviceBlock, st.integers(0, N_DEV - 1)),
                      st.builds(HostBlock, st.integers(0, N_HOST - 1)),
                      st.builds(DiskBlock, st.sampled_from(HASHES)))


class TiersMachine(RuleBasedStateMachine):
    @initialize(root=st.just(None))
    def setup(self, root):
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        self.dev = DevicePool(LAY, N_DEV, device="cpu")
        self.host = HostPool(LAY, N_HOST)
        self.disk = DiskStore(self.tmp.name, LAY, LAY.fingerprint("m"))
        self.eng = TransferEngine(self.dev, self.host, self.disk, io_threads=2)
        self.model: dict[object, torch.Tensor] = {}
        self.full = False
        self.real_write = os.write

        def write(fd, data):  # the syscall boundary: ENOSPC while the "disk is full"
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.real_write(fd, data)
        os.write = write

    def teardown(self):
        if hasattr(self, "eng"):
            os.write = self.real_write
            self.eng.close()
            self.tmp.cleanup()

    def _key(self, loc):
        return ("disk", loc.block_hash) if isinstance(loc, DiskBlock) else loc

    @rule(block_id=st.integers(0, N_DEV - 1), seed=st.integers(0, 2**16))
    def compute_writes_device_block(self, block_id, seed):
        data = torch.randn((1, *LAY.block_shape), generator=torch.Generator().manual_seed(seed))
        self.dev.write_blocks([block_id], data)
        self.model[DeviceBlock(block_id)] = data[0].clone()

    @rule(src=locations, dst=locations)
    def move(self, src, dst):
        if self._key(src) not in self.model or self._key(src) == self._key(dst):
            return
        if isinstance(src, DiskBlock) and isinstance(dst, DiskBlock):
            return
        if isinstance(dst, DiskBlock):
            if self._key(dst) in self.model:
                return  # content-addressed: a hash already on disk is never rewritten
            dst = DiskBlock(dst.block_hash, None, (1, 2))
        before = self.model[self._key(src)].clone()
        result = self.eng.wait(self.eng.submit(self.eng.prepare([Move(src, dst)])), timeout=30)
        assert result is not None
        if result.ok[0]:
            self.model[self._key(dst)] = before
        else:
            assert isinstance(src, DiskBlock) or isinstance(dst, DiskBlock) and self.full, \
                result.errors
            self.model.pop(self._key(dst), None)  # the target holds garbage now
            if isinstance(src, DiskBlock):
                self.model.pop(self._key(src))      # it was corrupt: gone
        if self._key(src) in self.model:
            assert torch.equal(self._read(src), before), "a move changed its source"

    @rule(full=st.booleans())
    def disk_fills_or_frees(self, full):
        self.full = full

    @rule(h=st.sampled_from(HASHES), garbage=st.binary(min_size=0, max_size=300))
    def corrupt_a_file(self, h, garbage):
        path = self.disk.path_of(h)
        if path.exists():
            path.write_bytes(garbage)
            self.model.pop(("disk", h), None)

    @rule(h=st.sampled_from(HASHES))
    def remove_from_disk(self, h):
        self.disk.remove(h)
        self.model.pop(("disk", h), None)

    def _read(self, loc):
        if isinstance(loc, DeviceBlock):
            return self.dev.read_blocks([loc.block_id])[0]
        if isinstance(loc, HostBlock):
            return self.host.read_blocks([loc.block_id])[0]
        return self.disk.get(loc.block_hash)

    @invariant()
    def every_known_location_holds_its_bytes(self):
        if not hasattr(self, "eng"):
            return
        for key, want in list(self.model.items()):
            loc = DiskBlock(key[1]) if isinstance(key, tuple) else key
            got = self._read(loc)
            assert got is not None and torch.equal(got, want), f"{loc} lost its bytes"
        for h in HASHES:  # a disk block the model does not know is a miss, never other bytes
            if ("disk", h) not in self.model:
                assert self.disk.get(h) is None
        self.eng.check_invariants()
        self.disk.check_invariants()


TiersMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=20,
                                          deadline=None)
test_tiers_state_machine = TiersMachine.TestCase
