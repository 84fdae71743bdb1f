"""A per-primitive linear model of layer time, against the roofline (issue 17, offline).

Each layer's equations (forward, backward and update, `_prim_features`) are
summed per primitive group: dot_general, convolutions (regular, grouped /
depthwise, input-dilated = transposed), elementwise, transcendental,
reductions, gather / scatter / dynamic slices, layout (reshape, transpose,
broadcast, concatenate, ...), equations inside loops (`loop`, also counted
in their own group) and the rest. The model is

    t = c0 + sum_g (a_g * count_g + b_g * flops_g + d_g * bytes_g),   all >= 0,

fitted on the calibration models' layers (`cost_accuracy.TRAIN_MODELS`, fixed
before any fit) by non-negative least squares on the relative error (each
row divided by its measured time), or in log space. Errors: held-out models'
layers above 100 us, median / p90 APE, on the saved records (no device):

    accuracy_v3.json (H200 and the 16-core CPU), cross_card/accuracy_v3_h100.json (H100)

The roofline baseline is `cost_accuracy`'s own fit (per executable on the
GPUs, per kernel on the CPU; after-fusion bytes where known), on the same
layers. Layers the zoo no longer has (no jaxpr to count) are left out of
both; the baseline on the whole file is given too.

    python experiments/primitive_model.py --out experiments/results/primitive_model.md

The features are cached in results/primitive_features.json (keyed by model, small,
batch and layer); delete it to count them again after the zoo or the tracer changes
(re-tracing the eleven models takes about a minute on a CPU).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
from absl import app, flags
from scipy.optimize import least_squares, nnls

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import _prim_features as pf  # noqa: E402
import cost_accuracy as ca  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "write the markdown here (default: stdout)")

RESULTS = pathlib.Path(__file__).parent / "results"
CACHE = RESULTS / "primitive_features.json"
THRESHOLD_S = 100e-6
SPLITS = 8
MM = ("dot", "conv", "conv_dw", "conv_tr")
NON_MM = tuple(g for g in pf.GROUPS if g not in MM)
BINS = tuple(f"mm{k}" for k in range(len(pf.SIZE_BINS) + 1))


def _cols(variant: str) -> list[str]:
    """The feature columns of a variant (the constant c0 is always added)."""
    base, _, extra = variant.partition("+")
    if base in ("full", "full-log"):
        cols = [f"{p}_{g}" for g in pf.GROUPS for p in "nfb"]
    elif base in ("size", "size-log"):
        # dot / conv FLOPs by FLOPs per equation (one b per bin); counts and bytes per group.
        cols = ([f"{p}_{g}" for g in pf.GROUPS for p in "nb"]
                + [f"f_{g}" for g in NON_MM] + [f"f_{b}" for b in BINS])
    elif base in ("compact", "compact-log"):
        # One cost per equation; FLOPs and bytes per group.
        cols = ["n_all"] + [f"{p}_{g}" for g in pf.GROUPS for p in "fb"]
    else:
        raise ValueError(variant)
    if "fused" in extra:
        cols.append("fused_bytes")
    if "kern" in extra:
        cols.append("kernels")
    return cols


VARIANTS = ("full", "full-log", "size", "size-log", "compact", "compact-log",
            "full+fused", "size+fused", "full+kern", "size+kern")


def _row(r, feats, cols):
    f = feats[pf.key_of(r)]
    out = [1.0]
    for c in cols:
        if c == "fused_bytes":
            fb = r["work"].get("fused_bytes")
            out.append(f.get("b_all", 0.0) if fb is None else fb)
        elif c == "kernels":
            out.append(float(r.get("kernels") or 1))
        else:
            out.append(f.get(c, 0.0))
    return out


def fit(records, feats, variant):
    """Non-negative coefficients (c0 first) fitted on `records`."""
    cols = _cols(variant)
    a = np.array([_row(r, feats, cols) for r in records])
    y = np.array([r["measured_s"] for r in records])
    ar = a / y[:, None]  # relative error: (a x - y) / y
    scale = np.linalg.norm(ar, axis=0)
    scale[scale == 0] = 1.0
    z, _ = nnls(ar / scale, np.ones(len(y)), maxiter=50 * a.shape[1])
    x = z / scale
    if variant.partition("+")[0].endswith("-log"):
        # Start from the relative fit; a column all zero on these rows stays 0.
        colmax = a.max(axis=0)
        s = np.where(x > 0, x, np.where(colmax > 0, 1e-3 * np.median(y) / np.where(
            colmax > 0, colmax, 1.0), 0.0))

        def resid(u):
            return np.log(np.maximum(a @ (u * s), 1e-30)) - np.log(y)

        sol = least_squares(resid, np.where(x > 0, 1.0, 1e-3), bounds=(0.0, np.inf),
                            x_scale="jac")
        x = sol.x * s
    return x, cols


def predict(x, cols, records, feats):
    return np.array([_row(r, feats, cols) for r in records]) @ x


def ape(pred, records):
    y = np.array([r["measured_s"] for r in records])
    return np.abs(pred - y) / y


def _large(rs):
    return [r for r in rs if r["measured_s"] > THRESHOLD_S]


def stats(err):
    if len(err) == 0:
        return float("nan"), float("nan"), 0
    return float(np.median(err)), float(np.percentile(err, 90)), len(err)


def held_out(records, feats, variant, train_models):
    train = [r for r in records if r["model"] in train_models]
    test = _large([r for r in records if r["model"] not in train_models])
    x, cols = fit(train, feats, variant)
    return ape(predict(x, cols, test, feats), test), test


def baseline(records, launch_model, train_models, test=None):
    """The roofline's held-out APE (cost_accuracy's fit) on `test` (default: held-out large)."""
    base = ca._base_profiles(records)
    dev = records[0]["device"]
    train = [r for r in records if r["model"] in train_models]
    prof = ca.fit_layers(base[dev], train, launch_model=launch_model)
    if test is None:
        test = _large([r for r in records if r["model"] not in train_models])
    return ca._errors(prof, test, launch_model), test


def device_sets():
    v3 = json.loads((RESULTS / "accuracy_v3.json").read_text())["records"]
    h100 = json.loads((RESULTS / "cross_card/accuracy_v3_h100.json").read_text())["records"]
    return {
        "H200": ([r for r in v3 if r["device"] == "gpu:0"], "executable"),
        "H100": (h100, "executable"),
        "CPU (16 cores)": ([r for r in v3 if r["device"] == "cpu:0"], "kernels"),
    }


def _pct(m, p, n=None):
    s = f"{100 * m:.1f}% / {100 * p:.1f}%"
    return s if n is None else s + f" (n={n})"


def main(argv):
    del argv
    sets = device_sets()
    feats = pf.features([r for rs, _ in sets.values() for r in rs], CACHE)
    train_models = ca.TRAIN_MODELS
    known = {}
    for name, (rs, _) in sets.items():
        known[name] = [r for r in rs if pf.key_of(r) in feats]
    lines = ["# Per-primitive linear model vs the roofline (held-out layers above 100 us)", "",
             "Calibrated on " + ", ".join(train_models) + " (fixed split; the H100 file has no "
             "resnet50); every other model held out. Cells: median / p90 APE (n layers).", "",
             "Layers the zoo no longer has (no jaxpr to count features from): "
             + "; ".join(f"{k}: {len(sets[k][0]) - len(v)}" for k, v in known.items())
             + ". The baseline row is on the same layers as the others; the file row on every "
             "record of the file (cost_accuracy's reported figure).", "",
             "| model | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    cells = []
    for rs, lm in sets.values():
        cells.append(_pct(*stats(baseline(rs, lm, train_models)[0])))
    lines.append("| roofline, whole file | " + " | ".join(cells) + " |")
    cells = []
    for name, (rs, lm) in sets.items():
        test = _large([r for r in known[name] if r["model"] not in train_models])
        cells.append(_pct(*stats(baseline(rs, lm, train_models, test)[0])))
    lines.append("| roofline, same layers | " + " | ".join(cells) + " |")
    per_variant = {}
    for v in VARIANTS:
        cells = []
        for name in sets:
            if "kern" in v and name != "CPU (16 cores)":
                cells.append("-")
                continue
            err, test = held_out(known[name], feats, v, train_models)
            per_variant[(v, name)] = (err, test)
            cells.append(_pct(*stats(err)))
        lines.append(f"| primitive {v} | " + " | ".join(cells) + " |")

    lines += ["", "## Capacity: fitted on every model, errors on the same layers above 100 us",
              "", "| model | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    for v in ("roofline",) + VARIANTS:
        cells = []
        for name, (_, lm) in sets.items():
            rk = known[name]
            everyone = sorted({r["model"] for r in rk})
            if v == "roofline":
                err = baseline(rk, lm, everyone, _large(rk))[0]
            elif "kern" in v and name != "CPU (16 cores)":
                cells.append("-")
                continue
            else:
                x, cols = fit(rk, feats, v)
                err = ape(predict(x, cols, _large(rk), feats), _large(rk))
            cells.append(_pct(*stats(err)))
        lines.append(f"| {v} | " + " | ".join(cells) + " |")

    lines += ["", "## Leave one model out", "",
              "Each model of a set held out in turn, the model fitted on every other model "
              "of the set; pooled: median / p90 APE over every model's layers above 100 us "
              "when it was the one held out.", "",
              "| model | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    lomo_vs = ("roofline",) + tuple(v for v in VARIANTS if "kern" not in v)
    lomo = {}  # (variant, set) -> {model: errors}
    for name, (_, lm) in sets.items():
        rk = known[name]
        models = sorted({r["model"] for r in rk})
        for v in lomo_vs:
            per = {}
            for m in models:
                test = _large([r for r in rk if r["model"] == m])
                if not test:
                    continue
                if v == "roofline":
                    per[m] = baseline(rk, lm, [x for x in models if x != m], test)[0]
                else:
                    x, cols = fit([r for r in rk if r["model"] != m], feats, v)
                    per[m] = ape(predict(x, cols, test, feats), test)
            lomo[(v, name)] = per
    for v in lomo_vs:
        cells = [_pct(*stats(np.concatenate(list(lomo[(v, name)].values())))) for name in sets]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("")
    vs = ("roofline", "full", "size", "full+fused", "full-log")
    for name in sets:
        models = list(lomo[("roofline", name)])
        lines += [f"### {name}: median APE of the held-out model's layers above 100 us", "",
                  "| held out | layers > 100 us | " + " | ".join(vs) + " |",
                  "|---" * (len(vs) + 2) + "|"]
        for m in models:
            cells = [f"{100 * np.median(lomo[(v, name)][m]):.1f}%" for v in vs]
            lines.append(f"| {m} | {len(lomo[('roofline', name)][m])} | "
                         + " | ".join(cells) + " |")
        lines.append("")

    rng = np.random.default_rng(0)
    lines += [f"## Robustness: {SPLITS} random half splits of each set's models", "",
              "Median over splits of the held-out median / p90 APE (layers above 100 us); "
              "wins / losses of the median against the roofline on the same split (by more "
              "than 0.5 points).", "",
              "| model | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    splits = {}
    for name in sets:
        models = sorted({r["model"] for r in known[name]})
        splits[name] = [list(rng.choice(models, len(models) // 2, replace=False))
                        for _ in range(SPLITS)]
    base_split = {}
    for name, (rs, lm) in sets.items():
        base_split[name] = [stats(baseline(rs, lm, tr, _large(
            [r for r in known[name] if r["model"] not in tr]))[0]) for tr in splits[name]]
    for v in ("roofline", "full", "size", "full+fused", "full-log", "compact"):
        cells = []
        for name in sets:
            if v == "roofline":
                ss = base_split[name]
            else:
                ss = [stats(held_out(known[name], feats, v, tr)[0]) for tr in splits[name]]
            med = np.median([x[0] for x in ss])
            p9 = np.median([x[1] for x in ss])
            cell = _pct(med, p9)
            if v != "roofline":
                b = np.array([x[0] for x in base_split[name]])
                o = np.array([x[0] for x in ss])
                cell += f", {int(np.sum(o < b - 0.005))}/{int(np.sum(o > b + 0.005))}"
            cells.append(cell)
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines.append("")

    lines += ["## Worst held-out layers (fixed split, variant `full`)", ""]
    for name in sets:
        err, test = per_variant[("full", name)]
        x, cols = fit([r for r in known[name] if r["model"] in train_models], feats, "full")
        pred = predict(x, cols, test, feats)
        order = np.argsort(-err)[:8]
        lines.append(f"{name}: " + "; ".join(
            f"{test[i]['model']}/{test[i]['layer']} {pred[i] / test[i]['measured_s']:.2f}x "
            f"of {1e6 * test[i]['measured_s']:.0f} us" for i in order) + ".")
        nz = [f"{c} {v:.3g}" for c, v in zip(["c0"] + cols, x) if v > 0]
        lines += ["", f"{name} `full` coefficients (> 0): " + ", ".join(nz) + ".", ""]

    text = "\n".join(lines) + "\n"
    if _OUT.value:
        pathlib.Path(_OUT.value).write_text(text)
    print(text)


if __name__ == "__main__":
    app.run(main)
