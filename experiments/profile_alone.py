"""A fitted profile alone, predicting whole steps (issue 17, deliverable 3; offline).

What a table for an absent GPU gets from `hetpar profile --fit` without a
GPU of its class present: hetpar's unfused byte counts and the profile's
efficiencies, summed over the step's layers. Fitted here on the H200's layer
records (`results/accuracy_v3.json`, gpu:0, the `hetpar profile --fit
default` models) two ways, as `fit_samples` writes a profile (compute
efficiencies from the fit on after-fusion bytes, bytes efficiencies from
the fit on unfused counts) and the unfused fit alone; the H100 borrows the
calibration (`transfer_calibration`). Each zoo model's step is traced here
at the cross-card batch and compared with the steps measured on each card
(`results/cross_card/cross_card_steps_{h200,h100_fitted}.json`).

    python experiments/profile_alone.py [--out results/cross_card/profile_alone.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
FIT_MODELS = ("alexnet", "conv6", "lm_embed", "mobilenet_v1", "transformer")  # --fit default


def main(argv=None) -> int:
    import cost_accuracy as ca

    from hetpar import zoo
    from hetpar.cost_models import (
        calibrate,
        fit_samples,
        graph_layer_work,
        predict,
        spec,
        transfer_calibration,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = HERE / "results"
    recs = [r for r in json.loads((res / "accuracy_v3.json").read_text())["records"]
            if r["device"] == "gpu:0" and r["model"] in FIT_MODELS]
    base = spec("h200").replace(name="gpu:0")
    samples = [(ca.record_work(r, "executable", "fused"), r["measured_s"]) for r in recs]
    profiles = {
        "as fit_samples writes it": fit_samples(base, samples),
        "unfused fit alone": calibrate(base, [(dataclasses.replace(w, fused_bytes=None), t)
                                              for w, t in samples], fit_overhead=True),
    }
    steps = {card: json.loads((res / "cross_card" / f"cross_card_steps_{f}.json").read_text())
             for card, f in (("h200", "h200"), ("h100", "h100_fitted"))}
    measured = {card: {(r["model"], r["batch"]): r["measured_s"] for r in s["rows"]}
                for card, s in steps.items()}
    cols = [(name, card) for name in profiles for card in ("h200", "h100")]
    lines = ["# A fitted profile alone, predicting whole steps (unfused counts)", "",
             f"Fitted on the H200's layers of {', '.join(FIT_MODELS)} "
             "(`accuracy_v3.json`); the H100 borrows the calibration. Error: "
             "predicted / measured - 1.", "",
             "| model | batch | " + " | ".join(f"{n}, {c}" for n, c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    errors: dict = {c: [] for c in cols}
    for model, batch in measured["h200"]:
        _, graph = zoo.trace_model(model, batch=batch)
        works = [dataclasses.replace(graph_layer_work(graph, n), fused_bytes=None)
                 for n in graph.layers]
        cells = []
        for name, card in cols:
            prof = profiles[name]
            if card == "h100":
                prof = transfer_calibration(prof, spec("h100").replace(name="h100"))
            m = measured[card].get((model, batch))
            if m is None:
                cells.append("-")
                continue
            e = sum(predict(prof, w) for w in works) / m - 1
            errors[(name, card)].append(abs(e))
            cells.append(f"{e:+.0%}")
        lines.append(f"| {model} | {batch} | " + " | ".join(cells) + " |")
    lines += ["", "Median |error|: " + ", ".join(
        f"{n}, {c}: {statistics.median(v):.1%}" for (n, c), v in errors.items() if v), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
