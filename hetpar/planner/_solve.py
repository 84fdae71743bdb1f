"""plan(table, ...): solve the placement ILP and return the Plan.

It evaluates the ILP's result and the baselines on the same cost model.
Where a device's memory is tight it also searches where each layer's state
lives and its update runs (`_offload`), or which activations to recompute,
and keeps that plan when its replayed step is better; where a layer plan
misses the budgets and replicas meet them, it says why (`layer_plan`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
from collections.abc import Mapping

from absl import logging

from hetpar.core import (
    SCHEDULES,
    CostTable,
    InfeasibleError,
    Placement,
    PlanError,
    seconds,
)
from hetpar.planner import _baselines, _feasibility, _ilp, _offload
from hetpar.planner._arrays import MODES, OBJECTIVES, Arrays, Predicted, is_place
from hetpar.planner._baselines import BaselineResult
from hetpar.planner._evaluate import (
    data_parallel_obstacle,
    evaluate,
    evaluate_data_parallel,
    violations,
)
from hetpar.planner._groups import Group, group_table, groups_of, partitions
from hetpar.planner._plan import Plan
from hetpar.planner._sharded import SHARDINGS, evaluate_sharded, sharded_obstacle
from hetpar.planner._simulate import FORWARD_SHARE, evaluate_replayed


def plan(table: CostTable, *, objective: str = "time", mode: str = "sequential",
         microbatches: int = 1, contiguous: bool = False, max_cost: float | None = None,
         max_step_time: float | None = None, solver: str = "auto",
         time_limit: float | None = None, gap: float | None = None,
         pins: Mapping[str, str] | None = None, baselines: bool = True,
         data_parallel: bool = True, schedule: str = "gpipe",
         memory: Mapping[str, float] | None = None, offload: bool = True,
         activations: bool = True, sharded: bool = True, donate: bool = False,
         groups: bool = True) -> Plan:
    """Places every layer of `table` on a device by solving the placement ILP.

    Where some accelerator cannot hold every layer it could run, the planner
    also searches where each layer's state lives between steps and where its
    update runs (`hetpar.planner._offload`: on the accelerator, on a host CPU
    with the update there, or on the host and streamed in for the update),
    replays that plan's step with its transfers and host updates, and keeps
    whichever of the two is better (`Plan.offloaded`, `solver.offload`).

    Args:
      table: the CostTable (graph.json).
      objective: "time" (seconds per step), "cost" (dollars per step) or
        "energy" (joules per step).
      mode: "sequential" (one microbatch; minimise Σ time + Σ transfers) or
        "pipelined" (M microbatches; the ILP minimises T1 + (M - 1) x
        bottleneck, see `hetpar.planner.evaluate`; the plan's predicted step
        time replays `schedule`, see `hetpar.planner.simulate`).
      microbatches: M, pipelined mode.
      contiguous: pipelined: each device holds one contiguous run of layers.
        When False, the planner solves both with and without that constraint
        and keeps the plan whose replayed step is better: a device visited
        twice can wait on the other inside every microbatch.
      max_cost: dollars per step the plan may not exceed.
      max_step_time: seconds per step the plan may not exceed.
      solver: "cbc" (bundled with pulp), "highs" (needs highspy), or "auto":
        HiGHS when highspy is installed, else CBC. HiGHS proved optimality
        several times faster on memory-tight instances
        (experiments/results/planner_bench.md).
      time_limit: solver time limit in seconds; on expiry the best plan found
        is returned with status "feasible" and its gap.
      gap: relative optimality gap at which the solver may stop (default 1e-4).
      pins: extra {layer: device} pins on top of the table's.
      baselines: also evaluate the baselines (single devices, greedy, memory
        fill, HEFT, exhaustive when small).
      activations: where memory is tight, also plan with every accelerator
        layer's activations recomputed in its backward (`activations="remat"`:
        its activation bytes off the device, a second forward on its time)
        and keep that plan when it predicts better (`_with_remat`).
      schedule: pipelined: the per-device order the plan will run under,
        "gpipe" or "1f1b" (as `hetpar.auto(schedule=...)`).
      data_parallel: also consider running the whole step data parallel over
        the accelerators of one kind (two or more; not CPUs) and return that
        plan (`Plan.replicas`) when it is predicted better. A two-stage
        pipeline cannot beat it on equal GPUs at realistic batches: its
        bubble and every microbatch's kernel launches cost more than the
        all-reduce (experiments/results/two_gpus_*_h200x2.md).
      sharded: with `data_parallel`, also consider the same groups with their
        state sharded (`Plan.sharding`: "zero1", the optimizer state split
        across the group; "fsdp", the parameters too), priced by
        `evaluate_sharded`; every candidate is recorded in `baselines`.
      memory: {device: bytes} caps on the devices' memory for this plan (a
        device keeps its `memory_bytes` where not capped, and a cap never
        raises it), so a plan for a smaller device can be tried anywhere.
      offload: also consider keeping layers' state apart from their compute
        when memory is tight (needs `param_bytes` in the table, and a CPU
        device linked both ways to the accelerator).
      groups: with `data_parallel` and `sharded`, also place layers over
        device groups (each accelerator kind cut into equal groups, their
        state sharded: `_consider_group_pipelines`, `Plan.groups`).
      donate: the step donates its state (`hetpar.auto(donate_argnums=...)`):
        the old parameters and optimizer state are freed as the new are made,
        so state needs one copy where it lives (a device, the host) instead
        of two (`with_donation`).

    Returns:
      The Plan.

    Raises:
      InfeasibleError: no assignment satisfies memory, links, pins and budgets;
        the message names the device short of memory and by how much, the
        edge without a link, or the budget that cannot be met; with offload,
        the smallest footprint found and its device (the host, when the
        offloaded state does not fit there).
      PlanError: bad arguments.
    """
    req = _Request(objective=objective, mode=mode, microbatches=microbatches,
                   contiguous=contiguous, max_cost=max_cost, max_step_time=max_step_time,
                   solver=solver, time_limit=time_limit, gap=gap, schedule=schedule)
    req = req.checked()
    _check_replay_size(table, req)
    if memory:
        table = with_memory(table, memory)
    if donate:
        table = with_donation(table)
    if pins:
        table = table.with_pins(pins)
    arr = Arrays(table)
    _check_prices(arr, req)
    reason = _feasibility.link_obstacle(arr)
    if reason:
        raise InfeasibleError(reason)
    short = _feasibility.memory_shortfall(arr)
    search = offload and _offload.memory_tight(arr, req.microbatches)
    if short and not search and not data_parallel:
        raise short
    # The plan with recomputed activations is a second, independent solve of
    # the same size: started now, it runs beside this one (HiGHS releases
    # the GIL; the 6.74B model's replan on two H200s spent 43 s in solves
    # one after another: `plan` 30 s there, 22 s on 2 cores this way).
    alternative = (_Background(_remat_plan, table, arr, req, offload)
                   if search and activations else None)
    # So is the offload search, beside the layer ILP.
    offloading = _Background(_offload_search, arr, req) if search else None
    result, err, status = None, None, "infeasible"
    if not short:
        sol = req.solve(arr)
        logging.info("ILP %s: %s in %.2f s (build %.2f s, %d vars, %d constraints)",
                     req.solver, sol.status, sol.solve_time_s, sol.build_time_s, sol.variables,
                     sol.constraints)
        status = sol.status
        if sol.assignment is None:
            err = _infeasible(arr, sol, req)
        else:
            result = _layer_plan(table, arr, sol, req)
    if search:
        result, off_err = _with_offload(table, arr, req, result, offloading.result())
        if err is None or short:
            err = off_err
    if alternative is not None:
        result = _with_remat(table, arr, req, result, alternative.result())
    if result is None:
        err = err or short or InfeasibleError("no plan meets the constraints")
        # No placement of layers meets the budgets; replicas still might.
        shell = req.plan(table, assignment={}, predicted=None,
                         solver={"name": req.solver, "status": status,
                                 "layer_plan": str(err)})
        dp = (_consider_data_parallel(shell, table, arr, req, sharded) if data_parallel
              else shell)
        if data_parallel and groups:
            dp = _consider_group_pipelines(dp, table, req, sharded, donate)
        if not dp.replicas and not dp.groups:
            raise err
        return dp
    if baselines:
        result = dataclasses.replace(result, baselines=_evaluated_baselines(
            table, arr, req, contiguous=result.contiguous))
    if data_parallel:
        result = _consider_data_parallel(result, table, arr, req, sharded)
        if groups:
            result = _consider_group_pipelines(result, table, req, sharded, donate)
    return result


def plan_over_groups(table: CostTable, groups: Mapping[str, Group], **kw) -> Plan:
    """The placement ILP over `groups`, each one device (`group_table`): a
    plan placing layers on groups (`Plan.groups`), its fingerprint `table`'s.
    `kw` as `plan`'s (data parallel and offload are not searched inside).

    Raises:
      PlanError: a group names absent devices, mixes kinds, or shares a
        device with another (`group_obstacle`); InfeasibleError as `plan`.
    """
    gt = group_table(table, groups)
    kw = {**kw, "data_parallel": False, "offload": False, "baselines": False}
    sub = plan(gt, **kw)
    return dataclasses.replace(
        sub, fingerprint=table.fingerprint(), groups=dict(groups),
        devices=table.device_names,
        solver={**sub.solver, "chosen": groups_name(groups)})


def groups_name(groups: Mapping[str, Group]) -> str:
    """A group plan's name among the candidates: `fsdp groups a+b | c+d`."""
    shardings = {g.sharding for g in groups.values()}
    how = shardings.pop() if len(shardings) == 1 else "mixed"
    return f"{how or 'replicated'} groups {' | '.join(groups)}"


def _consider_group_pipelines(result: Plan, table: CostTable, req: _Request,
                              sharded: bool, donate: bool) -> Plan:
    """`result`, or layers placed over groups of one accelerator kind (each
    kind's devices cut into equal consecutive groups of two or more, their
    state sharded by zero1 or fsdp; pipelined under `req`'s microbatches)
    when that is feasible and predicted better. Every candidate goes into
    `baselines`."""
    if not sharded:
        return result
    best, base = result, dict(result.baselines)
    for cut in partitions(table, replica_groups(table)):
        for stage in SHARDINGS:
            groups = groups_of(cut, stage)
            name = groups_name(groups)
            try:
                p = plan_over_groups(
                    table, groups, objective=req.objective, mode=req.mode,
                    microbatches=req.microbatches, contiguous=req.contiguous,
                    max_cost=req.max_cost, max_step_time=req.max_step_time,
                    solver=req.solver, time_limit=req.time_limit, gap=req.gap,
                    schedule=req.schedule, donate=donate)
            except PlanError as e:
                base[name] = BaselineResult(name, reason=str(e))
                continue
            base[name] = BaselineResult(name, predicted=p.predicted)
            if best.predicted is None or p.predicted.objective(req.objective) < (
                    best.predicted.objective(req.objective) * (1 - 1e-9)):
                best = dataclasses.replace(
                    p, solver={**result.solver, **p.solver, "chosen": name})
    if not result.baselines:
        base = {}
    return dataclasses.replace(best, baselines=base)


def _remat_table(table: CostTable, arr: Arrays) -> CostTable:
    """`table` priced as if every layer recomputed its activations on its
    accelerators: their bytes leave the layer's memory there, and its time
    gains the forward its backward reads again (the replay's FORWARD_SHARE of
    forward + backward, times the layer's recompute_fraction). CPU devices
    keep their figures (memory is not what they lack)."""
    cpus = {d.name for d in table.devices if d.kind in ("cpu", "pinned_host")}
    layers = []
    for i, layer in enumerate(table.layers):
        act = float(arr.act[i])
        if act <= 0:
            layers.append(layer)
            continue
        accs = [d for d in layer.time_s if d not in cpus]
        layers.append(dataclasses.replace(
            layer,
            time_s={d: t * (1 + FORWARD_SHARE * float(arr.recompute[i])) if d in accs else t
                    for d, t in layer.time_s.items()},
            memory_bytes={d: max(m - act, 0.0) if d in accs else m
                          for d, m in layer.memory_bytes.items()},
            # recomputed, they come back while its backward runs
            workspace_bytes=float(arr.ws_remat[i]),
            activation_bytes=0.0))
    return dataclasses.replace(table, layers=tuple(layers))


#: Solve the plan with recomputed activations beside the other from this
#: many cores: with fewer, the two would share a core and each reach its
#: solver's time limit with half the work done (a plan could come out worse).
CONCURRENT_FROM_CORES = 4


def _cores() -> int:
    """The cores this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Background:
    """`fn(*args)` in a thread of its own where the host has
    `CONCURRENT_FROM_CORES` cores, else when its result is asked for;
    `result()` returns it or raises what it raised."""

    def __init__(self, fn, *args):
        self._call, self._out = functools.partial(fn, *args), None
        self._thread = None
        if _cores() >= CONCURRENT_FROM_CORES:
            self._thread = threading.Thread(target=self._run, name="hetpar-plan", daemon=True)
            self._thread.start()

    def _run(self):
        try:
            self._out = (self._call(), None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            self._out = (None, e)

    def result(self):
        if self._thread is None:
            self._run()
        else:
            self._thread.join()
        value, error = self._out
        if error is not None:
            raise error
        return value


def _remat_plan(table: CostTable, arr: Arrays, req: _Request, offload: bool) -> Plan | None:
    """The plan of the remat-priced table (`_remat_table`), or None where none."""
    try:
        return plan(_remat_table(table, arr), objective=req.objective, mode=req.mode,
                    microbatches=req.microbatches, contiguous=req.contiguous,
                    max_cost=req.max_cost, max_step_time=req.max_step_time,
                    solver=req.solver, time_limit=req.time_limit, gap=req.gap,
                    schedule=req.schedule, baselines=False, data_parallel=False,
                    offload=offload, activations=False)
    except PlanError as e:
        logging.info("no plan with recomputed activations: %s", e)
        return None


def _with_remat(table: CostTable, arr: Arrays, req: _Request, result: Plan | None,
                remat: Plan | None) -> Plan | None:
    """The better of `result` and the plan with recomputed activations.

    Recomputing a layer's activations in its backward (`activations="remat"`,
    run by the split pass) frees their bytes on the accelerator for the
    price of a second forward: where memory is what forces state off the
    GPU or layers onto the CPU, that can win. `remat` was planned on the
    remat-priced table (`_remat_plan`), whose prediction is the remat
    plan's; kept when it beats `result` on the objective, or when `result`
    is None.
    """
    if remat is None or remat.replicas or remat.predicted is None:
        return result
    cpus = {d.name for d in table.devices if d.kind == "cpu"}
    placements = {}
    for n, p in remat.placements.items():
        i = arr.lindex[n]
        # A layer whose parameters live on another device recomputes too: the
        # split pass reads them again for its backward, which reads its
        # weights anyway (the input gradient); its biases and norms come twice.
        if p.compute in cpus or arr.act[i] <= 0:
            placements[n] = p
        else:
            placements[n] = dataclasses.replace(p, activations="remat")
    if violations(table, placements, arrays=arr, microbatches=req.microbatches):
        return result  # what stays kept does not fit
    predicted = remat.predicted
    if req.mode == "sequential":
        placements = _fewest_recomputed(table, arr, placements)
        predicted = evaluate(table, placements, arrays=arr)
    elif any(p.activations != "remat" for n, p in placements.items()
             if arr.act[arr.lindex[n]] > 0 and p.compute not in cpus):
        predicted = _predict(table, arr, placements, req)
    if result is not None and result.predicted is not None and (
            predicted.objective(req.objective) >= result.predicted.objective(req.objective)):
        return result
    recomputed = sum(p.activations == "remat" for p in placements.values())
    return dataclasses.replace(
        remat, assignment={n: p.to_json() for n, p in placements.items()}, offloaded={},
        predicted=predicted,
        # The ILP's objective was the plan recomputing every layer it could.
        solver={**remat.solver, "recomputed": f"{recomputed} of {len(placements)} layers"})


def _fewest_recomputed(table: CostTable, arr: Arrays,
                       placements: dict[str, Placement]) -> dict[str, Placement]:
    """`placements` with each recomputed layer kept ("keep") wherever memory
    still holds, the dearest recomputations per byte freed first: GPT-2 at
    batch 256 under half its memory needs about half its blocks recomputed,
    not all (each costs a third of its time x its recompute_fraction)."""
    def cost_per_byte(n: str) -> float:
        i, p = arr.lindex[n], placements[n]
        return float(arr.t[i, arr.dindex[p.compute]] * arr.recompute[i]) / float(arr.act[i])

    out = dict(placements)
    for n in sorted((n for n, p in placements.items() if p.activations == "remat"),
                    key=cost_per_byte, reverse=True):
        kept = {**out, n: dataclasses.replace(out[n], activations="keep")}
        if not violations(table, kept, arrays=arr):
            out = kept
    return out


def with_donation(table: CostTable) -> CostTable:
    """`table` for a step that donates its state (same fingerprint): its
    `Arrays` count one copy of the state where it lives, not the old and the
    new (`Arrays.state_copies`)."""
    return dataclasses.replace(table, meta={**table.meta, "donated": True})


def with_memory(table: CostTable, memory: Mapping[str, float]) -> CostTable:
    """`table` with device memories set: {device or kind: bytes} (same fingerprint).

    A key names a device of the table (`gpu:0`, `h100:0`) or a kind
    (`h100`, `cpu`: every device of that kind; a device's own name wins over
    its kind). A device that is not present (a spec sheet, a profile from
    elsewhere) may be given more memory than its figure as well as less: a
    plan for a DGX host with 2 TB of RAM. A present device, whose capacity
    the table read off this machine (`meta["present_capacity"]`: JAX's
    allocator limit, the host's RAM its arrays may use), may only be
    capped: it cannot be given memory it does not have.

    Raises:
      PlanError: a key that names no device or kind of the table (a comma
        list among them), a value that is not a positive number, or more
        than a present device holds.
    """
    if not isinstance(memory, Mapping):
        raise PlanError(f"memory maps device names to bytes, got {type(memory).__name__}")
    kinds = {d.kind for d in table.devices}
    for d, v in memory.items():
        if isinstance(d, str) and "," in d:
            raise PlanError(f"memory names {d!r}: one device or kind per entry, e.g. "
                            "{'gpu:0': 40e9, 'gpu:1': 40e9} (on the command line, repeat "
                            "--memory DEVICE=GB for each)")
        if d not in table.device_names and d not in kinds:
            raise PlanError(f"memory names unknown device {d!r}; devices: "
                            f"{', '.join(table.device_names)}; kinds: {', '.join(sorted(kinds))}")
        if isinstance(v, bool) or not isinstance(v, int | float) or not (
                v > 0 and math.isfinite(v)):
            raise PlanError(f"memory[{d!r}] must be a positive number of bytes, got {v!r}")
    present = table.meta.get("present_capacity") or {}
    devices = []
    for dev in table.devices:
        key = dev.name if dev.name in memory else dev.kind if dev.kind in memory else None
        if key is None:
            devices.append(dev)
            continue
        want = float(memory[key])
        have = present.get(dev.name)
        if have is not None and want > have * (1 + 1e-9):
            raise PlanError(
                f"memory[{key!r}] gives {dev.name} {want / 1e9:.3g} GB, but it is present here "
                f"and holds {have / 1e9:.3g} GB (JAX's allocator limit for an accelerator; "
                "for a CPU the host's RAM this process's arrays may use: what the OS has "
                "available and what they hold): a present device cannot be given memory it "
                "does not have. Cap it lower, or plan for a larger card by its kind (e.g. "
                "'h200')")
        devices.append(dataclasses.replace(dev, memory_bytes=want))
    return dataclasses.replace(table, devices=tuple(devices),
                               meta={**table.meta, "memory_caps": dict(memory)})


def _predict(table: CostTable, arr: Arrays, assignment: Mapping, req: _Request) -> Predicted:
    """An assignment's Predicted on the plan's terms (pipelined: replayed)."""
    if req.mode == "pipelined":
        return evaluate_replayed(table, assignment, req.microbatches, req.schedule, arrays=arr)
    return evaluate(table, assignment, arrays=arr)


def _offload_search(arr: Arrays, req: _Request):
    """The offload ILP's solution (`_offload.search`) on `req`'s terms."""
    return _offload.search(arr, solver=req.solver, time_limit=req.time_limit, gap=req.gap,
                           microbatches=req.microbatches if req.mode == "pipelined" else 1,
                           contiguous=req.contiguous and req.mode == "pipelined")


def _with_offload(table: CostTable, arr: Arrays, req: _Request, result: Plan | None,
                  found) -> tuple[Plan | None, InfeasibleError | None]:
    """`result`, or the offload search's plan (`found`, `_offload_search`)
    when its replayed objective is better.

    The candidates, all replayed: the offload ILP's placements, the same with
    every offloaded layer's update moved to the host, streamed, or streamed
    from its accelerator's pinned host memory (where memory allows),
    ZeRO-Offload's rule and JAX's host offload. Returns (plan, error): the
    error says why no candidate fits memory (`_offload.diagnose`), when none
    does.
    """
    M = req.microbatches if req.mode == "pipelined" else 1
    info = found.info()
    logging.info("offload ILP %s: %s in %.2f s", req.solver, found.status, found.solve_time_s)
    candidates = []
    if found.placements is not None:
        candidates += [("ilp", found.placements), *_offload.variants(arr, found.placements)]
    for name, rule in _RULES.items():
        placements, _ = rule(table, arrays=arr)
        if placements is not None:
            candidates.append((name, placements))
    best = None
    for name, placements in candidates:
        if violations(table, placements, arrays=arr, contiguous=req.contiguous,
                      microbatches=req.microbatches):
            continue
        p = _predict(table, arr, placements, req)
        if _over_budget(p, req.max_cost, req.max_step_time) is not None:
            continue
        if best is None or p.objective(req.objective) < best[2].objective(req.objective):
            best = (name, placements, p)
    if best is None:
        if result is None and found.placements is None and found.status == "infeasible":
            return result, _offload.diagnose(arr, solver=req.solver, time_limit=req.time_limit,
                                             microbatches=M)
        return result, None
    name, placements, p = best
    info.update(candidate=name, replayed=float(p.objective(req.objective)))
    mine = p.objective(req.objective)
    if result is not None:
        info["without_offload"] = result.predicted.objective(req.objective)
        if mine >= result.predicted.objective(req.objective) * (1 - 1e-9):
            info["chosen"] = False
            return dataclasses.replace(result, solver={**result.solver, "offload": info}), None
    info["chosen"] = True
    solver = {"name": req.solver, "status": "rule" if name in _RULES else found.status,
              "gap": found.gap, "solve_time_s": found.solve_time_s,
              "build_time_s": found.build_time_s, "objective": found.objective,
              "variables": found.variables, "constraints": found.constraints, "offload": info}
    if result is not None:
        solver["layer_plan_predicted"] = result.predicted.to_json()
    contiguous = req.contiguous or (req.mode == "pipelined" and not violations(
        table, placements, contiguous=True, arrays=arr, microbatches=req.microbatches))
    return req.plan(table, assignment=placements, predicted=p, solver=solver,
                    contiguous=contiguous and req.mode == "pipelined"), None


@dataclasses.dataclass(frozen=True)
class _Request:
    """The options of one `plan` call (see there)."""

    objective: str
    mode: str
    microbatches: int
    contiguous: bool
    max_cost: float | None
    max_step_time: float | None
    solver: str
    time_limit: float | None
    gap: float | None
    schedule: str

    def checked(self) -> _Request:
        """These options, checked, with solver "auto" resolved.

        Raises:
          PlanError: naming the bad option.
        """
        if self.objective not in OBJECTIVES:
            raise PlanError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        req = self
        if self.solver == "auto":
            req = dataclasses.replace(
                self, solver="highs" if _ilp.highs_available() else "cbc")
        if self.mode not in MODES:
            raise PlanError(f"mode must be one of {MODES}, got {self.mode!r}")
        mb = self.microbatches
        if not isinstance(mb, int) or mb < 1:
            raise PlanError(f"microbatches must be a positive integer, got {mb!r}")
        if self.mode == "sequential" and mb != 1:
            raise PlanError("microbatches > 1 needs mode='pipelined'")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("max_cost", "max_step_time", "time_limit", "gap"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise PlanError(f"{name} must be a non-negative number, got {v!r}")
        return req

    def solve(self, arr: Arrays, **changes) -> _ilp.IlpSolution:
        """The ILP under these options, with `changes` to them (e.g. contiguous=True)."""
        options = dict(objective=self.objective, mode=self.mode,
                       microbatches=self.microbatches, contiguous=self.contiguous,
                       max_cost=self.max_cost, max_step_time=self.max_step_time,
                       solver=self.solver, time_limit=self.time_limit, gap=self.gap)
        return _ilp.solve(arr, **{**options, **changes})

    def plan(self, table: CostTable, **fields) -> Plan:
        """A Plan of `table` under these options; `fields` give the rest."""
        return Plan(**{
            "fingerprint": table.fingerprint(), "mode": self.mode, "objective": self.objective,
            "microbatches": self.microbatches if self.mode == "pipelined" else 1,
            "contiguous": self.contiguous,
            "constraints": {"max_cost": self.max_cost, "max_step_time": self.max_step_time},
            "devices": table.device_names, **fields})


def _check_prices(arr: Arrays, req: _Request) -> None:
    """The cost objective and budget need prices, the energy objective watts."""
    if req.objective == "cost" or req.max_cost is not None:
        if not (arr.price.any() or arr.price_alone.any()):
            raise PlanError("the cost objective and max_cost need price_per_hour on the "
                            "devices; every device's price is 0")
    if req.objective == "energy" and not (arr.watts_busy.any() or arr.watts_idle.any()):
        raise PlanError("the energy objective needs watts_busy/watts_idle on the devices; "
                        "every device's watts are 0")


def _layer_plan(table: CostTable, arr: Arrays, sol: _ilp.IlpSolution, req: _Request) -> Plan:
    """The Plan of the ILP's assignment (pipelined: replayed, and stages tried contiguous)."""
    objective = req.objective
    closed = evaluate(table, sol.assignment, req.mode, req.microbatches, arrays=arr)
    value = closed.objective(objective)
    if sol.objective is not None and abs(sol.objective - value) > 1e-6 * max(abs(value), 1e-12):
        logging.warning("ILP objective %.9g differs from the evaluated %.9g", sol.objective, value)
    solver_info = {"name": req.solver, "status": sol.status, "gap": sol.gap,
                   "solve_time_s": sol.solve_time_s, "build_time_s": sol.build_time_s,
                   "objective": sol.objective, "variables": sol.variables,
                   "constraints": sol.constraints}
    assignment, predicted, contiguous = sol.assignment, closed, req.contiguous
    if req.mode == "pipelined":
        predicted = evaluate_replayed(table, assignment, req.microbatches, req.schedule,
                                      arrays=arr)
        if not contiguous and violations(table, assignment, contiguous=True, arrays=arr,
                                         microbatches=req.microbatches):
            assignment, predicted, contiguous, solver_info = _try_contiguous(
                arr, req, assignment, predicted, solver_info)
    return req.plan(table, assignment=assignment, predicted=predicted, solver=solver_info,
                    contiguous=contiguous)


#: The most microbatches x layers a pipelined plan may ask for. Its step time
#: replays the schedule, every microbatch of every layer, for the plan and
#: each baseline: about 8 s at this many on a 2-core machine (7 layers, M =
#: 4681), linear in M; at a million microbatches it would run for hours.
MAX_REPLAYED_WORK = 32768


def _check_replay_size(table: CostTable, req: _Request) -> None:
    """Refuses, at once, a pipelined plan whose replays would run for minutes.

    Raises:
      PlanError: microbatches x layers over MAX_REPLAYED_WORK.
    """
    layers = max(len(table.layers), 1)
    if req.mode != "pipelined" or req.microbatches * layers <= MAX_REPLAYED_WORK:
        return
    most = MAX_REPLAYED_WORK // layers
    raise PlanError(
        f"{req.microbatches} microbatches x {layers} layers is more schedule than the planner "
        f"replays ({MAX_REPLAYED_WORK} microbatch-layers at most: its predicted step replays "
        f"every microbatch of every layer, for the plan and each baseline)",
        api=f"pass microbatches={most} or fewer for this graph",
        cli=f"pass --microbatches {most} or fewer for this graph")


def _evaluated_baselines(table: CostTable, arr: Arrays, req: _Request, *,
                         contiguous: bool) -> dict[str, BaselineResult]:
    """The baselines on the plan's terms (pipelined: their steps replayed too), and
    ZeRO-Offload's rule where the table allows offload."""
    base = _baselines.all_baselines(table, req.objective, req.mode, req.microbatches,
                                    max_cost=req.max_cost, max_step_time=req.max_step_time,
                                    contiguous=contiguous, arrays=arr)
    if req.mode == "pipelined":
        base = {k: r if r.predicted is None else dataclasses.replace(
            r, predicted=evaluate_replayed(table, r.assignment, req.microbatches, req.schedule,
                                           arrays=arr))
                for k, r in base.items()}
    if _offload.options(arr):
        for name in _RULES:
            base[name] = _rule_baseline(name, table, arr, req)
    return base


#: The offload baselines, by name: ZeRO-Offload's rule (state and update on the
#: host CPU) and JAX's host offload (optimizer state in pinned host memory).
_RULES = {_offload.ZERO_OFFLOAD: _offload.zero_offload, _offload.JAX_OFFLOAD: _offload.jax_offload}


def _rule_baseline(name: str, table: CostTable, arr: Arrays, req: _Request) -> BaselineResult:
    """An offload rule (`_RULES`), replayed on the plan's terms."""
    placements, why = _RULES[name](table, arrays=arr)
    if placements is None:
        return BaselineResult(name, reason=why)
    broken = violations(table, placements, arrays=arr, microbatches=req.microbatches)
    if broken:
        more = f" (+{len(broken) - 2} more)" if len(broken) > 2 else ""
        return BaselineResult(name, placements, reason="; ".join(broken[:2]) + more)
    return BaselineResult(name, placements, _predict(table, arr, placements, req))


def _try_contiguous(arr: Arrays, req: _Request, assignment, predicted, solver_info):
    """The ILP again with contiguous stages; its plan when its replayed step is better.

    Returns (assignment, predicted, contiguous, solver_info); solver_info
    records both replayed objectives under "replayed", and when the
    contiguous plan wins, its ILP objective under "objective" (the first
    solve's under "free_objective").
    """
    objective = req.objective
    sol = req.solve(arr, contiguous=True)
    info = dict(solver_info)
    info["replayed"] = {"free": predicted.objective(objective)}
    if sol.assignment is None:
        info["replayed"]["contiguous"] = f"no plan ({sol.status})"
        return assignment, predicted, False, info
    other = evaluate_replayed(arr.table, sol.assignment, req.microbatches, req.schedule,
                              arrays=arr)
    info["replayed"]["contiguous"] = other.objective(objective)
    if _over_budget(other, req.max_cost, req.max_step_time) is None and (
            other.objective(objective) < predicted.objective(objective)):
        info.update(free_objective=info["objective"], objective=sol.objective,
                    contiguous_solve_time_s=sol.solve_time_s, chosen_stages="contiguous")
        return sol.assignment, other, True, info
    return assignment, predicted, False, info


def replica_groups(table: CostTable) -> list[tuple[str, ...]]:
    """The devices a data-parallel plan may replicate over: each kind of accelerator
    with two or more devices (CPUs excluded: virtual CPU devices share one host's cores;
    memory places too: they compute nothing),
    at most one device per compute group (devices sharing one cannot speed each other up)."""
    by_kind: dict[str, list[str]] = {}
    groups: set[str] = set()
    for d in table.devices:
        if d.kind != "cpu" and not is_place(d) and (
                d.compute_group is None or d.compute_group not in groups):
            by_kind.setdefault(d.kind, []).append(d.name)
            if d.compute_group is not None:
                groups.add(d.compute_group)
    return [tuple(names) for names in by_kind.values() if len(names) >= 2]


def _consider_data_parallel(result: Plan, table: CostTable, arr: Arrays,
                            req: _Request, sharded: bool = True) -> Plan:
    """`result`, or the whole step over a group (state replicated, or sharded
    by zero1 or fsdp: `_sharded`) when one is feasible and predicted better.

    Every candidate goes into `baselines`, with its prediction or why it is
    infeasible; of equal predictions the first wins: replicated, zero1, fsdp."""
    best, base = result, dict(result.baselines)
    for group in replica_groups(table):
        for stage in (None, *(SHARDINGS if sharded else ())):
            name = f"{stage or 'data parallel'} {'+'.join(group)}"
            if stage is None:
                reason = data_parallel_obstacle(table, group, arrays=arr)
            else:
                reason = sharded_obstacle(table, group, stage, arrays=arr)
            if reason is None:
                p = (evaluate_data_parallel(table, group, arrays=arr) if stage is None
                     else evaluate_sharded(table, group, stage, arrays=arr))
                reason = _over_budget(p, req.max_cost, req.max_step_time)
            if reason is not None:
                base[name] = BaselineResult(name, reason=reason)
                continue
            base[name] = BaselineResult(name, predicted=p)
            if best.predicted is None or p.objective(result.objective) < (
                    best.predicted.objective(result.objective) * (1 - 1e-9)):
                layer_plan = ({"layer_plan_predicted": result.predicted.to_json()}
                              if result.predicted is not None else {})
                best = dataclasses.replace(
                    result, replicas=group, sharding=stage, predicted=p, offloaded={},
                    assignment=dict.fromkeys(table.layer_names, group[0]),
                    solver={**result.solver, "chosen": name, **layer_plan})
    if not result.baselines:  # baselines were not asked for: keep only the choice's record
        base = {}
    return dataclasses.replace(best, baselines=base)


def _over_budget(p: Predicted, max_cost: float | None, max_step_time: float | None) -> str | None:
    """Which budget `p` breaks, in words, or None."""
    if max_cost is not None and p.cost_usd_per_step > max_cost * (1 + 1e-9):
        return f"costs ${p.cost_usd_per_step:.3g} per step, over max_cost"
    if max_step_time is not None and p.step_time_s > max_step_time * (1 + 1e-9):
        return f"takes {seconds(p.step_time_s)} per step, over max_step_time"
    return None


def _infeasible(arr: Arrays, sol: _ilp.IlpSolution, req: _Request) -> PlanError:
    """Why the ILP found no plan, in words: the time limit, a budget, or the constraints."""
    max_cost, max_step_time = req.max_cost, req.max_step_time
    if sol.status == "no_solution":
        return PlanError(f"the solver found no plan within the time limit "
                         f"({req.time_limit} s); raise time_limit")
    if max_cost is not None or max_step_time is not None:
        free = req.solve(arr, objective="cost" if max_cost is not None else "time",
                         max_cost=None, max_step_time=None, time_limit=req.time_limit or 60)
        if free.assignment is not None:
            p = evaluate(arr.table, free.assignment, req.mode, req.microbatches, arrays=arr)
            if max_cost is not None and max_step_time is None:
                return InfeasibleError(f"no plan costs at most ${max_cost:.3g} per step; the "
                                       f"cheapest costs ${p.cost_usd_per_step:.3g}",
                                       api="raise max_cost", cli="raise --max-cost")
            if max_step_time is not None and max_cost is None:
                return InfeasibleError(f"no plan takes at most {seconds(max_step_time)} per "
                                       f"step; the fastest takes {seconds(p.step_time_s)}",
                                       api="raise max_step_time", cli="raise --max-step-time")
            return InfeasibleError("no plan meets both max_cost and max_step_time",
                                   api="relax one", cli="relax --max-cost or --max-step-time")
    contiguous = " and contiguous stages" if req.contiguous else ""
    return InfeasibleError("no assignment satisfies memory, links and pins"
                           f"{contiguous} together (each alone can be met)",
                           api="raise memory_bytes of the accelerators (or plan's memory=), "
                               "add links, or relax the layers' pinned/allowed devices",
                           cli=f"give the accelerators more memory (--memory DEVICE=GB, or "
                               f"devices[].memory_bytes in graph.json), add links to graph.json, "
                               f"or relax the layers' pinned/allowed there"
                               f"{'; or drop --contiguous' if req.contiguous else ''}")
