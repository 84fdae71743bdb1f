"""A `hetpar profile --fit` file, checked on models it was not fitted on (issue 17).

For each present device in the file: the held-out zoo models' layers
(reference configs on accelerators, small ones at batch 32 on the CPU, as
`--fit` uses), each predicted by hetpar's cost table from the profile
(`cost_table(..., profiles=..., fused_bytes=True)`: the per-equation layer
model where the profile kept one, else the roofline) and measured as
`--fit` measures its layers (`measure_layers`: the lower quartile of up to
40 runs; on a CPU one model's layers interleaved). Prints and writes
median / p90 |predicted / measured - 1| over layers above 100 us.

With `--refit DEVICES` (e.g. `cpu:0`), it then times the fit's layers
again (a fresh timing cache), right after the held-out ones, refits the
device on them (`fit_on_layers`, as `--fit` did) and scores the held-out
layers again: how far the machine drifted between the fit and the check
(the re-timed fit layers against the profile's `fit_layers`), and what the
model predicts when its layers and the held-out ones are timed together.

    python -m hetpar profile --fit default --out P.json
    python experiments/check_fitted_profile.py --profiles P.json --out DIR [--refit cpu:0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import tempfile

import numpy as np

HELD_OUT = ("cnn_preprocess", "cyclegan_generator", "mlp", "resnet18")


def main(argv=None) -> int:
    from hetpar.cost_models import (
        cost_table,
        load_profiles,
        measure_layers,
        present_devices,
        resolve_device,
    )
    from hetpar.zoo import trace_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", required=True)
    ap.add_argument("--models", default=",".join(HELD_OUT))
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", default="",
                    help="check only these of the file's devices (default: every one present)")
    ap.add_argument("--refit", default="", help="devices to refit on their fit layers timed "
                    "again after the check, and score again (e.g. cpu:0)")
    args = ap.parse_args(argv)
    profiles = load_profiles(args.profiles)
    present = present_devices()
    measured = [n for n, p in profiles.devices.items() if p.origin == "measured" and n in present]
    wanted = [d for d in args.devices.split(",") if d]
    missing = [d for d in wanted if d not in measured]
    if missing:
        ap.error(f"--devices {','.join(missing)}: not a measured device of {args.profiles} "
                 f"present here (those: {', '.join(measured)})")
    unknown = [d for d in args.refit.split(",") if d and d not in measured]
    if unknown:
        ap.error(f"--refit {','.join(unknown)}: not a measured device of {args.profiles} "
                 f"present here (those: {', '.join(measured)})")
    rows, summary = [], {}
    for name, prof in profiles.devices.items():
        if prof.origin != "measured" or name not in present or (wanted and name not in wanted):
            continue
        cpu = present[name].platform == "cpu"
        errs = []
        for model in args.models.split(","):
            _, g = trace_model(model, small=cpu, batch=32 if cpu else None)
            table = cost_table(g, [name], profiles=profiles, fused_bytes=True,
                               host_cpu_included=False)
            # Timed together, as --fit timed its layers (`measure_layers`).
            timings = measure_layers(g, [layer.name for layer in table.layers],
                                     resolve_device(name))
            for layer, timing in zip(table.layers, timings, strict=True):
                t = timing.typical_s
                p = layer.time_s[name]
                rows.append({"device": name, "kind": present[name].device_kind, "model": model,
                             "layer": layer.name, "predicted_s": p, "measured_s": t})
                if t > 100e-6:
                    errs.append(abs(p / t - 1))
        summary[name] = {"layer_model": prof.sources.get("layer_model", "none"),
                         **_stats(errs)}
        print(name, json.dumps(summary[name]), flush=True)
        if name in args.refit.split(","):
            summary[name]["refit"] = _refit(profiles, name, prof, present[name],
                                            [r for r in rows if r["device"] == name])
            print(name, "refit", json.dumps(summary[name]["refit"]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_fitted_profile.json").write_text(
        json.dumps({"profiles": args.profiles, "summary": summary, "rows": rows}, indent=1))
    return 0


def _stats(errs) -> dict:
    e = np.array(errs)
    return {"n": int(e.size), "median": float(np.median(e)) if e.size else None,
            "p90": float(np.percentile(e, 90)) if e.size else None}


def _refit(profiles, name, prof, device, rows) -> dict:
    """The device refitted on its fit layers timed again now, and the held-out
    `rows` (measured just before) predicted by it."""
    from hetpar.cli._profile import _fitted
    from hetpar.cost_models import cost_table
    from hetpar.zoo import trace_model

    cpu = device.platform == "cpu"
    fit_layers = prof.benchmarks.get("fit_layers", [])
    if not fit_layers:
        return {"error": f"{name}'s profile keeps no fit_layers (not from hetpar profile --fit "
                         "at this code): nothing to time again"}
    # By fingerprint: a --quick profile's layers (other sizes) match none.
    before = {r["key"]: r["measured_s"] for r in fit_layers}
    models = list(dict.fromkeys(r["model"] for r in fit_layers))  # --fit's, in its order
    old = os.environ.get("HETPAR_CACHE_DIR")
    with tempfile.TemporaryDirectory() as fresh:
        os.environ["HETPAR_CACHE_DIR"] = fresh  # time every fit layer again
        try:  # as `hetpar profile --fit` fits (its graphs, sweep and runs)
            alone = dataclasses.replace(profiles, devices={name: prof})  # this device only
            refit = _fitted(alone, models, quick=False, progress=lambda _: None).devices[name]
        finally:
            if old is None:
                os.environ.pop("HETPAR_CACHE_DIR")
            else:
                os.environ["HETPAR_CACHE_DIR"] = old
    drift = [r["measured_s"] / before[r["key"]] for r in refit.benchmarks["fit_layers"]
             if before.get(r["key"], 0.0) > 100e-6]
    # A profile fitted before a CPU's layers were timed interleaved: its drift
    # compares two ways of timing, not two times.
    then = {r.get("timing", "back to back") for r in fit_layers}
    now = {r.get("timing", "back to back") for r in refit.benchmarks["fit_layers"]}
    moved = profiles.replace_devices({**profiles.devices, name: refit})
    errs, by_model = [], {}
    for r in rows:
        by_model.setdefault(r["model"], []).append(r)
    for model, rs in by_model.items():
        _, g = trace_model(model, small=cpu, batch=32 if cpu else None)
        table = cost_table(g, [name], profiles=moved, fused_bytes=True, host_cpu_included=False)
        pred = {layer.name: layer.time_s[name] for layer in table.layers}
        for r in rs:
            r["refit_predicted_s"] = pred[r["layer"]]
            if r["measured_s"] > 100e-6:
                errs.append(abs(pred[r["layer"]] / r["measured_s"] - 1))
    return {"layer_model": refit.sources.get("layer_model", "none"), **_stats(errs),
            "timing_then_now": [sorted(then), sorted(now)],
            "fit_layers_now_over_then": {"n": len(drift), **({
                "median": float(np.median(drift)), "p10": float(np.percentile(drift, 10)),
                "p90": float(np.percentile(drift, 90))} if drift else {})}}


if __name__ == "__main__":
    raise SystemExit(main())
