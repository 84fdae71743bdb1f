"""CostTable: the planner's input, and its file form graph.json.

A CostTable says what every layer costs on every device (time, memory), which
tensors cross between layers (edges, in bytes forward and backward) and what
the devices and links between them are. It is validated once, when built, so
everything downstream can trust it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetpar.core._errors import GraphFormatError
from hetpar.core._files import load_json, save_json
from hetpar.core._fingerprint import fingerprint

FORMAT = "hetpar.graph"
VERSION = 1
# What `hetpar trace --out` writes: a listing of the layers, often mistaken for graph.json.
_LAYERS_FORMAT = "hetpar.layers"
_HOW_TO_WRITE = "hetpar costs MODEL --devices LIST --out graph.json"
# Device fields written only when set: files without them mean the default.
_OPTIONAL_DEVICE_FIELDS = ("price_alone_per_hour", "compute_group")


@dataclasses.dataclass(frozen=True)
class Device:
    """A device the planner may place layers on.

    Attributes:
      name: unique name, e.g. "cpu:0" or "gpu:0".
      kind: device kind, e.g. "cpu", "h100", "tpu-v5e".
      memory_bytes: memory available to layers (parameters, optimizer state,
        saved activations, workspace).
      price_per_hour: dollars per hour while in use (cost objective).
      watts_busy: power while computing (energy objective).
      watts_idle: power while in use but idle (energy objective).
      price_alone_per_hour: dollars per hour when a plan uses this device and
        no other (None: `price_per_hour`). A host CPU costs nothing beside its
        GPU, which is already rented, but a plan that uses only the CPU rents
        a CPU machine: without this, the cost objective would call all-CPU
        free.
      compute_group: devices with the same group share one compute resource,
        so their work never overlaps: the virtual CPU devices of one process
        (`--xla_force_host_platform_device_count`) run on the same cores.
        None: the device computes on its own.
      stage_overhead_s: seconds the runtime adds for each stage it runs on
        this device beyond the stage's work (dispatching its executable,
        its worker's handoff), measured by `hetpar.auto(profile="measure")`
        (`hetpar.stage_overhead_s`). 0 where layer times were not scaled to
        one executable: predicted and per-layer measured times each pay a
        launch already.
    """

    name: str
    kind: str
    memory_bytes: float
    price_per_hour: float = 0.0
    watts_busy: float = 0.0
    watts_idle: float = 0.0
    price_alone_per_hour: float | None = None
    compute_group: str | None = None
    stage_overhead_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Link:
    """A directed link: sending `n` bytes from `src` to `dst` takes `latency_s + n / bandwidth`.

    With a measured `curve` ((bytes, seconds) points, bytes ascending: a copy's
    seconds beyond a 4 kB one), it takes `latency_s + curve(n)`, piecewise
    linear through (0, 0) and the points, extended past the last point by
    the last segment's slope (the average rate where that is not positive).
    Copies from an H100 host's CPU device, put to a SingleDeviceSharding as
    the transfer engine once did, ran ~3-4 GB/s up to 28 MiB and ~1.1 GB/s
    from 32 MiB (experiments/results/links): one bandwidth priced either
    size 3x off. Links are rarely straight lines; a curve takes whatever shape
    was measured.
    """

    src: str
    dst: str
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    curve: tuple[tuple[float, float], ...] = ()

    def copy_s(self, nbytes: float, leaves: Sequence[float] = ()) -> float:
        """Seconds `nbytes` take over the link, beyond its latency.

        With `leaves` (the bytes of the arrays the copy moves in one call,
        scaled to sum to `nbytes`), each array is priced at its own size on
        the curve, and never below its first point: a curve point is then
        what one more array of that size adds to a call (a memory place's
        link, `place_link_figures`), and a layer's state is a few dozen
        arrays, not one; a small array still pays what the smallest one
        measured did (mostly the array's own overhead, not its bytes).
        """
        if not self.curve:
            return nbytes / self.bandwidth_bytes_per_s
        total = float(sum(leaves))
        if total <= 0:
            return curve_s(self.curve, nbytes)
        least = self.curve[0][1]
        return sum(max(curve_s(self.curve, b * nbytes / total), least) if b > 0 else 0.0
                   for b in leaves)

    def seconds(self, nbytes: float, leaves: Sequence[float] = ()) -> float:
        """Seconds sending `nbytes` (as `leaves`, see `copy_s`) takes: latency and copy."""
        return self.latency_s + self.copy_s(nbytes, leaves)


def curve_rate(curve, nbytes: float) -> float | None:
    """Bytes per second a link curve moves `nbytes` at, beyond its latency: the
    one bandwidth read off a curve for what needs a single figure
    (collectives, reports); None where the curve prices that copy at nothing."""
    took = curve_s(curve, nbytes)
    return nbytes / took if took > 0 else None


def curve_s(curve, nbytes: float) -> float:
    """A link curve's seconds at `nbytes` (see `Link`)."""
    xs = [0.0] + [float(b) for b, _ in curve]
    ys = [0.0] + [float(t) for _, t in curve]
    if nbytes <= xs[-1]:
        return float(np.interp(nbytes, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    if slope <= 0:  # a flat or dipping last segment (noise): the average rate
        slope = ys[-1] / xs[-1]
    return ys[-1] + slope * (nbytes - xs[-1])


@dataclasses.dataclass(frozen=True)
class Layer:
    """A layer (forward, backward and update) and its cost on each device.

    Attributes:
      name: unique layer name.
      time_s: seconds per step on each device it can run on; a device missing
        here cannot run the layer.
      memory_bytes: bytes the layer holds on each device of `time_s`.
      allowed: if given, the only devices the layer may use.
      pinned: if given, the device the layer must use.
      activation_bytes: bytes of activations the layer saves for its backward
        pass per step (all microbatches), part of `memory_bytes`; only used to
        report pipelined activation memory in flight. None means "estimate it
        as the bytes of the layer's outgoing edges".
      fixed_s: per device, the part of `time_s` that does not shrink with the
        microbatch (kernel launches: a GPU runs a small kernel no faster than a
        few microseconds). Pipelined over M microbatches the layer takes
        fixed + (time - fixed) / M per microbatch, time + (M - 1) x fixed per
        step. None (or a device missing) means 0: time scales with the batch.
        On two H200s the transformer's step fits 15.5 ms + 0.60 ms per sample
        (experiments/results/two_gpus_affine_h200x2.md).
      param_bytes: bytes of the layer's parameters, the size of its gradient
        (what a data-parallel step all-reduces). None: unknown, and no
        data-parallel plan is considered, nor any offload of its state.
      opt_state_bytes: bytes of the layer's optimizer state (part of
        `memory_bytes`). None: unknown; the offload planner then takes
        what `memory_bytes` holds beyond 2 x `param_bytes` and the
        activations.
      update_s: seconds of the layer's optimizer update alone on each device
        (part of `time_s` where both name a device; may name devices the
        layer cannot compute on: a host CPU that updates state it holds).
        None (or a device missing): unknown there, and the offload planner
        runs no update of the layer on that device.
      recompute_fraction: share of the layer's forward that recomputing its
        activations repeats (activations="remat"), in [0, 1]: the forward
        equations its backward reads from (a GPT-2 block's: 0.68 of its
        forward FLOPs). None means 1: the whole forward runs again.
      workspace_bytes: bytes the layer's stage holds only while it runs,
        beyond `memory_bytes` (its temporaries: a GPT-2 head's logits'
        softmax and gradient). The planner adds the largest on each device
        to what it holds (`remat_workspace_bytes` where it recomputes its
        activations). None means 0.
      remat_workspace_bytes: the same where it recomputes its activations
        (activations="remat"): its recomputed forward and its backward run
        as one, the activations inside (at least `workspace_bytes`; under
        `workspace_bytes` + `activation_bytes` where the backward frees
        activations as it goes). None: unknown, and the planner takes
        `workspace_bytes` + `activation_bytes`.
      state_leaves: the shapes of the layer's state, one `(role, shape,
        bytes)` per leaf, role "param" or "opt_state": what a sharded-state
        plan can split over a group of N devices (a leaf no axis of which N
        divides stays whole on every device). None: unknown, and the
        planner takes every byte as divisible.
    """

    name: str
    time_s: Mapping[str, float]
    memory_bytes: Mapping[str, float]
    allowed: tuple[str, ...] | None = None
    pinned: str | None = None
    activation_bytes: float | None = None
    fixed_s: Mapping[str, float] | None = None
    param_bytes: float | None = None
    opt_state_bytes: float | None = None
    update_s: Mapping[str, float] | None = None
    recompute_fraction: float | None = None
    workspace_bytes: float | None = None
    remat_workspace_bytes: float | None = None
    state_leaves: tuple[tuple[str, tuple[int, ...], float], ...] | None = None

    def __post_init__(self):
        if self.state_leaves is not None and isinstance(self.state_leaves, list | tuple):
            object.__setattr__(self, "state_leaves", tuple(
                (r, tuple(shape), b) if isinstance(shape, list | tuple) else (r, shape, b)
                for r, shape, b in self.state_leaves))

    def devices(self) -> tuple[str, ...]:
        """Devices this layer may run on: timed there, allowed, and the pin if any."""
        out = tuple(self.time_s)
        if self.allowed is not None:
            out = tuple(d for d in out if d in self.allowed)
        if self.pinned is not None:
            out = tuple(d for d in out if d == self.pinned)
        return out


@dataclasses.dataclass(frozen=True)
class Edge:
    """A tensor crossing from layer `src` to layer `dst`.

    `bytes` flow src -> dst in the forward pass; `bytes_backward` (its
    gradient) flow dst -> src in the backward pass.
    """

    src: str
    dst: str
    bytes: float
    bytes_backward: float = 0.0


def _check_update_reads(reads: Any, layers: set[str]) -> None:
    """meta.update_reads: {layer: "all" | [layer, ...]} over the table's layers
    (the replay waits for what it names: `LayerGraph.update_reads`)."""
    if reads is None:
        return
    fix = ('meta.update_reads must map a layer to "all" or a list of layers whose '
           "backward its update reads")
    if not isinstance(reads, Mapping):
        raise GraphFormatError(f"{fix}; got {type(reads).__name__}")
    for layer, r in reads.items():
        names = [] if r == "all" else r
        if layer not in layers or not isinstance(names, list | tuple) or any(
                n not in layers for n in names):
            raise GraphFormatError(f"{fix}; got {layer!r}: {r!r} (the table's layers: "
                                   f"{', '.join(sorted(layers)[:5])}...)")


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Costs of every layer on every device, the edges between layers, the links between devices.

    Build it with the constructor (tests, cost models) or from graph.json with
    `CostTable.load` / `CostTable.from_json`; both validate and raise
    `GraphFormatError` naming the offending field.
    """

    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    layers: tuple[Layer, ...]
    edges: tuple[Edge, ...]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "edges", tuple(self.edges))
        _validate(self)

    # -- lookups -------------------------------------------------------------

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    def device(self, name: str) -> Device:
        """The device called `name`."""
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def link(self, src: str, dst: str) -> Link | None:
        """The link src -> dst, or None."""
        return self._link_map().get((src, dst))

    def _link_map(self) -> dict[tuple[str, str], Link]:
        return {(k.src, k.dst): k for k in self.links}

    def topological_order(self) -> list[int]:
        """Layer indices in a topological order, as close to the listed order as possible."""
        import networkx as nx  # 0.2 s to import: only when a table is validated or ordered

        g = nx.DiGraph()
        g.add_nodes_from(range(len(self.layers)))
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        g.add_edges_from((index[e.src], index[e.dst]) for e in self.edges)
        return list(nx.lexicographical_topological_sort(g))

    def with_pins(self, pins: Mapping[str, str]) -> CostTable:
        """A copy of this table with extra layers pinned (same fingerprint)."""
        names = set(self.layer_names)
        for layer, dev in pins.items():
            if layer not in names:
                raise GraphFormatError(f"pins names unknown layer {layer!r}; known: "
                                       f"{_few(sorted(names))}")
            if dev not in self.device_names:
                raise GraphFormatError(f"pins[{layer!r}] names unknown device {dev!r}; known: "
                                       f"{', '.join(self.device_names)}")
        layers = tuple(dataclasses.replace(layer, pinned=pins[layer.name])
                       if layer.name in pins else layer for layer in self.layers)
        return dataclasses.replace(self, layers=layers)

    def fingerprint(self) -> str:
        """A stable hash of the graph's structure: layer names, edges (src, dst) and device names.

        Times, memory sizes, bytes, prices and links are deliberately left
        out: re-profiling the same model on the same devices (or a new cost
        model) changes the numbers but not what a plan refers to, so a plan
        stays valid. A different model (layers, edges) or a different device
        set changes the fingerprint.
        """
        return fingerprint({
            "layers": sorted(self.layer_names),
            "edges": sorted([e.src, e.dst] for e in self.edges),
            "devices": sorted(self.device_names),
        })

    # -- file form -------------------------------------------------------------

    def to_json(self) -> dict:
        """The graph.json form (a plain dict)."""
        def layer_json(layer: Layer) -> dict:
            out = {"name": layer.name, "time_s": dict(layer.time_s),
                   "memory_bytes": dict(layer.memory_bytes)}
            if layer.allowed is not None:
                out["allowed"] = list(layer.allowed)
            if layer.pinned is not None:
                out["pinned"] = layer.pinned
            if layer.activation_bytes is not None:
                out["activation_bytes"] = layer.activation_bytes
            if layer.fixed_s:
                out["fixed_s"] = dict(layer.fixed_s)
            if layer.param_bytes is not None:
                out["param_bytes"] = layer.param_bytes
            if layer.opt_state_bytes is not None:
                out["opt_state_bytes"] = layer.opt_state_bytes
            if layer.update_s:
                out["update_s"] = dict(layer.update_s)
            if layer.recompute_fraction is not None:
                out["recompute_fraction"] = layer.recompute_fraction
            if layer.workspace_bytes is not None:
                out["workspace_bytes"] = layer.workspace_bytes
            if layer.remat_workspace_bytes is not None:
                out["remat_workspace_bytes"] = layer.remat_workspace_bytes
            if layer.state_leaves is not None:
                out["state_leaves"] = [{"role": r, "shape": list(shape), "bytes": b}
                                       for r, shape, b in layer.state_leaves]
            return out

        out = {
            "format": FORMAT,
            "version": VERSION,
            "devices": [{k: v for k, v in dataclasses.asdict(d).items()
                         if not (k in _OPTIONAL_DEVICE_FIELDS and v is None)
                         and not (k == "stage_overhead_s" and v == 0.0)}
                        for d in self.devices],
            "links": [{k: list(map(list, v)) if k == "curve" else v
                       for k, v in dataclasses.asdict(link).items() if k != "curve" or v}
                      for link in self.links],
            "layers": [layer_json(layer) for layer in self.layers],
            "edges": [dataclasses.asdict(e) for e in self.edges],
        }
        if self.meta:
            out["meta"] = dict(self.meta)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CostTable:
        """Builds and validates a CostTable from the graph.json form.

        Raises:
          GraphFormatError: naming the offending field and how to fix it.
        """
        if not isinstance(data, Mapping):
            raise GraphFormatError(f"graph.json must hold a JSON object, got {type(data).__name__}")
        fmt = data.get("format")
        if fmt == _LAYERS_FORMAT:
            raise GraphFormatError(f"format is {fmt!r}: that file is a layer listing from "
                                   "`hetpar trace`, not the planner's input; write graph.json "
                                   f"with `{_HOW_TO_WRITE}`")
        if fmt != FORMAT:
            raise GraphFormatError(f"format is {fmt!r}, expected {FORMAT!r}: is this a graph.json "
                                   f"written by `{_HOW_TO_WRITE}`?")
        version = data.get("version")
        if version != VERSION:
            raise GraphFormatError(f"version {version!r} is not supported (this hetpar reads "
                                   f"version {VERSION}); re-export the graph with this hetpar")
        for key in ("devices", "links", "layers", "edges"):
            if key not in data:
                raise GraphFormatError(f"missing field {key!r} (a list); see docs/formats.md")
            if not isinstance(data[key], list):
                raise GraphFormatError(f"field {key!r} must be a list, got "
                                       f"{type(data[key]).__name__}")
        devices = tuple(
            Device(name=_field(d, "name", f"devices[{i}]", str),
                   kind=_field(d, "kind", f"devices[{i}]", str),
                   memory_bytes=_field(d, "memory_bytes", f"devices[{i}]", float),
                   price_per_hour=_field(d, "price_per_hour", f"devices[{i}]", float, 0.0),
                   watts_busy=_field(d, "watts_busy", f"devices[{i}]", float, 0.0),
                   watts_idle=_field(d, "watts_idle", f"devices[{i}]", float, 0.0),
                   price_alone_per_hour=_field(d, "price_alone_per_hour", f"devices[{i}]",
                                               float, None),
                   compute_group=_field(d, "compute_group", f"devices[{i}]", str, None),
                   stage_overhead_s=_field(d, "stage_overhead_s", f"devices[{i}]", float, 0.0))
            for i, d in enumerate(_objects(data["devices"], "devices")))
        links = tuple(
            Link(src=_field(k, "src", f"links[{i}]", str),
                 dst=_field(k, "dst", f"links[{i}]", str),
                 bandwidth_bytes_per_s=_field(k, "bandwidth_bytes_per_s", f"links[{i}]", float),
                 latency_s=_field(k, "latency_s", f"links[{i}]", float, 0.0),
                 curve=_curve(k, f"links[{i}]"))
            for i, k in enumerate(_objects(data["links"], "links")))
        layers = []
        for i, layer in enumerate(_objects(data["layers"], "layers")):
            where = f"layers[{i}]"
            allowed = layer.get("allowed")
            if allowed is not None:
                if not isinstance(allowed, list) or not all(isinstance(a, str) for a in allowed):
                    raise GraphFormatError(f"{where}.allowed must be a list of device names")
                allowed = tuple(allowed)
            act = layer.get("activation_bytes")
            layers.append(Layer(
                name=_field(layer, "name", where, str),
                time_s=_number_map(layer, "time_s", where),
                memory_bytes=_number_map(layer, "memory_bytes", where),
                allowed=allowed,
                pinned=_field(layer, "pinned", where, str, None),
                activation_bytes=None if act is None else _field(layer, "activation_bytes",
                                                                 where, float),
                fixed_s=_number_map(layer, "fixed_s", where) if "fixed_s" in layer else None,
                param_bytes=None if layer.get("param_bytes") is None else _field(
                    layer, "param_bytes", where, float),
                opt_state_bytes=None if layer.get("opt_state_bytes") is None else _field(
                    layer, "opt_state_bytes", where, float),
                update_s=_number_map(layer, "update_s", where) if layer.get(
                    "update_s") is not None else None,
                recompute_fraction=None if layer.get("recompute_fraction") is None else _field(
                    layer, "recompute_fraction", where, float),
                workspace_bytes=None if layer.get("workspace_bytes") is None else _field(
                    layer, "workspace_bytes", where, float),
                remat_workspace_bytes=None if layer.get("remat_workspace_bytes") is None
                else _field(layer, "remat_workspace_bytes", where, float),
                state_leaves=_state_leaves(layer, where)))
        edges = tuple(
            Edge(src=_field(e, "src", f"edges[{i}]", str),
                 dst=_field(e, "dst", f"edges[{i}]", str),
                 bytes=_field(e, "bytes", f"edges[{i}]", float),
                 bytes_backward=_field(e, "bytes_backward", f"edges[{i}]", float, 0.0))
            for i, e in enumerate(_objects(data["edges"], "edges")))
        meta = data.get("meta", {})
        if not isinstance(meta, Mapping):
            raise GraphFormatError("meta must be an object")
        _check_update_reads(meta.get("update_reads"), {la.name for la in layers})
        return cls(devices=devices, links=links, layers=tuple(layers), edges=edges,
                   meta=dict(meta))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostTable:
        """Reads and validates a graph.json file."""
        return load_json(path, cls.from_json, GraphFormatError, what="graph file",
                         how=_HOW_TO_WRITE)

    def save(self, path: str | os.PathLike) -> None:
        """Writes graph.json."""
        save_json(path, self.to_json())


# -- validation ------------------------------------------------------------------

_MISSING = object()


def _objects(items: list, where: str) -> list[Mapping]:
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise GraphFormatError(f"{where}[{i}] must be an object, got {type(item).__name__}")
    return items


def _field(obj: Mapping, key: str, where: str, typ: type, default: Any = _MISSING) -> Any:
    if key not in obj or obj[key] is None:
        if default is _MISSING:
            raise GraphFormatError(f"{where} is missing field {key!r}")
        return default
    value = obj[key]
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GraphFormatError(f"{where}.{key} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, typ):
        raise GraphFormatError(f"{where}.{key} must be a {typ.__name__}, got {value!r}")
    return value


#: Roles of a layer's state leaves (`Layer.state_leaves`).
STATE_ROLES = ("param", "opt_state")


def _state_leaves(layer: Mapping, where: str) -> tuple | None:
    """`layers[i].state_leaves` of graph.json: [{"role", "shape", "bytes"}], checked."""
    leaves = layer.get("state_leaves")
    if leaves is None:
        return None
    if not isinstance(leaves, list):
        raise GraphFormatError(f"{where}.state_leaves must be a list of "
                               f'{{"role", "shape", "bytes"}} objects, got {leaves!r}')
    out = []
    for k, leaf in enumerate(leaves):
        at = f"{where}.state_leaves[{k}]"
        if not isinstance(leaf, Mapping):
            raise GraphFormatError(f'{at} must be an object {{"role", "shape", "bytes"}}')
        role, shape = leaf.get("role"), leaf.get("shape")
        if role not in STATE_ROLES:
            raise GraphFormatError(f"{at}.role must be one of {STATE_ROLES}, got {role!r}")
        if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise GraphFormatError(f"{at}.shape must be a list of non-negative integers, "
                                   f"got {shape!r}")
        out.append((role, tuple(shape), _field(leaf, "bytes", at, float)))
    return tuple(out)


def _number_map(obj: Mapping, key: str, where: str) -> dict[str, float]:
    value = _field(obj, key, where, dict)
    out = {}
    for dev in value:
        out[dev] = _field(value, dev, f"{where}.{key}", float)
    return out


def _few(names: Sequence[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _curve(obj: Mapping, where: str) -> tuple[tuple[float, float], ...]:
    """A link's `curve` from JSON: [[bytes, seconds], ...] (checked by `_validate_links`)."""
    value = _field(obj, "curve", where, list, [])
    out = []
    for j, point in enumerate(value):
        if (not isinstance(point, list | tuple) or len(point) != 2
                or any(isinstance(x, bool) or not isinstance(x, int | float) for x in point)):
            raise GraphFormatError(f"{where}.curve[{j}] must be [bytes, seconds], got {point!r}")
        out.append((float(point[0]), float(point[1])))
    return tuple(out)


def _check_number(value: float, where: str, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise GraphFormatError(f"{where} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0) or math.isinf(value):
        need = "positive" if positive else "non-negative"
        raise GraphFormatError(f"{where} is {value!r}; it must be {need} and finite")


def _validate(table: CostTable) -> None:
    """Checks a table's internal consistency; raises GraphFormatError naming the field."""
    names = _validate_devices(table.devices)
    known = ", ".join(names)
    _validate_links(table.links, names, known)
    layers: dict[str, int] = {}
    for i, layer in enumerate(table.layers):
        _validate_layer(i, layer, layers, names, known)
        layers[layer.name] = i
    _validate_edges(table.edges, layers)
    _check_acyclic(layers, table.edges)


def _validate_devices(devices: Sequence[Device]) -> dict[str, int]:
    """Checks the devices; returns {name: index}."""
    names: dict[str, int] = {}
    for i, d in enumerate(devices):
        if not isinstance(d, Device):
            raise GraphFormatError(f"devices[{i}] must be a Device")
        if not isinstance(d.name, str) or not d.name:
            raise GraphFormatError(f"devices[{i}].name must be a non-empty string")
        if d.name in names:
            raise GraphFormatError(f"devices[{i}].name {d.name!r} duplicates devices"
                                   f"[{names[d.name]}]; device names must be unique")
        names[d.name] = i
        _check_number(d.memory_bytes, f"devices[{i}].memory_bytes")
        _check_number(d.price_per_hour, f"devices[{i}].price_per_hour")
        _check_number(d.watts_busy, f"devices[{i}].watts_busy")
        _check_number(d.watts_idle, f"devices[{i}].watts_idle")
        if d.price_alone_per_hour is not None:
            _check_number(d.price_alone_per_hour, f"devices[{i}].price_alone_per_hour")
            if d.price_alone_per_hour < d.price_per_hour:
                raise GraphFormatError(
                    f"devices[{i}].price_alone_per_hour ({d.price_alone_per_hour}) is below "
                    f"its price_per_hour ({d.price_per_hour}); renting a device alone never "
                    "costs less than beside others: drop the field or raise it")
        if d.compute_group is not None and (not isinstance(d.compute_group, str)
                                            or not d.compute_group):
            raise GraphFormatError(f"devices[{i}].compute_group must be a non-empty string "
                                   f"(or absent), got {d.compute_group!r}")
    if not devices:
        raise GraphFormatError("devices is empty; list at least one device")
    return names


def _validate_links(links: Sequence[Link], names: Mapping[str, int], known: str) -> None:
    """Checks the links: known ends, no self-links or duplicates, positive bandwidth."""
    seen: dict[tuple[str, str], int] = {}
    for i, k in enumerate(links):
        for end in ("src", "dst"):
            if getattr(k, end) not in names:
                raise GraphFormatError(f"links[{i}].{end} names unknown device "
                                       f"{getattr(k, end)!r}; known devices: {known}")
        if k.src == k.dst:
            raise GraphFormatError(f"links[{i}] links {k.src!r} to itself; remove it "
                                   "(transfers on one device are free)")
        if (k.src, k.dst) in seen:
            raise GraphFormatError(f"links[{i}] duplicates links[{seen[k.src, k.dst]}] "
                                   f"({k.src} -> {k.dst}); keep one")
        seen[k.src, k.dst] = i
        _check_number(k.bandwidth_bytes_per_s, f"links[{i}].bandwidth_bytes_per_s",
                      positive=True)
        _check_number(k.latency_s, f"links[{i}].latency_s")
        last = 0.0
        for j, (b, t) in enumerate(k.curve):
            _check_number(b, f"links[{i}].curve[{j}] bytes", positive=True)
            _check_number(t, f"links[{i}].curve[{j}] seconds")
            if b <= last:
                raise GraphFormatError(f"links[{i}].curve's bytes must rise, got {b!r} after "
                                       f"{last!r}; sort its points by size")
            last = b


def _validate_layer(i: int, layer: Layer, layers: Mapping[str, int], names: Mapping[str, int],
                    known: str) -> None:
    """Checks layers[i] against the devices and the layers before it (`layers`)."""
    where = f"layers[{i}]"
    if not isinstance(layer, Layer):
        raise GraphFormatError(f"{where} must be a Layer")
    if not isinstance(layer.name, str) or not layer.name:
        raise GraphFormatError(f"{where}.name must be a non-empty string")
    if layer.name in layers:
        raise GraphFormatError(f"{where}.name {layer.name!r} duplicates layers"
                               f"[{layers[layer.name]}]; layer names must be unique")
    where = f"layers[{i}] ({layer.name})"
    _validate_layer_costs(layer, where, names, known)
    for dev in layer.allowed or ():
        if dev not in names:
            raise GraphFormatError(f"{where}.allowed names unknown device {dev!r}; known "
                                   f"devices: {known}")
    if layer.pinned is not None:
        if layer.pinned not in names:
            raise GraphFormatError(f"{where}.pinned names unknown device "
                                   f"{layer.pinned!r}; known devices: {known}")
        if layer.pinned not in layer.time_s:
            raise GraphFormatError(f"{where}.pinned is {layer.pinned!r} but time_s has no "
                                   "time there; add its time on that device")
    if layer.activation_bytes is not None:
        _check_number(layer.activation_bytes, f"{where}.activation_bytes")
    if layer.param_bytes is not None:
        _check_number(layer.param_bytes, f"{where}.param_bytes")
    if layer.opt_state_bytes is not None:
        _check_number(layer.opt_state_bytes, f"{where}.opt_state_bytes")
    if layer.workspace_bytes is not None:
        _check_number(layer.workspace_bytes, f"{where}.workspace_bytes")
    if layer.remat_workspace_bytes is not None:
        _check_number(layer.remat_workspace_bytes, f"{where}.remat_workspace_bytes")
    for k, (_, _, b) in enumerate(layer.state_leaves or ()):
        _check_number(b, f"{where}.state_leaves[{k}].bytes")
    if layer.recompute_fraction is not None:
        _check_number(layer.recompute_fraction, f"{where}.recompute_fraction")
    if layer.recompute_fraction is not None and not layer.recompute_fraction <= 1:
        raise GraphFormatError(f"{where}.recompute_fraction is {layer.recompute_fraction}; it "
                               "is a share of the layer's forward, between 0 and 1 (omit it "
                               "for 1: the whole forward recomputed)")
    for dev, u in (layer.update_s or {}).items():
        if dev not in names:
            raise GraphFormatError(f"{where}.update_s names unknown device {dev!r}; known "
                                   f"devices: {known}")
        _check_number(u, f"{where}.update_s[{dev!r}]")
    for dev, f in (layer.fixed_s or {}).items():
        if dev not in layer.time_s:
            raise GraphFormatError(f"{where}.fixed_s names {dev!r}, which time_s does not; "
                                   "fixed_s is a part of the layer's time there")
        _check_number(f, f"{where}.fixed_s[{dev!r}]")
        if f > layer.time_s[dev]:
            raise GraphFormatError(f"{where}.fixed_s[{dev!r}] = {f} exceeds its time_s "
                                   f"({layer.time_s[dev]}); it is the part of the time "
                                   "that does not shrink with the microbatch")
    if not layer.devices():
        raise GraphFormatError(f"{where} can run on no device: time_s names "
                               f"{sorted(layer.time_s) or 'none'}, allowed is "
                               f"{list(layer.allowed) if layer.allowed is not None else 'any'}"
                               "; give it a time on an allowed device")


def _validate_layer_costs(layer: Layer, where: str, names: Mapping[str, int],
                          known: str) -> None:
    """Checks a layer's time_s and memory_bytes: known devices, numbers, both given."""
    for dev, t in layer.time_s.items():
        if dev not in names:
            raise GraphFormatError(f"{where}.time_s names unknown device {dev!r}; known "
                                   f"devices: {known}. Add it to devices or drop the time")
        _check_number(t, f"{where}.time_s[{dev!r}]")
    for dev, m in layer.memory_bytes.items():
        if dev not in names:
            raise GraphFormatError(f"{where}.memory_bytes names unknown device {dev!r}; "
                                   f"known devices: {known}")
        _check_number(m, f"{where}.memory_bytes[{dev!r}]")
    for dev in layer.time_s:
        if dev not in layer.memory_bytes:
            raise GraphFormatError(f"{where}.memory_bytes lacks {dev!r}, which time_s "
                                   "names; give the layer's memory on every device it is "
                                   "timed on")


def _validate_edges(edges: Sequence[Edge], layers: Mapping[str, int]) -> None:
    """Checks the edges: known layers at both ends, no duplicates, byte counts."""
    seen: dict[tuple[str, str], int] = {}
    for i, e in enumerate(edges):
        for end in ("src", "dst"):
            if getattr(e, end) not in layers:
                raise GraphFormatError(f"edges[{i}].{end} names unknown layer "
                                       f"{getattr(e, end)!r}; known layers: "
                                       f"{_few(list(layers))}")
        if (e.src, e.dst) in seen:
            raise GraphFormatError(f"edges[{i}] duplicates edges[{seen[e.src, e.dst]}] "
                                   f"({e.src} -> {e.dst}); merge their bytes into one edge")
        seen[e.src, e.dst] = i
        _check_number(e.bytes, f"edges[{i}].bytes")
        _check_number(e.bytes_backward, f"edges[{i}].bytes_backward")


def _check_acyclic(layers: Mapping[str, int], edges: Sequence[Edge]) -> None:
    """The edges must form a DAG; names a cycle if they do not."""
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(layers)
    g.add_edges_from((e.src, e.dst) for e in edges)
    if not nx.is_directed_acyclic_graph(g):
        cycle = nx.find_cycle(g)
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        raise GraphFormatError(f"edges form a cycle ({path}); edges must form a DAG "
                               "(forward data flow only; the backward pass is bytes_backward)")
