"""Why microbatched pipelines over two GPUs lose: a fixed + per-sample step model.

Offline, from measured rows only (no device needed). For each model, fits the
one-GPU step time as t(b) = fixed + per_sample x b by least squares over the
measured `jax.jit` steps: the full batch, and the "whole step at batch b/M,
xM" launch-floor rows of bench_two_gpus.py. Then builds a two-layer cost table
for hetpar's half/half plan (the halves' shares of the step from the layers'
spec-sheet predictions, the crossing activations' bytes from the traced graph,
the links `hetpar profile` measured between the two GPUs), with `fixed_s` set,
and lets the planner's own `evaluate` predict each measured pipeline. Also
shown: the prediction with fixed = 0 (time scales with the batch), which is
what the planner assumed before `Layer.fixed_s`.

Usage:
  python experiments/two_gpus_affine.py --out experiments/results/two_gpus_affine_h200x2
"""

from __future__ import annotations

import json

import numpy as np
from _timing import write_results
from absl import app, flags

from hetpar.cost_models import load_profiles
from hetpar.planner import CostTable, Device, Edge, Layer, Link, evaluate
from hetpar.zoo import cost_table

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "experiments/results/two_gpus_affine_h200x2", "output prefix")
flags.DEFINE_list("runs", ["experiments/results/two_gpus_h200x2_run2.json",
                           "experiments/results/two_gpus_transformer_b128_h200x2.json",
                           "experiments/results/two_gpus_transformer_b32_h200x2_run3.json",
                           "experiments/results/two_gpus_alexnet_b128_h200x2.json"],
                  "bench_two_gpus.py results (JSON), all from one kind of machine")
flags.DEFINE_string("profiles", "experiments/results/profile_2gpu_h200x2.json",
                    "the two-GPU machine's profile (its links are used)")


def points(rows, model):
    """(batch, seconds) of one-GPU jax.jit steps, floor rows divided back to one step."""
    out = []
    for r in rows:
        if r["model"] != model or "error" in r:
            continue
        if r["config"] == "one GPU (jax.jit)":
            out.append((r["batch"], r["step_s"]))
        elif r["config"].startswith("one GPU, whole step at batch"):
            m = r["microbatches"]
            out.append((r["batch"] // m, r["step_s"] / m))
    return out


def fit(pts):
    b = np.array([p[0] for p in pts], float)
    t = np.array([p[1] for p in pts], float)
    a = np.stack([np.ones_like(b), b], axis=1)
    (fixed, per), *_ = np.linalg.lstsq(a, t, rcond=None)
    return float(max(fixed, 0.0)), float(per)


def half_table(model, batch, fixed, per, links):
    """Two layers (first half -> gpu:0, second half -> gpu:1) of the traced model."""
    spec = cost_table(model, ["h200"], batch=batch)
    names = list(spec.layer_names)
    first = set(names[: len(names) // 2])
    dev = spec.device_names[0]
    times = {layer.name: layer.time_s[dev] for layer in spec.layers}
    share = sum(times[n] for n in first) / sum(times.values())
    crossing = [e for e in spec.edges if (e.src in first) != (e.dst in first)]
    fwd = sum(e.bytes for e in crossing)
    bwd = sum(e.bytes_backward for e in crossing)
    step = fixed + per * batch
    layers = []
    for name, s in (("first", share), ("second", 1 - share)):
        layers.append(Layer(name, {"gpu:0": s * step, "gpu:1": s * step},
                            {"gpu:0": 0.0, "gpu:1": 0.0},
                            fixed_s={"gpu:0": s * fixed, "gpu:1": s * fixed}))
    devices = (Device("gpu:0", "h200", 1e12), Device("gpu:1", "h200", 1e12))
    table = CostTable(devices, links, tuple(layers), (Edge("first", "second", fwd, bwd),))
    return table, share, fwd


def main(argv):
    del argv
    rows = []
    for path in FLAGS.runs:
        rows += json.load(open(path))["rows"]
    ps = load_profiles(FLAGS.profiles)
    links = []
    for src, dst in (("gpu:0", "gpu:1"), ("gpu:1", "gpu:0")):
        lk = ps.fastest_link(src, dst, 16 << 20)
        links.append(Link(src, dst, lk.bandwidth_bytes_per_s, lk.latency_s))
    links = tuple(links)
    res = {"models": []}
    lines = ["# Two GPUs: a fixed + per-sample model of the step explains the pipelines "
             "(2x NVIDIA H200, NVLink)", "",
             "Offline from measured rows (`experiments/two_gpus_affine.py`). One-GPU "
             "`jax.jit` step t(b) = fixed + per_sample x b, fitted on the full-batch steps and "
             "the launch-floor rows (the whole step at batch b/M, run M times). hetpar's "
             "half/half pipeline predicted by the planner's `evaluate` with `Layer.fixed_s` "
             "(each microbatch pays the fixed part whole) and without it (time scales with "
             "the batch). Links: `profile_2gpu_h200x2.json`.", ""]
    for model in sorted({r["model"] for r in rows}):
        pts = points(rows, model)
        if len({b for b, _ in pts}) < 2:
            continue
        fixed, per = fit(pts)
        lines += [f"## {model}: t(b) = {fixed * 1e3:.2f} ms + {per * 1e3:.3f} ms x b", "",
                  "fit points: " + ", ".join(f"b={b}: {t * 1e3:.2f} ms" for b, t in pts), "",
                  "| batch | M | schedule | measured | predicted (fixed_s) | error | "
                  "predicted (no fixed) | error | measured speedup | predicted speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        out = {"model": model, "fixed_s": fixed, "per_sample_s": per, "points": pts, "rows": []}
        for r in rows:
            if r["model"] != model or r.get("config") != "hetpar half/half" or "error" in r:
                continue
            b, m = r["batch"], r["microbatches"]
            one = [x["step_s"] for x in rows if x["model"] == model and x["batch"] == b
                   and x["config"] == "one GPU (jax.jit)"][0]
            table, share, fwd = half_table(model, b, fixed, per, links)
            linear = CostTable(table.devices, table.links, tuple(
                Layer(layer.name, layer.time_s, layer.memory_bytes) for layer in table.layers),
                table.edges)
            split = {"first": "gpu:0", "second": "gpu:1"}
            mode = "pipelined" if m > 1 else "sequential"
            pred = evaluate(table, split, mode, m).step_time_s
            lin = evaluate(linear, split, mode, m).step_time_s
            meas = r["step_s"]
            lines.append(f"| {b} | {m} | {r['schedule']} | {meas * 1e3:.1f} ms | "
                         f"{pred * 1e3:.1f} ms | {(pred - meas) / meas:+.0%} | "
                         f"{lin * 1e3:.1f} ms | {(lin - meas) / meas:+.0%} | "
                         f"{one / meas:.2f}x | {one / pred:.2f}x |")
            out["rows"].append({"batch": b, "microbatches": m, "schedule": r["schedule"],
                                "measured_s": meas, "predicted_s": pred,
                                "predicted_linear_s": lin, "first_half_share": share,
                                "crossing_bytes": fwd})
        lines.append("")
        res["models"].append(out)
    write_results(FLAGS.out, "\n".join(lines) + "\n", res)


if __name__ == "__main__":
    app.run(main)
