"""Probe: hetpar's per-call overhead and first call against jax.jit.

Steady state: a one-device hetpar plan against jax.jit, interleaved step by
step (one step of each in turn, so load on a shared machine hits both
alike), medians and their ratio. On the GPU (the default, as `gpu.sh
overhead` runs it) zoo models with the batch on the host and on the GPU;
`--platform=cpu` times models on the first CPU device, among them
`hf_resnet`: a small Hugging Face Flax ResNet (~130 state leaves, little
compute), where per-call overhead shows.

First call (`--first_call`): the time to the first result of a step split in
two stages over cpu:0 and cpu:1 (`plan={...}`), and of a one-device plan,
against jax.jit's first call; each in a fresh process, in turns.

Usage:
  python experiments/probe_overhead.py
  python experiments/probe_overhead.py --platform=cpu --models=hf_resnet,mlp --steps=300
  python experiments/probe_overhead.py --first_call --models=hf_resnet --repeats=3
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

_PLATFORM = flags.DEFINE_enum("platform", "gpu", ["gpu", "cpu"], "where the steps run")
_MODELS = flags.DEFINE_list("models", None, "models (zoo names or hf_resnet); default by platform")
_STEPS = flags.DEFINE_integer("steps", 43, "interleaved steps per model (the first 3 not timed)")
_FIRST_CALL = flags.DEFINE_boolean("first_call", False, "time first calls instead")
_REPEATS = flags.DEFINE_integer("repeats", 3, "fresh processes per kind of first call")
_ONE = flags.DEFINE_string("one", None, "internal: time one first call (jit, one, split)")
_PLAN = flags.DEFINE_string("plan", None, "internal: the split plan, as JSON")


def hf_resnet():
    """(train_step, state, batch, {layer: device} over two devices) of a small HF ResNet."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from transformers import FlaxResNetForImageClassification, ResNetConfig

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    model = FlaxResNetForImageClassification(config, seed=0, input_shape=(1, 32, 32, 3))
    tx = optax.adam(1e-3)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model(batch["pixel_values"], params=p, train=False).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["labels"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.RandomState(0)
    batch = {"pixel_values": jnp.asarray(rng.randn(4, 3, 32, 32), jnp.float32),
             "labels": jnp.arange(4) % 10}
    return train_step, (model.params, tx.init(model.params)), batch


def workload(name):
    if name == "hf_resnet":
        return hf_resnet()
    from hetpar import zoo

    w = zoo.get(name, small=_PLATFORM.value == "cpu")
    args = w.example_args()
    return w.train_step, tuple(args[:-1]), args[-1]


def one(fn, state, batch):
    import jax

    t0 = time.perf_counter()
    *state, loss = fn(*state, batch)
    jax.block_until_ready(loss)
    return time.perf_counter() - t0, tuple(state)


def interleaved(step, state, batch, device, steps, *, batch_to=None):
    """Medians of jax.jit and a one-device hetpar plan, one step of each in turn."""
    import jax

    import hetpar

    jitted = jax.jit(step)
    auto = hetpar.auto(step, devices=[device])

    def jit_step(*a):
        # The caller moves a host batch to the device, as hetpar does.
        return jitted(*a[:-1], a[-1] if batch_to is None else jax.device_put(a[-1], batch_to))

    s_j = s_a = state
    tj, ta = [], []
    for i in range(steps):
        t, s_j = one(jit_step, s_j, batch)
        u, s_a = one(auto, s_a, batch)
        if i >= 3:
            tj.append(t)
            ta.append(u)
    return statistics.median(tj), statistics.median(ta)


def steady():
    import jax

    if _PLATFORM.value == "gpu":
        gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
        for name in _MODELS.value or ("mlp", "transformer", "resnet18", "alexnet"):
            step, state, batch = workload(name)
            for where, b in (("host", jax.device_put(batch, cpu)),
                             ("gpu", jax.device_put(batch, gpu))):
                j, a = interleaved(step, jax.device_put(state, gpu), b, "gpu:0",
                                   _STEPS.value, batch_to=gpu)
                print(f"{name:12s} batch on {where:4s}: jax.jit {j * 1e3:7.3f} ms  hetpar "
                      f"{a * 1e3:7.3f} ms  ratio {a / j:.3f}", flush=True)
        return
    for name in _MODELS.value or ("hf_resnet", "mlp", "transformer"):
        step, state, batch = workload(name)
        leaves = len(jax.tree_util.tree_leaves((state, batch)))
        j, a = interleaved(step, state, batch, "cpu:0", _STEPS.value)
        print(f"{name:12s} {leaves:4d} leaves: jax.jit {j * 1e3:7.3f} ms  hetpar "
              f"{a * 1e3:7.3f} ms  ratio {a / j:.3f}", flush=True)


def first_call_here(name, kind):
    """Seconds to the first result of `kind` (jit, one, split) in this fresh process."""
    import jax

    import hetpar

    step, state, batch = workload(name)
    jax.block_until_ready(jax.jit(lambda x: x + 1)(1.0))  # backend up
    if kind == "layers":  # traced here, so that no timed process has traced before
        print(json.dumps(hetpar.trace(step, *state, batch).layers))
        return
    if kind == "split":
        fn = hetpar.auto(step, plan=json.loads(_PLAN.value))
    elif kind == "one":
        fn = hetpar.auto(step, devices=["cpu:0"])
    else:
        fn = jax.jit(step)
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*state, batch))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stages = len(fn.lower(*state, batch).stages.stages) if kind == "split" else 0
    print(f"{wall:.3f} {cpu:.3f} {stages}", flush=True)


def first_calls():
    env = dict(os.environ)
    flag = "--xla_force_host_platform_device_count=2"
    if flag.split("=")[0] not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()

    def child(name, kind, *more):
        return subprocess.run(
            [sys.executable, __file__, f"--one={kind}", f"--models={name}", "--platform=cpu",
             *more], env=env, capture_output=True, text=True, check=True).stdout

    for name in _MODELS.value or ("hf_resnet",):
        layers = json.loads(child(name, "layers").strip().splitlines()[-1])
        # The first half of the layers on cpu:0, the rest on cpu:1.
        plan = {n: "cpu:0" if k < len(layers) // 2 else "cpu:1" for k, n in enumerate(layers)}
        print(f"{name}: {len(layers)} layers, plan {plan}", flush=True)
        times: dict = {"jit": [], "one": [], "split": []}
        for _ in range(_REPEATS.value):
            for kind in times:  # in turns, each in a fresh process
                out = child(name, kind, f"--plan={json.dumps(plan)}")
                wall, cpu, stages = out.split()[-3:]
                times[kind].append((float(wall), float(cpu)))
                print(f"{name} {kind:5s} {float(wall):7.2f} s wall {float(cpu):7.2f} s cpu"
                      + (f" ({stages} stages)" if kind == "split" else ""), flush=True)
        j = statistics.median(w for w, _ in times["jit"])
        for kind in ("one", "split"):
            k = statistics.median(w for w, _ in times[kind])
            print(f"{name}: {kind} first call {k:.2f} s, jax.jit {j:.2f} s: ratio {k / j:.2f} "
                  f"(medians of {_REPEATS.value})", flush=True)


def main(argv):
    del argv
    if _ONE.value:
        first_call_here(_MODELS.value[0], _ONE.value)
    elif _FIRST_CALL.value:
        first_calls()
    else:
        steady()


if __name__ == "__main__":
    app.run(main)
