"""Fixtures of the core tests; the helpers themselves live in core_helpers.py."""

from __future__ import annotations

import pytest
from core_helpers import STEPS, FakeClock


def pytest_terminal_summary(terminalreporter):
    """Report how many state-machine rule steps ran (the soak run records this number)."""
    if STEPS.steps:
        total = sum(STEPS.steps.values())
        terminalreporter.write_sep("-", f"core state machines: {total} rule steps in "
                                        f"{sum(STEPS.programs.values())} programs")
        for name in sorted(STEPS.steps):
            ev = STEPS.events.get(name)
            extra = ("; " + ", ".join(f"{k} {v}" for k, v in sorted(ev.items()))) if ev else ""
            terminalreporter.write_line(
                f"  {name}: {STEPS.steps[name]} steps, {STEPS.programs.get(name, 0)} programs"
                f"{extra}")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
