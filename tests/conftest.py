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



def pytest_configure(config) -> None:
    """Converted copies of GGUF models (radixkv.load_cache) go to a per-run temp folder, never
    the user's ~/.cache, unless the caller chose a folder."""
    import tempfile

    # Engines skip warming oneDNN's per-row-count GEMM kernels (up to 0.5 s each: the suite
    # builds hundreds); test_engine_correctness's warm-up test turns it back on.
    os.environ.setdefault("RADIXKV_WARM_GEMM_ROWS", "0")
    config.radixkv_model_cache = None
    if "RADIXKV_MODEL_CACHE_DIR" not in os.environ:
        config.radixkv_model_cache = tempfile.mkdtemp(prefix="radixkv-test-models-")
        os.environ["RADIXKV_MODEL_CACHE_DIR"] = config.radixkv_model_cache


def pytest_unconfigure(config) -> None:
    import shutil

    if getattr(config, "radixkv_model_cache", None):
        shutil.rmtree(config.radixkv_model_cache, ignore_errors=True)
