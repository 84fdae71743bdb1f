"""The call path of a `hetpar.auto` step: `AutoStep`.

A call tries the last step called first, when it may go straight to its jit
(`CompiledStep.call_known`, or `NnxFastCall` for Flax NNX objects unchanged
since); otherwise the arguments' signature picks or builds a `CompiledStep`
(one per signature, cached). A step that runs out of device memory is
planned again with that device capped and run again (`_replan_smaller`,
hetpar/_recovery.py). The properties (`plan`, `assignment`, `placements`,
`explain()`, `report()`) describe the last signature compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
from absl import logging

from hetpar._compiled_step import UNKNOWN, CompiledStep
from hetpar._memory_check import (
    MemoryCheckWarning,
    allocator_peak,
    does_not_fit,
    misfits,
    replan_caps,
    slower_replan,
)
from hetpar._nnx_args import NNX_MARK, NnxArgs, NnxFastCall
from hetpar._options import Options
from hetpar._recovery import (
    MAX_REPLANS,
    OutOfMemoryError,
    OutOfMemoryWarning,
    bytes_wanted,
    failed_device,
    give_up,
    is_out_of_memory,
    smaller_cap,
)
from hetpar._signature import donated_positions, signature
from hetpar._step_planning import candidate_devices
from hetpar.core import HetparError, InfeasibleError, Placement, memory_place, nbytes
from hetpar.cost_models import live_capacity
from hetpar.runtime import Workers


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
        t = time.perf_counter()
        step = self._step_for(args)[0]
        if step.first_call.total_s is None:
            step.first_call.before_s += time.perf_counter() - t
        return step

    def place(self, *args) -> tuple:
        """The arguments moved to where the plan keeps them between steps.

        Plans and compiles for them first, like `lower`. A model larger than
        the accelerator, built on it or on the host, is moved once: its
        parameters to their devices, its offloaded optimizer state to the
        host (`gpu:0:pinned_host`); drop the old references so their memory
        frees before the first step:

            params, opt_state, batch = step.place(params, opt_state, batch)

        With `donate_argnums`, the donated arguments' arrays are given up as
        their copies are made, a chunk at a time, so the host holds one copy
        of a model built there; if a copy fails, `PlaceError.placed` holds
        every argument, moved or not (hetpar/_place.py).
        """
        t = time.perf_counter()
        step, nnx_args = self._step_for(args)
        if nnx_args is not None:
            raise HetparError("place() takes arrays, not Flax NNX objects")
        placing = time.perf_counter()
        placed = step.place(args)
        if step.first_call.total_s is None:
            done = time.perf_counter()
            step.first_call.place_s = (step.first_call.place_s or 0.0) + done - placing
            step.first_call.before_s += done - t
        return placed

    def _step_for(self, args: tuple) -> tuple[CompiledStep, NnxArgs | None]:
        key = signature(args)
        step = self._compiled.get(key)
        if step is None:
            # Looking for NNX objects walks the arguments in Python (10x a
            # flatten): only once per signature, never on a known one.
            step = NNX_MARK if NnxArgs.present(args) else self._new_step(self._fn, args)
            self._compiled[key] = step
        nnx_args = None
        if step is NNX_MARK:
            nnx_args = NnxArgs(args)
            key = nnx_args.key + signature(nnx_args.pure_args)
            step = self._compiled.get(key)
            if step is None:
                step = self._compiled[key] = self._new_step(nnx_args.pure_step(self._fn),
                                                            nnx_args.pure_args)
        self._last = step
        return step, nnx_args

    def _new_step(self, fn: Callable, args: tuple) -> CompiledStep:
        """The step compiled for these arguments, its compiled stages checked
        against the devices' memory before anything runs (hetpar/_memory_check.py).

        Where a device's compiled peak exceeds what the plan may use there,
        the device is capped by the excess and the step planned and compiled
        again, at most `MAX_REPLANS` times; then, or where the planner finds
        no plan under the cap, one line (`InfeasibleError`) naming the device
        and the bytes. A plan given (`plan=`), a step with one device to run
        on, or one under several processes, is not planned again: it runs,
        with a warning (`MemoryCheckWarning`).
        """
        step = CompiledStep(fn, args, self.options, self._workers)
        first = step.plan  # what a replanned plan's speed is told against
        closest = None  # the worst misfit of the plan that came closest to fitting
        # The compiled peaks answer to the caller's caps (and those a step
        # that ran out of memory set), not to the caps below that steer the
        # planner: where it undercounts, a plan it fits under a steering cap
        # compiles over that cap and may still fit the device.
        limits = dict(self.options.memory or {})
        for tries in itertools.count():
            step.memory_limits = limits
            found = misfits(step, limits=limits)
            if not found:
                return step
            worst = found[0]
            if not worst.host and (closest is None or worst.excess_bytes < closest.excess_bytes):
                closest = worst
            # Under several processes each checks its own devices: planning
            # again on one alone would part the processes' plans.
            why = ("was given" if self.options.plan is not None else
                   "has one device to run on" if len(candidate_devices(step, self.options)) < 2
                   else "runs under several processes" if jax.process_count() > 1 else None)
            if why is not None:
                msg = (f"hetpar: {worst.describe()}; the plan {why}, so it runs as it is and "
                       "may run out of memory")
                logging.warning(msg)
                warnings.warn(msg, MemoryCheckWarning, stacklevel=4)
                return step
            caps = replan_caps(step, found)
            cap = caps[worst.device]
            if tries >= MAX_REPLANS or min(caps.values()) <= 0:
                cap = min(cap, *caps.values())
                raise does_not_fit(worst, tries=tries, cap=cap, closest=closest)
            others = ", ".join(f"{d} at {nbytes(c)}" for d, c in caps.items() if d != worst.device)
            logging.warning("hetpar: %s; planning again with %s capped at %s%s before the "
                            "first step", worst.describe(), worst.device, nbytes(cap),
                            f" ({others})" if others else "")
            memory = dict(self.options.memory or {})
            for d, c in caps.items():
                memory[d] = min(c, memory.get(d, c))
            self.options = dataclasses.replace(self.options, memory=memory)
            try:
                again = CompiledStep(fn, args, self.options, self._workers, before=step)
            except InfeasibleError as e:
                raise does_not_fit(worst, tries=tries, why=e, cap=cap, closest=closest) from e
            again.first_call.absorb(step.first_call)
            slower = slower_replan(first, again.plan, worst, cap)
            if slower is not None:
                logging.warning(slower)
                warnings.warn(slower, MemoryCheckWarning, stacklevel=4)
            step = again
        raise AssertionError("unreachable")

    def __call__(self, *args):
        start = time.perf_counter()
        for tries in itertools.count():
            try:
                return self._call(args, start)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is caught
                # (A stage that ran out of memory mid-step may name deleted
                # buffers too: its donated inputs were given up. That is
                # an out-of-memory, told as one, not the caller's mistake.)
                if self.options.donate_argnums and "deleted" in str(e) \
                        and not is_out_of_memory(e):
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
                self._replan_smaller(e, tries, args)

    def _replan_smaller(self, e: Exception, tries: int, args: tuple) -> None:
        """After a step ran out of memory, caps the device that ran out below what
        the plan predicted there, so that the next call plans again on the same
        arguments (intact where none was donated, or none of the donated was
        given up before the failure; JAX gives them up even where the
        executable then cannot get its memory, tests/test_gpu.py: where one is
        deleted, it gives up); raises `OutOfMemoryError` where planning again
        cannot help (see hetpar/_recovery.py)."""
        # A replanned step that failed while compiling (XLA's autotuner, out of
        # memory beside the state) is not `_last` yet: the step replanned is.
        step, self._direct, self._nnx_direct = self._last or self._replanned, None, None
        if isinstance(e, InfeasibleError) and tries > 0 and self._shrunk is not None:
            device, first, cap = self._shrunk
            raise give_up(device, first, tries=tries - 1, cap=cap, why=e) from first
        if step is None:
            raise e
        used = sorted({memory_place(d)[0] for p in step.placements.values() for d in p.devices})
        device = failed_device(e, used) or (self._shrunk[0] if self._shrunk else None)
        if device is None:
            raise e
        lost = _donated_lost(args, self.options.donate_argnums)
        if (self.options.plan is not None or lost
                or tries >= MAX_REPLANS or len(candidate_devices(step, self.options)) < 2):
            raise give_up(device, e, tries=tries, given=self.options.plan is not None,
                          donated=lost) from e
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
            result = self._call_nnx_direct(args)
            if result is not UNKNOWN:
                step = self._nnx_direct[0]
                if not step.clock.done:  # (the new state too: a step may return nothing)
                    step.clock.observe(start, result, step)
                return result[0]
        step, nnx_args = self._step_for(args)
        if step.peaks_before_run is None:  # the first call: planned, placed, not run
            step.peaks_before_run = {d: allocator_peak(step, d) for d in step.devices}
        running = time.perf_counter()
        if nnx_args is None:
            out = results = step(*args)
            self._direct = step if step.direct else None
        else:
            self._direct = None
            out, state = results = step(*nnx_args.pure_args)
            nnx_args.update(state)
            fast = NnxFastCall.build(args, nnx_args, state) if step.direct else None
            self._nnx_direct = None if fast is None else (step, fast)
        if not step.clock.done:
            step.clock.observe(start, results, step)  # waits for the results at first
        if step.first_call.total_s is None:
            step.first_call.ran(start, running)
            step.compiled_once = True
            with step.first_call.after("collectives"):
                step.predicted()  # a sharded step's reads what its executable moves
        return out

    def _call_nnx_direct(self, args: tuple):
        """The last NNX step, straight to its jit, on objects unchanged since
        (`NnxFastCall`): (its result, the objects' new state); `UNKNOWN` where
        they or the other arguments differ."""
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
        return out, state

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
        """{layer: the device that computes it} of the last compiled signature:
        the form `plan=` takes, as `step.plan.assignment`. It does not say where
        an offloaded layer keeps its parameters and optimizer state:
        `step.placements` does (and `plan=step.placements` keeps them there),
        and so does `step.report()`'s placement column."""
        return dict(self._need_last().assignment)

    @property
    def placements(self) -> dict[str, Placement]:
        """{layer: Placement}: where each layer computes, keeps its parameters
        and optimizer state, and runs its update (all on `step.assignment`'s
        device unless the layer is offloaded)."""
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
        """The cost report of the last compiled signature's step: where each layer
        runs (its placement: the compute device, and where an offloaded layer's
        state lives; every replica of a data-parallel step), and its predicted
        step beside the measured one (`step` in the report: the median of
        `StepClock.STEPS` steps after `SETTLE` more than the compiling one; a
        warning when they differ by more than 25%), each device's memory
        predicted, compiled and measured (`step["memory"]`, and the host's RAM
        its CPU devices and memory places share beside the process's resident
        peak, `step["host_memory"]`: hetpar/_memory_check.py), where the first
        call's time went
        (`step["first_call"]`, hetpar/_first_call.py) and, for a whole step
        over several devices, its collectives as planned and as compiled
        (`step["collectives"]`, hetpar/_compiled_collectives.py)."""
        import dataclasses as dc

        from hetpar._compiled_collectives import collectives_summary
        from hetpar._memory_check import host_memory_summary, memory_summary
        from hetpar._report import report_graph

        step = self._need_last()
        rep = report_graph(step.graph, xla=False)
        replicas = list(step.plan.replicas) if step.plan is not None else []
        sharding = step.plan.sharding if step.plan is not None and replicas else None
        rows = tuple({"name": r["name"],
                      "placement": replicas or step.placements[r["name"]].to_json(),
                      **({"sharding": sharding} if sharding else {}), **r}
                     for r in rep.rows)
        memory = memory_summary(step)
        summary = {**step.clock.summary(step), "memory": memory,
                   "host_memory": host_memory_summary(memory, step),
                   "first_call": step.first_call.summary(), "hint": microbatch_hint(step)}
        collectives = collectives_summary(step)
        if collectives is not None:
            summary["collectives"] = collectives
        return dc.replace(rep, rows=rows, step=summary)

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
        hint = microbatch_hint(step)
        return "\n".join([text, *(f"not cut per layer: {n}" for n in step.graph.notes),
                          *([hint] if hint else [])])


def microbatch_hint(step) -> str | None:
    """How to let a plan's devices or groups overlap, where its layers run on
    several of them one after another (no microbatches): in words, or None."""
    plan = step.plan
    if plan is None or plan.replicas or step.options.microbatches > 1:
        return None
    used = sorted({p.compute for p in step.placements.values()})
    if len(used) < 2:
        return None
    what = "groups" if plan.groups else "devices"
    return (f"microbatches: the layers run on {len(used)} {what} ({', '.join(used)}) one "
            "after another; with microbatches they overlap as a pipeline: take the gradient "
            "with hetpar.value_and_grad (or hetpar.grad), drop-in replacements for JAX's, "
            f"and pass hetpar.auto(..., microbatches=M{', groups=...' if plan.groups else ''})")


def _describe(p: Placement) -> str:
    if not p.offloaded:
        return p.compute
    params = "" if p.params == p.state else f", parameters on {p.params}"
    return f"computes on {p.compute}, state on {p.state}{params}, update on {p.update}"


def _donated_lost(args: tuple, donate_argnums) -> bool:
    """Whether a step that failed gave up any of the caller's donated arrays."""
    return any(isinstance(x, jax.Array) and x.is_deleted()
               for i in donated_positions(donate_argnums, len(args))
               for x in jax.tree_util.tree_leaves(args[i]))
