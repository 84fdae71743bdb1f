"""Planner benchmark: solve times, gap against exhaustive search, ILP vs baselines.

Writes experiments/results/planner_bench.{json,md}. Run:
  python experiments/bench_planner.py [--seeds 3] [--time_limit 30]

The instances are `tests/random_tables.py`'s seeded random DAGs. Solve times
are the bare placement ILP's (`hetpar.planner._ilp.solve`: model build +
solve, no feasibility diagnosis, baselines or schedule replay), which is what
this benchmark measures; everything else goes through the public API.
"""

import dataclasses
import json
import os
import platform
import statistics
import sys
import time

from absl import app, flags, logging

from hetpar.core import CostTable
from hetpar.planner import Arrays, _ilp, exhaustive, highs_available, plan

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.random_tables import random_cost_table  # noqa: E402  (the repository root, above)

_SEEDS = flags.DEFINE_integer("seeds", 3, "random graphs per timing point")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 30.0, "solver time limit per solve, seconds")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results"),
                           "results folder")

TIMINGS = [  # layers, devices, mode, target median seconds
    (200, 3, "sequential", 1.0), (1000, 4, "sequential", 10.0), (200, 3, "pipelined", 10.0)]


_ZOO_ONLY = flags.DEFINE_bool("zoo_only", False, "only (re)run the zoo comparison, keeping the "
                               "random-graph results already in the output file")


def solve_times(layers: int, devices: int, *, mode: str = "sequential", memory: str = "loose",
                solver: str = "cbc", seeds: int = 3, microbatches: int = 8,
                time_limit: float = 30.0, gap: float | None = None) -> dict:
    """Median wall time (model build + solve) over seeded random DAGs."""
    rows = []
    for seed in range(seeds):
        arr = Arrays(random_cost_table(seed, layers, devices, memory=memory))
        t0 = time.perf_counter()
        sol = _ilp.solve(arr, mode=mode, microbatches=microbatches, solver=solver,
                         time_limit=time_limit, gap=gap)
        rows.append({"seed": seed, "total_s": time.perf_counter() - t0,
                     "solve_s": sol.solve_time_s, "build_s": sol.build_time_s,
                     "status": sol.status, "gap": sol.gap, "variables": sol.variables})
        logging.info("%dx%d %s %s %s: %s", layers, devices, mode, memory, solver, rows[-1])
    return {"layers": layers, "devices": devices, "mode": mode, "memory": memory,
            "solver": solver, "time_limit_s": time_limit, "gap_option": gap or _ilp.DEFAULT_GAP,
            "median_s": statistics.median(r["total_s"] for r in rows),
            "max_s": max(r["total_s"] for r in rows),
            "statuses": [r["status"] for r in rows],
            "gaps": [r["gap"] for r in rows], "runs": rows}


def gap_vs_exhaustive(seeds: int = 20, layers: int = 10, devices: int = 3) -> dict:
    """Largest relative gap between the ILP (default options) and exhaustive search."""
    worst = 0.0
    n = 0
    for seed in range(seeds):
        for memory in ("loose", "tight"):
            for shape in ("chain", "dag"):
                table = random_cost_table(seed, layers, devices, shape=shape, memory=memory,
                                          missing_links=seed % 2 == 1)
                try:
                    p = plan(table, baselines=False)
                except Exception as e:  # infeasible instances have no gap to measure
                    logging.info("seed %d skipped: %s", seed, e)
                    continue
                oracle = exhaustive(table).predicted.step_time_s
                worst = max(worst, (p.predicted.step_time_s - oracle) / oracle)
                n += 1
    return {"instances": n, "layers": layers, "devices": devices, "max_rel_gap": worst}


def versus_baselines(tables: list[CostTable], *, objective: str = "time",
                     mode: str = "sequential", microbatches: int = 1) -> list[dict]:
    """The ILP's objective and every baseline's, as a ratio to the ILP, per table."""
    out = []
    for table in tables:
        p = plan(table, objective=objective, mode=mode, microbatches=microbatches,
                 time_limit=60)
        mine = p.predicted.objective(objective)
        row = {"graph": table.meta.get("model", table.meta.get("source", table.fingerprint())),
               "layers": len(table.layers), "devices": list(table.device_names),
               "ilp": mine, "status": p.solver["status"]}
        for name, r in p.baselines.items():
            row[name] = None if r.predicted is None else r.predicted.objective(objective) / mine
        out.append(row)
    return out


def random_tables(seeds: int = 5, layers: int = 60, devices: int = 3) -> list[CostTable]:
    """Random DAGs for the baseline comparison: loose and tight memory."""
    return [random_cost_table(s, layers, devices, memory=m) for s in range(seeds)
            for m in ("loose", "tight")]


def zoo_tables():
    """The zoo's train steps at their published sizes, priced from spec sheets.

    Devices: a generic 16-core server CPU, an H100 and a TPU v5e (spec-sheet
    kinds: nothing needs to be present). Layers are depth-1 modules.
    """
    from hetpar import zoo

    return [dataclasses.replace(table, meta={**table.meta, "model": name})
            for name in zoo.names()
            for table in [zoo.cost_table(name, ["cpu", "h100", "tpu-v5e"])]]


def main(argv):
    del argv
    path = os.path.join(_OUT.value, "planner_bench.json")
    if _ZOO_ONLY.value:
        with open(path) as f:
            results = json.load(f)
    else:
        solvers = ["cbc"] + (["highs"] if highs_available() else [])
        timings = []
        for layers, devices, mode, target in TIMINGS:
            for memory in ("loose", "one_tight", "tight"):
                for solver in solvers:
                    r = solve_times(layers, devices, mode=mode, memory=memory, solver=solver,
                                    seeds=_SEEDS.value, time_limit=_TIME_LIMIT.value)
                    timings.append({**r, "target_s": target})
        results = {
            "machine": f"{os.cpu_count()}-core CPU dev box "
                       f"({platform.processor() or platform.machine()}, "
                       f"Python {platform.python_version()})",
            "timings": timings,
            "gap_vs_exhaustive": gap_vs_exhaustive(),
            "random_vs_baselines": versus_baselines(random_tables()),
        }
    results["zoo_vs_baselines"] = versus_baselines(zoo_tables())
    os.makedirs(_OUT.value, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(_OUT.value, "planner_bench.md"), "w") as f:
        f.write(render(results))


def render(r) -> str:
    lines = ["# Planner benchmark", "", f"Machine: {r['machine']}.", "",
             "Random DAGs (chain + skip edges) from `random_cost_table`; *loose*: every device "
             "holds the model, *one_tight*: the first accelerator holds 25-45% of it, the other "
             "devices all of it (docs/architecture/planner.md's 'tight GPU memory limit' "
             "instance), "
             "*tight*: each accelerator holds 25-45% of it. Time = model build "
             f"+ solve, median over seeds; solver time limit {r['timings'][0]['time_limit_s']} s, "
             f"relative gap option {r['timings'][0]['gap_option']}.", "",
             "| layers x devices | mode | memory | solver | median s | max s | target s | "
             "statuses | final gaps |", "|---|---|---|---|---|---|---|---|---|"]
    for t in r["timings"]:
        gaps = ", ".join("-" if g is None else f"{g:.2g}" for g in t["gaps"])
        # Runs that reached the time limit were stopped, whatever status they report.
        stopped = sum(run["solve_s"] >= t["time_limit_s"] for run in t["runs"])
        if stopped:
            gaps += f" ({stopped} stopped at the time limit)"
        lines.append(f"| {t['layers']}x{t['devices']} | {t['mode']} | {t['memory']} | "
                     f"{t['solver']} | {t['median_s']:.2f} | {t['max_s']:.2f} | {t['target_s']} | "
                     f"{', '.join(t['statuses'])} | {gaps} |")
    g = r["gap_vs_exhaustive"]
    lines += ["", f"Gap against exhaustive search: max relative gap {g['max_rel_gap']:.2e} over "
              f"{g['instances']} instances of {g['layers']} layers x {g['devices']} devices "
              "(default options).", ""]
    for title, rows in (("Random graphs", r["random_vs_baselines"]),
                        ("Zoo graphs", r["zoo_vs_baselines"])):
        lines.append(f"## {title}: baselines' step time / ILP's (sequential, objective time)")
        if not rows:
            lines += ["", "Not run yet (needs the cost models).", ""]
            continue
        names = [k for k in rows[0] if k not in ("graph", "layers", "devices", "ilp", "status")]
        lines += ["", "| graph | ILP s | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for row in rows:
            cells = ["n/a" if row[n] is None else f"{row[n]:.3f}" for n in names]
            lines.append(f"| {row['graph']} | {row['ilp']:.4g} | " + " | ".join(cells) + " |")
        lines += ["", "n/a: the baseline has no plan here (a device too small for the model, or "
                  "exhaustive search, which is refused above 12 layers).", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
