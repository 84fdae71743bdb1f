"""Shared test setup: several virtual CPU devices, and the GPU marker.

Four CPU devices are forced before JAX starts, so multi-device tests
(splitting, transfers, residency, schedules) run on any machine.
"""

import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

# On a machine without a GPU, XLA's CPU code generation runs at LLVM -O0: the
# suite is mostly compiles of small steps, and LLVM's optimisation is a
# quarter of their time (fast tier 5:46 -> 4:30 on 2 cores). Every HLO pass
# (fusion, layout, buffer assignment: what hetpar's stages and XLA's whole
# step differ by) still runs, and hetpar and the `jax.jit` step it is checked
# against are compiled alike, leaf by leaf. Where a GPU is present the flags
# are left alone (the GPU tests time and compare real kernels), and
# HETPAR_TEST_XLA_OPT=1 keeps LLVM's optimisation on a CPU machine too.
_GPU_PRESENT = os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
if (not _GPU_PRESENT and not os.environ.get("HETPAR_TEST_XLA_OPT")
        and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

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


def codegen_unoptimised() -> bool:
    """Whether this run compiles at LLVM -O0 (see the top of this file)."""
    return "xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")


def rerun_optimised(request) -> None:
    """Runs the calling test again in a fresh process with XLA's code generation
    optimised, as users compile, and asserts it passed: for the few tests whose
    subject is the optimised code's rounding (the oracle's floor)."""
    env = dict(os.environ, HETPAR_TEST_XLA_OPT="1", HETPAR_TEST_NO_COMPILE_CACHE="1",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "").replace(
                   "--xla_backend_optimization_level=0", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", request.node.nodeid],
                          cwd=request.config.rootpath, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


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
