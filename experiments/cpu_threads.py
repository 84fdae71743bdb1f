"""Does how a CPU threads a GEMM explain its layer model's misses? (issue 17, offline)

The host CPU's layer model misses held-out layers by 14-16% median and
41-44% p90 on interleaved timings that repeat to 2-5% (results/cpu_timing),
and its in-sample capacity is 12-16%: its terms are linear in each class's
FLOPs, so a GEMM's time per FLOP is the same at every size. XLA's CPU
backend does not run a GEMM that way: it splits one over its thread pool in
blocks of some minimum work, so a small GEMM runs on one core (16x the
time per FLOP of a large one on the H100 host's 16), and one of a few
blocks on a few: time per FLOP falls with size until every core is busy.
This tries that as the GEMM's useful fraction on a CPU,

    u_e = min(cores, ceil(flops_e / grain)) / cores

for grains over four decades, and scores, for each, the fit on the first
interleaved pass against the held-out layers of the second, on the saved
runs of `probe_cpu_timing.py` (no device: re-traces the layers), as
`cpu_vector_tile.py` does for a vector tile.

    python experiments/cpu_threads.py [--runs results/cpu_timing/probe_cpu_timing.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

from probe_cpu_timing import THR, _layers, work_and_equations  # noqa: E402

#: FLOPs one thread of the pool takes at least; None: the model as hetpar has it.
GRAINS = (None, 1e4, 3e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8)
CORES = 16  # the hosts' (the runs' `cpu_count`)


def threaded_terms(em, eqs, work, *, peak, bandwidth, grain):
    """`em.terms` with each GEMM's FLOPs over its busy share of the cores."""
    out = em.terms(eqs, work, peak=peak, bandwidth=bandwidth, units=CORES, cpu=True)
    for c in em.MATMUL_CLASSES:
        out["flops_" + c] = 0.0
    for e in eqs:
        u = min(CORES, math.ceil(e.flops / grain)) / CORES
        out["flops_" + e.cls] += e.reps * e.flops / u / peak
    return out


def _score(items, works, eqs, fit_t, check_t, grain):
    from hetpar.cost_models import _equation_model as em
    from hetpar.cost_models import fit_samples, predict_layer, spec, with_layer_model

    original = em._terms_of

    def threaded(profile, e, work):
        if grain is None or profile.device_class != "cpu":
            return original(profile, e, work)
        return threaded_terms(em, e, work, peak=profile.peak("f32", "matmul"),
                              bandwidth=profile.memory_bandwidth_bytes_per_s, grain=grain)

    em._terms_of = threaded
    try:
        base = spec("cpu").replace(name="cpu:0", origin="measured")
        samples = [(m, eqs[i], works[i], fit_t[i]) for i, (m, _, _, held, only) in
                   enumerate(items) if not held and not only]
        extra = [(m, eqs[i], works[i], fit_t[i]) for i, (m, _, _, held, only) in
                 enumerate(items) if only]
        fitted = fit_samples(base, [(w, t) for _, _, w, t in samples])
        chosen = with_layer_model(base, fitted, samples, extra=extra)
        rows = [(items[i][0], items[i][2],
                 predict_layer(chosen, works[i], eqs[i]) / check_t[i] - 1)
                for i, it in enumerate(items) if it[3] and check_t[i] > THR]
    finally:
        em._terms_of = original
    e = np.abs([r for *_, r in rows])
    worst = sorted(rows, key=lambda r: -abs(r[2]))[:4]
    return {"model": chosen.sources.get("layer_model", "none"), "n": int(e.size),
            "median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
            "worst": [f"{m}/{la} {r:+.0%}" for m, la, r in worst]}


def main(argv=None) -> int:
    from check_fitted_profile import HELD_OUT

    from hetpar.cli._profile import FIT_MODELS
    from hetpar.cost_models import resolve_device

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=[
        str(HERE / "results/cpu_timing/probe_cpu_timing.json"),
        str(HERE / "results/cpu_timing/probe_cpu_timing_run2.json")])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = resolve_device("cpu:0")
    items = _layers(dev, [m for m in FIT_MODELS if m != "sweep"], list(HELD_OUT))
    works, eqs = work_and_equations(items, "cpu")
    out = {}
    for path in args.runs:
        rows = json.loads(pathlib.Path(path).read_text())["rows"]
        by = {(r["model"], r["layer"]): r for r in rows}
        for fit, check in (("B1_interleaved", "B2_interleaved"),
                           ("B2_interleaved", "B1_interleaved")):
            fit_t = [by[(m, la)][fit] for m, _, la, *_ in items]
            check_t = [by[(m, la)][check] for m, _, la, *_ in items]
            for grain in GRAINS:
                s = _score(items, works, eqs, fit_t, check_t, grain)
                run = f"{pathlib.Path(path).parent.name}/{pathlib.Path(path).stem}"
                key = f"{run} fit {fit[:2]} grain {grain}"
                out[key] = s
                print(f"{key:66s} n={s['n']} median {s['median']:.1%} "
                      f"p90 {s['p90']:.1%}  {', '.join(s['worst'])}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
