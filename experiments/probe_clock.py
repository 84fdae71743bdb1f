"""What hetpar's step clock costs the calls it times (issue 41).

Runs 71-73 (fit_h200x2): over two H200s, hetpar's FSDP step of the zoo
transformer (about 1,750 arrays of state) ran 7-15 ms slower in exactly the
calls its `StepClock` observes (calls 2-8) than in later calls and than the
same jit called directly, both before and after the clock waited for one
result a device instead of all. This times, in one process and in turns,
the step's own jit called in each of these ways, each step then waited for
as bench_fit waits (its loss, then the whole state):

- `inner`: the jit alone;
- `pick`: the jit, then the clock's choice of arrays (`one_per_device`) and
  its wait on them, in the caller's thread (the clock since the fifteenth
  session; run 75 timed its choice by sorting every result, since then it
  takes them in order until they cover the executable's devices);
- `pick_cpu`: the clock's choice of arrays, no wait: its Python alone;
- `wait_all`: the jit, then a wait on every result (the clock before);
- `thread`: the jit, the choice handed to a waiting thread (a clock that
  never blocks the call);
- `hetpar_clock` / `hetpar`: `hetpar.auto`'s call with its clock observing
  every call, and with its clock done (as after its eighth call).

Spec sheets only (`HETPAR_CALIBRATE=0`): the plan is FSDP, forced.

    HETPAR_CALIBRATE=0 python experiments/probe_clock.py --out R.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu HETPAR_CALIBRATE=0 \\
        python experiments/probe_clock.py --tiny --out /tmp/r.json     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4, help="steps of each kind a round")
    ap.add_argument("--d-model", type=int, default=2048)
    a = ap.parse_args()

    import jax
    from _fsdp import hetpar_fsdp

    from hetpar import zoo
    from hetpar._step_clock import StepClock, one_per_device, wait

    cfg = (dict(batch=4, d_model=64, num_layers=24, num_heads=4) if a.tiny
           else dict(batch=8, d_model=a.d_model, num_layers=24, num_heads=16))
    w = zoo.get("transformer", **cfg)
    devs = jax.devices()[:2]
    out = {"config": cfg, "devices": [str(d) for d in devs], "jax": jax.__version__,
           "card": getattr(devs[0], "device_kind", "")}

    t = time.perf_counter()
    with jax.default_device(jax.devices("cpu")[0]):
        host_args = w.example_args()
    auto, step, inner, (p, o, b) = hetpar_fsdp(w.train_step, host_args, devs)
    del host_args
    out["first_call_s"] = time.perf_counter() - t
    out["plan"] = {"sharding": step.plan.sharding, "replicas": list(step.plan.replicas)}
    out["leaves"] = len(jax.tree_util.tree_leaves((p, o)))

    done_at: queue.Queue = queue.Queue()
    pending: queue.Queue = queue.Queue()

    def waiter():
        while True:
            arrays = pending.get()
            wait(arrays)
            done_at.put(time.perf_counter())

    threading.Thread(target=waiter, daemon=True).start()

    def picked(res):
        arrays = [x for x in jax.tree_util.tree_leaves(res) if isinstance(x, jax.Array)]
        return one_per_device(arrays, step.executable_devices)

    def call(kind, p, o):
        if kind == "hetpar_clock":
            step.clock = StepClock()  # observing again: every call of the round
            return auto(p, o, b)
        if kind == "hetpar":
            step.clock.done = True
            return auto(p, o, b)
        res = inner(p, o, b)
        if kind == "pick":
            wait(picked(res))
        elif kind == "pick_cpu":
            picked(res)
        elif kind == "wait_all":
            wait(jax.tree_util.tree_leaves(res))
        elif kind == "thread":
            pending.put(picked(res))
        return res

    kinds = ["inner", "pick", "pick_cpu", "wait_all", "thread", "hetpar_clock", "hetpar"]
    times = {k: [] for k in kinds}
    to_loss = {k: [] for k in kinds}
    calls = {k: [] for k in kinds}  # the call alone: until it returned
    for _ in range(a.rounds):
        for kind in kinds:
            for _ in range(a.steps):
                t = time.perf_counter()
                p, o, loss = call(kind, p, o)
                calls[kind].append(time.perf_counter() - t)
                float(loss)
                to_loss[kind].append(time.perf_counter() - t)
                jax.block_until_ready((p, o))
                times[kind].append(time.perf_counter() - t)
            if kind == "thread":  # its waits all came back before the next kind
                for _ in range(a.steps):
                    done_at.get(timeout=60)
    # The clock's Python alone, many times over the same results (no step between).
    res = (p, o, loss)
    t = time.perf_counter()
    for _ in range(50):
        picked(res)
    out["pick_python_ms"] = (time.perf_counter() - t) / 50 * 1e3
    t = time.perf_counter()
    for _ in range(50):
        jax.tree_util.tree_leaves(res)
    out["tree_leaves_ms"] = (time.perf_counter() - t) / 50 * 1e3

    med = {k: statistics.median(v) for k, v in times.items()}
    out.update({"times_s": times, "times_to_loss_s": to_loss, "calls_s": calls,
                "median_s": med,
                "median_to_loss_s": {k: statistics.median(v) for k, v in to_loss.items()},
                "median_call_s": {k: statistics.median(v) for k, v in calls.items()},
                "over_inner": {k: v / med["inner"] for k, v in med.items()}})
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("median_s", "median_to_loss_s", "over_inner",
                                          "pick_python_ms", "tree_leaves_ms", "leaves")}),
          flush=True)


if __name__ == "__main__":
    main()
