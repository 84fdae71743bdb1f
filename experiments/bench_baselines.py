"""hetpar against its baselines, measured on CPU + GPU (issue: measured comparisons).

For every zoo model at its default (realistic) batch, on the GPU machine's card
and its 16-core CPU, side by side in one run:

  (a) all-GPU `jax.jit`, (b) all-CPU `jax.jit`, (c) greedy fastest device per
  layer, (d) memory fill in layer order (Accelerate-style), (e) hetpar's plan
  for time, (f) for cost, (g) for energy;

each with its measured step time (median after warm-up), dollars per 1000
samples, joules per step (E = P x T per device used: busy watts while it
computes, idle watts for the rest of the step), and hetpar's predicted step
time beside the measured one. Plans (c)-(g) come from the model's cost table:
every layer measured alone on both devices, then scaled per device so the
layers sum to that device's whole step, timed by hetpar with the runtime's
cost per stage and crossing (`zoo.cost_table(measure=True, calibrate=True)`,
what `hetpar costs MODEL --measure --calibrate` runs; uncalibrated
predictions, `measure=True` alone, are reported too). Plans (c)-(g) run under `hetpar.auto`.

Also: the CPU vs GPU speedup table beside the Tesla T4 study, energy per step
per device, and a memory-bound case (a GPU memory budget the model does not
fit, which every plan obeys): all-GPU cannot run; hetpar against memory fill
and all-CPU, with a timeline of hetpar's plan.

The batch starts every step on the host (the CPU device), as from a data
loader without prefetching; every variant pays for moving it.

Usage (on the GPU machine):
  python experiments/bench_baselines.py --out $OUT/baselines
  python experiments/bench_baselines.py --quick --out /tmp/b   # CPU smoke test
"""

from __future__ import annotations

import gc
import json
import statistics
import time
import traceback

import jax
import numpy as np
from _timing import median_step, write_results
from absl import app, flags

import hetpar
from hetpar import InfeasibleError, zoo
from hetpar.cost_models import load_profiles
from hetpar.planner import Arrays, evaluate, greedy_fastest, memory_fill, plan, violations

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "experiments/results/baselines", "output path prefix (.md, .json)")
flags.DEFINE_list("models", None, "zoo models (default: all)")
flags.DEFINE_integer("steps", 20, "timed steps per accelerator measurement")
flags.DEFINE_integer("cpu_steps", 3, "timed steps for plans that run layers on the CPU")
flags.DEFINE_integer("k", 3, "timed runs per layer measurement")
flags.DEFINE_bool("quick", False, "small configs, a second CPU device as the 'GPU' (smoke test)")
flags.DEFINE_string("memory_model", "transformer", "model of the memory-bound case ('' skips)")
flags.DEFINE_string("profiles", None, "measured profiles (hetpar profile --out): link "
                    "latencies and bandwidths, prices and watts for the cost tables")
flags.DEFINE_float("memory_fraction", 0.8,
                   "memory-bound case: GPU budget as a fraction of what the model needs")

PUBLISHED_T4 = {"conv6": "246x", "vgg16": "51-116x", "resnet18": "51-116x",
                "cyclegan_generator": "11x"}
CPU = "cpu:0"


def _accelerator() -> str:
    accs = [d for d in jax.devices() if d.platform != "cpu"]
    return f"{accs[0].platform}:{accs[0].id}" if accs else "cpu:1"


def _device(name: str) -> jax.Device:
    return hetpar.cost_models.present_devices()[name]


def _on_host(tree):
    return jax.device_put(tree, _device(CPU))


def time_jit(w, args, dev_name: str, steps: int) -> float:
    """(a)/(b): the step under plain jax.jit on one device; the batch comes from the host."""
    dev = _device(dev_name)
    jitted = jax.jit(w.train_step)
    state, batch = jax.device_put(tuple(args[:2]), dev), _on_host(args[2])

    def step(*a):
        return jitted(*a[:-1], jax.device_put(a[-1], dev))

    _, state = median_step(step, state, batch, 2)  # compile + warm-up
    t, _ = median_step(step, state, batch, steps)
    return t


def run_plan(w, args, assignment: dict, steps: int, microbatches: int = 1,
             timeline_steps: int = 0) -> dict:
    """A plan under hetpar.auto: median step, busy seconds per device, and a timeline."""
    step = hetpar.auto(w.train_step, plan=assignment, microbatches=microbatches,
                       schedule="1f1b" if microbatches > 1 else "gpipe")
    state, batch = tuple(args[:2]), _on_host(args[2])
    _, state = median_step(step, state, batch, 2)
    t, state = median_step(step, state, batch, steps)
    used = sorted(set(assignment.values()))
    out = {"step_s": t, "busy_s": {used[0]: t} if len(used) == 1 else {}, "timeline": []}
    if len(used) > 1:
        ex = step.lower(*state, batch)._executor
        ex.record_events = True
        busy: dict[str, list[float]] = {}
        t_first = None
        for _ in range(max(3, timeline_steps)):
            t_call = time.perf_counter()
            t_first = t_first or t_call
            *state, loss = step(*state, batch)
            jax.block_until_ready(loss)
            per: dict[str, float] = {}
            for ev in ex.last_events:
                per[ev.device] = per.get(ev.device, 0.0) + ev.end_s - ev.start_s
                out["timeline"].append({"device": ev.device, "phase": ev.phase,
                                        "microbatch": ev.microbatch,
                                        "start_s": ev.start_s + t_call - t_first,
                                        "end_s": ev.end_s + t_call - t_first})
            for d, b in per.items():
                busy.setdefault(d, []).append(b)
        ex.record_events = False
        out["busy_s"] = {d: statistics.median(v) for d, v in busy.items()}
    return out


def dollars_and_joules(table, assignment: dict, step_s: float, busy_s: dict,
                       batch: int) -> tuple[float, float]:
    """Measured $ per 1000 samples and J per step, priced by the planner's own rules."""
    arr = Arrays(table)
    used = np.zeros(len(arr.devices), bool)
    busy = np.zeros(len(arr.devices))
    for d in set(assignment.values()):
        used[arr.dindex[d]] = True
        busy[arr.dindex[d]] = min(busy_s.get(d, step_s), step_s)
    return (step_s * arr.hourly_price(used) / 3600.0 / batch * 1000.0,
            arr.joules(used, busy, step_s))


def _key(assignment: dict) -> tuple:
    return tuple(sorted(assignment.items()))


def _describe(assignment: dict, acc: str) -> str:
    used = sorted(set(assignment.values()))
    if len(used) == 1:
        return f"all {used[0]}"
    on_cpu = [layer for layer, d in assignment.items() if d == CPU]
    few = ", ".join(on_cpu[:4]) + (", ..." if len(on_cpu) > 4 else "")
    return f"{len(on_cpu)}/{len(assignment)} layers on {CPU} ({few}), rest on {acc}"


def measure_table(w, acc: str, k: int, small: bool):
    """(measured, calibrated) cost tables of the step on the accelerator and
    the CPU, as a user gets them from `hetpar costs MODEL --measure
    [--calibrate]`: no benchmark-side scaling."""
    t0 = time.perf_counter()
    profiles = load_profiles(FLAGS.profiles) if FLAGS.profiles else None
    # budget=None: the all-CPU rows need the CPU timed too, however slow.
    kw = dict(small=small, batch=int(w.config["batch_size"]), measure=True, k=k,
              profiles=profiles, progress=lambda line: print("  " + line, flush=True),
              budget=None)
    raw = zoo.cost_table(w.name, [acc, CPU], **kw)
    table = zoo.cost_table(w.name, [acc, CPU], calibrate=True, **kw)  # layers cached: cheap
    print(f"  cost tables measured in {time.perf_counter() - t0:.0f} s", flush=True)
    return raw, table


def compare(name: str, small: bool, steps: int, cpu_steps: int, k: int) -> dict:
    """Rows (a)-(g) for one model; the cost tables are returned for the memory case."""
    acc = _accelerator()
    w = zoo.get(name, small=small)
    batch = int(w.config["batch_size"])
    args = w.example_args()
    print(f"== {name} (batch {batch})", flush=True)
    jit_s = {acc: time_jit(w, args, acc, steps), CPU: time_jit(w, args, CPU, cpu_steps)}
    print(f"  jax.jit: {acc} {jit_s[acc] * 1e3:.2f} ms, {CPU} {jit_s[CPU] * 1e3:.1f} ms",
          flush=True)
    raw, table = measure_table(w, acc, k, small)
    plans = {
        "greedy fastest": greedy_fastest(table).assignment,
        "memory fill": memory_fill(table).assignment,
        "hetpar (time)": plan(table, objective="time", baselines=False).assignment,
        "hetpar (cost)": plan(table, objective="cost", baselines=False).assignment,
        "hetpar (energy)": plan(table, objective="energy", baselines=False).assignment,
    }
    rows = []
    for label, dev in (("all-GPU jax.jit", acc), ("all-CPU jax.jit", CPU)):
        one = {layer: dev for layer in table.layer_names}
        usd, joules = dollars_and_joules(table, one, jit_s[dev], {dev: jit_s[dev]}, batch)
        rows.append({"variant": label, "plan": f"all {dev}", "step_s": jit_s[dev],
                     "usd_per_1000": usd, "joules_per_step": joules,
                     "predicted_s": evaluate(table, one).step_time_s,
                     "predicted_raw_s": evaluate(raw, one).step_time_s})
    runs: dict = {}
    for label, asg in plans.items():
        if _key(asg) not in runs:
            on_cpu = CPU in asg.values()
            print(f"  running {label}: {_describe(asg, acc)}", flush=True)
            runs[_key(asg)] = run_plan(w, args, asg, cpu_steps if on_cpu else steps)
        r = runs[_key(asg)]
        usd, joules = dollars_and_joules(table, asg, r["step_s"], r["busy_s"], batch)
        rows.append({"variant": label, "plan": _describe(asg, acc), "step_s": r["step_s"],
                     "usd_per_1000": usd, "joules_per_step": joules,
                     "busy_s": r["busy_s"], "assignment": asg,
                     "predicted_s": evaluate(table, asg).step_time_s,
                     "predicted_raw_s": evaluate(raw, asg).step_time_s})
    # The measured table itself, for offline analysis of prediction errors.
    out_tables = {"raw": raw.to_json()}
    out = {"model": name, "batch": batch, "rows": rows, "jit_s": jit_s, **out_tables,
           "step_scale": table.meta["step_scale"],
           "devices": {d.name: {"kind": d.kind, "price_per_hour": d.price_per_hour,
                                "price_alone_per_hour": d.price_alone_per_hour,
                                "watts_busy": d.watts_busy, "watts_idle": d.watts_idle}
                       for d in table.devices}}
    return out, (w, args, raw, table)


def memory_case(name: str, fraction: float, small: bool, steps: int, cpu_steps: int, k: int,
                tables: dict) -> dict:
    """A GPU memory budget below what the model needs, obeyed by every plan."""
    import dataclasses

    acc = _accelerator()
    if name in tables:
        w, args, raw, table = tables[name]
    else:
        w = zoo.get(name, small=small)
        args = w.example_args()
        raw, table = measure_table(w, acc, k, small)
    batch = int(w.config["batch_size"])
    need = sum(layer.memory_bytes[acc] for layer in table.layers)
    budget = fraction * need
    devices = tuple(dataclasses.replace(d, memory_bytes=budget) if d.name == acc else d
                    for d in table.devices)
    tight = dataclasses.replace(table, devices=devices)
    all_gpu = {layer: acc for layer in table.layer_names}
    out = {"model": name, "batch": batch, "need_gb": need / 1e9, "budget_gb": budget / 1e9,
           "all_gpu": "; ".join(violations(tight, all_gpu)), "rows": [], "timelines": {}}
    mem = {layer.name: layer.memory_bytes[acc] for layer in tight.layers}
    plans = {"memory fill": memory_fill(tight).assignment}
    try:
        plans["hetpar (time)"] = plan(tight, baselines=False).assignment
        plans["hetpar (time, pipelined M=4)"] = plan(
            tight, mode="pipelined", microbatches=4, baselines=False).assignment
    except InfeasibleError as e:
        out["hetpar_error"] = str(e)
    for label, asg in plans.items():
        if asg is None:
            continue
        assert not violations(tight, asg), (label, violations(tight, asg))
        m = 4 if "M=4" in label else 1
        print(f"  memory case, {label}: {_describe(asg, acc)}", flush=True)
        r = run_plan(w, args, asg, cpu_steps, microbatches=m, timeline_steps=3)
        mode = "pipelined" if m > 1 else "sequential"
        usd, joules = dollars_and_joules(tight, asg, r["step_s"], r["busy_s"], batch)
        out["rows"].append({"variant": label, "plan": _describe(asg, acc), "step_s": r["step_s"],
                            "usd_per_1000": usd, "joules_per_step": joules,
                            "busy_s": r["busy_s"], "assignment": asg,
                            "gpu_gb": sum(mem[layer] for layer, d in asg.items()
                                          if d == acc) / 1e9,
                            "predicted_s": evaluate(tight, asg, mode, m).step_time_s})
        out["timelines"][f"{name}, GPU budget {budget / 1e9:.2f} GB: {label}"] = r["timeline"]
    return out


# -- report ---------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s >= 0.01 else f"{s * 1e3:.2f} ms"


def _x(r: float) -> str:
    return f"{r:.0f}x" if r >= 10 else f"{r:.2f}x"


def to_markdown(res: dict) -> str:
    host = res["host"]
    lines = [f"# hetpar against its baselines, measured ({host})", "",
             f"jax {res['jax']}, {res['date']}. Devices: {res['devices']}. Medians over "
             f"{res['steps']} steps (accelerator-only plans) or {res['cpu_steps']} steps (plans "
             "with CPU layers) after 2 warm-up steps; the batch starts each step on the host. "
             "Dollars: list price per hour of the devices a plan uses (a host CPU beside its GPU "
             "is free; a CPU used alone is rented as a CPU machine); joules: busy watts while "
             "computing + idle watts for the rest of the step, devices used only "
             f"(watts, prices and links from: {res.get('profiles', 'spec sheets')}).", ""]
    models = [m for m in res["models"] if "error" not in m]
    # 1. speedups
    lines += ["## CPU vs GPU training speedup (all-CPU jax.jit / all-GPU jax.jit)", "",
              "| model | batch | GPU step | CPU step | speedup | T4 study (Xeon vs T4) |",
              "|---|---|---|---|---|---|"]
    for m in models:
        g, c = m["rows"][0]["step_s"], m["rows"][1]["step_s"]
        lines.append(f"| {m['model']} | {m['batch']} | {_ms(g)} | {_ms(c)} | {_x(c / g)} | "
                     f"{PUBLISHED_T4.get(m['model'], '')} |")
    # 2. energy
    lines += ["", "## Energy per training step, E = P x T (busy watts x measured step)", "",
              "| model | GPU J/step | CPU J/step | GPU mJ/sample | CPU mJ/sample | CPU/GPU |",
              "|---|---|---|---|---|---|"]
    for m in models:
        g, c = m["rows"][0]["joules_per_step"], m["rows"][1]["joules_per_step"]
        lines.append(f"| {m['model']} | {g:.3g} | {c:.3g} | {g / m['batch'] * 1e3:.3g} | "
                     f"{c / m['batch'] * 1e3:.3g} | {_x(c / g)} |")
    # 3. baselines
    lines += ["", "## Every variant, per model", "",
              "| model | variant | plan | step (measured) | predicted (raw) | pred. error | "
              "$/1000 samples | J/step |", "|---|---|---|---|---|---|---|---|"]
    for m in models:
        for r in m["rows"]:
            err = (r["predicted_s"] - r["step_s"]) / r["step_s"]
            lines.append(f"| {m['model']} | {r['variant']} | {r['plan']} | {_ms(r['step_s'])} | "
                         f"{_ms(r['predicted_s'])} ({_ms(r['predicted_raw_s'])}) | {err:+.0%} | "
                         f"{r['usd_per_1000']:.4g} | {r['joules_per_step']:.3g} |")
    # 4. goals
    lines += ["", "## Goals", "",
              "| model | hetpar (time) / best single device | best single device | "
              "hetpar (cost) $ vs best single $ | hetpar plans: worst prediction error |",
              "|---|---|---|---|---|"]
    for m in models:
        rows = {r["variant"]: r for r in m["rows"]}
        singles = [rows["all-GPU jax.jit"], rows["all-CPU jax.jit"]]
        best = min(singles, key=lambda r: r["step_s"])
        cheap = min(singles, key=lambda r: r["usd_per_1000"])
        het = rows["hetpar (time)"]
        errs = [abs(r["predicted_s"] - r["step_s"]) / r["step_s"] for r in m["rows"]
                if r["variant"].startswith("hetpar")]
        lines.append(f"| {m['model']} | {het['step_s'] / best['step_s']:.3f} | "
                     f"{best['variant'].split()[0]} | "
                     f"{cheap['usd_per_1000'] / rows['hetpar (cost)']['usd_per_1000']:.2f}x | "
                     f"{max(errs):.1%} |")
    mc = res.get("memory_case")
    if mc and "error" not in mc:
        lines += ["", f"## Memory-bound: {mc['model']} (batch {mc['batch']}) under a GPU budget "
                  f"of {mc['budget_gb']:.2f} GB (it needs {mc['need_gb']:.2f} GB)", "",
                  f"All-GPU cannot run: {mc['all_gpu'] or 'fits?!'}", "",
                  "| variant | plan | GPU GB planned | step (measured) | predicted | "
                  "$/1000 samples | J/step |", "|---|---|---|---|---|---|---|"]
        cpu_row = mc.get("all_cpu")
        if cpu_row:
            lines.append(f"| all-CPU jax.jit | all {CPU} | 0 | {_ms(cpu_row['step_s'])} | | "
                         f"{cpu_row['usd_per_1000']:.4g} | {cpu_row['joules_per_step']:.3g} |")
        for r in mc["rows"]:
            lines.append(f"| {r['variant']} | {r['plan']} | {r['gpu_gb']:.2f} | "
                         f"{_ms(r['step_s'])} | {_ms(r['predicted_s'])} | "
                         f"{r['usd_per_1000']:.4g} | {r['joules_per_step']:.3g} |")
        if "hetpar_error" in mc:
            lines.append(f"\nhetpar: {mc['hetpar_error']}")
    failed = [m for m in res["models"] if "error" in m]
    if failed:
        lines += ["", "## Failed", ""] + [f"- {m['model']}: {m['error']}" for m in failed]
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    if FLAGS.quick:
        jax.config.update("jax_num_cpu_devices", 2)
    small = FLAGS.quick
    steps, cpu_steps = (3, 2) if FLAGS.quick else (FLAGS.steps, FLAGS.cpu_steps)
    names = FLAGS.models or zoo.names()
    devs = hetpar.cost_models.present_devices()
    res = {"host": " + ".join(sorted({f"{d.device_kind}" for d in devs.values()})),
           "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "devices": sorted(devs),
           "steps": steps, "cpu_steps": cpu_steps, "profiles": FLAGS.profiles or "spec sheets",
           "models": []}
    tables = {}
    for name in names:
        try:
            row, tables[name] = compare(name, small, steps, cpu_steps, FLAGS.k)
        except Exception as e:  # noqa: BLE001 - the report says what failed
            traceback.print_exc()
            row = {"model": name, "error": f"{type(e).__name__}: {e}"}
        res["models"].append(row)
        for key in list(tables):  # keep only what the memory case needs
            if key != FLAGS.memory_model:
                del tables[key]
        gc.collect()
        write_results(FLAGS.out, to_markdown(res), res)  # partial results survive a timeout
    if FLAGS.memory_model:
        try:
            mc = memory_case(FLAGS.memory_model, FLAGS.memory_fraction, small, steps, cpu_steps,
                             FLAGS.k, tables)
            done = {m["model"]: m for m in res["models"] if "error" not in m}
            if FLAGS.memory_model in done:
                mc["all_cpu"] = done[FLAGS.memory_model]["rows"][1]
            res["memory_case"] = mc
            with open(FLAGS.out + "_timelines.json", "w") as f:
                json.dump(mc.pop("timelines"), f)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["memory_case"] = {"error": f"{type(e).__name__}: {e}"}
    write_results(FLAGS.out, to_markdown(res), res)


if __name__ == "__main__":
    app.run(main)
