"""A zoo model's traced step and its cost table, by model name (`hetpar plan MODEL`).

The zoo's way into the passes and the cost models: `trace_model` builds a
model's `Workload` and traces its train step into a `LayerGraph`;
`cost_table` goes on to the planner's CostTable (graph.json) on a device list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from absl import logging

from hetpar import cost_models
from hetpar.core import CostTable, ProfileError, seconds
from hetpar.cost_models import ProfileSet, load_profiles
from hetpar.passes import LayerGraph, trace
from hetpar.zoo._registry import get
from hetpar.zoo._workload import Workload


def _step_args(workload: Workload) -> tuple:
    """A workload's step arguments, abstract when the zoo allows it (nothing allocated)."""
    try:
        return tuple(jax.eval_shape(workload.example_args))
    except Exception:  # noqa: BLE001 - some zoo builds only run concretely
        logging.debug("eval_shape of example_args failed; building them concretely")
        return tuple(workload.example_args())


def trace_model(model: str, *, small: bool = False, batch: int | None = None,
                config: Mapping[str, Any] | None = None,
                depth: int | None = None) -> tuple[Workload, LayerGraph]:
    """(workload, LayerGraph) of a zoo model's train step.

    Args:
      model: a zoo name (`hetpar models`).
      small: the model's small test config.
      batch: batch size (default: the model's).
      config: model config overrides.
      depth: module-path depth that names layers (see `hetpar.trace`).
    """
    w = get(model, small=small, batch=batch, **dict(config or {}))
    return w, trace(w.train_step, *_step_args(w), depth=depth)


_BUDGET = cost_models.TimingBudget()  # the default: far slower devices stay predicted


def cost_table(
    model: str,
    devices: Sequence[str],
    *,
    small: bool = False,
    batch: int | None = None,
    config: Mapping[str, Any] | None = None,
    measure: bool = False,
    profiles: ProfileSet | str | None = None,
    k: int | None = None,
    progress: Callable[[str], None] | None = None,
    microbatches: int = 1,
    calibrate: bool = False,
    budget: cost_models.TimingBudget | None = _BUDGET,
) -> CostTable:
    """The CostTable of a zoo model's train step on `devices` (`hetpar plan MODEL`).

    Args:
      model: a zoo name (`hetpar models`).
      devices: as for `hetpar.cost_models.cost_table`.
      small: the model's small test config.
      batch: batch size (default: the model's).
      config: model config overrides.
      measure: measure present devices instead of predicting.
      profiles: a ProfileSet, or the path of a profile file.
      k: timed runs per measurement (default: `cost_models.LAYER_RUNS` per
        layer, 10 per whole step).
      progress: as for `hetpar.cost_models.cost_table`.
      microbatches: with `measure` and M > 1, also measure every layer at
        batch / M and fit its `fixed_s` (see `hetpar.cost_models.cost_table`),
        so pipelined plans pay what small microbatches really cost.
      calibrate: time the whole step under `jax.jit` (median of k runs) on
        each present device of `devices`, one per kind (the layers predicted
        from XLA's after-fusion bytes there), and scale every
        device's layers to it, spec-sheet devices by a measured device of
        their class (`scale_to_step(siblings=True)`): plan for an H100 from
        an H200 host (`hetpar costs MODEL --devices gpu:0,h100 --calibrate`).
      budget: what `measure` and `calibrate` leave predicted on a device far
        slower than the fastest present one (`cost_models.TimingBudget`);
        None times everything (`hetpar costs --measure-all`).

    Returns:
      The CostTable; `meta` also names the model and batch size.

    Raises:
      ProfileError: M > 1 without `measure`, a batch M does not divide, or
        `calibrate` without a present device in `devices`.
    """
    if isinstance(profiles, str):
        profiles = load_profiles(profiles)
    w, graph = trace_model(model, small=small, batch=batch, config=config)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ProfileError(f"microbatches must be a positive integer, got {microbatches!r}")
    small_graph = None
    if microbatches > 1:
        full = int(w.config["batch_size"])
        if not measure:
            raise ProfileError("microbatches > 1 fits fixed_s from measurements",
                               api="pass measure=True", cli="add --measure")
        if full % microbatches:
            raise ProfileError(f"microbatches={microbatches} does not divide the batch ({full})")
        _, small_graph = trace_model(model, small=small, batch=full // microbatches,
                                     config=config)
    table = cost_models.cost_table(
        graph, devices, profiles=profiles, measure=measure,
        k=cost_models.LAYER_RUNS if k is None else k, progress=progress,
        microbatch_graph=small_graph, microbatches=microbatches, budget=budget,
        fused_bytes=True if calibrate else None,
        meta={"model": model, "batch": w.config.get("batch_size"), "small": small})
    return _calibrated(table, w, 10 if k is None else k, progress, budget) if calibrate else table


def _calibrated(table: CostTable, w: Workload, k: int,
                progress: Callable[[str], None] | None,
                budget: cost_models.TimingBudget | None) -> CostTable:
    """`table` scaled to the whole step timed on its present devices (see `cost_table`)."""
    present = cost_models.present_devices()
    if not any(name in present for name in table.device_names):
        raise ProfileError(f"calibrate times the step on a present device; none of "
                           f"{list(table.device_names)} is present (present: "
                           f"{sorted(present)}). Add one, e.g. gpu:0")
    args = w.example_args()  # built once, for every kind timed

    def time_step(name: str, dev) -> float | None:
        t = cost_models.measure_step(w.train_step, args, dev, k=k, warmup=2).median_s
        if progress:
            progress(f"whole step on {name}: {seconds(t)} (jax.jit, median of {k})")
        return t

    def time_replicas(names: list[str], devs: list) -> float | None:
        if cost_models.batch_share(args, (-1,), len(devs)) is None:  # does not split
            return None
        t = cost_models.measure_step(w.train_step, args, devs, k=k, warmup=2).median_s
        if progress:
            progress(f"whole step data parallel over {', '.join(names)}: {seconds(t)} "
                     f"(jax.jit, median of {k})")
        return t

    from hetpar.runtime import (
        crossing_s,
        link_curve,
        place_line,
        place_link_figures,
        ring_figures,
        stage_overhead_s,
    )

    def reported(measure, line):
        def call(*args):
            value = measure(*args)
            if progress:
                progress(line(*args, value))
            return value
        return call

    overhead = reported(stage_overhead_s, lambda name, _, t:
                        f"runtime overhead per stage on {name}: {seconds(t)}")
    crossing = reported(crossing_s, lambda a, b, _, t:
                        f"runtime crossing {a[0]} <-> {b[0]}: {seconds(t)}")
    curve = reported(link_curve, lambda src, dst, sizes, c:
                     f"runtime copies {src} -> {dst}: " + (", ".join(
                         f"{b / 1e6:.3g} MB {seconds(t)}" for b, t in c) if c else "unmeasured"))
    def guarded(measure, what: str):
        # A runtime extra (collectives, host links) that fails leaves its
        # figures as they were, as the first call's calibration does.
        def call(names, devs):
            try:
                return measure(devs)
            except Exception as e:  # noqa: BLE001 - out of memory, a backend without it
                if progress:
                    progress(f"{what} over {'+'.join(names)}: not measured "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                return None
        return call

    collective = reported(guarded(ring_figures, "collectives"), lambda names, _, r: (
        f"collectives over {'+'.join(names)}: " + (
            f"a ring step {r[0] / 1e9:.3g} GB/s, {seconds(r[1])}" if r else "unmeasured")))
    places = reported(guarded(place_link_figures, "host links"), lambda names, _, b: (
        f"copies to and from the pinned host memory of {'+'.join(names)} at once: " + (
            place_line(b) if b else "unmeasured")))
    # (Layers measured at batch / M too already have their own fixed parts.)
    scaled = cost_models.scale_to_timed_step(table, present, time_step, overhead, crossing,
                                             time_replicas=time_replicas, budget=budget,
                                             curve=curve, collective=collective,
                                             place_links=places)
    if progress and scaled.meta.get("untimed_kinds"):
        progress(f"whole step not timed on {', '.join(scaled.meta['untimed_kinds'])}: predicted "
                 "over 10x the fastest device's (--measure-all times it)")
    return scaled
