"""The tier protocol's shape (issue 12 part 1): one ABC every mover implements, write policies as
objects, imports flowing one way, no duck-typed probing of movers by the engine."""

from __future__ import annotations

import ast
import copy
import pathlib

import pytest

import radixkv
from radixkv.errors import ConfigError
from radixkv.tiers import DeviceOnlyMover, KVMover
from radixkv.tiers.write_policy import (ReadOnly, WriteBack, WriteThrough, WritePolicy,
                                        write_policy)

ROOT = pathlib.Path(radixkv.__file__).parent


class _Recorder(KVMover):
    """A mover with only the protocol's two abstract methods (copies run like the device-only
    mover's) that records every attribute anyone reads of it, so a test can check which
    members the engine uses."""

    def __init__(self, kv_cache) -> None:
        object.__setattr__(self, "read", set())
        self.inner = DeviceOnlyMover(kv_cache)

    def __getattribute__(self, name: str):
        if not name.startswith("_") and name not in ("read", "inner"):
            object.__getattribute__(self, "read").add(name)
        return object.__getattribute__(self, name)

    def apply_moves(self, moves) -> None:
        self.inner.apply_moves(moves)

    def copy_blocks(self, copies) -> None:
        self.inner.copy_blocks(copies)


def _serve(model, kv_mover=None):
    """Requests with a prompt shared by n=3 samples (whose first appends copy the prompt's
    partial last block) beside plain ones; final outputs by id, and the engine's mover."""
    import sys

    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine
    from radixkv.engine.sampling import SamplingParams

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from engine_helpers import run_requests

    eng = LLMEngine(copy.deepcopy(model), None, CacheConfig(block_size=4, num_device_blocks=64),
                    EngineConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=256),
                    "tiny", kv_mover=kv_mover)
    reqs = [(f"r{i}", [i + 1] * 10 + [7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0))
            for i in range(4)]
    reqs.append(("n3", [5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=6, n=3,
                                                               temperature=1.0, seed=3)))
    try:
        out = run_requests(eng, reqs)
        return {k: [c.token_ids for c in o.outputs] for k, o in out.items()}, eng.kv_mover
    finally:
        eng.close()


@pytest.fixture(scope="module")
def served(make_tiny):
    """The same requests served with the built-in mover and with ``_Recorder`` (once)."""
    model = make_tiny("llama")
    ref, _ = _serve(model)
    got, rec = _serve(model, kv_mover=lambda kv: _Recorder(kv))
    return ref, got, rec


def test_the_two_abstract_methods_are_the_whole_contract(served) -> None:
    """A mover that implements only ``apply_moves`` and ``copy_blocks`` serves the engine as
    the built-in device-only mover does (same outputs, the copy-on-write copies made): the
    ABC's defaults are all the rest an engine needs. Leaving either out is refused."""
    ref, got, rec = served
    assert got == ref
    assert rec.inner.num_copies > 0
    with pytest.raises(TypeError):
        KVMover()

    class NoCopies(KVMover):
        def apply_moves(self, moves): ...

    with pytest.raises(TypeError):
        NoCopies()


def test_the_engine_reads_only_the_protocol_of_its_mover(served) -> None:
    """The engine uses its mover through ``KVMover``'s members alone: no probing for
    attributes a particular mover might have (``getattr(mover, "x", None)`` or ``hasattr``
    would read a name outside the protocol here)."""
    rec = served[2]
    protocol = {n for n in dir(KVMover) if not n.startswith("_")}
    read = object.__getattribute__(rec, "read")
    assert "copy_blocks" in read and read <= protocol, sorted(read - protocol)


def test_write_policies_are_objects_that_wire_hooks() -> None:
    """Each write policy wires the remote tier's hooks into a real tree and a mover, with the
    listeners' real signatures: write-back hears drops and the mover's groups, write-through
    also every computed block, read-only nothing."""
    from radixkv.core.block_manager import BlockManager
    from radixkv.core.hashing import Namespace, hash_token_blocks

    assert isinstance(write_policy("write_back"), WriteBack)
    assert isinstance(write_policy("write_through"), WriteThrough)
    assert isinstance(write_policy("read_only"), ReadOnly)
    wt = WriteThrough()
    assert write_policy(wt) is wt and isinstance(wt, WritePolicy)
    with pytest.raises(ConfigError):
        write_policy("write_sometimes")

    class Tier:     # RemoteTier's three hooks, with its signatures
        def __init__(self) -> None:
            self.seen: list[tuple] = []

        def on_drop(self, blocks) -> None:
            self.seen.append(("drop", [b.block_hash for b in blocks]))

        def on_computed(self, hashes, slots=None) -> None:
            self.seen.append(("computed", list(hashes)))

        def apply_moves(self, moves) -> None:
            self.seen.append(("moves", len(moves)))

    class Mover(KVMover):
        def __init__(self) -> None:
            self.observers: list = []

        def apply_moves(self, moves) -> None:
            for fn in self.observers:
                fn(moves)

        def copy_blocks(self, copies) -> None: ...

        def add_observer(self, fn) -> None:
            self.observers.append(fn)

    ns = Namespace("m")
    [h] = hash_token_blocks([1, 1], 2, ns)
    for policy, want in ((ReadOnly(), []),
                         (WriteBack(), [("drop", [h]), ("moves", 0)]),
                         (WriteThrough(), [("computed", [h]), ("drop", [h]), ("moves", 0)])):
        bm, tier, mover = BlockManager.create(4, 2, policy="lru"), Tier(), Mover()
        policy.attach(tier, bm.tree, mover)
        bm.allocate("a", [1, 1, 9], ns)
        bm.commit("a", 3)
        bm.free("a")
        bm.tree.evict(0, 1)
        mover.apply_moves([])
        assert tier.seen == want, policy


def _imports(path: pathlib.Path) -> set[str]:
    """Modules a file imports, TYPE_CHECKING blocks included (a cycle is a cycle)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_imports_flow_one_way_through_the_tier_package() -> None:
    for path in (ROOT / "tiers").glob("*.py"):
        bad = {m for m in _imports(path) if m.startswith(("radixkv.engine", "radixkv.api",
                                                          "radixkv.server", "radixkv.fleet"))}
        assert not bad, f"{path.name} imports upward: {bad}"
    for path in list((ROOT / "storage").glob("*.py")) + list((ROOT / "core").glob("*.py")):
        bad = {m for m in _imports(path) if m.startswith("radixkv.tiers")}
        assert not bad, f"{path.name} imports the tier package: {bad}"
    # the former cycle: disk.py imports disk_scan.py, never the other way
    assert "radixkv.storage.disk" not in _imports(ROOT / "storage" / "disk_scan.py")


def test_a_mover_that_is_not_a_kvmover_is_refused(tiny_model) -> None:
    from radixkv.config import CacheConfig, EngineConfig
    from radixkv.engine.llm_engine import LLMEngine

    class Duck:   # the old duck-typed shape: no longer enough
        def apply_moves(self, moves): ...
        def copy_blocks(self, copies): ...

    with pytest.raises(ConfigError, match="KVMover"):
        LLMEngine(tiny_model("llama"), None, CacheConfig(num_device_blocks=16),
                  EngineConfig(device="cpu"), "tiny", kv_mover=Duck())
    eng = LLMEngine(tiny_model("llama"), None, CacheConfig(num_device_blocks=16),
                    EngineConfig(device="cpu"), "tiny", kv_mover=lambda kv: DeviceOnlyMover(kv))
    assert isinstance(eng.kv_mover, DeviceOnlyMover)
    eng.close()
