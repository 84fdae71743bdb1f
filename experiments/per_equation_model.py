"""Per-equation layer-time models against the calibrated roofline (issue 17, deliverable 2).

Offline, no device: the saved layer records of `results/accuracy_v3.json`
(H200 gpu:0 and the 16-core host CPU) and `results/cross_card/accuracy_v3_h100.json`
(H100), and each zoo layer's equations re-traced here (~30 s on a CPU;
cached under `hetpar.cost_models.cache_dir()`).

The roofline prices a layer as one (FLOPs, bytes) pair. Here every
matmul-like equation of the layer (forward, backward and update; a scan's
body once per trip) is priced by its class, `dot` (dot_general), `conv`
(forward and data-gradient convolutions), `wgrad` (weight-gradient
convolutions: output smaller than the kernel operand) and `dw`
(grouped/depthwise), plus the layer's non-matmul traffic after fusion:

    t = c0 + b buffers [+ k kernels, CPU] + sum_c (a_c sum_e f_e / (P u_e) + kappa_c n_c)
        + gamma nonmatmul_fused_bytes / BW

with every coefficient >= 0, fitted by non-negative least squares on the
relative error, then refined in log space (soft L1). `u_e` is 1 (M1) or the
useful fraction of a tiled GEMM's issued work (M2 on: tile padding x the
idle units of the last wave, tiles of 64x64x32 or 128x128x32 over 132 SMs
or 16 cores, optionally split along K). P and BW (spec peak and bandwidth)
only set units. A class absent from the calibration models borrows its
parent's coefficients (wgrad, dw -> conv -> dot). Input-dilated convolutions
whose kernel is not reversed (cyclegan's ConvTranspose; not cuDNN's
backward-data pattern) count their FLOPs over the zero-stuffed input.

The split is fixed (`cost_accuracy.TRAIN_MODELS`); also reported: leave one
calibration model out (model selection within the train models) and 8
random half splits of the models (robustness).

    python experiments/per_equation_model.py [--out results/per_equation_model.md]
"""

import json
import math
import pathlib
import sys

import numpy as np
from scipy.optimize import least_squares, nnls

HERE = pathlib.Path(__file__).parent
RES = HERE / "results"
sys.path.insert(0, str(HERE))


def _cache_file() -> pathlib.Path:
    from hetpar.cost_models import cache_dir

    return cache_dir() / "per_equation_features.json"


TRAIN = ("alexnet", "conv6", "lm_embed", "mobilenet_v1", "resnet50", "transformer")  # fixed
THR = 100e-6
# Scales only (the fit absorbs them): f32 TF32 peak and HBM bandwidth from hetpar's specs.
P = {"H200": 494.7e12, "H100": 494.7e12, "CPU": 3.69e12}
BW = {"H200": 4.8e12, "H100": 3.35e12, "CPU": 307.2e9}
PAR = {"H200": 132, "H100": 132, "CPU": 16}   # SMs / cores: tiles that run at once
MMC = ("dot", "conv", "wgrad", "dw", "tr")

# ---------------------------------------------------------------- per-equation features


def _walk(eqns, times, in_loop, rows):
    import _prim_features as pf

    from hetpar.passes import eqn_work

    for e, reps, looped, prod in pf.leaf_equations(eqns, times, in_loop):
        name = e.primitive.name
        w = eqn_work(e)
        ex = {"prim": name, "loop": looped}
        if name == "dot_general":
            lhs, rhs = (v.aval.shape for v in e.invars[:2])
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
            ex.update(b=math.prod(lhs[d] for d in lb), k=math.prod(lhs[d] for d in lc),
                      m=math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb),
                      n=math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb))
        elif name == "conv_general_dilated":
            p, dn = e.params, e.params["dimension_numbers"]
            lhs, rhs = (v.aval.shape for v in e.invars[:2])
            out = e.outvars[0].aval.shape
            ex.update(groups=p["feature_group_count"] * p["batch_group_count"],
                      lhs_dil=list(p.get("lhs_dilation") or ()),
                      m=out[dn.out_spec[0]] * math.prod(out[d] for d in dn.out_spec[2:]),
                      n=rhs[dn.rhs_spec[0]] // max(1, p["feature_group_count"]),
                      k=rhs[dn.rhs_spec[1]] * math.prod(rhs[d] for d in dn.rhs_spec[2:]),
                      ksp=math.prod(rhs[d] for d in dn.rhs_spec[2:]),
                      osp=math.prod(out[d] for d in dn.out_spec[2:]),
                      rhs_rev=prod.get(id(e.invars[1])) == "rev")
        rows.append([pf.group_of(e), reps, float(w.flops + w.transcendentals),
                     float(w.bytes_accessed), float(w.transcendentals), ex])


def equation_rows(graph, layer: str) -> list:
    """One traced layer's matmul-like and other equations, as `columns` prices them."""
    rows = []
    _walk([graph.program.eqns[i] for i in graph[layer].eqns], 1, False, rows)
    return rows


#: The device labels of P, BW and PAR by a record's spec-sheet kind.
LABEL = {"h200": "H200", "h100": "H100", "cpu": "CPU"}


def eq_features(records):
    cache = _cache_file()
    have = json.loads(cache.read_text()) if cache.exists() else {}
    done = {(m, bool(int(small)), int(batch))
            for m, small, batch, _ in (k.split("|", 3) for k in have)}
    todo = sorted({(r["model"], bool(r["small"]), r["batch"]) for r in records} - done)
    if todo:
        from hetpar.zoo import trace_model
        for model, small, batch in todo:
            _, g = trace_model(model, small=small, batch=batch)
            for name in g.layers:
                have[f"{model}|{int(small)}|{batch}|{name}"] = equation_rows(g, name)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(have))
    return have


def key(r):
    return f"{r['model']}|{int(r['small'])}|{r['batch']}|{r['layer']}"


def mm_class(g, ex, transposed=False):
    if g == "dot":
        return "dot"
    if g == "conv_dw":
        return "dw"
    if transposed and g == "conv_tr" and not ex.get("rhs_rev"):
        # input-dilated without a reversed kernel (a ConvTranspose's forward and its
        # kernel gradient): the layer sweep's transposed layers, fitted as
        # "conv"/"wgrad", ran 4-14x slower than fitted (H100)
        return "tr"
    if ex["osp"] < ex["ksp"]:
        return "wgrad"  # output kernel-shaped, reduction over the activations
    return "conv"       # forward and data-gradient (input-dilated) convolutions


def util(m, n, k, par, tm=64, tn=64, tk=32, splitk=False):
    """Useful fraction of a tiled GEMM's issued work: tile padding x last-wave idle units."""
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    if splitk and tiles < par:  # reduction split across units until the machine is full
        tiles *= max(1, min(par // tiles, math.ceil(k / (8 * tk))))
    pad = m * n * k / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn * math.ceil(k / tk) * tk)
    return pad * tiles / (math.ceil(tiles / par) * par)


def columns(r, eqf, dev, spec):
    rows = eqf.get(key(r))
    if rows is None:
        return None
    w = r["work"]
    ub = w["bytes_by_class"]
    utot = sum(ub.values()) or 1.0
    fb = w.get("fused_bytes")
    fb = max(fb, w.get("io_bytes", 0.0)) if fb is not None else utot
    cols = {"c0": 1.0, "buf": float(w.get("buffers", 0))}
    if dev == "CPU":
        cols["kern"] = float(r.get("kernels") or 1)
    for c in MMC:
        cols["f_" + c] = 0.0
        cols["n_" + c] = 0.0
    for g, times, f, _bytes, _, ex in rows:
        if g not in ("dot", "conv", "conv_dw", "conv_tr"):
            continue
        c = mm_class(g, ex, spec.get("transposed", False))
        if g == "conv_tr" and not ex.get("rhs_rev"):
            # input-dilated without a reversed kernel: not cuDNN's backward-data pattern,
            # run densely over the zero-stuffed input (cyclegan's ConvTranspose)
            f *= math.prod(ex["lhs_dil"])
        u = 1.0
        if spec.get("util") and c != "dw":
            m = ex["m"] * (ex.get("b", 1) if c == "dot" else 1)
            split = spec.get("splitk") == "all" or (spec.get("splitk") == "wgrad"
                                                     and c == "wgrad")
            u = util(m, ex["n"], ex["k"], PAR[dev], *spec["util"], splitk=split)
        cols["f_" + c] += times * f / u / P[dev]
        cols["n_" + c] += times
    # non-matmul traffic after fusion (share of XLA's bytes by unfused share)
    cols["mem"] = fb * (1 - ub.get("matmul", 0.0) / utot) / BW[dev]
    return cols


FALLBACK = {"wgrad": "conv", "dw": "conv", "conv": "dot", "dot": "conv", "tr": "conv"}


def fit(X, t, names, loss):
    A = X / t[:, None]
    s = np.linalg.norm(A, axis=0)
    s[s == 0] = 1.0
    z, _ = nnls(A / s, np.ones(len(t)), maxiter=100 * X.shape[1])
    x = z / s
    if loss == "log":
        colmax = X.max(axis=0)
        act = colmax > 0
        sc = np.where(x > 0, x, np.where(act, 1e-3 * np.median(t) / np.where(act, colmax, 1), 1.0))
        sol = least_squares(lambda u: np.log(np.maximum(X @ (u * sc), 1e-12)) - np.log(t),
                            np.where(x > 0, 1.0, 1e-3), bounds=(0, np.inf), loss="soft_l1",
                            f_scale=0.1, x_scale="jac", max_nfev=5000)
        x = sol.x * sc
    for i, n in enumerate(names):  # a class absent from calibration borrows its parent's
        if not np.any(X[:, i] > 0) and "_" in n:
            p = n.split("_")[0] + "_" + FALLBACK.get(n.split("_", 1)[1], "conv")
            if p in names and np.any(X[:, names.index(p)] > 0):
                x[i] = x[names.index(p)]
    return x


def design(recs, eqf, dev, spec):
    cs = [columns(r, eqf, dev, spec) for r in recs]
    names = list(cs[0])
    return (np.array([[c[n] for n in names] for c in cs]),
            np.array([r["measured_s"] for r in recs]), names)


def run_model(recs, eqf, dev, spec, train, test_models=None):
    known = [r for r in recs if key(r) in eqf]
    tr = [r for r in known if r["model"] in train]
    te = [r for r in known if r["model"] not in train and r["measured_s"] > THR
          and (test_models is None or r["model"] in test_models)]
    X, t, names = design(tr, eqf, dev, spec)
    x = fit(X, t, names, spec.get("loss", "log"))
    if not te:
        return np.zeros(0), np.zeros(0), te, dict(zip(names, x))
    Xe, tt, _ = design(te, eqf, dev, spec)
    pred = Xe @ x
    return np.abs(pred - tt) / tt, pred, te, dict(zip(names, x))


def baseline(recs, launch_model, train, test):
    import cost_accuracy as ca

    from hetpar.cost_models import predict
    prof = ca.fit_layers(ca._base_profiles(recs)[recs[0]["device"]],
                         [r for r in recs if r["model"] in train], launch_model=launch_model)
    pred = np.array([predict(prof, ca.record_work(r, launch_model)) for r in test])
    t = np.array([r["measured_s"] for r in test])
    return np.abs(pred - t) / t, pred


def stats(e):
    e = np.asarray(e)
    if not e.size:
        return (np.nan, np.nan, 0)
    return (float(np.median(e)), float(np.percentile(e, 90)), int(e.size))


def pct(s, n=True):
    return f"{100*s[0]:.1f}% / {100*s[1]:.1f}%" + (f" (n={s[2]})" if n else "")


def splits(models, n=8, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.choice(sorted(models), len(models) // 2, replace=False)) for _ in range(n)]


MODELS = {
    "M1 per-eq classes": dict(),
    "M2 per-eq classes + tile/wave util": dict(util=(64, 64, 32)),
    "M3 = M2, linear rel-error fit": dict(util=(64, 64, 32), loss="rel"),
    "M2' util 128x128x32 tiles": dict(util=(128, 128, 32)),
    "M4 = M2 + split-K for wgrad": dict(util=(64, 64, 32), splitk="wgrad"),
    "M5 = M2 + split-K for all": dict(util=(64, 64, 32), splitk="all"),
    "M4' 128 tiles + split-K wgrad": dict(util=(128, 128, 32), splitk="wgrad"),
}


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the report here (markdown)")
    out = ap.parse_args().out
    v3 = json.loads((RES / "accuracy_v3.json").read_text())["records"]
    h100 = json.loads((RES / "cross_card/accuracy_v3_h100.json").read_text())["records"]
    S = {"H200": ([r for r in v3 if r["device"] == "gpu:0"], "executable"),
         "H100": (h100, "executable"),
         "CPU": ([r for r in v3 if r["device"] == "cpu:0"], "kernels")}
    eqf = eq_features(v3 + h100)
    L = ["# Per-equation layer-time models (issue 17, deliverable 2), held-out layers > 100 us", "",
         "Fixed split: calibrated on " + ", ".join(TRAIN) + " (H100 file: no resnet50). "
         "Cells: median / p90 APE (n).", "",
         "| model | " + " | ".join(S) + " |", "|---" * (len(S) + 1) + "|"]
    cells, cells2 = [], []
    for rs, lm in S.values():
        te = [r for r in rs if r["model"] not in TRAIN and r["measured_s"] > THR]
        e, _ = baseline(rs, lm, TRAIN, te)
        cells.append(pct(stats(e)))
        kn = np.array([key(r) in eqf for r in te])
        cells2.append(pct(stats(e[kn])))
    L.append("| baseline roofline (cost_accuracy fit), whole file | " + " | ".join(cells) + " |")
    L.append("| baseline roofline, same layers as below | " + " | ".join(cells2) + " |")
    fixed = {}
    for nm, sp in MODELS.items():
        cells = []
        for dev, (rs, _) in S.items():
            e, pred, te, coef = run_model(rs, eqf, dev, sp, TRAIN)
            fixed[(nm, dev)] = (e, pred, te, coef)
            cells.append(pct(stats(e)))
        L.append(f"| {nm} | " + " | ".join(cells) + " |")

    L += ["", "## Inner leave-one-calibration-model-out (train models only; model selection)", "",
          "| model | " + " | ".join(S) + " |", "|---" * (len(S) + 1) + "|"]
    for nm, sp in [("baseline", None)] + list(MODELS.items()):
        cells = []
        for dev, (rs, lm) in S.items():
            ms = sorted({r["model"] for r in rs if r["model"] in TRAIN and key(r) in eqf})
            es = []
            for m in ms:
                tr = [x for x in ms if x != m]
                sub = [r for r in rs if r["model"] in ms]
                if sp is None:
                    te = [r for r in sub
                          if r["model"] == m and r["measured_s"] > THR and key(r) in eqf]
                    if te:
                        es.append(baseline(sub, lm, tr, te)[0])
                else:
                    es.append(run_model(sub, eqf, dev, sp, tr)[0])
            cells.append(pct(stats(np.concatenate(es))))
        L.append(f"| {nm} | " + " | ".join(cells) + " |")

    L += ["", "## Robustness: 8 random half splits of each set's models (seed 0)", "",
          "Median over splits of held-out median / p90; wins/losses of the median vs the "
          "baseline on the same split and layers (> 0.5 points).", "",
          "| model | " + " | ".join(S) + " |", "|---" * (len(S) + 1) + "|"]
    base_sp, rows = {}, {nm: [] for nm in MODELS}
    for dev, (rs, lm) in S.items():
        ms = sorted({r["model"] for r in rs if key(r) in eqf})
        sps = splits(ms)
        b = []
        for tr in sps:
            te = [r for r in rs if r["model"] not in tr and r["measured_s"] > THR and key(r) in eqf]
            b.append(stats(baseline(rs, lm, tr, te)[0]))
        base_sp[dev] = b
        for nm, sp in MODELS.items():
            o = [stats(run_model(rs, eqf, dev, sp, tr)[0]) for tr in sps]
            bm, om = np.array([x[0] for x in b]), np.array([x[0] for x in o])
            rows[nm].append(f"{100*np.median(om):.1f}% / {100*np.median([x[1] for x in o]):.1f}%, "
                            f"{int(np.sum(om < bm - .005))}/{int(np.sum(om > bm + .005))}")
    L.append("| baseline | " + " | ".join(
        f"{100 * np.median([x[0] for x in base_sp[d]]):.1f}% / "
        f"{100 * np.median([x[1] for x in base_sp[d]]):.1f}%"
        for d in S) + " |")
    for nm in MODELS:
        L.append(f"| {nm} | " + " | ".join(rows[nm]) + " |")

    for nm in ("M2 per-eq classes + tile/wave util",):
        L += ["", f"## {nm}: per held-out model (fixed split), coefficients, worst layers", ""]
        for dev in S:
            e, pred, te, coef = fixed[(nm, dev)]
            per = {}
            for i, r in enumerate(te):
                per.setdefault(r["model"], []).append(e[i])
            L.append(f"**{dev}**: " + ", ".join(f"{m} {100*np.median(v):.0f}% (n={len(v)})"
                                              for m, v in sorted(per.items())))
            L.append("")
            L.append("coefficients: " + ", ".join(f"{k} {v:.3g}" for k, v in coef.items()))
            L.append("")
            o = np.argsort(-e)[:8]
            L.append("worst: " + "; ".join(
                f"{te[i]['model']}/{te[i]['layer']} {pred[i] / te[i]['measured_s']:.2f}x"
                f" of {1e6 * te[i]['measured_s']:.0f} us" for i in o))
            L.append("")
    text = "\n".join(L) + "\n"
    print(text)
    if out:
        pathlib.Path(out).write_text(text)


if __name__ == "__main__":
    main()
