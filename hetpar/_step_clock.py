"""A planned step's measured time beside the planner's prediction: `StepClock`
times a step's first calls and warns (`PredictionWarning`) when the two
differ by more than 25%."""

from __future__ import annotations

import os
import time
import warnings

import jax
import numpy as np

from hetpar.core import seconds


class StepClock:
    """Times a compiled step's first calls, to set the measured step beside the predicted.

    The first call compiles and the next `SETTLE` settle, untimed (first
    runs of each stage, host buffers of state kept in host memory: on an
    H100, the median of an offload plan's first five calls after compiling
    was 1.4x its steady 345 ms, a false warning; how many calls settling
    needs was not measured); the next `STEPS` are timed from the call to its
    results being ready (this process's part of them): those calls wait for
    their results, as a training loop that reads its loss does, so each is
    timed alone. Later calls are not timed and do not wait. Once timed, a
    planned step measured more than `TOLERANCE` away from the planner's
    prediction gives one warning (a one-device step, which nothing planned,
    is compared in `AutoStep.report()`).
    """

    STEPS = 5
    SETTLE = 2
    TOLERANCE = 0.25

    def __init__(self):
        self.calls = 0
        self.samples: list[float] = []
        self.done = False

    @property
    def measured_s(self) -> float | None:
        if len(self.samples) < self.STEPS:
            return None
        return float(np.median(self.samples))

    def observe(self, start: float, out, step) -> None:
        arrays = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
        devices = getattr(step, "executable_devices", None)  # None: several stages
        if devices:
            arrays = one_per_device(arrays, devices)
        if all(x.is_fully_addressable for x in arrays):
            # One wait for all: a shard at a time made a Python array per
            # shard, 892 for GPT-2 data parallel over two GPUs (~10 ms).
            wait(arrays)
        else:  # results of several processes: wait for the parts held here
            for x in arrays:
                for shard in x.addressable_shards:
                    shard.data.block_until_ready()
        self.calls += 1
        if self.calls > 1 + self.SETTLE:  # the first one compiled, the next settle
            self.samples.append(time.perf_counter() - start)
        if len(self.samples) >= self.STEPS:
            self.done = True
            # Compared where the planner ran; a one-device step (nothing planned)
            # is costed when its report is asked for, not in the training loop.
            if step.plan is not None:
                gap = self.summary(step)
                if gap.get("warning"):
                    warnings.warn(gap["warning"], PredictionWarning, stacklevel=3)

    def summary(self, step) -> dict:
        """{"predicted_s", "measured_s", "steps", "ratio", "calibration", "warning"}
        (None where unknown); `calibration` says where the prediction is the
        calibration's own timing of this step (`calibration_timing`)."""
        predicted = step.predicted()
        p = None if predicted is None else predicted.step_time_s
        m = self.measured_s
        own = calibration_timing(step)
        out = {"predicted_s": p, "measured_s": m, "steps": len(self.samples),
               "ratio": None, "calibration": own, "warning": None}
        if p and m:
            out["ratio"] = m / p
            if abs(m / p - 1) > self.TOLERANCE:
                head = (f"hetpar: the measured step ({seconds(m)}, median of "
                        f"{len(self.samples)}) is {m / p:.2f}x the planner's prediction "
                        f"({seconds(p)}), off by more than {self.TOLERANCE:.0%}. ")
                untimed = _untimed(step.table)
                used = {d for pl in step.placements.values() for d in pl.devices}
                if step.options.calibrates() and untimed:
                    out["warning"] = head + (
                        f"the calibration left {', '.join(untimed)} untimed (predicted "
                        "over 10x slower than the fastest device, cost_models.TimingBudget): "
                        "if the plan computes there, its figures are the spec sheet's; "
                        "`hetpar costs MODEL --measure --calibrate --measure-all` times them")
                elif own:
                    out["warning"] = head + (
                        f"The prediction is the calibration's own timing: the first call "
                        f"timed this whole step ({own}) while planning and scaled its layers "
                        "to it, so the gap says how repeatable the step's time is here (other "
                        "work on the machine, the first steps settling), not how good the "
                        "cost model is")
                elif step.options.calibrates() and len(used) == 1:
                    out["warning"] = head + (
                        f"The step runs on {next(iter(used))} alone, as one stage: the gap "
                        "is in its layers' times (timed here, each alone, and scaled to the "
                        "whole step), e.g. a step of microbatches, which that scaling did not "
                        "time whole")
                elif step.options.calibrates():
                    out["warning"] = head + (
                        "The layers, the whole step and the runtime's costs per stage "
                        "and crossing were measured here (the calibration): the gap is "
                        "how the stages overlap, e.g. devices sharing cores (virtual CPU "
                        "devices) slowing each other's stages; the replay "
                        "(hetpar.planner.simulate) shows what was assumed")
                else:
                    given = step.options.profile not in (None, "auto", "spec") or (
                        step.options.profile == "auto" and os.environ.get("HETPAR_PROFILES"))
                    source = "the profiles given" if given else "spec sheets (no profile given)"
                    out["warning"] = head + (
                        f"The prediction comes from {source}; pass profile='auto' (the "
                        "default; with HETPAR_CALIBRATE unset) or 'measure' to calibrate on "
                        "this machine at the first call, or run `hetpar profile --out "
                        "profiles.json` here and pass profile='profiles.json'")
        return out


def wait(arrays: list) -> None:
    """Waits until `arrays` are ready (one call, for tests to watch)."""
    jax.block_until_ready(arrays)


def one_per_device(arrays: list, devices: frozenset | None = None) -> list:
    """Of the results of one executable, enough arrays to hold a buffer on
    each device it ran on. An execution's results on a device are ready
    together (one definition event), so waiting for one there is waiting
    for all.

    `devices`, the devices the executable ran on where known (the clock
    always knows them): the results are taken in order until they cover
    them, which is the first result for a step sharded over all of them.
    Without, the widest are taken first (a replicated loss covers them
    all), which sorts them all: sorting 1,750 results by their device sets
    took 1.3 ms of each timed call on the two-H200 host (run 75).

    Waiting for every result was what the clock's steps paid: on two H200s
    the zoo's 5.04B fsdp step (over 1,700 buffers of state) ran 111-120 ms
    while the clock timed it and 104-106 ms after, where the same jit
    called directly and the hand-written FSDP ran 103-108 all through
    (experiments/results/fit_h200x2, run 71), and bench_fit's five steps,
    all timed by the clock, put hetpar at 1.14x the hand-written step (run
    70)."""
    seen: set = set()
    picked = []
    ordered = arrays if devices else sorted(arrays, key=lambda x: -len(x.sharding.device_set))
    for x in ordered:
        on = x.sharding.device_set
        if not on <= seen:
            picked.append(x)
            seen |= on
            if devices and seen >= devices:
                break
    return picked


def calibration_timing(step) -> str | None:
    """Where a step's prediction is its calibration's own timing, what was timed
    (`cpu:0`, `data parallel over gpu:0, gpu:1`); else None.

    Calibrating (`Options.calibrates`), the whole step is timed on each present device
    (and data parallel over a pair) while planning, and the layers are scaled
    to it (`cost_models.scale_to_step`): a plan that runs the step as it was
    timed (one device, one microbatch; or data parallel over the pair timed)
    is predicted what was just measured. Set beside later steps, that says
    how repeatable the timing is, not how good the cost model is (issue 42).
    """
    table = step.table
    if not step.options.calibrates() or table is None:
        return None
    plan = step.plan
    if plan is not None and plan.replicas:
        timed = table.meta.get("replicated_step_s") or {}
        if not plan.sharding and " ".join(plan.replicas) in timed:  # replicated, as timed
            return f"data parallel over {', '.join(plan.replicas)}"
        return None
    used = {d for pl in step.placements.values() for d in pl.devices}
    if len(used) == 1 and step.options.microbatches == 1:
        (device,) = used
        if device in (table.meta.get("step_s") or {}):
            return device
    return None


def _untimed(table) -> list[str]:
    """The devices and kinds a measured table left predicted (`TimingBudget`)."""
    if table is None:
        return []
    kept = {d for devices in table.meta.get("kept_predicted", {}).values() for d in devices}
    return sorted(kept) + [k for k in table.meta.get("untimed_kinds", ()) if k not in kept]


class PredictionWarning(UserWarning):
    """A step's measured time is far from what the planner predicted."""
