"""Levers on the per-layer roofline, tried offline on saved layer records (issue 17).

Each lever adds a small, explainable term to `hetpar.cost_models.predict`'s
model and is fitted with it on the fixed calibration models
(`cost_accuracy.TRAIN_MODELS`); errors are on the held-out models' layers
above 100 us. The levers are evaluated here with a copy of the model (a
robust log-space least-squares fit, as `calibrate`'s refinement, started
from `calibrate`'s own fit); the one that earned a place in the predictor,
a convolution efficiency of its own, is `calibrate(fit_conv=True)`, and
`cost_accuracy.py` reports it from the real code.

    conv     convolutions' FLOPs at an efficiency of their own (not dot_general's)
    grp      grouped / depthwise convolutions' FLOPs at their own efficiency
    dil      input-dilated convolutions (transposed; strided convs' backward) at theirs
    mmadd    a GEMM's memory traffic not hidden under its compute: matmul time is
             flops / (e * peak) + a * bytes / bandwidth (an efficiency that ramps
             with arithmetic intensity)
    mmkern   a fixed cost per matmul equation (an efficiency that ramps with FLOPs
             per kernel: t = flops / (e * peak) + n_matmul * c)
    exec     a fixed cost per executable on top of the per-kernel one
    eq       a cost per unfused equation on top of the per-kernel one (CPU per-op)
    ovl      the fixed cost overlaps the work: max(work, launches * o)
    tile*    matmul FLOPs padded to tensor-core tiles (M, N, K multiples) first

Besides the fixed split: random half splits of the models (robustness) and
the fit on every model (what the family can reach at best: not held out).

    python experiments/predictor_levers.py --out experiments/results/predictor_levers_v3.md
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import sys
from collections import defaultdict

import numpy as np
from absl import app, flags
from scipy.optimize import least_squares

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import cost_accuracy as ca  # noqa: E402

from hetpar.cost_models import OP_CLASSES, predict, spec  # noqa: E402
from hetpar.cost_models._roofline import _terms, physical_floor  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "write the markdown tables here (default: stdout)")
_SPLITS = flags.DEFINE_integer("splits", 8, "random half splits for the robustness table")

RESULTS = pathlib.Path(__file__).parent / "results"
THRESHOLD_S = 100e-6
LEVERS = ("ovl", "conv", "grp", "dil", "mmadd", "mmkern", "exec", "eq")
_SCALE = {"o": 1e-6, "b": 1e-6, "ovl": 1e-6, "mmkern": 1e-6, "exec": 1e-6, "eq": 1e-6}
_INIT = {"conv": 3.0, "grp": 20.0, "dil": 5.0, "mmadd": 0.5, "mmkern": 5e-6, "exec": 20e-6,
         "eq": 1e-6, "ovl": 20e-6}


# -- per-equation matmul features, by re-tracing the zoo (no device) ----------------


def _walk(eqns, times, acc):
    """Every matmul-like leaf equation under `eqns` (control flow and calls
    walked by hetpar's `leaf_equations`: scan x length, while x trips, the
    costlier cond branch), its features added to `acc`."""
    from hetpar.passes import eqn_work, leaf_equations

    for e, reps, _ in leaf_equations(eqns, times):
        name = e.primitive.name
        if name not in ("dot_general", "conv_general_dilated"):
            continue
        f, _, b = eqn_work(e).by_class["matmul"]
        lhs, rhs = (v.aval.shape for v in e.invars[:2])
        out = e.outvars[0].aval.shape
        if name == "dot_general":
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            key = "dot"
            bsz = math.prod(lhs[d] for d in lb)
            k = math.prod(lhs[d] for d in lc)
            m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
            n = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
        else:
            p, dn = e.params, e.params["dimension_numbers"]
            groups = p["feature_group_count"] * p["batch_group_count"]
            dilated = any(d > 1 for d in (p.get("lhs_dilation") or ()))
            key = "conv_grouped" if groups > 1 else ("conv_lhsdil" if dilated else "conv")
            m = out[dn.out_spec[0]] * math.prod(out[d] for d in dn.out_spec[2:])
            n = rhs[dn.rhs_spec[0]] // groups
            k = rhs[dn.rhs_spec[1]] * math.prod(rhs[d] for d in dn.rhs_spec[2:])
            bsz = groups
        acc["n_" + key] += reps
        acc["f_" + key] += reps * f
        acc.setdefault("sizes", []).append((f, reps, bsz, m, n, k))


def features(records):
    """{(model, small, batch, layer): matmul features} of the records' layers."""
    from hetpar.zoo import trace_model

    out = {}
    for model, small, batch in sorted({(r["model"], r["small"], r["batch"]) for r in records}):
        _, g = trace_model(model, small=small, batch=batch)
        for name in g.layers:
            acc = defaultdict(float)
            _walk([g.program.eqns[i] for i in g[name].eqns], 1, acc)
            out[(model, small, batch, name)] = dict(acc)
    return out


# -- the model with levers ---------------------------------------------------------------


class _Data:
    def __init__(self, prof, records, launch_model, feats, tile=None):
        def feat(r):
            k = (r["model"].lstrip("~"), r["small"], r["batch"])  # "~": _in_sample's copies
            return feats.get(k + (r["layer"],)) or feats.get(k + (r["layer"].split("/")[-1],), {})

        fs = [feat(r) for r in records]
        works = [ca.record_work(r, launch_model) for r in records]
        self.t = np.array([r["measured_s"] for r in records])
        terms = [_terms(prof, w) for w in works]
        self.comp = np.array([a for a, _, _ in terms])
        self.mem = np.array([b for _, b, _ in terms])
        self.fmem = np.array([c for _, _, c in terms])
        self.floor = np.array([physical_floor(prof, w) for w in works])
        self.launch = np.array([w.launches for w in works], float)
        self.buf = np.array([w.buffers for w in works], float)
        self.eq = np.array([r["equations"] for r in records], float)

        def g(k):
            return np.array([f.get(k, 0.0) for f in fs])

        fmm = np.array([w.flops("matmul") for w in works])
        per_flop = np.where(fmm > 0, self.comp[:, 0] / np.maximum(fmm, 1e-30), 0.0)
        self.c_conv = g("f_conv") * per_flop
        self.c_grp = g("f_conv_grouped") * per_flop
        self.c_dil = g("f_conv_lhsdil") * per_flop
        self.n_mm = sum(g(k) for k in ("n_dot", "n_conv", "n_conv_grouped", "n_conv_lhsdil"))
        self.mm_bytes = np.array([w.bytes("matmul") for w in works]) / \
            prof.memory_bandwidth_bytes_per_s
        if tile:
            self.comp[:, 0] *= np.array([_padded_ratio(f, tile) for f in fs])


def _padded_ratio(feat, tile):
    num = den = 0.0
    for f, times, _bsz, m, n, k in feat.get("sizes", []):
        if f > 0:
            pads = [math.ceil(x / t) * t / x for x, t in zip((m, n, k), tile, strict=True)]
            num += times * f * math.prod(pads)
            den += times * f
    return num / den if den else 1.0


def _model(d, p, lev):
    u, v, f, o, b = p["u"], p["v"], p["f"], p["o"], p["b"]
    comp = d.comp * u
    for k, col in (("conv", d.c_conv), ("grp", d.c_grp), ("dil", d.c_dil)):
        if k in lev:
            comp[:, 0] += col * (p[k] - u[0])
    side = np.maximum(np.maximum(comp, d.mem * v), d.fmem * f).sum(1)
    if "ovl" in lev:
        t = np.maximum(side, d.launch * o) + d.buf * b + d.launch * p["ovl"]
    else:
        t = side + d.launch * o + d.buf * b
    for k, col in (("mmadd", d.mm_bytes), ("mmkern", d.n_mm), ("eq", d.eq)):
        if k in lev:
            t = t + col * p[k]
    if "exec" in lev:
        t = t + p["exec"]
    return np.maximum(t, d.floor)


def _fit(d, p0, lev):
    names = ["u", "v", "f", "o", "b"] + [k for k in LEVERS if k in lev]

    def pack(p):
        return np.concatenate([np.atleast_1d(np.asarray(p[k], float)) / _SCALE.get(k, 1.0)
                               for k in names])

    def unpack(z):
        p, i = {}, 0
        for k in names:
            n = len(OP_CLASSES) if k in ("u", "v") else 1
            val = z[i:i + n] * _SCALE.get(k, 1.0)
            i += n
            p[k] = val if k in ("u", "v") else float(val[0])
        return p

    n = len(OP_CLASSES)
    lo = np.concatenate([np.ones(2 * n), [1.0, 0.0, 0.0]]
                        + [[1.0 if k in ("conv", "grp", "dil") else 0.0] for k in names[5:]])
    res = least_squares(lambda z: np.log(_model(d, unpack(z), lev)) - np.log(d.t),
                        np.maximum(pack(p0), lo + 1e-9), bounds=(lo, np.inf),
                        loss="soft_l1", f_scale=0.1, max_nfev=4000)
    return unpack(res.x), res.cost


def held_out(records, launch_model, lev, train, feats, tile=None):
    """(median, p90, n) APE on the held-out layers above 100 us."""
    prof = spec(records[0]["kind"] if records[0]["kind"] in ("cpu", "h100", "h200")
                else "h100").replace(name=records[0]["device"])
    tr = [r for r in records if r["model"] in train]
    te = [r for r in records if r["model"] not in train]
    if tile:  # calibrate's start must see the padded FLOPs too
        tr = [_pad_record(r, feats, tile) for r in tr]
        te = [_pad_record(r, feats, tile) for r in te]
    cal = ca.fit_layers(prof, tr, launch_model=launch_model)
    dte = _Data(prof, te, launch_model, feats)
    if lev:
        dtr = _Data(prof, tr, launch_model, feats)
        p0 = {"u": np.array([1 / cal.efficiencies[c]["flops"] for c in OP_CLASSES]),
              "v": np.array([1 / cal.efficiencies[c]["bytes"] for c in OP_CLASSES]),
              "f": 1 / cal.fused_efficiency(), "o": cal.launch_overhead_s,
              "b": cal.buffer_overhead_s}
        starts = [dict(p0, **{k: (p0["u"][0] if k in ("conv", "grp", "dil") else 0.0)
                              for k in lev})]
        starts += [dict(starts[0], **{k: _INIT[k]}) for k in lev]
        p = min((_fit(dtr, s, lev) for s in starts), key=lambda x: x[1])[0]
        pred = _model(dte, p, lev)
    else:
        pred = np.array([predict(cal, ca.record_work(r, launch_model)) for r in te])
    err = np.abs(pred - dte.t) / dte.t
    big = dte.t > THRESHOLD_S
    if not big.any():
        return float("nan"), float("nan"), 0
    return float(np.median(err[big])), float(np.percentile(err[big], 90)), int(big.sum())


def _pad_record(r, feats, tile):
    k = (r["model"].lstrip("~"), r["small"], r["batch"])
    f = feats.get(k + (r["layer"],)) or feats.get(k + (r["layer"].split("/")[-1],), {})
    work = dict(r["work"])
    fb = dict(work["flops_by_class"])
    fb["matmul"] = fb.get("matmul", 0.0) * _padded_ratio(f, tile)
    work["flops_by_class"] = fb
    return dict(r, work=work)


# -- the study ---------------------------------------------------------------------


def _load(path, device=None):
    rs = json.loads((RESULTS / path).read_text())["records"]
    return [r for r in rs if device is None or r["device"] == device]


def device_sets():
    h100k = _load("cross_card/accuracy_gpu_h100_kernels.json")
    return {
        "H200 (per executable; no GPU kernel counts)":
            (_load("accuracy_h200_v2_kernels.json", "gpu:0"), "executable"),
        "H100, 10 models (per executable; no counts)":
            (_load("cross_card/accuracy_gpu_h100.json"), "executable"),
        "H100, 8 models with kernel counts (per kernel)": (h100k, "kernels"),
        "CPU, 16 cores (per kernel)":
            (_load("accuracy_h200_v2_kernels.json", "cpu:0"), "kernels"),
    }


CANDIDATES = [("baseline", (), None), ("conv", ("conv",), None), ("grp", ("grp",), None),
              ("dil", ("dil",), None), ("grp+dil", ("grp", "dil"), None),
              ("mmadd", ("mmadd",), None), ("mmkern", ("mmkern",), None),
              ("exec", ("exec",), None), ("eq", ("eq",), None), ("ovl", ("ovl",), None),
              ("tile 128x128x32", (), (128, 128, 32)),
              ("tile 128x128x32 + conv", ("conv",), (128, 128, 32)),
              ("conv+grp+dil+mmadd+mmkern", ("conv", "grp", "dil", "mmadd", "mmkern"), None)]


def main(argv):
    del argv
    sets = device_sets()
    feats = features([r for rs, _ in sets.values() for r in rs])
    train = ca.TRAIN_MODELS
    pct = "{:.1f}%".format
    lines = ["# Predictor levers on the fixed split (held-out layers above 100 us)", "",
             "Calibrated on " + ", ".join(train) + "; every other model held out. "
             "Cells: median / p90 APE.", "",
             "| lever | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    for name, lev, tile in CANDIDATES:
        cells = []
        for rs, lm in sets.values():
            m, p9, n = held_out(rs, lm, lev, train, feats, tile)
            cells.append(f"{pct(100 * m)} / {pct(100 * p9)} (n={n})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    rng = random.Random(0)
    lines += ["", f"## Robustness: {_SPLITS.value} random half splits of each set's models", "",
              "Median over splits of the held-out median APE; wins / losses against the "
              "baseline on the same split (by more than 0.5 points).", "",
              "| lever | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    splits = {k: [rng.sample(sorted({r["model"] for r in rs}), len({r["model"] for r in rs}) // 2)
                  for _ in range(_SPLITS.value)] for k, (rs, _) in sets.items()}
    base = {k: [held_out(rs, lm, (), tr, feats)[0] for tr in splits[k]]
            for k, (rs, lm) in sets.items()}
    for name, lev, tile in CANDIDATES[1:6]:
        cells = []
        for k, (rs, lm) in sets.items():
            v = np.array([held_out(rs, lm, lev, tr, feats, tile)[0] for tr in splits[k]])
            b = np.array(base[k])
            cells.append(f"{pct(100 * np.nanmedian(v))} (baseline {pct(100 * np.nanmedian(b))}), "
                         f"{int(np.nansum(v < b - 0.005))}/{int(np.nansum(v > b + 0.005))}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Capacity: fitted on every model, errors on the (not held-out) same layers",
              "", "| lever | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    for name, lev, tile in (CANDIDATES[0], CANDIDATES[1], CANDIDATES[-1]):
        cells = []
        for rs, lm in sets.values():
            everyone = sorted({r["model"] for r in rs})
            # Fitted on all: held_out's test set would be empty, so test on all too.
            m, p9, n = _in_sample(rs, lm, lev, everyone, feats, tile)
            cells.append(f"{pct(100 * m)} / {pct(100 * p9)}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    if _OUT.value:
        pathlib.Path(_OUT.value).write_text(text)
    print(text)


def _in_sample(records, launch_model, lev, models, feats, tile):
    dup = [dict(r, model="~" + r["model"]) for r in records]  # the same layers, "held out"
    return held_out(records + dup, launch_model, lev, models, feats, tile)


if __name__ == "__main__":
    app.run(main)
