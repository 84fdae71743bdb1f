"""Predicted against measured, as a user gets them (issue 17): spec sheets
(`profile="auto"`) against the first-call calibration (`profile="measure"`).

    python experiments/bench_predictions.py --out DIR [--quick] [--batch B]
        [--memory_fraction F] [--memory_microbatches M]

For the zoo transformer (GPT-2 small) at batch 256 (--batch) on the GPUs present (two
or more): one GPU, data parallel over two, and the two-GPU pipeline (first
half of the layers on one GPU, the rest on the other) at M = 1, 2, 4, 8
(1F1B); the memory-bound pipeline the planner chooses when each GPU may hold
0.7x (--memory_fraction) what the step needs, at M=4 (--memory_microbatches);
one GPU holding half of it (--offload_fraction; the planner recomputes
activations or offloads).
Each plan runs under `hetpar.auto` with each profile; the prediction is
`step.predicted()` (the planner's for a plan it made; for a pipeline given
as a dict, its replay under the schedule, costed when the step was built),
the measurement the median of --steps steps, each timed to its results
being ready. profile="measure" times each layer alone, the whole step,
and the runtime's cost per stage and per crossing on the devices present
(written to the json's `runtime`). Writes predictions.json and predictions.md.
`--quick`: the small transformer on 2 CPU devices.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import numpy as np

import hetpar
from hetpar import zoo


def _measure(step, args, steps: int) -> float:
    state, batch = tuple(args[:-1]), args[-1]
    for _ in range(3):
        *state, loss = step(*state, batch)
        jax.block_until_ready((state, loss))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        *state, loss = step(*state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _predicted(step, args) -> float:
    """The step's own prediction: the plan's, or for a plan dict its replay (`predicted()`)."""
    return step.lower(*args).predicted().step_time_s


def _breakdown(step, args) -> dict:
    """Where the prediction's time goes: busy seconds per device, transfers,
    and the calibration's figures (the runtime's costs, the fixed fraction)."""
    compiled = step.lower(*args)
    p = compiled.predicted()
    out = {"busy_s": p.busy_s, "compute_s": p.compute_s, "transfer_s": p.transfer_s,
           "closed_form_s": p.closed_form_s}
    table = compiled.table
    if table is not None:
        out["meta"] = {k: v for k, v in table.meta.items()
                       if k in ("step_s", "step_scale", "stage_overhead_s", "crossing_s",
                                "fixed_fraction", "replicated_step_s")}
    return out


def _describe(compiled) -> str:
    """What the planner chose: mode, devices, state kept apart from compute."""
    plan = compiled.plan
    if plan is None:
        return "one device"
    if plan.replicas:
        return f"data parallel over {', '.join(plan.replicas)}"
    places = compiled.placements.values()
    apart = [p for p in places if p.state not in (None, p.compute)]
    text = (f"{plan.mode}, M={plan.microbatches}, compute on "
            f"{', '.join(sorted({p.compute for p in places}))}")
    if apart:
        text += (f"; {len(apart)} of {len(places)} layers keep their state on "
                 f"{', '.join(sorted({p.state for p in apart}))} (update on "
                 f"{', '.join(sorted({p.update or p.compute for p in apart}))})")
    policies = [p.activations for p in places if p.activations != "keep"]
    for policy in sorted(set(policies)):
        text += f"; {policies.count(policy)} layers' activations: {policy}"
    return text


def _run_plan(row, w, example, kwargs, plan, steps, profiles) -> None:
    """Predicts and measures one plan under each profile, into `row`."""
    for profile in profiles:
        step = hetpar.auto(w.train_step, profile=profile, **kwargs)
        t0 = time.perf_counter()
        predicted = _predicted(step, example)
        if plan is None:
            compiled = step.lower(*example)
            row["chosen"] = _describe(compiled)
        row[f"predicted_{profile}_s"] = predicted
        row[f"plan_time_{profile}_s"] = time.perf_counter() - t0
        row[f"breakdown_{profile}"] = _breakdown(step, example)
        # Before the (possibly long) measurement: a timeout still shows what was chosen.
        print(f"{row['plan']:<24} {profile:<8} predicted {predicted * 1e3:9.2f} ms "
              f"(planned in {row[f'plan_time_{profile}_s']:.0f} s; {row.get('chosen', 'given')})",
              flush=True)
        measured = _measure(step, example, steps)
        row.setdefault("measured_s", []).append(measured)
        print(f"{row['plan']:<24} {profile:<8} predicted {predicted * 1e3:9.2f} ms  "
              f"measured {measured * 1e3:9.2f} ms", flush=True)
    row["measured_s"] = float(np.median(row["measured_s"]))
    for profile in profiles:
        row[f"error_{profile}"] = row[f"predicted_{profile}_s"] / row["measured_s"] - 1


def _anchors(w, example, m: int, device: str) -> dict:
    """What a pipeline's layers could be scaled to, timed on one device: the
    M-microbatch step as one executable (what profile="measure" times), and
    the step at batch / M run M times, one executable per microbatch as the
    stages run (with M updates where the pipeline runs one)."""
    from hetpar._grad import microbatched
    from hetpar.cost_models import batch_share, measure_step

    unrolled = measure_step(microbatched(w.train_step, m), example, device, k=5).median_s
    part = measure_step(w.train_step, batch_share(example, (-1,), m), device, k=5).median_s
    print(f"  anchors at M={m}: one executable {unrolled * 1e3:.1f} ms, "
          f"{m} x batch/{m} {m * part * 1e3:.1f} ms", flush=True)
    return {"unrolled_step_s": unrolled, "microbatch_step_s": part}


def _runtime() -> dict:
    """The runtime's costs profile="measure" measured: per stage, per crossing (seconds)."""
    from hetpar._calibration import OVERHEADS

    def name(k) -> str:
        if isinstance(k, frozenset):
            return " <-> ".join(sorted(map(str, k)))
        if isinstance(k, tuple) and len(k) == 3:  # a link curve: (src, dst, the sizes timed)
            sizes = sorted(set(k[2]))
            return (f"{k[0]} -> {k[1]} curve at {len(sizes)} sizes, "
                    f"{sizes[0]:.0f}-{sizes[-1]:.0f} B")
        return str(k)

    return {name(k): v for k, v in OVERHEADS.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=None, help="default: 256 (--quick: 8)")
    ap.add_argument("--memory_fraction", type=float, default=0.7)
    ap.add_argument("--memory_microbatches", type=int, default=4)
    ap.add_argument("--offload_fraction", type=float, default=0.5,
                    help="the one-GPU memory-bound plan's share of what the step needs "
                         "(small enough, state leaves the GPU, not only activations)")
    ap.add_argument("--plans", nargs="*", default=None,
                    help="run only the plans named, or whose names contain one of these")
    ap.add_argument("--anchors", action="store_true",
                    help="for microbatched plans, also time the M-microbatch step as one "
                         "executable and the step at batch/M (one device)")
    ap.add_argument("--profiles", nargs="+", default=["auto", "measure"],
                    choices=["auto", "measure"],
                    help="the profiles each plan runs under (measure alone: half the time)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = "cpu" if args.quick else "gpu"
    names = [f"{kind}:{d.id}" for d in jax.devices(kind)[:2]]
    w = zoo.get("transformer", small=args.quick, batch=args.batch or (8 if args.quick else 256))
    example = jax.tree_util.tree_map(np.asarray, w.example_args())
    layers = list(hetpar.trace(w.train_step, *example).layers)
    plans = [("one device", dict(devices=names[:1]), None, 1)]
    if len(names) > 1:  # one GPU: the one-device and offload plans only
        pipe = {name: names[i * 2 // len(layers)] for i, name in enumerate(layers)}
        plans += [("data parallel x2", dict(devices=names, data_parallel="always"), None, 1)]
        plans += [(f"pipeline x2 M={m} 1f1b", dict(plan=pipe, microbatches=m, schedule="1f1b"),
                   pipe, m) for m in (1, 2, 4, 8)]
    # Memory-bound: each GPU may hold 0.7x what the step needs (the planner pipelines
    # it over both, M=4 1F1B), and one GPU holding half of it (the planner offloads
    # state to pinned host memory).
    graph = hetpar.trace(w.train_step, *example)
    host = names[1] if args.quick else "cpu:0"  # where offloaded state may live
    need = sum(graph[la].memory_bytes for la in graph.layers)
    frac, mm = args.memory_fraction, args.memory_microbatches
    if len(names) > 1:
        plans += [(f"memory-bound x2 ({frac}x) M={mm} 1f1b",
                   dict(devices=names, memory=dict.fromkeys(names, frac * need),
                        microbatches=mm, schedule="1f1b", data_parallel=False), None, 4)]
    off = args.offload_fraction
    plans += [(f"one device, {off}x memory (offload)",
               dict(devices=[names[0], host], memory={names[0]: off * need}), None, 1)]
    if args.plans:
        exact = {p[0] for p in plans} & set(args.plans)  # "one device" alone, not the offload
        plans = [p for p in plans
                 if p[0] in exact or any(k in p[0] for k in set(args.plans) - exact)]
    meta = dict(model=w.name, batch=w.config["batch_size"], steps=args.steps,
                device=jax.devices(kind)[0].device_kind, jax=jax.__version__)
    rows = []
    for name, kwargs, plan, m in plans:
        row = {"plan": name}
        try:
            _run_plan(row, w, example, kwargs, plan, args.steps, args.profiles)
            if args.anchors and m > 1:
                row.update(_anchors(w, example, m, names[0]))
        except Exception as e:  # noqa: BLE001 - reported, the other plans go on
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append(row)
        # Written after every plan: a timeout keeps what was measured.
        (out / "predictions.json").write_text(json.dumps(dict(meta, rows=rows,
                                                              runtime=_runtime()), indent=1))
    title = {"auto": "spec sheets", "measure": "profile='measure'"}
    lines = [f"# Predicted against measured ({meta['device']}, {meta['model']}, "
             f"batch {meta['batch']})", "",
             f"Measured: median of the {len(args.profiles)} runs' medians of "
             f"{args.steps} steps. Error: predicted / measured - 1.", "",
             "| plan | measured ms | " + " | ".join(f"{title[p]} ms | error"
                                                  for p in args.profiles) + " |",
             "|---|---|" + "---|---|" * len(args.profiles)]
    for r in rows:
        lines.append(f"| {r['plan']} | {r['measured_s'] * 1e3:.2f} | " + " | ".join(
            f"{r[f'predicted_{p}_s'] * 1e3:.2f} | {r[f'error_{p}']:+.0%}"
            for p in args.profiles) + " |")
    if rows:
        lines += ["", "Median |error|: " + ", ".join(
            f"{title[p]} {statistics.median(abs(r[f'error_{p}']) for r in rows):.0%}"
            for p in args.profiles) + ".", ""]
    lines += [f"- {r['plan']}: the planner chose: {r['chosen']}" for r in rows if "chosen" in r]
    text = "\n".join(lines) + "\n"
    (out / "predictions.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
