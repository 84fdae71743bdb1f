"""Plan: which device runs each layer, and what that is predicted to cost (plan.json).

A Plan can be saved, loaded, checked against a table and explained;
`plan(table, ...)` (`_solve`) makes one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetpar.core import (
    CostTable,
    Placement,
    PlanError,
    load_json,
    nbytes,
    parse_placements,
    save_json,
    seconds,
    signed_seconds,
)
from hetpar.planner._arrays import (
    MODES,
    OBJECTIVES,
    Arrays,
    Predicted,
    gradient_beyond_activations,
    held_bytes,
)
from hetpar.planner._baselines import BaselineResult
from hetpar.planner._groups import Group, group_table
from hetpar.planner._sharded import SHARDINGS, unsplit_layers
from hetpar.planner._simulate import FORWARD_SHARE

FORMAT = "hetpar.plan"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class Plan:
    """A placement of layers on devices and its predicted costs (the plan.json form).

    Attributes:
      fingerprint: the CostTable's fingerprint (layers, edges, device names).
      mode: "sequential" or "pipelined".
      objective: "time", "cost" or "energy".
      microbatches: M (1 in sequential mode).
      assignment: {layer: compute device}. The constructor also takes
        `Placement`s (or their plan.json objects) here: their compute device
        stays in `assignment`, the placement goes to `offloaded`.
      predicted: the plan's Predicted costs.
      solver: {"name", "status", "gap", "solve_time_s", "objective"}.
      baselines: {name: BaselineResult}, evaluated on the same table.
      contiguous: whether pipelined stages were constrained to be contiguous.
      constraints: {"max_cost": ..., "max_step_time": ...} (None when unset).
      replicas: when set, the whole step runs data parallel over these devices
        (batch split evenly, state replicated, gradients all-reduced) and
        `assignment` puts every layer on the first; `predicted` is then
        `evaluate_data_parallel`'s. Empty: the layers run where `assignment` says.
      offloaded: {layer: Placement} of the layers whose state or update lives
        apart from their compute device (the rest keep everything there).
        `placements` gives every layer's.
      devices: the devices it was planned over (its table's), idle ones
        included: `hetpar.auto(plan=...)` prices the plan over them again.
        Empty in plans written before it was recorded.
      sharding: with `replicas`, how their state is laid out: None
        (replicated: every device holds all of it), "zero1" (optimizer state
        split across them, parameters replicated) or "fsdp" (parameters and
        optimizer state split); `predicted` is then `evaluate_sharded`'s.
      groups: {group name: Group} where `assignment` places layers on groups
        of devices (a pipeline whose stages are sharded groups); `predicted`
        is then the plan's over `group_table(table, groups)`. Empty: layers
        sit on single devices.
    """

    fingerprint: str
    mode: str
    objective: str
    microbatches: int
    assignment: Mapping[str, str]
    predicted: Predicted
    solver: Mapping[str, Any]
    baselines: Mapping[str, BaselineResult] = dataclasses.field(default_factory=dict)
    contiguous: bool = False
    constraints: Mapping[str, float | None] = dataclasses.field(default_factory=dict)
    replicas: tuple[str, ...] = ()
    offloaded: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    devices: tuple[str, ...] = ()
    sharding: str | None = None
    groups: Mapping[str, Group] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        placements = {**parse_placements(self.assignment),
                      **parse_placements(self.offloaded)}
        object.__setattr__(self, "assignment",
                           {n: p.compute for n, p in placements.items()})
        object.__setattr__(self, "offloaded", {
            n: p for n, p in placements.items()
            if p.offloaded or p.activations != "keep"})

    @property
    def placements(self) -> dict[str, Placement]:
        """{layer: Placement} for every layer: compute, state and update device."""
        return {n: self.offloaded.get(n) or Placement(d) for n, d in self.assignment.items()}

    @property
    def state_assignment(self) -> dict[str, str]:
        """{layer: the device or memory place holding its optimizer state between steps}."""
        return {n: p.state for n, p in self.placements.items()}

    @property
    def update_assignment(self) -> dict[str, str]:
        """{layer: the device running its optimizer update}."""
        return {n: p.update for n, p in self.placements.items()}

    # -- file form -------------------------------------------------------------

    def to_json(self) -> dict:
        """The plan.json form (an offloaded layer's assignment is a placement object)."""
        return {
            "format": FORMAT, "version": VERSION, "fingerprint": self.fingerprint,
            "mode": self.mode, "objective": self.objective, "microbatches": self.microbatches,
            "contiguous": self.contiguous, "constraints": dict(self.constraints),
            "assignment": {n: p.to_json() for n, p in self.placements.items()},
            "predicted": self.predicted.to_json(),
            "solver": dict(self.solver),
            "baselines": {k: v.to_json() for k, v in self.baselines.items()},
            **({"replicas": list(self.replicas)} if self.replicas else {}),
            **({"devices": list(self.devices)} if self.devices else {}),
            **({"sharding": self.sharding} if self.sharding else {}),
            **({"groups": {n: g.to_json() for n, g in self.groups.items()}}
               if self.groups else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Plan:
        """Builds a Plan from its plan.json form.

        Raises:
          PlanError: naming the malformed field.
        """
        if not isinstance(data, Mapping):
            raise PlanError("plan.json must hold a JSON object")
        if data.get("format") != FORMAT:
            raise PlanError(f"format is {data.get('format')!r}, expected {FORMAT!r}: is this "
                            "a plan written by `hetpar plan --out`?")
        if data.get("version") != VERSION:
            raise PlanError(f"version {data.get('version')!r} is not supported (this hetpar "
                            f"reads version {VERSION}); re-plan with this hetpar")
        for key in ("fingerprint", "mode", "objective", "microbatches", "assignment",
                    "predicted", "solver"):
            if key not in data:
                raise PlanError(f"plan is missing field {key!r}")
        if data["mode"] not in MODES:
            raise PlanError(f"mode must be one of {MODES}, got {data['mode']!r}")
        if data["objective"] not in OBJECTIVES:
            raise PlanError(f"objective must be one of {OBJECTIVES}, got {data['objective']!r}")
        mb = data["microbatches"]
        if not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
            raise PlanError(f"microbatches must be a positive integer, got {mb!r}")
        assignment = data["assignment"]
        if not isinstance(assignment, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str | Mapping)
                for k, v in assignment.items()):
            raise PlanError("assignment must map layer names to device names (strings) or "
                            "placement objects ({\"compute\", \"state\", \"update\"})")
        assignment = parse_placements(assignment)
        if not isinstance(data["fingerprint"], str):
            raise PlanError(f"fingerprint must be a string, got {data['fingerprint']!r}")
        _check_solver(data["solver"])
        predicted = Predicted.from_json(data["predicted"])
        baselines = data.get("baselines", {})
        if not isinstance(baselines, Mapping):
            raise PlanError("baselines must be an object")
        contiguous = data.get("contiguous", False)
        if not isinstance(contiguous, bool):
            raise PlanError(f"contiguous must be true or false, got {contiguous!r}")
        constraints = data.get("constraints", {})
        if not isinstance(constraints, Mapping):
            raise PlanError(f"constraints must be an object, got {constraints!r}")
        for key, value in constraints.items():
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, int | float) or not value > 0 or value == float("inf")):
                raise PlanError(f"constraints.{key} must be a positive number or null, "
                                f"got {value!r}")
        replicas = data.get("replicas", [])
        if not isinstance(replicas, list) or not all(isinstance(d, str) for d in replicas) or (
                len(replicas) == 1):
            raise PlanError(f"replicas must list two or more device names, got {replicas!r}")
        sharding = data.get("sharding")
        if sharding is not None and (sharding not in SHARDINGS or not replicas):
            raise PlanError(f"sharding must be one of {SHARDINGS} (with replicas: the "
                            f"devices whose state it splits) or absent, got {sharding!r}"
                            + ("" if replicas else " without replicas"))
        devices = data.get("devices", [])
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices) or (
                len(set(devices)) != len(devices)):
            raise PlanError(f"devices must list distinct device names, got {devices!r}")
        groups = data.get("groups", {})
        if not isinstance(groups, Mapping):
            raise PlanError(f"groups must be an object {{name: group}}, got {groups!r}")
        groups = {n: Group.from_json(n, g) for n, g in groups.items()}
        if groups and replicas:
            raise PlanError("a plan has replicas (the whole step data parallel) or groups "
                            "(layers placed on groups), not both")
        named = {d for p in assignment.values() for d in p.devices}
        named = {m for d in named for m in (groups[d].devices if d in groups else (d,))}
        unplanned = sorted(named - set(devices))
        if devices and unplanned:
            raise PlanError(f"the plan places layers on {unplanned}, which its devices "
                            f"{devices} (the devices it was planned over) leave out")
        return cls(
            fingerprint=str(data["fingerprint"]), mode=data["mode"],
            objective=data["objective"], microbatches=mb, assignment=dict(assignment),
            predicted=predicted, solver=dict(data["solver"]),
            baselines={k: BaselineResult.from_json(k, v) for k, v in baselines.items()},
            contiguous=contiguous, constraints=dict(constraints), replicas=tuple(replicas),
            devices=tuple(devices), sharding=sharding, groups=groups)

    def save(self, path: str | os.PathLike) -> None:
        """Writes plan.json."""
        save_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Reads and validates plan.json.

        Raises:
          PlanError: the file is missing, not JSON, or malformed.
        """
        return load_json(path, cls.from_json, PlanError, what="plan file",
                         how="hetpar plan ... --out plan.json")

    # -- use -----------------------------------------------------------------

    def check(self, table: CostTable) -> None:
        """Checks that this plan fits `table` (same model, devices present).

        Raises:
          PlanError: the plan names devices the table lacks, or was made for a
            different graph (fingerprint mismatch).
        """
        devices = set(table.device_names)
        named = [m for p in self.placements.values() for d in p.devices
                 for m in (self.groups[d].devices if d in self.groups else (d,))]
        missing = sorted({d for d in (*named, *self.replicas) if d not in devices})
        if missing:
            raise PlanError(f"the plan places layers on {missing}, which are not among the "
                            f"devices present ({', '.join(table.device_names)}); re-plan for "
                            "these devices")
        if self.fingerprint != table.fingerprint():
            if self.devices and set(self.devices) != set(table.device_names):
                # The fingerprint covers the device set: say which device differs
                # rather than suspect the model.
                lacking = sorted(set(self.devices) - devices)
                extra = sorted(devices - set(self.devices))
                raise PlanError(
                    f"the plan was planned over {list(self.devices)}; this table's devices "
                    f"are {list(table.device_names)}"
                    + (f" (without {', '.join(lacking)})" if lacking else "")
                    + (f" (with {', '.join(extra)} besides)" if extra else ""),
                    api="cost the same devices as the plan, or re-plan for these",
                    cli="give --devices as the plan's, or re-plan with `hetpar plan` for these")
            layers = set(table.layer_names)
            extra = sorted(set(self.assignment) - layers)[:5]
            lacking = sorted(layers - set(self.assignment))[:5]
            detail = ""
            if extra or lacking:
                detail = f" (plan-only layers: {extra}; layers the plan lacks: {lacking})"
            raise PlanError(f"the plan was made for graph {self.fingerprint} but this graph is "
                            f"{table.fingerprint()}{detail}: a different model, layer "
                            "grouping or device set; re-plan")

    def explain(self, table: CostTable) -> str:
        """Says for each layer why it sits where it does.

        For each layer: its time on each device, what moving it alone to each
        other device would change (compute, transfers), and the constraint
        that forbids the move if one does (pinned, not allowed, memory full,
        no link). For a layer whose state lives apart from its compute: why
        (the memory its compute device would need with the state resident),
        and what it costs (its update on the host, its state's transfers).
        """
        self.check(table)
        if self.groups:
            gt = group_table(table, self.groups)
            inner = dataclasses.replace(self, groups={}, fingerprint=gt.fingerprint())
            return "\n".join([*self._groups_lines(table), inner.explain(gt)])
        if self.replicas:
            return (f"{self._group_line()}: every layer runs on each device, on "
                    f"1/{len(self.replicas)} of the batch\n"
                    + "".join(f"{line}\n" for line in self._unsplit_lines(table))
                    + "".join(f"{line}\n" for line in _chosen_lines(self))
                    + self.summary())
        arr = Arrays(table)
        a = np.array([arr.dindex[self.assignment[n]] for n in arr.layers])
        M = self.microbatches if self.mode == "pipelined" else 1
        t = arr.t_at(M)
        f, b = arr.edge_parts(M)
        comm = f + b
        L, D = arr.ok.shape
        memory = held_bytes(arr, arr.placed(self.placements), M)
        mem = arr.mem_at(M)
        working = np.zeros(D)  # the largest working set on each device
        np.maximum.at(working, a, arr.ws)
        incident: list[list[tuple[int, int, bool]]] = [[] for _ in range(L)]
        for k in range(len(arr.eu)):
            incident[arr.eu[k]].append((k, int(arr.ev[k]), True))
            incident[arr.ev[k]].append((k, int(arr.eu[k]), False))
        lines = [f"{self.mode} plan, objective {self.objective}; per microbatch where pipelined"]
        for i, layer in enumerate(table.layers):
            here = a[i]

            def transfers(j: int, i: int = i) -> float:
                tot = 0.0
                for k, other, out in incident[i]:
                    pair = (j, a[other]) if out else (a[other], j)
                    tot += comm[k][pair]
                return tot

            t_here, x_here = t[i, here] / M, transfers(here)
            times = ", ".join(f"{d} {seconds(t[i, j] / M)}" if np.isfinite(t[i, j])
                              else f"{d} -" for j, d in enumerate(arr.devices)
                              if not arr.place[j])
            lines.append(f"{layer.name} -> {arr.devices[here]}  (time: {times}; transfers here "
                         f"{seconds(x_here)})")
            if layer.name in self.offloaded:
                lines.append("    " + _why_apart(arr, i, self.offloaded[layer.name], memory, a,
                                                mem))
            for j, d in enumerate(arr.devices):
                if j == here or arr.place[j]:  # a memory place holds state, never a layer
                    continue
                if layer.pinned is not None:
                    lines.append(f"    {d}: pinned to {layer.pinned}")
                    continue
                if not np.isfinite(t[i, j]):
                    lines.append(f"    {d}: no time measured there (cannot run)")
                    continue
                if not arr.ok[i, j]:
                    lines.append(f"    {d}: not in the layer's allowed devices")
                    continue
                x_there = transfers(j)
                if not np.isfinite(x_there):
                    lines.append(f"    {d}: no link to a neighbour's device")
                    continue
                dt, dx = t[i, j] / M - t_here, x_there - x_here
                why = (f"compute {signed_seconds(dt)}, transfers {signed_seconds(dx)} "
                       f"(net {signed_seconds(dt + dx)})")
                over = (memory[j] + mem[i, j] + max(arr.ws[i] - working[j], 0.0)
                        - arr.cap[j])
                if over > 0:
                    why += f"; memory full: would exceed {d} by {nbytes(over)}"
                lines.append(f"    {d}: {why}")
        return "\n".join(lines)

    def summary(self, table: CostTable | None = None) -> str:
        """A readable table: the assignment, predicted costs, baselines and solver status.

        Args:
          table: if given, each layer's time on its device and its transfers are listed.
        """
        lines = [f"hetpar plan ({self.mode}, objective {self.objective}"
                 + (f", {self.microbatches} microbatches" if self.mode == "pipelined" else "")
                 + f", graph {self.fingerprint})", ""]
        if self.replicas:
            lines.append(f"{self._group_line()}: the whole step on each, batch split "
                         f"{len(self.replicas)} ways, " + {
                             None: "gradients all-reduced",
                             "zero1": "gradients reduce-scattered, each device updating its "
                                      "shard, new parameters all-gathered",
                             "fsdp": "each layer's parameters all-gathered for its forward "
                                     "and backward, its gradients reduce-scattered",
                         }[self.sharding])
        elif table is not None:
            arr = Arrays(table)
            M = self.microbatches if self.mode == "pipelined" else 1
            t = arr.t_at(M)
            f, b = arr.edge_parts(M)
            a = {n: arr.dindex[d] for n, d in self.assignment.items()}
            xfer = dict.fromkeys(arr.layers, 0.0)
            for k, e in enumerate(table.edges):
                xfer[e.dst] += f[k, a[e.src], a[e.dst]] + b[k, a[e.src], a[e.dst]]
            w = max(5, *(len(n) for n in arr.layers))
            apart = bool(self.offloaded)
            acts = any(pl.activations != "keep" for pl in self.placements.values())
            extra = f" {'state':<10} {'update':<10}" if apart else ""
            extra += f" {'activations':<11}" if acts else ""
            lines.append(f"{'layer':<{w}}  {'device':<10}{extra} {'time':>10} "
                         f"{'transfers in':>13}")
            for n in arr.layers:
                d, pl = a[n], self.placements[n]
                extra = f" {pl.state:<10} {pl.update:<10}" if apart else ""
                extra += f" {pl.activations:<11}" if acts else ""
                # A recomputed layer runs (the part its backward reads of) its forward twice.
                again = (1 + FORWARD_SHARE * arr.recompute[arr.lindex[n]]
                         if pl.activations == "remat" else 1.0)
                lines.append(f"{n:<{w}}  {arr.devices[d]:<10}{extra} "
                             f"{seconds(again * t[arr.lindex[n], d] / M):>10} "
                             f"{seconds(xfer[n]):>13}")
            if apart:
                lines.append("(time: the layer's forward + backward + update on its compute "
                             "device, a recomputed layer's second forward included; an update "
                             "on the host runs there instead)")
        else:
            for n, pl in self.placements.items():
                params = f"params {pl.params}, " if pl.params != pl.state else ""
                parts = [f"{params}state {pl.state}, update {pl.update}"] if pl.offloaded else []
                parts += [f"activations {pl.activations}"] if pl.activations != "keep" else []
                lines.append(f"{n}: {pl.compute}" + (f" ({'; '.join(parts)})" if parts else ""))
        p = self.predicted
        lines += ["", "predicted per step: " + _costs(p)]
        if any(pl.offloaded for pl in self.placements.values()):
            lines.append(_offload_line(self.placements, p))
        remat = sum(pl.activations == "remat" for pl in self.placements.values())
        if remat:
            lines.append(f"activations: {remat} of {len(self.placements)} layers recompute "
                         "their forward in the backward instead of keeping its activations "
                         "(the memory that frees keeps state on the accelerator)")
        if p.schedule is not None and p.closed_form_s is not None:
            lines.append(f"step time replays the {p.schedule} schedule (the ILP's closed form: "
                         f"{seconds(p.closed_form_s)})")
        if p.peak_memory_bytes:
            lines.append("peak memory: " + ", ".join(
                f"{d} {nbytes(v)}" for d, v in p.peak_memory_bytes.items()))
        tried = self.solver.get("replayed")
        if tried:
            lines.append("stages tried: " + ", ".join(
                f"{k} {seconds(v) if isinstance(v, float) and self.objective == 'time' else v}"
                for k, v in tried.items()))
        if p.bottleneck_s is not None:
            lines.append(f"bottleneck: {p.bottleneck} {seconds(p.bottleneck_s)} per microbatch")
        lines.append("busy: " + ", ".join(f"{d} {seconds(s)}" for d, s in p.busy_s.items()))
        s = self.solver
        gap = s.get("gap")
        lines.append(f"solver: {s.get('name')} {s.get('status')}"
                     + (f", gap {gap:.2%}" if isinstance(gap, float) else "")
                     + f", {s.get('solve_time_s', 0.0):.2f} s")
        if self.baselines:
            lines += ["", f"baselines ({self.objective}):"]
            mine = p.objective(self.objective)
            for name, r in self.baselines.items():
                if r.predicted is None:
                    lines.append(f"  {name:<16} infeasible: {r.reason}")
                else:
                    v = r.predicted.objective(self.objective)
                    rel = f"{v / mine:.3f}x" if mine > 0 else ""
                    lines.append(f"  {name:<16} {_costs(r.predicted)}  ({rel} the plan)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _group_line(self) -> str:
        """What the whole-step plan does with its devices' state, in words."""
        over = ", ".join(self.replicas)
        return {None: f"data parallel over {over} (state replicated)",
                "zero1": f"zero1 over {over} (optimizer state sharded, parameters replicated)",
                "fsdp": f"fsdp over {over} (parameters and optimizer state sharded)",
                }[self.sharding]

    def _groups_lines(self, table: CostTable) -> list[str]:
        """What each group of a group plan does, why this plan was chosen over
        the alternatives the planner weighed, and the state left replicated."""
        held = {None: "state replicated", "zero1": "optimizer state sharded",
                "fsdp": "parameters and optimizer state sharded"}
        lines = []
        for name, g in self.groups.items():
            layers = [n for n, d in self.assignment.items() if d == name]
            where = ", state resting in each member's pinned host memory" if (
                g.state == "pinned_host") else ""
            lines.append(f"group {name}: {len(layers)} layers data parallel over "
                         f"{len(g.devices)} devices, {held[g.sharding]}{where}")
            if g.sharding:
                lines += [f"    {layer}: {k} state leaves stay replicated: no axis of theirs "
                          f"is a multiple of {len(g.devices)}"
                          for layer, k in unsplit_layers(table, len(g.devices)).items()
                          if layer in layers]
        lines += _chosen_lines(self)
        return lines

    def _unsplit_lines(self, table: CostTable) -> list[str]:
        """Why some of a sharded plan's state stays replicated, one line per layer."""
        if not self.sharding:
            return []
        n = len(self.replicas)
        return [f"{layer}: {k} state leaves stay replicated: no axis of theirs is a multiple "
                f"of {n}" for layer, k in unsplit_layers(table, n).items()]


def _chosen_lines(plan: Plan) -> list[str]:
    """Why the plan was chosen: its predicted step beside every alternative
    the planner weighed (its baselines), best first, and the infeasible ones
    with their reasons."""
    if not plan.baselines:
        return []
    mine = plan.predicted.objective(plan.objective)
    ok = sorted((r.predicted.objective(plan.objective), name)
                for name, r in plan.baselines.items() if r.predicted is not None)
    lines = [f"chosen: {plan.solver.get('chosen', 'this plan')}, predicted "
             f"{_objective(mine, plan.objective)}; the alternatives:"]
    lines += [f"    {name}: {_objective(v, plan.objective)}"
              + (f" ({v / mine:.2f}x)" if mine > 0 else "") for v, name in ok]
    lines += [f"    {name}: infeasible: {r.reason}" for name, r in plan.baselines.items()
              if r.predicted is None]
    return lines


def _objective(v: float, objective: str) -> str:
    return {"time": seconds(v), "cost": f"${v:.3g}"}.get(objective, f"{v:.3g} J")


def _check_solver(solver: Any) -> None:
    """The solver record is free-form, but the figures the summary prints must be numbers.

    Raises:
      PlanError: naming the field (`solver.solve_time_s`).
    """
    if not isinstance(solver, Mapping):
        raise PlanError(f"solver must be an object, got {solver!r}")
    for key in ("gap", "solve_time_s", "build_time_s", "objective"):
        value = solver.get(key)
        # A solver stopped before proving anything reports an infinite gap.
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not value >= 0):
            raise PlanError(f"solver.{key} must be a number >= 0 or null, got {value!r}")
    for key in ("name", "status"):
        if solver.get(key) is not None and not isinstance(solver[key], str):
            raise PlanError(f"solver.{key} must be a string, got {solver[key]!r}")


def _offload_line(placements: Mapping[str, Placement], p: Predicted) -> str:
    """A line on a plan's state apart from compute."""
    apart = [pl for pl in placements.values() if pl.offloaded]
    host = sum(pl.update == pl.state != pl.compute for pl in apart)
    resident = sum(pl.update == pl.compute and pl.params == pl.compute for pl in apart)
    fetched = sum(pl.update == pl.compute != pl.params for pl in apart)
    states = ", ".join(sorted({pl.state for pl in apart}))
    kept = f", {resident} of them keeping their parameters on it" if resident else ""
    kept += (f", {fetched} of them fetching their weights from their state's home for each "
             "stage that reads them" if fetched else "")
    return (f"state apart: {len(apart)} of {len(placements)} layers keep their state on "
            f"{states} ({host} updated there, {len(apart) - host} streamed to their compute "
            f"device for the update{kept}); the step time replays their transfers "
            f"({seconds(p.transfer_s)} on the links) and host updates")


def _why_apart(arr: Arrays, i: int, pl: Placement, memory: np.ndarray,
               compute: np.ndarray, mem: np.ndarray) -> str:
    """Why layer i's state is where it is and what that costs, in one line.

    `memory`: [D] the plan's `held_bytes`; `compute`: [L] each layer's compute
    device; `mem`: [L, D] what each layer holds (`Arrays.mem_at`, the plan's microbatches).
    """
    c, s = arr.dindex[pl.compute], arr.dindex[pl.state]
    o = float(np.nan_to_num(arr.opt[i, c]))
    p = float(np.nan_to_num(arr.param[i]))
    need = memory[c] + o
    if s != c and pl.update == pl.compute and not arr.waits[i]:
        # resident, its gradient would be held through the step again (`quick_gradients`)
        need += float(gradient_beyond_activations(arr)[i])

    def move(a: int, b: int, n: float, *roles: str) -> str:
        return (seconds(arr.link_s(a, b, n, arr.state_leaves(i, *roles)))
                if arr.bw[a, b] > 0 else "-")

    everyone = float(mem[compute == c, c].sum())
    why = (f"state on {pl.state}: {pl.compute} would need {nbytes(need)} with it resident "
           f"({nbytes(everyone)} with all its layers' state there), holds "
           f"{nbytes(arr.cap[c])}")
    if need <= arr.cap[c] * (1 + 1e-9):
        why += " (the room serves another layer's state or compute, or the plan was given)"
    w = arr.dindex[pl.params]
    opt_in, opt_out = move(s, c, o, "opt_state"), move(c, s, o, "opt_state")
    new_out = (move(c, s, p + o, "param", "opt_state") if w == s
               else f"{opt_out} + {move(c, w, p, 'param')}")
    if pl.update == pl.state and s != c:
        cost = (f"host update {seconds(float(np.nan_to_num(arr.upd[i, s])))}, weights in "
                f"{move(s, c, p, 'param')} overlapped with earlier layers' compute, "
                f"gradient out {move(c, s, p)}")
    elif w == c:
        cost = (f"update on {pl.compute} with the optimizer state streamed, parameters "
                f"resident: optimizer state in {opt_in}, new state out {opt_out}")
    elif arr.place[w]:
        cost = (f"fetched: weights in {move(w, c, p, 'param')} for each stage that reads "
                f"them (the forward, the backward with the update), never kept on "
                f"{pl.compute}; optimizer state in {opt_in}, new parameters and state out "
                f"{new_out}")
    else:
        cost = (f"update on {pl.compute} with the state streamed: weights in "
                f"{move(w, c, p, 'param')} overlapped, optimizer state in {opt_in}, new "
                f"parameters and state out {new_out}")
    return f"{why}; {cost}"


def _costs(p: Predicted) -> str:
    return (f"{seconds(p.step_time_s)}, ${p.cost_usd_per_step:.3g}, "
            f"{p.energy_j_per_step:.3g} J")
