"""Planner benchmarks: solve time, optimality gap, and the ILP against the baselines.

Functions here are what `experiments/bench_planner.py` runs; they return plain
dicts so the script only formats and writes them.
"""

from __future__ import annotations

import statistics
import time

from absl import logging

from hetpar.core import CostTable
from hetpar.planner import _baselines, _ilp
from hetpar.planner._evaluate import Arrays
from hetpar.planner._plan import plan
from hetpar.planner._random import random_cost_table


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
                oracle = _baselines.exhaustive(table).predicted.step_time_s
                worst = max(worst, (p.predicted.step_time_s - oracle) / oracle)
                n += 1
    return {"instances": n, "layers": layers, "devices": devices, "max_rel_gap": worst}


def versus_baselines(tables: list[CostTable], *, objective: str = "time",
                     mode: str = "sequential", microbatches: int = 1) -> list[dict]:
    """The ILP's objective and every baseline's, as a ratio to the ILP, per table.

    This is also the hook for the zoo comparison: feed it the zoo graphs'
    CostTables (spec-sheet costs for cpu, h100, tpu-v5e) once the cost models
    build them.
    """
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



