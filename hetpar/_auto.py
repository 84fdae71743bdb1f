"""`@hetpar.auto`: trace, cost, plan, split and run a training step across devices.

The first call with given shapes and dtypes traces the step into layers,
builds its cost table for the devices, solves the placement ILP (or takes
the plan given), splits the step into per-device stages and compiles them.
Later calls with the same shapes reuse all of that; new shapes retrace, as
`jax.jit` does. A plan that puts every layer on one device compiles the
whole step as one `jax.jit` executable on that device: no overhead beyond
`jax.jit`'s own.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from absl import logging

from hetpar._grad import microbatching
from hetpar.core import HetparError, PlanError
from hetpar.cost_models import present_devices
from hetpar.passes import LayerGraph, StageGraph, microbatch_of, split, trace
from hetpar.runtime import Executor, Replicated


@dataclasses.dataclass(frozen=True)
class Options:
    """What `hetpar.auto` was asked for (see `auto`)."""

    devices: tuple[str, ...] | None = None
    objective: str = "time"
    plan: Any = None
    microbatches: int = 1
    batch_argnums: tuple[int, ...] | None = None
    schedule: str = "gpipe"
    profile: Any = "auto"
    depth: int | None = None
    on_missing_device: str = "error"
    data_parallel: bool = True


def _marked(fn: Callable, microbatches: int, batch_argnums: Sequence[int] | None) -> Callable:
    """`fn` with its batch arguments registered for `hetpar.value_and_grad`."""

    @functools.wraps(fn)
    def step(*args):
        nums = (len(args) - 1,) if batch_argnums is None else batch_argnums
        leaves = [leaf for k in nums for leaf in jax.tree_util.tree_leaves(args[k])]
        with microbatching(microbatches, leaves):
            return fn(*args)

    return step


class CompiledStep:
    """A step traced, planned and compiled for one signature of arguments.

    Attributes:
      graph: the LayerGraph of the (microbatch-marked) step.
      table: the CostTable the planner saw (None when the plan was given as a dict).
      plan: the planner's Plan (None when given as a dict).
      assignment: layer -> device name.
      stages: the StageGraph (None on the one-device fast path).
    """

    def __init__(self, fn: Callable, args: tuple, options: Options):
        self.options = options
        m = int(options.microbatches)
        if m < 1:
            raise HetparError(f"microbatches must be >= 1, got {m}")
        self._step = _marked(fn, m, options.batch_argnums)
        self.graph: LayerGraph = trace(self._step, *args, depth=options.depth,
                                       batch_argnums=options.batch_argnums)
        if m > 1 and not any(microbatch_of(str(e.source_info.name_stack)) is not None
                             for e in self.graph.program.eqns):
            raise HetparError(
                f"microbatches={m} needs the step to take its gradient with "
                "hetpar.value_and_grad or hetpar.grad (drop-in replacements for JAX's), "
                "which mark what runs per microbatch.")
        self.devices = present_devices()
        self.table = None
        self.plan = None
        self.assignment = self._assign(options)
        used = sorted(set(self.assignment.values()))
        self.stages: StageGraph | None = None
        self._out_tree = self.graph.program.out_tree
        self._replicated = None
        self._executor = None
        replicas = self.plan.replicas if self.plan is not None else ()
        if replicas:
            absent = [d for d in replicas if d not in self.devices]
            if absent:
                raise PlanError(f"the plan replicates the step over {absent}, which are not "
                                f"present (present: {sorted(self.devices)})")
            # The user's step, not the microbatch-marked one: each replica runs
            # its share of the batch whole.
            self._replicated = Replicated(fn, [self.devices[d] for d in replicas], args,
                                          options.batch_argnums)
            used = list(replicas)
        elif len(used) == 1:
            self._device = self.devices[used[0]]
            sharding = jax.sharding.SingleDeviceSharding(self._device)
            # Explicit shardings in and out: fresh and resident arguments then hit
            # the same executable (jit's cache tells committed inputs apart).
            self._jit = jax.jit(self._step, in_shardings=sharding, out_shardings=sharding)
            self._sharding = sharding
        else:
            self.stages = split(self.graph, self.assignment, schedule=options.schedule)
            self._executor = Executor(self.stages, {d: self.devices[d] for d in used},
                                      _transfer_engine(self.devices, options))
        logging.info("hetpar: %d layers on %s", len(self.graph), used)

    # -- planning ---------------------------------------------------------

    def _candidate_devices(self, options: Options) -> list[str]:
        names = list(options.devices) if options.devices else list(self.devices)
        absent = [d for d in names if d not in self.devices]
        if absent:
            raise PlanError(f"devices {absent} are not present (present: {sorted(self.devices)}); "
                            "to plan for devices that are not here use `hetpar plan` offline")
        return names

    def _assign(self, options: Options) -> dict[str, str]:
        plan = options.plan
        if plan is None:
            return self._solve(options, self._candidate_devices(options))
        from hetpar.planner import Plan

        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if not isinstance(plan, (Plan, Mapping)):
            raise PlanError(f"plan must be a path to plan.json, a hetpar.Plan or a dict "
                            f"{{layer: device}}, got {type(plan).__name__}")
        assignment = dict(plan.assignment if isinstance(plan, Plan) else plan)
        wanted = sorted(set(assignment.values()) | set(getattr(plan, "replicas", ())))
        absent = [d for d in wanted if d not in self.devices]
        if absent:
            if options.on_missing_device == "replan":
                logging.warning("hetpar: plan names devices %s that are not present; replanning "
                                "on %s", absent, sorted(self.devices))
                return self._solve(options, self._candidate_devices(
                    dataclasses.replace(options, devices=None)))
            raise PlanError(f"the plan places layers on {absent}, which are not present here "
                            f"(present: {sorted(self.devices)}). Pass "
                            "on_missing_device='replan' to plan afresh for these devices.")
        if isinstance(plan, Mapping):
            return assignment
        # The plan's fingerprint names the devices it was planned over: those it
        # uses, or (a plan that left some idle) every device given or present.
        table = self._cost_table(wanted, options)
        if plan.fingerprint != table.fingerprint():
            wider = self._cost_table(self._candidate_devices(options), options)
            if plan.fingerprint == wider.fingerprint():
                table = wider
        plan.check(table)
        self.table, self.plan = table, plan
        return dict(plan.assignment)

    def _cost_table(self, devices: list[str], options: Options):
        from hetpar.cost_models import cost_table, load_profiles

        profiles = options.profile
        if profiles in (None, "auto"):
            # A profile file `hetpar profile` wrote, named by the environment;
            # else the spec sheets of the devices' kinds.
            profiles = os.environ.get("HETPAR_PROFILES") or None
        if isinstance(profiles, (str, os.PathLike)):
            profiles = load_profiles(profiles)
        return cost_table(self.graph, devices, profiles=profiles)

    def _solve(self, options: Options, devices: list[str]) -> dict[str, str]:
        from hetpar.planner import plan as solve

        if len(devices) == 1:
            return dict.fromkeys(self.graph.layers, devices[0])
        self.table = self._cost_table(devices, options)
        m = int(options.microbatches)
        self.plan = solve(self.table, objective=options.objective,
                          mode="pipelined" if m > 1 else "sequential", microbatches=m,
                          data_parallel=options.data_parallel, schedule=options.schedule)
        return dict(self.plan.assignment)

    # -- running ----------------------------------------------------------

    def _batch_here(self, args: tuple) -> tuple:
        """`args` with batch arrays committed to another device moved to the plan's one.

        jit would accept them and copy them itself, but by a slow path: a host
        batch made AlexNet's step 4.1x jit's on the H200, against 1x when moved
        with `device_put` first (experiments/results/probe_overhead_h200_run2.txt).
        Numpy batches and resident arrays go to jit untouched (its C++ path).
        """
        nums = self.options.batch_argnums
        nums = (len(args) - 1,) if nums is None else nums
        moved = None
        for i in nums:
            if any(isinstance(x, jax.Array) and x.sharding != self._sharding
                   for x in jax.tree_util.tree_leaves(args[i])):
                moved = moved or list(args)
                moved[i] = jax.device_put(args[i], self._device)
        return args if moved is None else tuple(moved)

    def __call__(self, *args):
        if self._replicated is not None:
            return self._replicated(*args)
        if self._executor is None:
            return self._jit(*self._batch_here(args))
        flat = jax.tree_util.tree_leaves(args)
        return jax.tree_util.tree_unflatten(self._out_tree, self._executor(flat))


def _transfer_engine(devices, options):
    from hetpar.runtime import TransferEngine

    return TransferEngine(names={d: n for n, d in devices.items()})


def _signature(args) -> tuple:
    """What a compiled step is keyed on: the argument structure, shapes and dtypes.

    On every call, so kept cheap (tens of microseconds for a ResNet's state).
    """
    leaves, tree = jax.tree_util.tree_flatten(args)
    try:
        return tree, tuple([(x.shape, x.dtype) for x in leaves])
    except AttributeError:  # Python scalars among the arguments
        return tree, tuple((getattr(x, "shape", None), getattr(x, "dtype", type(x)))
                           for x in leaves)


class AutoStep:
    """A training step under `hetpar.auto`: call it like the original."""

    def __init__(self, fn: Callable, options: Options):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.options = options
        self._compiled: dict[tuple, CompiledStep] = {}
        self._last: CompiledStep | None = None

    def lower(self, *args) -> CompiledStep:
        """Traces, plans and compiles for these arguments without running."""
        key = _signature(args)
        step = self._compiled.get(key)
        if step is None:
            step = self._compiled[key] = CompiledStep(self._fn, args, self.options)
        self._last = step
        return step

    def __call__(self, *args):
        return self.lower(*args)(*args)

    def _need_last(self) -> CompiledStep:
        if self._last is None:
            raise HetparError("call the step (or .lower(*args)) once before asking for its plan")
        return self._last

    @property
    def plan(self):
        """The Plan of the last compiled signature (None when given as a dict)."""
        return self._need_last().plan

    @property
    def assignment(self) -> dict[str, str]:
        return dict(self._need_last().assignment)

    def report(self):
        """The cost report of the last compiled signature's step."""
        from hetpar._report import report_graph

        return report_graph(self._need_last().graph, xla=False)

    def explain(self) -> str:
        """Why each layer is where it is (the planner's explanation)."""
        step = self._need_last()
        if step.plan is None or step.table is None:
            why = ("given in the plan" if self.options.plan is not None
                   else "the only device to plan for")
            return "\n".join(f"{layer}: {dev} ({why})" for layer, dev in step.assignment.items())
        return step.plan.explain(step.table)


def auto(fn: Callable | None = None, *, devices: Sequence[str] | None = None,
         objective: str = "time", plan: Any = None, microbatches: int = 1,
         batch_argnums: Sequence[int] | int | None = None, schedule: str = "gpipe",
         profile: Any = "auto", depth: int | None = None,
         on_missing_device: str = "error", data_parallel: bool = True):
    """Runs a training step across the devices present, placed by hetpar's planner.

    Usable as `@hetpar.auto` or `hetpar.auto(step, devices=[...], ...)`.

    Args:
      fn: the step, e.g. `train_step(params, opt_state, batch)`.
      devices: device names (`cpu:0`, `gpu:0`) to use; default all present.
      objective: "time", "cost" or "energy".
      plan: a path to plan.json, a `hetpar.Plan`, or a dict {layer: device}
        (layer names as `hetpar.trace(fn, *args).layers`); default: solve.
      microbatches: with M > 1 and a step that takes its gradient with
        `hetpar.value_and_grad`/`hetpar.grad`, the gradient part runs as M
        microbatches through the device pipeline and the update runs once.
      batch_argnums: which arguments of `fn` are batch data (default: the last).
      schedule: "gpipe" or "1f1b".
      profile: "auto" (the profile file named by $HETPAR_PROFILES, else spec
        sheets), a path to a `hetpar profile` file, or a ProfileSet.
      depth: module-path depth naming layers (see `hetpar.trace`).
      on_missing_device: "error", or "replan" to plan afresh when a loaded
        plan names devices that are not present.
      data_parallel: let the planner choose to run the whole step data
        parallel over two or more accelerators of one kind (batch split, state
        replicated, `Plan.replicas`) when it predicts that faster (or cheaper)
        than any placement of layers. False: layer placements only.

    Returns:
      An `AutoStep`: call it like `fn`; it has `.plan`, `.report()`,
      `.explain()` and `.lower(*args)`.
    """
    if isinstance(batch_argnums, int):
        batch_argnums = (batch_argnums,)
    options = Options(tuple(devices) if devices else None, objective, plan, microbatches,
                      tuple(batch_argnums) if batch_argnums is not None else None, schedule,
                      profile, depth, on_missing_device, bool(data_parallel))
    if on_missing_device not in ("error", "replan"):
        raise HetparError("on_missing_device must be 'error' or 'replan'")
    if fn is None:
        return functools.partial(_wrap, options=options)
    return _wrap(fn, options)


def _wrap(fn: Callable, options: Options) -> AutoStep:
    return AutoStep(fn, options)
