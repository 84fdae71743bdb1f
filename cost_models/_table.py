"""From a LayerGraph and a device list to the planner's CostTable (graph.json).

`cost_table` fills, for every (layer, device), the time of the layer's stage
(forward + backward + update: what the runtime will run for it) and the
memory it holds, and adds the devices (capacity, price, power) and the links
between them (`_resolve` names the devices and finds the links).

Times
-----
Predicted by the roofline (`predict`) from the layer's counted work (the op
class `data_movement` and control flow count as `other`), with one launch:
a layer is one executable. With `measure=True`, present devices are measured
instead: the layer's callable alone, random inputs of the right dtypes,
the lower quartile of up to k runs (`Timing.typical_s`), cached on disk
(`measure_layer`; a CPU's layers timed together first, interleaved, as a
step runs them: `measure_layers`). The predictions are
kept in `meta` next to the measurements so reports can show both. A
spec-sheet device of a measured device's class (planning for an `h100` on
an H200 host) takes the measured time x the two rooflines' ratio.
`scale_to_step` rescales a table's layers to measured whole-step times (and,
with `siblings`, a spec-sheet device's by its measured sibling's factor).

Optimizer updates
-----------------
Each layer also gets `opt_state_bytes` and `update_s`: its optimizer
update's time on every device, priced by the same roofline from the
update's equations alone (`update_work`), so the offload planner can move
the update to the host CPU that holds the state. Measured tables time each
update alone on the present devices (`measure_update`) where an update may
run apart: a present CPU beside a device of another class.

Devices
-------
Present CPU devices of one process share its cores: the table puts them in
one `compute_group`, and the planner then never overlaps their work.

Memory places
-------------
Beside every accelerator of a list with a CPU device, the table also gets
that accelerator's pinned host memory as a device of kind `pinned_host`
named `<accelerator>:pinned_host` (`gpu:0:pinned_host`): memory_bytes the
host CPU device's (they share the host's RAM; the planner caps the two
together), no price or power, no compute group, no layer times (no layer
computes there; layers' `memory_bytes` and `update_s` never name it), and
links both ways to its accelerator alone, at the bus's speed rather than the
CPU device's (`_resolve.memory_places`). The offload planner streams
optimizer state from there for updates on the accelerator, as JAX's host
offload does. `memory_places=False` leaves them out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import logging

from hetpar.core import CostTable, Device, Edge, Layer, ProfileError, seconds
from hetpar.core._graph import curve_rate
from hetpar.cost_models._equation_model import matmul_equations, predict_layer
from hetpar.cost_models._layer_timing import (
    INTERLEAVED_PLATFORMS,
    LAYER_RUNS,
    measure_layer,
    measure_layers,
    measure_update,
)
from hetpar.cost_models._layer_work import graph_layer_work, layer_fused_bytes, update_work
from hetpar.cost_models._profiles import ProfileSet
from hetpar.cost_models._resolve import (
    PLACE_KIND,
    MemoryPlace,
    ResolvedDevice,
    memory_places,
    resolve_devices,
    resolve_links,
    split_places,
    typical_copy,
)
from hetpar.cost_models._roofline import FUSED_BYTES_CLASSES, LayerWork, predict
from hetpar.cost_models._specs import plan_prices, spec, spec_kinds


@dataclasses.dataclass(frozen=True)
class TimingBudget:
    """What `measure=True` and `scale_to_timed_step` leave predicted: timing
    that costs more than it can change a plan.

    A present device of another kind than the fastest present device,
    predicted more than `slower` times slower (for one layer, or for the
    whole step) and over `floor_s` (a layer's run) or `step_floor_s` (a
    whole step), is not timed: its layers keep their predictions (or follow
    a measured device of their class, as a spec-sheet sibling does). The
    runtime's own costs (per stage, crossings, copies) are still measured
    there: they take milliseconds. On an H200 host, GPT-2 small at batch
    256 takes seconds a layer on the host CPU, ~15 ms on the GPU: timing
    each CPU layer three times and the whole step there took past 340 s,
    for a device that computes no layer of the plan chosen. Devices of the
    fastest one's kind (virtual CPU devices, two GPUs) are always timed,
    and so are the (layer, device) pairs in `timed`: those a plan made on
    the predictions computes (`hetpar.auto` times them and plans again),
    and the whole step and every layer on the device kinds in `steps`:
    those such a plan spends most of its step on (layers timed alone sum
    past the stage that runs them together: GPT-2 at batch 16 on an H100
    host's CPU, 2.42 s against 2.02 s), scaled to the step as the fastest
    kind is; every layer, since a scale over spec-sheet figures is not
    one. `None` in place of a budget times everything.
    """

    slower: float = 10.0
    floor_s: float = 0.25
    step_floor_s: float = 1.0
    timed: frozenset[tuple[str, str]] = frozenset()
    steps: frozenset[str] = frozenset()

    def __post_init__(self):
        if not self.slower >= 1.0 or not (self.floor_s >= 0 and self.step_floor_s >= 0):
            raise ProfileError(
                f"TimingBudget(slower={self.slower!r}, floor_s={self.floor_s!r}, "
                f"step_floor_s={self.step_floor_s!r}): slower must be >= 1 (how many times "
                "the fastest device's time) and the floors >= 0 seconds; pass budget=None "
                "to time every device")
        if isinstance(self.steps, str) or not all(isinstance(k, str) for k in self.steps):
            raise ProfileError(
                f"TimingBudget(steps={self.steps!r}): steps is a set of device kinds, e.g. "
                "frozenset({'cpu'})")
        object.__setattr__(self, "steps", frozenset(self.steps))

    def skips(self, predicted_s: float, fastest_s: float, *, step: bool = False) -> bool:
        floor = self.step_floor_s if step else self.floor_s
        return predicted_s > max(floor, self.slower * fastest_s)


def cost_table(
    graph,
    devices: Sequence[str],
    *,
    profiles: ProfileSet | None = None,
    measure: bool = False,
    k: int = LAYER_RUNS,
    progress: Callable[[str], None] | None = None,
    host_cpu_included: bool = True,
    meta: Mapping[str, Any] | None = None,
    microbatch_graph=None,
    microbatches: int = 1,
    memory_places: bool = True,
    fused_bytes: bool | None = None,
    budget: TimingBudget | None = TimingBudget(),
) -> CostTable:
    """The planner's CostTable of `graph` on `devices`.

    Args:
      graph: a LayerGraph (`hetpar.passes.trace`).
      devices: present devices (`cpu:0`, `gpu:0`) and spec-sheet kinds
        (`h100`, `tpu-v5e`); see `_resolve` for their graph.json names.
      profiles: measured profiles (`load_profiles(path)`); default: spec
        sheets alone.
      measure: measure every layer on the present devices instead of
        predicting it. A spec-sheet device of a measured device's class
        (`h100` beside a present H200) takes that device's measured time x
        their predicted ratio; other spec-sheet devices stay predicted. The predictions
        kept in `meta` then use XLA's after-fusion bytes of each layer
        (`_fused_works`); without `measure` they use the unfused count.
      k: timed runs per measurement (at most: fewer for slow layers); a
        layer's time is their lower quartile (`Timing.typical_s`).
      progress: called with one line per measured layer.
      host_cpu_included: price the host CPU beside an accelerator at its
        `host_price_per_hour` (see `plan_prices`).
      meta: extra entries for the table's `meta`.
      microbatch_graph: with `measure`, the same step traced at batch / M
        (same layer names). Each layer is measured there too and its
        `fixed_s` (what every microbatch pays whole: kernel launches) is
        fitted from t = fixed + per_sample x batch at both sizes:
        fixed = (M t_small - t) / (M - 1), clipped to [0, t].
      microbatches: M, the ratio of the two batches.
      fused_bytes: predict GPUs and TPUs from XLA's after-fusion bytes of
        each layer (compiled for a present device of their class; default:
        with `measure`). Profiles fitted on measured layers (`hetpar profile
        --fit`) fit their bytes efficiency on these bytes.
      memory_places: add each accelerator's pinned host memory as a device
        of kind `pinned_host` when the list has a CPU device (see the
        module docstring); memory places named in `devices`
        (`gpu:0:pinned_host`) are added whatever this says.
      budget: with `measure`, a layer predicted far slower on a present
        device than on the fastest present one (of another kind) is not
        timed there (`TimingBudget`; listed in `meta["kept_predicted"]`);
        None measures every layer everywhere.

    Returns:
      A validated `hetpar.core.CostTable`. Its `meta` holds the
      predicted (`predicted_s`) and, with `measure`, measured
      (`measured_s`, `measured_iqr_s`) seconds per layer and device, and the
      source of every device's figures.

    Raises:
      ProfileError: unknown device kind, or `measure` for a device that is
        not present.
    """
    profiles = profiles if profiles is not None else ProfileSet(
        {k_: spec(k_) for k_ in spec_kinds()})
    devices, listed_places = split_places(devices)
    devs = resolve_devices(devices, profiles, measure=measure)
    sizes = _edge_sizes(graph)
    places = _memory_places(devs, profiles, sizes, listed_places, memory_places)
    if microbatch_graph is not None and not (measure and microbatches > 1):
        raise ProfileError("microbatch_graph needs measure=True and microbatches > 1")
    times = _Times()
    fused_bytes = measure if fused_bytes is None else fused_bytes
    for name in graph.layers:
        _predict(graph, name, devs, times, fused_bytes=fused_bytes)
    if measure:
        _time_together(graph, devs, times, k=k, microbatch_graph=microbatch_graph,
                       budget=budget, say=progress)
    layers = [_layer(graph, name, devs, times, measure=measure, k=k,
                     microbatch_graph=microbatch_graph, microbatches=microbatches, budget=budget,
                     say=None if progress is None else _counted(progress, i, len(graph.layers)))
              for i, name in enumerate(graph.layers)]
    edges = [Edge(u, v, float(e["bytes"]), float(e["bytes_backward"]))
             for u, v, e in graph.graph.edges(data=True)]
    info_meta: dict[str, Any] = {
        "source": "hetpar costs",
        "graph_fingerprint": graph.fingerprint(),
        "timing": "measured" if measure else "predicted",
        "predicted_s": times.predicted,
        "device_sources": {d.name: {"origin": d.profile.origin, **dict(d.profile.sources)}
                           for d in devs},
    }
    # What a present device holds here (`as_present`): `memory=` may cap it, never raise it.
    info_meta["present_capacity"] = {d.name: float(d.profile.memory_bytes) for d in devs
                                     if d.jax_device is not None}
    info_meta["present_capacity"].update(
        {p.name: float(p.memory_bytes) for p in places if p.device.jax_device is not None})
    for place in places:
        info_meta["device_sources"][place.name] = {
            "origin": "memory place", "device": place.device.name,
            "memory_bytes": f"the RAM of host {place.host or 'cpu (spec sheet)'}"}
    if measure:
        info_meta["measured_s"] = times.measured
        info_meta["measured_iqr_s"] = times.measured_iqr
        if times.kept:
            info_meta["kept_predicted"] = times.kept
        if times.updates:
            info_meta["measured_update_s"] = times.updates
    if times.fixed:
        info_meta["fixed_s"] = f"fitted from each layer measured at batch and batch/{microbatches}"
    info_meta.update(meta or {})
    links = resolve_links(devs, profiles, sizes) + [k for p in places for k in p.links()]
    return CostTable(devices=_table_devices(devs, host_cpu_included=host_cpu_included)
                     + tuple(_place_device(p) for p in places),
                     links=tuple(links), layers=tuple(layers), edges=tuple(edges), meta=info_meta)


def _memory_places(devs: Sequence[ResolvedDevice], profiles: ProfileSet,
                   sizes: Sequence[float], listed: Sequence[str],
                   wanted: bool) -> list[MemoryPlace]:
    """The table's memory places: every accelerator's (when `wanted`) and the listed ones."""
    if not wanted and not listed:
        return []
    places = memory_places(devs, profiles, sizes, listed)
    return places if wanted else [p for p in places if p.name in listed]


def _place_device(place: MemoryPlace) -> Device:
    """The graph.json device of a memory place: host memory, free, computing nothing."""
    return Device(name=place.name, kind=PLACE_KIND, memory_bytes=place.memory_bytes)


@dataclasses.dataclass
class _Times:
    """Seconds by layer and device name: predicted, and measured where asked."""

    predicted: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    measured: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    measured_iqr: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    kept: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # not measured
    updates: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    fixed: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def _counted(progress: Callable[[str], None], i: int, n: int) -> Callable[[str], None]:
    """`progress` with `[i+1/n] ` before every line."""
    return lambda msg: progress(f"[{i + 1}/{n}] {msg}")


def _predict(graph, name: str, devs: Sequence[ResolvedDevice], times: _Times, *,
             fused_bytes: bool) -> None:
    """Records the layer's predicted time on every device in `times.predicted`."""
    work = graph_layer_work(graph, name)
    works = (_fused_works(graph, name, work, devs) if fused_bytes
             else {d.name: work for d in devs})
    eqs = (matmul_equations(graph, name) if any(d.profile.layer_model for d in devs)
           else ())
    times.predicted[name] = {d.name: predict_layer(d.profile, works[d.name], eqs)
                             for d in devs}


def _time_together(graph, devs: Sequence[ResolvedDevice], times: _Times, *, k: int,
                   microbatch_graph, budget: TimingBudget | None,
                   say: Callable[[str], None] | None) -> None:
    """On present devices whose layers are timed interleaved (a CPU:
    `INTERLEAVED_PLATFORMS`), the layers the budget times there, and every
    update where updates may run apart, timed together first
    (`measure_layers`, into the disk cache the rows read), as a step runs
    them: one layer timed alone there came out up to 2.9x faster than
    after the others."""
    updates = _updates_apart(devs)  # then every update is timed (`_measure_updates`)
    for d in devs:
        if d.jax_device is None or d.jax_device.platform not in INTERLEAVED_PLATFORMS:
            continue
        names = [n for n in graph.layers if not _skipped(n, d, devs, times, budget)]
        if names:
            if say:
                say(f"timing {len(names)} layers on {d.name} together")
            measure_layers(graph, names, d.jax_device, k=k)
        if names and microbatch_graph is not None:
            measure_layers(microbatch_graph, [n for n in names if n in microbatch_graph.layers],
                           d.jax_device, k=k)
        if updates:
            measure_layers(graph, list(graph.layers), d.jax_device, update=True, k=k)


def _skipped(name: str, d: ResolvedDevice, devs: Sequence[ResolvedDevice], times: _Times,
             budget: TimingBudget | None) -> bool:
    """Whether `budget` leaves the layer predicted on device `d`."""
    predicted = times.predicted[name]
    fastest = min((x for x in devs if x.jax_device is not None),
                  key=lambda x: predicted[x.name], default=None)
    return (budget is not None and fastest is not None
            and d.profile.kind != fastest.profile.kind
            and (name, d.name) not in budget.timed and d.profile.kind not in budget.steps
            and budget.skips(predicted[d.name], predicted[fastest.name]))


def _layer(graph, name: str, devs: Sequence[ResolvedDevice], times: _Times, *,
           measure: bool, k: int, microbatch_graph, microbatches: int,
           budget: TimingBudget | None, say: Callable[[str], None] | None) -> Layer:
    """The table's row of one layer: its predictions (`_predict`), and its
    measured times on present devices."""
    info = graph[name]
    row = dict(times.predicted[name])
    if measure:
        measured = _measure_present(graph, name, devs, times, k=k,
                                    microbatch_graph=microbatch_graph,
                                    microbatches=microbatches, budget=budget, say=say)
        row.update(measured)
        row.update(_from_siblings(devs, measured, times.predicted[name]))
    mem = float(info.memory_bytes)
    upd = update_work(graph, name)
    update_s = None if upd is None else {d.name: predict(d.profile, upd) for d in devs}
    if measure and update_s is not None and _updates_apart(devs):
        update_s.update(_measure_updates(graph, name, devs, times, k=k, say=say))
    return Layer(name=name, time_s=row, memory_bytes={d.name: mem for d in devs},
                 activation_bytes=float(info.activation_bytes),
                 fixed_s=times.fixed.get(name), param_bytes=float(info.param_bytes),
                 opt_state_bytes=float(info.opt_state_bytes),
                 recompute_fraction=float(info.recompute_fraction),
                 workspace_bytes=float(info.workspace_bytes),
                 update_s=update_s)


def _updates_apart(devs: Sequence[ResolvedDevice]) -> bool:
    """Whether a plan may run an update apart from its layer's compute: a
    present CPU beside a present device of another class (the host CPU that
    updates the state it holds, `hetpar.core.Placement.update`)."""
    present = {d.profile.device_class for d in devs if d.jax_device is not None}
    return "cpu" in present and len(present) > 1


def _measure_updates(graph, name: str, devs: Sequence[ResolvedDevice], times: _Times, *,
                     k: int, say: Callable[[str], None] | None) -> dict[str, float]:
    """The layer's optimizer update timed alone on every present device
    (recorded in `times.updates`). Every one, whatever the budget: an update
    is elementwise over the layer's state, milliseconds even on a host CPU,
    and the offload planner's host updates stand on it: on spec-sheet CPU
    figures, GPT-2's offload plans on an H200 host predicted 3x their
    measured step (experiments/results/predictions_memory_bound)."""
    out = {}
    for d in devs:
        if d.jax_device is None:
            continue
        t = measure_update(graph, name, d.jax_device, k=k)
        if t is None:  # no update equations (the caller checks update_work first)
            continue
        out[d.name] = times.updates.setdefault(name, {})[d.name] = t.typical_s
        if say:
            say(f"{name}'s update on {d.name}: {seconds(t.typical_s)}"
                + (" cached" if t.earlier else ""))
    return out


def _measure_present(graph, name: str, devs: Sequence[ResolvedDevice], times: _Times, *,
                     k: int, microbatch_graph, microbatches: int, budget: TimingBudget | None,
                     say: Callable[[str], None] | None) -> dict[str, float]:
    """Measures one layer on every present device (but those `budget`
    skips); records it in `times`.

    With `microbatch_graph`, the layer is measured there too and its
    `fixed_s` fitted (see `cost_table`).

    Returns:
      {device name: measured seconds (`Timing.typical_s`)}.
    """
    out = {}
    predicted = times.predicted[name]
    fastest = min((d for d in devs if d.jax_device is not None),
                  key=lambda d: predicted[d.name], default=None)
    for d in devs:
        if d.jax_device is None:
            continue
        if _skipped(name, d, devs, times, budget):
            times.kept.setdefault(name, []).append(d.name)
            if say:
                say(f"{name} on {d.name}: not timed, predicted {seconds(predicted[d.name])} "
                    f"(over {budget.slower:g}x {fastest.name}'s "
                    f"{seconds(predicted[fastest.name])})")
            continue
        t = measure_layer(graph, name, d.jax_device, k=k)
        times.measured.setdefault(name, {})[d.name] = t.typical_s
        times.measured_iqr.setdefault(name, {})[d.name] = t.iqr_s
        out[d.name] = t.typical_s
        if microbatch_graph is not None and name in microbatch_graph.layers:
            small = measure_layer(microbatch_graph, name, d.jax_device, k=k).typical_s
            f = (microbatches * small - t.typical_s) / (microbatches - 1)
            times.fixed.setdefault(name, {})[d.name] = min(max(f, 0.0), t.typical_s)
        if say:
            say(f"{name} on {d.name}: {seconds(t.typical_s)}"
                f" (predicted {seconds(times.predicted[name][d.name])})"
                + (" cached" if t.earlier else ""))
    return out


def _from_siblings(devs: Sequence[ResolvedDevice], measured: Mapping[str, float],
                   predicted: Mapping[str, float]) -> dict[str, float]:
    """Times of the devices not measured, from a measured device of their class:
    its time x the two devices' predicted ratio for this layer (Habitat's way
    of predicting one GPU from another; checked H200 <-> H100 in
    experiments/cross_card.py)."""
    by_class: dict[str, str] = {}
    for d in devs:
        if d.name in measured:
            by_class.setdefault(d.profile.device_class, d.name)
    out = {}
    for d in devs:
        src = by_class.get(d.profile.device_class)
        if d.name not in measured and src is not None and predicted[src] > 0:
            out[d.name] = measured[src] * predicted[d.name] / predicted[src]
    return out


def _table_devices(devs: Sequence[ResolvedDevice], *,
                   host_cpu_included: bool) -> tuple[Device, ...]:
    """The graph.json devices: capacity, the plan's price (`plan_prices`), power, and
    the compute group of present CPU devices (`compute_groups`)."""
    prices = plan_prices([d.profile for d in devs], host_cpu_included=host_cpu_included)
    # A host CPU that is free beside its accelerator is still rented as a CPU
    # machine by a plan that uses it alone.
    alone = {d.name: float(d.profile.price_per_hour) for d in devs
             if d.profile.price_per_hour > prices[d.name]}
    groups = compute_groups(devs)
    return tuple(
        Device(name=d.name, kind=d.kind, memory_bytes=float(d.profile.memory_bytes),
               price_per_hour=float(prices[d.name]), watts_busy=float(d.profile.watts_busy),
               watts_idle=float(d.profile.watts_idle), price_alone_per_hour=alone.get(d.name),
               compute_group=groups.get(d.name))
        for d in devs
    )


def compute_groups(devs: Sequence[ResolvedDevice]) -> dict[str, str]:
    """{device name: compute group} for the present CPU devices that share cores.

    JAX's CPU devices of one process (several with
    `--xla_force_host_platform_device_count`) are virtual: they run on the
    same host cores, so splitting work across them gains nothing. On the
    2-core development machine a 2-CPU pipeline of the small transformer,
    planned as independent devices, was predicted 1.29x faster than one CPU
    and measured 3.5x slower than `jax.jit`. Each group with two or more
    devices in the table is named `process<i>-cpu`. Spec-sheet devices (no
    JAX device behind them) stay independent, and so does a present CPU
    device that a profile file describes as another class (a virtual CPU
    standing in for a GPU in tests).
    """
    by_process: dict[str, list[str]] = {}
    for d in devs:
        jd = d.jax_device
        if jd is not None and jd.platform == "cpu" and d.profile.device_class == "cpu":
            by_process.setdefault(f"process{jd.process_index}-cpu", []).append(d.name)
    return {name: group for group, names in by_process.items() if len(names) > 1
            for name in names}


def _fused_works(graph, layer: str, work: LayerWork,
                 devs: Sequence[ResolvedDevice]) -> dict[str, LayerWork]:
    """Per device, `work` with the after-fusion bytes where they can be known.

    A present device gets its own backend's figure (the layer is compiled
    for it to be measured anyway). A spec-sheet device borrows the figure
    of a present device of its class (same compiler, same fusion; the
    fused/unfused ratio of the layer carries over), else keeps the
    unfused count. Only devices that price with them get them: a class in
    `FUSED_BYTES_CLASSES`, or a profile with a per-equation layer model
    (a CPU's, whose bytes term is fitted on them).
    """
    def uses(d) -> bool:
        return d.profile.device_class in FUSED_BYTES_CLASSES or bool(d.profile.layer_model)

    by_backend: dict[str, float | None] = {}
    by_class: dict[str, float] = {}
    for d in devs:
        if d.jax_device is None or not uses(d):
            continue
        platform = d.jax_device.platform
        if platform not in by_backend:
            by_backend[platform] = layer_fused_bytes(graph, layer, platform)
        if by_backend[platform] is not None:
            by_class.setdefault(d.profile.device_class, by_backend[platform])
    out = {}
    for d in devs:
        if not uses(d):
            fused = None
        elif d.jax_device is not None:
            fused = by_backend.get(d.jax_device.platform)
        else:
            fused = by_class.get(d.profile.device_class)
        out[d.name] = work if fused is None else dataclasses.replace(work, fused_bytes=fused)
    return out


def _edge_sizes(graph) -> list[float]:
    """Bytes of every tensor that crosses between layers (1 MB when none does)."""
    sizes = []
    for _, _, d in graph.graph.edges(data=True):
        sizes += [b for b in (d["bytes"], d["bytes_backward"]) if b > 0]
    return sizes or [1e6]


def scale_to_step(table, step_s: Mapping[str, float], *, siblings: bool = False):
    """`table` with each device's layer times scaled to sum to its whole-step time.

    A layer measured alone pays one executable launch and loses fusion with
    its neighbours; the whole step as one executable pays neither (on the
    H200, ~0.1 ms per GPU launch: several times the work of a small layer).
    Measuring the whole step on each device (`jax.jit` of the step) and
    scaling keeps the layers' relative costs and makes one-device plans
    predict what they measure; mixed plans, which run one executable per
    stage, are predicted from the scaled layers.

    With `siblings`, a device that was not measured (a spec-sheet `h100`
    planned for from an H200 host) takes the factor of a measured device of
    its class (cpu, gpu, tpu): its predicted layer times are then the
    measured card's, each scaled by the two cards' predicted ratio for that
    layer (how Habitat predicts one GPU from another). Checked H200 <-> H100
    in experiments/cross_card.py.

    Args:
      table: a CostTable.
      step_s: {device name: measured seconds of the whole step there}.
      siblings: carry each class's factor to its devices not in `step_s`.

    Returns:
      The scaled CostTable; `meta["step_scale"]` holds the factor per device
      (`meta["step_scale_from"]` the measured device a sibling's came from).
    """
    unknown = sorted(set(step_s) - set(table.device_names))
    if unknown:
        raise ProfileError(f"scale_to_step: {unknown} are not devices of the table "
                           f"({', '.join(table.device_names)})")
    bad = {d: t for d, t in step_s.items() if not (math.isfinite(t) and t > 0)}
    if bad:
        raise ProfileError(f"scale_to_step: step times must be positive seconds, got {bad}; "
                           "pass the median step time measured on each device")
    totals = {d: sum(layer.time_s.get(d, 0.0) for layer in table.layers) for d in step_s}
    factor = {d: step_s[d] / totals[d] for d in step_s if totals[d] > 0}
    borrowed = _sibling_factors(table, factor) if siblings else {}
    factor.update({d: f for d, (f, _) in borrowed.items()})
    # An update timed alone (`measure_update`) is what it costs run apart, its
    # own executable: the factor corrects layers timed alone to the step.
    timed_updates = table.meta.get("measured_update_s", {})
    layers = tuple(dataclasses.replace(
        layer,
        time_s={d: t * factor.get(d, 1.0) for d, t in layer.time_s.items()},
        fixed_s=None if layer.fixed_s is None else {
            d: f * factor.get(d, 1.0) for d, f in layer.fixed_s.items()},
        update_s=None if layer.update_s is None else {
            d: u * (1.0 if d in timed_updates.get(layer.name, {}) else factor.get(d, 1.0))
            for d, u in layer.update_s.items()})
        for layer in table.layers)
    meta = {**table.meta, "step_scale": factor, "step_s": dict(step_s)}
    if borrowed:
        meta["step_scale_from"] = {d: src for d, (_, src) in borrowed.items()}
    return dataclasses.replace(table, layers=layers, meta=meta)


def scale_to_timed_step(table, present: Mapping[str, Any],
                        time_step: Callable[[str, Any], float | None],
                        stage_overhead: Callable[[str, Any], float | None] | None = None,
                        crossing: Callable[..., float | None] | None = None,
                        bandwidth: Callable[[Any, Any, float], float | None] | None = None,
                        *, time_replicas: Callable[[list[str], list], float | None] | None = None,
                        budget: TimingBudget | None = TimingBudget(),
                        curve: Callable[[Any, Any, list], Sequence | None] | None = None):
    """`table` scaled to whole steps timed here (`scale_to_step(siblings=True)`).

    The step is timed once per device kind the table has a present device
    of: `time_step(name, jax_device)` gives its seconds, or None where it
    cannot run (that kind keeps its predictions). Devices of one kind share
    the figure; spec-sheet siblings follow a timed device of their class.
    `hetpar.auto(profile="measure")` and `hetpar costs --calibrate` use it.

    Layers scaled to one executable no longer pay a launch each, so a split
    step's stages need their runtime cost back: with `stage_overhead`
    (`hetpar.runtime.stage_overhead_s`), each timed kind's is measured once
    and set as its devices' `stage_overhead_s`, a sibling's borrowed. With
    `crossing` too (`hetpar.runtime.crossing_s`), each pair of present kinds
    has a crossing measured (once, on its first two devices) and its links'
    latency raised to it: a link's spec-sheet latency is the wire's, not the
    runtime's handoff. With `bandwidth` (`hetpar.runtime.link_bandwidth`),
    each direction of those pairs has its bandwidth measured at the sizes
    plans move over it (`_copy_size`; two virtual CPU devices copied at
    1.2 GB/s where the spec sheet says 154). With `curve`
    (`hetpar.runtime.link_curve(src, dst, sizes)`: (bytes, seconds) points
    at the sizes of the copies the link may carry, `_copy_sizes`), those
    links take the measured curve instead (`Link.curve`;
    `meta["link_curves"]`), and a bandwidth read off it at the
    byte-weighted median size. With
    `time_replicas` (`time_replicas(names, jax_devices)`: the step run data
    parallel over two present devices of a kind), each kind with two or
    more present devices has the part of its step that a replica pays whole
    (launches, per-call costs) measured: with the gradients' all-reduce (as
    the table's links price it) taken out, a replica's step is
    `(1 - f) T(B) / 2 + f T(B)` for a fixed fraction `f`. Layers without a
    `fixed_s` of their own get that fraction of their time as theirs (a
    sibling borrows its class's fraction): GPT-2 at batch 16 is mostly fixed
    cost, and data parallel over two GPUs ran 0.9-1.2x one GPU's step where
    halving the work predicted 0.5x. A callback returning None leaves its
    figure as predicted. A kind whose step the table puts far above the
    fastest present device's (`budget`, `TimingBudget`: the host CPU beside
    a GPU on a large model) is not timed: its layers keep their figures
    (a sibling of a timed class still borrows that class's factor), its
    runtime costs are measured as above, and the table's meta lists it
    under `untimed_kinds`.

    Returns:
      The scaled table, or `table` itself when nothing was timed.
    """
    step_s: dict[str, float] = {}
    by_kind: dict[str, float | None] = {}
    overhead: dict[str, float] = {}
    table_step = {name: sum(la.time_s.get(name, 0.0) for la in table.layers)
                  for name in table.device_names if name in present}
    fastest = min(table_step, key=table_step.get, default=None)
    untimed: list[str] = []
    runtime: list[str] = []  # devices whose runtime costs are measured
    for name in table.device_names:
        dev = present.get(name)
        if dev is None:  # a spec-sheet device, or a memory place
            continue
        kind = table.device(name).kind
        if kind not in by_kind:
            skip = (budget is not None and kind != table.device(fastest).kind
                    and kind not in budget.steps
                    and budget.skips(table_step[name], table_step[fastest], step=True))
            if skip:
                logging.info("hetpar: not timing the whole step on %s: the table puts it at "
                             "%s, over %gx %s's %s; %s keeps its layers' figures", name,
                             seconds(table_step[name]), budget.slower, fastest,
                             seconds(table_step[fastest]), kind)
                untimed.append(kind)
            by_kind[kind] = None if skip else time_step(name, dev)
            # The runtime's own costs take milliseconds: measured for an
            # untimed kind too (the offload planner's host CPU needs its links).
            cost = (stage_overhead(name, dev) if stage_overhead is not None
                    and (by_kind[kind] is not None or skip) else None)
            if cost is not None:
                overhead[kind] = cost
        if by_kind[kind] is not None:
            step_s[name] = by_kind[kind]
        if by_kind[kind] is not None or kind in untimed:
            runtime.append(name)
    if not step_s:
        return dataclasses.replace(table, meta={**table.meta, "untimed_kinds": untimed}) \
            if untimed else table
    scaled = scale_to_step(table, step_s, siblings=True)
    if untimed:
        scaled = dataclasses.replace(scaled, meta={**scaled.meta, "untimed_kinds": untimed})
    if overhead:
        scaled = _with_runtime_costs(table, scaled, present, runtime, overhead, crossing,
                                     bandwidth, curve)
    if time_replicas is not None:  # last: the all-reduce over the links measured
        scaled = _with_fixed_parts(scaled, present, step_s, time_replicas)
    return scaled


def _with_runtime_costs(table, scaled, present, names, overhead, crossing, bandwidth,
                        curve=None):
    """`scaled` with the measured cost per stage of `names` (present devices)
    and the measured crossing and bandwidth of their links (see
    `scale_to_timed_step`)."""
    per_device = {d: overhead[table.device(d).kind] for d in names
                  if table.device(d).kind in overhead}
    lent = _sibling_factors(table, per_device)
    per_device.update({d: v for d, (v, _) in lent.items()})
    devices = tuple(dataclasses.replace(d, stage_overhead_s=per_device[d.name])
                    if d.name in per_device else d for d in scaled.devices)
    meta = {**scaled.meta, "stage_overhead_s": per_device}
    kind = {d: table.device(d).kind for d in names}
    # One link per pair of kinds (crossing: either way) and per direction
    # (bandwidth) is measured; every link between timed devices of those kinds takes it.
    ways = {(kind[k.src], kind[k.dst]): k for k in reversed(table.links)
            if k.src in kind and k.dst in kind and k.src != k.dst}
    by_pair: dict[tuple, float] = {}
    if crossing is not None:
        for (a, b), k in ways.items():
            pair = tuple(sorted((a, b)))
            if pair not in by_pair and k.src in per_device and k.dst in per_device:
                t = crossing((k.src, present[k.src]), (k.dst, present[k.dst]),
                             (per_device[k.src], per_device[k.dst]))
                if t is not None:
                    by_pair[pair] = t
        meta["crossing_s"] = {"/".join(p): v for p, v in by_pair.items()}
    by_way: dict[tuple[str, str], float] = {}
    curves: dict[tuple[str, str], tuple] = {}
    at = {way: _copy_size(table, *way) for way in ways}
    if curve is not None:
        for way, k in ways.items():
            points = curve(present[k.src], present[k.dst], _copy_sizes(table, *way))
            if points:
                curves[way] = tuple((float(b), float(t)) for b, t in points)
                # The straight line through the plan's typical copy, for what
                # reads a bandwidth alone (collectives, reports).
                rate = curve_rate(curves[way], at[way])
                if rate is not None:
                    by_way[way] = rate
        meta["link_curves"] = {"->".join(w): [list(p) for p in c] for w, c in curves.items()}
    if bandwidth is not None:
        for way, k in ways.items():
            if way not in curves:
                b = bandwidth(present[k.src], present[k.dst], at[way])
                if b is not None:
                    by_way[way] = b
    if curve is not None or bandwidth is not None:
        meta["bandwidth_bytes_per_s"] = {"->".join(w): v for w, v in by_way.items()}
        meta["bandwidth_at_bytes"] = {"->".join(w): v for w, v in at.items()}

    def measured(k):
        # The crossing is the runtime's, so every link between those kinds
        # pays it; the copies were timed between present devices only.
        way = (table.device(k.src).kind, table.device(k.dst).kind)
        latency = max(k.latency_s, by_pair.get(tuple(sorted(way)), 0.0))
        if not (k.src in kind and k.dst in kind):
            return dataclasses.replace(k, latency_s=latency)
        return dataclasses.replace(k, latency_s=latency, bandwidth_bytes_per_s=by_way.get(
            way, k.bandwidth_bytes_per_s), curve=curves.get(way, k.curve))

    links = tuple(measured(k) for k in scaled.links)
    return dataclasses.replace(scaled, devices=devices, links=links, meta=meta)


def _copy_sizes(table, src_kind: str, dst_kind: str) -> list[float]:
    """Bytes of each copy a link src_kind -> dst_kind may carry, ascending ([1.0]: none).

    Every link carries the values passed between layers; a link between a host
    (CPU) and an accelerator also carries offloaded layers' weights, gradients
    and optimizer state, which are most of what memory-capped plans move
    (GPT-2 b16: 28-57 MB a block, against 6 MB activations and a 154 MB
    embedding).
    """
    sizes = [b for e in table.edges for b in (e.bytes, e.bytes_backward) if b > 0]
    if (src_kind == "cpu") != (dst_kind == "cpu"):
        sizes += [b for la in table.layers for b in (la.param_bytes, la.opt_state_bytes)
                  if b is not None and b > 0]
    return sorted(sizes) or [1.0]


def _copy_size(table, src_kind: str, dst_kind: str) -> float:
    """Bytes a copy src_kind -> dst_kind is measured at: the size that half the
    bytes such a link may carry come in copies of at most (a byte-weighted
    median of `_copy_sizes`, `typical_copy`).
    """
    return typical_copy(_copy_sizes(table, src_kind, dst_kind))


def _with_fixed_parts(table, present: Mapping[str, Any], step_s: Mapping[str, float],
                      time_replicas: Callable[[list[str], list], float | None]):
    """`table` with each layer's `fixed_s` (where it has none) set to the
    fraction of the whole step a data-parallel replica pays whole, less its
    optimizer update (`update_s`, charged whole apart), measured per kind
    that has two or more timed devices the planner could run data parallel
    (see `scale_to_timed_step`); a spec-sheet sibling of their class borrows
    the fraction."""
    from hetpar.planner import data_parallel_obstacle

    timed: dict[str, list[str]] = {}
    for d in step_s:
        timed.setdefault(table.device(d).kind, []).append(d)
    fraction: dict[str, float] = {}
    replicated: dict[str, float] = {}
    for devices in timed.values():
        if len(devices) < 2 or all(d in (la.fixed_s or {}) for la in table.layers
                                   for d in devices):
            continue  # no data parallel; or every layer has its own (measured per microbatch)
        pair = devices[:2]
        if data_parallel_obstacle(table, pair):  # the planner cannot price it: nothing to time
            continue
        both = time_replicas(pair, [present[d] for d in pair])
        if both is None:
            continue
        fraction.update(dict.fromkeys(devices, _replica_fraction(table, pair, both)))
        replicated[" ".join(pair)] = both
    if not fraction:
        return table
    fraction.update({d: v for d, (v, _) in _sibling_factors(table, fraction).items()})
    return dataclasses.replace(_with_fraction(table, fraction),
                               meta={**table.meta, "fixed_fraction": fraction,
                                     "replicated_step_s": replicated})


def _with_fraction(table, fraction: Mapping[str, float]):
    """`table` whose layers without a `fixed_s` of their own on a device of
    `fraction` take that fraction of their time there, less their optimizer
    update: the measured part holds the update (it does not shrink with the
    batch), which data parallel charges apart (`update_s`)."""
    def fixed(layer):
        have = dict(layer.fixed_s or {})
        update = layer.update_s or {}
        for d, t in layer.time_s.items():
            if d in fraction and d not in have:
                have[d] = max(0.0, fraction[d] * t - update.get(d, 0.0))
        return dataclasses.replace(layer, fixed_s=have or None)

    return dataclasses.replace(table, layers=tuple(fixed(la) for la in table.layers))


def _replica_fraction(table, pair: Sequence[str], measured_s: float) -> float:
    """The fraction f in [0, 1] for which the planner's data-parallel
    prediction over `pair` (`evaluate_data_parallel`: the all-reduce as the
    links price it, replicas sharing a compute group adding up) is the step
    `measured_s`. The prediction grows with f: bisection."""
    from hetpar.planner import evaluate_data_parallel

    def step(f: float) -> float:
        return evaluate_data_parallel(_with_fraction(table, dict.fromkeys(pair, f)),
                                      pair).step_time_s

    if step(0.0) >= measured_s:
        return 0.0
    if step(1.0) <= measured_s:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < measured_s else (lo, mid)
    return (lo + hi) / 2


def _sibling_factors(table, factor: Mapping[str, float]) -> dict[str, tuple[float, str]]:
    """{unmeasured device: (factor, measured device)}, the first measured
    device of its class lending its factor; memory places and devices of a
    class nothing measured keep theirs."""
    from hetpar.cost_models._profile import device_class

    def cls(name: str) -> str | None:
        try:
            return device_class(table.device(name).kind)
        except ProfileError:  # a memory place (kind pinned_host)
            return None

    measured: dict[str, str] = {}
    for d in factor:
        measured.setdefault(cls(d), d)
    return {d: (factor[measured[cls(d)]], measured[cls(d)])
            for d in table.device_names
            if d not in factor and cls(d) is not None and cls(d) in measured}
