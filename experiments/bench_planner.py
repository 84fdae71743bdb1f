"""Planner benchmark: solve times, gap against exhaustive search, ILP vs baselines.

Writes experiments/results/planner_bench.{json,md}. Run:
  python experiments/bench_planner.py [--seeds 3] [--time_limit 30]
"""

import dataclasses
import json
import os
import platform

from absl import app, flags

from hetpar.planner import _bench, highs_available

_SEEDS = flags.DEFINE_integer("seeds", 3, "random graphs per timing point")
_TIME_LIMIT = flags.DEFINE_float("time_limit", 30.0, "solver time limit per solve, seconds")
_OUT = flags.DEFINE_string("out", os.path.join(os.path.dirname(__file__), "results"),
                           "results folder")

TIMINGS = [  # layers, devices, mode, target median seconds
    (200, 3, "sequential", 1.0), (1000, 4, "sequential", 10.0), (200, 3, "pipelined", 10.0)]


_ZOO_ONLY = flags.DEFINE_bool("zoo_only", False, "only (re)run the zoo comparison, keeping the "
                               "random-graph results already in the output file")


_ONE_TIGHT_ONLY = flags.DEFINE_bool(
    "one_tight_only", False, "only add the one-tight-accelerator timing rows (docs/architecture.md's "
    "instance) to the results already in the output file")


def zoo_tables():
    """The zoo's train steps at their published sizes, priced from spec sheets.

    Devices: a generic 16-core server CPU, an H100 and a TPU v5e (spec-sheet
    kinds: nothing needs to be present). Layers are depth-1 modules.
    """
    from hetpar import zoo
    from hetpar.cost_models import cost_table_for_model

    tables = []
    for name in zoo.names():
        table = cost_table_for_model(name, ["cpu", "h100", "tpu-v5e"])
        tables.append(dataclasses.replace(table, meta={**table.meta, "model": name}))
    return tables


def main(argv):
    del argv
    if _ONE_TIGHT_ONLY.value:  # add the one-tight rows to an existing results file
        path = os.path.join(_OUT.value, "planner_bench.json")
        with open(path) as f:
            results = json.load(f)
        solvers = ["cbc"] + (["highs"] if highs_available() else [])
        rows = [r for r in results["timings"] if r.get("memory") != "one_tight"]
        for layers, devices, mode, target in TIMINGS:
            for solver in solvers:
                r = _bench.solve_times(layers, devices, mode=mode, memory="one_tight",
                                       solver=solver, seeds=_SEEDS.value,
                                       time_limit=_TIME_LIMIT.value)
                r["target_s"] = target
                rows.append(r)
        results["timings"] = rows
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(_OUT.value, "planner_bench.md"), "w") as f:
            f.write(render(results))
        return
    if _ZOO_ONLY.value:
        path = os.path.join(_OUT.value, "planner_bench.json")
        with open(path) as f:
            results = json.load(f)
        results["zoo_vs_baselines"] = _bench.versus_baselines(zoo_tables())
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(_OUT.value, "planner_bench.md"), "w") as f:
            f.write(render(results))
        return
    solvers = ["cbc"] + (["highs"] if highs_available() else [])
    timings = []
    for layers, devices, mode, target in TIMINGS:
        for memory in ("loose", "one_tight", "tight"):
            for solver in solvers:
                r = _bench.solve_times(layers, devices, mode=mode, memory=memory, solver=solver,
                                       seeds=_SEEDS.value, time_limit=_TIME_LIMIT.value)
                r["target_s"] = target
                timings.append(r)
    results = {
        "machine": f"{os.cpu_count()}-core CPU dev box "
                   f"({platform.processor() or platform.machine()}, "
                   f"Python {platform.python_version()})",
        "timings": timings,
        "gap_vs_exhaustive": _bench.gap_vs_exhaustive(),
        "random_vs_baselines": _bench.versus_baselines(_bench.random_tables()),
        "zoo_vs_baselines": _bench.versus_baselines(zoo_tables()),
    }
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "planner_bench.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(_OUT.value, "planner_bench.md"), "w") as f:
        f.write(render(results))


def render(r) -> str:
    lines = ["# Planner benchmark", "", f"Machine: {r['machine']}.", "",
             "Random DAGs (chain + skip edges) from `random_cost_table`; *loose*: every device "
             "holds the model, *one_tight*: the first accelerator holds 25-45% of it, the other "
             "devices all of it (docs/architecture.md's 'tight GPU memory limit' instance), *tight*: each "
             "accelerator holds 25-45% of it. Time = model build "
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
