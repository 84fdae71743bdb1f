"""Runs a plan whose stages compute on device groups: a pipeline of sharded groups.

A group plan (`Plan.groups`) places layers on groups of devices of one kind
(`cpu:0+cpu:1`) instead of single devices; `passes.split` cuts the step into
stages by group name as it does by device name, so the first half of the
layers may be one group's stages and the rest another's, microbatched under
GPipe or 1F1B as any pipeline. Each stage is one `jax.jit` over its group's
`Mesh` (axis "replica"), data parallel inside the group:

* state (a program input whose role is "param" or "opt_state", and the new
  state the step returns for it) is laid out as `Sharded` lays it out: split
  on its largest axis the group size divides (`shard_axis`), the parameters
  only under "fsdp", the optimizer state under "zero1" and "fsdp"; a leaf no
  axis divides stays replicated;
* a value whose leading axis is a batch's or a microbatch's rows (the batch,
  activations, their cotangents) is split on that axis: each member computes
  its rows;
* any other value with an axis the group divides (a layer's gradient
  between its backward and the update) is split as state is, so the
  gradient is reduce-scattered, not all-reduced; scalars are replicated.

Nothing is moved by a hand-written collective: every stage's in and out
shardings say where its values live, XLA's SPMD partitioner inserts the
all-gathers and reduce-scatters inside the group, and a value crossing from
one group to the next is one `jax.device_put` to the consumer's sharding
(member i of one group sends its rows to member i of the next where the
layouts agree). A single device in such a plan is a group of one.

Offload (`offload`): a group's state kept in host memory between steps, each
member's shard in its own device's `pinned_host` memory (ZeRO-Infinity's
layout; on CPU devices too, as the offload plans run there). A stage reading
it brings its shards in (`device_put` to the stage's device sharding) and
the new state goes back as soon as the stage that made it is dispatched.

Dispatch: the stages are dispatched from the calling thread in one global
order that keeps every group's schedule order (`global_order`); JAX's
asynchronous dispatch lets groups on different devices run at once. (The
`Executor`'s per-device worker threads and streaming prefetch are not used
here: see docs/architecture/status.md.) Donation (`donate`) gives each
donated input up at its last reader; `stage_memory` (each stage's compiled
memory analysis) is what the check before the first step replays
(`hetpar._memory_check.group_peaks`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetpar.core import PlanError
from hetpar.passes import StageGraph
from hetpar.runtime._network import global_order
from hetpar.runtime._sharded import STAGES, shard_axis

#: What a group does with its state: replicated (None), "zero1" or "fsdp".
GROUP_SHARDINGS = (None, *STAGES)


class _Group:
    """One group's mesh and layout rules."""

    def __init__(self, devices: Sequence[jax.Device], sharding: str | None,
                 batch_rows: frozenset[int], offload: bool):
        self.mesh = Mesh(np.array(list(devices)), ("replica",))
        self.size = len(devices)
        self.sharding = sharding
        self.rows = batch_rows
        self.offload = offload
        self.replicated = NamedSharding(self.mesh, PartitionSpec())

    def split_on(self, axis: int | None) -> NamedSharding:
        if axis is None or self.size == 1:
            return self.replicated
        return NamedSharding(self.mesh, PartitionSpec(*[None] * axis, "replica"))

    def layout(self, aval, role: str | None) -> NamedSharding:
        """Where a value of `aval` lives on this group (module docstring)."""
        shape = tuple(aval.shape)
        if role == "param" and self.sharding != "fsdp":
            return self.replicated
        if role == "opt_state" and self.sharding is None:
            return self.replicated
        if role is None and shape and shape[0] in self.rows and shape[0] % self.size == 0:
            return self.split_on(0)
        if role is None and self.sharding is None:
            return self.replicated
        return self.split_on(shard_axis(shape, self.size))

    def home(self, aval, role: str | None) -> NamedSharding:
        """Where a state value rests between steps: its layout, in its
        devices' pinned host memory when the group offloads its state."""
        s = self.layout(aval, role)
        if self.offload and role in ("param", "opt_state"):
            return s.with_memory_kind("pinned_host")
        return s


def output_roles(graph) -> list[str | None]:
    """Per flat output of the step, the role of the state argument it is the
    new value of ("param", "opt_state"), or None (a loss, a metric).

    An element of the returned tuple (or the whole result) is a state
    argument's new value where it has that argument's structure, shapes and
    dtypes, as `Sharded.out_shardings` matches them."""
    program = graph.program
    invars = program.jaxpr.jaxpr.invars
    roles = list(graph.input_roles)
    like: dict = {}
    start = 0
    for child in program.in_tree.children():
        k = child.num_leaves
        leaf_roles = roles[start:start + k]
        if leaf_roles and "batch" not in leaf_roles:
            sig = (child, tuple((tuple(v.aval.shape), str(v.aval.dtype))
                                for v in invars[start:start + k]))
            like.setdefault(sig, leaf_roles)
        start += k
    outvars = program.jaxpr.jaxpr.outvars
    out_tree = program.out_tree
    whole = (out_tree, tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in outvars))
    if whole in like:
        return list(like[whole])
    children = out_tree.children() if out_tree.num_nodes > 1 else [out_tree]
    out: list[str | None] = []
    start = 0
    for child in children:
        k = child.num_leaves
        sig = (child, tuple((tuple(v.aval.shape), str(v.aval.dtype))
                            for v in outvars[start:start + k]))
        out += list(like.get(sig, [None] * k))
        start += k
    return out if len(out) == len(outvars) else [None] * len(outvars)


class GroupRunner:
    """Compiles a StageGraph's stages over their groups' meshes and runs them.

    Args:
      stages: the split step; every stage's device is a key of `groups`.
      groups: {group name: its jax devices} (a single device: a list of one).
      sharding: {group name: None, "zero1" or "fsdp"}.
      batch_rows: the leading-axis sizes of the batch and its microbatches:
        values with such a leading axis are split over a group's members.
      offload: groups whose state rests in their devices' pinned host memory.
      donate: positions of the step's flat inputs it donates (the leaves of
        `donate_argnums`): each is given up by its last reader, as the
        `Executor` gives it up. Where that stage reads it laid out as it
        rests, the stage's executable takes it donated (XLA may write the
        new state into it); else it is deleted once that stage was
        dispatched (JAX frees it when the reads are done). The caller's
        donated arrays end the step deleted, as `jax.jit` leaves them.

    Raises:
      PlanError: a stage on a group not in `groups`, or a group offloading
        on devices without pinned host memory.
    """

    def __init__(self, stages: StageGraph, groups: Mapping[str, Sequence[jax.Device]],
                 sharding: Mapping[str, str | None], batch_rows: frozenset[int],
                 offload: Sequence[str] = (), donate: Sequence[int] = ()):
        self.stages = stages
        unknown = sorted({st.device for st in stages.stages} - set(groups))
        if unknown:
            raise PlanError(f"stages compute on {unknown}, which name no group of the plan")
        for g in offload:
            lacking = [str(d) for d in groups[g]
                       if "pinned_host" not in {m.kind for m in d.addressable_memories()}]
            if lacking:
                raise PlanError(f"group {g} keeps its state in pinned host memory, which "
                                f"{', '.join(lacking)} lack")
        self.groups = {name: _Group(devs, sharding.get(name), batch_rows, name in offload)
                       for name, devs in groups.items()}
        # (For the step's callers: a name's first device, as the Executor's map.)
        self.devices = {name: devs[0] for name, devs in groups.items()}
        self.local = list(stages.device_order)
        jaxpr = stages.graph.program.jaxpr.jaxpr
        self._invars = list(jaxpr.invars)
        self._outvars = list(jaxpr.outvars)
        role = dict(zip(self._invars, stages.graph.input_roles))
        self._out_roles = output_roles(stages.graph)
        for v, r in zip(self._outvars, self._out_roles):
            if isinstance(v, jcore.Var) and r is not None:
                role.setdefault(v, r)
        self._role = {v: r for v, r in role.items() if r in ("param", "opt_state")}
        self._order = global_order(stages.device_order, stages.stages)
        self._home = {v: self.groups[d].home(v.aval, self._role.get(v))
                      for v, d in zip(self._invars, stages.input_devices)
                      if d in self.groups}
        made = {v: st.device for st in stages.stages for v in st.outputs}
        # The new state goes where its group keeps state (host memory when offloaded).
        self._send_home = {v: self.groups[made[v]].home(v.aval, self._role.get(v))
                           for v in self._outvars
                           if isinstance(v, jcore.Var) and v in made
                           and self.groups[made[v]].offload and v in self._role}
        # Donation: each donated input's last reader (in dispatch order)
        # takes it donated where it reads it as it rests, else deletes it.
        last: dict = {}
        for i in self._order:
            for v in stages.stages[i].inputs:
                last[v] = i
        wanted = {self._invars[k] for k in donate} - set(self._outvars)
        self.donated = frozenset(v for v in wanted if v in last)
        donate_at: dict[int, list[int]] = {}
        self._give_up: dict[int, list] = {}  # stage -> donated inputs it reads last
        for v in self.donated:
            i = last[v]
            st = stages.stages[i]
            g = self.groups[st.device]
            self._give_up.setdefault(i, []).append(v)
            rests = self._home.get(v)
            if rests is not None and st.inputs.count(v) == 1 and \
                    rests == g.layout(v.aval, self._role.get(v)):
                donate_at.setdefault(i, []).append(st.inputs.index(v))
        self._donating = frozenset(donate_at)
        self._in = []
        self._out = []
        self.compiled = []
        # Per stage, XLA's memory analysis of its executable (per member:
        # one SPMD program), None where the backend gives none.
        self.stage_memory = []
        for st in stages.stages:
            g = self.groups[st.device]
            ins = [g.layout(v.aval, self._role.get(v)) for v in st.inputs]
            outs = [g.layout(v.aval, self._role.get(v)) for v in st.outputs]
            fn = jax.jit(jcore.jaxpr_as_fun(st.jaxpr), in_shardings=ins, out_shardings=outs,
                         donate_argnums=tuple(sorted(donate_at.get(st.index, ()))))
            specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=s)
                     for v, s in zip(st.inputs, ins)]
            with warnings.catch_warnings():
                # A donated input no output can reuse is still given up.
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                executable = fn.lower(*specs).compile()
            try:
                self.stage_memory.append(executable.memory_analysis())
            except Exception:  # noqa: BLE001 - a backend without memory analysis
                self.stage_memory.append(None)
            self._in.append(ins)
            self._out.append(outs)
            self.compiled.append(fn)
        # Values are dropped once their last reader is dispatched.
        readers: dict = {}
        for st in stages.stages:
            for v in st.inputs:
                readers[v] = readers.get(v, 0) + 1
        kept = set(self._outvars) | set(self._invars)
        self._readers = {v: n for v, n in readers.items() if v not in kept}

    def layout_of(self, name: str, var) -> NamedSharding:
        """Where `var` lives on group `name` (for tests and reports)."""
        return self.groups[name].layout(var.aval, self._role.get(var))

    def place_inputs(self, flat_args: Sequence, only: Sequence[int] | None = None) -> list:
        """The step's inputs moved to where the plan keeps them between steps
        (`only`: those positions only)."""
        out = list(flat_args)
        wanted = range(len(flat_args)) if only is None else only
        at = [i for i in wanted if self._invars[i] in self._home
              and not _laid_out(flat_args[i], self._home[self._invars[i]])]
        moved = jax.device_put([flat_args[i] for i in at], [self._home[self._invars[i]]
                                                            for i in at])
        for i, y in zip(at, moved):
            out[i] = y
        return out

    def __call__(self, flat_args: Sequence) -> list:
        for x in flat_args:
            # Before any stage runs: a deleted buffer handed to a stage's
            # executable (state donated to an earlier step) crashed the
            # process (CPU, jax 0.10), where jax.jit raises this.
            if isinstance(x, jax.Array) and x.is_deleted():
                raise RuntimeError(f"Array has been deleted with shape={x.aval.str_short()}.")
        env = dict(zip(self._invars, flat_args))
        left = dict(self._readers)
        for i in self._order:
            st = self.stages.stages[i]
            args = [env[v] for v in st.inputs]
            want = self._in[i]
            at = [k for k, (x, s) in enumerate(zip(args, want)) if not _laid_out(x, s)]
            if at:  # one batched put: from another group, host memory, or the caller
                for k, y in zip(at, jax.device_put([args[k] for k in at],
                                                   [want[k] for k in at])):
                    args[k] = y
            if i in self._donating:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                    outs = self.compiled[i](*args)
            else:
                outs = self.compiled[i](*args)
            for v, y in zip(st.outputs, outs):
                env[v] = jax.device_put(y, self._send_home[v]) if v in self._send_home else y
            for v in self._give_up.get(i, ()):
                # Not taken donated (read from elsewhere, or moved for its
                # stage): the caller's buffer goes once its last reader was
                # dispatched.
                x = env[v]
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
            for v in st.inputs:
                if v in left:
                    left[v] -= 1
                    if not left[v]:
                        del env[v]
        return [env[v] if isinstance(v, jcore.Var) else v.val for v in self._outvars]


def _laid_out(x, sharding) -> bool:
    return isinstance(x, jax.Array) and x.committed and x.sharding == sharding
