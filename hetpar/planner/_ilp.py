"""The placement ILP: binary x[l, d] (layer l on device d), built with pulp.

Transfers use the marginal form (DESIGN "Planner"): for each edge e = (u, v)
and each placement (a, b) a continuous z[e, a, b] >= 0 with Σ_b z[e, a, b] =
x[u, a] and Σ_a z[e, a, b] = x[v, b]. With x binary, z is exactly the
indicator of (u on a, v on b); its LP relaxation is exact on trees, which is
why it solves orders of magnitude faster than y >= x[u,a] + x[v,b] - 1.
z exists only for pairs the edge may use (same device, or linked in every
direction it needs), so unlinked neighbours are excluded by construction.

Every time in the model is divided by a scale (about one layer's time) and
the objective by its largest price or wattage, so CBC's absolute tolerances
(~1e-6) do not swallow objectives of 1e-7 dollars.

Cost and energy multiply the step time T by "device used" indicators u[d].
That product is linearised exactly with w[d] >= T - T_max (1 - u[d]),
w[d] >= 0, where T_max is a valid upper bound on T over all assignments; the
objective only pushes w down, so at the optimum w[d] = T u[d].
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import time
import warnings

import numpy as np
import pulp

from hetpar.core import PlanError
from hetpar.planner._evaluate import Arrays

SOLVERS = ("cbc", "highs")
# Default relative gap: 0.01%, far below the cost model's own error; on
# memory-tight graphs proving the last 1e-6 can take a minute. Tests pass gap=1e-9.
DEFAULT_GAP = 1e-4


@dataclasses.dataclass(frozen=True)
class IlpSolution:
    """What the solver found.

    Attributes:
      assignment: {layer: device}.
      objective: the model's objective value in the objective's units
        (seconds, dollars or joules per step).
      status: "optimal", "feasible" (stopped with a gap) or "infeasible".
      gap: relative gap at the end (0 when optimal, None when unknown).
      solve_time_s: wall time of the solver (model building excluded).
      build_time_s: wall time to build the pulp model.
      solver: "cbc" or "highs".
      variables, constraints: model size.
    """

    assignment: dict[str, str] | None
    objective: float | None
    status: str
    gap: float | None
    solve_time_s: float
    build_time_s: float
    solver: str
    variables: int
    constraints: int


def highs_available() -> bool:
    """Whether pulp can use HiGHS (highspy installed)."""
    return bool(pulp.HiGHS(msg=False).available())


def _affine(terms) -> pulp.LpAffineExpression:
    return pulp.LpAffineExpression(terms)


def solve(arr: Arrays, *, objective: str = "time", mode: str = "sequential",
          microbatches: int = 1, contiguous: bool = False, max_cost: float | None = None,
          max_step_time: float | None = None, solver: str = "cbc",
          time_limit: float | None = None, gap: float | None = None) -> IlpSolution:
    """Builds and solves the placement ILP on a table's arrays.

    Args:
      arr: `Arrays(table)`.
      objective: "time", "cost" or "energy".
      mode: "sequential" or "pipelined".
      microbatches: M (pipelined).
      contiguous: pipelined: each device holds one contiguous run of layers in
        the table's topological order.
      max_cost: dollars per step the plan may not exceed.
      max_step_time: seconds per step the plan may not exceed.
      solver: "cbc" or "highs".
      time_limit: solver wall-time limit in seconds (None: none).
      gap: relative gap at which the solver may stop (None: DEFAULT_GAP).

    Returns:
      The IlpSolution; status "infeasible" with no assignment if none exists.
    """
    if solver not in SOLVERS:
        raise PlanError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if solver == "highs" and not highs_available():
        raise PlanError("solver 'highs' needs highspy: pip install highspy (or use --solver cbc)")
    t0 = time.perf_counter()
    L, D = arr.ok.shape
    M = microbatches if mode == "pipelined" else 1
    pipelined = mode == "pipelined"

    t_step = arr.t_at(M)  # per step, with each microbatch's fixed part
    finite_t = np.where(arr.ok, t_step, 0.0)
    scale = float(np.mean(np.where(arr.ok, t_step, np.inf).min(axis=1)))
    if not scale > 0:
        scale = float(finite_t.max()) or 1.0
    f_mb, b_mb = arr.edge_parts(M)  # per microbatch
    f_s, b_s = f_mb / scale, b_mb / scale
    t_s = finite_t / scale

    prob = pulp.LpProblem("hetpar_placement", pulp.LpMinimize)
    x = {}
    for i, j in zip(*np.nonzero(arr.ok), strict=True):
        x[i, j] = prob.add_variable(f"x{i}_{j}", cat=pulp.LpBinary)
    dev_of = [np.nonzero(arr.ok[i])[0].tolist() for i in range(L)]
    for i in range(L):
        prob.addConstraint(_affine([(x[i, j], 1.0) for j in dev_of[i]]) == 1, f"one{i}")

    # Memory: skip devices that could hold every layer at once anyway.
    for j in range(D):
        rows = np.nonzero(arr.ok[:, j])[0]
        if arr.mem[rows, j].sum() > arr.cap[j]:
            prob.addConstraint(
                _affine([(x[i, j], float(arr.mem[i, j])) for i in rows]) <= float(arr.cap[j]),
                f"mem{j}")

    # Transfers (marginal form) and their time terms.
    time_terms = [(x[i, j], float(t_s[i, j]) / M) for (i, j) in x]
    link_terms: dict[tuple[int, int], list] = {}
    edge_max = 0.0
    for k in range(len(arr.eu)):
        u, v = int(arr.eu[k]), int(arr.ev[k])
        rows: dict[int, list] = {a: [] for a in dev_of[u]}
        cols: dict[int, list] = {b: [] for b in dev_of[v]}
        worst = 0.0
        for a in dev_of[u]:
            for b in dev_of[v]:
                if not arr.pair_ok[k, a, b]:
                    continue
                z = prob.add_variable(f"z{k}_{a}_{b}", lowBound=0)
                rows[a].append((z, 1.0))
                cols[b].append((z, 1.0))
                if a != b:
                    c = float(f_s[k, a, b] + b_s[k, a, b])
                    time_terms.append((z, c))
                    worst = max(worst, c)
                    if pipelined:
                        link_terms.setdefault((a, b), []).append((z, float(f_s[k, a, b])))
                        if b_s[k, a, b] > 0:
                            link_terms.setdefault((b, a), []).append((z, float(b_s[k, a, b])))
        edge_max += worst
        for a, terms in rows.items():
            prob.addConstraint(_affine(terms + [(x[u, a], -1.0)]) == 0, f"mu{k}_{a}")
        for b, terms in cols.items():
            prob.addConstraint(_affine(terms + [(x[v, b], -1.0)]) == 0, f"mv{k}_{b}")

    # T: step time in scaled units. Upper bound t_max for the big-M products.
    t_max_layers = float(np.where(arr.ok, t_s, 0.0).max(axis=1).sum())
    if pipelined:
        bottleneck = prob.add_variable("B", lowBound=0)
        for j in range(D):
            rows = np.nonzero(arr.ok[:, j])[0]
            prob.addConstraint(
                _affine([(x[i, j], float(t_s[i, j]) / M) for i in rows] + [(bottleneck, -1.0)])
                <= 0, f"busy{j}")
        for (a, b), terms in link_terms.items():
            prob.addConstraint(_affine(terms + [(bottleneck, -1.0)]) <= 0, f"link{a}_{b}")
        step_expr = _affine(time_terms + [(bottleneck, float(M - 1))])
        b_max = max(t_max_layers / M, edge_max)
        t_max = t_max_layers / M + edge_max + (M - 1) * b_max
    else:
        step_expr = _affine(time_terms)
        t_max = t_max_layers + edge_max
    t_max = t_max * 1.01 + 1e-6

    if contiguous:
        order = arr.order
        for j in range(D):
            starts = []
            prev = None
            for pos, i in enumerate(order):
                if (i, j) in x:
                    s = prob.add_variable(f"s{pos}_{j}", lowBound=0)
                    terms = [(s, 1.0), (x[i, j], -1.0)]
                    if prev is not None and (prev, j) in x:
                        terms.append((x[prev, j], 1.0))
                    prob.addConstraint(_affine(terms) >= 0, f"st{pos}_{j}")
                    starts.append((s, 1.0))
                prev = i
            if starts:
                prob.addConstraint(_affine(starts) <= 1, f"onerun{j}")

    needs_used = objective in ("cost", "energy") or max_cost is not None
    step = prob.add_variable("T", lowBound=0)
    prob.addConstraint(step_expr - step == 0, "step")
    w, used_var = {}, {}
    if needs_used:
        for j in range(D):
            rows = np.nonzero(arr.ok[:, j])[0]
            if not len(rows):
                continue
            u = used_var[j] = prob.add_variable(f"u{j}", cat=pulp.LpBinary)
            for i in rows:
                prob.addConstraint(_affine([(u, 1.0), (x[i, j], -1.0)]) >= 0, f"used{i}_{j}")
            w[j] = prob.add_variable(f"w{j}", lowBound=0)
            prob.addConstraint(_affine([(w[j], 1.0), (step, -1.0), (u, -t_max)]) >= -t_max,
                               f"prod{j}")

    # Dollars: Σ price[d] w[d], plus, for a device priced higher when a plan
    # uses it alone (a host CPU rented as its own machine), the surcharge on
    # alone[d] >= w[d] - Σ_{k != d} w[k]. That bound is exact only when u and
    # w are exact both ways, so u[k] <= Σ_l x[l, k] and w[k] <= T, t_max u[k]
    # are added too (otherwise an idle device could be "used" to dodge it).
    price_terms = [(w[j], float(arr.price[j])) for j in w]
    surcharged = [j for j in w if arr.price_alone[j] > arr.price[j]]
    if needs_used and surcharged:
        for j in w:
            rows = np.nonzero(arr.ok[:, j])[0]
            u = used_var[j]
            prob.addConstraint(_affine([(u, 1.0)] + [(x[i, j], -1.0) for i in rows]) <= 0,
                               f"usedonly{j}")
            prob.addConstraint(_affine([(w[j], 1.0), (step, -1.0)]) <= 0, f"wle{j}")
            prob.addConstraint(_affine([(w[j], 1.0), (u, -t_max)]) <= 0, f"wleu{j}")
        for j in surcharged:
            alone = prob.add_variable(f"alone{j}", lowBound=0)
            prob.addConstraint(_affine([(alone, 1.0), (w[j], -1.0)]
                                       + [(w[k], 1.0) for k in w if k != j]) >= 0, f"alone{j}")
            price_terms.append((alone, float(arr.price_alone[j] - arr.price[j])))

    if max_step_time is not None:
        prob.addConstraint(_affine([(step, 1.0)]) <= max_step_time / scale, "max_step_time")
    if max_cost is not None:
        prob.addConstraint(
            _affine([(v, p / 3600.0 * scale) for v, p in price_terms]) <= max_cost, "max_cost")

    if objective == "time":
        norm = scale
        prob.setObjective(_affine([(step, 1.0)]))
    elif objective == "cost":
        pmax = float(max(arr.price.max(), arr.price_alone.max())) or 1.0
        norm = scale * pmax / 3600.0
        prob.setObjective(_affine([(v, p / pmax) for v, p in price_terms]))
    elif objective == "energy":
        wmax = float(max(arr.watts_busy.max(), arr.watts_idle.max())) or 1.0
        norm = scale * wmax
        terms = [(x[i, j], float(t_s[i, j]) * float(arr.watts_busy[j] - arr.watts_idle[j]) / wmax)
                 for (i, j) in x]
        terms += [(w[j], float(arr.watts_idle[j]) / wmax) for j in w]
        prob.setObjective(_affine(terms))
    else:
        raise PlanError(f"objective must be one of time, cost, energy; got {objective!r}")
    build = time.perf_counter() - t0

    gap = DEFAULT_GAP if gap is None else gap
    status, final_gap, solve_s = _run_solver(prob, solver, time_limit, gap)
    n_vars, n_cons = prob.numVariables(), prob.numConstraints()
    if status == "infeasible":
        return IlpSolution(None, None, status, None, solve_s, build, solver, n_vars, n_cons)
    assignment = {}
    for i in range(L):
        j = max(dev_of[i], key=lambda j: x[i, j].varValue or 0.0)
        assignment[arr.layers[i]] = arr.devices[j]
    value = pulp.value(prob.objective)
    return IlpSolution(assignment, None if value is None else float(value) * norm, status,
                       final_gap, solve_s, build, solver, n_vars, n_cons)


@contextlib.contextmanager
def _quiet_stdout():
    """Silences file descriptor 1 (native code's prints) for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _run_solver(prob: pulp.LpProblem, solver: str, time_limit: float | None,
                gap: float) -> tuple[str, float | None, float]:
    t0 = time.perf_counter()
    final_gap = None
    if solver == "cbc":
        fd, log_path = tempfile.mkstemp(prefix="hetpar_cbc_", suffix=".log")
        os.close(fd)
        try:
            with warnings.catch_warnings():
                # pulp 3.3 deprecates PULP_CBC_CMD for 4.0, but it is the CBC
                # pulp bundles; COIN_CMD would need a separate CBC install.
                warnings.simplefilter("ignore", DeprecationWarning)
                cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap,
                                        logPath=log_path)
            prob.solve(cbc)
            with open(log_path) as f:
                log = f.read()
        finally:
            os.unlink(log_path)
        # CBC prints "Gap:" with two decimals only; recompute it from the bound.
        obj = re.search(r"^Objective value:\s*([-+0-9.eE]+)", log, re.M)
        low = re.search(r"^Lower bound:\s*([-+0-9.eE]+)", log, re.M)
        if obj and low:
            o, lb = float(obj.group(1)), float(low.group(1))
            final_gap = max(0.0, o - lb) / max(abs(o), 1e-12)
    else:
        with _quiet_stdout():  # highspy prints a banner from C++ whatever msg says
            prob.solve(pulp.HiGHS(msg=False, timeLimit=time_limit, gapRel=gap))
        try:
            final_gap = float(prob.solverModel.getInfo().mip_gap)
        except Exception:  # older highspy: no info; the status still says enough
            final_gap = None
    solve_s = time.perf_counter() - t0
    if prob.sol_status == pulp.LpSolutionOptimal:
        status, final_gap = "optimal", 0.0 if final_gap is None else min(final_gap, gap)
    elif prob.sol_status == pulp.LpSolutionIntegerFeasible:
        status = "feasible"
        # A stop on the gap option counts as optimal to within that gap.
        if final_gap is not None and final_gap <= gap:
            status = "optimal"
    elif prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        status = "infeasible"
    else:
        # Stopped (time limit) before any integer solution.
        status = "infeasible" if prob.status != pulp.LpStatusNotSolved else "no_solution"
    return status, final_gap, solve_s
