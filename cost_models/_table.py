"""From a LayerGraph and a device list to the planner's CostTable (graph.json).

`cost_table` fills, for every (layer, device), the time of the layer's stage
(forward + backward + update: what the runtime will run for it) and the
memory it holds, and adds the devices (capacity, price, power) and the links
between them.

Device names
------------
A device list mixes two kinds of entries:

- present (or profiled) devices by their JAX name, `platform:id`
  (`cpu:0`, `gpu:0`). Their graph.json name is that JAX name, so the runtime
  can find them; their `kind` is the spec-sheet kind (`cpu`, `h200`, ...).
  A name that a profile file describes may be planned for on a machine where
  it is absent, but not measured there.
- spec-sheet kinds (`h100`, `tpu-v5e`, `cpu`) for what-if planning. Each
  becomes a device named `<kind>:<i>` (`h100:0`, `h100:1` when listed twice),
  with the first index no present device already uses; `h100:1` may also be
  written out. They are always predicted, never measured: no JAX device
  stands behind them.

Times
-----
Predicted by the roofline (`predict`) from the layer's counted work (the op
class `data_movement` and control flow count as `other`), with one launch:
a layer is one executable. With `measure=True`, present devices are measured
instead: the layer's callable alone, random inputs of the right dtypes,
median of k runs, cached on disk (`measure_cached`). The predictions are
kept in `meta` next to the measurements so reports can show both.

Links
-----
Measured links from the profile set, the fastest path per ordered pair over
the graph's edge sizes (the runtime takes the fastest path; the
`pinned_host_staged` path is left out because it times only half a
transfer). CPU devices of one host share its memory: between them a copy
runs at the host's memory bandwidth. An accelerator without a measured path
to a CPU uses its spec sheet's host link, and two accelerators without a
measured path go through the host (two hops in series).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from hetpar.core import ProfileError
from hetpar.cost_models._devices import device_name, present_devices
from hetpar.cost_models._measure import Timing, measure_cached
from hetpar.cost_models._profiles import OP_CLASSES, DeviceProfile, LinkProfile, ProfileSet
from hetpar.cost_models._roofline import LayerWork, predict
from hetpar.cost_models._specs import plan_prices, spec, spec_kinds

# LayerGraph op classes the roofline has no class of its own for.
_CLASS_MAP = {"data_movement": "other", "control_flow": "other"}

# Not a whole transfer path: it times only pinned host -> device (see LinkProfile).
_PARTIAL_PATHS = frozenset({"pinned_host_staged"})

_NAME = re.compile(r"^([A-Za-z0-9_.\-]+):(\d+)$")


# -- work ------------------------------------------------------------------------


def layer_dtype(graph, layer: str) -> str:
    """`bf16` when the layer's matmuls read 16-bit floats, else `f32`."""
    closed, _, _ = graph.layer_jaxpr(layer)
    for e in closed.jaxpr.eqns:
        if e.primitive.name in ("dot_general", "conv_general_dilated"):
            if any(str(getattr(a.aval, "dtype", "")) in ("bfloat16", "float16")
                   for a in e.invars):
                return "bf16"
    return "f32"


def layer_io(graph, layer: str) -> tuple[int, float]:
    """(arrays, bytes) of the layer callable's inputs and outputs, from its jaxpr.

    Each array is a buffer the runtime hands over per call (one per
    parameter and optimizer-state leaf, activation and gradient); together
    they are read or written at least once.
    """
    from jax.extend import core as jcore

    closed, _, _ = graph.layer_jaxpr(layer)
    n, nbytes = 0, 0.0
    for v in list(closed.jaxpr.invars) + list(closed.jaxpr.outvars):
        aval = getattr(v, "aval", None)
        if isinstance(v, jcore.Literal) or aval is None or not hasattr(aval, "shape"):
            continue  # literals are not buffers
        n += 1
        try:
            nbytes += float(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        except TypeError:  # extended dtypes (PRNG keys): a key is a few words
            nbytes += float(math.prod(aval.shape)) * 8.0
    return n, nbytes


# XLA's cost analysis counts a loop body once: after-fusion bytes of a layer
# holding one would understate its traffic by the trip count.
_LOOPS = frozenset({"scan", "while"})


def _has_loop(jaxpr) -> bool:
    from jax.extend import core as jcore

    for e in jaxpr.eqns:
        if e.primitive.name in _LOOPS:
            return True
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
                if isinstance(inner, jcore.Jaxpr) and _has_loop(inner):
                    return True
    return False


def layer_xla_cost(graph, layer: str, backend: str):
    """XLA's after-fusion cost of the layer compiled alone for `backend` (an `XlaCost`).

    Returns None when XLA's figures cannot stand for the layer: it holds a
    loop (XLA counts the body once) or the compile or analysis failed.
    """
    from hetpar.passes import compiled_cost

    closed, inputs, _ = graph.layer_jaxpr(layer)
    if _has_loop(closed.jaxpr):
        return None
    try:
        return compiled_cost(closed, [v.aval for v in inputs], backend)
    except Exception as e:  # noqa: BLE001 - the unfused count still stands
        logging.warning("XLA cost of %s on %s failed: %s", layer, backend, e)
        return None


def layer_fused_bytes(graph, layer: str, backend: str) -> float | None:
    """Bytes the layer moves after XLA's fusion on `backend`, or None when unknown."""
    cost = layer_xla_cost(graph, layer, backend)
    return None if cost is None else cost.bytes_accessed


def layer_work(info, *, dtype: str = "f32", launches: int = 1, buffers: int = 0,
               io_bytes: float = 0.0, fused_bytes: float | None = None) -> LayerWork:
    """The roofline's view of a LayerInfo's counted work.

    Args:
      info: a `LayerInfo` (its `work.by_class` is `{class: [flops, trans, bytes]}`).
      dtype: whose peak applies (`f32`, `bf16`).
      launches: dispatches; a layer's stage is one executable, so 1.
      buffers, io_bytes: the call's input and output arrays and their bytes
        (`layer_io`); 0 when unknown.
      fused_bytes: after-fusion bytes on the device (`layer_fused_bytes`),
        None when unknown.

    Returns:
      A LayerWork over the roofline's op classes.
    """
    flops = dict.fromkeys(OP_CLASSES, 0.0)
    nbytes = dict.fromkeys(OP_CLASSES, 0.0)
    trans = 0.0
    for cls, (f, t, b) in info.work.by_class.items():
        c = _CLASS_MAP.get(cls, cls)
        if c not in flops:
            c = "other"
        flops[c] += float(f)
        nbytes[c] += float(b)
        trans += float(t)
    return LayerWork(flops, nbytes, launches=launches, transcendentals=trans, dtype=dtype,
                     buffers=int(buffers), io_bytes=float(io_bytes),
                     fused_bytes=None if fused_bytes is None else float(fused_bytes))


def graph_layer_work(graph, layer: str, backend: str | None = None) -> LayerWork:
    """`layer_work` of one layer of a LayerGraph, with its dtype, buffers and io bytes.

    With `backend` (a present platform: `cpu`, `gpu`), the layer is compiled
    for it and XLA's after-fusion bytes fill `fused_bytes`.
    """
    n, io = layer_io(graph, layer)
    fused = None if backend is None else layer_fused_bytes(graph, layer, backend)
    return layer_work(graph[layer], dtype=layer_dtype(graph, layer), buffers=n, io_bytes=io,
                      fused_bytes=fused)


# -- devices ---------------------------------------------------------------------


class _Dev:
    """One device of the table: its graph.json name, profile and JAX device (or None)."""

    def __init__(self, name: str, profile: DeviceProfile, jax_device=None):
        self.name = name
        self.profile = profile
        self.jax_device = jax_device

    @property
    def kind(self) -> str:
        return self.profile.kind


def _profile_for_present(name: str, dev, profiles: ProfileSet) -> DeviceProfile:
    """A present device's profile: measured by name, else a measured one of its kind, else spec."""
    from hetpar.cost_models._microbench import spec_kind_of

    if name in profiles.devices:
        return profiles.device(name)
    kind = spec_kind_of(dev) if dev is not None else name.split(":")[0]
    # Virtual devices of one host (cpu:1 beside a measured cpu:0) are the same silicon.
    for p in profiles.devices.values():
        if p.origin == "measured" and p.kind == kind:
            return p
    if kind not in spec_kinds():
        raise ProfileError(
            f"device {name!r} (kind {kind!r}) has no measured profile and no spec sheet; "
            f"run `hetpar profile --out profiles.json` and pass --profiles profiles.json"
        )
    return profiles.device(kind)


def resolve_devices(
    devices: Sequence[str], profiles: ProfileSet, *, measure: bool = False
) -> list[_Dev]:
    """Graph.json devices for a device list; see the module docstring for the names.

    Raises:
      ProfileError: an entry is neither a present or profiled device nor a
        spec-sheet kind; or `measure` asks for a device that is not present.
    """
    if not devices:
        raise ProfileError("no devices given; list some, e.g. --devices cpu:0,gpu:0,h100")
    present = present_devices()
    out: list[_Dev] = []
    taken: set[str] = set(present)
    spec_entries: list[tuple[str, int | None]] = []
    for raw in devices:
        entry = raw.strip()
        m = _NAME.match(entry)
        if entry in present or (entry in profiles.devices and m and \
                profiles.devices[entry].origin == "measured"):
            if any(d.name == entry for d in out):
                raise ProfileError(f"device {entry!r} is listed twice")
            if measure and entry not in present:
                raise ProfileError(
                    f"cannot measure {entry!r}: it is not present on this machine (present: "
                    f"{', '.join(present)}); drop --measure to predict it from its profile"
                )
            jd = present.get(entry)
            prof = _profile_for_present(entry, jd, profiles).replace(name=entry)
            out.append(_Dev(entry, prof, jd))
            continue
        kind, idx = (m.group(1), int(m.group(2))) if m else (entry, None)
        if kind in spec_kinds():
            spec_entries.append((kind, idx))
            continue
        if m and kind in ("cpu", "gpu", "tpu", "cuda", "rocm"):
            raise ProfileError(
                f"device {entry!r} is not present (present: {', '.join(present)})"
                + ("; --measure needs a present device" if measure else "")
                + "; to plan for a device that is not here, name its spec-sheet kind "
                f"({', '.join(spec_kinds())}) or pass a profile file that describes it"
            )
        raise ProfileError(
            f"unknown device kind {entry!r}; known kinds: {', '.join(spec_kinds())}; "
            f"present devices: {', '.join(present)}"
        )
    taken |= {d.name for d in out}
    for kind, idx in spec_entries:
        if idx is None:
            idx = 0
            while f"{kind}:{idx}" in taken:
                idx += 1
        name = f"{kind}:{idx}"
        if name in taken:
            raise ProfileError(f"device {name!r} is listed twice or names a present device")
        taken.add(name)
        out.append(_Dev(name, profiles.device(kind).replace(name=name), None))
    return out


# -- links -----------------------------------------------------------------------


def _series(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """Two hops one after the other: latencies add, 1/bandwidths add."""
    return a[0] + b[0], 1.0 / (1.0 / a[1] + 1.0 / b[1])


def _link(src: _Dev, dst: _Dev, profiles: ProfileSet, sizes: Sequence[float],
          cpu_names: Sequence[str]) -> tuple[float, float] | None:
    """(latency_s, bandwidth) of the best path src -> dst, or None when unknown."""

    def measured(a: str, b: str) -> LinkProfile | None:
        cands = [lk for lk in profiles.links_between(a, b) if lk.path not in _PARTIAL_PATHS]
        if not cands:
            return None
        return min(cands, key=lambda lk: sum(lk.time(n) for n in sizes))

    lk = measured(src.name, dst.name)
    if lk is not None:
        return lk.latency_s, lk.bandwidth_bytes_per_s
    s_cpu, d_cpu = src.profile.device_class == "cpu", dst.profile.device_class == "cpu"
    if s_cpu and d_cpu:
        host = src.profile
        return host.launch_overhead_s, host.memory_bandwidth_bytes_per_s / 2  # read + write

    def to_host(acc: _Dev, outbound: bool) -> tuple[float, float] | None:
        # Any measured CPU of the host will do: its CPU devices share one memory.
        for c in cpu_names:
            lk = measured(acc.name, c) if outbound else measured(c, acc.name)
            if lk is not None:
                return lk.latency_s, lk.bandwidth_bytes_per_s
        hl = acc.profile.host_link
        return (hl.latency_s, hl.bandwidth_bytes_per_s) if hl else None

    if d_cpu:
        return to_host(src, True)
    if s_cpu:
        return to_host(dst, False)
    a, b = to_host(src, True), to_host(dst, False)
    return _series(a, b) if a and b else None


# -- inputs and measurement ------------------------------------------------------


def _index_bounds(jaxpr) -> dict:
    """Upper bounds (exclusive) for integer variables used as indices, by variable.

    Gathers, scatters and dynamic slices bound their index operands; the
    bound is carried back through the integer arithmetic that built them
    (converts, broadcasts, concatenates, wrap-around selects), conservatively.
    """
    from jax.extend import core as jcore

    bounds: dict = {}

    def bound(v, b):
        if isinstance(v, jcore.Var) and np.issubdtype(np.dtype(v.aval.dtype), np.integer):
            bounds[v] = min(bounds.get(v, b), max(1, int(b)))

    for e in reversed(jaxpr.eqns):
        p = e.primitive.name
        if p == "gather":
            op, idx = e.invars[0], e.invars[1]
            dims = e.params["dimension_numbers"].start_index_map
            if dims:
                bound(idx, min(op.aval.shape[d] for d in dims))
        elif p.startswith("scatter"):
            op, idx = e.invars[0], e.invars[1]
            dims = e.params["dimension_numbers"].scatter_dims_to_operand_dims
            if dims:
                bound(idx, min(op.aval.shape[d] for d in dims))
        elif p in ("dynamic_slice", "dynamic_update_slice"):
            op = e.invars[0]
            sizes = (e.params["slice_sizes"] if p == "dynamic_slice"
                     else e.invars[1].aval.shape)
            first = 1 if p == "dynamic_slice" else 2
            for d, a in enumerate(e.invars[first:]):
                bound(a, op.aval.shape[d] - sizes[d] + 1)
        outs = [o for o in e.outvars if o in bounds]
        if outs:
            b = min(bounds[o] for o in outs)
            for a in e.invars:
                bound(a, b)
    return bounds


def random_inputs(graph, layer: str, seed: int = 0) -> tuple[Callable, list]:
    """The layer's callable and random arguments of the right shapes and dtypes.

    Floats are standard normal, booleans fair coins, integers uniform below
    the bound their uses as indices set (embedding rows, label classes; 128
    when unused as an index), typed PRNG keys come from `jax.random.key`.

    Returns:
      (fn, args) for `measure`.
    """
    import jax

    closed, _, _ = graph.layer_jaxpr(layer)
    fn, shapes = graph.layer_callable(layer)
    bounds = _index_bounds(closed.jaxpr)
    rng = np.random.default_rng(seed)
    args = []
    for v, s in zip(closed.jaxpr.invars, shapes, strict=True):
        shape, dt = tuple(s.shape), s.dtype
        if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
            n = max(1, math.prod(shape))
            keys = jax.random.split(jax.random.key(seed), n)
            args.append(keys.reshape(shape))
        elif np.dtype(dt) == np.bool_:
            args.append(rng.random(shape) < 0.5)
        elif np.issubdtype(np.dtype(dt), np.integer):
            hi = min(bounds.get(v, 128), int(np.iinfo(np.dtype(dt)).max) + 1)
            args.append(rng.integers(0, max(1, hi), size=shape).astype(dt))
        else:
            args.append(rng.standard_normal(shape).astype(dt))
    return fn, args


def layer_key(graph, layer: str) -> str:
    """The layer's fingerprint for the measurement cache: a hash of its jaxpr."""
    closed, _, _ = graph.layer_jaxpr(layer)
    return "layer/" + hashlib.sha256(str(closed).encode()).hexdigest()[:24]


def measure_layer(graph, layer: str, device, *, k: int = 10, warmup: int = 2) -> Timing:
    """Times one layer's stage alone on a present device (cached on disk).

    Args:
      graph: the LayerGraph.
      layer: the layer's name.
      device: a JAX device or its name (`gpu:0`).
      k: timed runs (median and IQR are reported).
      warmup: untimed runs first (the first compiles).

    Returns:
      The Timing; `cached` when it came from the disk cache.
    """
    fn, args = random_inputs(graph, layer)
    return measure_cached(layer_key(graph, layer), fn, args, device, k=k, warmup=warmup)


# -- the table -------------------------------------------------------------------


def _fused_works(graph, layer: str, work: LayerWork, devs: Sequence[_Dev]
                 ) -> dict[str, LayerWork]:
    """Per device, `work` with the after-fusion bytes where they can be known.

    A present device gets its own backend's figure (the layer is compiled
    for it to be measured anyway). A spec-sheet device borrows the figure
    of a present device of its class (same compiler, same fusion; the
    fused/unfused ratio of the layer carries over), else keeps the
    unfused count, as does every device of a class outside
    `FUSED_BYTES_CLASSES` (the CPU).
    """
    by_backend: dict[str, float | None] = {}
    by_class: dict[str, float] = {}
    for d in devs:
        if d.jax_device is None or d.profile.device_class not in FUSED_BYTES_CLASSES:
            continue
        platform = d.jax_device.platform
        if platform not in by_backend:
            by_backend[platform] = layer_fused_bytes(graph, layer, platform)
        if by_backend[platform] is not None:
            by_class.setdefault(d.profile.device_class, by_backend[platform])
    out = {}
    for d in devs:
        if d.profile.device_class not in FUSED_BYTES_CLASSES:
            fused = None
        elif d.jax_device is not None:
            fused = by_backend.get(d.jax_device.platform)
        else:
            fused = by_class.get(d.profile.device_class)
        out[d.name] = work if fused is None else dataclasses.replace(work, fused_bytes=fused)
    return out


def _edge_sizes(graph) -> list[float]:
    sizes = []
    for _, _, d in graph.graph.edges(data=True):
        sizes += [b for b in (d["bytes"], d["bytes_backward"]) if b > 0]
    return sizes or [1e6]


def cost_table(
    graph,
    devices: Sequence[str],
    *,
    profiles: ProfileSet | None = None,
    measure: bool = False,
    k: int = 10,
    progress: Callable[[str], None] | None = None,
    host_cpu_included: bool = True,
    meta: Mapping[str, Any] | None = None,
    microbatch_graph=None,
    microbatches: int = 1,
):
    """The planner's CostTable of `graph` on `devices`.

    Args:
      graph: a LayerGraph (`hetpar.passes.trace`).
      devices: present devices (`cpu:0`, `gpu:0`) and spec-sheet kinds
        (`h100`, `tpu-v5e`); see the module docstring for graph.json names.
      profiles: measured profiles (`load_profiles(path)`); default: spec
        sheets alone.
      measure: measure every layer on the present devices instead of
        predicting it (spec-sheet devices stay predicted). The predictions
        kept in `meta` then use XLA's after-fusion bytes of each layer
        (`_fused_works`); without `measure` they use the unfused count.
      k: timed runs per measurement.
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

    Returns:
      A validated `hetpar.core.CostTable`. Its `meta` holds the
      predicted (`predicted_s`) and, with `measure`, measured
      (`measured_s`, `measured_iqr_s`) seconds per layer and device, and the
      source of every device's figures.

    Raises:
      ProfileError: unknown device kind, or `measure` for a device that is
        not present.
    """
    from hetpar.core import CostTable, Device, Edge, Layer, Link

    profiles = profiles if profiles is not None else ProfileSet(
        {k_: spec(k_) for k_ in spec_kinds()})
    devs = resolve_devices(devices, profiles, measure=measure)
    prices = plan_prices([d.profile for d in devs], host_cpu_included=host_cpu_included)
    # A host CPU that is free beside its accelerator is still rented as a CPU
    # machine by a plan that uses it alone.
    alone = {d.name: float(d.profile.price_per_hour) for d in devs
             if d.profile.price_per_hour > prices[d.name]}
    predicted: dict[str, dict[str, float]] = {}
    measured: dict[str, dict[str, float]] = {}
    measured_iqr: dict[str, dict[str, float]] = {}
    fixed: dict[str, dict[str, float]] = {}
    if microbatch_graph is not None and not (measure and microbatches > 1):
        raise ProfileError("microbatch_graph needs measure=True and microbatches > 1")
    layers = []
    n = len(graph.layers)
    for i, name in enumerate(graph.layers):
        info = graph[name]
        work = graph_layer_work(graph, name)
        works = {d.name: work for d in devs}
        if measure:
            works = _fused_works(graph, name, work, devs)
        predicted[name] = {d.name: predict(d.profile, works[d.name]) for d in devs}
        times = dict(predicted[name])
        if measure:
            for d in devs:
                if d.jax_device is None:
                    continue
                t = measure_layer(graph, name, d.jax_device, k=k)
                measured.setdefault(name, {})[d.name] = t.median_s
                measured_iqr.setdefault(name, {})[d.name] = t.iqr_s
                times[d.name] = t.median_s
                if microbatch_graph is not None and name in microbatch_graph.layers:
                    small = measure_layer(microbatch_graph, name, d.jax_device, k=k).median_s
                    f = (microbatches * small - t.median_s) / (microbatches - 1)
                    fixed.setdefault(name, {})[d.name] = min(max(f, 0.0), t.median_s)
                if progress:
                    progress(f"[{i + 1}/{n}] {name} on {d.name}: {t.median_s * 1e3:.3f} ms"
                             f" (predicted {predicted[name][d.name] * 1e3:.3f} ms)"
                             + (" cached" if t.cached else ""))
        mem = float(info.memory_bytes)
        layers.append(Layer(name=name, time_s=times, memory_bytes={d.name: mem for d in devs},
                            activation_bytes=float(info.activation_bytes),
                            fixed_s=fixed.get(name), param_bytes=float(info.param_bytes)))
    edges = [Edge(u, v, float(e["bytes"]), float(e["bytes_backward"]))
             for u, v, e in graph.graph.edges(data=True)]
    sizes = _edge_sizes(graph)
    cpu_names = [d.name for d in devs if d.profile.device_class == "cpu"]
    cpu_names += [n_ for n_, p in profiles.devices.items()
                  if p.origin == "measured" and p.device_class == "cpu" and n_ not in cpu_names]
    links = []
    for a in devs:
        for b in devs:
            if a is b:
                continue
            lk = _link(a, b, profiles, sizes, cpu_names)
            if lk is None:
                logging.warning("no link from %s to %s: they cannot hold adjacent layers",
                                a.name, b.name)
                continue
            links.append(Link(a.name, b.name, bandwidth_bytes_per_s=lk[1], latency_s=lk[0]))
    table_devices = [
        Device(name=d.name, kind=d.kind, memory_bytes=float(d.profile.memory_bytes),
               price_per_hour=float(prices[d.name]), watts_busy=float(d.profile.watts_busy),
               watts_idle=float(d.profile.watts_idle), price_alone_per_hour=alone.get(d.name))
        for d in devs
    ]
    info_meta: dict[str, Any] = {
        "source": "hetpar costs",
        "graph_fingerprint": graph.fingerprint(),
        "timing": "measured" if measure else "predicted",
        "predicted_s": predicted,
        "device_sources": {d.name: {"origin": d.profile.origin, **dict(d.profile.sources)}
                           for d in devs},
    }
    if measure:
        info_meta["measured_s"] = measured
        info_meta["measured_iqr_s"] = measured_iqr
    if fixed:
        info_meta["fixed_s"] = f"fitted from each layer measured at batch and batch/{microbatches}"
    info_meta.update(meta or {})
    return CostTable(devices=tuple(table_devices), links=tuple(links), layers=tuple(layers),
                     edges=tuple(edges), meta=info_meta)


def scale_to_step(table, step_s: Mapping[str, float]):
    """`table` with each device's layer times scaled to sum to its whole-step time.

    A layer measured alone pays one executable launch and loses fusion with
    its neighbours; the whole step as one executable pays neither (on the
    H200, ~0.1 ms per GPU launch: several times the work of a small layer).
    Measuring the whole step on each device (`jax.jit` of the step) and
    scaling keeps the layers' relative costs and makes one-device plans
    predict what they measure; mixed plans, which run one executable per
    stage, are predicted from the scaled layers.

    Args:
      table: a CostTable.
      step_s: {device name: measured seconds of the whole step there}.

    Returns:
      The scaled CostTable; `meta["step_scale"]` holds the factor per device.
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
    layers = tuple(dataclasses.replace(
        layer,
        time_s={d: t * factor.get(d, 1.0) for d, t in layer.time_s.items()},
        fixed_s=None if layer.fixed_s is None else {
            d: f * factor.get(d, 1.0) for d, f in layer.fixed_s.items()})
        for layer in table.layers)
    meta = {**table.meta, "step_scale": factor, "step_s": dict(step_s)}
    return dataclasses.replace(table, layers=layers, meta=meta)


def example_args(workload) -> tuple:
    """A workload's step arguments, abstract when the zoo allows it (nothing allocated)."""
    import jax

    try:
        return tuple(jax.eval_shape(workload.example_args))
    except Exception:  # noqa: BLE001 - some zoo builds only run concretely
        logging.debug("eval_shape of example_args failed; building them concretely")
        return tuple(workload.example_args())


def trace_model(model: str, *, small: bool = False, batch: int | None = None,
                config: Mapping[str, Any] | None = None, depth: int | None = None):
    """(workload, LayerGraph) of a zoo model's train step."""
    from hetpar import zoo
    from hetpar.passes import trace

    w = zoo.get(model, small=small, batch=batch, **dict(config or {}))
    return w, trace(w.train_step, *example_args(w), depth=depth)


def cost_table_for_model(
    model: str,
    devices: Sequence[str],
    *,
    small: bool = False,
    batch: int | None = None,
    config: Mapping[str, Any] | None = None,
    measure: bool = False,
    profiles: ProfileSet | str | None = None,
    k: int = 10,
    progress: Callable[[str], None] | None = None,
    microbatches: int = 1,
):
    """The CostTable of a zoo model's train step on `devices` (`hetpar plan MODEL`).

    Args:
      model: a zoo name (`hetpar models`).
      devices: as for `cost_table`.
      small: the model's small test config.
      batch: batch size (default: the model's).
      config: model config overrides.
      measure: measure present devices instead of predicting.
      profiles: a ProfileSet, or the path of a profile file.
      k: timed runs per measurement.
      progress: as for `cost_table`.
      microbatches: with `measure` and M > 1, also measure every layer at
        batch / M and fit its `fixed_s` (see `cost_table`), so pipelined
        plans pay what small microbatches really cost.

    Returns:
      The CostTable; `meta` also names the model and batch size.

    Raises:
      ProfileError: M > 1 without `measure`, or a batch M does not divide.
    """
    from hetpar.cost_models._profiles import load_profiles

    if isinstance(profiles, str):
        profiles = load_profiles(profiles)
    w, graph = trace_model(model, small=small, batch=batch, config=config)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ProfileError(f"microbatches must be a positive integer, got {microbatches!r}")
    small_graph = None
    if microbatches > 1:
        full = int(w.config["batch_size"])
        if not measure:
            raise ProfileError("microbatches > 1 fits fixed_s from measurements: add measure")
        if full % microbatches:
            raise ProfileError(f"microbatches={microbatches} does not divide the batch ({full})")
        _, small_graph = trace_model(model, small=small, batch=full // microbatches,
                                     config=config)
    return cost_table(graph, devices, profiles=profiles, measure=measure, k=k,
                      progress=progress, microbatch_graph=small_graph,
                      microbatches=microbatches,
                      meta={"model": model, "batch": w.config.get("batch_size"),
                            "small": small})


def per_sample(table, batch: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per layer and device: seconds, dollars and joules per sample.

    Dollars use the device's plan price (`price_per_hour`), joules its busy
    power; both scale the layer's step time, divided by the batch size.

    Returns:
      `{layer: {device: {"time_s", "usd", "joules"}}}` per sample.
    """
    devs = {d.name: d for d in table.devices}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for layer in table.layers:
        row = {}
        for dev, t in layer.time_s.items():
            d = devs[dev]
            row[dev] = {"time_s": t / batch, "usd": t * d.price_per_hour / 3600 / batch,
                        "joules": t * d.watts_busy / batch}
        out[layer.name] = row
    return out


# -- accuracy of the predictor ---------------------------------------------------

#: How a layer's launches count in the calibrated model: one dispatch per
#: layer (its stage is one executable), or one per unfused equation.
LAUNCH_MODELS = ("executable", "equations")

#: Which byte count the bytes term uses: XLA's after-fusion bytes where the
#: record has them (`fused`), or hetpar's unfused count always (`unfused`).
BYTES_MODELS = ("fused", "unfused")

#: Device classes whose predictions use after-fusion bytes. Measured on the
#: H200 host (experiments/results/accuracy_h200_v2.md): they cut the GPU's
#: held-out error (28.8% -> 25.6% median) but raise the CPU's (24.8% ->
#: 43.5%: XLA:CPU's byte count says little about its loop-nest time), so the
#: CPU keeps hetpar's unfused count. Fused bytes are still recorded for it.
FUSED_BYTES_CLASSES = frozenset({"gpu", "tpu"})


def layer_records(
    model: str,
    device,
    *,
    small: bool = False,
    batch: int | None = None,
    k: int = 10,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Measures every layer of a zoo model on one present device.

    Returns:
      One record per layer: model, layer, device, device kind, batch, the
      layer's work (`LayerWork.to_json`, with the after-fusion bytes on
      this device in `fused_bytes` when XLA gives them), XLA's cost analysis
      (`xla`, None for layers with loops), its unfused equation count, and
      the measured median and IQR in seconds. `accuracy` reads these.
    """
    from hetpar.cost_models._devices import resolve_device
    from hetpar.cost_models._microbench import spec_kind_of

    dev = resolve_device(device)
    w, graph = trace_model(model, small=small, batch=batch)
    out = []
    for name in graph.layers:
        info = graph[name]
        t = measure_layer(graph, name, dev, k=k)
        xla = layer_xla_cost(graph, name, dev.platform)
        work = graph_layer_work(graph, name)
        if xla is not None and xla.bytes_accessed is not None:
            work = dataclasses.replace(work, fused_bytes=xla.bytes_accessed)
        out.append({
            "model": model, "layer": name, "device": device_name(dev),
            "device_kind": dev.device_kind, "kind": spec_kind_of(dev),
            "batch": w.config.get("batch_size"), "small": small,
            "work": work.to_json(),
            "xla": None if xla is None else dataclasses.asdict(xla),
            "equations": int(info.work.launches),
            "measured_s": t.median_s, "iqr_s": t.iqr_s,
        })
        if progress:
            progress(f"{model}/{name} on {device_name(dev)}: {t.median_s * 1e3:.3f} ms")
    return out


def _class_of(kind: str) -> str:
    from hetpar.cost_models._profiles import device_class

    try:
        return device_class(kind)
    except ProfileError:
        return "gpu" if kind in ("gpu", "cuda", "rocm") else kind


def record_work(record: Mapping[str, Any], launch_model: str = "executable",
                bytes_model: str = "fused") -> LayerWork:
    """The LayerWork of a record, launches and bytes counted as the models say."""
    data = dict(record["work"])
    data["launches"] = 1 if launch_model == "executable" else max(1, record["equations"])
    if bytes_model == "unfused" or _class_of(record.get("kind", "cpu")) not in FUSED_BYTES_CLASSES:
        data["fused_bytes"] = None
    return LayerWork.from_json(data)


def fit_layers(profile: DeviceProfile, records: Sequence[Mapping[str, Any]], *,
               launch_model: str = "executable", bytes_model: str = "fused") -> DeviceProfile:
    """Calibrates `profile` on measured layers: per-class efficiencies and the launch cost."""
    from hetpar.cost_models._roofline import calibrate

    samples = [(record_work(r, launch_model, bytes_model), r["measured_s"]) for r in records]
    return calibrate(profile, samples, fit_overhead=True)


def _errors(profile: DeviceProfile, records, launch_model: str,
            bytes_model: str = "fused") -> np.ndarray:
    pred = np.array([predict(profile, record_work(r, launch_model, bytes_model))
                     for r in records])
    meas = np.array([r["measured_s"] for r in records])
    return np.abs(pred - meas) / meas


def _stats(err: np.ndarray) -> dict[str, Any]:
    if err.size == 0:
        return {"n": 0, "median_ape": None, "p90_ape": None}
    return {"n": int(err.size), "median_ape": float(np.median(err)),
            "p90_ape": float(np.percentile(err, 90))}


def accuracy(
    records: Sequence[Mapping[str, Any]],
    base: Mapping[str, DeviceProfile],
    train_models: Sequence[str],
    *,
    launch_model: str = "executable",
    bytes_model: str = "fused",
    threshold_s: float = 100e-6,
) -> dict[str, Any]:
    """Held-out error of the calibrated roofline, per device.

    Args:
      records: from `layer_records`.
      base: device name -> profile to calibrate (its peaks stay fixed).
      train_models: models whose layers calibrate; the rest are held out.
      launch_model: one of `LAUNCH_MODELS`.
      bytes_model: one of `BYTES_MODELS`.
      threshold_s: the "large layer" cut (by measured time).

    Returns:
      `{device: {"train": ..., "test": ..., "test_large": ..., "uncalibrated_test": ...,
      "profile": calibrated efficiencies}}`, each a dict of n, median and
      90th-percentile absolute percentage error (as fractions).
    """
    out: dict[str, Any] = {}
    for dev in sorted({r["device"] for r in records}):
        rs = [r for r in records if r["device"] == dev]
        train = [r for r in rs if r["model"] in train_models]
        test = [r for r in rs if r["model"] not in train_models]
        if not train or not test:
            continue
        prof = fit_layers(base[dev], train, launch_model=launch_model, bytes_model=bytes_model)
        large = [r for r in test if r["measured_s"] > threshold_s]
        out[dev] = {
            "kind": rs[0]["kind"], "device_kind": rs[0]["device_kind"],
            "train": _stats(_errors(prof, train, launch_model, bytes_model)),
            "test": _stats(_errors(prof, test, launch_model, bytes_model)),
            "test_large": _stats(_errors(prof, large, launch_model, bytes_model)),
            "uncalibrated_test_large": _stats(_errors(base[dev], large, launch_model,
                                                      bytes_model)),
            "efficiencies": {c: dict(e) for c, e in prof.efficiencies.items()},
            "fused_bytes_efficiency": prof.fused_bytes_efficiency,
            "with_fused_bytes": sum(r["work"].get("fused_bytes") is not None for r in rs),
            "launch_overhead_s": prof.launch_overhead_s,
            "buffer_overhead_s": prof.buffer_overhead_s,
            "train_models": sorted({r["model"] for r in train}),
            "test_models": sorted({r["model"] for r in test}),
        }
    return out
