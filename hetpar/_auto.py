"""`@hetpar.auto`: trace, cost, plan, split and run a training step across devices.

The first call with given shapes and dtypes traces the step into layers,
builds its cost table for the devices, solves the placement ILP (or takes
the plan given), splits the step into per-device stages and compiles them.
Later calls with the same shapes reuse all of that; new shapes retrace, as
`jax.jit` does. A plan that puts every layer on one device compiles the
whole step as one `jax.jit` executable on that device, and later calls go
straight to it (`AutoStep.__call__`): jit's own C++ signature check is the
only one, so the step costs what `jax.jit`'s does.

Leaves of the arguments that are not arrays or Python numbers (an Equinox
model's activation function) are static, as under `eqx.filter_jit`: part of
the signature, compared by equality (identity when unhashable), closed over
when tracing; the result's are returned as the trace produced them
(`StaticLeaves`, passes/_program.py).

Flax NNX objects among the arguments (a Module, an Optimizer, Rngs: any
`nnx.Pytree`) are handled as `nnx.jit` handles them: split into a GraphDef
and their state before the call, merged back inside the step, and updated
in place with the state the step leaves them in.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from hetpar._grad import is_key, microbatched
from hetpar.core import (
    HetparError,
    InfeasibleError,
    Placement,
    PlanError,
    is_memory_place,
    memory_place,
    nbytes,
    parse_placements,
    seconds,
)
from hetpar.cost_models import live_capacity, present_devices

# The planner (and pulp) load with this module, not lazily inside a call:
# pulp keeps a traceback from an optional solver it fails to load, and a
# traceback's frames hold their callers' frames, so a first import under a
# step's first call pinned that call's arguments (a 40 GB optimizer state on
# the GPU) for the life of the process.
import hetpar.planner  # noqa: E402,F401  isort: skip
from hetpar._calibration import (
    allreduce_across_processes_s,
    profiles_of,
    runtime_costs,
    whole_step_s,
)
from hetpar._host_memory import warn_without_huge_pages
from hetpar._nnx_args import NNX_MARK, NnxArgs, NnxFastCall
from hetpar._options import Options, check_places, check_present, is_int
from hetpar._recovery import (
    CHECKED_STEPS,
    MAX_REPLANS,
    OutOfMemoryError,
    OutOfMemoryWarning,
    bytes_wanted,
    failed_device,
    give_up,
    is_out_of_memory,
    ready,
    smaller_cap,
)
from hetpar._signature import batch_positions, donated_positions, fast_signature, signature
from hetpar._step_clock import StepClock
from hetpar.passes import (
    LayerGraph,
    StageGraph,
    StaticLeaves,
    batch_argnums_of,
    check_covers,
    microbatch_of,
    split,
    static_where,
    trace,
)
from hetpar.runtime import Executor, Replicated, TransferEngine, Workers


def _untimed_used(plan, table) -> frozenset[tuple[str, str]]:
    """(layer, device) pairs the plan computes on that `table` left predicted
    (`meta["kept_predicted"]`, profile="measure"'s TimingBudget)."""
    kept = table.meta.get("kept_predicted", {})
    return frozenset((n, p.compute) for n, p in plan.placements.items()
                     if p.compute in kept.get(n, ()))


def _untimed_steps(plan, table) -> frozenset[str]:
    """Device kinds whose whole step `table` left untimed (`untimed_kinds`)
    on which the plan spends at least half its predicted step: their layers,
    timed alone, are scaled to no step of theirs."""
    untimed = set(table.meta.get("untimed_kinds", ()))
    if plan.predicted is None or not untimed:
        return frozenset()
    busy: dict[str, float] = {}
    for name, s in plan.predicted.busy_s.items():
        kind = table.device(name).kind
        if kind in untimed:
            busy[kind] = busy.get(kind, 0.0) + s
    step = plan.predicted.step_time_s
    return frozenset(k for k, s in busy.items() if s >= 0.5 * step)


class CompiledStep:
    """A step traced, planned and compiled for one signature of arguments.

    Attributes:
      graph: the LayerGraph of the (microbatch-marked) step.
      table: the CostTable the planner saw; for a plan given as a dict, the one
        `predicted()` costed it on (None until asked).
      plan: the planner's Plan (None when given as a dict).
      assignment: layer -> device name.
      stages: the StageGraph (None on the one-device fast path).
    """

    def __init__(self, fn: Callable, args: tuple, options: Options,
                 workers: Workers | None = None):
        if options.batch_argnums is None:
            # Found once, here, for every path below (a share per process, the
            # replicas' split, microbatches): a batch of two arguments, `x` and
            # `y` of step(params, opt_state, x, y), is cut as one.
            options = dataclasses.replace(options, batch_argnums=batch_argnums_of(args))
        self.options = options
        self.clock = StepClock()
        self.devices = present_devices()
        check_present(options.devices, self.devices)
        self.plan_fingerprint: str | None = None
        if isinstance(options.plan, (str, os.PathLike)):  # read once, not per check
            from hetpar.planner import Plan

            options = dataclasses.replace(options, plan=Plan.load(options.plan))
        multi = jax.process_count() > 1
        self._share = None
        if multi and options.hierarchical is True:
            # Each process runs the per-host plan on its rows of the batch.
            self._share = _BatchShare(args, options)
            args = self._share(args)
        elif multi and (options.batch == "local" or _replicates(options.plan)
                        or (options.data_parallel == "always" and options.plan is None)):
            # Each process passes its share of the batch: only data parallel takes that.
            self._init_across_processes(fn, args, options)
            return
        m = options.microbatches
        self._nargs = len(args)
        self._batch_argnums = batch_positions(options.batch_argnums, len(args))
        self._donated = donated_positions(options.donate_argnums, len(args))
        step = microbatched(fn, m, self._batch_argnums)
        # Non-array leaves (an Equinox model's activation function) are closed
        # over, as eqx.filter_jit does: the graph and every runtime see arrays.
        static = StaticLeaves(step, args)
        # `trace` reads None as "the last argument, unless it is the only one".
        self.graph: LayerGraph = trace(static.pure_step, *static.pure_args,
                                       depth=options.depth, batch_argnums=options.batch_argnums)
        self._static = static if static.any else None
        self._step = step if self._static is None else static.pure_step
        user_args, args = args, static.pure_args
        # profile="measure" times the step on these, while planning only (kept,
        # they would hold the caller's old state alive).
        self._calibration_args = args if options.profile == "measure" else None
        if m > 1 and not any(microbatch_of(str(e.source_info.name_stack)) is not None
                             for e in self.graph.program.eqns):
            raise HetparError(
                f"microbatches={m} needs the step to take its gradient with "
                "hetpar.value_and_grad or hetpar.grad (drop-in replacements for JAX's), "
                "which mark what runs per microbatch.")
        self.table = None
        self.plan = None
        self._given_prediction = None
        self._whole_steps: dict = {}  # profile="measure"'s whole-step timings, while planning
        self.placements: dict[str, Placement] = parse_placements(self._assign(options))
        if self._share is not None and self.plan is not None:
            if self.plan.replicas:
                raise PlanError("a hierarchical plan places layers within each process; this "
                                "plan replicates the step (data parallel), which "
                                "hierarchical=False runs across every process's devices")
            self.plan = self._with_allreduce(self.plan, options)
        elif (multi and options.hierarchical == "auto" and options.plan is None
              and options.objective == "time" and self.plan is not None):
            alternative = self._hierarchical_step_s(fn, user_args, options)
            if alternative is not None and alternative < self.plan.predicted.step_time_s:
                logging.info("hetpar: a hierarchical plan (predicted %.3g s) beats the plan over "
                             "every process's devices (%.3g s)", alternative,
                             self.plan.predicted.step_time_s)
                self.__init__(fn, user_args, dataclasses.replace(options, hierarchical=True),
                              workers)
                return
        if multi and self.plan is not None and self.plan.replicas:
            # The planner chose data parallel across processes: its own path.
            self._init_across_processes(fn, user_args, options, plan=self.plan)
            return
        self.assignment = {layer: p.compute for layer, p in self.placements.items()}
        used = sorted({d for p in self.placements.values() for d in p.devices})
        self.stages: StageGraph | None = None
        self._out_tree = self.graph.program.out_tree
        self._replicated = None
        self._replicated_known = None
        self._executor = None
        self._checked_steps = 0  # calls whose results were waited for (`ready`)
        self._jit = None
        replicas = self.plan.replicas if self.plan is not None else ()
        if replicas:
            absent = [d for d in replicas if d not in self.devices]
            if absent:
                raise PlanError(f"the plan replicates the step over {absent}, which are not "
                                f"present (present: {sorted(self.devices)})")
            # The user's step, not the microbatch-marked one: each replica runs
            # its share of the batch whole.
            if self._static is not None:
                self._static = StaticLeaves(fn, user_args)
                fn = self._static.pure_step
            self._replicated = Replicated(fn, [self.devices[d] for d in replicas], args,
                                          self._batch_argnums,
                                          donate_argnums=() if self._static else self._donated)
            if self._static is None and not multi:
                # Later calls with these leaves' shapes and dtypes go straight
                # to its jit (`call_known`): the full path's checks of GPT-2's
                # 446 leaves cost more than a batch-16 step's GPU time.
                self._replicated_known = fast_signature(args)
            used = list(replicas)
        elif (len(used) == 1 and not multi
              and all(p.activations == "keep" for p in self.placements.values())):
            # (A layer that offloads or recomputes its activations needs its
            # forward and backward in stages apart: the split path below.)
            self._device = self.devices[used[0]]
            sharding = jax.sharding.SingleDeviceSharding(self._device)
            # Explicit shardings in and out: fresh and resident arguments then hit
            # the same executable (jit's cache tells committed inputs apart).
            # With static leaves, jit takes the traced leaves as one flat list.
            jitted = self._step if self._static is None else self._static.flat_step
            # Flat positions of the batch arguments' leaves, static leaves counted.
            ends = list(itertools.accumulate(len(jax.tree_util.tree_leaves(a))
                                             for a in user_args))
            starts = [0, *ends[:-1]]
            donate = self._donated
            if self._static is not None and donate:  # jit takes the traced leaves flat
                fixed = set(static_where(user_args))
                traced = [i for i in range(ends[-1]) if i not in fixed]
                donate = tuple(j for j, i in enumerate(traced)
                               if any(starts[k] <= i < ends[k] for k in self._donated))
            self._jit = jax.jit(_traced_when_known(jitted), in_shardings=sharding,
                                out_shardings=sharding, donate_argnums=donate)
            self._sharding = self._placed_like = sharding
            self._batch_leaves = tuple(i for k in self._batch_argnums
                                       for i in range(starts[k], ends[k]))
        elif self._share is not None:
            self.stages = split(self.graph, self.placements, schedule=options.schedule,
                                update_apart=True)
            mine, across = _hierarchical_devices(used, self.devices)
            self._executor = Executor(self.stages, mine, TransferEngine(), workers,
                                      across=across)
        else:
            if multi:
                self._check_placements_across()
            if self._donated:
                logging.warning("hetpar: donate_argnums: a plan split over %s does not donate "
                                "its arguments yet; the old and the new state coexist during "
                                "a step, as the planner counts them", used)
            self.stages = split(self.graph, self.placements, schedule=options.schedule)
            self._executor = Executor(self.stages,
                                      {d: self.devices[memory_place(d)[0]] for d in used},
                                      TransferEngine(), workers)
        if multi:
            self._check_across_processes()
        if self._executor is not None:
            # The platforms that compute here (a CPU that only holds state computes nothing).
            ex = self._executor
            warn_without_huge_pages(ex.devices[d].platform for d in ex.local
                                    if ex.stages.device_order[d])
        if self._calibration_args is not None:
            self.predicted()  # a step nothing planned is costed now, while the arguments are here
            self._calibration_args = None
        logging.info("hetpar: %d layers on %s", len(self.graph), used)

    def _check_across_processes(self) -> None:
        """A layer plan under several processes: each process runs its devices'
        stages, and values cross by collectives (hetpar.runtime._network). Every
        process must have planned the same (a collective compares fingerprints)."""
        self.plan_fingerprint = _plan_fingerprint(self.plan, self.graph, self.placements,
                                                  self.options.microbatches)
        from hetpar._distributed import check_same_on_all_processes

        check_same_on_all_processes(
            self.plan_fingerprint, "the plan",
            hint="every process must run the same step on arguments of the same shapes, with "
                 "the same hetpar.auto options, plan and profiles")

    def _check_placements_across(self) -> None:
        """Each layer's devices belong to one process (its state is not sent
        between processes every step)."""
        for layer, p in self.placements.items():
            owners = {self.devices[memory_place(d)[0]].process_index for d in p.devices}
            if len(owners) > 1:
                raise PlanError(f"layer {layer!r} computes on {p.compute} and keeps its state "
                                f"on {p.state}: devices of different processes. Across "
                                "processes a layer's state stays on its compute device's "
                                "process")

    def _init_across_processes(self, fn: Callable, args: tuple, options: Options,
                               plan=None) -> None:
        """Several processes (`jax.distributed`), data parallel: the whole step
        over devices of every process (the planner's `plan`, a plan given with
        `replicas`, or with `batch="local"` every device of the default backend).

        Every process runs this at its first call with these shapes, with the
        same arguments' shapes, options and devices; the plan's fingerprint is
        compared across the processes (a collective: all of them must get here).
        """
        self._nargs = len(args)
        self._batch_argnums = batch_positions(options.batch_argnums, len(args))
        self._given_prediction = None
        self.stages = None
        self._executor = None
        self._jit = None
        self._replicated_known = None
        chosen, table = plan, self.table if plan is not None else None
        if plan is not None:
            options = dataclasses.replace(options, plan=plan)
        replicas = self._replicas_across_processes(options)
        static = StaticLeaves(fn, args)
        self._static = static if static.any else None
        self._step = fn if self._static is None else static.pure_step
        self._replicated = Replicated(self._step, [self.devices[d] for d in replicas],
                                      static.pure_args, self._batch_argnums, batch=options.batch)
        # Traced on the global shapes (batch="local": each process holds 1/P of the batch).
        self.graph: LayerGraph = trace(self._step,
                                       *self._replicated.global_shapes(static.pure_args),
                                       depth=options.depth, batch_argnums=options.batch_argnums)
        self._out_tree = self.graph.program.out_tree
        if chosen is not None:  # the planner's, on the table it saw
            self.table, plan = table, chosen
        elif isinstance(options.plan, (str, os.PathLike)) or hasattr(options.plan, "replicas"):
            self.table = self._cost_table(list(replicas), options)
            from hetpar.planner import Plan

            plan = options.plan if hasattr(options.plan, "replicas") else Plan.load(options.plan)
            plan.check(self.table)
        else:
            self.table = self._cost_table(list(replicas), options)
            plan = self._data_parallel_plan(replicas, options)
        self.plan = plan
        self.placements = dict(plan.placements)
        self.assignment = {layer: p.compute for layer, p in self.placements.items()}
        self.plan_fingerprint = _plan_fingerprint(plan, self.graph)
        from hetpar._distributed import check_same_on_all_processes

        check_same_on_all_processes(
            self.plan_fingerprint, "the plan",
            hint="every process must run the same step on arguments of the same shapes, with "
                 "the same hetpar.auto options, plan and profiles")
        logging.info("hetpar: %d layers data parallel over %s (%d processes)", len(self.graph),
                     list(replicas), jax.process_count())

    def _replicas_across_processes(self, options: Options) -> tuple[str, ...]:
        """The replicas of a multi-process step: the plan's, `devices`, or every
        device of the default backend on every process (`jax.devices()`)."""
        n = jax.process_count()
        plan = options.plan
        if plan is not None:
            from hetpar.planner import Plan

            if isinstance(plan, (str, os.PathLike)):
                plan = Plan.load(plan)
            if not isinstance(plan, Plan) or not plan.replicas:
                raise PlanError(
                    "with batch='local' each process passes its share of the batch, which "
                    "only a data-parallel plan takes (a pipeline's first stage reads the "
                    "whole batch); this plan places layers. Pass the whole batch on every "
                    "process (batch='global', the default), or a plan with `replicas`.")
            replicas = tuple(plan.replicas)
        else:
            if not options.data_parallel:
                raise HetparError(
                    "with batch='local' each process passes its share of the batch, which "
                    "only data parallel takes (a pipeline's first stage reads the whole "
                    "batch); data_parallel=False asks for layer placements. Pass the whole "
                    "batch on every process (batch='global', the default).")
            from hetpar._distributed import device_names

            replicas = (tuple(options.devices) if options.devices
                        else tuple(device_names(jax.devices())))
        absent = [d for d in replicas if d not in self.devices]
        if absent:
            raise PlanError(f"the plan replicates the step over {absent}, which are not "
                            f"present (present: {sorted(self.devices)})")
        if len(replicas) < 2:
            raise PlanError(f"under several processes ({n}) hetpar.auto replicates the step over "
                            f"two or more devices; got {list(replicas)}")
        idle = sorted(set(range(n)) - {self.devices[d].process_index for d in replicas})
        if idle:
            raise PlanError(f"the replicas {list(replicas)} leave processes {idle} without a "
                            "device; every process runs the step, so each must hold at least "
                            "one replica")
        from hetpar.cost_models import spec_kind_of

        kinds = sorted({spec_kind_of(self.devices[d]) for d in replicas})
        if len(kinds) > 1:
            raise PlanError(f"data parallel across processes needs devices of one kind; "
                            f"{list(replicas)} are of kinds {kinds}")
        return replicas

    def _data_parallel_plan(self, replicas: tuple[str, ...], options: Options):
        """The Plan running the whole step data parallel over `replicas`, predicted
        on `self.table` (no ILP)."""
        from hetpar.planner import Plan, evaluate_data_parallel

        predicted = evaluate_data_parallel(self.table, replicas)
        return Plan(fingerprint=self.table.fingerprint(), mode="sequential",
                    objective=options.objective, microbatches=1,
                    assignment=dict.fromkeys(self.graph.layers, replicas[0]),
                    predicted=predicted,
                    solver={"name": "none", "status": "given",
                            "chosen": "data parallel " + "+".join(replicas)},
                    replicas=replicas, devices=self.table.device_names)

    # -- planning ---------------------------------------------------------

    def _candidate_devices(self, options: Options) -> list[str]:
        # Options checked that the devices given are present.
        if options.devices:
            return list(options.devices)
        if jax.process_count() > 1:
            # Every process's devices of the default backend: the same list on
            # every process (a GPU process lists only its own CPU device); a
            # hierarchical plan's are process 0's (each process maps them to its own).
            from hetpar._distributed import device_names

            names = device_names(jax.devices())
            if options.hierarchical:
                names = [n for n in names if n.startswith("p0/")]
            return names
        return list(self.devices)

    def _assign(self, options: Options) -> Mapping[str, str | Placement]:
        # A malformed profile file fails here, where one device or a plan dict
        # builds no cost table, not at report() after training.
        self._profile_set(options)
        plan = options.plan
        if plan is None:
            return self._solve(options, self._candidate_devices(options))
        from hetpar.planner import Plan

        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if isinstance(plan, Mapping):
            check_covers(self.graph, plan)
        assignment = dict(plan.placements if isinstance(plan, Plan) else parse_placements(plan))
        wanted = sorted({d for p in assignment.values() for d in p.devices}
                        | set(getattr(plan, "replicas", ())))
        check_places(wanted, self.devices)
        absent = [d for d in wanted if memory_place(d)[0] not in self.devices]
        # A plan file's fingerprint covers every device it was planned over,
        # idle ones too: one absent here rejects it as surely as a used one.
        absent += [d for d in getattr(plan, "devices", ())
                   if not is_memory_place(d) and d not in self.devices and d not in absent]
        if absent:
            if options.on_missing_device == "replan":
                devices = self._candidate_devices(options)  # within devices=, if given
                logging.warning("hetpar: plan names devices %s that are not present; replanning "
                                "on %s", absent, devices)
                return self._solve(options, devices)
            used = [d for d in absent if d in wanted]
            raise PlanError(
                (f"the plan places layers on {used}" if used else
                 f"the plan was planned over {list(plan.devices)}, its fingerprint covering "
                 "them all")
                + f"; {', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not present "
                f"here (present: {', '.join(sorted(self.devices))})",
                api="pass on_missing_device='replan' to plan afresh for these devices",
                cli="leave --plan out to plan afresh for these devices, or re-plan for them "
                    "with `hetpar plan`")
        if options.devices:
            # devices= says where the step may run: a plan reaching past it is a
            # mistake to report, not a placement to run silently.
            outside = [d for d in wanted if memory_place(d)[0] not in options.devices]
            if outside:
                raise PlanError(
                    f"the plan places layers on {outside}, which the devices given "
                    f"({', '.join(options.devices)}) leave out",
                    api="add them to devices=, or place those layers on the devices given",
                    cli="add them to --devices, or leave --devices out")
        if isinstance(plan, Mapping):
            return assignment
        # The plan's fingerprint names the devices it was planned over: those it
        # records (idle ones too), or, in a plan from before it recorded them,
        # those it uses or every device given or present.
        # (Memory places in it come with their devices' table.)
        recorded = [d for d in plan.devices if not is_memory_place(d)]
        over = [d for d in recorded if d in self.devices]
        table = self._cost_table(over if len(over) == len(recorded) > 0 else wanted, options)
        if plan.fingerprint != table.fingerprint():
            wider = self._cost_table(self._candidate_devices(options), options)
            if plan.fingerprint == wider.fingerprint():
                table = wider
        plan.check(table)
        self.table, self.plan = table, plan
        return dict(plan.placements)

    def _profile_set(self, options: Options):
        """The profiles this step's tables come from (`profiles_of`), read once."""
        if not hasattr(self, "_profiles"):
            self._profiles = profiles_of(options)
        return self._profiles

    def _cost_table(self, devices: list[str], options: Options, graph: LayerGraph | None = None,
                    timed: frozenset[tuple[str, str]] = frozenset(),
                    steps: frozenset[str] = frozenset()):
        from hetpar.cost_models import TimingBudget, cost_table

        calibrate = (options.profile == "measure" and graph is None
                     and self._calibration_args is not None)
        # profile="measure" times each layer alone on the present devices
        # (cached on disk by its jaxpr), then scales them to the whole step:
        # the roofline's layer shares put a pipeline's cut 10% off on GPT-2.
        # Far slower devices stay predicted, but for the `timed` pairs and
        # the whole step on the `steps` kinds.
        budget = TimingBudget(timed=timed, steps=steps)
        table = cost_table(graph or self.graph, devices, profiles=self._profile_set(options),
                           measure=calibrate, budget=budget,
                           progress=(lambda line: logging.info("hetpar: %s", line))
                           if calibrate else None)
        if calibrate:
            table = self._calibrated(table, budget)
        return table

    def _calibrated(self, table, budget):
        """`table` scaled to the whole step measured under `jax.jit` on one
        present device of each kind it has (`profile="measure"`)."""
        from hetpar.cost_models import batch_share, scale_to_timed_step

        if jax.process_count() > 1:
            raise HetparError("profile='measure' calibrates in one process; under "
                              "jax.distributed run `hetpar profile` there and pass its file")
        if self._calibration_args is None:  # only while planning
            return table
        step, args, batch = self._step, self._calibration_args, self._batch_argnums

        def replicas(names: list[str], devs: list) -> float | None:
            # The step data parallel over two devices, as Replicated runs it:
            # what a replica pays whole (launches, the host's dispatch to both)
            # is measured, not inferred from a smaller batch on one device.
            if batch_share(args, batch, len(devs)) is None:  # the batch does not split
                return None
            return whole_step_s(step, args, devs, batch, failed="the step data parallel over "
                                 f"{', '.join(names)}; data parallel is predicted from the "
                                 "whole step on one device")

        options = self.options
        # Only where the step may run data parallel (one more compile); a
        # microbatched step's layers were measured per microbatch already.
        dp = (options.microbatches == 1 and bool(options.data_parallel)
              and (options.plan is None or _replicates(options.plan)))
        def whole(_, dev) -> float:
            # Timed once per device while planning: a re-planning round
            # (`_solve`) builds the table again.
            if dev not in self._whole_steps:
                self._whole_steps[dev] = whole_step_s(step, args, dev, batch)
            return self._whole_steps[dev]

        def replicas_once(names: list[str], devs: list) -> float | None:
            key = ("replicas", *names)
            if key not in self._whole_steps:
                self._whole_steps[key] = replicas(names, devs)
            return self._whole_steps[key]

        scaled = scale_to_timed_step(
            table, self.devices, whole, **runtime_costs(),
            time_replicas=replicas_once if dp else None, budget=budget)
        steps = [f"{d} {seconds(t)}" for d, t in (scaled.meta.get("step_s") or {}).items()]
        steps += [f"data parallel over {', '.join(pair.split())} {seconds(t)}"
                  for pair, t in (scaled.meta.get("replicated_step_s") or {}).items()]
        logging.info("hetpar: calibrated to the whole step measured here: %s",
                     ", ".join(steps) or "none")
        return scaled

    def _hierarchical_step_s(self, fn: Callable, args: tuple, options: Options) -> float | None:
        """The predicted step of a hierarchical plan (see `auto`'s `hierarchical`):
        the planner's plan over process 0's devices for one process's share of
        the batch, plus the gradients' all-reduce across the processes. None
        where the batch does not split over the processes."""
        from hetpar.planner import plan as solve

        try:
            share = _BatchShare(args, options)
        except HetparError:
            return None
        local = share(args)
        m = options.microbatches
        static = StaticLeaves(microbatched(fn, m, batch_positions(options.batch_argnums,
                                                                   len(local))), local)
        graph = trace(static.pure_step, *static.pure_args, depth=options.depth,
                      batch_argnums=options.batch_argnums)
        hier = dataclasses.replace(options, hierarchical=True)
        devices = self._candidate_devices(hier)
        if len(devices) == 1:
            table = self._cost_table(devices, hier, graph)
            from hetpar.planner import evaluate

            step = evaluate(table, dict.fromkeys(graph.layers, devices[0])).step_time_s
        else:
            table = self._cost_table(devices, hier, graph)
            step = solve(table, objective="time", mode="pipelined" if m > 1 else "sequential",
                         microbatches=m, data_parallel=False, schedule=options.schedule,
                         memory=options.memory).predicted.step_time_s
        return step + allreduce_across_processes_s(table, options)

    def _with_allreduce(self, plan, options: Options):
        """A hierarchical plan with the gradients' all-reduce across processes
        added to its predicted step (and so named in `solver`)."""
        extra = allreduce_across_processes_s(self.table, options)
        p = plan.predicted
        return dataclasses.replace(
            plan, predicted=dataclasses.replace(p, step_time_s=p.step_time_s + extra,
                                                transfer_s=p.transfer_s + extra),
            solver={**plan.solver, "chosen": f"hierarchical over {jax.process_count()} "
                    f"processes (gradients all-reduced: {extra:.3g} s)"})

    def _solve(self, options: Options, devices: list[str]) -> dict[str, Placement]:
        from hetpar.planner import plan as solve

        if options.data_parallel == "always":
            if not options.devices:
                from hetpar._distributed import device_names

                devices = device_names(jax.devices())  # the default backend's
            self.table = self._cost_table(devices, options)
            self.plan = self._data_parallel_plan(tuple(devices), options)
            return dict(self.plan.placements)
        if len(devices) == 1:
            return dict.fromkeys(self.graph.layers, devices[0])
        self.table = self._cost_table(devices, options)
        m = options.microbatches

        def planned():
            return solve(self.table, objective=options.objective,
                         mode="pipelined" if m > 1 else "sequential", microbatches=m,
                         data_parallel=bool(options.data_parallel) and self._share is None,
                         schedule=options.schedule, memory=options.memory)

        self.plan = planned()
        # profile="measure" left far slower devices predicted (TimingBudget);
        # a plan that computes layers there stood on spec sheets: time those
        # layers there and plan again (GPT-2 at batch 16 on an H200 host,
        # planned on the CPU's spec sheet with a quarter of the GPU's memory,
        # predicted 1.08 s and ran in 0.36 s).
        # A plan that spends most of its step on such a device also has the
        # whole step timed there, as the fastest device has: its layers timed
        # alone summed to 1.2x the step (GPT-2, batch 16, an H100 host's CPU).
        timed: frozenset[tuple[str, str]] = frozenset()
        steps: frozenset[str] = frozenset()
        for _ in range(3):  # each round times what the last plan used; few rounds move
            used = _untimed_used(self.plan, self.table) - timed
            busy = _untimed_steps(self.plan, self.table) - steps
            if not used and not busy:
                break
            logging.info("hetpar: the plan computes %d layers on devices left untimed (%s)%s; "
                         "timing them and planning again", len(used),
                         ", ".join(sorted({d for _, d in used})),
                         f", most of its step on {', '.join(sorted(busy))}" if busy else "")
            timed |= used
            steps |= busy
            self.table = self._cost_table(devices, options, timed=timed, steps=steps)
            self.plan = planned()
        else:
            left = _untimed_used(self.plan, self.table) - timed
            busy = _untimed_steps(self.plan, self.table) - steps
            if busy:
                logging.warning("hetpar: after 3 rounds the plan spends most of its step on %s, "
                                "whose whole step is not timed; its layers are not scaled to it",
                                ", ".join(sorted(busy)))
            if left:
                logging.warning("hetpar: after 3 rounds the plan still computes %d layers on "
                                "devices left untimed; their figures are predicted", len(left))
        return dict(self.plan.placements)

    def predicted(self):
        """The planner's prediction of this step's costs (a `hetpar.planner.Predicted`), or None.

        A planned step has its plan's prediction. A step nothing planned (one
        device, or a plan given as a dict) is costed on its devices at the
        first ask (with profile="measure", while planning, when the step was
        timed): one device in closed form, anything else replayed under its
        schedule (`hetpar.planner.evaluate_replayed`), as the planner prices
        the plans it makes.
        """
        if self.plan is not None:
            return self.plan.predicted
        if self._given_prediction is None:
            from hetpar.planner import evaluate, evaluate_replayed

            used = sorted({d for p in self.placements.values() for d in p.devices})
            table = self._cost_table(used, self.options)
            m = self.options.microbatches
            if len(used) == 1:
                self._given_prediction = evaluate(
                    table, self.assignment, mode="pipelined" if m > 1 else "sequential",
                    microbatches=m)
            else:
                self._given_prediction = evaluate_replayed(
                    table, self.placements, m, self.options.schedule)
            if self.table is None:  # what the prediction was costed on, to inspect
                self.table = table
        return self._given_prediction

    def given_plan(self):
        """A Plan for a step nothing planned (a plan dict, one device): its
        placements priced on their devices (`predicted`), named "given"."""
        from hetpar.planner import Plan

        predicted = self.predicted()
        if predicted is None:
            return None
        m = self.options.microbatches
        return Plan(fingerprint=self.table.fingerprint(),
                    mode="pipelined" if m > 1 else "sequential",
                    objective=self.options.objective, microbatches=m,
                    assignment=dict(self.assignment), predicted=predicted,
                    solver={"name": "given", "status": "given by the caller",
                            "gap": 0.0, "solve_time_s": 0.0},
                    offloaded={n: p for n, p in self.placements.items()
                               if p.offloaded or p.activations != "keep"},
                    devices=tuple(d.name for d in self.table.devices))

    # -- running ----------------------------------------------------------

    def _batch_here(self, args: tuple) -> tuple:
        """`args` with batch arrays committed to another device moved to the plan's one.

        jit would accept them and copy them itself, but by a slow path: a host
        batch made AlexNet's step 4.1x jit's on the H200, against 1x when moved
        with `device_put` first (experiments/results/probe_overhead_h200_run2.txt).
        Numpy batches and resident arrays go to jit untouched (its C++ path).
        """
        moved = None
        for i in self._batch_argnums:
            for x in jax.tree_util.tree_leaves(args[i]):
                if self._elsewhere(x):
                    moved = moved or list(args)
                    moved[i] = jax.device_put(args[i], self._device)
                    break
        return args if moved is None else tuple(moved)

    def _elsewhere(self, x) -> bool:
        """Whether `x` is a JAX array placed other than the plan's device.

        On every call, for every batch leaf: a sharding object already found
        equal (arrays of one source share theirs) is recognised by identity,
        and NumPy arrays by type, before anything slower.
        """
        if type(x) is np.ndarray or not isinstance(x, jax.Array):
            return False
        sharding = x.sharding
        if sharding is self._placed_like:
            return False
        if sharding != self._sharding:
            return True
        self._placed_like = sharding
        return False

    def _batch_leaves_here(self, leaves: list) -> list:
        """`_batch_here` on the flat leaves of the arguments (the static-leaf path)."""
        moved = [i for i in self._batch_leaves if self._elsewhere(leaves[i])]
        if moved:
            for i, y in zip(moved, jax.device_put([leaves[i] for i in moved], self._device)):
                leaves[i] = y
        return leaves

    @property
    def direct(self) -> bool:
        """Whether calls may go straight to its jit executable (`call_known`): a
        one-device plan, or data parallel in one process without static leaves."""
        return self._jit is not None or self._replicated_known is not None

    def call_known(self, args: tuple):
        """Runs the step if jit has already run it for arguments like these, else `UNKNOWN`.

        The fast path of a one-device plan: jit's C++ dispatch checks the
        arguments' structure, shapes, dtypes and placement, and where they
        are new it would trace, which `_traced_when_known` refuses outside
        `__call__`; with static leaves, their structure and the leaves are
        checked here first. Nothing runs for arguments not known, and the
        caller takes the full path.
        """
        if len(args) != self._nargs:
            return UNKNOWN
        if self._jit is None:
            # Data parallel: the arguments' structure, shapes and dtypes are
            # checked here, so jit never traces on this path (it must not be
            # refused a trace, as the one-device path does: an exception inside
            # jit's dispatch leaves that signature on its slow path for good).
            if fast_signature(args) != self._replicated_known:
                return UNKNOWN
            return self._replicated.call_placed_batch(args)
        try:
            if self._static is None:  # _call_jit's first case, one Python call less
                return self._jit(*self._batch_here(args))
            return self._call_jit(args)
        except (_NewSignature, TypeError):  # TypeError: a non-array leaf (the full path says)
            return UNKNOWN

    def __call__(self, *args):
        if self._jit is not None:
            before, _known.on = getattr(_known, "on", False), True
            try:
                out = self._call_jit(args)
            finally:
                _known.on = before
            if out is UNKNOWN:
                raise HetparError("these arguments' structure or static (non-array) leaves "
                                  "differ from those the step was compiled for; call the "
                                  "hetpar.auto step itself, which compiles for them")
            return out
        if self._static is not None:
            return self._static.result(self._run(self._static.strip(args)))
        return self._run(args)

    def _call_jit(self, args: tuple):
        if self._static is None:
            return self._jit(*self._batch_here(args))
        static = self._static
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != static.in_tree or not static.matches(leaves):
            return UNKNOWN
        out = self._jit(*static.dynamic(self._batch_leaves_here(leaves)))
        return static.result_of(out)

    def place(self, args: tuple) -> tuple:
        """`args` moved to where the plan keeps them between steps (see `auto`'s `place`)."""
        # Arrays only: static leaves (an activation function) and Python
        # numbers (a learning rate) stay as they are, so the step's
        # signature does not change.
        def is_array(x):
            return isinstance(x, (jax.Array, np.ndarray))

        if (self._replicated is not None and self._replicated.multi_process
                and self._static is None):
            return self._replicated.global_args(args)
        leaves, tree = jax.tree_util.tree_flatten(args)
        if self._executor is None:
            if self._replicated is None:
                leaves = [jax.device_put(x, self._sharding) if is_array(x) else x
                          for x in leaves]
            return jax.tree_util.tree_unflatten(tree, leaves)
        fixed = set(static_where(args)) if self._static is not None else set()
        traced = [i for i in range(len(leaves)) if i not in fixed]
        placed = self._executor.place_inputs([leaves[i] for i in traced])
        for i, y in zip(traced, placed):
            if is_array(leaves[i]) and y is not None:  # None: another process keeps it
                leaves[i] = y
        return jax.tree_util.tree_unflatten(tree, leaves)

    def _run(self, args: tuple):
        if self._replicated is not None:
            return self._replicated(*args)
        if self._share is not None:
            args = self._share(args)
        flat = jax.tree_util.tree_leaves(args)
        out = self._executor(flat)
        if self._checked_steps < CHECKED_STEPS:
            self._checked_steps += 1
            ready(out)
        return jax.tree_util.tree_unflatten(self._out_tree, out)


UNKNOWN = object()  # CompiledStep.call_known: not run, take the full path


class _NewSignature(Exception):
    """jit was about to trace a one-device step outside `CompiledStep.__call__`."""


_known = threading.local()  # .on: inside CompiledStep.__call__, where jit may trace


def _traced_when_known(step: Callable) -> Callable:
    """`step` for jit, refusing to be traced from `CompiledStep.call_known`.

    jit traces only arguments it has no executable for: the signature check
    of the fast path is jit's own, and a signature jit has not seen goes back
    to `AutoStep`'s full path (which may plan it differently).
    """

    @functools.wraps(step)
    def traced(*args):
        if not getattr(_known, "on", False):
            raise _NewSignature
        return step(*args)

    return traced


def _plan_fingerprint(plan, graph: LayerGraph, placements=None, microbatches=None) -> str:
    """What every process must agree on: the plan's graph and devices, where each
    layer runs, the replicas, and the step's (global) argument shapes and dtypes.
    Not the predicted figures (measured profiles may differ a little by process).
    A plan given as a dict has only its `placements`."""
    from hetpar.core import fingerprint

    placements = plan.placements if plan is not None else placements
    return fingerprint({
        "graph": plan.fingerprint if plan is not None else graph.fingerprint(),
        "mode": plan.mode if plan is not None else None,
        "microbatches": plan.microbatches if plan is not None else microbatches,
        "assignment": {n: p.to_json() for n, p in placements.items()},
        "replicas": list(plan.replicas) if plan is not None else [],
        "inputs": [a.str_short() for a in graph.program.jaxpr.in_avals],
    })


class _BatchShare:
    """A hierarchical plan's batch: this process's rows of it.

    With `batch="global"` every process passes the whole batch and keeps rows
    [i B/P, (i+1) B/P); with `batch="local"` it passes those rows itself.
    """

    def __init__(self, args: tuple, options: Options):
        self.nums = batch_positions(options.batch_argnums, len(args))
        self.whole = options.batch == "global"
        self.i, self.n = jax.process_index(), jax.process_count()
        for k in self.nums:
            for x in jax.tree_util.tree_leaves(args[k]):
                rows = np.shape(x)[0] if np.ndim(x) and not is_key(x) else None
                if self.whole and rows is not None and rows % self.n:
                    raise HetparError(
                        f"a batch array of shape {np.shape(x)} does not split over "
                        f"{self.n} processes: its leading axis must be a multiple of {self.n}")

    def __call__(self, args: tuple) -> tuple:
        if not self.whole:
            return args

        def rows(x):
            if not np.ndim(x) or is_key(x):  # a PRNG key in the batch goes whole
                return x
            b = np.shape(x)[0] // self.n
            return x[self.i * b:(self.i + 1) * b]

        return tuple(jax.tree_util.tree_map(rows, a) if k in self.nums else a
                     for k, a in enumerate(args))


def _hierarchical_devices(used, present) -> tuple[dict, dict]:
    """A per-host plan's devices (process 0's names) on this process, and each
    one's counterpart on every process, in process order."""
    from hetpar._distributed import parse_device_name

    me, n = jax.process_index(), jax.process_count()
    mine, across = {}, {}
    for name in used:
        device, _ = memory_place(name)
        _, platform, index = parse_device_name(device)
        peers = [present.get(f"p{q}/{platform}:{index}") for q in range(n)]
        if any(d is None for d in peers):
            raise PlanError(f"a hierarchical plan runs on {device} of every process, but "
                            f"process {peers.index(None)} has no {platform}:{index}")
        mine[name] = peers[me]
        across[name] = peers
    return mine, across


def _replicates(plan) -> bool:
    """Whether `plan` (a Plan, a plan.json path, a dict or None) runs data parallel."""
    if plan is None or isinstance(plan, Mapping):
        return False
    if isinstance(plan, (str, os.PathLike)):
        from hetpar.planner import Plan

        plan = Plan.load(plan)
    return bool(getattr(plan, "replicas", ()))


class AutoStep:
    """A training step under `hetpar.auto`: call it like the original.

    Flax NNX objects among the arguments are updated in place, as under
    `nnx.jit` (see `NnxArgs`). Leaves of the arguments that are neither
    arrays nor Python numbers (an Equinox model's activation functions) are
    static, as under `eqx.filter_jit`: a new one compiles afresh, an equal
    one reuses the step (`StaticLeaves`, passes/_program.py).

    A call first tries the last step called, if it is a one-device plan
    (`CompiledStep.call_known`: straight to its jit, whose own check of the
    arguments is the only one); otherwise, or for arguments that jit has not
    run, it takes the full path: the arguments' signature (`signature`)
    picks or builds the compiled step.
    """

    def __init__(self, fn: Callable, options: Options):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self.options = options
        # Signature -> its CompiledStep, or NNX_MARK where the arguments hold Flax
        # NNX objects (whose steps are keyed by their GraphDef and state too).
        self._compiled: dict[tuple, Any] = {}
        self._last: CompiledStep | None = None
        # The last step called, when calls may go straight to its jit (`CompiledStep.direct`).
        self._direct: CompiledStep | None = None
        # The last step called on Flax NNX objects, when it is `direct`, and
        # how to call it again on those objects without splitting them anew.
        self._nnx_direct: tuple[CompiledStep, NnxFastCall] | None = None
        # Every signature's executor runs on these: one thread per device,
        # however many shapes the step is called with.
        self._workers = Workers()
        # (device, first error, cap) once a step ran out of memory and was replanned.
        self._shrunk: tuple[str, Exception, float] | None = None
        self._replanned: CompiledStep | None = None  # the step that last ran out of memory

    def lower(self, *args) -> CompiledStep:
        """Traces, plans and compiles for these arguments without running.

        With Flax NNX objects among `args`, this is the step on their state:
        it takes and returns what `NnxArgs` describes.
        """
        return self._step_for(args)[0]

    def place(self, *args) -> tuple:
        """The arguments moved to where the plan keeps them between steps.

        Plans and compiles for them first, like `lower`. A model larger than
        the accelerator, built on it or on the host, is moved once: its
        parameters to their devices, its offloaded optimizer state to the
        host (`gpu:0:pinned_host`); drop the old references so their memory
        frees before the first step:

            params, opt_state, batch = step.place(params, opt_state, batch)
        """
        step, nnx_args = self._step_for(args)
        if nnx_args is not None:
            raise HetparError("place() takes arrays, not Flax NNX objects")
        return step.place(args)

    def _step_for(self, args: tuple) -> tuple[CompiledStep, NnxArgs | None]:
        key = signature(args)
        step = self._compiled.get(key)
        if step is None:
            # Looking for NNX objects walks the arguments in Python (10x a
            # flatten): only once per signature, never on a known one.
            step = NNX_MARK if NnxArgs.present(args) else CompiledStep(
                self._fn, args, self.options, self._workers)
            self._compiled[key] = step
        nnx_args = None
        if step is NNX_MARK:
            nnx_args = NnxArgs(args)
            key = nnx_args.key + signature(nnx_args.pure_args)
            step = self._compiled.get(key)
            if step is None:
                step = self._compiled[key] = CompiledStep(
                    nnx_args.pure_step(self._fn), nnx_args.pure_args, self.options,
                    self._workers)
        self._last = step
        return step, nnx_args

    def __call__(self, *args):
        start = time.perf_counter()
        for tries in itertools.count():
            try:
                return self._call(args, start)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is caught
                if self.options.donate_argnums and "deleted" in str(e):
                    raise HetparError(
                        f"an argument was deleted: donate_argnums="
                        f"{self.options.donate_argnums} gave its buffers to an earlier step. "
                        "Pass the state the last step returned, as with jax.jit, or drop "
                        f"donate_argnums ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
                    ) from e
                replanned_infeasible = isinstance(e, InfeasibleError) and tries > 0
                if (not is_out_of_memory(e) and not replanned_infeasible) \
                        or isinstance(e, OutOfMemoryError):
                    raise
                self._replan_smaller(e, tries)

    def _replan_smaller(self, e: Exception, tries: int) -> None:
        """After a step ran out of memory (the caller's arguments intact: no stage
        donates them), caps the device that ran out below what the plan predicted
        there, so that the next call plans again; raises `OutOfMemoryError` where
        that cannot help (see hetpar/_recovery.py)."""
        # A replanned step that failed while compiling (XLA's autotuner, out of
        # memory beside the state) is not `_last` yet: the step replanned is.
        step, self._direct, self._nnx_direct = self._last or self._replanned, None, None
        if isinstance(e, InfeasibleError) and tries > 0 and self._shrunk is not None:
            device, first, cap = self._shrunk
            raise give_up(device, first, tries - 1, cap, why=e) from first
        if step is None:
            raise e
        used = sorted({memory_place(d)[0] for p in step.placements.values() for d in p.devices})
        device = failed_device(e, used) or (self._shrunk[0] if self._shrunk else None)
        if device is None:
            raise e
        if (self.options.plan is not None or tries >= MAX_REPLANS
                or len(step._candidate_devices(self.options)) < 2):
            raise give_up(device, e, tries, None) from e
        table = step.table
        capacity = ({d.name: d.memory_bytes for d in table.devices}.get(device)
                    if table is not None else None) or live_capacity(step.devices[device])[0]
        predicted = step.predicted()
        held = (predicted.peak_memory_bytes or predicted.memory_bytes or {}) if predicted else {}
        cap = smaller_cap(capacity or float("inf"), held.get(device), tries, bytes_wanted(e))
        self._shrunk = (device, e if self._shrunk is None else self._shrunk[1], cap)
        self.options = dataclasses.replace(self.options,
                                           memory={**(self.options.memory or {}), device: cap})
        self._compiled.clear()  # every signature plans again under the cap
        self._replanned, self._last = step, None
        first_line = str(e).splitlines()[0][:200]
        msg = (f"hetpar: {device} ran out of memory running the step ({first_line}); your "
               f"arguments are unchanged. Planning again with {device} capped at "
               f"{nbytes(cap)} and running the step again.")
        logging.warning(msg)
        if tries == 0:
            warnings.warn(msg, OutOfMemoryWarning, stacklevel=3)

    def _call(self, args: tuple, start: float):
        direct = self._direct
        if direct is not None:
            # A one-device plan: straight to its jit, which checks the
            # arguments as jax.jit does; only arguments it has not run go on.
            out = direct.call_known(args)
            if out is not UNKNOWN:
                if not direct.clock.done:
                    direct.clock.observe(start, out, direct)
                return out
        if self._nnx_direct is not None:
            out = self._call_nnx_direct(args)
            if out is not UNKNOWN:
                step = self._nnx_direct[0]
                if not step.clock.done:
                    step.clock.observe(start, out, step)
                return out
        step, nnx_args = self._step_for(args)
        if nnx_args is None:
            out = step(*args)
            self._direct = step if step.direct else None
        else:
            self._direct = None
            out, state = step(*nnx_args.pure_args)
            nnx_args.update(state)
            fast = NnxFastCall.build(args, nnx_args, state) if step.direct else None
            self._nnx_direct = None if fast is None else (step, fast)
        if not step.clock.done:
            step.clock.observe(start, out, step)
        return out

    def _call_nnx_direct(self, args: tuple):
        """The last NNX step, straight to its jit, on objects unchanged since
        (`NnxFastCall`); `UNKNOWN` where they or the other arguments differ."""
        step, fast = self._nnx_direct
        pure = fast.pure_args(args)
        if pure is None:
            return UNKNOWN
        result = step.call_known(pure)
        if result is UNKNOWN:
            return UNKNOWN
        out, state = result
        fast.update(state)
        self._last = step
        return out

    def _need_last(self) -> CompiledStep:
        if self._last is None:
            raise HetparError("call the step (or .lower(*args)) once before asking for its plan")
        return self._last

    @property
    def plan(self):
        """The Plan of the last compiled signature: the planner's, or, for a plan
        given as a dict or a step on one device, what runs costed as a Plan
        (`solver["name"] == "given"`), so `step.plan` always describes the step."""
        step = self._need_last()
        if step.plan is not None:
            return step.plan
        return step.given_plan()

    @property
    def plan_fingerprint(self) -> str | None:
        """Under several processes, the hash every process checked it shares (the
        plan, its replicas and the global argument shapes); None with one process."""
        return self._need_last().plan_fingerprint

    @property
    def assignment(self) -> dict[str, str]:
        """{layer: the device that computes it} of the last compiled signature."""
        return dict(self._need_last().assignment)

    @property
    def placements(self) -> dict[str, Placement]:
        """{layer: Placement}: where each layer computes, keeps its state, updates."""
        return dict(self._need_last().placements)

    @property
    def state_assignment(self) -> dict[str, str]:
        """{layer: the device or memory place that holds its optimizer state}."""
        return {layer: p.state for layer, p in self.placements.items()}

    @property
    def params_assignment(self) -> dict[str, str]:
        """{layer: the device or memory place that holds its parameters}."""
        return {layer: p.params for layer, p in self.placements.items()}

    @property
    def update_assignment(self) -> dict[str, str]:
        """{layer: the device that runs its optimizer update}."""
        return {layer: p.update for layer, p in self.placements.items()}

    def report(self):
        """The cost report of the last compiled signature's step, with its
        predicted step beside the measured one (`step` in the report: the
        median of `StepClock.STEPS` steps after `SETTLE` more than the
        compiling one; a warning when they differ by more than 25%)."""
        import dataclasses as dc

        from hetpar._report import report_graph

        step = self._need_last()
        return dc.replace(report_graph(step.graph, xla=False), step=step.clock.summary(step))

    @property
    def measured_step_s(self) -> float | None:
        """The last compiled signature's measured step (median seconds of its
        first timed steps, see `StepClock`), or None before enough steps."""
        return self._need_last().clock.measured_s

    def explain(self) -> str:
        """Why each layer is where it is (the planner's explanation)."""
        step = self._need_last()
        if step.plan is None or step.table is None:
            why = ("given in the plan" if self.options.plan is not None
                   else "the only device to plan for")
            text = "\n".join(f"{layer}: {_describe(p)} ({why})"
                             for layer, p in step.placements.items())
        else:
            text = step.plan.explain(step.table)
        # Control flow the tracer could not cut per layer (an optimizer update
        # written as one `cond` whose results are tied together) stays whole.
        return "\n".join([text, *(f"not cut per layer: {n}" for n in step.graph.notes)])


def _describe(p: Placement) -> str:
    if not p.offloaded:
        return p.compute
    params = "" if p.params == p.state else f", parameters on {p.params}"
    return f"computes on {p.compute}, state on {p.state}{params}, update on {p.update}"


def auto(fn: Callable | None = None, *, devices: str | Sequence[str] | None = None,
         objective: str = "time", plan: Any = None, microbatches: int = 1,
         batch_argnums: Sequence[int] | int | None = None, schedule: str = "gpipe",
         profile: Any = "auto", depth: int | None = None,
         on_missing_device: str = "error", data_parallel: bool = True,
         memory: Mapping[str, float] | None = None, batch: str = "global",
         hierarchical: bool | str = "auto", donate_argnums: int | Sequence[int] = ()):
    """Runs a training step across the devices present, placed by hetpar's planner.

    Usable as `@hetpar.auto` or `hetpar.auto(step, devices=[...], ...)`.

    Args:
      fn: the step, e.g. `train_step(params, opt_state, batch)`. A step on
        Flax NNX objects that updates them in place (`optimizer.update(model,
        grads)`) updates them as under `nnx.jit`; it returns arrays only.
      devices: device names (`cpu:0`, `gpu:0`) to use, or one name as a
        string (`devices="gpu:0"`); default all present.
      objective: "time", "cost" or "energy".
      plan: a path to plan.json, a `hetpar.Plan`, or a dict naming every
        layer (layer names as `hetpar.trace(fn, *args).layers`) with its
        device, or with a placement `{"compute": "gpu:0", "state": "cpu:0",
        "update": "cpu:0"}` that keeps its parameters and optimizer state on
        another device between steps and runs its update there (or streams
        the state to `compute` for the update: `"update": "gpu:0"`). State
        may live in a memory place, `"state": "gpu:0:pinned_host"` (the
        GPU's pinned host memory), and parameters apart from it,
        `"params": "gpu:0"`; default: solve.
      microbatches: a positive int. With M > 1 and a step that takes its gradient with
        `hetpar.value_and_grad`/`hetpar.grad`, the gradient part runs as M
        microbatches through the device pipeline and the update runs once.
      batch_argnums: which arguments of `fn` are batch data: an int or ints
        (default: the last, and the arguments just before it every leaf of
        which has as many rows: `x` and `y` of `step(params, opt_state, x, y)`).
      schedule: "gpipe" or "1f1b".
      profile: "auto" (the profile file named by $HETPAR_PROFILES, else spec
        sheets), a path to a `hetpar profile` file, or a ProfileSet.
        "measure": as "auto", then calibrated here at the first call: the
        whole step runs under `jax.jit` on one device of each kind planned
        for, and each device's layer times are scaled to sum to it
        (`scale_to_step`), so a one-device plan predicts what it measures
        and the others are priced on this machine's figures. One process only.
      depth: module-path depth naming layers (see `hetpar.trace`).
      on_missing_device: "error", or "replan" to plan afresh when a loaded
        plan names devices that are not present.
      data_parallel: let the planner choose to run the whole step data
        parallel over two or more accelerators of one kind (batch split, state
        replicated, `Plan.replicas`) when it predicts that faster (or cheaper)
        than any placement of layers. False: layer placements only.
        "always": no ILP; the step runs data parallel over `devices` (default:
        the default backend's devices, of every process under jax.distributed).
      memory: {device: bytes} caps on devices' memory for planning (e.g.
        `{"gpu:0": 40e9}`), so the planner keeps state off a device (offload)
        as if it were that small. A cap bounds what the layers hold across
        the step (parameters, state, gradients, kept activations) plus the
        largest working set of a layer on the device while it runs (its
        temporaries, counted unfused from the trace: GPT-2's head at batch
        16 x 128 tokens, 1.23 GB) and the optimizer state streamed in flight.
        Not counted: XLA's own workspace and compiling (0.34-0.66 GB for
        GPT-2 b16 on an H100); leave room for those. A GPT-2 b16 plan
        counted at 1.29 GB under a 1.30 GB cap peaked at 1.16 GB in a
        serialised step, about 1.21 GB in a training loop
        (experiments/results/plan_memory).
      batch: under `jax.distributed` with several processes, what each process
        passes as the batch arguments: "global" (the whole batch, the same on
        every process; each process uses its devices' share) or "local" (only
        its own share: leading axis = global batch / process count, process i
        holding rows [i B/P, (i+1) B/P)); parameters and optimizer state are
        passed whole either way. With one process both mean the same. Across
        processes hetpar.auto runs the step data parallel over every
        process's devices of the default backend (or `devices`, or a Plan's
        `replicas`), and returns global jax.Arrays, replicated (read one with
        `np.asarray`); see docs/distributed.md.
      hierarchical: under several processes, True plans the step over one
        process's devices (process 0's names, `p0/gpu:0`) and runs that plan
        on every process, each on its share of the batch, averaging the
        gradients (and the loss) across the processes before the update:
        data parallel across processes (hosts), the planner's placement or
        pipeline within each. "auto" (the default): the planner weighs that
        against its plan over every process's devices and runs the faster
        (objective "time", no plan given). False: never. Ignored with one
        process.
      donate_argnums: arguments the step replaces (its parameters and
        optimizer state), as `jax.jit` takes them: their buffers may hold
        the new state, so one copy of the state lives on the device instead
        of two, and the arrays passed are deleted by the call (pass the
        state the step returned, as with jax.jit). One-device and data
        parallel plans donate; a plan split over devices does not yet (the
        planner counts the old and the new state there).

    Returns:
      An `AutoStep`: call it like `fn`; it has `.plan`, `.report()`,
      `.explain()` and `.lower(*args)`.

    Raises:
      HetparError: a bad option, here rather than at the first call (PlanError
        for a malformed `plan` or `devices` not present). A plan dict that
        does not name exactly the step's layers raises PlanError at the first call.
    """
    if isinstance(devices, str):
        devices = (devices,)
    elif devices is not None and not isinstance(devices, Sequence):
        raise PlanError(f"devices must be a device name or a sequence of them, got "
                        f"{type(devices).__name__}")
    if is_int(batch_argnums):
        batch_argnums = (batch_argnums,)
    elif batch_argnums is not None and not isinstance(batch_argnums, Sequence):
        raise HetparError("batch_argnums must be an int, a sequence of ints or None, got "
                          f"{type(batch_argnums).__name__}")
    options = Options(devices=tuple(devices) if devices else None, objective=objective,
                      plan=plan, microbatches=microbatches,
                      batch_argnums=None if batch_argnums is None else tuple(batch_argnums),
                      schedule=schedule, profile=profile, depth=depth,
                      on_missing_device=on_missing_device,
                      data_parallel=data_parallel if data_parallel == "always"
                      else bool(data_parallel),
                      memory=None if memory is None else dict(memory)
                      if isinstance(memory, Mapping) else memory, batch=batch,
                      hierarchical=hierarchical,
                      donate_argnums=(donate_argnums,) if is_int(donate_argnums)
                      else tuple(donate_argnums) if isinstance(donate_argnums, Sequence)
                      else donate_argnums)
    if fn is None:
        return functools.partial(_wrap, options=options)
    return _wrap(fn, options)


def _wrap(fn: Callable, options: Options) -> AutoStep:
    return AutoStep(fn, options)
