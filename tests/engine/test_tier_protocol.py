"""The tier protocol's shape (issue 12 part 1): one ABC every mover implements, write policies as
objects, imports flowing one way, no duck-typed probing of movers by the engine."""

from __future__ import annotations

import ast
import pathlib

import pytest

import radixkv
from radixkv.errors import ConfigError
from radixkv.tiers import DeviceOnlyMover, KVMover
from radixkv.tiers.mover import TieredKVMover
from radixkv.tiers.remote import RemoteTier
from radixkv.tiers.write_policy import (ReadOnly, WriteBack, WriteThrough, WritePolicy,
                                        write_policy)

ROOT = pathlib.Path(radixkv.__file__).parent


def test_every_mover_implements_the_one_protocol() -> None:
    for cls in (DeviceOnlyMover, TieredKVMover, RemoteTier):
        assert issubclass(cls, KVMover)
        assert not getattr(cls, "__abstractmethods__", None), cls
    with pytest.raises(TypeError):
        KVMover()   # abstract: apply_moves and copy_blocks are the contract


def test_write_policies_are_objects_that_wire_hooks() -> None:
    assert isinstance(write_policy("write_back"), WriteBack)
    assert isinstance(write_policy("write_through"), WriteThrough)
    assert isinstance(write_policy("read_only"), ReadOnly)
    wt = WriteThrough()
    assert write_policy(wt) is wt and isinstance(wt, WritePolicy)
    with pytest.raises(ConfigError):
        write_policy("write_sometimes")

    from radixkv.core.block_manager import BlockManager

    class Mover:
        def __init__(self) -> None:
            self.observed: list = []

        def add_observer(self, fn):
            self.observed.append(fn)

    class Tier:
        reads: tuple | None = None

        def read_events(self, cursor, computed):
            self.reads = (cursor, computed)

        def apply_moves(self, moves): ...

    for policy, reads, computed, observers in ((ReadOnly(), False, False, 0),
                                               (WriteBack(), True, False, 1),
                                               (WriteThrough(), True, True, 1)):
        tree, tier, mover = BlockManager.create(4, 2, lower_tier_blocks=[4]).tree, Tier(), Mover()
        policy.attach(tier, tree, mover)
        assert (tier.reads is not None) == reads
        assert tier.reads is None or tier.reads[1] == computed
        assert (tree.events is not None and tree.events.num_readers == 1) == reads
        assert len(mover.observed) == observers


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


def test_the_engine_does_not_probe_its_mover() -> None:
    src = (ROOT / "engine" / "llm_engine.py").read_text()
    assert "getattr(self.kv_mover" not in src and "getattr(kv_mover" not in src
    for path in (ROOT / "tiers").glob("*.py"):
        assert "except Exception" not in path.read_text().replace(
            "except Exception as e:  # noqa: BLE001", ""), path.name


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
