"""The CPU layer model at reference sizes, on this machine's CPU (issue 17).

`hetpar profile --fit` fits a CPU on the zoo's small configs (channels 4-32,
batch 32), where a layer's time is mostly XLA's per-op overheads. This fits
and checks it on the models' reference configs instead (batch at most
`--batch`): every layer of the train models (`cost_accuracy.TRAIN_MODELS`)
and of the held-out ones timed alone on cpu:0 (`layer_samples`, the lower
quartile of up to 40 calls, cached), the roofline and the per-equation
layer model fitted on the train layers, with and without the layer sweep's
transposed convolutions (`hetpar profile`'s `CPU_SWEEP_KINDS`), and scored
on the held-out layers above 100 us. No accelerator needed.

    python -m hetpar profile --devices cpu:0 --no-transfers --out P.json
    python experiments/cpu_reference_layers.py --profiles P.json --batch 8 --out DIR
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

from check_fitted_profile import HELD_OUT  # noqa: E402 - one list of held-out models


def main(argv=None) -> int:
    import cost_accuracy as ca

    from hetpar.cli._profile import CPU_SWEEP_KINDS
    from hetpar.cost_models import (
        fit_equation_model,
        fit_samples,
        layer_samples,
        load_profiles,
        matmul_equations,
        predict_layer,
        present_devices,
        with_layer_model,
    )
    from hetpar.zoo import get, trace_model, trace_sweep

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", required=True, help="hetpar profile's file (cpu:0 measured)")
    ap.add_argument("--batch", type=int, default=8, help="largest batch (default %(default)s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    prof = load_profiles(args.profiles).devices.get("cpu:0")
    if prof is None or prof.origin != "measured":
        ap.error(f"{args.profiles} has no measured cpu:0; make one with "
                 "`python -m hetpar profile --devices cpu:0 --no-transfers --out P.json`")
    dev = present_devices()["cpu:0"]

    def samples(name, graph):
        t0 = time.time()
        out = [(n, layer, matmul_equations(graph, layer), w, t)
               for n, layer, w, t in layer_samples([(name, graph)], dev)]
        print(f"{name}: {len(out)} layers in {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)
        return out

    def model(name):
        return samples(name, trace_model(name, batch=min(get(name).config["batch_size"],
                                                          args.batch))[1])

    held = [s for m in HELD_OUT for s in model(m)]
    train = [s for m in ca.TRAIN_MODELS for s in model(m)]
    sweep = samples("sweep", trace_sweep(cpu=True, kinds=CPU_SWEEP_KINDS))

    summary, rows = {}, []
    for on, fit in (("train models", train), ("train models + sweep transposed", train + sweep)):
        roof = fit_samples(prof, [(w, t) for *_, w, t in fit])
        coef = fit_equation_model(roof, [(e, w, t) for _, _, e, w, t in fit])
        eq = roof.replace(layer_model=coef)
        chosen = with_layer_model(prof, roof, [(n, e, w, t) for n, _, e, w, t in fit])
        for name, p in (("roofline", roof), ("layer model", eq)):
            err = [abs(predict_layer(p, w, e) / t - 1) for _, _, e, w, t in held if t > 100e-6]
            summary[f"{name}, fitted on {on}"] = {
                "n": len(err), "median": float(np.median(err)),
                "p90": float(np.percentile(err, 90))}
        summary[f"choice, fitted on {on}"] = chosen.sources.get("layer_model")
        for m, layer, e, w, t in held:
            rows.append({"fitted_on": on, "model": m, "layer": layer, "measured_s": t,
                         "layer_model_s": predict_layer(eq, w, e),
                         "roofline_s": predict_layer(roof, w, e)})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpu_reference_b{args.batch}.json").write_text(json.dumps({
        "cpu": platform.processor() or platform.machine(), "batch": args.batch,
        "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
