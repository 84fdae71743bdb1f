"""Multi-controller groundwork: `python -m hetpar.launch` and `hetpar._distributed`.

The end-to-end tests start 2 processes x 2 virtual CPU devices, joined by
`jax.distributed` with gloo CPU collectives (docs/distributed.md). They run in
subprocesses, so this pytest process's own 4 forced devices do not matter.
"""

import os
import subprocess
import sys
import textwrap
import time

import jax
import pytest

from hetpar import _distributed, launch
from hetpar.cost_models import device_name as single_process_name

EXPECTED_NAMES = ["p0/cpu:0", "p0/cpu:1", "p1/cpu:0", "p1/cpu:1"]

# Written to tmp_path and run by every process. argv[1]: "train" runs 3
# data-parallel adam steps over the global 4-device mesh and checks them against
# the same step on one device; "raise"/"abort" make process 1 fail after one
# step, before the next collective, while process 0 goes on into it.
SCRIPT = textwrap.dedent('''
    import json
    import sys

    from hetpar._distributed import abort, device_name, initialize

    assert initialize(), "not started by hetpar.launch"
    assert initialize()  # idempotent

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mode = sys.argv[1]
    pid = jax.process_index()
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    print("NAMES " + json.dumps([device_name(d) for d in jax.devices()]))
    print("LOCAL " + json.dumps([device_name(d) for d in jax.local_devices()]))

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    # Same seed on every process: the same full batch and initial params.
    rng = np.random.default_rng(0)
    sizes = [8, 32, 4]
    params = [{"w": (rng.normal(size=(m, n)) / np.sqrt(m)).astype(np.float32),
               "b": np.zeros(n, np.float32)} for m, n in zip(sizes[:-1], sizes[1:])]
    x = rng.normal(size=(64, sizes[0])).astype(np.float32)
    y = rng.normal(size=(64, sizes[-1])).astype(np.float32)
    opt = optax.adam(1e-2)

    def loss_fn(params, x, y):
        h = x
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            if i < len(params) - 1:
                h = jnp.tanh(h)
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run(params, opt_state, x, y, jitted, steps=3):
        losses = []
        for i in range(steps):
            if i == 1 and pid == 1 and mode == "raise":
                raise RuntimeError("process 1 fails on purpose")
            if i == 1 and pid == 1 and mode == "abort":
                print("process 1 aborts on purpose", flush=True)
                abort(3)
            params, opt_state, loss = jitted(params, opt_state, x, y)
            losses.append(np.asarray(loss))
        return params, losses

    # Across processes: params and optimizer state replicated, batch split 4 ways.
    def global_array(a, sharding):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    g_params = jax.tree.map(lambda a: global_array(a, replicated), params)
    g_state = jax.tree.map(lambda a: global_array(a, replicated), opt.init(params))
    g_step = jax.jit(step, out_shardings=(replicated, replicated, replicated))
    g_params, g_losses = run(g_params, g_state, global_array(x, by_batch),
                             global_array(y, by_batch), g_step)

    # The reference: the whole batch on this process's first device alone.
    dev = jax.local_devices()[0]
    r_params, r_losses = run(jax.device_put(params, dev), jax.device_put(opt.init(params), dev),
                             jax.device_put(x, dev), jax.device_put(y, dev), jax.jit(step))

    def rel_err(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))

    errs = [rel_err(a, b) for a, b in zip(g_losses, r_losses)]
    errs += [rel_err(a, b) for a, b in zip(jax.tree.leaves(g_params), jax.tree.leaves(r_params))]
    assert max(errs) <= 1e-5, errs
    assert r_losses[-1] < r_losses[0], r_losses  # it trains
    print(f"LOSSES {[float(v) for v in g_losses]}")
    print(f"OK process {pid} max rel err {max(errs):.2e}")
''')


def run_launcher(tmp_path, mode, *launcher_args, timeout=90):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    # CPU even where a GPU is present: the script expects cpu devices and gloo.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hetpar.launch", "-n", "2", "--devices_per_process", "2",
         *launcher_args, str(script), mode],
        capture_output=True, text=True, env=env, timeout=timeout)
    return proc, time.monotonic() - start


def lines_of(proc, i):
    return [ln[len(f"[p{i}] "):] for ln in proc.stdout.splitlines()
            if ln.startswith(f"[p{i}] ")]


def test_data_parallel_training_across_two_processes(tmp_path):
    proc, _ = run_launcher(tmp_path, "train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for i in range(2):
        out = lines_of(proc, i)
        assert any(ln.startswith(f"OK process {i}") for ln in out), out[-20:]
        names = next(ln for ln in out if ln.startswith("NAMES "))
        assert names == "NAMES " + str(EXPECTED_NAMES).replace("'", '"')
        local = next(ln for ln in out if ln.startswith("LOCAL "))
        assert local == f'LOCAL ["p{i}/cpu:0", "p{i}/cpu:1"]'
    # Both processes saw the same (replicated) losses.
    losses = [next(ln for ln in lines_of(proc, i) if ln.startswith("LOSSES ")) for i in range(2)]
    assert losses[0] == losses[1]


@pytest.mark.parametrize("mode, status", [("raise", 1), ("abort", 3)])
def test_one_process_failing_stops_the_job(tmp_path, mode, status):
    # Process 0 blocks in its next collective, waiting for process 1, which is
    # gone: only the launcher's kill ends it (after --grace seconds).
    proc, seconds = run_launcher(tmp_path, mode, "--grace", "2")
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"process 1 failed first (exit code {status})" in proc.stderr, proc.stderr
    assert "killing process(es) 0" in proc.stderr
    assert not any(ln.startswith("OK") for ln in proc.stdout.splitlines())
    assert seconds < 60


def test_device_names_in_one_process():
    # One process: exactly today's names (hetpar.cost_models.device_name).
    assert jax.process_count() == 1
    for d in jax.devices():
        assert _distributed.device_name(d) == single_process_name(d) == f"cpu:{d.id}"
    assert _distributed.initialize() is False  # no HETPAR_* variables: nothing to join


@pytest.mark.parametrize("name, parsed", [
    ("p0/cpu:0", (0, "cpu", 0)), ("p12/gpu:3", (12, "gpu", 3)),
    ("cpu:1", (None, "cpu", 1)), ("tpu:7", (None, "tpu", 7))])
def test_parse_device_name(name, parsed):
    assert _distributed.parse_device_name(name) == parsed


@pytest.mark.parametrize("bad", ["cpu", "p/cpu:0", "p0/cpu", "0:1", "cpu:x", "p0/cpu:0 ", ""])
def test_parse_device_name_rejects(bad):
    with pytest.raises(ValueError, match="not a device name"):
        _distributed.parse_device_name(bad)


def test_child_env():
    base = {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=4", "KEEP": "1"}
    env = launch.child_env(base, process_id=1, num_processes=2, coordinator="localhost:123",
                           devices_per_process=2)
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=2"
    assert (env["HETPAR_COORDINATOR"], env["HETPAR_NUM_PROCESSES"],
            env["HETPAR_PROCESS_ID"]) == ("localhost:123", "2", "1")
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo" and env["KEEP"] == "1"
    assert base == {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=4",
                    "KEEP": "1"}  # not changed in place
    kept = launch.child_env({"JAX_CPU_COLLECTIVES_IMPLEMENTATION": "mpi"}, process_id=0,
                            num_processes=1, coordinator="localhost:1", devices_per_process=None)
    assert kept["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "mpi" and "XLA_FLAGS" not in kept
