"""How reproducible is a layer's measured time? (issue 17, deliverable 2)

A per-layer predictor can be no closer to the measured times than two
measurements of the same layer are to each other. The committed records say
how close that is with hetpar's protocol (`measure`: a few warm-up calls,
then k = 10 calls, each `block_until_ready`, median): two runs of the zoo's
layers on the same H200 differ by a median of 8.3% and a p90 of 28.8%; on
its host CPU 8.8% / 31.2%; the layer sweep on two hosts with the same CPU
model 13.1% / 29.3% (`compare --records`).

`measure` times every layer of the zoo models (and, `--sweep`, of
layer_sweep.py's grid) on each present device and keeps every sample, from
which `compare` scores candidate estimators offline by how well two
independent runs (separate processes, the second in reverse layer order)
agree:

- `single10`: the median of the first 10 single calls (hetpar's protocol);
- `single`: the median of all single calls (`--n`, within `--budget_s`);
- `single_p25`, `single_min`: their lower quartile and minimum;
- `batched`: the median over `--batches` batches of back-to-back calls with
  one `block_until_ready` at the end, each batch long enough to take
  `--batch_s` (a call's time then excludes the host's wait for the device).

Each run also writes records in cost_accuracy.py's format with
`measured_s` from one estimator (`--estimator`), so `layer_sweep.py
evaluate` and `per_equation_model.py` can score predictors against them.

    python experiments/measure_repro.py measure --out DIR --run 1 [--sweep]
    python experiments/measure_repro.py compare DIR/repro_<tag>_run1.json DIR/repro_<tag>_run2.json
    python experiments/measure_repro.py compare --records A.json B.json
    python experiments/measure_repro.py merge RUN1.json RUN2.json --into results/accuracy_v3.json \
        --estimator single_p25 --out NEW.json

`merge` writes the `--into` file's records (their work, XLA costs, kernel
counts, equation rows) with `measured_s` from the runs: the mean of the
runs' estimates where both timed the layer; records no run timed are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

MODELS = ("mlp,lm_embed,conv6,rnn,cnn_preprocess,mobilenet_v1,resnet18,transformer,alexnet,"
          "cyclegan_generator,resnet50")
ESTIMATORS = ("single10", "single", "single_p25", "single_min", "batched")
THR = 100e-6


def time_samples(fn, args, device, *, n: int, batches: int, batch_s: float,
                 budget_s: float, warmup: int = 3) -> dict:
    """Single-call and batched samples of `jax.jit(fn)(*args)` on `device`."""
    import jax

    args = jax.device_put(tuple(args), device)
    jitted = jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(jitted(*args))
    single, t_start = [], time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        single.append(time.perf_counter() - t0)
        if len(single) >= 10 and time.perf_counter() - t_start > budget_s:
            break
    reps = max(1, min(100, math.ceil(batch_s / max(statistics.median(single), 1e-6))))
    batched, t_start = [], time.perf_counter()
    for _ in range(batches):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = jitted(*args)
        jax.block_until_ready(out)
        batched.append((time.perf_counter() - t0) / reps)
        if len(batched) >= 3 and time.perf_counter() - t_start > budget_s:
            break
    return {"single": single, "batched": batched, "reps": reps}


def estimate(rec: dict, how: str) -> float:
    s = rec["single"]
    if how == "single10":
        return float(np.median(s[:10]))
    if how == "single":
        return float(np.median(s))
    if how == "single_p25":
        return float(np.percentile(s, 25))
    if how == "single_min":
        return float(min(s))
    if how == "batched":
        return float(np.median(rec["batched"]))
    raise ValueError(how)


def _graphs(args, dev):
    """(model, graph, batch, small, extra) per model to time on `dev`."""
    import hetpar
    from hetpar.zoo import trace_model

    cpu = dev.platform == "cpu"
    for model in args.models.split(","):
        w, g = trace_model(model, small=cpu, batch=args.cpu_batch if cpu else None)
        yield model, g, w.config.get("batch_size"), cpu, {}
    if args.sweep:
        import layer_sweep as ls

        scale, hw = (0.25, 0.5) if cpu else (1.0, 1.0)
        step, params, batch = ls.sweep_step(ls.grid(scale, hw))
        yield "sweep", hetpar.trace(step, params, batch), None, cpu, {"scale": scale,
                                                                      "hw_scale": hw}


def _measure(args) -> int:
    import jax
    import per_equation_model as pem

    from hetpar.cost_models import device_name, present_devices, random_inputs, spec_kind_of
    from hetpar.cost_models._layer_work import graph_layer_work, layer_kernels, layer_xla_cost

    devices = [d for d in present_devices().values()
               if not args.platforms or d.platform in args.platforms]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    accel = [d for d in devices if d.platform != "cpu"]
    tag = args.tag or (accel[0].device_kind.split()[-1].lower() if accel else "cpu")
    path = out / f"repro_{tag}_run{args.run}.json"
    records, t0 = [], time.time()
    deadline = t0 + args.deadline_s
    for dev in sorted(devices, key=lambda d: d.platform == "cpu"):
        jobs = [(m, g, b, small, extra, name) for m, g, b, small, extra in _graphs(args, dev)
                for name in g.layers]
        if args.reverse:
            jobs.reverse()
        for model, g, batch, small, extra, name in jobs:
            if time.time() > deadline:
                print(f"deadline: stopped before {model}/{name} on {device_name(dev)}")
                break
            fn, _ = g.layer_callable(name)
            rec = {"model": model, "layer": name, "device": device_name(dev),
                   "device_kind": dev.device_kind, "kind": spec_kind_of(dev),
                   "batch": batch, "small": small, **extra}
            rec.update(time_samples(fn, random_inputs(g, name)[1], dev, n=args.n,
                                    batches=args.batches, batch_s=args.batch_s,
                                    budget_s=args.budget_s))
            if args.features:
                work = graph_layer_work(g, name)
                xla = layer_xla_cost(g, name, dev.platform)
                if xla is not None and xla.bytes_accessed is not None:
                    work = dataclasses.replace(work, fused_bytes=xla.bytes_accessed)
                rec.update(work=work.to_json(),
                           xla=None if xla is None else dataclasses.asdict(xla),
                           equations=int(g[name].work.launches),
                           kernels=layer_kernels(g, name, dev.platform))
                if model == "sweep":
                    rec["eq_rows"] = pem.equation_rows(g, name)
            rec["measured_s"] = estimate(rec, args.estimator)
            rec["iqr_s"] = float(np.subtract(*np.percentile(rec["single"], [75, 25])))
            records.append(rec)
            print(f"{model}/{name} on {device_name(dev)}: single {1e3 * rec['measured_s']:.3f}"
                  f" ms, batched {1e3 * estimate(rec, 'batched'):.3f} ms", flush=True)
        path.write_text(json.dumps(dict(
            jax=jax.__version__, date=time.strftime("%Y-%m-%d"), run=args.run,
            estimator=args.estimator, reverse=args.reverse, records=records)) + "\n")
        print(f"{device_name(dev)} done at {time.time() - t0:.0f} s; wrote {path}", flush=True)
    return 0


def _key(r):
    # The card too: "gpu:0" names an H100 and an H200 alike (the hosts' CPUs
    # are one model, "cpu" on both, and pair up on purpose).
    return (r["model"], r["layer"], r["device"], r.get("device_kind"), r.get("batch"),
            bool(r.get("small")), r.get("scale"), r.get("hw_scale"))


def _agreement(a: dict, b: dict, how) -> tuple[np.ndarray, list]:
    keys = [k for k in a if k in b]
    ea, eb = (np.array([how(x[k]) for k in keys]) for x in (a, b))
    big = (ea > THR) | (eb > THR)
    return np.abs(ea - eb)[big] / eb[big], [k for k, m in zip(keys, big) if m]


def _compare(args) -> int:
    def load(p):
        d = json.loads(pathlib.Path(p).read_text())
        return {_key(r): r for r in (d["records"] if isinstance(d, dict) else d)}

    a, b = load(args.files[0]), load(args.files[1])
    hows = ({"measured_s": lambda r: r["measured_s"]} if args.records else
            {h: (lambda r, h=h: estimate(r, h)) for h in ESTIMATORS})
    lines = [f"Run-to-run agreement, |a - b| / b, layers above {THR * 1e6:.0f} us in either: "
             f"`{args.files[0]}` against `{args.files[1]}`.", "",
             "| device | models | estimator | n | median | p90 |", "|---|---|---|---|---|---|"]
    for dev in sorted({k[2] for k in a}):
        for part, pick in (("zoo", lambda k: k[0] != "sweep"),
                           ("sweep", lambda k: k[0] == "sweep")):
            aa = {k: v for k, v in a.items() if k[2] == dev and pick(k)}
            bb = {k: v for k, v in b.items() if k[2] == dev and pick(k)}
            if not set(aa) & set(bb):
                continue
            for h, fn in hows.items():
                e, _ = _agreement(aa, bb, fn)
                if e.size:
                    lines.append(f"| {dev} | {part} | {h} | {e.size} | {100 * np.median(e):.1f}% "
                                 f"| {100 * np.percentile(e, 90):.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


def _merge(args) -> int:
    runs = [{_key(r): r for r in json.loads(pathlib.Path(f).read_text())["records"]}
            for f in args.files]
    data = json.loads(pathlib.Path(args.into).read_text())
    out, dropped = [], 0
    for r in data["records"]:
        timed = [run[_key(r)] for run in runs if _key(r) in run]
        if not timed:
            dropped += 1
            continue
        est = [estimate(t, args.estimator) for t in timed]
        out.append({k: v for k, v in r.items() if k not in ("median_s", "iqr_s")}
                   | {"measured_s": float(np.mean(est)), "runs": est})
    data = dict(data, records=out, merged_from=list(args.files), estimator=args.estimator)
    pathlib.Path(args.out).write_text(json.dumps(data) + "\n")
    print(f"{args.out}: {len(out)} records ({dropped} not re-timed, left out)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--run", type=int, default=1)
    m.add_argument("--tag", default=None)
    m.add_argument("--models", default=MODELS)
    m.add_argument("--sweep", action="store_true", help="also layer_sweep.py's grid")
    m.add_argument("--platforms", nargs="*", default=None)
    m.add_argument("--cpu_batch", type=int, default=32)
    m.add_argument("--n", type=int, default=40, help="single calls per layer (at most)")
    m.add_argument("--batches", type=int, default=10)
    m.add_argument("--batch_s", type=float, default=0.005)
    m.add_argument("--budget_s", type=float, default=1.0,
                   help="per layer and kind of sample: fewer samples once this long")
    m.add_argument("--deadline_s", type=float, default=1e9)
    m.add_argument("--reverse", action="store_true", help="time the layers in reverse order")
    m.add_argument("--features", action="store_true",
                   help="also the records' work, XLA cost and kernel counts (compiles twice)")
    m.add_argument("--estimator", default="single", choices=ESTIMATORS,
                   help="what the records' measured_s holds")
    c = sub.add_parser("compare")
    c.add_argument("files", nargs=2)
    c.add_argument("--records", action="store_true",
                   help="files of plain records (measured_s only), e.g. cost_accuracy.py's")
    c.add_argument("--out", default=None)
    g = sub.add_parser("merge")
    g.add_argument("files", nargs="+")
    g.add_argument("--into", required=True, help="the records whose measured_s to replace")
    g.add_argument("--estimator", default="single_p25", choices=ESTIMATORS)
    g.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return {"measure": _measure, "compare": _compare, "merge": _merge}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
