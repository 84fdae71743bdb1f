"""Device groups as the planner's devices: pipelines whose stages are sharded groups.

A group (`Group`: devices of one kind, a sharding, where its state rests)
computes its layers data parallel over its members, its state split across
them as a whole-step sharded plan's is (`_sharded`). To plan layers over
groups, `group_table` rewrites a CostTable so that each group is one device
of it; the placement ILP, the pipeline replay and every check then run
unchanged, and a plan over that table places layers on groups (the first
half of the layers on `gpu:0+gpu:1`, the rest on `gpu:2+gpu:3`, microbatched
as any pipeline). `consider_group_pipelines` does that for the partitions
of each accelerator kind into equal groups and keeps the best when it beats
the plan so far (`Plan.groups`).

A layer on a group of N, per member (the module docstring of `_sharded` has
the terms):

* time: its fixed part whole, its update times its shard's share, the rest
  / N (`replica_busy` per layer), plus its collectives on the group's ring
  (`ring_of`): under "fsdp" its split parameters all-gathered for its
  forward and its backward and its gradient reduce-scattered, three ring
  collectives of P_l / N, of which `FSDP_HIDDEN` is hidden behind compute
  as in a whole-step fsdp plan; under "zero1" a reduce-scatter and an
  all-gather of P_l; leaves that stay whole are all-reduced. The
  collectives count as fixed time (paid by every microbatch: each
  microbatch's stages gather and scatter again);
* memory: a member's share of its parameters and their gradient (P_l / N
  under fsdp, P_l else), of its optimizer state (O_l / N under zero1 and
  fsdp) and of its activations (A_l / N), in the table's terms (the
  planner adds the new state beside the old, `Arrays`); the gathered
  parameters and unreduced gradient, 2 (P_l - P_l / N), are its working
  set (held while it runs). Leaves no axis of which N divides count whole;
* with `state="pinned_host"` (offload) its state rests in each member's
  pinned host memory, old and new: the member holds its gradient share and
  activations, and the layer's state share only while the layer runs (its
  working set); its time gains the copies in and out at the member's
  `pinned_host` link (or, lacking one, its link to the table's CPU; a CPU
  device's own host memory: free).

Edges between groups carry bytes / N per member: member i of one group
sends its rows to member i of the next, in parallel, so the link between
two groups is the slowest link between paired members.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from hetpar.core import (
    CostTable,
    Device,
    Link,
    PlanError,
    memory_place,
    ring_allgather_s,
    ring_allreduce_s,
)
from hetpar.planner._arrays import Arrays
from hetpar.planner._evaluate import ring_of
from hetpar.planner._sharded import FSDP_HIDDEN, SHARDINGS, split_bytes

#: Where a group's state rests between steps.
GROUP_STATES = ("device", "pinned_host")


@dataclasses.dataclass(frozen=True)
class Group:
    """Devices of one kind computing layers together, data parallel.

    Attributes:
      devices: two or more device names (one: a plain device).
      sharding: None (state replicated on every member), "zero1" (optimizer
        state split) or "fsdp" (parameters too).
      state: "device", or "pinned_host": each member's shard rests in its
        device's pinned host memory and is streamed in for the step.
    """

    devices: tuple[str, ...]
    sharding: str | None = "fsdp"
    state: str = "device"

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices or not all(isinstance(d, str) and d for d in self.devices):
            raise PlanError(f"a group must list device names, got {list(self.devices)!r}")
        if len(set(self.devices)) != len(self.devices):
            raise PlanError(f"a group lists a device twice: {list(self.devices)}")
        if self.sharding is not None and self.sharding not in SHARDINGS:
            raise PlanError(f"a group's sharding must be one of {SHARDINGS} or null, got "
                            f"{self.sharding!r}")
        if self.state not in GROUP_STATES:
            raise PlanError(f"a group's state must be one of {GROUP_STATES}, got "
                            f"{self.state!r}")

    @property
    def name(self) -> str:
        """The name a plan's assignment uses: its devices joined by '+'."""
        return "+".join(self.devices)

    def to_json(self) -> dict:
        return {"devices": list(self.devices), "sharding": self.sharding,
                **({"state": self.state} if self.state != "device" else {})}

    @classmethod
    def from_json(cls, name: str, data) -> Group:
        """Raises: PlanError naming `groups.<name>` and what is wrong."""
        if not isinstance(data, Mapping) or not isinstance(data.get("devices"), list):
            raise PlanError(f"groups.{name} must be an object with a devices list, got "
                            f"{data!r}")
        try:
            group = cls(tuple(data["devices"]), data.get("sharding"),
                        data.get("state", "device"))
        except PlanError as e:
            raise PlanError(f"groups.{name}: {e}") from None
        if group.name != name:
            raise PlanError(f"groups.{name} lists devices {list(group.devices)}: a group is "
                            f"named by its devices joined by '+' ({group.name!r})")
        return group


def groups_of(names: Sequence[Sequence[str]], sharding: str | None = "fsdp",
              state: str = "device") -> dict[str, Group]:
    """{name: Group} of device lists (`hetpar.auto(groups=...)`)."""
    out = {}
    for devices in names:
        g = Group(tuple(devices), sharding, state)
        out[g.name] = g
    return out


def group_obstacle(table: CostTable, groups: Mapping[str, Group]) -> str | None:
    """Why layers cannot be planned over `groups` on `table`, or None: every
    member a device of the table, no device in two groups, one kind per
    group, and a link both ways between a group's neighbours on its ring."""
    seen: dict[str, str] = {}
    known = set(table.device_names)
    for name, g in groups.items():
        absent = [d for d in g.devices if d not in known]
        if absent:
            return (f"group {name} names {', '.join(absent)}, not among the devices "
                    f"({', '.join(table.device_names)})")
        for d in g.devices:
            if d in seen:
                return f"{d} is in two groups, {seen[d]} and {name}"
            seen[d] = name
        kinds = {d: table.device(d).kind for d in g.devices}
        if len(set(kinds.values())) > 1:
            return (f"group {name} mixes kinds: "
                    + ", ".join(f"{d} ({k})" for d, k in kinds.items())
                    + "; a group runs one program on every member, so its devices must be "
                      "of one kind")
        for k, d in enumerate(g.devices):
            nxt = g.devices[(k + 1) % len(g.devices)]
            if len(g.devices) > 1 and table.link(d, nxt) is None:
                return f"group {name}: no link {d} -> {nxt} for its collectives"
    return None


def group_table(table: CostTable, groups: Mapping[str, Group]) -> CostTable:
    """`table` with each group as one device (the module docstring has the terms).

    Raises:
      PlanError: `group_obstacle`'s reason.
    """
    reason = group_obstacle(table, groups)
    if reason:
        raise PlanError(reason)
    arr = Arrays(table)
    devices, per_layer = [], {}
    for name, g in groups.items():
        first = table.device(g.devices[0])
        devices.append(Device(
            name=name, kind=first.kind,
            memory_bytes=min(table.device(d).memory_bytes for d in g.devices),
            price_per_hour=sum(table.device(d).price_per_hour for d in g.devices),
            watts_busy=sum(table.device(d).watts_busy for d in g.devices),
            watts_idle=sum(table.device(d).watts_idle for d in g.devices),
            stage_overhead_s=first.stage_overhead_s))
        per_layer[name] = _member_costs(table, arr, g)
    links = []
    for a, ga in groups.items():
        for b, gb in groups.items():
            if a == b:
                continue
            pairs = [table.link(x, y) for x, y in zip(ga.devices, gb.devices)]
            if len(ga.devices) != len(gb.devices):  # not paired: through the first members
                pairs = [table.link(ga.devices[0], gb.devices[0])]
            if any(p is None for p in pairs):
                continue
            links.append(Link(a, b, min(p.bandwidth_bytes_per_s for p in pairs),
                              max(p.latency_s for p in pairs)))
    n_min = min(len(g.devices) for g in groups.values())
    layers = []
    for i, layer in enumerate(table.layers):
        costs = {name: per_layer[name][i] for name in groups}
        ok = {name: c for name, c in costs.items() if c is not None}
        layers.append(dataclasses.replace(
            layer,
            time_s={n: c["time"] for n, c in ok.items()},
            memory_bytes={n: c["memory"] for n, c in ok.items()},
            fixed_s={n: c["fixed"] for n, c in ok.items()},
            update_s={n: c["update"] for n, c in ok.items()} if layer.update_s else None,
            allowed=None, pinned=None,
            activation_bytes=(None if layer.activation_bytes is None
                              else layer.activation_bytes / n_min),
            workspace_bytes=max(c["workspace"] for c in ok.values()) if ok else None,
            # (per member; the largest group's figure where groups differ)
            param_bytes=max((c["param"] for c in ok.values()), default=layer.param_bytes),
            opt_state_bytes=max((c["opt"] for c in ok.values()), default=None),
            state_leaves=None))
    edges = [dataclasses.replace(e, bytes=e.bytes / n_min, bytes_backward=e.bytes_backward / n_min)
             for e in table.edges]
    meta = {**table.meta, "groups": {n: g.to_json() for n, g in groups.items()}}
    return CostTable(devices=tuple(devices), links=tuple(links), layers=tuple(layers),
                     edges=tuple(edges), meta=meta)


def _member_costs(table: CostTable, arr: Arrays, g: Group) -> list[dict | None]:
    """Per layer, what one member of `g` spends and holds for it (None: the
    layer cannot run on every member)."""
    idx = [arr.dindex[d] for d in g.devices]
    n = len(idx)
    j = idx[0]
    bw, lat = ring_of(arr, idx) if n > 1 else (np.inf, 0.0)
    p_split, o_split = split_bytes(table, arr, idx) if n > 1 else (
        np.zeros(len(arr.layers)), np.zeros(len(arr.layers)))
    if g.sharding is None:
        p_split, o_split = np.zeros_like(p_split), np.zeros_like(o_split)
    elif g.sharding == "zero1":
        p_keep = p_split.copy()  # split for the update's share, not for memory
    params = np.nan_to_num(arr.param)
    opt = np.nan_to_num(arr.opt[:, j])
    out: list[dict | None] = []
    place = _host_link(table, arr, g)
    for i, _layer in enumerate(table.layers):
        if not all(arr.ok[i, k] for k in idx):
            out.append(None)
            continue
        t, fixed = float(arr.t[i, j]), float(arr.fixed[i, j])
        update = float(np.clip(np.nan_to_num(arr.upd[i, j]), 0.0, t - fixed))
        state = params[i] + opt[i]
        split = (p_keep[i] if g.sharding == "zero1" else p_split[i]) + o_split[i]
        share = (state - split + split / n) / state if state > 0 else 1.0
        whole = params[i] - (p_keep[i] if g.sharding == "zero1" else p_split[i])
        # Collectives run per microbatch (each stage gathers the parameters it
        # reads and scatters the gradient it makes): part of the fixed time.
        coll = 0.0
        if n > 1:
            coll += ring_allreduce_s(float(whole), n, bw, lat) if whole > 0 else 0.0
            if g.sharding == "fsdp" and p_split[i] > 0:  # as a whole-step fsdp plan's
                coll += (1 - FSDP_HIDDEN) * 3 * ring_allgather_s(float(p_split[i]), n, bw, lat)
            elif g.sharding == "zero1" and p_keep[i] > 0:
                coll += 2 * ring_allgather_s(float(p_keep[i]), n, bw, lat)
        time = fixed + coll + update * share + (t - fixed - update) / n
        # In the table's terms (`Arrays` adds the new parameters and optimizer
        # state to `memory_bytes`): a member's parameters, gradient,
        # activations and optimizer state, each its share.
        act = float(min(np.nan_to_num(arr.act[i]), arr.table_mem[i, j]))
        p_m = p_split[i] / n + whole if g.sharding == "fsdp" else params[i]
        o_m = o_split[i] / n + opt[i] - o_split[i]
        other = float(arr.other[i, j])
        mem = 2 * p_m + act / n + o_m + other
        workspace = float(arr.ws[i]) / n
        if g.sharding == "fsdp":  # the layer's parameters gathered and its gradient whole
            workspace += 2 * p_split[i] * (1 - 1 / n)
        if g.state == "pinned_host":
            # The state rests in host memory, old and new: the member holds the
            # gradient while the step runs, and the layer's state while it runs.
            mem = p_m + act / n + other
            workspace += p_m + o_m
            time += place(p_m + o_m) * 2
            p_m, o_m = 0.0, 0.0
        out.append({"time": time, "fixed": fixed + coll, "update": update * share,
                    "memory": max(mem, 0.0), "workspace": workspace,
                    "param": p_m, "opt": o_m})
    return out


def _host_link(table: CostTable, arr: Arrays, g: Group):
    """seconds(bytes) of a member's copy between its device and its host memory."""
    d = g.devices[0]
    place = f"{d}:pinned_host"
    link = table.link(place, d) if place in arr.dindex else None
    if link is None:
        cpus = [x.name for x in table.devices if x.kind == "cpu"
                and memory_place(x.name)[1] is None and x.name != d]
        link = table.link(cpus[0], d) if cpus else None
    if link is None:  # a CPU device's own host memory: a copy within the host
        return lambda b: 0.0
    return link.seconds


def partitions(table: CostTable, kinds: Sequence[Sequence[str]]) -> list[list[tuple[str, ...]]]:
    """Each way to cut each device list of `kinds` into two or more equal,
    consecutive groups of two or more devices."""
    out = []
    for names in kinds:
        n = len(names)
        for size in range(2, n // 2 + 1):
            if n % size == 0:
                out.append([tuple(names[k:k + size]) for k in range(0, n, size)])
    return out
