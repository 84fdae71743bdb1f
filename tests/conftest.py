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


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU (none present)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
