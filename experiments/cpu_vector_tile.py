"""Does a CPU's vector width explain its layer model's worst misses? (issue 17, offline)

The host CPU's layer model misses held-out layers by 14-16% median and
41-42% p90 even with the drift between passes taken out
(results/cpu_timing). Among the worst: ResNet-18's 4-channel convolutions
(-46%). On the accelerators the model divides a GEMM's FLOPs by its useful
fraction of tiled work (`useful_fraction`); on a CPU that fraction (a GPU's
64x64x32 tiles over 132 units) had made things worse. This tries the CPU's
own tile: a GEMM's output columns (N: output channels, features) issued in
whole vectors of `lanes` f32 (AVX-512: 16), rows (M) in blocks of `rows`,
over the host's cores; and scores, for each tile, the fit on the first
interleaved pass against the held-out layers of the second, on both saved
runs of `probe_cpu_timing.py` (no device: re-traces the layers, ~2 min).

    python experiments/cpu_vector_tile.py [--runs results/cpu_timing/probe_cpu_timing.json ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))

from probe_cpu_timing import THR, _layers, work_and_equations  # noqa: E402

#: (M, N, K) tiles tried; None: the model as hetpar has it (no fraction on CPUs).
TILES = (None, (1, 8, 1), (1, 16, 1), (4, 16, 1), (8, 16, 1), (1, 32, 1), (8, 32, 1))
CORES = 16  # the H100 host's (the runs' `cpu_count`)


def score(items, works, eqs, fit_t, check_t, cpu_terms=None) -> dict:
    """hetpar's own fit (`fit_samples`, `with_layer_model`) on `fit_t`, scored
    on the held-out layers over 100 us of `check_t`; `cpu_terms(profile,
    eqs, work)`, where given, replaces the layer model's terms on a CPU
    (`cpu_threads.py` shares this)."""
    from hetpar.cost_models import _equation_model as em
    from hetpar.cost_models import fit_samples, predict_layer, spec, with_layer_model

    original = em._terms_of

    def terms_of(profile, e, work):
        if cpu_terms is None or profile.device_class != "cpu":
            return original(profile, e, work)
        return cpu_terms(profile, e, work)

    em._terms_of = terms_of
    try:
        base = spec("cpu").replace(name="cpu:0", origin="measured")
        samples = [(m, eqs[i], works[i], fit_t[i]) for i, (m, _, _, held, only) in
                   enumerate(items) if not held and not only]
        extra = [(m, eqs[i], works[i], fit_t[i]) for i, (m, _, _, held, only) in
                 enumerate(items) if only]
        fitted = fit_samples(base, [(w, t) for _, _, w, t in samples])
        chosen = with_layer_model(base, fitted, samples, extra=extra)
        rows = [(items[i][0], items[i][2], predict_layer(chosen, works[i], eqs[i]) / check_t[i] - 1)
                for i, it in enumerate(items) if it[3] and check_t[i] > THR]
    finally:
        em._terms_of = original
    e = np.abs([r for *_, r in rows])
    worst = sorted(rows, key=lambda r: -abs(r[2]))[:4]
    return {"model": chosen.sources.get("layer_model", "none"), "n": int(e.size),
            "median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
            "worst": [f"{m}/{la} {r:+.0%}" for m, la, r in worst]}


def tile_terms(tile):
    """The layer model's terms on a CPU with its GEMMs in `tile`s over `CORES`."""
    from hetpar.cost_models import _equation_model as em

    def terms(profile, e, work):
        return em.terms(e, work, peak=profile.peak("f32", "matmul"),
                        bandwidth=profile.memory_bandwidth_bytes_per_s, units=CORES,
                        cpu=False, tile=tile)

    return None if tile is None else terms


def gemm_terms(seconds):
    """The layer model's terms on a CPU with each matmul equation's FLOPs
    term priced by `seconds(equation, peak)` (one run of it) instead of its
    FLOPs at the peak (`cpu_threads.py`, `cpu_power.py`)."""
    from hetpar.cost_models import _equation_model as em

    def terms(profile, eqs, work):
        peak = profile.peak("f32", "matmul")
        out = em.terms(eqs, work, peak=peak, bandwidth=profile.memory_bandwidth_bytes_per_s,
                       units=CORES, cpu=True)
        for c in em.MATMUL_CLASSES:
            out["flops_" + c] = 0.0
        for e in eqs:
            out["flops_" + e.cls] += e.reps * seconds(e, peak)
        return out

    return terms


def held_out_layers():
    """The fit models' and held-out models' layers (`probe_cpu_timing._layers`),
    re-traced here, with their work and matmul equations on a CPU."""
    from check_fitted_profile import HELD_OUT

    from hetpar.cli._profile import FIT_MODELS
    from hetpar.cost_models import resolve_device

    items = _layers(resolve_device("cpu:0"), [m for m in FIT_MODELS if m != "sweep"],
                    list(HELD_OUT))
    works, eqs = work_and_equations(items, "cpu")
    return items, works, eqs


def parse_runs(argv, doc: str):
    """`--runs` (the saved `probe_cpu_timing.py` runs; default: the H100 host's
    two) and `--out` of the offline CPU scripts."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=[
        str(HERE / "results/cpu_timing/probe_cpu_timing.json"),
        str(HERE / "results/cpu_timing/probe_cpu_timing_run2.json")])
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def pass_times(path, items, fit: str, check: str) -> tuple[list, list]:
    """Each item's time in the run's `fit` pass and in its `check` pass."""
    rows = json.loads(pathlib.Path(path).read_text())["rows"]
    by = {(r["model"], r["layer"]): r for r in rows}
    return ([by[(m, la)][fit] for m, _, la, *_ in items],
            [by[(m, la)][check] for m, _, la, *_ in items])


def score_both_ways(argv, doc: str, variants) -> int:
    """Scores each `(label, cpu_terms)` of `variants` on every run of
    `--runs`, fitted on one interleaved pass and checked on the other, both
    ways; prints a line each and writes them all to `--out` (JSON). The
    offline scripts that try a term of their own (`cpu_threads.py`,
    `cpu_power.py`) share this."""
    args = parse_runs(argv, doc)
    items, works, eqs = held_out_layers()
    out = {}
    for path in args.runs:
        run = f"{pathlib.Path(path).parent.name}/{pathlib.Path(path).stem}"
        for fit, check in (("B1_interleaved", "B2_interleaved"),
                           ("B2_interleaved", "B1_interleaved")):
            fit_t, check_t = pass_times(path, items, fit, check)
            for label, terms in variants:
                s = score(items, works, eqs, fit_t, check_t, terms)
                key = f"{run} fit {fit[:2]} {label}"
                out[key] = s
                print(f"{key:72s} n={s['n']} median {s['median']:.1%} "
                      f"p90 {s['p90']:.1%}  {', '.join(s['worst'])}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    args = parse_runs(argv, __doc__)
    items, works, eqs = held_out_layers()
    out = {}
    for path in args.runs:
        fit_t, check_t = pass_times(path, items, "B1_interleaved", "B2_interleaved")
        for tile in TILES:
            s = score(items, works, eqs, fit_t, check_t, tile_terms(tile))
            out[f"{pathlib.Path(path).stem} {tile}"] = s
            print(f"{pathlib.Path(path).stem:26s} tile {str(tile):12s} {s['model']:8s} "
                  f"n={s['n']} median {s['median']:.1%} p90 {s['p90']:.1%}  "
                  f"{', '.join(s['worst'])}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
