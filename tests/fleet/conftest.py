"""The fleet's tests need ray[serve] (the cluster extra, which scripts/dev.sh installs): a skip
locally without it, a failure in CI, where a silent skip would hide an untested fleet."""

from __future__ import annotations

import importlib.util
import os


def pytest_configure(config) -> None:
    if os.environ.get("CI") and importlib.util.find_spec("ray") is None:
        raise RuntimeError("ray[serve] missing in CI: scripts/dev.sh installs the cluster extra")
