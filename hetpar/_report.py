"""The HLO cost report: per-layer (or per-primitive) FLOPs, bytes and intensity.

Two columns per figure: counted by hetpar on the jaxpr (before XLA's
optimisation passes) and read from XLA's cost analysis of each layer
compiled alone (after them). XLA's unknowns stay None ("?" in tables).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Callable, Sequence

from hetpar.core import HetparError, Placement, human
from hetpar.passes import LayerGraph, XlaCost, layer_costs, step_cost, trace


@dataclasses.dataclass(frozen=True)
class CostReport:
    """Cost figures of one traced step.

    Attributes:
      rows: one dict per layer (or per primitive with `by="op"`), keys as in
        `to_json()["layers"]`; a `hetpar.auto` step's rows also have its
        `placement` (plan.json's form: a device name, or a placement object
        for a layer whose state lives apart from its compute device; the
        list of replicas of a data-parallel step).
      totals: whole-step figures; the `xla_*` totals come from compiling the
        whole step at once (so fusion across layers is included).
      model, batch, mode, backend, by: what was reported.
      step: for a `hetpar.auto` step (`AutoStep.report()`), its predicted and
        measured step: {"predicted_s", "measured_s", "steps", "ratio",
        "warning", "memory": {device: {"predicted", "compiled", "measured",
        "capacity", "planned_under" where the memory check's replan capped
        the planner below the capacity, and "measured_before_step": True
        where the allocator's peak was reached before the first step}},
        "first_call": {"total_s",
        "place_s", "phases", "other_s"}}; None for a report of a traced
        function.
    """

    rows: tuple[dict, ...]
    totals: dict
    model: str | None = None
    batch: int | None = None
    mode: str = "train"
    backend: str = "cpu"
    by: str = "layer"
    step: dict | None = None

    def to_json(self) -> dict:
        out = {"model": self.model, "batch": self.batch, "mode": self.mode,
               "backend": self.backend, "by": self.by,
               "layers": [dict(r) for r in self.rows], "totals": dict(self.totals)}
        if self.step is not None:
            out["step"] = dict(self.step)
        return out

    def to_csv(self) -> str:
        buf = io.StringIO()
        keys = list(self.rows[0]) if self.rows else ["name"]
        w = csv.DictWriter(buf, fieldnames=keys)
        w.writeheader()
        for r in self.rows:
            w.writerow({**r, "placement": placement_text(r["placement"], r.get("sharding"))}
                       if "placement" in r else r)
        w.writerow({"name": "TOTAL", **{k: v for k, v in self.totals.items() if k in keys}})
        return buf.getvalue()

    def table(self) -> str:
        """A human-readable table: a row per layer and the totals."""
        cols = ["name", "placement", "flops", "xla_flops", "bytes_accessed",
                "xla_bytes_accessed", "intensity", "param_bytes", "activation_bytes"]
        heads = ["layer" if self.by == "layer" else "op", "placement", "FLOPs", "FLOPs (XLA)",
                 "bytes", "bytes (XLA)", "FLOP/B", "params", "activations"]
        # XLA's columns when nothing was compiled (xla=False, `AutoStep.report()`)
        # would be a column of "?" each: leave them out.
        known = [c == "name" or any(r.get(c) is not None for r in (*self.rows, self.totals))
                 for c in cols]
        cols = [c for c, k in zip(cols, known) if k]
        heads = [h for h, k in zip(heads, known) if k]
        units = {"bytes_accessed": "B", "xla_bytes_accessed": "B", "param_bytes": "B",
                 "activation_bytes": "B"}

        def cell(r, c):
            v = r.get(c)
            if c == "name":
                return str(v)
            if c == "placement":
                return "" if v is None else placement_text(v, r.get("sharding"))
            if c == "intensity":
                return "?" if v is None else f"{v:.2f}"
            return human(v, units.get(c, ""))

        body = [[cell(r, c) for c in cols] for r in self.rows]
        body.append([cell({"name": "TOTAL", **self.totals}, c) for c in cols])
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(heads)]
        line = lambda cells: "  ".join(  # text left, figures right
            c.ljust(w) if cols[i] in ("name", "placement") else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths)))
        title = (f"hetpar cost report: {self.model or 'step'}  mode={self.mode}  "
                 f"batch={self.batch}  backend={self.backend}")
        out = [title, line(heads), line(["-" * w for w in widths])]
        out += [line(b) for b in body[:-1]]
        out += [line(["-" * w for w in widths]), line(body[-1])]
        if self.step is not None:
            out.append(step_line(self.step))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


#: How a whole-step plan's state lies over its replicas, in a report's cell.
SHARDED_TEXT = {"zero1": "data parallel, optimizer state sharded",
                "fsdp": "fsdp: parameters and optimizer state sharded"}


def placement_text(value: str | dict | list, sharding: str | None = None) -> str:
    """A placement in one cell: the compute device, then where the layer keeps
    or runs what it does not on it (`gpu:0; params, state gpu:0:pinned_host`);
    a list is a data-parallel step's replicas (`sharding`: its state split,
    `Plan.sharding`)."""
    if isinstance(value, list):
        return ", ".join(value) + f" ({SHARDED_TEXT.get(sharding, 'data parallel')})"
    p = Placement.parse(value)
    apart: dict[str, list[str]] = {}
    for part in ("params", "state", "update"):
        if getattr(p, part) != p.compute:
            apart.setdefault(getattr(p, part), []).append(part)
    cells = [p.compute, *(f"{', '.join(parts)} {where}" for where, parts in apart.items())]
    if p.activations != "keep":
        cells.append(f"activations {p.activations}")
    return "; ".join(cells)


def step_line(step: dict) -> str:
    """`predicted step: ..., measured ...` (and the warning) of a report's `step`."""
    from hetpar.core import seconds

    p, m = step.get("predicted_s"), step.get("measured_s")
    own = step.get("calibration")
    text = ("predicted step: " + ("none (the plan was given as a dict)" if p is None
                                  else seconds(p))
            + (f" (the calibration's own timing of this step, {own}: not a test of the "
               "cost model)" if own and p is not None else "")
            + "; measured: " + (f"not yet ({step.get('steps', 0)} steps timed)" if m is None
                                else f"{seconds(m)} (median of {step['steps']} steps)"))
    if p and m:
        text += (f"; measured / calibration {m / p:.2f}" if own
                 else f"; measured / predicted {m / p:.2f}")
    if step.get("memory"):
        text += "\n" + memory_lines(step["memory"])
        if step.get("host_memory"):
            text += "\n" + host_memory_line(step["host_memory"])
    if step.get("first_call"):
        text += "\n" + first_call_line(step["first_call"])
    if step.get("warning"):
        text += "\nWARNING: " + step["warning"]
    if step.get("hint"):
        text += "\n" + step["hint"]
    return text


def memory_lines(memory: dict) -> str:
    """One line per device: its memory predicted by the planner, compiled (XLA's
    memory analysis over the schedule) and measured (the allocator's peak)."""
    from hetpar.core import nbytes

    def b(v):
        return "?" if v is None else nbytes(v)

    lines = ["memory per device (predicted / compiled / measured peak, of capacity):"]
    for d, m in memory.items():
        lines.append(f"  {d}: {b(m.get('predicted'))} / {b(m.get('compiled'))} / "
                     + ("no allocator statistics" if m.get("measured") is None
                        else b(m.get("measured")) + (" (reached before the first step: "
                                                     "the calibration's or place()'s)"
                                                     if m.get("measured_before_step") else ""))
                     + f", of {b(m.get('capacity'))}"
                     + (f" (planned under {b(m['planned_under'])}: the memory check's replan)"
                        if m.get("planned_under") is not None else ""))
    return "\n".join(lines)


def host_memory_line(host: dict) -> str:
    """The host's RAM, shared by the CPU devices and memory places: their
    figures summed, and the process's resident peak."""
    from hetpar.core import nbytes

    def b(v):
        return "?" if v is None else nbytes(v)

    return (f"  host RAM ({' + '.join(host['devices'])}): {b(host.get('predicted'))} / "
            f"{b(host.get('compiled'))} / {b(host.get('measured'))} (the process's resident "
            f"peak), of {b(host.get('capacity'))}"
            + (f" ({b(host['for_arrays'])} of it for arrays now)"
               if host.get("for_arrays") is not None else ""))


def first_call_line(first: dict) -> str:
    """`first call 12.3 s: trace 1.2 s, plan ...` (`FirstCall.summary()`)."""
    from hetpar.core import seconds

    parts = [f"{name} {seconds(s)}" for name, s in first["phases"].items()]
    if first.get("place_s") is not None:
        parts.append(f"place() {seconds(first['place_s'])}")
    if first.get("other_s") is not None:
        parts.append(f"other {seconds(first['other_s'])}")
    total = first.get("total_s")
    return (f"first call {'not yet' if total is None else seconds(total)}: "
            + (", ".join(parts) or "nothing timed"))


def report_graph(graph: LayerGraph, *, backend: str = "cpu", xla: bool = True,
                 by: str = "layer", model: str | None = None, batch: int | None = None,
                 mode: str = "train") -> CostReport:
    """The cost report of an already traced step."""
    if by not in ("layer", "op"):
        raise HetparError(f"by must be 'layer' or 'op', got {by!r}")
    xla_layers = layer_costs(graph, backend) if xla and by == "layer" else {}
    xla_step = step_cost(graph, backend) if xla else XlaCost.unknown()
    rows = []
    if by == "layer":
        for name in graph.layers:
            info = graph[name]
            x = xla_layers.get(name, XlaCost.unknown())
            rows.append({
                "name": name,
                "flops": info.flops,
                "bytes_accessed": info.bytes_accessed,
                "transcendentals": info.transcendentals,
                "intensity": info.work.intensity,
                "param_bytes": info.param_bytes,
                "opt_state_bytes": info.opt_state_bytes,
                "activation_bytes": info.activation_bytes,
                "xla_flops": x.flops,
                "xla_bytes_accessed": x.bytes_accessed,
                "xla_transcendentals": x.transcendentals,
                "equations": len(info.eqns),
            })
    else:
        total = graph.total_work()
        for prim, (f, t, b) in sorted(total.by_primitive.items(), key=lambda kv: -kv[1][0]):
            rows.append({"name": prim, "flops": f, "bytes_accessed": b, "transcendentals": t,
                         "intensity": f / b if b else 0.0, "param_bytes": None,
                         "activation_bytes": None, "xla_flops": None,
                         "xla_bytes_accessed": None, "xla_transcendentals": None})
    total = graph.total_work()
    totals = {
        "flops": total.flops,
        "bytes_accessed": total.bytes_accessed,
        "transcendentals": total.transcendentals,
        "intensity": total.intensity,
        "param_bytes": sum(graph[n].param_bytes for n in graph.layers),
        "activation_bytes": sum(graph[n].activation_bytes for n in graph.layers),
        "xla_flops": xla_step.flops,
        "xla_bytes_accessed": xla_step.bytes_accessed,
        "xla_transcendentals": xla_step.transcendentals,
    }
    if batch is None:
        batch = batch_size(graph)
    return CostReport(tuple(rows), totals, model, batch, mode, backend, by)


def batch_size(graph: LayerGraph) -> int | None:
    """The leading dimension of the step's first batch input (None without one)."""
    invars = graph.program.jaxpr.jaxpr.invars
    for var, role in zip(invars, graph.input_roles):
        shape = getattr(var.aval, "shape", ())
        if role == "batch" and shape:
            return int(shape[0])
    return None


def report(step_fn: Callable, *example_args, backend: str = "cpu", xla: bool = True,
           by: str = "layer", depth: int | None = None,
           batch_argnums: Sequence[int] | int | None = None) -> CostReport:
    """Traces `step_fn(*example_args)` and reports what each layer costs.

    Args:
      step_fn: a training (or forward) step.
      *example_args: arguments with real shapes and dtypes.
      backend: backend whose XLA compiler gives the "after optimisation" column.
      xla: compile each layer with XLA for that column (slower); False leaves it unknown.
      by: "layer", or "op" for the same figures per primitive.
      depth: module-path depth that names layers (see `hetpar.trace`).
      batch_argnums: which arguments are data (see `hetpar.trace`).

    Returns:
      A CostReport; `str(report)` is a table, `report.to_json()` the JSON form.
    """
    graph = trace(step_fn, *example_args, depth=depth, batch_argnums=batch_argnums)
    return report_graph(graph, backend=backend, xla=xla, by=by)


def dumps(rep: CostReport, fmt: str) -> str:
    """The report as 'table', 'json' or 'csv' text."""
    if fmt == "table":
        return rep.table()
    if fmt == "json":
        return json.dumps(rep.to_json(), indent=2)
    if fmt == "csv":
        return rep.to_csv()
    raise HetparError(f"unknown format {fmt!r}; use table, json or csv")
