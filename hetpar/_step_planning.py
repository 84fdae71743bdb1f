"""Planning one compiled step: where its layers go, and on what figures.

Functions of the `CompiledStep` being planned (`compiled`), which they read
and fill in (`compiled.table`, `compiled.plan`): the devices it may run on
(`candidate_devices`), a plan given checked against them or the ILP solved
(`assign`, `solve_placements`), its cost table (`cost_table_for`, calibrated
to the whole step measured here under `profile="measure"`: `calibrated`),
a data-parallel plan (`data_parallel_plan`) and, under several processes,
the hierarchical plan weighed against the plan over every process's devices
(`hierarchical_step_s`, `with_allreduce`, `BatchShare`: this process's rows
of the batch).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np
from absl import logging

from hetpar._grad import is_key, microbatched
from hetpar.core import (
    HetparError,
    Placement,
    PlanError,
    is_memory_place,
    memory_place,
    nbytes,
    parse_placements,
    seconds,
)

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
    step_key,
    whole_step_s,
)
from hetpar._options import FORCED, Options, check_groups_present, check_places
from hetpar._signature import batch_positions
from hetpar.passes import LayerGraph, StaticLeaves, check_covers, trace


def _untimed_used(plan, table) -> frozenset[tuple[str, str]]:
    """(layer, device) pairs the plan computes on that `table` left predicted
    (`meta["kept_predicted"]`, profile="measure"'s TimingBudget)."""
    kept = table.meta.get("kept_predicted", {})
    return frozenset((n, p.compute) for n, p in plan.placements.items()
                     if p.compute in kept.get(n, ()))


def _untimed_steps(plan, table) -> frozenset[str]:
    """Device kinds whose whole step `table` left untimed (`untimed_kinds`)
    on which the plan spends at least half its predicted step: their layers,
    timed alone, are scaled to no step of theirs. Not a kind no round can
    time (`untimable_kinds`: the step does not fit there alone, or a run
    is over the budget's ceiling; a 6.7B Llama-style model on an H200 spent
    a 5 s round finding that again), and not a kind the plan computes no
    layer on: its busy time is then updates, each already timed alone (a
    0.54B model at 7.5 GB of an H200 spent 72 s timing every layer's
    forward and backward on the host CPU, which its plan used only to
    update state kept there)."""
    untimed = (set(table.meta.get("untimed_kinds", ()))
               - set(table.meta.get("untimable_kinds", ())))
    if plan.predicted is None or not untimed:
        return frozenset()
    computing = {table.device(p.compute).kind for p in plan.placements.values()}
    busy: dict[str, float] = {}
    for name, s in plan.predicted.busy_s.items():
        kind = table.device(name).kind
        if kind in untimed and kind in computing:
            busy[kind] = busy.get(kind, 0.0) + s
    step = plan.predicted.step_time_s
    return frozenset(k for k, s in busy.items() if s >= 0.5 * step)


def data_parallel_plan(compiled, replicas: tuple[str, ...], options: Options):
    """The Plan running the whole step data parallel over `replicas`, its state
    replicated or sharded as `options.data_parallel` forces ("zero1",
    "fsdp"; else replicated), predicted on `compiled.table` (no ILP).

    Raises:
      PlanError: replicas of mixed kinds (naming each one's), or the
        planner's reason the group cannot run the step (its memory).
    """
    from hetpar.planner import Plan, evaluate_data_parallel, evaluate_sharded

    kinds = {d: compiled.table.device(d).kind for d in replicas}
    if len(set(kinds.values())) > 1:
        raise PlanError(
            "data parallel runs the same program on every device of the group, which must "
            "be of one kind; these are " + ", ".join(f"{d} ({k})" for d, k in kinds.items()),
            api="pass devices= of one kind", cli="pass --devices of one kind")
    sharding = FORCED.get(options.data_parallel)
    if sharding is None:
        predicted = evaluate_data_parallel(compiled.table, replicas)
    else:
        predicted = evaluate_sharded(compiled.table, replicas, sharding)
    return Plan(fingerprint=compiled.table.fingerprint(), mode="sequential",
                objective=options.objective, microbatches=1,
                assignment=dict.fromkeys(compiled.graph.layers, replicas[0]),
                predicted=predicted,
                solver={"name": "none", "status": "given",
                        "chosen": f"{sharding or 'data parallel'} " + "+".join(replicas)},
                replicas=replicas, devices=compiled.table.device_names, sharding=sharding)


def candidate_devices(compiled, options: Options) -> list[str]:
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
    return list(compiled.devices)


def assign(compiled, options: Options) -> Mapping[str, str | Placement]:
    # A malformed profile file fails here, where one device or a plan dict
    # builds no cost table, not at report() after training.
    profile_set(compiled, options)
    plan = options.plan
    if plan is None:
        return solve_placements(compiled, options, candidate_devices(compiled, options))
    from hetpar.planner import Plan

    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    if isinstance(plan, Mapping):
        check_covers(compiled.graph, plan)
    assignment = dict(plan.placements if isinstance(plan, Plan) else parse_placements(plan))
    groups = getattr(plan, "groups", {})
    # A group plan's layers sit on groups: its devices are the groups' members.
    wanted = sorted({m for p in assignment.values() for d in p.devices
                     for m in (groups[d].devices if d in groups else (d,))}
                    | set(getattr(plan, "replicas", ())))
    check_places(wanted, compiled.devices)
    check_groups_present([g.devices for g in groups.values()], compiled.devices)
    absent = [d for d in wanted if memory_place(d)[0] not in compiled.devices]
    # A plan file's fingerprint covers every device it was planned over,
    # idle ones too: one absent here rejects it as surely as a used one.
    absent += [d for d in getattr(plan, "devices", ())
               if not is_memory_place(d) and d not in compiled.devices and d not in absent]
    if absent:
        if options.on_missing_device == "replan":
            devices = candidate_devices(compiled, options)  # within devices=, if given
            logging.warning("hetpar: plan names devices %s that are not present; replanning "
                            "on %s", absent, devices)
            return solve_placements(compiled, options, devices)
        used = [d for d in absent if d in wanted]
        raise PlanError(
            (f"the plan places layers on {used}" if used else
             f"the plan was planned over {list(plan.devices)}, its fingerprint covering "
             "them all")
            + f"; {', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not present "
            f"here (present: {', '.join(sorted(compiled.devices))})",
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
    over = [d for d in recorded if d in compiled.devices]
    table = cost_table_for(compiled, over if len(over) == len(recorded) > 0 else wanted, options)
    if plan.fingerprint != table.fingerprint():
        wider = cost_table_for(compiled, candidate_devices(compiled, options), options)
        if plan.fingerprint == wider.fingerprint():
            table = wider
    plan.check(table)
    compiled.table, compiled.plan = table, plan
    return dict(plan.placements)


def profile_set(compiled, options: Options):
    """The profiles this step's tables come from (`profiles_of`), read once."""
    if not hasattr(compiled, "_profiles"):
        compiled._profiles = profiles_of(options)
    return compiled._profiles


def cost_table_for(compiled, devices: list[str], options: Options,
                   graph: LayerGraph | None = None,
                   timed: frozenset[tuple[str, str]] = frozenset(),
                   steps: frozenset[str] = frozenset()):
    from hetpar.cost_models import TimingBudget

    calibrate = (options.calibrates() and graph is None
                 and compiled._calibration_args is not None)
    # profile="measure" times each layer alone on the present devices
    # (cached on disk by its jaxpr), then scales them to the whole step:
    # the roofline's layer shares put a pipeline's cut 10% off on GPT-2.
    # Far slower devices stay predicted, but for the `timed` pairs and
    # the whole step on the `steps` kinds.
    budget = TimingBudget(timed=timed, steps=steps)
    with compiled.first_call.phase("calibrate" if calibrate else "costs"):
        return _table_for(compiled, devices, options, graph, budget, calibrate,
                          again=bool(timed or steps))


def _table_for(compiled, devices: list[str], options: Options, graph, budget,
               calibrate: bool, *, again: bool):
    """`cost_table_for`'s table: from the profiles, calibrated here when asked."""
    from hetpar.cost_models import cache_dir, cost_table

    if calibrate:
        start = time.perf_counter()
        tell(f"hetpar: calibrating on {', '.join(d for d in devices if d in compiled.devices)}"
              f" at the first call: each layer and the whole step timed here, cached in "
              f"{cache_dir()} (profile='spec' or HETPAR_CALIBRATE=0 plans from spec sheets)")
    profiles = profile_set(compiled, options)
    layers = calibrate
    # profile="measure" times every layer, as asked; the default only those
    # whose times can move the plan.
    if calibrate and options.profile == "auto" and not again:
        table = cost_table(graph or compiled.graph, devices, profiles=profiles)
        alone = device_alone(table, devices, compiled.devices, options, compiled=compiled)
        if alone is not None and whole_step_timable(compiled, table, alone):
            # The plan is `alone` whatever the layers' shares: timing each
            # layer there (a compile each) would change no placement. The
            # whole step is still timed, and the layers scaled to it.
            layers = False
            tell(f"hetpar: the step fits {alone} and every other device is over "
                  f"{budget.slower:.0f}x slower: timing the whole step only")
        elif alone is not None:
            # It fits donated, but a timed run keeps the caller's state
            # beside its own, so the whole step is not timed there: without
            # its layers' times the plan was the spec sheet's (a 2.9B HF
            # Llama at 84 GB of an H200: 360.5 ms predicted, 179.1 run;
            # fit_h200, run 59).
            tell(f"hetpar: the step fits {alone} donated, but not beside the copy of its "
                 "state a timed run needs: timing its layers")
    if layers or not calibrate:
        table = cost_table(graph or compiled.graph, devices, profiles=profiles,
                           measure=layers, budget=budget,
                           progress=(lambda line: logging.info("hetpar: %s", line))
                           if layers else None)
    if calibrate:
        table = calibrated(compiled, table, budget, runtime=layers)
        tell(f"hetpar: calibrated in {time.perf_counter() - start:.1f} s")
    return table


def device_alone(table, devices: list[str], present, options: Options,
                 compiled=None) -> str | None:
    """The present device every plan for this step would compute it all on,
    or None: the fastest present device, where it holds the whole step
    (state, activations, working set, within its capacity: predicted, or,
    given the `compiled` step, its one-device executable's own figure,
    `fits_compiled`), has no peer of its kind among `devices` (no data
    parallel, no pipeline of equals), and every other device is predicted
    over `TimingBudget.slower` times slower (a host CPU beside a GPU). Only
    for the planner's own choice: not with a plan given, memory caps or
    microbatches; `profile="measure"` times every layer all the same."""
    from hetpar.cost_models import TimingBudget
    from hetpar.planner import violations

    if options.plan is not None or options.memory or options.microbatches > 1:
        return None
    total = {d: sum(layer.time_s.get(d, float("inf")) for layer in table.layers)
             for d in table.device_names}
    here = [d for d in devices if d in present and d in total]
    if not here:
        return None
    best = min(here, key=total.get)
    kind = table.device(best).kind
    slower = TimingBudget().slower
    # A device without every layer's time (a memory place) computes nothing.
    if any(d != best and math.isfinite(total[d]) and (
            table.device(d).kind == kind or total[d] < slower * total[best])
           for d in table.device_names):
        return None
    if options.donate_argnums:  # one copy of the state, as the planner counts it then
        from hetpar.planner._solve import with_donation

        table = with_donation(table)
    if violations(table, dict.fromkeys(table.layer_names, best)) and not (
            compiled is not None and fits_compiled(compiled, table, best)):
        return None
    return best


def _planning_table(compiled, devices: list[str], options: Options):
    """The table the planner solves: `compiled.table`, or, where the whole
    step fits one device alone by its compiled figure only
    (`fits_compiled`), that table with the device's memory unbounded, so
    that the plan is that device alone, as under `jax.jit`. (The plan keeps
    the planner's own memory figures: `step.report()` shows them beside the
    compiled and measured ones.)"""
    table = compiled.table
    alone = device_alone(table, devices, compiled.devices, options, compiled=compiled)
    if alone is not None and compiled._fits_compiled.get(alone):
        logging.info("hetpar: the whole step fits %s compiled: planned there alone", alone)
        return _roomy(table, alone)
    # Where the one-device compile did not fit, the planner plans with the
    # device's own capacity, not one scaled by its overcount: planned so, a
    # 6.74B step recomputed a few layers that saved nothing compiled (run 13).
    # It is the capacity less the margin the compiled check keeps back for a
    # split plan, where one accelerator computes beside the host. Where two
    # of one kind could run the step data parallel (one executable, checked
    # with the smaller MARGIN), a replica near the capacity would be planned
    # out: there the capacity stands, and the check replans a split plan
    # over it (no two-GPU machine measured this yet).
    accelerators = [d for d in devices
                    if d in compiled.devices and compiled.devices[d].platform != "cpu"]
    kinds = [table.device(d).kind for d in accelerators]
    if len(set(kinds)) < len(kinds):
        return table
    return within_split_margin(table, accelerators)


def within_split_margin(table, accelerators):
    """`table` with each of the present `accelerators` given its capacity less
    `_memory_check.SPLIT_MARGIN`, what the compiled check lets a split plan
    use there: a plan filling the whole capacity was always planned again,
    a compile of every stage later (a 2.9B Hugging Face Llama at 45 GB of an
    H200: planned at 45.0 GB, replayed compiled at 41.1 GB, over the 39.6 GB
    the check allows; experiments/results/fit_h200, run 20). Their memory
    places too (`gpu:0:pinned_host`), which the check holds to the same
    margin: a 6.74B plan filling XLA's pinned pool would be planned again
    for its place alone. CPU devices share the host's RAM, checked apart
    (`host_misfit`). A `memory=` cap is the caller's (or the check's own
    replanning cap) and stands as given."""
    from hetpar._memory_check import SPLIT_MARGIN

    if not accelerators:
        return table
    kept = set(accelerators) | {d.name for d in table.devices
                                if memory_place(d.name)[1] is not None
                                and memory_place(d.name)[0] in accelerators}
    return dataclasses.replace(table, devices=tuple(
        dataclasses.replace(d, memory_bytes=d.memory_bytes * (1 - SPLIT_MARGIN))
        if d.name in kept else d for d in table.devices))


def _roomy(table, name: str):
    """`table` with device `name` given memory without bound (the planner's
    own figures otherwise: what else keeps a plan off it)."""
    return dataclasses.replace(table, devices=tuple(
        dataclasses.replace(d, memory_bytes=1e30) if d.name == name else d
        for d in table.devices))


def fits_compiled(compiled, table, name: str) -> bool:
    """Whether the whole step, compiled for present device `name` alone as a
    one-device plan runs it (donation included), fits there less
    `_memory_check.MARGIN`, where only the planner's memory figures keep it
    off (`violations` names nothing else) and they put it at most
    `COMPILE_WITHIN` x the capacity.

    The planner's memory model overcounts what XLA's executables hold: on a
    15 GB H200 it planned a 0.54B Llama-style step with five layers
    recomputed (predicted 14.4 GB; compiled 10.0 GB, 1.64x jit's step) where
    the step under `jax.jit` ran in 14.2 GB (experiments/results/fit_h200).
    The compile is the one the one-device plan's first call runs (jit's
    cache serves it); one compile, cached per device, and only while
    planning on the caller's arguments (the calibration's)."""
    from hetpar._memory_check import COMPILE_WITHIN, MARGIN
    from hetpar.planner import evaluate, violations

    cache = compiled._fits_compiled
    if name in cache:
        return cache[name]
    cache[name] = False
    args = compiled._calibration_args
    if args is None or compiled._static is not None or name not in compiled.devices:
        return False
    everything = dict.fromkeys(table.layer_names, name)
    roomy = _roomy(table, name)
    if violations(roomy, everything):
        return False
    p = evaluate(roomy, everything)
    need = (p.peak_memory_bytes or p.memory_bytes or {}).get(name)
    cap = table.device(name).memory_bytes
    if need is None or need > COMPILE_WITHIN * cap:
        return False
    logging.info("hetpar: compiling the whole step for %s alone to see whether it fits (the "
                 "planner puts it at %s; it holds %s)", name, nbytes(need), nbytes(cap))
    try:
        with compiled.first_call.phase("compile"):
            peak = compiled.one_device_peak(name, args)
    except Exception as e:  # noqa: BLE001 - the compile ran out of memory: no fit
        logging.info("hetpar: compiling the step for %s alone failed (%s: %s)", name,
                     type(e).__name__, e)
        return False
    cache[name] = ok = peak is not None and peak <= (1 - MARGIN) * cap
    logging.info("hetpar: the planner puts the whole step on %s at %s (it holds %s); "
                 "compiled, it needs %s: %s", name, nbytes(need), nbytes(cap),
                 nbytes(peak or 0), "it fits" if ok else "it does not fit")
    return ok


def tell(line: str) -> None:
    """A progress line on stderr, as a user waiting on the first call sees it
    (absl's INFO lines are hidden by default)."""
    print(line, file=sys.stderr, flush=True)


def calibrated(compiled, table, budget, runtime: bool = True):
    """`table` scaled to the whole step measured under `jax.jit` on one
    present device of each kind it has (the calibration). With `runtime`,
    the runtime's own costs (per stage, per crossing, the links' copies) are
    measured too: not where one device runs the step alone (`device_alone`),
    which no stage, crossing or copy of the plan pays (a 0.54B model's warm
    first call on an H200 spent 6.7 s calibrating with its whole step read
    from the cache: these measurements and the spec table,
    experiments/results/fit_h200)."""
    from hetpar.cost_models import batch_share, scale_to_timed_step

    if jax.process_count() > 1:
        raise HetparError("profile='measure' calibrates in one process; under "
                          "jax.distributed run `hetpar profile` there and pass its file")
    if compiled._calibration_args is None:  # only while planning
        return table
    step, args, batch = compiled._step, compiled._calibration_args, compiled._batch_argnums
    key = step_key(compiled.graph.program)

    def replicas(names: list[str], devs: list) -> float | None:
        # The step data parallel over two devices, as Replicated runs it:
        # what a replica pays whole (launches, the host's dispatch to both)
        # is measured, not inferred from a smaller batch on one device.
        if batch_share(args, batch, len(devs)) is None:  # the batch does not split
            return None
        return whole_step_s(step, args, devs, batch, key=key,
                            failed=f"the step data parallel over {', '.join(names)}; data "
                                   "parallel is predicted from the whole step on one device")

    options = compiled.options
    # Only where the step may run data parallel (one more compile); a
    # microbatched step's layers were measured per microbatch already.
    dp = (options.microbatches == 1 and bool(options.data_parallel)
          and (options.plan is None or replicates(options.plan)))
    def whole(_, dev) -> float:
        # Timed once per device while planning: a re-planning round
        # (`solve_placements`) builds the table again.
        if dev not in compiled._whole_steps:
            compiled._whole_steps[dev] = whole_step_s(step, args, dev, batch, key=key,
                                                      jitted=compiled.shared_jit(dev))
        return compiled._whole_steps[dev]

    def replicas_once(names: list[str], devs: list) -> float | None:
        key = ("replicas", *names)
        if key not in compiled._whole_steps:
            compiled._whole_steps[key] = replicas(names, devs)
        return compiled._whole_steps[key]

    scaled = scale_to_timed_step(
        table, compiled.devices, whole, **(runtime_costs() if runtime else {}),
        time_replicas=replicas_once if dp else None, budget=budget,
        fits=lambda name: whole_step_timable(compiled, table, name))
    steps = [f"{d} {seconds(t)}" for d, t in (scaled.meta.get("step_s") or {}).items()]
    steps += [f"data parallel over {', '.join(pair.split())} {seconds(t)}"
              for pair, t in (scaled.meta.get("replicated_step_s") or {}).items()]
    logging.info("hetpar: calibrated to the whole step measured here: %s",
                 ", ".join(steps) or "none")
    return scaled


def whole_step_timable(compiled, table, name: str) -> bool:
    """Whether the calibration may time the whole step on device `name`:
    the step fits there alone as the planner counts it without donation
    (the timed run keeps the caller's arguments beside its own state), or
    its one-device compile fitted and is the run (`fits_compiled`; not with
    donation: the run then holds one state, the timed run the caller's
    beside its own copy)."""
    return _fits_alone(table, name, compiled.options.memory) or (
        # the run is the compile `fits_compiled` checked (`shared_jit`)
        not compiled._donated and compiled._fits_compiled.get(name, False))


def _fits_alone(table, name: str, memory=None) -> bool:
    """Whether the whole step is predicted to fit device `name` alone (the
    calibration times it only there: elsewhere the run would only run out of
    memory; a 0.54B model on a 15 GB H200 spent 130 s of its first call in
    XLA's autotuner and an out-of-memory run, experiments/results/fit_h200)."""
    from hetpar.planner import violations
    from hetpar.planner._solve import with_memory

    # memory= as the planner reads it; no donation: the calibration keeps the
    # caller's arguments beside the state it runs on
    capped = with_memory(table, memory) if memory else table
    return not violations(capped, dict.fromkeys(table.layer_names, name))


def hierarchical_step_s(compiled, fn: Callable, args: tuple, options: Options) -> float | None:
    """The predicted step of a hierarchical plan (see `auto`'s `hierarchical`):
    the planner's plan over process 0's devices for one process's share of
    the batch, plus the gradients' all-reduce across the processes. None
    where the batch does not split over the processes."""
    from hetpar.planner import plan as solve

    try:
        share = BatchShare(args, options)
    except HetparError:
        return None
    local = share(args)
    m = options.microbatches
    static = StaticLeaves(microbatched(fn, m, batch_positions(options.batch_argnums,
                                                               len(local))), local)
    graph = trace(static.pure_step, *static.pure_args, depth=options.depth,
                  batch_argnums=options.batch_argnums)
    hier = dataclasses.replace(options, hierarchical=True)
    devices = candidate_devices(compiled, hier)
    if len(devices) == 1:
        table = cost_table_for(compiled, devices, hier, graph)
        from hetpar.planner import evaluate

        step = evaluate(table, dict.fromkeys(graph.layers, devices[0])).step_time_s
    else:
        table = cost_table_for(compiled, devices, hier, graph)
        step = solve(table, objective="time", mode="pipelined" if m > 1 else "sequential",
                     microbatches=m, data_parallel=False, schedule=options.schedule,
                     memory=options.memory).predicted.step_time_s
    return step + allreduce_across_processes_s(table, options)


def with_allreduce(compiled, plan, options: Options):
    """A hierarchical plan with the gradients' all-reduce across processes
    added to its predicted step (and so named in `solver`)."""
    extra = allreduce_across_processes_s(compiled.table, options)
    p = plan.predicted
    return dataclasses.replace(
        plan, predicted=dataclasses.replace(p, step_time_s=p.step_time_s + extra,
                                            transfer_s=p.transfer_s + extra),
        solver={**plan.solver, "chosen": f"hierarchical over {jax.process_count()} "
                f"processes (gradients all-reduced: {extra:.3g} s)"})


def solve_placements(compiled, options: Options, devices: list[str]) -> dict[str, Placement]:
    from hetpar.planner import plan as solve

    if options.groups:
        return _over_groups(compiled, options)
    if options.data_parallel in FORCED:
        if not options.devices:
            from hetpar._distributed import device_names

            devices = device_names(jax.devices())  # the default backend's
        compiled.table = cost_table_for(compiled, devices, options)
        compiled.plan = data_parallel_plan(compiled, tuple(devices), options)
        return dict(compiled.plan.placements)
    if len(devices) == 1:
        return dict.fromkeys(compiled.graph.layers, devices[0])
    # (A replan starts from what the step's last plan timed.)
    timed, steps = compiled._timed, compiled._timed_steps
    compiled.table = cost_table_for(compiled, devices, options, timed=timed, steps=steps)
    m = options.microbatches

    def planned():
        return solve(_planning_table(compiled, devices, options), objective=options.objective,
                     mode="pipelined" if m > 1 else "sequential", microbatches=m,
                     data_parallel=bool(options.data_parallel) and compiled._share is None,
                     sharded=options.data_parallel is True,
                     # (group plans run in one process: GroupRunner)
                     groups=jax.process_count() == 1,
                     schedule=options.schedule, memory=options.memory,
                     donate=bool(options.donate_argnums))

    compiled.plan = planned()
    # profile="measure" left far slower devices predicted (TimingBudget);
    # a plan that computes layers there stood on spec sheets: time those
    # layers there and plan again (GPT-2 at batch 16 on an H200 host,
    # planned on the CPU's spec sheet with a quarter of the GPU's memory,
    # predicted 1.08 s and ran in 0.36 s).
    # A plan that spends most of its step on such a device also has the
    # whole step timed there, as the fastest device has: its layers timed
    # alone summed to 1.2x the step (GPT-2, batch 16, an H100 host's CPU).
    for _ in range(3):  # each round times what the last plan used; few rounds move
        used = _untimed_used(compiled.plan, compiled.table) - timed
        # The layers the plan computes there first: timed, they mostly move
        # the plan off that device. A round timing every layer on it (the
        # whole step) only where the plan still leans on it after (a 2.9B
        # Llama at 45 GB of an H200 spent minutes timing all 27 layers on
        # the host CPU for a plan that put 5 there on spec-sheet figures).
        busy = frozenset() if used else _untimed_steps(compiled.plan, compiled.table) - steps
        if not used and not busy:
            break
        if used:
            logging.info("hetpar: the plan computes %d layers on devices left untimed (%s); "
                         "timing them and planning again", len(used),
                         ", ".join(sorted({d for _, d in used})))
        else:
            logging.info("hetpar: the plan spends most of its step on %s, whose layers were "
                         "not timed together; timing them and planning again",
                         ", ".join(sorted(busy)))
        timed |= used
        steps |= busy
        compiled._timed, compiled._timed_steps = timed, steps
        compiled.table = cost_table_for(compiled, devices, options, timed=timed, steps=steps)
        compiled.plan = planned()
    else:
        left = _untimed_used(compiled.plan, compiled.table) - timed
        busy = _untimed_steps(compiled.plan, compiled.table) - steps
        if busy:
            logging.warning("hetpar: after 3 rounds the plan spends most of its step on %s, "
                            "whose whole step is not timed; its layers are not scaled to it",
                            ", ".join(sorted(busy)))
        if left:
            logging.warning("hetpar: after 3 rounds the plan still computes %d layers on "
                            "devices left untimed; their figures are predicted", len(left))
    return dict(compiled.plan.placements)


def _over_groups(compiled, options: Options) -> dict[str, Placement]:
    """`hetpar.auto(groups=...)`: the ILP places the layers over the groups
    given, each sharded as `data_parallel` names ("zero1"; "always": state
    replicated; otherwise "fsdp")."""
    from hetpar.planner import groups_of, plan_over_groups

    check_groups_present(options.groups, compiled.devices)
    members = [d for g in options.groups for d in g]
    sharding = (FORCED[options.data_parallel] if options.data_parallel in FORCED
                else "fsdp")
    compiled.table = cost_table_for(compiled, members, options)
    m = options.microbatches
    compiled.plan = plan_over_groups(
        compiled.table, groups_of(options.groups, sharding, options.group_state),
        objective=options.objective, mode="pipelined" if m > 1 else "sequential",
        microbatches=m, schedule=options.schedule, memory=options.memory,
        donate=bool(options.donate_argnums))
    return dict(compiled.plan.placements)


class BatchShare:
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


def replicates(plan) -> bool:
    """Whether `plan` (a Plan, a plan.json path, a dict or None) runs data parallel."""
    if plan is None or isinstance(plan, Mapping):
        return False
    if isinstance(plan, (str, os.PathLike)):
        from hetpar.planner import Plan

        plan = Plan.load(plan)
    return bool(getattr(plan, "replicas", ()))
