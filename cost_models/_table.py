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
`scale_to_step` (`_calibrate_table`) rescales a table's layers to measured
whole-step times (and, with `siblings`, a spec-sheet device's by its measured
sibling's factor).

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hetpar._host_memory import pinned_pool_bytes
from hetpar.core import CostTable, Device, Edge, Layer, ProfileError, pinned_pool_reserved, seconds
from hetpar.cost_models._devices import host_arrays
from hetpar.cost_models._equation_model import matmul_equations, predict_layer
from hetpar.cost_models._group_figures import with_stored
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
    one. `None` in place of a budget times everything. But a whole step the
    table puts over `step_ceiling_s` on a device of another kind than the
    fastest is never timed (`scale_to_timed_step`): on an H200 host the
    0.54B Llama-style model's calibration ran its step on the host CPU (the
    table's 37 s) and timed out at 200 s.
    """

    slower: float = 10.0
    floor_s: float = 0.25
    step_floor_s: float = 1.0
    step_ceiling_s: float = 10.0
    timed: frozenset[tuple[str, str]] = frozenset()
    steps: frozenset[str] = frozenset()

    def __post_init__(self):
        if not self.slower >= 1.0 or not (self.floor_s >= 0 and self.step_floor_s >= 0
                                          and self.step_ceiling_s > 0):
            raise ProfileError(
                f"TimingBudget(slower={self.slower!r}, floor_s={self.floor_s!r}, "
                f"step_floor_s={self.step_floor_s!r}, step_ceiling_s={self.step_ceiling_s!r}): "
                "slower must be >= 1 (how many times the fastest device's time), the floors "
                ">= 0 seconds and the ceiling > 0; pass budget=None to time every device")
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
    # Updates that wait for other layers' gradients (a global-norm clip);
    # written when empty too: a table without it is taken to wait (`Arrays.waits`).
    reads = graph.update_reads()
    info_meta["update_reads"] = {n: r if r == "all" else list(r) for n, r in reads.items()}
    # What a present device holds here (`as_present`): `memory=` may cap it, never raise it.
    info_meta["present_capacity"] = {d.name: float(d.profile.memory_bytes) for d in devs
                                     if d.jax_device is not None}
    info_meta["present_capacity"].update(
        {p.name: float(p.memory_bytes) for p in places if p.device.jax_device is not None})
    # The limit of XLA's pinned pool behind each present GPU's place: its
    # process's GPUs share it, and it draws doubling regions of the host's
    # RAM up to it (`hetpar.core.pinned_pool_reserved`, `Arrays.pool`).
    pooled = {p.name: pinned_pool_bytes() for p in places
              if p.device.jax_device is not None and p.device.jax_device.platform == "gpu"}
    if pooled:
        info_meta["pinned_pool_bytes"] = pooled
        # The regions it holds already, which it keeps (a replan after a step).
        pinned = host_arrays()[1]
        if pinned > 0:
            held = pinned_pool_reserved(pinned, pinned_pool_bytes())
            info_meta["pinned_pool_regions"] = dict.fromkeys(pooled, held)
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
    table = CostTable(devices=_table_devices(devs, host_cpu_included=host_cpu_included)
                      + tuple(_place_device(p) for p in places),
                      links=tuple(links), layers=tuple(layers), edges=tuple(edges),
                      meta=info_meta)
    # What the profile file measured over groups of its devices at once.
    return with_stored(table, profiles.meta)


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
                 remat_workspace_bytes=float(info.remat_workspace_bytes),
                 state_leaves=tuple((r, shape, float(b)) for r, shape, b in info.state_leaves),
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
