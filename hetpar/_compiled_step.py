"""A step traced, planned and compiled for one signature of its arguments.

`CompiledStep` traces the step into layers, has it planned
(hetpar/_step_planning.py), splits it into per-device stages and compiles
them, and runs it: a one-device plan as one `jax.jit` executable, a
data-parallel one as `Replicated` (`Sharded` where its state is sharded),
any other through the `Executor`; under
several processes, data parallel across them or a hierarchical plan on each
one's share of the batch. `call_known` is the fast path `AutoStep` tries
first: straight to the jit executable, for arguments jit has already run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from hetpar._first_call import FirstCall
from hetpar._grad import microbatched
from hetpar._host_memory import (
    PINNED_POOL_RAM_SHARE,
    PINNED_POOL_VAR,
    pinned_pool_bytes,
    warn_without_huge_pages,
)
from hetpar._memory_check import (
    compiled_peaks,
    group_peaks,
    with_host_staging,
    worth_compiling,
)
from hetpar._options import FORCED, Options, check_present
from hetpar._place import place
from hetpar._recovery import CHECKED_STEPS, ready
from hetpar._signature import batch_positions, donated_positions, fast_signature, flat_signature
from hetpar._step_clock import StepClock
from hetpar._step_planning import (
    BatchShare,
    assign,
    cost_table_for,
    data_parallel_plan,
    hierarchical_step_s,
    replicates,
    tell,
    with_allreduce,
)
from hetpar.core import HetparError, Placement, PlanError, memory_place, parse_placements
from hetpar.cost_models import present_devices
from hetpar.passes import (
    LayerGraph,
    StageGraph,
    StaticLeaves,
    batch_argnums_of,
    microbatch_of,
    one_program,
    split,
    static_where,
    trace,
)
from hetpar.runtime import (
    Executor,
    GroupRunner,
    Replicated,
    Sharded,
    TransferEngine,
    Workers,
    executable_peak,
)
from hetpar.runtime._replicated import deleted_error


class CompiledStep:
    """A step traced, planned and compiled for one signature of arguments.

    Attributes:
      graph: the LayerGraph of the (microbatch-marked) step.
      table: the CostTable the planner saw; for a plan given as a dict, the one
        `predicted()` costed it on (None until asked).
      plan: the planner's Plan (None when given as a dict).
      assignment: layer -> device name.
      stages: the StageGraph (None on the one-device fast path).
      compiled_once: whether its first call ran (its executables are compiled).
    """

    # A whole step's argument shapes as its first call lowers them, and what
    # its executable moves once read (hetpar/_compiled_collectives.py).
    _replicated_shapes = None
    _collectives_read = None
    compiled_once = False

    def __init__(self, fn: Callable, args: tuple, options: Options,
                 workers: Workers | None = None, before: CompiledStep | None = None):
        if options.batch_argnums is None:
            # Found once, here, for every path below (a share per process, the
            # replicas' split, microbatches): a batch of two arguments, `x` and
            # `y` of step(params, opt_state, x, y), is cut as one.
            options = dataclasses.replace(options, batch_argnums=batch_argnums_of(args))
        self.options = options
        self.clock = StepClock()
        if not hasattr(self, "first_call"):  # (kept when a hierarchical plan starts afresh)
            self.first_call = FirstCall()
        # ({device: peak bytes}, {device: where}) of the compiled stages
        # (hetpar/_memory_check.py); None where nothing split was compiled.
        self.compiled_memory = None
        # device -> the allocator's peak when the first call started running
        # (set by `AutoStep`; `memory_summary` tells a peak reached before it)
        self.peaks_before_run: dict | None = None
        # The caps the compiled peaks answer to (the caller's, and those a
        # step that ran out of memory set), where `options.memory` also holds
        # caps a replan set to steer the planner (set by `AutoStep`).
        self.memory_limits: dict | None = None
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
            self._share = BatchShare(args, options)
            args = self._share(args)
        elif multi and (options.batch == "local" or replicates(options.plan)
                        or (options.data_parallel in FORCED and options.plan is None)):
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
        with self.first_call.phase("trace"):
            self.graph: LayerGraph = trace(static.pure_step, *static.pure_args,
                                           depth=options.depth,
                                           batch_argnums=options.batch_argnums)
        self._static = static if static.any else None
        self._step = step if self._static is None else static.pure_step
        user_args, args = args, static.pure_args
        # profile="measure" times the step on these, while planning only (kept,
        # they would hold the caller's old state alive).
        self._calibration_args = args if options.calibrates() else None
        if m > 1 and not any(microbatch_of(str(e.source_info.name_stack)) is not None
                             for e in self.graph.program.eqns):
            raise HetparError(
                f"microbatches={m} needs the step to take its gradient with "
                "hetpar.value_and_grad or hetpar.grad (drop-in replacements for JAX's), "
                "which mark what runs per microbatch.")
        self.table = None
        self.plan = None
        self._given_prediction = None
        # The calibration's whole-step timings, while planning, and what the
        # planning rounds timed (`solve_placements`): a replan of the same
        # step (`before`, after its compiled check) starts from them rather
        # than timing its way there again.
        self._whole_steps: dict = dict(before._whole_steps) if before is not None else {}
        self._timed = before._timed if before is not None else frozenset()
        self._timed_steps = before._timed_steps if before is not None else frozenset()
        self._one_device_jits: dict = {}  # device -> the step's jit there (`_one_device_jit`)
        self._jit_peaks: dict = {}  # device -> its one-device jit's compiled peak (`jit_memory`)
        self._fits_compiled: dict = {}  # device name -> whether the whole step fits it compiled
        with self.first_call.phase("plan"):
            self.placements: dict[str, Placement] = parse_placements(assign(self, options))
        if self._share is not None and self.plan is not None:
            if self.plan.replicas:
                raise PlanError("a hierarchical plan places layers within each process; this "
                                "plan replicates the step (data parallel), which "
                                "hierarchical=False runs across every process's devices")
            self.plan = with_allreduce(self, self.plan, options)
        elif (multi and options.hierarchical == "auto" and options.plan is None
              and options.objective == "time" and self.plan is not None):
            alternative = hierarchical_step_s(self, fn, user_args, options)
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
        groups = self.plan.groups if self.plan is not None else {}
        if groups:
            if multi:
                raise PlanError("a plan over device groups runs in one process (not yet "
                                "under jax.distributed)",
                                api="plan without groups= under several processes")
            with self.first_call.phase("compile"):  # the split included
                self.stages = split(self.graph, self.placements, schedule=options.schedule)
                self._executor = GroupRunner(
                    self.stages, {n: [self.devices[d] for d in g.devices]
                                  for n, g in groups.items()},
                    {n: g.sharding for n, g in groups.items()},
                    _batch_rows(args, self._batch_argnums, m),
                    offload=[n for n, g in groups.items() if g.state == "pinned_host"],
                    donate=self._donated_leaves(user_args))
            with self.first_call.phase("memory check"):
                self.compiled_memory = group_peaks(
                    self._executor, {n: g.devices for n, g in groups.items()})
        elif replicas:
            absent = [d for d in replicas if d not in self.devices]
            if absent:
                raise PlanError(f"the plan replicates the step over {absent}, which are not "
                                f"present (present: {sorted(self.devices)})")
            # The user's step, not the microbatch-marked one: each replica runs
            # its share of the batch whole.
            if self._static is not None:
                self._static = StaticLeaves(fn, user_args)
                fn = self._static.pure_step
            self._replicated = _whole_step(
                fn, [self.devices[d] for d in replicas], args, self._batch_argnums, self.plan,
                self.graph, donate_argnums=self._donated)
            if not multi:
                # (`args` are the traced leaves alone where the step has static
                # ones, as the runner takes them: an Equinox model's.)
                self._replicated_shapes = self._replicated.shapes(args)
            if self._static is None and not multi:
                # Later calls with these leaves' shapes and dtypes go straight
                # to its jit (`call_known`): the full path's checks of GPT-2's
                # 446 leaves cost more than a batch-16 step's GPU time.
                self._replicated_known = fast_signature(args)
            used = list(replicas)
            if not multi and worth_compiling(self, replicas):
                # Compiled now (jit's cache serves the first call), its
                # per-device memory checked before anything runs.
                with self.first_call.phase("compile"):
                    peak = self._replicated.memory_peak(self._replicated_shapes)
                if peak is not None:
                    self.compiled_memory = (dict.fromkeys(replicas, peak),
                                            dict.fromkeys(replicas, "the step's executable, "
                                                          "per replica"))
        elif (len(used) == 1 and not multi
              and all(p.activations == "keep" for p in self.placements.values())):
            # (A layer that offloads or recomputes its activations needs its
            # forward and backward in stages apart: the split path below.)
            self._device = self.devices[used[0]]
            self._jit = self._one_device_jit(self._device, user_args)
            self._sharding = self._placed_like = jax.sharding.SingleDeviceSharding(self._device)
            ends = list(itertools.accumulate(len(jax.tree_util.tree_leaves(a))
                                             for a in user_args))
            starts = [0, *ends[:-1]]
            # The arguments' shapes, for `jit_memory` (with static leaves, the
            # traced leaves jit takes flat).
            self._jit_specs = (jax.tree_util.tree_map(lambda x: _spec(x, self._sharding), args)
                               if self._static is None else
                               tuple(_spec(x, self._sharding) for x in
                                     self._static.dynamic(jax.tree_util.tree_leaves(user_args))))
            self._batch_leaves = tuple(i for k in self._batch_argnums
                                       for i in range(starts[k], ends[k]))
            # Compiled now, not at the first call (jit's cache serves that call
            # this executable: one compile), so that its memory is checked
            # against the device's before anything runs (AutoStep._new_step);
            # not where the plan is predicted far from full (`CHECK_FROM`).
            peak = None
            if worth_compiling(self, used):
                with self.first_call.phase("compile"):
                    peak = self.jit_memory()
            if peak is not None:
                self.compiled_memory = ({used[0]: peak}, {used[0]: "the step's executable"})
        elif self._share is not None:
            self.stages = split(self.graph, self.placements, schedule=options.schedule,
                                update_apart=True)
            mine, across = _hierarchical_devices(used, self.devices)
            self._executor = Executor(self.stages, mine, TransferEngine(), workers,
                                      across=across)
        else:
            if multi:
                self._check_placements_across()
            if self._donated and multi:
                logging.warning("hetpar: donate_argnums: a plan split over processes does "
                                "not donate its arguments yet; the old and the new state "
                                "coexist during a step")
            with self.first_call.phase("compile"):  # the split included
                # One device (layers recomputed): one executable (`one_program`).
                self.stages = one_program(split(self.graph, self.placements,
                                                schedule=options.schedule))
                # The first call's progress, as the calibration's: a split
                # plan's stages compile for tens of seconds on a large model
                # (30 s of a 2.9B Llama's 113 s first call on an H200).
                told = options.calibrates() and len(self.stages.stages) > 1
                if told:
                    start = time.perf_counter()
                    tell(f"hetpar: compiling the plan's {len(self.stages.stages)} stages on "
                         f"{', '.join(used)}")
                self._executor = Executor(self.stages,
                                          {d: self.devices[memory_place(d)[0]] for d in used},
                                          TransferEngine(), workers,
                                          donate=() if multi else self._donated_leaves(user_args))
                if told:
                    tell(f"hetpar: compiled in {time.perf_counter() - start:.1f} s")
            with self.first_call.phase("memory check"):
                self.compiled_memory = with_host_staging(self, compiled_peaks(self._executor))
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
        logging.info("hetpar: %d layers on %s%s", len(self.graph), used, self._peaks_line())
        hint = self._pinned_pool_hint()
        if hint:
            logging.warning("hetpar: %s", hint)

    def _pinned_pool_hint(self) -> str | None:
        """What to do where a GPU's pinned host memory place is planned full at
        XLA's pinned pool (`_host_memory.pinned_pool_bytes`) with host
        RAM to spare: the state the pool could not take is updated on, or
        computed by, the host CPU instead."""
        from hetpar.core import nbytes

        predicted = self.plan.predicted if self.plan is not None else None
        if predicted is None or self.table is None:
            return None
        peaks = predicted.peak_memory_bytes or predicted.memory_bytes or {}
        pool = pinned_pool_bytes()
        caps = {d.name: d.memory_bytes for d in self.table.devices}
        from hetpar._memory_check import host_ram, host_total

        ram = host_ram() or 0.0
        # (a process's GPUs share the pool: each place has its part; a place
        # capped by the host's RAM itself gains nothing from a larger pool)
        full = [d for d, b in peaks.items() if memory_place(d)[1] == "pinned_host"
                and ram > 1.05 * caps.get(d, float("inf"))
                and self.devices.get(memory_place(d)[0]) is not None
                and self.devices[memory_place(d)[0]].platform == "gpu"
                and 0 < caps.get(d, 0) <= pool + 1 and b > 0.95 * caps[d]]
        # The pool holds up to twice what it serves (its doubling regions),
        # so it is widened to a share of the RAM, never past it (run 56).
        total = host_total() or 0.0
        wider = int(PINNED_POOL_RAM_SHARE * total // (1 << 30))
        if not full or wider * (1 << 30) <= 1.05 * pool:
            return None
        return (f"{', '.join(full)} planned full at XLA's pinned host memory pool "
                f"({nbytes(pool)}); with host RAM to spare, set {PINNED_POOL_VAR}={wider} "
                f"(GiB: {PINNED_POOL_RAM_SHARE:.0%} of the host's RAM, which `import hetpar` "
                "before JAX starts sets) so that more state streams from there instead of "
                "the host CPU")

    def _peaks_line(self) -> str:
        """" (peak memory: gpu:0 39.7 GB planned, 36.5 GB compiled, ...)" for
        the plan's devices, the line telling where the first call goes: what
        the plan was checked at before it runs."""
        from hetpar.core import nbytes

        predicted = self.plan.predicted if self.plan is not None else None
        planned = (predicted.peak_memory_bytes or predicted.memory_bytes or {}) if predicted else {}
        compiled = self.compiled_memory[0] if self.compiled_memory else {}
        parts = []
        # (a group plan's planned figures are by group, its compiled ones by member)
        for d in [*planned, *(d for d in compiled if d not in planned)]:
            said = [f"{nbytes(planned[d])} planned"] if planned.get(d) else []
            said += [f"{nbytes(compiled[d])} compiled"] if compiled.get(d) else []
            if said:
                parts.append(f"{d} {', '.join(said)}")
        # What a GPU's places take of the host's RAM: XLA's pinned pool holds
        # its regions for them, up to twice their arrays (run 56 was killed
        # by the OS for it).
        from hetpar._memory_check import host_draws

        served = {d: b for d, b in (compiled or planned).items() if b and memory_place(d)[1]}
        pool = host_draws(self, served)[1] if served else 0.0
        if pool > 1.05 * sum(served.values()):
            parts.append(f"XLA's pinned pool holding {nbytes(pool)} of the host's RAM for them")
        return f" (peak memory: {'; '.join(parts)})" if parts else ""

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
            self.table = cost_table_for(self, list(replicas), options)
            from hetpar.planner import Plan

            plan = options.plan if hasattr(options.plan, "replicas") else Plan.load(options.plan)
            plan.check(self.table)
        else:
            self.table = cost_table_for(self, list(replicas), options)
            plan = data_parallel_plan(self, replicas, options)
        self.plan = plan
        if plan.sharding:  # the same step, its state laid out as the plan shards it
            self._replicated = _whole_step(self._step, [self.devices[d] for d in replicas],
                                           static.pure_args, self._batch_argnums, plan,
                                           self.graph, batch=options.batch)
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

    # -- planning (how the placements are chosen: hetpar/_step_planning.py) --

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
            # A sharded step, once compiled: its collectives as its executable
            # moves them (hetpar/_compiled_collectives.py).
            from hetpar._compiled_collectives import repriced

            return repriced(self, self.plan.predicted) or self.plan.predicted
        if self._given_prediction is None:
            from hetpar.planner import evaluate, evaluate_replayed

            used = sorted({d for p in self.placements.values() for d in p.devices})
            table = cost_table_for(self, used, self.options)
            placements = _priced_on(table, self.placements)
            m = self.options.microbatches
            if len({d for p in placements.values() for d in p.devices}) == 1:
                self._given_prediction = evaluate(
                    table, self.assignment, mode="pipelined" if m > 1 else "sequential",
                    microbatches=m)
            else:
                self._given_prediction = evaluate_replayed(
                    table, placements, m, self.options.schedule)
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

    def jit_memory(self) -> float | None:
        """A one-device step's executable's peak bytes (`executable_peak`:
        arguments, outputs, temporaries, less what donated arguments alias,
        and code), compiled on its arguments' shapes: the executable the
        first call runs (jit's cache serves it), compiled once at
        construction. None where the backend gives no analysis."""
        if self._jit is None or getattr(self, "_jit_specs", None) is None:
            return None
        if self._device not in self._jit_peaks:  # (or compiled while planning)
            try:
                self._jit_peaks[self._device] = _compiled_peak(self._jit, self._jit_specs)
            except Exception:  # noqa: BLE001 - no analysis on this backend
                self._jit_peaks[self._device] = None
        return self._jit_peaks[self._device]

    def replicated_memory(self) -> float | None:
        """A data-parallel or sharded step's executable's peak bytes on each
        replica (`Replicated.memory_peak`), read once its first call ran,
        where the check before running was skipped (`worth_compiling`: a
        plan predicted under half of each device). jit's cache then serves
        the compile (0.06 s on CPU devices), so `report()` sets the compiled
        figure beside the planner's: the zoo's fsdp plan over two H200s was
        planned at 42.1 GB a GPU and held 36.0 (fit_h200x2, run 72). None
        before the first call, over several processes, or where the backend
        gives no analysis."""
        if (self._replicated is None or self._replicated_shapes is None
                or not self.compiled_once):
            return None
        if not hasattr(self, "_replicated_peak"):
            self._replicated_peak = self._replicated.memory_peak(self._replicated_shapes)
        return self._replicated_peak

    def one_device_peak(self, name: str, args: tuple) -> float | None:
        """The whole step's peak bytes compiled for present device `name`
        alone, as a one-device plan runs it (`_one_device_jit`, donation
        included; `executable_peak`), on `args` (the caller's, no static
        leaves): the executable that plan's first call then runs, and whose
        figure `jit_memory` then reads. Cached; None where the backend gives
        no analysis.

        Raises:
          Whatever compiling raises (out of memory in XLA's autotuner).
        """
        device = self.devices[name]
        if device not in self._jit_peaks:
            sharding = jax.sharding.SingleDeviceSharding(device)
            self._jit_peaks[device] = _compiled_peak(
                self._one_device_jit(device, args),
                jax.tree_util.tree_map(lambda x: _spec(x, sharding), args))
        return self._jit_peaks[device]

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
    def one_executable(self) -> bool:
        """Whether a call runs one executable (one device, or a whole step over
        several): its results are ready together on each device."""
        return self.executable_devices is not None

    @property
    def executable_devices(self) -> frozenset | None:
        """The devices its one executable runs on (None: several stages)."""
        if self._jit is not None:
            return frozenset([self._device])
        if self._replicated is not None:
            return frozenset(self._replicated.mesh.devices.flat)
        return None

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
            known, leaves = flat_signature(args)
            if known != self._replicated_known:
                return UNKNOWN
            if self._donated:  # the leaves just flattened: ~0.03 us each
                deleted_error(leaves)
            return self._replicated.call_placed_batch(args, checked=True)
        try:
            if self._static is None:  # _call_jit's first case, one Python call less
                return self._jit(*self._batch_here(args))
            return self._call_jit(args)
        except (_NewSignature, TypeError):  # TypeError: a non-array leaf (the full path says)
            return UNKNOWN

    def __call__(self, *args):
        if self._jit is not None:
            with _may_trace():
                out = self._call_jit(args)
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

    def _one_device_jit(self, device: jax.Device, user_args: tuple) -> Callable:
        """The step under `jax.jit` on `device` alone, as the one-device plan runs it.

        Built once per device: the calibration times the whole step with it
        (`shared_jit`) and a one-device plan then runs the executable already
        compiled, instead of compiling the step a second time.
        """
        if device in self._one_device_jits:
            return self._one_device_jits[device]
        sharding = jax.sharding.SingleDeviceSharding(device)
        # Explicit shardings in and out: fresh and resident arguments then hit
        # the same executable (jit's cache tells committed inputs apart).
        # With static leaves, jit takes the traced leaves as one flat list.
        jitted = self._step if self._static is None else self._static.flat_step
        donate = self._donated
        if self._static is not None and donate:  # jit takes the traced leaves flat
            donate = self._donated_leaves(user_args)
        self._one_device_jits[device] = jax.jit(
            _traced_when_known(jitted), in_shardings=sharding, out_shardings=sharding,
            donate_argnums=donate)
        return self._one_device_jits[device]

    def _donated_leaves(self, user_args: tuple) -> tuple[int, ...]:
        """The donated arguments' positions among the step's traced (non-static) leaves."""
        if not self._donated:
            return ()
        ends = list(itertools.accumulate(len(jax.tree_util.tree_leaves(a)) for a in user_args))
        starts = [0, *ends[:-1]]
        fixed = set(static_where(user_args)) if self._static is not None else set()
        traced = [i for i in range(ends[-1]) if i not in fixed]
        return tuple(j for j, i in enumerate(traced)
                     if any(starts[k] <= i < ends[k] for k in self._donated))

    def shared_jit(self, device: jax.Device) -> Callable | None:
        """The one-device jit for the calibration to time the whole step with,
        where it is the very function a one-device plan runs: the step takes
        its arguments as given (no static leaves). Else None. Its `donated`
        says which arguments it donates: the calibration then gives it
        copies of its own there (`cost_models.measure_step`), never the
        caller's arrays, and the step compiles once, not once for the
        timing and once more for the run (a 2.9B model: 15 s)."""
        if self._static is not None:
            return None
        if set(self._donated) & set(batch_positions(self._batch_argnums, self._nargs)):
            return None  # a donated batch: the timing would need a fresh one every run
        jitted = self._one_device_jit(device, ())

        def call(*args):
            with _may_trace():
                return jitted(*args)

        call.donated = tuple(self._donated)
        return call

    def place(self, args: tuple) -> tuple:
        """`args` moved to where the plan keeps them between steps (see `auto`'s `place`)."""
        return place(self, args)

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


@contextlib.contextmanager
def _may_trace():
    """Lets the one-device jit trace (`_traced_when_known`) within the block."""
    before, _known.on = getattr(_known, "on", False), True
    try:
        yield
    finally:
        _known.on = before


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


def _compiled_peak(jitted, specs) -> float | None:
    """`executable_peak` of `jitted` compiled on `specs` (jit's cache keeps the
    executable for the call that follows)."""
    with _may_trace():
        return executable_peak(jitted.lower(*specs).compile().memory_analysis())


def _spec(x, sharding) -> jax.ShapeDtypeStruct:
    """`x`'s shape and dtype (weak type included, as jit keys on it) on `sharding`."""
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                                sharding=sharding)


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
        "sharding": plan.sharding if plan is not None else None,
        "inputs": [a.str_short() for a in graph.program.jaxpr.in_avals],
    })


def _batch_rows(args: tuple, batch_argnums, microbatches: int) -> frozenset[int]:
    """The leading-axis sizes of the batch's leaves and of their microbatches:
    values of such rows are split over a group's members (`GroupRunner`)."""
    rows = {np.shape(x)[0] for k in batch_argnums for x in jax.tree_util.tree_leaves(args[k])
            if np.ndim(x)}
    return frozenset(rows | {r // microbatches for r in rows if r % microbatches == 0})


def _whole_step(fn: Callable, devices: list, args: tuple, batch_argnums, plan,
                graph: LayerGraph, **options) -> Replicated:
    """The runtime of a whole-step plan: `Replicated`, or `Sharded` where the
    plan shards the state: the optimizer state's leaves (zero1), the
    parameters' too (fsdp), by the roles the trace gave each input."""
    if not plan.sharding:
        return Replicated(fn, devices, args, batch_argnums, **options)
    roles = iter(graph.input_roles)
    sharded = ("opt_state",) if plan.sharding == "zero1" else ("param", "opt_state")
    shard = [[next(roles) in sharded for _ in jax.tree_util.tree_leaves(a)] for a in args]
    return Sharded(fn, devices, args, batch_argnums, shard=shard, **options)


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


def _priced_on(table, placements: dict[str, Placement]) -> dict[str, Placement]:
    """`placements` with each memory place `table` lacks priced as its device:
    a CPU device's own pinned host memory (`cpu:0:pinned_host`, which a plan
    given may name and the runtime keeps state in) is the same RAM, and the
    cost table lists memory places of accelerators only. Before, the step's
    prediction, and so `report()`, failed on such a plan ("state device
    'cpu:0:pinned_host' is unknown")."""
    known = set(table.device_names)

    def on(name):
        return memory_place(name)[0] if name is not None and name not in known else name

    return {layer: dataclasses.replace(p, compute=on(p.compute), state=on(p.state),
                                       update=on(p.update), params=on(p.params))
            for layer, p in placements.items()}
