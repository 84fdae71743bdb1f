"""A `hetpar profile --fit` file, checked on models it was not fitted on (issue 17).

For each present device in the file: the held-out zoo models' layers
(reference configs on accelerators, small ones at batch 32 on the CPU, as
`--fit` uses), each predicted by hetpar's cost table from the profile
(`cost_table(..., profiles=..., fused_bytes=True)`: the per-equation layer
model where the profile kept one, else the roofline) and measured as
`--fit` measures its layers (`measure_layers`: the lower quartile of up to
40 runs; on a CPU one model's layers interleaved). Prints and writes
median / p90 |predicted / measured - 1| over layers above 100 us.

    python -m hetpar profile --fit default --out P.json
    python experiments/check_fitted_profile.py --profiles P.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib

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
    args = ap.parse_args(argv)
    profiles = load_profiles(args.profiles)
    present = present_devices()
    measured = [n for n, p in profiles.devices.items() if p.origin == "measured" and n in present]
    wanted = [d for d in args.devices.split(",") if d]
    missing = [d for d in wanted if d not in measured]
    if missing:
        ap.error(f"--devices {','.join(missing)}: not a measured device of {args.profiles} "
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
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_fitted_profile.json").write_text(
        json.dumps({"profiles": args.profiles, "summary": summary, "rows": rows}, indent=1))
    return 0


def _stats(errs) -> dict:
    e = np.array(errs)
    return {"n": int(e.size), "median": float(np.median(e)) if e.size else None,
            "p90": float(np.percentile(e, 90)) if e.size else None}


if __name__ == "__main__":
    raise SystemExit(main())
