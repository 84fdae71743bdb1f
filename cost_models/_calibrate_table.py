"""A cost table calibrated to whole steps timed on the devices present.

Layers timed alone each pay an executable launch and lose their fusion with
their neighbours; the whole step as one executable pays neither.
`scale_to_step` rescales each device's layer times to its measured
whole-step time (and, with `siblings`, a spec-sheet device's by its measured
sibling's factor). `scale_to_timed_step` times the step here, once per device
kind (within a `TimingBudget`), scales to it, and gives back what the
scaling took out: the runtime's cost per stage, each pair of kinds'
crossing, its links' bandwidth or copy curve, and the part of a step a
data-parallel replica pays whole (`fixed_s`). `hetpar.auto(profile="measure")`
and `hetpar costs --calibrate` use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from absl import logging

from hetpar.core import ProfileError, seconds
from hetpar.core._graph import curve_rate
from hetpar.cost_models._group_figures import place_owners, with_place_links, with_rings
from hetpar.cost_models._resolve import typical_copy
from hetpar.cost_models._table import TimingBudget


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
                        curve: Callable[[Any, Any, list], Sequence | None] | None = None,
                        fits: Callable[[str], bool] | None = None,
                        collective: Callable[[list[str], list], tuple | None] | None = None,
                        place_links: Callable[[list[str], list], float | None] | None = None):
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
    under `untimed_kinds`. So is a kind whose first present device `fits`
    (`fits(name)`) says cannot hold the whole step (timing it there would
    only run out of memory), and one of another kind than the fastest whose
    step the table puts over `budget.step_ceiling_s`, even where
    `budget.steps` asks for it (its runs would cost the first call more than
    the timing corrects); both are also listed under `untimable_kinds`.
    With `collective` (`collective(names, jax_devices)`:
    `hetpar.runtime.ring_figures`, (bandwidth, latency) of a ring step),
    each kind with two or more present devices, CPUs aside, has its
    collectives timed over all of them (`meta["collectives"]`, by the
    devices' names joined with "+"): sharded state's all-gathers and
    reduce-scatters are priced on it, not on the copy links. With
    `place_links` (`place_links(names, jax_devices)`:
    `hetpar.runtime.place_link_figures`, each way), the links between the
    present accelerators and their pinned host memory places take the
    figures measured with all of them copying both ways at once
    (`meta["place_links"]`), as plans streaming state on them do.

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
    untimable: list[str] = []
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
            elif fits is not None and not fits(name):
                skip = True
                untimable.append(kind)
                logging.info("hetpar: not timing the whole step on %s: it does not fit there "
                             "alone; %s keeps its layers' figures", name, kind)
            elif (budget is not None and kind != table.device(fastest).kind
                    and table_step[name] > budget.step_ceiling_s):
                skip = True
                untimable.append(kind)
                logging.info("hetpar: not timing the whole step on %s: the table puts a run "
                             "at %s, over %s; %s keeps its layers' figures", name,
                             seconds(table_step[name]), seconds(budget.step_ceiling_s), kind)
            if skip:
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
    # (`untimable_kinds`: untimed because the step does not fit there alone,
    # or one run would take past the budget's ceiling; no later round times
    # them either.)
    marks = {"untimed_kinds": untimed, **({"untimable_kinds": untimable} if untimable else {})}
    if not step_s and not untimed:
        return table
    scaled = scale_to_step(table, step_s, siblings=True) if step_s else table
    if untimed:
        scaled = dataclasses.replace(scaled, meta={**scaled.meta, **marks})
    if overhead:
        # Where no kind's whole step was timed too (an offload plan's GPU
        # that cannot hold the step, its host CPU far slower): its links are
        # what the plan leans on. Left at the spec sheet's 63 GB/s, a 0.54B
        # model's plan on a 7.5 GB H200 predicted 272 ms and ran 1265 ms.
        scaled = _with_runtime_costs(table, scaled, present, runtime, overhead, crossing,
                                     bandwidth, curve)
    if collective is not None:
        scaled = _with_collectives(scaled, present, collective)
    if place_links is not None:
        scaled = _with_place_links(scaled, present, place_links)
    if time_replicas is not None and step_s:  # last: the all-reduce over the links measured
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


def _with_collectives(table, present: Mapping[str, Any], collective):
    """`table` with each group of two or more present devices of one
    accelerator kind given its measured ring (`meta["collectives"]`)."""
    from hetpar.planner import replica_groups

    rings = {}
    for group in replica_groups(table):  # the groups the planner shards state over
        names = [n for n in group if n in present]
        if len(names) >= 2:
            got = collective(names, [present[n] for n in names])
            if got is not None:
                rings["+".join(names)] = {"bandwidth_bytes_per_s": got[0], "latency_s": got[1]}
    return with_rings(table, rings)


def _with_place_links(table, present: Mapping[str, Any], place_links):
    """`table` with the links between present accelerators and their pinned
    host memory places at the figures `place_links` measured over all of
    them at once (each way: bandwidth, a call's latency, each array's cost
    by its size; `meta["place_links"]`, by the accelerators' names joined
    with "+"). The table has one figure
    per link, not one per plan: a plan streaming on one of them alone is
    priced as if all streamed (on two H200s 31 GB/s each way where one
    alone copies 43), which errs slow where the other figure would err fast
    on every plan that streams on all (run 34 ran 1.30x its prediction)."""
    owners = [n for n in place_owners(table) if n in present]
    if not owners:
        return table
    figures = place_links(owners, [present[n] for n in owners])
    bandwidth = (figures or {}).get("bandwidth_bytes_per_s")
    if not bandwidth or not math.isfinite(bandwidth) or bandwidth <= 0:
        return table
    return with_place_links(table, owners, figures)


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
