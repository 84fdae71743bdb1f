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

import dataclasses
import functools
import os
import re
import tempfile
import time
import warnings

import numpy as np
import pulp

from hetpar.core import PlanError
from hetpar.planner._arrays import Arrays

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


@dataclasses.dataclass
class _Model:
    """The pulp problem under construction and what its parts share.

    Attributes:
      arr: the table's arrays.
      prob: the pulp problem.
      M: microbatches (1 in sequential mode).
      pipelined: whether the mode is "pipelined".
      scale: seconds per model time unit (about one layer's time).
      t_s: [L, D] each layer's time per step, scaled; 0 where it may not run.
      f_s, b_s: [E, D, D] each edge's per-microbatch transfer times, scaled.
      x: {(layer, device): binary placement variable}, allowed pairs only.
      dev_of: per layer, the devices it may run on.
    """

    arr: Arrays
    prob: pulp.LpProblem
    M: int
    pipelined: bool
    scale: float
    t_s: np.ndarray
    f_s: np.ndarray
    b_s: np.ndarray
    x: dict = dataclasses.field(default_factory=dict)
    dev_of: list = dataclasses.field(default_factory=list)


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
    if objective not in _OBJECTIVES:
        raise PlanError(f"objective must be one of time, cost, energy; got {objective!r}")
    t0 = time.perf_counter()
    m = _new_model(arr, mode, microbatches)
    _add_placement(m)
    _add_memory(m)
    time_terms = [(m.x[i, j], float(m.t_s[i, j]) / m.M) for (i, j) in m.x]
    link_terms, edge_max = _add_transfers(m, time_terms)
    step_expr, t_max = _step_time(m, time_terms, link_terms, edge_max)
    if contiguous:
        _add_contiguity(m)
    step = m.prob.add_variable("T", lowBound=0)
    m.prob.addConstraint(step_expr - step == 0, "step")
    w, price_terms = {}, []
    if objective in ("cost", "energy") or max_cost is not None:
        w, used = _add_device_use(m, step, t_max)
        price_terms = _add_prices(m, step, t_max, w, used)
    _add_budgets(m, step, price_terms, max_cost, max_step_time)
    norm = _OBJECTIVES[objective](m, step, w, price_terms)
    build = time.perf_counter() - t0

    gap = DEFAULT_GAP if gap is None else gap
    status, final_gap, solve_s = _run_solver(m.prob, solver, time_limit, gap)
    n_vars, n_cons = m.prob.numVariables(), m.prob.numConstraints()
    if status == "infeasible":
        return IlpSolution(None, None, status, None, solve_s, build, solver, n_vars, n_cons)
    value = pulp.value(m.prob.objective)
    return IlpSolution(_assignment(m), None if value is None else float(value) * norm, status,
                       final_gap, solve_s, build, solver, n_vars, n_cons)


def _new_model(arr: Arrays, mode: str, microbatches: int) -> _Model:
    """An empty problem, with the times scaled to about one layer's time."""
    M = microbatches if mode == "pipelined" else 1
    t_step = arr.t_at(M)  # per step, with each microbatch's fixed part
    finite_t = np.where(arr.ok, t_step, 0.0)
    scale = float(np.mean(np.where(arr.ok, t_step, np.inf).min(axis=1)))
    if not scale > 0:
        scale = float(finite_t.max()) or 1.0
    f_mb, b_mb = arr.edge_parts(M)  # per microbatch
    return _Model(arr=arr, prob=pulp.LpProblem("hetpar_placement", pulp.LpMinimize), M=M,
                  pipelined=mode == "pipelined", scale=scale, t_s=finite_t / scale,
                  f_s=f_mb / scale, b_s=b_mb / scale)


def _add_placement(m: _Model) -> None:
    """x[l, d] for every allowed pair; each layer on exactly one device."""
    arr, prob = m.arr, m.prob
    for i, j in zip(*np.nonzero(arr.ok), strict=True):
        m.x[i, j] = prob.add_variable(f"x{i}_{j}", cat=pulp.LpBinary)
    m.dev_of = [np.nonzero(arr.ok[i])[0].tolist() for i in range(arr.ok.shape[0])]
    for i, devs in enumerate(m.dev_of):
        prob.addConstraint(_affine([(m.x[i, j], 1.0) for j in devs]) == 1, f"one{i}")


def _add_memory(m: _Model) -> None:
    """Each device's capacity: what its layers hold plus the largest working
    set among them (`w_j >= ws_i x_ij`); skips devices that could hold every
    layer at once anyway."""
    arr = m.arr
    mem = arr.mem_at(m.M)
    for j in range(arr.ok.shape[1]):
        rows = np.nonzero(arr.ok[:, j])[0]
        if mem[rows, j].sum() + arr.ws[rows].max(initial=0.0) > arr.cap[j]:
            terms = [(m.x[i, j], float(mem[i, j])) for i in rows]
            big = [i for i in rows if arr.ws[i] > 0]
            if big:
                w = m.prob.add_variable(f"ws{j}", lowBound=0)
                for i in big:
                    m.prob.addConstraint(_affine([(w, 1.0), (m.x[i, j], -float(arr.ws[i]))]) >= 0,
                                         f"ws{j}_{i}")
                terms.append((w, 1.0))
            m.prob.addConstraint(_affine(terms) <= float(arr.cap[j]), f"mem{j}")


def _add_transfers(m: _Model, time_terms: list) -> tuple[dict[tuple[int, int], list], float]:
    """z[e, a, b] in the marginal form; appends each crossing's time to `time_terms`.

    Returns:
      (link_terms, edge_max): pipelined, each directed link's per-microbatch
      load terms {(a, b): [(z, time)]}; and Σ over edges of its dearest
      crossing, for the step time's upper bound.
    """
    arr, prob, f_s, b_s = m.arr, m.prob, m.f_s, m.b_s
    link_terms: dict[tuple[int, int], list] = {}
    edge_max = 0.0
    for k in range(len(arr.eu)):
        u, v = int(arr.eu[k]), int(arr.ev[k])
        rows: dict[int, list] = {a: [] for a in m.dev_of[u]}
        cols: dict[int, list] = {b: [] for b in m.dev_of[v]}
        worst = 0.0
        for a in m.dev_of[u]:
            for b in m.dev_of[v]:
                if not arr.pair_ok[k, a, b]:
                    continue
                z = prob.add_variable(f"z{k}_{a}_{b}", lowBound=0)
                rows[a].append((z, 1.0))
                cols[b].append((z, 1.0))
                if a != b:
                    c = float(f_s[k, a, b] + b_s[k, a, b])
                    time_terms.append((z, c))
                    worst = max(worst, c)
                    if m.pipelined:
                        link_terms.setdefault((a, b), []).append((z, float(f_s[k, a, b])))
                        if b_s[k, a, b] > 0:
                            link_terms.setdefault((b, a), []).append((z, float(b_s[k, a, b])))
        edge_max += worst
        for a, terms in rows.items():
            prob.addConstraint(_affine(terms + [(m.x[u, a], -1.0)]) == 0, f"mu{k}_{a}")
        for b, terms in cols.items():
            prob.addConstraint(_affine(terms + [(m.x[v, b], -1.0)]) == 0, f"mv{k}_{b}")
    return link_terms, edge_max


def _step_time(m: _Model, time_terms: list, link_terms: dict[tuple[int, int], list],
               edge_max: float) -> tuple[pulp.LpAffineExpression, float]:
    """The step time T in scaled units, and an upper bound t_max on it for big-M products.

    Pipelined, T = T1 + (M - 1) B with B >= every compute resource's and
    link's load; a compute resource's load sums its devices' (one compute group).
    """
    arr, prob, M, t_s = m.arr, m.prob, m.M, m.t_s
    t_max_layers = float(np.where(arr.ok, t_s, 0.0).max(axis=1).sum())
    if m.pipelined:
        bottleneck = prob.add_variable("B", lowBound=0)
        for r in np.unique(arr.resource):
            terms = [(m.x[i, j], float(t_s[i, j]) / M) for j in np.nonzero(arr.resource == r)[0]
                     for i in np.nonzero(arr.ok[:, j])[0]]
            prob.addConstraint(_affine(terms + [(bottleneck, -1.0)]) <= 0, f"busy{r}")
        for (a, b), terms in link_terms.items():
            prob.addConstraint(_affine(terms + [(bottleneck, -1.0)]) <= 0, f"link{a}_{b}")
        step_expr = _affine(time_terms + [(bottleneck, float(M - 1))])
        b_max = max(t_max_layers / M, edge_max)
        t_max = t_max_layers / M + edge_max + (M - 1) * b_max
    else:
        step_expr = _affine(time_terms)
        t_max = t_max_layers + edge_max
    return step_expr, t_max * 1.01 + 1e-6


def _add_contiguity(m: _Model) -> None:
    """Each device starts at most one run of layers in the topological order.

    s[pos, d] >= x[l, d] - x[prev, d] marks where a run on d starts.
    """
    prob, x = m.prob, m.x
    for j in range(m.arr.ok.shape[1]):
        starts = []
        prev = None
        for pos, i in enumerate(m.arr.order):
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


def _add_device_use(m: _Model, step, t_max: float) -> tuple[dict, dict]:
    """u[d] (device used) and w[d] >= T - t_max (1 - u[d]), the linearised T u[d].

    Returns:
      (w, u): {device: variable}, for devices some layer may use.
    """
    arr, prob = m.arr, m.prob
    w, used = {}, {}
    for j in range(arr.ok.shape[1]):
        rows = np.nonzero(arr.ok[:, j])[0]
        if not len(rows):
            continue
        u = used[j] = prob.add_variable(f"u{j}", cat=pulp.LpBinary)
        for i in rows:
            prob.addConstraint(_affine([(u, 1.0), (m.x[i, j], -1.0)]) >= 0, f"used{i}_{j}")
        w[j] = prob.add_variable(f"w{j}", lowBound=0)
        prob.addConstraint(_affine([(w[j], 1.0), (step, -1.0), (u, -t_max)]) >= -t_max,
                           f"prod{j}")
    return w, used


def _add_prices(m: _Model, step, t_max: float, w: dict, used: dict) -> list:
    """The dollar terms [(variable, $/h)] of a step, in scaled time units.

    Σ price[d] w[d], plus, for a device priced higher when a plan uses it
    alone (a host CPU rented as its own machine), the surcharge on alone[d]
    >= w[d] - Σ_{k != d} w[k]. That bound is exact only when u and w are exact
    both ways, so u[k] <= Σ_l x[l, k] and w[k] <= T, t_max u[k] are added too
    (otherwise an idle device could be "used" to dodge it).
    """
    arr, prob = m.arr, m.prob
    price_terms = [(w[j], float(arr.price[j])) for j in w]
    surcharged = [j for j in w if arr.price_alone[j] > arr.price[j]]
    if not surcharged:
        return price_terms
    for j in w:
        rows = np.nonzero(arr.ok[:, j])[0]
        u = used[j]
        prob.addConstraint(_affine([(u, 1.0)] + [(m.x[i, j], -1.0) for i in rows]) <= 0,
                           f"usedonly{j}")
        prob.addConstraint(_affine([(w[j], 1.0), (step, -1.0)]) <= 0, f"wle{j}")
        prob.addConstraint(_affine([(w[j], 1.0), (u, -t_max)]) <= 0, f"wleu{j}")
    for j in surcharged:
        alone = prob.add_variable(f"alone{j}", lowBound=0)
        prob.addConstraint(_affine([(alone, 1.0), (w[j], -1.0)]
                                   + [(w[k], 1.0) for k in w if k != j]) >= 0, f"alone{j}")
        price_terms.append((alone, float(arr.price_alone[j] - arr.price[j])))
    return price_terms


def _add_budgets(m: _Model, step, price_terms: list, max_cost: float | None,
                 max_step_time: float | None) -> None:
    """max_step_time (seconds per step) and max_cost (dollars per step)."""
    if max_step_time is not None:
        m.prob.addConstraint(_affine([(step, 1.0)]) <= max_step_time / m.scale, "max_step_time")
    if max_cost is not None:
        m.prob.addConstraint(
            _affine([(v, p / 3600.0 * m.scale) for v, p in price_terms]) <= max_cost, "max_cost")


def _time_objective(m: _Model, step, w: dict, price_terms: list) -> float:
    """Minimise T; returns the factor from the objective's units to seconds."""
    m.prob.setObjective(_affine([(step, 1.0)]))
    return m.scale


def _cost_objective(m: _Model, step, w: dict, price_terms: list) -> float:
    """Minimise dollars / the largest price; returns the factor to dollars."""
    pmax = float(max(m.arr.price.max(), m.arr.price_alone.max())) or 1.0
    m.prob.setObjective(_affine([(v, p / pmax) for v, p in price_terms]))
    return m.scale * pmax / 3600.0


def _energy_objective(m: _Model, step, w: dict, price_terms: list) -> float:
    """Minimise joules / the largest wattage; returns the factor to joules.

    Busy watts above idle while each layer computes, idle watts for the
    whole step (w[d] = T u[d]) on every device used.
    """
    arr = m.arr
    wmax = float(max(arr.watts_busy.max(), arr.watts_idle.max())) or 1.0
    terms = [(m.x[i, j], float(m.t_s[i, j]) * float(arr.watts_busy[j] - arr.watts_idle[j]) / wmax)
             for (i, j) in m.x]
    terms += [(w[j], float(arr.watts_idle[j]) / wmax) for j in w]
    m.prob.setObjective(_affine(terms))
    return m.scale * wmax


_OBJECTIVES = {"time": _time_objective, "cost": _cost_objective, "energy": _energy_objective}


def _assignment(m: _Model) -> dict[str, str]:
    """{layer: device} from the solved x (the device with the largest x per layer)."""
    arr, x = m.arr, m.x
    out = {}
    for i, devs in enumerate(m.dev_of):
        j = max(devs, key=lambda j, i=i: x[i, j].varValue or 0.0)
        out[arr.layers[i]] = arr.devices[j]
    return out


@functools.cache
def _quiet_highspy() -> type:
    """highspy.Highs with output_flag off before its constructor's first logging call.

    highspy.Highs() installs its callback from the constructor, and that call
    prints HiGHS's banner once per process unless output_flag is already off;
    pulp can only set options once the object exists. Here the option is set
    on the instance itself just before, so nothing else (no other thread's
    output, no file descriptor) is touched.
    """
    import highspy

    class QuietHighs(highspy.Highs):
        def enableCallbacks(self):
            self.setOptionValue("output_flag", False)
            super().enableCallbacks()

    return QuietHighs


class _QuietHiGHS(pulp.HiGHS):
    """pulp's HiGHS (highspy) interface, silent: no banner, no log.

    Only the options this module passes are forwarded: msg (must be False),
    timeLimit and gapRel.
    """

    def createAndConfigureSolver(self, lp):
        model = lp.solverModel = _quiet_highspy()()
        model.setOptionValue("output_flag", False)
        if self.gapRel is not None:
            model.setOptionValue("mip_rel_gap", self.gapRel)
        if self.timeLimit is not None:
            model.setOptionValue("time_limit", float(self.timeLimit))


def _run_solver(prob: pulp.LpProblem, solver: str, time_limit: float | None,
                gap: float) -> tuple[str, float | None, float]:
    t0 = time.perf_counter()
    if solver == "cbc":
        final_gap = _run_cbc(prob, time_limit, gap)
    else:
        prob.solve(_QuietHiGHS(msg=False, timeLimit=time_limit, gapRel=gap))
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


def _run_cbc(prob: pulp.LpProblem, time_limit: float | None, gap: float) -> float | None:
    """Solves with the CBC pulp bundles (its log to a file, not stdout); returns the final gap."""
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
        return max(0.0, o - lb) / max(abs(o), 1e-12)
    return None
