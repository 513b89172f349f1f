"""Hypothesis profiles for the whole test suite (keep this file tiny; fixtures go in subfolders).

``ci`` (default): quick, deterministic, no deadline (2-core CI machines are noisy).
``soak``: many more examples and longer state-machine programs; select with
``RADIXKV_PROFILE=soak``.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True)
settings.register_profile(
    "soak", max_examples=250, stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True)
settings.load_profile(os.environ.get("RADIXKV_PROFILE", "ci"))
