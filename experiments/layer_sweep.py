"""Fit on many small layers, test on every zoo model (issue 17, deliverable 2).

The zoo's eleven models give the predictor few distinct layers to fit and
leave kinds out (transposed convolutions, 7x7 stems over 3 channels, gathers
of augmentation): fitted on six of them, no model family carried to the other
five within 10% (results/predictor_levers_v3.md, results/primitive_model.md).
This sweeps single-kind layers over a grid of sizes instead: dense (GEMM +
GELU), convolutions (1x1, 3x3, 7x7; stride 1 and 2; few and many channels),
depthwise and transposed convolutions, layer norm, softmax attention,
embedding lookups, elementwise chains, reductions and pooling. Each is one
`hetpar.layer` of a plain-JAX training step (forward, backward and an SGD
update, as a zoo layer holds them), timed alone like a zoo layer
(`measure_layer`), with the same record fields as `cost_accuracy.py` plus
the layer's per-primitive features (`_prim_features`).

    python experiments/layer_sweep.py measure --out DIR [--platforms gpu] [--scale 1]
    python experiments/layer_sweep.py evaluate --sweep DIR/sweep_<tag>.json \\
        --records results/accuracy_v3.json [--out FILE.md]

`evaluate` fits on the sweep alone, so every zoo model is held out, and
reports median / p90 APE on the zoo's layers above 100 us of the same device
kind: the calibrated roofline (`calibrate`, per-kernel launches), the
per-primitive linear model (`primitive_model.fit`) and the per-equation
models of `per_equation_model.py` (M1: each matmul-like equation priced by
its class; M2: with tile and wave utilisation), each fitted on the zoo's
train models, on the sweep, and on both. `measure` records every layer's
equation rows (`eq_rows`); files without them are re-traced from the grid. The sizes are the GPU's;
the CPU's are cut by `--cpu_scale` (batch and tokens, default 1/4) and
`--cpu_hw_scale` (image sides, default 1/2), as the zoo's CPU records use the
small configs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

# The grid lives in hetpar (`hetpar profile --fit default` times it).
from hetpar.zoo import sweep_grid as grid  # noqa: E402
from hetpar.zoo import sweep_step  # noqa: E402


def _measure(args) -> int:
    import _prim_features as pf
    import cost_accuracy as ca
    import jax
    import per_equation_model as pem

    import hetpar
    from hetpar.cost_models import device_name, present_devices

    devices = [d for d in present_devices().values()
               if not args.platforms or d.platform in args.platforms]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("cpu" if all(d.platform == "cpu" for d in devices)
                       else devices[0].device_kind.split()[-1].lower())
    path = out / f"sweep_{tag}.json"
    records = []
    t0 = time.time()
    # Accelerators first; the file is written after each device (a timeout keeps them).
    for dev in sorted(devices, key=lambda d: d.platform == "cpu"):
        cpu = dev.platform == "cpu"
        scale = args.scale * (args.cpu_scale if cpu else 1.0)
        specs = grid(scale, args.cpu_hw_scale if cpu else 1.0)
        if args.only:
            specs = [sp for sp in specs if any(k in sp.name for k in args.only)]
        step, params, batch = sweep_step(specs)
        graph = hetpar.trace(step, params, batch)
        recs = ca.graph_records(graph, "sweep", dev, batch=None, small=dev.platform == "cpu",
                                k=args.k, progress=lambda m: print(m, flush=True))
        for r in recs:
            r["features"] = pf.layer_features(graph, r["layer"])
            r["eq_rows"] = pem.equation_rows(graph, r["layer"])
            r["scale"], r["hw_scale"] = scale, args.cpu_hw_scale if cpu else 1.0
        records += recs
        print(f"{device_name(dev)}: {len(recs)} layers in {time.time() - t0:.0f} s", flush=True)
        path.write_text(json.dumps(dict(jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                                        records=records), indent=0) + "\n")
        print(f"wrote {path}", flush=True)
    return 0


def _sweep_equations(sweep: list[dict], cpu_hw_scale: float) -> dict:
    """{per_equation_model key: equation rows} of the sweep's layers: as
    recorded, else re-traced from the grid at the record's scale (files
    measured before the rows were recorded)."""
    import per_equation_model as pem

    import hetpar

    out = {pem.key(r): r["eq_rows"] for r in sweep if "eq_rows" in r}
    missing = [r for r in sweep if pem.key(r) not in out]
    for scale, hw in sorted({(r["scale"], r.get("hw_scale", cpu_hw_scale if r["kind"] == "cpu"
                                                else 1.0)) for r in missing}):
        step, params, batch = sweep_step(grid(scale, hw))
        graph = hetpar.trace(step, params, batch)
        for r in missing:
            if r["scale"] == scale and r["layer"] in graph.layers:
                out[pem.key(r)] = pem.equation_rows(graph, r["layer"])
    return out


def _per_equation_rows(swept, zoo_train, tests, label) -> list[str]:
    """per_equation_model's M1 and M2 fitted on the zoo's train models, the
    sweep, and both; scored on `tests` (each known to the rows)."""
    import per_equation_model as pem

    lines = []
    for on, train in (("the zoo's train models", zoo_train), ("the sweep", swept),
                      ("the sweep + the zoo's train models", swept + zoo_train)):
        for name, spec in (("per-equation (M1)", {}),
                           ("per-equation + utilisation (M2, 64x64x32)", {"util": (64, 64, 32)}),
                           ("M2 + a transposed-convolution class",
                            {"util": (64, 64, 32), "transposed": True})):
            X, t, names = pem.design(train, _EQ, label, spec)
            x = pem.fit(X, t, names, "log")
            cells = []
            for test in tests.values():
                Xe, te, _ = pem.design(test, _EQ, label, spec)
                cells.append(pem.pct(pem.stats(np.abs(Xe @ x - te) / te)))
            lines.append(f"| {name} | {on} | " + " | ".join(cells) + " |")
    return lines


def _worst(train, test, label, n: int) -> list[str]:
    """The held-out layers M2 (fitted on the sweep + the zoo's train models;
    without and with the transposed class) misses most: what sets its p90."""
    import per_equation_model as pem

    if n <= 0 or not test:
        return []
    lines = []
    for what, spec in (("M2", {"util": (64, 64, 32)}),
                       ("M2 + the transposed class", {"util": (64, 64, 32), "transposed": True})):
        X, t, names = pem.design(train, _EQ, label, spec)
        x = pem.fit(X, t, names, "log")
        Xe, te, _ = pem.design(test, _EQ, label, spec)
        err = (Xe @ x - te) / te
        lines += ["", f"Worst held-out layers, {what} on the sweep + the zoo's train models:",
                  "", "| model | layer | measured ms | predicted ms | error |",
                  "|---|---|---|---|---|"]
        for i in np.argsort(-np.abs(err))[:n]:
            lines.append(f"| {test[i]['model']} | {test[i]['layer']} | {te[i] * 1e3:.3f} | "
                         f"{(Xe @ x)[i] * 1e3:.3f} | {err[i]:+.0%} |")
    return lines


_EQ: dict = {}  # per_equation_model's rows of every layer evaluated


def _evaluate(args) -> int:
    import _prim_features as pf
    import cost_accuracy as ca
    import per_equation_model as pem
    import primitive_model as pm

    sweep = json.loads(pathlib.Path(args.sweep).read_text())["records"]
    zoo_records = []
    for f in args.records:
        data = json.loads(pathlib.Path(f).read_text())
        zoo_records += data["records"] if isinstance(data, dict) else data
    feats = pf.features(zoo_records, pm.CACHE)
    feats.update({pf.key_of(r): r["features"] for r in sweep})
    _EQ.update(pem.eq_features(zoo_records))
    _EQ.update(_sweep_equations(sweep, args.cpu_hw_scale))
    lines = ["# Fitted on the layer sweep, tested on the zoo's models", "",
             f"Sweep: `{args.sweep}` ({len(sweep)} layers). Zoo records: "
             + ", ".join(f"`{f}`" for f in args.records) + ".", "",
             "APE on the zoo's layers above 100 us, median / p90 (n): on the models outside "
             f"the zoo's train models ({', '.join(ca.TRAIN_MODELS)}) and on all models "
             "(in-sample for a fit on the zoo's train models)."]
    for kind in sorted({r["kind"] for r in sweep}):
        swept = [r for r in sweep if r["kind"] == kind]
        zoo = [r for r in zoo_records if r["kind"] == kind and pf.key_of(r) in feats]
        if not pm._large(zoo):
            continue
        zoo_train = [r for r in zoo if r["model"] in ca.TRAIN_MODELS]
        tests = {"held-out models": pm._large([r for r in zoo if r not in zoo_train]),
                 "all models": pm._large(zoo)}
        launch = "kernels" if kind == "cpu" else "executable"
        dev = swept[0]["device"]
        base = ca._base_profiles(swept + zoo)[dev]
        lines += ["", f"## {kind} ({len(swept)} sweep layers)", "",
                  "| model | fitted on | " + " | ".join(tests) + " |", "|---|---|---|---|"]
        for on, train in (("the zoo's train models", zoo_train), ("the sweep", swept),
                          ("the sweep + the zoo's train models", swept + zoo_train)):
            roof = ca.fit_layers(base, train, launch_model=launch)
            cells = [pm.stats(ca._errors(roof, t, launch)) for t in tests.values()]
            lines.append(f"| roofline | {on} | " + " | ".join(pm._pct(*c) for c in cells) + " |")
            for variant in ("full", "size"):
                x, cols = pm.fit(train, feats, variant)
                cells = [pm.stats(pm.ape(pm.predict(x, cols, t, feats), t))
                         for t in tests.values()]
                lines.append(f"| per-primitive ({variant}) | {on} | "
                             + " | ".join(pm._pct(*c) for c in cells) + " |")
        if kind in pem.LABEL:  # the per-equation models, on the layers they can price
            known = [r for r in swept + zoo if pem.key(r) in _EQ]
            lines += _per_equation_rows(
                [r for r in swept if r in known], [r for r in zoo_train if r in known],
                {k: [r for r in t if r in known] for k, t in tests.items()}, pem.LABEL[kind])
            lines += _worst([r for r in swept + zoo_train if r in known],
                            [r for r in tests["held-out models"] if r in known],
                            pem.LABEL[kind], args.worst)
    text = "\n".join(lines) + "\n"
    if args.out:
        pathlib.Path(args.out).write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--platforms", nargs="*", default=None)
    m.add_argument("--scale", type=float, default=1.0)
    m.add_argument("--cpu_scale", type=float, default=0.25)
    m.add_argument("--cpu_hw_scale", type=float, default=0.5)
    from hetpar.cost_models import LAYER_RUNS

    m.add_argument("--k", type=int, default=LAYER_RUNS)
    m.add_argument("--only", nargs="*", default=None, help="layers whose names contain these")
    m.add_argument("--tag", default=None)
    e = sub.add_parser("evaluate")
    e.add_argument("--sweep", required=True)
    e.add_argument("--records", nargs="+", required=True)
    e.add_argument("--out", default=None)
    e.add_argument("--worst", type=int, default=8,
                   help="list this many held-out layers M2 misses most (0: none)")
    e.add_argument("--cpu_hw_scale", type=float, default=0.5,
                   help="the CPU sweep's image-side scale (files without it recorded)")
    args = ap.parse_args(argv)
    return _measure(args) if args.cmd == "measure" else _evaluate(args)


if __name__ == "__main__":
    raise SystemExit(main())
