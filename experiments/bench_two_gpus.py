"""Pipelines over two GPUs against one GPU and against data parallelism.

Reproduces the local model-parallelism study's setting (AlexNet, VGG16: model
parallelism with pipelining against a sequential baseline; data parallelism)
and the issue's goal model (the GPT-2-small-like transformer), side by side in
one run on one host:

- one GPU: plain `jax.jit` of the train step on gpu:0;
- data parallel: the same `jax.jit` step with the batch sharded over both GPUs
  and the state replicated (what a JAX user tries first);
- hetpar: the step split over gpu:0 and gpu:1, microbatches M under GPipe and
  1F1B, with (a) the planner's pipelined plan for each M and schedule, and
  (b) a contiguous half/half plan by layer count (--half); M = 1 runs the
  first plan's stages without microbatches (model parallelism alone).

Predictions come from the table a user gets from `hetpar costs MODEL
--measure --calibrate --microbatches M` (one per M): layers measured alone
at batch and batch / M (the fixed part per microbatch fitted from the two),
scaled to the whole step hetpar times, with the runtime's cost per stage and
per crossing. (Until 2026-11-27 this script calibrated by hand: spec-sheet
shares scaled to its own one-GPU timing, a fixed part from one GPU's
gradient at batch / M; the "launch floor" rows still measure the latter.)
A pipeline's predicted step replays its schedule (`simulate`); the ILP's
closed form is noted beside it. Timelines of the runs and of their replays
are written for plotting (plot_timeline.py).

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
flags.DEFINE_bool("choice", True, "also run the planner's free choice (it may replicate)")
flags.DEFINE_bool("half", True, "run the contiguous half/half pipelines")
flags.DEFINE_bool("memory_only", False, "with --memory_fraction: only the one-GPU step, its "
                  "launch floor and the memory-bound case")
flags.DEFINE_float("memory_fraction", 0.0, "also run a memory-bound case: a per-GPU budget of "
                   "this fraction of what the step needs (0: skip)")

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


def calibrated_table(w, names, microbatches, quick):
    """The planner's table of the step on the two GPUs, as a user gets it:
    `hetpar costs MODEL --devices gpu:0,gpu:1 --measure --calibrate
    --microbatches M` (`zoo.cost_table`). Every layer measured alone at
    batch and batch / M (its fixed part per microbatch fitted from the two),
    scaled to the whole step hetpar times under `jax.jit`, with the runtime's
    cost per stage and per crossing measured too. No benchmark-side scaling.

    Returns:
      (table, fixed: seconds every microbatch pays whole, summed over layers).
    """
    table = zoo.cost_table(w.name, names, small=quick, batch=int(w.config["batch_size"]),
                           measure=True, microbatches=microbatches, calibrate=True,
                           profiles=_PROFILES, k=5)
    fixed = sum((la.fixed_s or {}).get(names[0], 0.0) for la in table.layers)
    return table, fixed


def _grad_time(w, dev, steps):
    """Median seconds of one GPU computing the gradient alone (forward and backward)."""
    variables, _, batch = jax.device_put(w.example_args(), dev)
    fn = jax.jit(jax.grad(w.loss))
    for _ in range(2):
        jax.block_until_ready(fn(variables, batch))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(variables, batch))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _floors(name, batch, microbatches, quick, dev, steps, base, add):
    """Gradient-only times: {M: g(batch / M)} and g(batch), each added as a row."""
    grad = _grad_time(zoo.get(name, small=quick, batch=batch), dev, steps)
    add({**base, "config": "one GPU, gradient only", "step_s": grad, "speedup": None})
    floor = {}
    for m in microbatches:
        if m > 1 and batch % m == 0 and time.perf_counter() - _T0 < FLAGS.budget_s:
            floor[m] = _grad_time(zoo.get(name, small=quick, batch=batch // m), dev, steps)
            add({**base, "config": f"one GPU, gradient only at batch {batch // m}, x{m}",
                 "microbatches": m, "step_s": m * floor[m], "speedup": None})
    return floor, grad


def _run(step, args, steps, **row):
    compiled = step.lower(*args)
    t = _time(step, args, steps)
    used = compiled.plan.replicas if compiled.plan is not None and compiled.plan.replicas else (
        sorted(set(compiled.assignment.values())))
    return compiled, {**row, "step_s": t, "devices_used": list(used)}


def _record_timeline(timelines, key, compiled, step, args):
    """One more step with the executor's events on, kept under `key` (split plans only)."""
    if compiled._executor is None or key in timelines:
        return
    ex = compiled._executor
    ex.record_events = True
    step(*args)
    ex.record_events = False
    timelines[key] = [vars(ev) for ev in ex.last_events]


def _close_to_jit(w, step, args, gpu):
    """Relative error of one hetpar step's outputs against one GPU's jax.jit."""
    ref = jax.jit(w.train_step)(*jax.device_put(args, gpu))
    out = step(*args)
    num = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
              for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)))
    den = sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in jax.tree_util.tree_leaves(ref))
    return (num / max(den, 1e-300)) ** 0.5


def _failed(row: dict, e: Exception) -> dict:
    return {**row, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def run_model(name, batch, microbatches, schedules, steps, quick, rows, timelines):
    from hetpar.planner import evaluate_data_parallel, plan, simulate

    names, devs = _devices(quick)
    w = zoo.get(name, small=quick, batch=batch)
    args = w.example_args()
    one = _time(jax.jit(w.train_step), jax.device_put(args, devs[0]), steps)
    base = {"model": name, "batch": batch}

    def add(row):
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)

    add({**base, "config": "one GPU (jax.jit)", "step_s": one, "speedup": 1.0})
    if FLAGS.memory_only:
        floor, grad = _floors(name, batch, [max(microbatches)], quick, devs[0], steps, base, add)
        table, _ = calibrated_table(w, names, max(microbatches), quick)
        return memory_case(w, args, table, one, names, devs, steps, rows, base, add, timelines)
    try:
        dp = data_parallel(w, args, devs, steps)
        dp_row = {**base, "config": "data parallel (jax.jit, sharded)", "step_s": dp,
                  "speedup": one / dp}
    except Exception as e:  # noqa: BLE001 - e.g. a batch that does not split
        dp_row = {**base, "config": "data parallel", "error": str(e)}
    # What every microbatch pays whole (kernel launches): one GPU computing the
    # gradient at batch / M, M times, against once at the full batch.
    floor, grad = _floors(name, batch, microbatches, quick, devs[0], steps, base, add)
    # One table per M, calibrated at that M's microbatch size (the fixed part
    # of a step differs with it); the planner's choice and data parallelism
    # (batch / 2 per GPU) use M = 2's when measured.
    tables = {}
    for m in sorted(floor):
        tables[m], fixed = calibrated_table(w, names, m, quick)
        print(f"calibrated at M={m}: one GPU {one * 1e3:.1f} ms, fixed part "
              f"{fixed * 1e3:.2f} ms", flush=True)
    table = tables.get(2) or (tables[max(tables)] if tables else
                              calibrated_table(w, names, 1, quick)[0])
    if "error" not in dp_row:
        dp_row["predicted_speedup"] = one / evaluate_data_parallel(table, names).step_time_s
    add(dp_row)
    layers = table.layer_names
    half = {n: names[0] if i < len(layers) // 2 else names[1] for i, n in enumerate(layers)}

    def predicted(assignment, m, sched):
        return one / simulate(tables.get(m, table), assignment, m, sched).step_time_s

    # The planner's choice on the calibrated table (it may replicate the step).
    if FLAGS.planner and FLAGS.choice:
        try:
            p = plan(table, baselines=False)
            step = hetpar.auto(w.train_step, plan=p, profile=_PROFILES or "auto")
            compiled, row = _run(step, args, steps, **base, config="hetpar planner",
                                 microbatches=1)
            row.update(speedup=one / row["step_s"],
                       predicted_speedup=one / p.predicted.step_time_s,
                       chosen=p.solver.get("chosen", "layer placement"),
                       rel_error_vs_jit=_close_to_jit(w, step, args, devs[0]))
            add(row)
        except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
            add(_failed({**base, "config": "hetpar planner"}, e))
    # The planner's pipelines (layer placements only), per M and schedule, on a
    # table calibrated at that M's microbatch size; the prediction replays the
    # schedule (`hetpar.planner.simulate`). M = 1 runs the M = 2 plan's stages
    # without microbatches (model parallelism without pipelining).
    pipelined = sorted(m for m in microbatches if m > 1)
    for m in sorted(microbatches) if FLAGS.planner and pipelined else ():
        table_m = tables.get(m, table)
        for sched in schedules if m > 1 else ["gpipe"]:
            if time.perf_counter() - _T0 > FLAGS.budget_s:
                break
            try:
                # M = 1: the stages of the smallest M's plan, no microbatches.
                p = plan(tables.get(pipelined[0], table) if m == 1 else table_m,
                         mode="pipelined", microbatches=max(m, pipelined[0]),
                         schedule=sched, data_parallel=False, baselines=False)
                run_pipeline(w, args, p.assignment, m, sched, one, steps, base, add, timelines,
                             devs, table_m, p if m > 1 else None)
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                add(_failed({**base, "config": "hetpar planner pipeline", "microbatches": m,
                             "schedule": sched}, e))
    for m in microbatches if FLAGS.half else ():
        for sched in schedules:
            if time.perf_counter() - _T0 > FLAGS.budget_s:
                return
            try:
                step = hetpar.auto(w.train_step, devices=names, plan=half, microbatches=m,
                                   schedule=sched, profile=_PROFILES or "auto")
                compiled, row = _run(step, args, steps, **base, config="hetpar half/half",
                                     microbatches=m, schedule=sched)
                row.update(speedup=one / row["step_s"], predicted_speedup=predicted(half, m, sched))
                add(row)
                _record_timeline(timelines, f"{name} M={m} {sched} half/half", compiled, step,
                                 args)
            except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                add(_failed({**base, "config": "hetpar half/half", "microbatches": m,
                             "schedule": sched}, e))
    if FLAGS.memory_fraction and time.perf_counter() - _T0 < FLAGS.budget_s:
        memory_case(w, args, table, one, names, devs, steps, rows, base, add, timelines)


def run_pipeline(w, args, assignment, m, sched, one, steps, base, add, timelines, devs, table,
                 p):
    """Runs one planned pipeline; records its row, its timeline and the replayed one."""
    from hetpar.planner import simulate

    step = hetpar.auto(w.train_step, plan=dict(assignment), microbatches=m, schedule=sched,
                       profile=_PROFILES or "auto")
    compiled, row = _run(step, args, steps, **base, config="hetpar planner pipeline",
                         microbatches=m, schedule=sched)
    replay = simulate(table, assignment, m, sched)
    stages = sorted({d for d in assignment.values()})
    row.update(speedup=one / row["step_s"], predicted_speedup=one / replay.step_time_s,
               predicted_s=replay.step_time_s,
               stage_layers={d: sum(v == d for v in assignment.values()) for d in stages},
               rel_error_vs_jit=_close_to_jit(w, step, args, devs[0]))
    if p is not None:
        row.update(closed_form_speedup=one / p.predicted.closed_form_s,
                   stages_chosen=p.solver.get("chosen_stages", "as solved"))
    add(row)
    key = f"{w.name} M={m} {sched} planner"
    _record_timeline(timelines, key, compiled, step, args)
    timelines[key + " (replayed)"] = replay.timeline()


def memory_case(w, args, table, one, names, devs, steps, rows, base, add, timelines):
    """A model too large for one GPU: a per-GPU memory budget every plan obeys.

    The budget is a fraction of what the step needs on one device (parameters,
    gradients, optimizer state, activations). One GPU and data parallelism
    (a full copy of the state on each GPU) cannot run; hetpar pipelines the
    step over both. Its result is checked against one GPU's jax.jit without
    the budget (the card itself has the memory).
    """
    import dataclasses

    from hetpar.planner import data_parallel_obstacle, plan, violations

    need = sum(la.memory_bytes[names[0]] for la in table.layers)
    budget = FLAGS.memory_fraction * need
    tight = dataclasses.replace(table, devices=tuple(
        dataclasses.replace(d, memory_bytes=budget) for d in table.devices))
    m, sched = 4, "1f1b"
    cfg = {**base, "config": f"memory budget {budget / 1e9:.2f} GB per GPU "
           f"(needs {need / 1e9:.2f} GB): hetpar planner", "microbatches": m, "schedule": sched}
    try:
        p = plan(tight, mode="pipelined", microbatches=m, schedule=sched, baselines=False)
        one_gpu = violations(tight, dict.fromkeys(table.layer_names, names[0]))
        dp_reason = data_parallel_obstacle(tight, names)
        # A plan that replicates runs as a Plan (a dict cannot say "replicas").
        step = hetpar.auto(w.train_step, plan=p if p.replicas else dict(p.assignment),
                           microbatches=m, schedule=sched, profile=_PROFILES or "auto")
        compiled, row = _run(step, args, steps, **cfg)
        per_gpu = dict(p.predicted.memory_bytes)
        row.update(speedup=one / row["step_s"], predicted_speedup=one / p.predicted.step_time_s,
                   one_gpu="cannot run: " + "; ".join(one_gpu),
                   data_parallel="fits" if dp_reason is None else "cannot run: " + dp_reason,
                   chosen=p.solver.get("chosen", "layer placement"),
                   gpu_gb={d: v / 1e9 for d, v in per_gpu.items()},
                   rel_error_vs_jit=_close_to_jit(w, step, args, devs[0]))
        if p.predicted.closed_form_s:
            row.update(closed_form_speedup=one / p.predicted.closed_form_s,
                       stages_chosen=p.solver.get("chosen_stages", "as solved"))
        add(row)
        if not p.replicas:
            from hetpar.planner import simulate

            key = f"{w.name} M={m} {sched} memory budget"
            _record_timeline(timelines, key, compiled, step, args)
            timelines[key + " (replayed)"] = simulate(tight, p.assignment, m, sched).timeline()
    except Exception as e:  # noqa: BLE001
        add(_failed(cfg, e))


def to_markdown(res) -> str:
    lines = [f"# Two GPUs against one ({res['host']})", "",
             f"jax {res['jax']}. Median step over {res['steps']} steps after warm-up; speedup = "
             "one-GPU step time / this step time (same batch).", "",
             "| model | batch | configuration | M | schedule | step | speedup | predicted speedup "
             "| devices | notes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | {r['config']} | "
                         f"{r.get('microbatches', '')} | {r.get('schedule', '')} | failed: "
                         f"{r['error'][:120]} | | | | |")
            continue
        pred = r.get("predicted_speedup")
        speedup = "" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        notes = []
        if "chosen" in r:
            notes.append(f"chose {r['chosen']}")
        if "rel_error_vs_jit" in r:
            notes.append(f"rel. error vs jax.jit {r['rel_error_vs_jit']:.1e}")
        if "closed_form_speedup" in r:
            notes.append(f"closed form {r['closed_form_speedup']:.2f}x; stages "
                         f"{r.get('stages_chosen', '')}")
        if "stage_layers" in r:
            notes.append("layers " + ", ".join(f"{d} {n}" for d, n in r["stage_layers"].items()))
        if "gpu_gb" in r:
            notes.append("held " + ", ".join(f"{d} {v:.2f} GB" for d, v in r["gpu_gb"].items()))
        for k in ("one_gpu", "data_parallel"):
            if k in r:
                notes.append(f"{k.replace('_', ' ')}: {r[k][:160]}")
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['config']} | {r.get('microbatches', '')} | "
            f"{r.get('schedule', '')} | {r['step_s'] * 1e3:.2f} ms | "
            f"{speedup} | "
            f"{'' if pred is None else f'{pred:.2f}x'} | {', '.join(r.get('devices_used', []))} | "
            f"{'; '.join(notes)} |")
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
            rows.append(_failed({"model": name, "batch": batch, "config": "all"}, e))
    devs = _devices(quick)[1]
    res = {"host": ", ".join(sorted({d.device_kind for d in devs})) + f" x{len(devs)}",
           "jax": jax.__version__, "steps": FLAGS.steps, "rows": rows}
    write_results(FLAGS.out, to_markdown(res), res)
    with open(FLAGS.out + "_timelines.json", "w") as f:
        json.dump(timelines, f, default=str)


if __name__ == "__main__":
    app.run(main)
