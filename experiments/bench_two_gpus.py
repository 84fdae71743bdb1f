"""Pipelines over two GPUs against one GPU and against data parallelism.

Reproduces the local model-parallelism study's setting (AlexNet, VGG16: model
parallelism with pipelining against a sequential baseline; data parallelism)
and the issue's goal model (the GPT-2-small-like transformer), side by side in
one run on one host:

- one GPU: plain `jax.jit` of the train step on gpu:0;
- data parallel: the same `jax.jit` step with the batch sharded over both GPUs
  and the state replicated (what a JAX user tries first);
- hetpar: the step split over gpu:0 and gpu:1, microbatches M under GPipe and
  1F1B, with (a) the planner's plan (spec-sheet costs, pipelined objective)
  and (b) a contiguous half/half plan; with the planner's predicted speedup.

Throughput is samples per second from the median step time. A time budget
stops the sweep early (what ran is still written). Usage:
  python experiments/bench_two_gpus.py --out $OUT/two_gpus
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from _timing import median_step, write_results
from absl import app, flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import hetpar
from hetpar import zoo

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "experiments/results/two_gpus", "output path prefix (.md, .json)")
flags.DEFINE_integer("steps", 20, "timed steps per configuration")
flags.DEFINE_float("budget_s", 420.0, "stop starting new configurations after this long")
flags.DEFINE_bool("quick", False, "small configs on virtual CPU devices (a smoke test)")
flags.DEFINE_string("profiles", None, "measured profiles (hetpar profile --out) for the planner")
flags.DEFINE_string("model", None, "run only this model (default: the built-in sweep)")
flags.DEFINE_integer("batch", None, "with --model: its batch size")
flags.DEFINE_list("microbatches", ["1", "4"], "with --model: microbatch counts")
flags.DEFINE_list("schedules", ["gpipe", "1f1b"], "with --model: schedules")
flags.DEFINE_bool("planner", True, "also run the planner's plan (else only half/half)")

_T0 = time.perf_counter()


def _time(step, args, steps):
    state = tuple(args[:-1])
    for _ in range(2):
        _, state = median_step(step, state, args[-1], 1)
    return median_step(step, state, args[-1], steps)[0]


def _devices(quick):
    if quick:
        return ["cpu:0", "cpu:1"], jax.devices("cpu")[:2]
    gpus = jax.devices("gpu")[:2]
    return [f"gpu:{d.id}" for d in gpus], gpus


def data_parallel(w, args, devs, steps):
    mesh = Mesh(np.array(devs), ("data",))
    rep = NamedSharding(mesh, PartitionSpec())
    by_batch = NamedSharding(mesh, PartitionSpec("data"))
    n = w.config["batch_size"]
    batch = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, by_batch if getattr(x, "ndim", 0) and x.shape[0] == n
                                 else rep), args[-1])
    state = jax.device_put(tuple(args[:-1]), rep)
    return _time(jax.jit(w.train_step), (*state, batch), steps)


def run_model(name, batch, microbatches, schedules, steps, quick, rows, timelines):
    names, devs = _devices(quick)
    w = zoo.get(name, small=quick, batch=batch)
    args = w.example_args()
    one = _time(jax.jit(w.train_step), jax.device_put(args, devs[0]), steps)
    rows.append({"model": name, "batch": batch, "config": "one GPU (jax.jit)", "step_s": one,
                 "speedup": 1.0})
    try:
        dp = data_parallel(w, args, devs, steps)
        rows.append({"model": name, "batch": batch, "config": "data parallel (jax.jit, sharded)",
                     "step_s": dp, "speedup": one / dp})
    except Exception as e:  # noqa: BLE001 - e.g. a batch that does not split
        rows.append({"model": name, "batch": batch, "config": "data parallel", "error": str(e)})
    # How much of a microbatched pipeline's time is launching kernels: one GPU
    # running the whole step M times at batch/M (an update each time, so a
    # slight over-estimate). If M x that exceeds the full-batch step, small
    # microbatches are launch-bound and no pipeline over two GPUs can win.
    for m in microbatches:
        if m > 1 and batch % m == 0 and time.perf_counter() - _T0 < FLAGS.budget_s:
            wm = zoo.get(name, small=quick, batch=batch // m)
            tm = _time(jax.jit(wm.train_step), jax.device_put(wm.example_args(), devs[0]), steps)
            rows.append({"model": name, "batch": batch,
                         "config": f"one GPU, whole step at batch {batch // m}, x{m}",
                         "microbatches": m, "step_s": m * tm, "speedup": one / (m * tm)})
            print(json.dumps(rows[-1], default=str), flush=True)
    layers = hetpar.trace(w.train_step, *args).layers
    half = {n: names[0] if i < len(layers) // 2 else names[1] for i, n in enumerate(layers)}
    for m in microbatches:
        for sched in schedules:
            plans = (("planner", None), ("half/half", half)) if FLAGS.planner else (
                ("half/half", half),)
            for plan_name, plan in plans:
                if time.perf_counter() - _T0 > FLAGS.budget_s:
                    return
                try:
                    step = hetpar.auto(w.train_step, devices=names, plan=plan, microbatches=m,
                                       schedule=sched, profile=_PROFILES or "auto")
                    compiled = step.lower(*args)
                    t = _time(step, args, steps)
                    row = {"model": name, "batch": batch, "config": f"hetpar {plan_name}",
                           "microbatches": m, "schedule": sched, "step_s": t,
                           "speedup": one / t,
                           "devices_used": sorted(set(compiled.assignment.values()))}
                    if compiled.plan is not None:
                        pred = compiled.plan.predicted.step_time_s
                        single = [b.predicted.step_time_s
                                  for k, b in compiled.plan.baselines.items()
                                  if k.startswith("only") and b.predicted is not None]
                        row["predicted_step_s"] = pred
                        row["predicted_speedup"] = min(single) / pred if single else None
                    rows.append(row)
                    if compiled._executor is not None and (name, m, sched) not in timelines:
                        ex = compiled._executor
                        ex.record_events = True
                        step(*args)
                        ex.record_events = False
                        timelines[f"{name} M={m} {sched} {plan_name}"] = [
                            vars(ev) for ev in ex.last_events]
                except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                    rows.append({"model": name, "batch": batch, "config": f"hetpar {plan_name}",
                                 "microbatches": m, "schedule": sched,
                                 "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(json.dumps(rows[-1], default=str), flush=True)


def to_markdown(res) -> str:
    lines = [f"# Two GPUs against one ({res['host']})", "",
             f"jax {res['jax']}. Median step over {res['steps']} steps after warm-up; speedup = "
             "one-GPU step time / this step time (same batch).", "",
             "| model | batch | configuration | M | schedule | step | speedup | predicted speedup "
             "| devices |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['config']} | "
                         f"{r.get('microbatches', '')} | {r.get('schedule', '')} | failed: "
                         f"{r['error'][:120]} | | | |")
            continue
        pred = r.get("predicted_speedup")
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['config']} | {r.get('microbatches', '')} | "
            f"{r.get('schedule', '')} | {r['step_s'] * 1e3:.2f} ms | {r['speedup']:.2f}x | "
            f"{'' if pred is None else f'{pred:.2f}x'} | {', '.join(r.get('devices_used', []))} |")
    return "\n".join(lines) + "\n"


_PROFILES = None


def main(argv):
    del argv
    global _PROFILES
    if FLAGS.profiles:
        from hetpar.cost_models import load_profiles

        _PROFILES = load_profiles(FLAGS.profiles)
    quick = FLAGS.quick
    if quick:
        jax.config.update("jax_num_cpu_devices", 2)
    rows, timelines = [], {}
    plan = ([("transformer", 8, (1, 2), ("gpipe", "1f1b"))] if quick else
            [("transformer", 32, (1, 4, 16), ("gpipe", "1f1b")),
             ("alexnet", 128, (4,), ("gpipe",)),
             ("vgg16", 32, (4,), ("gpipe",))])
    if FLAGS.model:
        plan = [(FLAGS.model, FLAGS.batch, tuple(int(m) for m in FLAGS.microbatches),
                 tuple(FLAGS.schedules))]
    for name, batch, ms, scheds in plan:
        if time.perf_counter() - _T0 > FLAGS.budget_s:
            break
        try:
            run_model(name, batch, ms, scheds, 5 if quick else FLAGS.steps, quick, rows,
                      timelines)
        except Exception as e:  # noqa: BLE001
            rows.append({"model": name, "batch": batch, "config": "all",
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
    devs = _devices(quick)[1]
    res = {"host": ", ".join(sorted({d.device_kind for d in devs})) + f" x{len(devs)}",
           "jax": jax.__version__, "steps": FLAGS.steps, "rows": rows}
    write_results(FLAGS.out, to_markdown(res), res)
    with open(FLAGS.out + "_timelines.json", "w") as f:
        json.dump(timelines, f, default=str)


if __name__ == "__main__":
    app.run(main)
