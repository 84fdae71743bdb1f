"""hetpar's per-equation layer model, scored offline on committed measurements (issue 17).

The product's model (`hetpar.cost_models.fit_equation_model`, `predict_layer`;
what `hetpar profile --fit` fits and the cost table predicts unmeasured
layers with) against hetpar's calibrated roofline (`fit_samples`), on the
reproducible layer times of `results/measure_repro` (the mean of two runs'
lower quartiles, merged into the zoo and sweep records: see that README's
commands). Held-out models fixed before fitting (`cost_accuracy.TRAIN_MODELS`);
layers above 100 us. Also: what `with_layer_model` (the choice `hetpar
profile --fit` makes, each fit model left out in turn) decides on the zoo's
train models alone. No device: every layer's equations are traced again here.

    python experiments/layer_model_check.py --zoo /tmp/zoo_h100.json \
        --sweep /tmp/sweep_h100.json --kind h100 [--device gpu:0] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

THR = 100e-6


def _records(path, device):
    d = json.loads(pathlib.Path(path).read_text())
    rs = d["records"] if isinstance(d, dict) else d
    return [r for r in rs if r["device"] == device]


def _equations(records):
    """{id(record): the product's matmul_equations of its layer}, traced again."""
    import hetpar
    from hetpar.cost_models import matmul_equations
    from hetpar.zoo import sweep_grid, sweep_step, trace_model

    out = {}
    for key in sorted({(r["model"], bool(r["small"]), r.get("batch"), r.get("scale"),
                        r.get("hw_scale")) for r in records}, key=str):
        model, small, batch, scale, hw = key
        if model == "sweep":
            step, params, b = sweep_step(sweep_grid(scale, hw), abstract=True)
            g = hetpar.trace(step, params, b)
        else:
            g = trace_model(model, small=small, batch=batch)[1]
        for r in records:
            if (r["model"], bool(r["small"]), r.get("batch"), r.get("scale"),
                    r.get("hw_scale")) == key and r["layer"] in g.layers:
                out[id(r)] = matmul_equations(g, r["layer"])
    return out


def _stats(err):
    err = np.asarray(err)
    return f"{100 * np.median(err):.1f}% / {100 * np.percentile(err, 90):.1f}% (n={err.size})"


def main(argv=None) -> int:
    import cost_accuracy as ca

    from hetpar.cost_models import (
        LayerWork,
        fit_equation_model,
        fit_samples,
        predict,
        predict_layer,
        spec,
        with_layer_model,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", required=True, help="merged zoo records")
    ap.add_argument("--sweep", default=None, help="merged sweep records")
    ap.add_argument("--kind", required=True, help="spec-sheet kind: h100, h200, cpu")
    ap.add_argument("--device", default="gpu:0", help="records of this device")
    ap.add_argument("--other", default=None,
                    help="merged zoo records of another card: predicted from this one's fit "
                         "on its own spec sheet (transfer_calibration), every zoo layer > 100 us")
    ap.add_argument("--other_kind", default=None, help="the other card's spec-sheet kind")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    zoo = [r for r in _records(args.zoo, args.device)]
    sweep = _records(args.sweep, args.device) if args.sweep else []
    eqs = _equations(zoo + sweep)
    zoo = [r for r in zoo if id(r) in eqs]
    sweep = [r for r in sweep if id(r) in eqs]
    base = spec(args.kind).replace(name=args.device, origin="measured")

    def sample(r):
        return eqs[id(r)], LayerWork.from_json(r["work"]), r["measured_s"]

    train_zoo = [r for r in zoo if r["model"] in ca.TRAIN_MODELS]
    test = [r for r in zoo if r["model"] not in ca.TRAIN_MODELS and r["measured_s"] > THR]
    lines = [f"# hetpar's layer models on {args.kind} ({args.device}), held-out zoo layers "
             "> 100 us, median / p90", "",
             f"Zoo records: `{args.zoo}` ({len(zoo)}); sweep: `{args.sweep}` ({len(sweep)}). "
             f"Held out: {', '.join(sorted({r['model'] for r in test}))}.", "",
             "| model | fitted on | held-out layers |", "|---|---|---|"]
    fits = [("the zoo's train models", train_zoo)]
    if sweep:
        fits.append(("the sweep + the zoo's train models", sweep + train_zoo))
    for on, train in fits:
        samples = [sample(r) for r in train]
        roof = fit_samples(base, [(w, t) for _, w, t in samples])
        eq = roof.replace(layer_model=fit_equation_model(roof, samples))
        e_roof = [abs(predict(roof, w) / t - 1) for _, w, t in map(sample, test)]
        e_eq = [abs(predict_layer(eq, w, e) / t - 1) for e, w, t in map(sample, test)]
        lines.append(f"| calibrated roofline (`fit_samples`) | {on} | {_stats(e_roof)} |")
        lines.append(f"| per-equation layer model (`fit_equation_model`) | {on} | "
                     f"{_stats(e_eq)} |")
    # What hetpar profile --fit decides on the zoo's train models.
    samples = [(r["model"], *sample(r)) for r in train_zoo]
    roof = fit_samples(base, [(w, t) for _, _, w, t in samples])
    chosen = with_layer_model(base, roof, samples, what="the zoo's train models")
    e = [abs(predict_layer(chosen, w, q) / t - 1) for q, w, t in map(sample, test)]
    lines += ["", f"`with_layer_model` on the zoo's train models: "
              f"{chosen.sources['layer_model']}. Its choice on the held-out layers: "
              f"{_stats(e)}."]
    if args.other:
        from hetpar.cost_models import transfer_calibration

        other = [r for r in _records(args.other, args.device) if r["measured_s"] > THR]
        oeqs = _equations(other)
        other = [r for r in other if id(r) in oeqs]
        eqs.update(oeqs)
        samples = [sample(r) for r in (sweep + train_zoo)]
        roof = fit_samples(base, [(w, t) for _, w, t in samples])
        eq = roof.replace(layer_model=fit_equation_model(roof, samples))
        target = spec(args.other_kind).replace(name=args.device)
        lines += ["", f"Plan for elsewhere: fitted here on {'the sweep + ' if sweep else ''}"
                  f"the zoo's train models, predicting {args.other_kind}'s zoo layers > 100 us "
                  f"(`{args.other}`) from its spec sheet with this calibration "
                  "(`transfer_calibration`):", "",
                  "| model | all its zoo layers | held-out models' layers |", "|---|---|---|"]
        for name, prof in (("calibrated roofline", roof), ("per-equation layer model", eq)):
            moved = transfer_calibration(prof, target)
            err = {id(r): abs(predict_layer(moved, w, e) / t - 1)
                   for r, (e, w, t) in ((r, sample(r)) for r in other)}
            held = [err[id(r)] for r in other if r["model"] not in ca.TRAIN_MODELS]
            lines.append(f"| {name} | {_stats(list(err.values()))} | {_stats(held)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
