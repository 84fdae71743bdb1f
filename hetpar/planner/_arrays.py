"""The planner's data model: a CostTable as arrays, an assignment as device
positions, and what a step costs and holds.

`Arrays` (the table indexed by layer and device position), `Placed` (each
layer's compute, state, update and parameter device), `Predicted` (a step's
time, dollars, joules and memory; its plan.json form checked at load), and
each device's peak bytes over a step (`held_bytes`, `ram_bytes`). The closed
form (`_closed_form`), the replay (`_simulate`), the public `evaluate`
(`_evaluate`), the ILPs and the baselines all read these; this module
imports none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetpar.core import (
    MEMORY_KINDS,
    SCHEDULES,
    CostTable,
    Placement,
    PlanError,
    is_memory_place,
    memory_place,
    pinned_pool_reserved,
    process_of,
)

MODES = ("sequential", "pipelined")
OBJECTIVES = ("time", "cost", "energy")
#: Copies of an offloaded layer's parameters and optimizer state its host
#: holds at the step's peak without donation: the old state and the new one
#: coexist, since the runtime then donates no buffer (the caller's state is
#: never left half-updated). A step that donates its state
#: (`donate_argnums`, a table `with_donation`) holds one (`Arrays.state_copies`).
HOST_STATE_COPIES = 2

#: Streamed optimizer states a device may hold at once, counted in its largest
#: one: the runtime lets `Executor.PREFETCH` (2) stages be in flight per
#: device, each streaming one holding its state once (its copy in is
#: donated, and the new state written into it, until the copy home ends:
#: `Executor._copies_donated`), while the next one's state arrives.
STREAMED_IN_FLIGHT = 3


def streamed_in_flight(n: int) -> int:
    """Optimizer states in flight on an accelerator that streams `n` layers'
    state: one each, at most STREAMED_IN_FLIGHT. (Before the copies were
    donated, old and new of each, at most five: a 0.54B model's fetched
    plan did not fit 6.6 GB of an H200 by that count alone, fit_h200 run 53.)"""
    return min(int(n), STREAMED_IN_FLIGHT)


def is_place(device) -> bool:
    """Whether a table `Device` is a memory place (`gpu:0:pinned_host`): memory
    beside an accelerator that holds state and never computes."""
    return device.kind in MEMORY_KINDS or is_memory_place(device.name)


@dataclasses.dataclass(frozen=True)
class Predicted:
    """What one step costs under an assignment.

    Attributes:
      step_time_s: seconds per training step.
      cost_usd_per_step: dollars per step.
      energy_j_per_step: joules per step.
      busy_s: seconds each device computes per step (devices used only).
      compute_s: Σ of layer times (per step).
      transfer_s: Σ of transfer times of crossing edges (per step, all microbatches).
      memory_bytes: bytes held on each device used (the same figure as
        `peak_memory_bytes` where that is known).
      bottleneck_s: pipelined only: the busiest resource's time per microbatch.
      bottleneck: pipelined only: which resource ("device gpu:0", "link a->b").
      activation_bytes_in_flight: pipelined only: {"gpipe": {dev: bytes},
        "1f1b": {dev: bytes}}.
      schedule: set when step_time_s comes from replaying the schedule
        ("gpipe" or "1f1b", `hetpar.planner.simulate`) rather than the
        closed form; cost and energy then use the replayed step time.
      closed_form_s: with `schedule`: the closed form's step time (the ILP's).
      peak_memory_bytes: the step's peak bytes on each device used, by
        `held_bytes`: with state offloaded, the compute device holds weight
        copies, gradients (where they outlive their backward) and
        activations, the host the offloaded state.
        None in plans written before it existed.
    """

    step_time_s: float
    cost_usd_per_step: float
    energy_j_per_step: float
    busy_s: Mapping[str, float]
    compute_s: float = 0.0
    transfer_s: float = 0.0
    memory_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bottleneck_s: float | None = None
    bottleneck: str | None = None
    activation_bytes_in_flight: Mapping[str, Mapping[str, float]] | None = None
    schedule: str | None = None
    closed_form_s: float | None = None
    peak_memory_bytes: Mapping[str, float] | None = None

    def objective(self, objective: str) -> float:
        """The value of `objective` ("time", "cost" or "energy")."""
        return {"time": self.step_time_s, "cost": self.cost_usd_per_step,
                "energy": self.energy_j_per_step}[objective]

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["busy_s"] = dict(self.busy_s)
        out["memory_bytes"] = dict(self.memory_bytes)
        if self.peak_memory_bytes is not None:
            out["peak_memory_bytes"] = dict(self.peak_memory_bytes)
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "predicted") -> Predicted:
        """Builds a Predicted from its plan.json form, every field checked.

        Args:
          data: the `predicted` object.
          where: its place in the file, for messages (`baselines['heft'].predicted`).

        Raises:
          PlanError: naming the field (`predicted.busy_s['gpu:0']`) and what it must be.
        """
        if not isinstance(data, Mapping):
            raise PlanError(f"{where} must be an object, got {data!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise PlanError(f"{where} has unknown fields {sorted(unknown)}")
        required = ("step_time_s", "cost_usd_per_step", "energy_j_per_step", "busy_s")
        for key in required:
            if key not in data:
                raise PlanError(f"{where} is missing field {key!r}")
        # A figure the summary prints and `hetpar run` divides by: a string or
        # a negative time would surface later as a traceback or a nonsense ratio.
        for key, check in _PREDICTED_FIELDS.items():
            if data.get(key) is not None or key in required:
                check(data.get(key), f"{where}.{key}")
        return cls(**data)


def _check_amount(value: Any, where: str) -> None:
    """A finite number >= 0 (seconds, dollars, joules, bytes)."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not np.isfinite(value) or value < 0):
        raise PlanError(f"{where} must be a finite number >= 0, got {value!r}")


def _check_amounts(value: Any, where: str) -> None:
    """An object {device or resource: finite number >= 0}."""
    if not isinstance(value, Mapping):
        raise PlanError(f"{where} must be an object {{device: number}}, got {value!r}")
    for k, v in value.items():
        _check_amount(v, f"{where}[{k!r}]")


def _check_in_flight(value: Any, where: str) -> None:
    """{schedule: {device: bytes}}."""
    if not isinstance(value, Mapping):
        raise PlanError(f"{where} must be an object {{schedule: {{device: bytes}}}}, "
                        f"got {value!r}")
    for k, v in value.items():
        _check_amounts(v, f"{where}[{k!r}]")


def _check_text(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise PlanError(f"{where} must be a string, got {value!r}")


def _check_schedule(value: Any, where: str) -> None:
    if value not in SCHEDULES:
        raise PlanError(f"{where} must be one of {SCHEDULES}, got {value!r}")


_PREDICTED_FIELDS = {
    "step_time_s": _check_amount, "cost_usd_per_step": _check_amount,
    "energy_j_per_step": _check_amount, "busy_s": _check_amounts,
    "compute_s": _check_amount, "transfer_s": _check_amount,
    "memory_bytes": _check_amounts, "bottleneck_s": _check_amount,
    "bottleneck": _check_text, "activation_bytes_in_flight": _check_in_flight,
    "schedule": _check_schedule, "closed_form_s": _check_amount,
    "peak_memory_bytes": _check_amounts,
}


class Arrays:
    """A CostTable as numpy arrays indexed by layer and device position.

    Attributes (L layers, D devices, E edges):
      t, mem: [L, D] time and memory; t is inf where the layer cannot run.
      ok: [L, D] whether the layer may run there (timed, allowed, pinned).
      cap, price, watts_busy, watts_idle: [D].
      price_alone: [D] hourly price when a plan uses that device alone.
      eu, ev: [E] layer indices of each edge's ends.
      lat, bw: [D, D] link latency and bandwidth (bw 0: no link).
      links: {(i, j): Link}: `link_s` prices a copy by its curve where measured.
      leaves: [L] {role: bytes of each state array}: a layer's state copies'
        arrays (`state_leaves`), each priced at its size on a curve.
      pair_ok: [E, D, D] whether edge e's ends may sit on (a, b).
      act: [L] activation bytes saved per step.
      param: [L] parameter (= gradient) bytes; nan where unknown.
      resource: [D] each device's compute resource: the position of the first
        device of its `compute_group`, else its own. Work on devices of one
        resource is serialised.
      opt: [L, D] optimizer-state bytes of the layer computing on d: its
        `opt_state_bytes`, else what its memory there holds beyond 2 x
        parameters and activations; nan where `param_bytes` is unknown (its
        state cannot be offloaded).
      upd: [L, D] seconds of the layer's update on d (`update_s`); nan where
        unknown.
      cpu: [D] whether the device is a CPU (kind "cpu"): where offloaded
        state may live and its update run.
      place: [D] whether the device is a memory place (kind "pinned_host",
        or a name like `gpu:0:pinned_host`): offloaded state may live there,
        nothing computes there.
      ram: [D] the position whose memory each device draws on: a memory
        place's host RAM is its process's CPU device's (they share it; the
        table's first CPU device's where none is of its process), every
        other device its own.
      pooled, pool, pool_floor: [D] whether a memory place is a GPU's pinned
        host memory, served by its process's one XLA pinned pool; that
        pool's limit (`meta["pinned_pool_bytes"]`, else the place's
        capacity); and the regions it held when the table was read
        (`meta["pinned_pool_regions"]`), which it keeps (`ram_bytes`).
      waits: [L] whether a layer's update waits for other layers'
        gradients (`meta["update_reads"]`: a global-norm clip; every layer
        where the table does not say): its gradient lives until the whole
        backward ran (`quick_gradients`).
      overhead: [D] seconds the runtime adds per stage on each device
        (`Device.stage_overhead_s`; 0 unless measured).
      step_scale: [D] the factor `scale_to_step` applied to each device's
        layers (1 where none): the replay undoes the fusion a stage of few
        layers cannot have.
    """

    def __init__(self, table: CostTable):
        self.table = table
        self.devices = list(table.device_names)
        self.layers = list(table.layer_names)
        dindex = {d: i for i, d in enumerate(self.devices)}
        lindex = {n: i for i, n in enumerate(self.layers)}
        self.dindex, self.lindex = dindex, lindex
        L, D, E = len(self.layers), len(self.devices), len(table.edges)
        self.t = np.full((L, D), np.inf)
        self.mem = np.zeros((L, D))
        self.fixed = np.zeros((L, D))
        self.ok = np.zeros((L, D), dtype=bool)
        for i, layer in enumerate(table.layers):
            for d, v in layer.time_s.items():
                self.t[i, dindex[d]] = v
            for d, v in (layer.fixed_s or {}).items():
                self.fixed[i, dindex[d]] = v
            for d, v in layer.memory_bytes.items():
                self.mem[i, dindex[d]] = v
            for d in layer.devices():
                self.ok[i, dindex[d]] = True
        self.cap = np.array([d.memory_bytes for d in table.devices])
        self.price = np.array([d.price_per_hour for d in table.devices])
        self.price_alone = np.array([d.price_per_hour if d.price_alone_per_hour is None
                                     else d.price_alone_per_hour for d in table.devices])
        self.watts_busy = np.array([d.watts_busy for d in table.devices])
        self.watts_idle = np.array([d.watts_idle for d in table.devices])
        self.overhead = np.array([d.stage_overhead_s for d in table.devices])
        scale = table.meta.get("step_scale") or {}
        self.step_scale = np.array([float(scale.get(d, 1.0)) for d in self.devices])
        first: dict[str, int] = {}
        self.resource = np.array([j if d.compute_group is None
                                  else first.setdefault(d.compute_group, j)
                                  for j, d in enumerate(table.devices)], dtype=int)
        self.eu = np.array([lindex[e.src] for e in table.edges], dtype=int)
        self.ev = np.array([lindex[e.dst] for e in table.edges], dtype=int)
        self.fwd = np.array([e.bytes for e in table.edges], dtype=float)
        self.bwd = np.array([e.bytes_backward for e in table.edges], dtype=float)
        self.lat = np.zeros((D, D))
        self.bw = np.zeros((D, D))
        self.links = {(dindex[k.src], dindex[k.dst]): k for k in table.links}
        for (i, j), k in self.links.items():
            self.lat[i, j] = k.latency_s
            self.bw[i, j] = k.bandwidth_bytes_per_s
        has = self.bw > 0
        np.fill_diagonal(has, True)
        needs_back = self.bwd > 0
        # pair (a, b) needs a->b, and b->a too when the edge carries a gradient back.
        self.pair_ok = np.broadcast_to(has, (E, D, D)) & (
            ~needs_back[:, None, None] | has.T[None, :, :])
        act = np.zeros(L)
        for i, layer in enumerate(table.layers):
            act[i] = np.nan if layer.activation_bytes is None else layer.activation_bytes
        self.param = np.array([np.nan if layer.param_bytes is None else layer.param_bytes
                               for layer in table.layers], dtype=float).reshape(L)
        # The arrays a layer's state copies move, by role: a copy of a few
        # dozen arrays pays each one's cost on a measured curve (`link_s`).
        self.leaves = [{role: tuple(b for r, _, b in (layer.state_leaves or ()) if r == role)
                        for role in ("param", "opt_state")} for layer in table.layers]
        out_bytes = np.bincount(self.eu, weights=self.fwd, minlength=L) if E else np.zeros(L)
        self.act = np.where(np.isnan(act), out_bytes, act)
        # What a layer's stage holds only while it runs (0: unknown).
        self.ws = np.array([layer.workspace_bytes or 0.0 for layer in table.layers], dtype=float)
        # The same where it recomputes its activations: they come back
        # while its backward runs (unknown: all of them beside the rest).
        self.ws_remat = np.array([
            self.ws[i] + self.act[i] if layer.remat_workspace_bytes is None
            else layer.remat_workspace_bytes for i, layer in enumerate(table.layers)], dtype=float)
        # Share of a layer's forward a recomputation of its activations repeats.
        self.recompute = np.array([1.0 if layer.recompute_fraction is None
                                   else layer.recompute_fraction for layer in table.layers])
        self.order = table.topological_order()
        # Whose update waits for other layers' gradients (the table's
        # `update_reads`: under a global-norm clip, every gradient): their
        # gradients live until the whole backward has run.
        # A table that does not say (written by hand, or before hetpar costs
        # recorded it): every update waits, the safe side.
        if "update_reads" in table.meta:
            reads = table.meta.get("update_reads") or {}
            self.waits = np.array([bool(reads.get(n)) for n in self.layers], dtype=bool)
        else:
            self.waits = np.ones(len(self.layers), dtype=bool)
        # Donation (`with_donation`): the runtime gives up the old state as
        # the new is made, so state needs one copy where it lives, not two.
        self.donated = bool(table.meta.get("donated"))
        self.state_copies = 1 if self.donated else HOST_STATE_COPIES
        given = np.array([np.nan if layer.opt_state_bytes is None else layer.opt_state_bytes
                          for layer in table.layers], dtype=float).reshape(L, 1)
        rest = np.maximum(self.mem - 2 * self.param[:, None] - self.act[:, None], 0.0)
        self.opt = np.where(np.isnan(given), rest, np.minimum(given, self.mem))
        self.opt[np.isnan(self.param)] = np.nan
        # A layer updated on its device holds its new parameters and optimizer
        # state there beside the caller's old ones until the step returns,
        # unless the step donates them (as `jax.jit` without donate_argnums).
        # So what a layer holds on d is its `memory_bytes` and that new state.
        self.table_mem = self.mem
        # What a layer's memory figure holds beyond its parameters, gradient,
        # optimizer state and activations (never negative: a table need not
        # itemise it); what group members count whole (`replica_memory`, `_groups`).
        self.other = np.maximum(self.table_mem - 2 * np.nan_to_num(self.param)[:, None]
                                - np.nan_to_num(self.opt)
                                - np.nan_to_num(self.act)[:, None], 0.0)
        if not self.donated:
            self.mem = self.mem + np.nan_to_num(self.param)[:, None] + np.nan_to_num(self.opt)
        # One batch at a time, a layer's gradient is made in its backward as
        # the activations it saved are freed: at the backward of layer k the
        # device holds the activations of the layers before k and the
        # gradients of those after, never both whole, so the peak is at most
        # the sum of max(activations, gradient) per layer. Counting both (as
        # `memory_bytes` does) ran 1.27-1.41x the compiled peak of one-device
        # steps on an H200 (a 6.74B Llama-style step: 147.5 GB planned, 108
        # GB compiled), which planned recomputation and CPU compute for steps
        # that fit. Pipelined, microbatches' activations wait beside the
        # gradients accumulating: `mem_whole` counts both.
        self.overlap = np.minimum(np.nan_to_num(self.act), np.nan_to_num(self.param))
        if table.meta.get("groups"):
            # A group table's layers are a member's share (`_groups`): its
            # activations per its smallest group, its gradient per its
            # sharding. Counted both: a group plan's peaks are not measured
            # yet (a whole-step replica's or sharded member's count once,
            # `replica_memory`, measured on two H200s).
            self.overlap = np.zeros(L)
        self.mem_whole = self.mem
        # (never below nothing: a table's memory_bytes need not hold the
        # activations and gradients its other fields name)
        self.mem = np.maximum(self.mem - self.overlap[:, None], 0.0)
        self.resident = self.mem
        self.upd = np.full((L, D), np.nan)
        for i, layer in enumerate(table.layers):
            for d, v in (layer.update_s or {}).items():
                self.upd[i, dindex[d]] = v
        self.cpu = np.array([d.kind == "cpu" for d in table.devices], dtype=bool)
        self.place = np.array([is_place(d) for d in table.devices], dtype=bool)
        # A memory place draws on the RAM of its own process's CPU device (the
        # first CPU device where none is of its process).
        cpus = [j for j in range(D) if self.cpu[j]]
        def host_of(j: int) -> int:
            mine = [k for k in cpus if process_of(self.devices[k]) == process_of(self.devices[j])]
            return (mine or cpus or [j])[0]
        self.ram = np.array([host_of(j) if self.place[j] else j for j in range(D)], dtype=int)
        # XLA's pinned pool behind the accelerators' memory places: one per
        # process, shared by the places of one host CPU device (`ram`),
        # drawing doubling regions of the host's RAM up to its limit
        # (`ram_bytes`, `pinned_pool_reserved`). The limit as read on this
        # machine (`meta["pinned_pool_bytes"]`), else, for a table of
        # another, the place's capacity. A CPU device's place has no pool.
        # (`meta["pinned_pool_regions"]`: what the pool held when the table
        # was read, which it keeps: a replan after a step.)
        limits = table.meta.get("pinned_pool_bytes") or {}
        present = table.meta.get("present_capacity") or {}
        held_now = table.meta.get("pinned_pool_regions") or {}
        on_cpu = [memory_place(d.name)[0] in dindex and self.cpu[dindex[memory_place(d.name)[0]]]
                  for d in table.devices]
        self.pooled = np.array([
            self.place[j] and self.ram[j] != j and not on_cpu[j]
            and memory_place(self.devices[j])[1] == "pinned_host" for j in range(D)], dtype=bool)
        self.pool = np.array([
            float(limits.get(d.name, present.get(d.name, d.memory_bytes))) if self.pooled[j]
            else 0.0 for j, d in enumerate(table.devices)])
        self.pool_floor = np.array([float(held_now.get(d.name, 0.0)) if self.pooled[j] else 0.0
                                    for j, d in enumerate(table.devices)])

    def mem_at(self, microbatches: int) -> np.ndarray:
        """[L, D] what each layer holds on each device: `mem` for one batch,
        `mem_whole` (activations and gradient both whole) pipelined."""
        return self.mem if microbatches <= 1 else self.mem_whole

    def overlap_at(self, microbatches: int) -> np.ndarray | float:
        """[L] the bytes `mem_at(microbatches)` leaves out as activations and
        gradient overlapping in time (0 pipelined)."""
        return self.overlap if microbatches <= 1 else 0.0

    def indices(self, assignment: Mapping[str, str]) -> np.ndarray:
        """[L] each layer's device position under `assignment` ({layer: device}).

        Raises:
          PlanError: the assignment misses a layer, or names an unknown layer or device.
        """
        missing = [n for n in self.layers if n not in assignment]
        if missing:
            raise PlanError(f"assignment lacks layers {missing[:5]}; every layer needs a device")
        extra = [n for n in assignment if n not in self.lindex]
        if extra:
            raise PlanError(f"assignment names unknown layers {extra[:5]}")
        out = np.empty(len(self.layers), dtype=int)
        for i, n in enumerate(self.layers):
            d = assignment[n]
            if not isinstance(d, str):
                d = Placement.parse(d, n).compute
            if d not in self.dindex:
                raise PlanError(f"assignment puts {n!r} on unknown device {d!r}; devices: "
                                f"{', '.join(self.devices)}")
            out[i] = self.dindex[d]
        return out

    def placed(self, assignment: Mapping[str, Any]) -> Placed:
        """The compute, params, state and update device of every layer under `assignment`.

        Values are device names or `Placement`s (or their plan.json objects).

        Raises:
          PlanError: a missing or unknown layer or device, an update on a
            device that is neither the layer's compute nor its state device,
            or compute or update on a memory place.
        """
        compute = self.indices(assignment)
        state, update, params = compute.copy(), compute.copy(), compute.copy()
        remat = np.zeros(len(compute), bool)
        for i, n in enumerate(self.layers):
            v = assignment[n]
            if isinstance(v, str):
                continue
            p = Placement.parse(v, n)
            remat[i] = p.activations == "remat"
            for what, name in (("state", p.state), ("update", p.update), ("params", p.params)):
                if name not in self.dindex:
                    raise PlanError(f"layer {n!r}: {what} device {name!r} is unknown; devices: "
                                    f"{', '.join(self.devices)}")
            state[i], update[i] = self.dindex[p.state], self.dindex[p.update]
            params[i] = self.dindex[p.params]
            if update[i] not in (compute[i], state[i]):
                raise PlanError(f"layer {n!r}: its update runs on {p.update}, neither its "
                                f"compute ({p.compute}) nor its state device ({p.state})")
            for what, j in (("compute", compute[i]), ("update", update[i])):
                if self.place[j]:
                    raise PlanError(f"layer {n!r}: its {what} is on {self.devices[j]}, a "
                                    "memory place (it holds state, it cannot compute)")
        return Placed(compute, state, update, params, remat)

    def resource_load(self, busy: np.ndarray) -> np.ndarray:
        """[..., D] seconds per compute resource (at its first device's position; 0
        elsewhere) from [..., D] seconds per device: devices of one group add up."""
        out = np.zeros_like(busy, dtype=float)
        for j in np.unique(self.resource):
            out[..., j] = busy[..., self.resource == j].sum(axis=-1)
        return out

    def resource_label(self, j: int, used: np.ndarray | None = None) -> str:
        """The resource at position j in words: "device gpu:0", or "devices cpu:0+cpu:1"
        (the group's devices `used`, all when None) when a compute group shares it."""
        members = np.nonzero(self.resource == j)[0]
        if used is not None and used[members].any():
            members = members[used[members]]
        if len(members) == 1:
            return f"device {self.devices[members[0]]}"
        return "devices " + "+".join(self.devices[k] for k in members)

    def hourly_price(self, used: np.ndarray) -> float:
        """Dollars per hour of the devices `used` ([D] bool); one used alone at its solo
        price (memory places, rented with their accelerator, do not count)."""
        price = self.price_alone if (used & ~self.place).sum() == 1 else self.price
        return float(price[used].sum())

    def joules(self, used: np.ndarray, busy: np.ndarray, step: float) -> float:
        """Joules of a step: busy watts while computing, idle watts for the rest, devices used."""
        return float(np.sum((busy * self.watts_busy + (step - busy) * self.watts_idle)[used]))

    def t_at(self, microbatches: int) -> np.ndarray:
        """[L, D] seconds per step when the step runs as M microbatches.

        Each microbatch pays the layer's fixed part whole and its scalable
        part / M: M x (fixed + (t - fixed) / M) = t + (M - 1) x fixed.
        """
        return self.t + (int(microbatches) - 1) * self.fixed

    def link_s(self, i: int, j: int, nbytes: float, leaves: Sequence[float] = ()) -> float:
        """Seconds sending `nbytes` over link i -> j takes (`Link.seconds`: its
        measured curve where it has one). Between an accelerator and its
        memory place, whose curve is what each array of a batched call adds
        (`place_link_figures`), each of `leaves` is priced at its own size;
        other links' curves were timed one copy at a time, and a copy there
        is priced whole."""
        if not (self.place[i] or self.place[j]):
            leaves = ()
        return self.links[i, j].seconds(nbytes, leaves)

    def state_leaves(self, i: int, *roles: str) -> tuple[float, ...]:
        """The bytes of layer i's state arrays of `roles` ("param",
        "opt_state"): what one copy of them moves (() where unknown)."""
        return tuple(b for r in roles for b in self.leaves[i][r])

    def edge_parts(self, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-microbatch transfer times of each edge for each placement (a, b).

        Returns:
          (fwd, bwd): [E, D, D]; fwd[e, a, b] runs on link a->b, bwd[e, a, b]
          (the gradient) on link b->a. Zero on the diagonal, inf where the
          pair has no link. A crossing makes the receiving device run a stage
          of its own, so each carries that device's stage overhead (the
          replay, `simulate`, charges it per stage instead).
        """
        M = float(microbatches)
        with np.errstate(divide="ignore", invalid="ignore"):
            into = self.lat + self.overhead[None, :]  # a -> b: b runs a stage more
            f = into[None] + self.fwd[:, None, None] / M / self.bw[None]
            bt = self.bw.T[None]
            b = np.where(self.bwd[:, None, None] > 0,
                         (self.lat.T + self.overhead[:, None])[None]
                         + self.bwd[:, None, None] / M / bt, 0.0)
        for (i, j), k in self.links.items():  # i -> j: forwards placed (i, j), grads (j, i)
            if k.curve:
                f[:, i, j] = into[i, j] + [k.copy_s(x / M) for x in self.fwd]
                b[:, j, i] = np.where(self.bwd > 0, self.lat[i, j] + self.overhead[j] + np.array(
                    [k.copy_s(x / M) for x in self.bwd]), 0.0)
        D = len(self.devices)
        eye = np.eye(D, dtype=bool)[None]
        f = np.where(eye, 0.0, np.where(self.pair_ok, f, np.inf))
        b = np.where(eye, 0.0, np.where(self.pair_ok, b, np.inf))
        return f, b


@dataclasses.dataclass(frozen=True)
class Placed:
    """An assignment as [L] device positions: compute, state, update and parameters
    of every layer (`params` None: with the state, as `Placement` defaults)."""

    compute: np.ndarray
    state: np.ndarray
    update: np.ndarray
    params: np.ndarray | None = None
    remat: np.ndarray | None = None  # [L] bool: activations recomputed in the backward

    def __post_init__(self):
        if self.params is None:
            object.__setattr__(self, "params", np.array(self.state, copy=True))
        if self.remat is None:
            object.__setattr__(self, "remat", np.zeros(len(self.compute), bool))

    @property
    def apart(self) -> np.ndarray:
        """[L] whether the layer's state or parameters live off its compute device."""
        return (self.state != self.compute) | (self.params != self.compute)

    @property
    def state_apart(self) -> np.ndarray:
        """[L] whether the layer's optimizer state lives off its compute device."""
        return self.state != self.compute

    @property
    def params_apart(self) -> np.ndarray:
        """[L] whether the layer's parameters live off its compute device (its
        weights come in each step and its new parameters go back)."""
        return self.params != self.compute

    @property
    def host_update(self) -> np.ndarray:
        """[L] whether the layer's update runs on its state device, apart from compute."""
        return self.state_apart & (self.update == self.state)

    @property
    def streamed(self) -> np.ndarray:
        """[L] whether the layer's update runs on its compute device with something apart."""
        return self.apart & (self.update == self.compute)

    def fetched(self, place: np.ndarray) -> np.ndarray:
        """[L] whether the layer is fetched: updated on its compute device with
        its parameters in a memory place (`place`: [D] bool), whose weights
        the runtime moves in for each read and never keeps
        (`runtime.Executor._cache_inputs`)."""
        return self.streamed & self.params_apart & np.asarray(place)[self.params]

    @property
    def any_apart(self) -> bool:
        """Whether the step needs the replay: state apart, or activations recomputed."""
        return bool(self.apart.any() or self.remat.any())


def held_bytes(arr: Arrays, placed: Placed, microbatches: int = 1) -> np.ndarray:
    """[D] each device's peak bytes over a step under `placed`.

    - A layer whose state and parameters stay with its compute holds its
      `memory_bytes` there (2 x parameters: values and gradients, optimizer
      state, saved activations) and its new parameters and optimizer state
      (`Arrays.resident`: without donation the caller's old ones live until
      the step returns; with it, the new replace the old). With one
      microbatch, its activations and its gradient count once, the larger
      (`Arrays.overlap`): the one is freed as the other is made.
    - A layer whose optimizer state lives elsewhere (a host CPU device or a
      memory place) holds on its compute device its weights (a copy, when
      the parameters live elsewhere too), its gradient, its activations and
      its new parameters when they live there. Streamed (update on the
      compute device), its optimizer state also visits the compute device
      during its update (its copy donated, the new state written into it):
      n streamed layers add `streamed_in_flight(n)` x the largest such
      state (1 for one; at most STREAMED_IN_FLIGHT, the runtime's bounded
      prefetch), beside the largest working set. Fetched (`Placed.fetched`: its parameters in a
      memory place too, moved in for each read and never kept), its
      weights are not held through the step either: they count in flight,
      with its state (state plus weights in the largest).
    - Where its optimizer state lives: `Arrays.state_copies` x the state
      (without donation old and new coexist: 2; donated, 1), plus its
      gradient when the update runs there. Where its parameters live, when
      not on the compute device: `state_copies` x the parameters, and on a
      CPU device feeding an accelerator once more (`staging_bytes`). Streaming only the state
      (parameters resident, JAX's host offload) halves neither copy but
      leaves the host the optimizer state alone.

    - A layer updated on its compute device as soon as its own gradient is
      made (`quick_gradients`: one batch, state apart, its update waiting
      for no other layer's gradient) holds that gradient only while its
      backward stage runs: it counts in the working set, not through the
      step.

    A memory place shares its host's RAM with the CPU device (`Arrays.ram`);
    `violations` checks the two together, not this figure.

    Everything counted can be alive at once (weights are copied in from the
    step's start, activations live until the backward), so this bounds the
    peak from above; it is not a plain sum of layer footprints.
    """
    L, D = arr.mem.shape
    rows = np.arange(L)
    c, s, w = placed.compute, placed.state, placed.params
    state_apart, params_apart = placed.state_apart, placed.params_apart
    mem_c = arr.mem_at(microbatches)[rows, c]
    o = np.nan_to_num(arr.opt[rows, c])
    p = np.nan_to_num(arr.param)
    out = np.zeros(D)
    # Apart, the old (and without donation the new) optimizer state leave the
    # device, and the new parameters when they live elsewhere too.
    copies = arr.state_copies
    fetched = placed.fetched(arr.place)
    quick = quick_gradients(arr, placed, microbatches)
    away = (np.where(state_apart, copies * o, 0.0)
            + np.where(params_apart, (copies - 1) * p, 0.0)
            + np.where(fetched, p, 0.0)  # its weight copy: in flight only
            # recomputed: not kept (nor overlapping its gradient)
            + np.where(placed.remat, arr.act - arr.overlap_at(microbatches), 0.0)
            # its gradient, while its backward runs only (what of it the
            # kept activations did not cover)
            + np.where(quick, gradient_beyond_activations(arr, placed.remat), 0.0))
    np.add.at(out, c, np.maximum(mem_c - away, 0.0))
    home = copies * o + np.where(placed.host_update, p, 0.0)
    np.add.at(out, s[state_apart], home[state_apart])
    np.add.at(out, w[params_apart], copies * p[params_apart])
    out += staging_bytes(arr, placed)
    # While the step runs: the streamed state in flight, beside the largest
    # working set of a layer (its recomputation's where it recomputes them):
    # a streamed layer's backward runs with its state arrived and the next's
    # arriving.
    visiting = placed.streamed & (state_apart | fetched)
    in_flight = np.zeros(len(out))
    moving = np.where(state_apart, o, 0.0) + np.where(fetched, p, 0.0)
    # Streaming stages, not layers: with microbatches a fetched layer's
    # weights come in for each microbatch's forward and backward, and those
    # of one layer follow each other on its device.
    stages = np.where(fetched, max(int(microbatches), 1), 1)
    for j in np.unique(c[visiting]):
        mine = visiting & (c == j)
        in_flight[j] = streamed_in_flight(stages[mine].sum()) * float(moving[mine].max())
    working = np.zeros(len(out))
    np.maximum.at(working, c, np.where(placed.remat, arr.ws_remat, arr.ws)
                  + np.where(quick, p, 0.0))
    return out + in_flight + working


def quick_gradients(arr: Arrays, placed: Placed, microbatches: int = 1) -> np.ndarray:
    """[L] whether a layer's gradient lives only while its backward stage
    runs: one batch (with microbatches they accumulate), its state apart
    from its compute and its update there (streamed or fetched: its stages
    are its own, the update in its backward's), and the update waiting for
    no other layer's gradient (`Arrays.waits`). Counted through the step,
    the zoo 5.04B plan at 45 GB of an H200 (no clip) was planned at 39.1 GB
    and measured at 26.0 (fit_h200, run 57)."""
    if int(microbatches) > 1:
        return np.zeros(len(arr.layers), dtype=bool)
    return placed.streamed & placed.state_apart & ~arr.waits


def gradient_beyond_activations(arr: Arrays, remat: np.ndarray | bool = False) -> np.ndarray:
    """[L] what a layer's gradient adds to its count through the step, one
    batch at a time: beyond its kept activations, which it overlaps
    (`Arrays.overlap`); all of it where they are recomputed."""
    p = np.nan_to_num(arr.param)
    return np.where(remat, p, np.maximum(p - arr.overlap, 0.0))


def staging_bytes(arr: Arrays, placed: Placed) -> np.ndarray:
    """[D] what the runtime's pinned staging holds, on the host, for the
    parameters that live on a CPU device and compute on an accelerator
    (the host way, or streamed with its parameters there): their bytes once
    more, on that CPU device. (Measured on the host way; the runtime copies
    the others the same way.)

    Each step copies such parameters from the CPU device's memory, which
    the accelerator cannot reach, through pinned buffers that the
    accelerator's client keeps in a pool it never returns. A 6.74B
    Llama-style plan that updated 24 layers' state on an H200 host's CPU
    was planned at 113 GB there and compiled at 105 GB. It reached 130 GB
    of the host's 134 GB in its first step, when the OS killed it: 92 GB
    anonymous and 38 GB pinned (shared) memory. The pinned memory was the
    gradients on their way to the update (19.4 GB, counted) and as much
    again, those layers' parameters (fit_h200, run 50). The gradients
    going the other way alias their pinned buffers and count once."""
    p = np.nan_to_num(arr.param)
    on_accelerator = ~arr.cpu[placed.compute] & ~arr.place[placed.compute]
    staged = placed.params_apart & arr.cpu[placed.params] & on_accelerator
    out = np.zeros(len(arr.devices))
    np.add.at(out, placed.params[staged], p[staged])
    return out


def ram_bytes(arr: Arrays, held: np.ndarray) -> np.ndarray:
    """[D] bytes drawn from each memory (`Arrays.ram`): a memory place's count with
    its host CPU device's, 0 at the place itself. An accelerator's places
    draw what XLA's pinned pool (one per process, `Arrays.pooled`) holds to
    serve them all, its regions (`pinned_pool_reserved`, at most the pool's
    limit, `Arrays.pool`: up to twice their arrays), not the arrays alone."""
    out = np.zeros(len(held))
    np.add.at(out, arr.ram, np.where(arr.pooled, 0.0, held))
    for j in np.unique(arr.ram[arr.pooled]):
        pool = arr.pooled & (arr.ram == j)
        out[j] += max(pinned_pool_reserved(float(held[pool].sum()), float(arr.pool[pool].max())),
                      float(arr.pool_floor[pool].max()))
    return out
