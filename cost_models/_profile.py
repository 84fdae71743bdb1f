"""One device's figures and one transfer path's: what every cost in hetpar is computed from.

A `DeviceProfile` describes one device (a present one such as `gpu:0`, or a
spec-sheet kind such as `h100`); a `LinkProfile` describes one transfer path
between two devices. Both are frozen dataclasses with a JSON form, and every
figure carries a source (spec sheet + public URL, or measured + date + host).
Validation happens once, in `from_json`, and raises `ProfileError` naming the
bad field and how to fix it.

Profiles are stored in the profile file form (what `hetpar profile --out`
writes, and what the built-in spec sheets use)::

    {"format": "hetpar.profiles", "version": 1,
     "devices": [DeviceProfile.to_json(), ...],
     "links":   [LinkProfile.to_json(), ...]}

`file_devices` checks its header; `ProfileSet` (`_profiles`) reads the rest.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from hetpar.core import ProfileError

FORMAT = "hetpar.profiles"
VERSION = 1

#: The roofline's op class of each of hetpar's jaxpr op classes (the classes
#: `hetpar.passes.op_class` gives an equation, `hetpar.passes.OP_CLASSES`).
#: Data movement (gathers, scatters, slices, sorts' neighbours) and control
#: flow have no benchmark of their own and share the class `other`. This
#: mapping is the one place the two vocabularies meet: a jaxpr class missing
#: here is an error where layer work is converted (`layer_work`), and
#: tests/test_cost_models.py checks the keys against `hetpar.passes.OP_CLASSES`.
ROOFLINE_CLASS = {
    "matmul": "matmul",
    "elementwise": "elementwise",
    "reduction": "reduction",
    "data_movement": "other",
    "control_flow": "other",
}

#: Op classes of the roofline predictor (derived from `ROOFLINE_CLASS`, in
#: its order). `matmul` is dot_general and convolutions; `elementwise`
#: includes transcendentals; `reduction` is reduce_* and friends; `other` is
#: everything else (gathers, scatters, sorts).
OP_CLASSES = tuple(dict.fromkeys(ROOFLINE_CLASS.values()))

#: Dtype keys of `peak_flops_per_s`. `f32` and `bf16` are the vector/tensor
#: peaks of the spec sheets. `f32_matmul` is the peak of f32 dots at JAX's
#: DEFAULT precision, which is not f32 arithmetic on accelerators: TF32 tensor
#: cores on NVIDIA Ampere and later, one bf16 MXU pass on TPU
#: (https://docs.jax.dev/en/latest/201/precision.html). docs/measurements.md measured a
#: 4096^3 f32 matmul at 411 TFLOP/s on an H200, six times the 67 TFLOP/s f32
#: figure, so the predictor must not cap f32 dots at the f32 vector peak.
DTYPES = ("f32", "bf16", "f32_matmul")

_DEVICE_CLASSES = ("cpu", "gpu", "tpu")

_GPU_KINDS = ("t4", "a100", "h100", "h200", "gpu")


def device_class(kind: str) -> str:
    """Returns the class (`cpu`, `gpu` or `tpu`) of a device kind.

    Siblings share a class: a device that is not present borrows the
    calibration of a measured device of the same class.
    """
    k = kind.lower()
    if k.startswith("tpu"):
        return "tpu"
    if k.startswith("cpu"):
        return "cpu"
    if k in _GPU_KINDS or k.startswith(("gpu", "nvidia", "cuda", "rocm")):
        return "gpu"
    raise ProfileError(
        f"cannot tell the class of device kind {kind!r}: name it cpu..., tpu-... "
        f"or one of the GPU kinds {', '.join(_GPU_KINDS)}"
    )


def _num(where: str, field: str, value: Any, *, positive: bool = True, allow_zero=False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(f"{where}: field {field!r} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0 and not allow_zero):
        need = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise ProfileError(f"{where}: field {field!r} must be {need}, got {value!r}")
    return v


def _efficiency(where: str, data: Mapping[str, Any], field: str, why: str) -> float | None:
    """An optional efficiency field: None when absent, else a number in (0, 1]."""
    value = data.get(field)
    if value is None:
        return None
    value = _num(where, field, value)
    if value > 1.0:
        raise ProfileError(f"{where}: field '{field}' = {value} exceeds 1: {why}")
    return value


def _require(where: str, data: Mapping[str, Any], field: str, hint: str) -> Any:
    if field not in data:
        raise ProfileError(f"{where}: missing field {field!r} ({hint}); add it to the file")
    return data[field]


def _never_falling(ys: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing fit of `ys` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """One transfer path from `src` to `dst`: `time(bytes) = latency + bytes / bandwidth`.

    Attributes:
      src: source device name (`cpu:0`, `p0/cpu:0`); for a spec sheet's host
        link, its kind; for a `network` link between whole processes, the
        process (`p0`).
      dst: destination device name (or process, `p1`).
      path: how the bytes move: `device_put` (plain `jax.device_put`),
        `pinned_host` (through the GPU's pinned host memory),
        `pinned_host_staged` (only the pinned-host -> device copy: a lower
        bound when the producer already wrote into pinned memory),
        `network` (between processes: a collective transfer across
        `jax.distributed`, see `network_link`), or a bus name for spec-sheet
        links (`pcie4x16`).
      latency_s: fixed cost of one transfer in seconds.
      bandwidth_bytes_per_s: sustained bandwidth.
      source: where the figures come from (spec + URL, or measured + date + host).
      samples: measured `(bytes, seconds)` pairs the fit came from (may be empty).
      duplex_bandwidth_bytes_per_s: each direction's bandwidth while copies
        run both ways at once, where known (a spec sheet's host link): lower
        than one way alone on real PCIe hosts, and what streamed optimizer
        state gets, since its copies in and out overlap. None: as one way.
    """

    src: str
    dst: str
    path: str
    latency_s: float
    bandwidth_bytes_per_s: float
    source: str
    samples: tuple[tuple[float, float], ...] = ()
    duplex_bandwidth_bytes_per_s: float | None = None

    def time(self, nbytes: float) -> float:
        """Seconds to move `nbytes` over this path."""
        return self.latency_s + float(nbytes) / self.bandwidth_bytes_per_s

    def copy_curve(self) -> tuple[tuple[float, float], ...]:
        """The samples as a `Link.curve` over this path's `latency_s`: (bytes,
        seconds beyond the latency) at each sampled size, fitted never to fall
        with size (pool adjacent violators: a noisy sample is averaged with
        its neighbours, not carried to every larger size), so a copy priced
        `latency_s + curve(bytes)` reproduces the samples. () with fewer than
        three sizes, or none slower than the latency. Samples at one size
        count as their median; non-finite ones are left out. The latency is
        the fit's, over every sample: the small copies alone vary by 20-40%
        (an H200 host's GPU -> CPU copies: 411-604 us from 4 to 64 KB).

        One bandwidth does not price every size: on an H100 host the CPU
        device's copies to the GPU (put to a SingleDeviceSharding) ran
        ~3-4 GB/s up to 28 MiB and ~1.1 GB/s from 32 MiB
        (experiments/results/links), so a straight line through the samples
        priced either size up to 3x off.
        """
        by_size: dict[float, list[float]] = {}
        for b, t in self.samples:
            if math.isfinite(b) and math.isfinite(t) and b > 0 and t >= 0:
                by_size.setdefault(float(b), []).append(float(t))
        if len(by_size) < 3:
            return ()
        sizes = sorted(by_size)
        beyond = _never_falling([statistics.median(by_size[b]) - self.latency_s
                                 for b in sizes])
        if beyond[-1] <= 0:
            return ()
        return tuple((b, max(t, 0.0)) for b, t in zip(sizes, beyond))

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form (a plain dict)."""
        out = {
            "src": self.src,
            "dst": self.dst,
            "path": self.path,
            "latency_s": self.latency_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "source": self.source,
        }
        if self.samples:
            out["samples"] = [list(s) for s in self.samples]
        if self.duplex_bandwidth_bytes_per_s is not None:
            out["duplex_bandwidth_bytes_per_s"] = self.duplex_bandwidth_bytes_per_s
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "link") -> LinkProfile:
        """Validates and builds a LinkProfile from its JSON form.

        Raises:
          ProfileError: a field is missing or out of range.
        """
        if not isinstance(data, Mapping):
            raise ProfileError(f"{where}: expected an object, got {type(data).__name__}")
        src = _require(where, data, "src", "source device name, e.g. 'cpu:0'")
        dst = _require(where, data, "dst", "destination device name, e.g. 'gpu:0'")
        where = f"link {src}->{dst}"
        path = _require(where, data, "path", "transfer path name, e.g. 'device_put'")
        lat = _num(
            where,
            "latency_s",
            _require(where, data, "latency_s", "seconds per transfer, e.g. 2e-5"),
            allow_zero=True,
        )
        bw = _num(
            where,
            "bandwidth_bytes_per_s",
            _require(where, data, "bandwidth_bytes_per_s", "bytes per second, e.g. 8e9"),
        )
        source = _require(where, data, "source", "where the figures come from")
        samples = _samples(where, data.get("samples", ()))
        duplex = data.get("duplex_bandwidth_bytes_per_s")
        if duplex is not None:
            duplex = _num(where, "duplex_bandwidth_bytes_per_s", duplex)
        return cls(str(src), str(dst), str(path), lat, bw, str(source), samples, duplex)


def _samples(where: str, raw: Any) -> tuple[tuple[float, float], ...]:
    """A link's `samples` from JSON: [[bytes, seconds], ...], bytes > 0, seconds >= 0."""
    if not isinstance(raw, (list, tuple)):
        raise ProfileError(f"{where}: 'samples' must be a list of [bytes, seconds], "
                           f"got {type(raw).__name__}")
    out = []
    for i, point in enumerate(raw):
        ok = isinstance(point, (list, tuple)) and len(point) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in point)
        if not ok or point[0] <= 0 or point[1] < 0:
            raise ProfileError(f"{where}: samples[{i}] must be [bytes > 0, seconds >= 0], "
                               f"got {point!r}; fix or remove it (re-run `hetpar profile`)")
        out.append((float(point[0]), float(point[1])))
    return tuple(out)


#: The path name of links between devices of different processes (docs/formats.md).
NETWORK_PATH = "network"

#: Default bandwidth of a link between two processes, when neither `hetpar
#: profile` under `jax.distributed` measured it nor `--link` declared it: one
#: 100 Gb/s Ethernet port (IEEE 802.3ba line rate, 12.5 GB/s). GPU clusters
#: often have more (400 Gb/s InfiniBand per GPU); two processes on one machine
#: over loopback TCP (gloo) get far less: ~1 GB/s measured on a 2-core VM.
DEFAULT_NETWORK_BANDWIDTH = 12.5e9
#: Default latency of one transfer between two processes: an estimate for one
#: message through a NIC, one switch and the collective library's stack (NCCL
#: or gloo). Loopback gloo on a 2-core VM measured ~0.3 ms per transfer.
DEFAULT_NETWORK_LATENCY_S = 20e-6
_DEFAULT_NETWORK_SOURCE = (
    "default network link (docs/formats.md): estimate, one 100 Gb/s Ethernet port "
    "(IEEE 802.3ba line rate) and 20 us per transfer; not measured: run `hetpar profile` "
    "under `python -m hetpar.launch` (or your cluster's launcher) to measure it, or "
    "declare it with --link pA-pB=GBps[@LATENCY_us]")


def process_link_name(process: int) -> str:
    """The `src`/`dst` of a link between whole processes: `p0`, `p1`, ..."""
    return f"p{int(process)}"


def default_network_link(src: str, dst: str) -> LinkProfile:
    """The documented default `network` link from `src` to `dst` (processes or devices):
    `DEFAULT_NETWORK_BANDWIDTH` and `DEFAULT_NETWORK_LATENCY_S`."""
    return LinkProfile(src=src, dst=dst, path=NETWORK_PATH,
                       latency_s=DEFAULT_NETWORK_LATENCY_S,
                       bandwidth_bytes_per_s=DEFAULT_NETWORK_BANDWIDTH,
                       source=_DEFAULT_NETWORK_SOURCE)


# Field name -> (hint for the error message) of the required numeric figures.
_DEVICE_FIGURES = {
    "memory_bandwidth_bytes_per_s": "device memory bandwidth in bytes/s, e.g. 3.35e12",
    "memory_bytes": "device memory capacity in bytes, e.g. 8.0e10",
    "launch_overhead_s": "seconds of fixed cost per kernel launch, e.g. 5e-6",
    "price_per_hour": "on-demand US dollars per device-hour, e.g. 6.88",
    "watts_busy": "watts while computing, e.g. 700",
    "watts_idle": "watts while idle, e.g. 70",
}

# A free device (a host CPU) or an unmetered one is fine; a device without
# memory or bandwidth is not.
_MAY_BE_ZERO = ("launch_overhead_s", "price_per_hour", "watts_busy", "watts_idle")


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What one device can do, and what it costs to run.

    Attributes:
      name: device name: a present device (`cpu:0`, `gpu:0`, JAX's
        platform:id) or a spec-sheet kind (`h100`).
      kind: spec-sheet kind (`cpu`, `t4`, `a100`, `h100`, `h200`, `tpu-v4`,
        `tpu-v5e`), or the platform (`gpu`) for a device with no spec sheet.
      peak_flops_per_s: physical peak FLOP/s by dtype (see `DTYPES`).
      memory_bandwidth_bytes_per_s: peak device-memory bandwidth.
      memory_bytes: device memory capacity.
      launch_overhead_s: fixed cost per kernel launch (dispatch included).
        A layer's stage is one executable: one launch per call.
      buffer_overhead_s: fixed cost per input or output array of a call
        (argument handling, one buffer per parameter and optimizer-state
        leaf); 0 unless calibrated on measured layers.
      fused_bytes_efficiency: fraction of peak bandwidth reached on a
        layer's after-fusion traffic (XLA's `bytes accessed` of the compiled
        layer, `LayerWork.fused_bytes`), in (0, 1]; None until calibrated,
        when the elementwise class's bytes efficiency (a streaming
        benchmark: real traffic too) stands in. See `fused_efficiency`.
      conv_efficiency: fraction of the matmul peak reached on convolution
        FLOPs (`LayerWork.conv_flops`), in (0, 1]; None unless calibrated
        with `calibrate(fit_conv=True)`, when convolutions run at the
        matmul class's FLOP efficiency. See `conv_flops_efficiency`.
      layer_model: coefficients of the per-equation layer model
        (`hetpar.cost_models.fit_equation_model`), fitted by `hetpar profile
        --fit` on measured layers unless, each fit model left out in turn,
        it predicted them clearly worse than the roofline; layers that are
        not measured are then predicted by it (`predict_layer`). None: the
        roofline.
      price_per_hour: on-demand dollars per device-hour when rented alone.
      host_price_per_hour: marginal dollars per hour when this device is the
        host CPU of an accelerator instance whose price already covers it
        (0 by default: see `hetpar.cost_models._specs` on the pricing model).
      watts_busy: power while computing.
      watts_idle: power while idle.
      host_link: the bus to the host CPU (None for the CPU itself).
      peer_link: the direct interconnect to another device of the same class
        in one machine (NVLink between SXM GPUs), or None: two such devices
        without a measured path between them then go through the host.
      efficiencies: `{op_class: {"flops": e, "bytes": e}}`, each in (0, 1]:
        the fraction of peak FLOP/s and of peak bandwidth reached.
      sources: `{figure: source}` for every figure above; nested figures use
        dotted keys (`peak_flops_per_s.bf16`).
      origin: `spec` (a spec sheet), `measured` (by `hetpar profile`), or
        `transferred` (a spec sheet with a sibling's measured calibration).
      benchmarks: raw microbenchmark results, free-form (may be empty).
    """

    name: str
    kind: str
    peak_flops_per_s: Mapping[str, float]
    memory_bandwidth_bytes_per_s: float
    memory_bytes: float
    launch_overhead_s: float
    price_per_hour: float
    watts_busy: float
    watts_idle: float
    efficiencies: Mapping[str, Mapping[str, float]]
    sources: Mapping[str, str]
    host_link: LinkProfile | None = None
    peer_link: LinkProfile | None = None
    host_price_per_hour: float = 0.0
    origin: str = "spec"
    benchmarks: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    buffer_overhead_s: float = 0.0
    fused_bytes_efficiency: float | None = None
    conv_efficiency: float | None = None
    layer_model: Mapping[str, float] | None = None

    def conv_flops_efficiency(self) -> float:
        """Efficiency on convolution FLOPs: calibrated, else the matmul class's."""
        if self.conv_efficiency is not None:
            return self.conv_efficiency
        return self.efficiencies["matmul"]["flops"]

    def fused_efficiency(self) -> float:
        """Efficiency on after-fusion bytes: calibrated, else the elementwise bytes one."""
        if self.fused_bytes_efficiency is not None:
            return self.fused_bytes_efficiency
        return self.efficiencies["elementwise"]["bytes"]

    @property
    def device_class(self) -> str:
        """`cpu`, `gpu` or `tpu`."""
        return device_class(self.kind)

    def peak(self, dtype: str, op_class: str = "elementwise") -> float:
        """Peak FLOP/s for `dtype` work of `op_class`.

        f32 matmul-class work uses `f32_matmul` when the profile has it (JAX's
        default precision); an unknown dtype falls back to `f32`.
        """
        peaks = self.peak_flops_per_s
        if dtype == "f32" and op_class == "matmul" and "f32_matmul" in peaks:
            return peaks["f32_matmul"]
        return peaks.get(dtype, peaks["f32"])

    def replace(self, **changes: Any) -> DeviceProfile:
        """Returns a copy with `changes` applied (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form (a plain dict)."""
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "origin": self.origin,
            "peak_flops_per_s": dict(self.peak_flops_per_s),
        }
        for f in _DEVICE_FIGURES:
            out[f] = getattr(self, f)
        out["host_price_per_hour"] = self.host_price_per_hour
        if self.buffer_overhead_s:
            out["buffer_overhead_s"] = self.buffer_overhead_s
        if self.fused_bytes_efficiency is not None:
            out["fused_bytes_efficiency"] = self.fused_bytes_efficiency
        if self.conv_efficiency is not None:
            out["conv_efficiency"] = self.conv_efficiency
        if self.layer_model:
            out["layer_model"] = dict(self.layer_model)
        out["host_link"] = self.host_link.to_json() if self.host_link else None
        if self.peer_link:
            out["peer_link"] = self.peer_link.to_json()
        out["efficiencies"] = {c: dict(e) for c, e in self.efficiencies.items()}
        out["sources"] = dict(self.sources)
        if self.benchmarks:
            out["benchmarks"] = jsonable(self.benchmarks)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceProfile:
        """Validates and builds a DeviceProfile from its JSON form.

        Raises:
          ProfileError: a field is missing, mistyped or out of range, or a
            figure has no source.
        """
        if not isinstance(data, Mapping):
            raise ProfileError(f"device profile: expected an object, got {type(data).__name__}")
        name = _require("device profile", data, "name", "device name, e.g. 'gpu:0' or 'h100'")
        where = f"device profile {name!r}"
        kind = _require(where, data, "kind", "spec-sheet kind, e.g. 'h100' or 'cpu'")
        device_class(str(kind))  # validates the kind
        peaks = _require(where, data, "peak_flops_per_s", "FLOP/s by dtype, e.g. {'f32': 6.7e13}")
        if not isinstance(peaks, Mapping) or "f32" not in peaks:
            raise ProfileError(
                f"{where}: field 'peak_flops_per_s' must be an object with at least an "
                f"'f32' entry (FLOP/s by dtype: {', '.join(DTYPES)}), got {peaks!r}"
            )
        peaks = {
            str(k): _num(where, f"peak_flops_per_s.{k}", v) for k, v in peaks.items()
        }
        figures = {
            f: _num(where, f, _require(where, data, f, hint), allow_zero=f in _MAY_BE_ZERO)
            for f, hint in _DEVICE_FIGURES.items()
        }
        host_price = _num(
            where, "host_price_per_hour", data.get("host_price_per_hour", 0.0), allow_zero=True
        )
        buffer_overhead = _num(
            where, "buffer_overhead_s", data.get("buffer_overhead_s", 0.0), allow_zero=True
        )
        fused_eff = _efficiency(where, data, "fused_bytes_efficiency", "no device moves its "
                                "after-fusion bytes faster than its peak bandwidth")
        conv_eff = _efficiency(where, data, "conv_efficiency",
                               "no device runs convolutions faster than its matmul peak")
        layer_model = data.get("layer_model")
        if layer_model is not None:
            if not isinstance(layer_model, Mapping) or not layer_model:
                raise ProfileError(f"{where}: field 'layer_model' must be an object of "
                                   "coefficients (hetpar profile --fit writes it)")
            from hetpar.cost_models._equation_model import TERMS

            unknown = sorted(set(map(str, layer_model)) - set(TERMS))
            missing = [t for t in TERMS if t not in layer_model]
            if unknown or missing:
                raise ProfileError(
                    f"{where}: layer_model must have exactly the terms {', '.join(TERMS)}; "
                    + (f"unknown: {unknown}" if unknown else f"missing: {missing}")
                    + " (hetpar profile --fit writes it)")
            layer_model = {str(k): _num(where, f"layer_model.{k}", v, allow_zero=True)
                           for k, v in layer_model.items()}
        link = data.get("host_link")
        host_link = LinkProfile.from_json(link, f"{where} host_link") if link else None
        peer = data.get("peer_link")
        peer_link = LinkProfile.from_json(peer, f"{where} peer_link") if peer else None
        effs = _require(where, data, "efficiencies", "{op_class: {'flops': e, 'bytes': e}}")
        efficiencies = _validate_efficiencies(where, effs)
        sources = _require(where, data, "sources", "{figure: where it came from}")
        if not isinstance(sources, Mapping):
            raise ProfileError(f"{where}: field 'sources' must be an object")
        needed = [f"peak_flops_per_s.{k}" for k in peaks] + list(_DEVICE_FIGURES)
        needed.append("efficiencies")
        for key in needed:
            if not sources.get(key):
                raise ProfileError(
                    f"{where}: figure {key!r} has no source; add sources[{key!r}] "
                    "(spec sheet + public URL, or 'measured <date> on <host>')"
                )
        origin = str(data.get("origin", "spec"))
        if origin not in ("spec", "measured", "transferred"):
            raise ProfileError(
                f"{where}: field 'origin' must be 'spec', 'measured' or 'transferred', "
                f"got {origin!r}"
            )
        return cls(
            name=str(name),
            kind=str(kind),
            peak_flops_per_s=peaks,
            host_link=host_link,
            peer_link=peer_link,
            host_price_per_hour=host_price,
            efficiencies=efficiencies,
            sources={str(k): str(v) for k, v in sources.items()},
            origin=origin,
            benchmarks=dict(data.get("benchmarks", {})),
            buffer_overhead_s=buffer_overhead,
            fused_bytes_efficiency=fused_eff,
            conv_efficiency=conv_eff,
            layer_model=layer_model,
            **figures,
        )


def _validate_efficiencies(where: str, effs: Any) -> dict[str, dict[str, float]]:
    if not isinstance(effs, Mapping):
        raise ProfileError(f"{where}: field 'efficiencies' must be an object")
    out = {}
    for c in OP_CLASSES:
        if c not in effs:
            raise ProfileError(
                f"{where}: field 'efficiencies.{c}' is missing; give "
                "{'flops': e, 'bytes': e} with e in (0, 1]"
            )
        e = effs[c]
        if not isinstance(e, Mapping):
            raise ProfileError(f"{where}: field 'efficiencies.{c}' must be an object")
        out[c] = {}
        for part in ("flops", "bytes"):
            v = _num(where, f"efficiencies.{c}.{part}", _require(
                where, e, part, f"efficiencies.{c}.{part}: fraction of peak in (0, 1]"))
            if v > 1.0:
                raise ProfileError(
                    f"{where}: field 'efficiencies.{c}.{part}' = {v} exceeds 1: no device "
                    "runs faster than its peak; raise the peak figure instead"
                )
            out[c][part] = v
    unknown = set(effs) - set(OP_CLASSES)
    if unknown:
        raise ProfileError(
            f"{where}: unknown op class(es) {sorted(unknown)} in 'efficiencies'; "
            f"known: {', '.join(OP_CLASSES)}"
        )
    return out


def jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    return x


def file_devices(data: Any, what: str = "profile file") -> list:
    """The device entries of the profile file form, after checking its header.

    Raises:
      ProfileError: not an object, another format, an unknown version, or no
        list of devices.
    """
    if not isinstance(data, Mapping):
        raise ProfileError(f"{what}: expected a JSON object at the top level")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ProfileError(
            f"{what}: field 'format' is {fmt!r}, expected {FORMAT!r}; "
            "is this a profile file written by `hetpar profile`?"
        )
    version = data.get("version")
    if version != VERSION:
        raise ProfileError(
            f"{what}: unknown version {version!r} (this hetpar reads version "
            f"{VERSION}); regenerate it with `hetpar profile` or upgrade hetpar"
        )
    devs = _require(what, data, "devices", "a list of device profiles")
    if not isinstance(devs, list):
        raise ProfileError(f"{what}: field 'devices' must be a list")
    return devs
