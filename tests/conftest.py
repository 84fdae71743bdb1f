"""Shared test setup: several virtual CPU devices, and the GPU marker.

Four CPU devices are forced before JAX starts, so multi-device tests
(splitting, transfers, residency, schedules) run on any machine.
"""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

# hetpar.auto calibrates at its first call by default (profile="auto"):
# hundreds of small steps would each be timed. The suite plans from spec
# sheets unless a test asks (profile="measure", or monkeypatches this away:
# tests/test_calibrate_default.py checks the default itself).
os.environ.setdefault("HETPAR_CALIBRATE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

# One compilation cache for the run's processes: a step compiled again, by
# another test or the other xdist worker, as the same XLA program is read back
# instead of compiled (each test builds its own functions, so JAX's in-memory
# caches miss). The process that starts the run makes the folder, its xdist
# workers inherit it through the environment, and it is removed at the end:
# every run starts cold, as CI does. The compiled code is the same.
# HETPAR_TEST_NO_COMPILE_CACHE=1 turns it off.
_OWN_CACHE = None
if not os.environ.get("HETPAR_TEST_NO_COMPILE_CACHE"):
    if not os.environ.get("HETPAR_TEST_JAX_CACHE"):
        _OWN_CACHE = tempfile.mkdtemp(prefix="hetpar-test-jax-cache-")
        os.environ["HETPAR_TEST_JAX_CACHE"] = _OWN_CACHE
    jax.config.update("jax_compilation_cache_dir", os.environ["HETPAR_TEST_JAX_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


# Zoo models whose compilation dominates a test on 2 cores (10-60 s each). A
# test run over one of them, by parameter or by fixture parameter, belongs to
# the slow tier; the fast tier (`-m "not slow"`) makes the same checks on the
# small models (mlp, lm_embed, transformer), and splits and pipelines a CNN,
# a transformer and an RNN cut to fewer layers (test_runtime.FAMILIES, whose
# cases are named by family). Tests slow for other reasons carry
# `@pytest.mark.slow` themselves.
SLOW_MODELS = frozenset({"alexnet", "cnn_preprocess", "conv6", "cyclegan_generator",
                         "mobilenet_v1", "resnet18", "resnet50", "rnn", "vgg16"})


def _over_slow_model(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(
        isinstance(v, str) and v in SLOW_MODELS for v in callspec.params.values())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _over_slow_model(item):
            item.add_marker(pytest.mark.slow)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
