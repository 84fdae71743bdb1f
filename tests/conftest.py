"""Shared test setup: several virtual CPU devices, and the GPU marker.

Four CPU devices are forced before JAX starts, so multi-device tests
(splitting, transfers, residency, schedules) run on any machine.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


# Zoo models whose compilation dominates a test on 2 cores (10-60 s each). A
# test run over one of them, by parameter or by fixture parameter, belongs to
# the slow tier; the fast tier (`-m "not slow"`) makes the same checks on the
# small models (mlp, lm_embed, transformer). Tests slow for other reasons carry
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
