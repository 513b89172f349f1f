"""The dependency lock (scripts/constraints.txt, made by scripts/lock_deps.py): well formed,
in step with scripts/dev.sh, and -- in an environment the lock applies to, as CI's -- exactly
what is installed: every package the set-up needs pinned, no stale pin, no drift."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "scripts" / "constraints.txt"


def _lock_module():
    spec = importlib.util.spec_from_file_location("lock_deps", ROOT / "scripts" / "lock_deps.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=;]+)", line)
        assert m, f"not a 'name==version' pin: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"{name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _header(key: str) -> str:
    found = re.search(rf"^# {key}: (\S+)$", LOCK.read_text(), re.M)
    assert found, f"the lock has no '# {key}:' line"
    return found.group(1)


def _applies() -> bool:
    return (not os.environ.get("RADIXKV_UNPINNED")
            and md.version("torch") == _header("torch")
            and "%d.%d" % sys.version_info[:2] == _header("python"))


needs_locked_env = pytest.mark.skipif(
    not _applies(), reason="the lock does not apply here (another torch or Python, or "
                           "RADIXKV_UNPINNED set): the set-up resolved freely")


def test_lock_is_well_formed_and_pins_no_machine_dependent_build():
    pins = _pins()
    lock = _lock_module()
    assert not set(pins) & set(lock.UNPINNED), "torch / triton must never be pinned"
    names = [line.split("==")[0] for line in LOCK.read_text().splitlines()
             if line and not line.startswith("#")]
    assert names == sorted(names), "pins out of order (regenerate with scripts/dev.sh lock)"
    for name in lock.NO_DEPS:
        assert canonicalize_name(name) in pins
    # made where CI runs: the CPU build (a lock made beside a CUDA torch would not apply in CI,
    # which would then resolve freely again, and would pin CUDA wheels)
    assert _header("torch").endswith("+cpu"), _header("torch")
    assert not [p for p in pins if p.startswith(("nvidia-", "cuda-"))]


def test_lock_extras_are_the_setups():
    """lock_deps.py locks the extras dev.sh installs: a new extra in one and not the other
    would install unpinned packages, or lock ones nobody installs."""
    dev_sh = (ROOT / "scripts" / "dev.sh").read_text()
    found = re.search(r'^EXTRAS="([^"]+)"$', dev_sh, re.M)
    assert found
    assert tuple(found.group(1).split(",")) == _lock_module().EXTRAS


@needs_locked_env
def test_every_needed_package_is_pinned_and_no_pin_is_stale():
    lock = _lock_module()
    need = {k for k in lock.closure() if k not in lock.UNPINNED}
    need |= {canonicalize_name(n) for n in lock.NO_DEPS}
    pins = set(_pins())
    assert not need - pins, f"needed but not pinned (run scripts/dev.sh lock): {need - pins}"
    assert not pins - need, f"pinned but not needed: {pins - need}"


@needs_locked_env
def test_installed_versions_are_the_pins():
    drift = {name: (version, md.version(name)) for name, version in _pins().items()
             if md.version(name) != version}
    assert not drift, f"installed versions differ from the lock (pin, installed): {drift}"


def test_lock_text_round_trips_here():
    """lock_deps.py run in this environment reproduces the committed file where the lock
    applies (else at least its format)."""
    text = _lock_module().lock_text()
    if _applies():
        assert text == LOCK.read_text()
    else:
        assert text.startswith("# ")
