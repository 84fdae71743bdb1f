"""Probe: does the step profile="measure" times equal the step a user's loop runs?

`hetpar.auto(profile="measure")` scales its layers to the whole step timed by
`cost_models.measure` (`jax.jit`, the same arguments every run). A user's loop
threads the state: each step takes the last one's outputs. On 2x H100 the
one-GPU plan of GPT-2 small at batch 16 predicted 21.8 ms and measured 28.7 ms
(bench_predictions.py). This times the same step every way, in one process,
one step of each in turn:

- `measure`: `cost_models.measure` (what calibration times);
- `jit, same args`: jax.jit, the same device arguments every run;
- `jit, threaded`: jax.jit, each step on the last one's outputs;
- `jit, threaded, donated`: the same with the state donated;
- `auto`: hetpar.auto on one device, threaded (one jax.jit executable);
- `auto measure`: the same with profile="measure", and its prediction.

With `--data_parallel` (two devices of the default platform), also the step
data parallel over both, interleaved with the rest:

- `measure_step over both`: `cost_models.measure_step` given both devices
  (what profile="measure" times for a replica's fixed part);
- `jit over both, threaded, host batch`: jax.jit over a mesh of both, the
  state replicated, the batch split;
- `auto data parallel`: hetpar.auto(data_parallel="always") over both.

and the same with the zoo's own batch, made with `jnp` on the default device
(uncommitted), as `hetpar run` passes it, or put split over both once:

- `measure_step over both, jnp batch` / `..., split batch`;
- `jit over both, threaded, jnp batch` / `..., split batch`;
- `auto data parallel, jnp batch` / `..., split batch`;
- `auto data parallel, jnp batch, loss read`: also `float(loss)` every step,
  as `hetpar run` prints it.

On 2x H200 at batch 16 the first measured 21.7 ms and hetpar.auto's
data-parallel step 35.6 ms (bench_predictions.py, one after the other).

    python experiments/probe_step_timing.py --batches 16 256 [--model transformer]
        [--data_parallel]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import numpy as np

import hetpar
from hetpar import zoo
from hetpar.cost_models import measure, measure_step


class _Loop:
    """One way of running the step, one step per `__call__` (timed)."""

    def __init__(self, step, args, threaded: bool, read_loss: bool = False):
        self.step, self.threaded, self.read_loss = step, threaded, read_loss
        self.state, self.batch = tuple(args[:-1]), args[-1]
        self.times: list[float] = []

    def __call__(self, timed: bool = True) -> None:
        t0 = time.perf_counter()
        *state, loss = self.step(*self.state, self.batch)
        jax.block_until_ready((state, loss))
        if self.read_loss:
            float(loss)
        if timed:
            self.times.append(time.perf_counter() - t0)
        if self.threaded:
            self.state = tuple(state)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="transformer")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--data_parallel", action="store_true",
                    help="also the step data parallel over the first two devices")
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    name = f"{dev.platform}:{dev.id}"
    rows = []
    for b in args.batches:
        w = zoo.get(args.model, small=args.small, batch=b)
        host = jax.tree_util.tree_map(np.asarray, w.example_args())
        on_dev = jax.device_put(host, dev)
        row = {"batch": b, "device": dev.device_kind}
        row["measure"] = measure(w.train_step, host, dev, k=args.steps, warmup=3).median_s
        j = jax.jit(w.train_step)
        jd = jax.jit(w.train_step, donate_argnums=tuple(range(len(host) - 1)))
        auto = hetpar.auto(w.train_step, devices=[name])
        calibrated = hetpar.auto(w.train_step, devices=[name], profile="measure")
        row["auto measure predicted"] = calibrated.lower(*host).predicted().step_time_s
        loops = {
            "jit, same args": _Loop(j, on_dev, threaded=False),
            "jit, threaded": _Loop(j, on_dev, threaded=True),
            "jit, threaded, host batch": _Loop(j, (*on_dev[:-1], host[-1]), threaded=True),
            "jit, threaded, donated": _Loop(jd, jax.device_put(host, dev), threaded=True),
            "auto": _Loop(auto, host, threaded=True),
            "auto measure": _Loop(calibrated, host, threaded=True),
        }
        if args.data_parallel:
            both = jax.devices()[:2]
            names = [f"{d.platform}:{d.id}" for d in both]
            row["measure_step over both"] = measure_step(w.train_step, host, both,
                                                         k=args.steps).median_s
            mesh = jax.sharding.Mesh(np.array(both), ("replica",))
            whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
            jm = jax.jit(w.train_step, in_shardings=(whole,) * (len(host) - 1) + (split,),
                         out_shardings=whole)
            loops["jit over both, threaded, host batch"] = _Loop(
                jm, (*jax.device_put(host[:-1], whole), host[-1]), threaded=True)
            loops["auto data parallel"] = _Loop(
                hetpar.auto(w.train_step, devices=names, data_parallel="always"), host,
                threaded=True)
            given = w.example_args()  # the zoo's batch: jnp, uncommitted
            assert not any(x.committed for x in jax.tree_util.tree_leaves(given[-1]))
            put = jax.device_put(given[-1], split)
            for kind, batch in (("jnp", given[-1]), ("split", put)):
                row[f"measure_step over both, {kind} batch"] = measure_step(
                    w.train_step, (*given[:-1], batch), both, k=args.steps).median_s
                loops[f"jit over both, threaded, {kind} batch"] = _Loop(
                    jm, (*jax.device_put(given[:-1], whole), batch), threaded=True)
                loops[f"auto data parallel, {kind} batch"] = _Loop(
                    hetpar.auto(w.train_step, devices=names, data_parallel="always"),
                    (*given[:-1], batch), threaded=True)
            loops["auto data parallel, jnp batch, loss read"] = _Loop(
                hetpar.auto(w.train_step, devices=names, data_parallel="always"), given,
                threaded=True, read_loss=True)
        for loop in loops.values():  # compile and warm up
            for _ in range(3):
                loop(timed=False)
        # Interleaved, one step of each in turn: drifts (clocks, a busy
        # host) hit every way alike.
        for _ in range(args.steps):
            for loop in loops.values():
                loop()
        row.update({k: statistics.median(v.times) for k, v in loops.items()})
        rows.append(row)
        print(" | ".join(f"{k} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{k} {v}"
                         for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
