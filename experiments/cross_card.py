"""Plan for elsewhere, checked (issue 17): measure on one GPU, predict another, measure there.

On each card (one call per card, same JAX):

    hetpar profile --out DIR/profile_<card>.json --no-transfers
    python experiments/cost_accuracy.py --platforms gpu --tag <card> --out_dir DIR
    python experiments/cross_card.py measure --profiles DIR/profile_<card>.json --out DIR

Then, anywhere (no device):

    python experiments/cross_card.py compare --steps A.json B.json \\
        --layers accuracy_A.json accuracy_B.json --out DIR

`measure` times every zoo model's whole training step under `jax.jit` on
gpu:0 (reference config and batch, and GPT-2 small at batch 256) and writes
what this card predicts for each GPU kind with a spec sheet (h100, h200), three ways:

- `spec`: the spec sheets alone (`hetpar plan MODEL --devices h100`);
- `profile`: this card's `hetpar profile` file; the other kind borrows its
  efficiencies and launch cost (`transfer_calibration`);
- `calibrated`: `hetpar costs MODEL --devices gpu:0,h100 --calibrate
  [--profiles FILE]`: the whole step timed here scales this card's layers,
  and the other kind's by the same factor (`scale_to_step(siblings=True)`);
  with a profile file fitted on layers (`hetpar profile --fit`), the other
  kind borrows the fitted efficiencies.

`compare` sets card A's predictions of card B beside what B measured (and
the other way round), per step, and per layer from the two cards'
`cost_accuracy` records (every layer of every zoo model, timed alone):

- `measured x ratio`: A's measured layer time x the roofline's B/A ratio,
  both rooflines calibrated on A's layers (B borrows A's efficiencies), as
  `hetpar costs --measure` does for a spec-sheet sibling;
- `roofline`: B's roofline alone with A's calibration (no A times);
- `measured as is`: A's time unchanged (the naive guess to beat).

Goal (issue 17): cross-card per-layer median error <= 15%.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # cost_accuracy, beside this script

SPEC_GPUS = ("h100", "h200")
STEP_MODELS = None  # every zoo model, plus GPT-2 small at batch 256


def _measure(args) -> int:
    import jax

    from hetpar import zoo
    from hetpar.cost_models import load_profiles, present_devices

    dev = present_devices().get(args.device)
    if dev is None:
        raise SystemExit(f"cross_card measure: {args.device} is not present "
                         f"({', '.join(present_devices())})")
    # GPT-2 small at batch 256 first: the step measured on both cards before.
    models = [("transformer", 256)] + [(m, None) for m in (args.models or zoo.names())]
    profiles = load_profiles(args.profiles) if args.profiles else None
    from hetpar.cost_models import spec_kind_of

    card = spec_kind_of(dev)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cross_card_steps_{card}.json"
    rows = []
    for model, batch in models:
        t0 = time.perf_counter()
        try:
            cal = zoo.cost_table(model, [args.device, *SPEC_GPUS], batch=batch, calibrate=True,
                                 k=args.k, profiles=profiles)
            spec_t = zoo.cost_table(model, list(SPEC_GPUS), batch=batch)
            prof_t = (zoo.cost_table(model, list(SPEC_GPUS), batch=batch, profiles=profiles)
                      if profiles is not None else None)
        except Exception as e:  # noqa: BLE001 - one model's failure must not end the run
            print(f"{model}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue

        def totals(table):
            return {k: sum(layer.time_s[f"{k}:0"] for layer in table.layers)
                    for k in SPEC_GPUS}

        row = {"model": model, "batch": cal.meta["batch"],
               "measured_s": cal.meta["step_s"][args.device],
               "predicted": {"spec": totals(spec_t), "calibrated": totals(cal)}}
        if prof_t is not None:
            row["predicted"]["profile"] = totals(prof_t)
        rows.append(row)
        print(f"{model:<20} b{row['batch']:<4} measured {row['measured_s'] * 1e3:8.2f} ms  "
              + "  ".join(f"{how}: " + "/".join(f"{v * 1e3:.2f}" for v in p.values())
                          for how, p in row["predicted"].items())
              + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        # Written after every model: a timeout keeps what was measured.
        path.write_text(json.dumps({"card": card, "device_kind": dev.device_kind,
                                    "jax": jax.__version__, "k": args.k,
                                    "profiles": args.profiles, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def _ape(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def _stats(errs) -> str:
    errs = list(errs)
    if not errs:
        return "- / -"
    return f"{np.median(errs):.1%} / {np.percentile(errs, 90):.1%}"


def _gpu_records(accuracy: dict) -> dict:
    """{(model, layer, batch): record} of an accuracy file's GPU layers (reference configs)."""
    return {(r["model"], r["layer"], r["batch"]): r for r in accuracy["records"]
            if r["device"].startswith("gpu") and not r["small"]}


def _layer_errors(src: dict, dst: dict, threshold_s: float) -> dict[str, list[float]]:
    """Per-layer APE predicting dst's GPU layers from src's, two ways."""
    from cost_accuracy import fit_layers, record_work

    from hetpar.cost_models import predict, spec, transfer_calibration

    a, b = _gpu_records(src), _gpu_records(dst)
    kind_a, kind_b = next(iter(a.values()))["kind"], next(iter(b.values()))["kind"]
    prof_a = fit_layers(spec(kind_a).replace(name="a"), list(a.values()))
    prof_b = transfer_calibration(prof_a, spec(kind_b).replace(name="b"))
    hows = ("measured x ratio", "roofline", "measured as is")
    out: dict[str, list[float]] = {h: [] for h in hows}
    out.update({f"{h}, > 100 us": [] for h in hows})
    for key in sorted(set(a) & set(b)):
        w = record_work(a[key])
        meas_b = b[key]["measured_s"]
        ratio = predict(prof_b, w) / predict(prof_a, w)
        for how, pred in (("measured x ratio", a[key]["measured_s"] * ratio),
                          ("roofline", predict(prof_b, w)),
                          ("measured as is", a[key]["measured_s"])):
            out[how].append(_ape(pred, meas_b))
            if meas_b > threshold_s:
                out[f"{how}, > 100 us"].append(_ape(pred, meas_b))
    out["_kinds"] = [kind_a, kind_b]
    return out


def _model_ratios(first: dict, second: dict) -> list[str]:
    """Per model, the two cards' summed layer times against the spec sheets' ratio."""
    from cost_accuracy import record_work

    from hetpar.cost_models import predict, spec

    a, b = _gpu_records(first), _gpu_records(second)
    ka, kb = next(iter(a.values()))["kind"], next(iter(b.values()))["kind"]
    pa, pb = spec(ka), spec(kb)
    lines = [f"## Why: {kb}/{ka} time ratio per model, measured against the spec sheets'", "",
             "Summed over each model's layers (timed alone). Spec sheets: the roofline of "
             "each card's spec sheet, with unfused and with XLA's after-fusion bytes.", "",
             f"| model | measured {kb}/{ka} | spec sheets, unfused bytes | "
             "spec sheets, after-fusion bytes |", "|---|---|---|---|"]
    for model in sorted({k[0] for k in a.keys() & b.keys()}):
        keys = [k for k in a.keys() & b.keys() if k[0] == model]
        meas = sum(b[k]["measured_s"] for k in keys) / sum(a[k]["measured_s"] for k in keys)
        cells = []
        for bytes_model in ("unfused", "fused"):
            works = [record_work(a[k], bytes_model=bytes_model) for k in keys]
            cells.append(sum(predict(pb, w) for w in works) / sum(predict(pa, w) for w in works))
        lines.append(f"| {model} | {meas:.2f} | {cells[0]:.2f} | {cells[1]:.2f} |")
    return lines + [""]


def _compare(args) -> int:
    steps = [json.loads(pathlib.Path(p).read_text()) for p in args.steps or []]
    layers = [json.loads(pathlib.Path(p).read_text()) for p in args.layers or []]
    lines = ["# Plan for elsewhere: one GPU predicted from another", ""]
    summary = {}
    for src, dst in ([(steps[0], steps[1]), (steps[1], steps[0])] if len(steps) == 2 else []):
        a, b = src["card"], dst["card"]
        meas = {(r["model"], r["batch"]): r["measured_s"] for r in dst["rows"]}
        lines += [f"## Whole steps: {a} predicts {b}", "",
                  f"Measured on {b}: `jax.jit` of the step, median of {dst['k']}. "
                  "Error: predicted / measured - 1.", "",
                  f"| model | batch | measured on {b} ms | on {a} ms | spec sheets | "
                  f"{a}'s profile | calibrated on {a} |", "|---|---|---|---|---|---|---|"]
        errs: dict[str, list[float]] = {"spec": [], "profile": [], "calibrated": []}
        for r in src["rows"]:
            key = (r["model"], r["batch"])
            if key not in meas:
                continue
            cells = []
            for how in errs:
                p = r["predicted"].get(how, {}).get(b)
                if p is None:
                    cells.append("-")
                    continue
                e = p / meas[key] - 1
                errs[how].append(abs(e))
                cells.append(f"{p * 1e3:.2f} ({e:+.0%})")
            lines.append(f"| {r['model']} | {r['batch']} | {meas[key] * 1e3:.2f} | "
                         f"{r['measured_s'] * 1e3:.2f} | " + " | ".join(cells) + " |")
        lines += ["", "Median |error|: " + ", ".join(
            f"{how} {statistics.median(e):.1%}" for how, e in errs.items() if e), ""]
        summary[f"{a}->{b} steps"] = {how: statistics.median(e) for how, e in errs.items() if e}
    if len(layers) == 2:
        lines += ["## Layers (every zoo model's layers, timed alone on each card)", "",
                  "Cards: " + ", ".join(f"{next(iter(part['device_kinds'].values()))} "
                                        f"(JAX {part['jax']}, {part['date']})"
                                        for part in layers) + ".", "",
                  "Median / p90 APE predicting the other card's measured layer time. "
                  "`measured x ratio`: the source card's measured time x the two rooflines' "
                  "ratio (what `hetpar costs --measure` gives a spec-sheet sibling); "
                  "`roofline`: the target's roofline with the source's calibration; "
                  "`measured as is`: the source card's time unchanged (the naive guess).", "",
                  "| source -> target | layers | measured x ratio | roofline | measured as is | "
                  "measured x ratio, > 100 us | roofline, > 100 us | measured as is, > 100 us |",
                  "|---|---|---|---|---|---|---|---|"]
        for src, dst in ((layers[0], layers[1]), (layers[1], layers[0])):
            e = _layer_errors(src, dst, 100e-6)
            ka, kb = e.pop("_kinds")
            lines.append(f"| {ka} -> {kb} | {len(e['roofline'])} | "
                         + " | ".join(_stats(e[h]) for h in e) + " |")
            summary[f"{ka}->{kb} layers"] = {h: float(np.median(v)) if v else None
                                             for h, v in e.items()}
        lines.append("")
        lines += _model_ratios(layers[0], layers[1])
    text = "\n".join(lines)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cross_card.md").write_text(text)
    (out / "cross_card.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time every model's step here; predict the other kinds")
    m.add_argument("--out", required=True)
    m.add_argument("--profiles", default=None, help="this card's `hetpar profile` file")
    m.add_argument("--models", nargs="*", default=None)
    m.add_argument("--k", type=int, default=10)
    m.add_argument("--device", default="gpu:0", help="the present device to time (cpu:0 to try it)")
    c = sub.add_parser("compare",
                       help="set each card's predictions beside the other's measurements")
    c.add_argument("--steps", nargs=2, default=None, metavar="STEPS_JSON",
                   help="the two cards' `measure` files (whole steps)")
    c.add_argument("--layers", nargs=2, default=None, metavar="ACCURACY_JSON")
    c.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    return _measure(args) if args.cmd == "measure" else _compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
