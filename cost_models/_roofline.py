"""Roofline prediction of layer time, with efficiencies calibrated from measurements.

For one layer on one device::

    t = sum over op classes c of max(flops_c / (eff_flops_c * peak),
                                     bytes_c / (eff_bytes_c * bandwidth))
        + launches * launch_overhead

The classes are summed, not maxed together, because a layer's matmuls,
elementwise ops and reductions run as separate kernels one after another.
Efficiencies lie in (0, 1], so no prediction beats the device's peak.
`calibrate` fits them by non-negative least squares on relative error.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging
from hetpar.cost_models._profiles import OP_CLASSES, DeviceProfile
from scipy.optimize import nnls

from hetpar._errors import ProfileError

# Efficiencies below this are treated as a fitting accident, not a device.
_MIN_EFF = 1e-6


@dataclasses.dataclass(frozen=True)
class LayerWork:
    """The work of one layer (or one microbenchmark), counted per op class.

    Attributes:
      flops_by_class: FLOPs per op class (`matmul`, `elementwise`,
        `reduction`, `other`); missing classes count as 0.
      bytes_by_class: bytes read plus written per op class.
      launches: kernels (or executables) launched.
      transcendentals: exp/log/tanh/... evaluations; charged as elementwise
        FLOPs (one each), whose calibrated efficiency absorbs their real cost.
      dtype: the dtype whose peak applies (`f32`, `bf16`); f32 matmul-class
        work uses the profile's `f32_matmul` peak when it has one.
    """

    flops_by_class: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bytes_by_class: Mapping[str, float] = dataclasses.field(default_factory=dict)
    launches: int = 1
    transcendentals: float = 0.0
    dtype: str = "f32"

    def __post_init__(self):
        for what in (self.flops_by_class, self.bytes_by_class):
            unknown = set(what) - set(OP_CLASSES)
            if unknown:
                raise ProfileError(
                    f"LayerWork: unknown op class(es) {sorted(unknown)}; "
                    f"known: {', '.join(OP_CLASSES)}"
                )
            if any(v < 0 for v in what.values()):
                raise ProfileError(f"LayerWork: negative count in {dict(what)}")

    def flops(self, op_class: str) -> float:
        """FLOPs of `op_class`, transcendentals included in `elementwise`."""
        f = float(self.flops_by_class.get(op_class, 0.0))
        if op_class == "elementwise":
            f += float(self.transcendentals)
        return f

    def bytes(self, op_class: str) -> float:
        """Bytes moved by `op_class`."""
        return float(self.bytes_by_class.get(op_class, 0.0))

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form."""
        return dataclasses.asdict(self) | {
            "flops_by_class": dict(self.flops_by_class),
            "bytes_by_class": dict(self.bytes_by_class),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LayerWork:
        """Builds a LayerWork from its JSON form."""
        return cls(**data)


def _terms(profile: DeviceProfile, work: LayerWork) -> tuple[np.ndarray, np.ndarray]:
    """Per-class times at efficiency 1: (compute seconds, memory seconds)."""
    bw = profile.memory_bandwidth_bytes_per_s
    comp = np.array([work.flops(c) / profile.peak(work.dtype, c) for c in OP_CLASSES])
    mem = np.array([work.bytes(c) / bw for c in OP_CLASSES])
    return comp, mem


def predict(profile: DeviceProfile, work: LayerWork) -> float:
    """Predicted seconds for `work` on the device of `profile`.

    Args:
      profile: the device (measured, spec sheet, or transferred).
      work: per-op-class FLOPs and bytes and the launch count.

    Returns:
      Seconds; never less than the time at the device's physical peak.
    """
    comp, mem = _terms(profile, work)
    ef = np.array([profile.efficiencies[c]["flops"] for c in OP_CLASSES])
    eb = np.array([profile.efficiencies[c]["bytes"] for c in OP_CLASSES])
    t = np.maximum(comp / ef, mem / eb).sum()
    return float(t + work.launches * profile.launch_overhead_s)


def calibrate(
    profile: DeviceProfile,
    samples: Sequence[tuple[LayerWork, float]],
    *,
    fit_overhead: bool = False,
    iterations: int = 50,
) -> DeviceProfile:
    """Fits the efficiencies (and optionally the launch overhead) to measurements.

    The model is linear in the inverse efficiencies once it is known which
    side of each max() is active; we alternate between fixing the active
    sides and solving non-negative least squares on relative error, from a
    few starting points, and keep the best fit. Inverse efficiencies are
    constrained to >= 1, so the fitted efficiencies lie in (0, 1]. A class
    whose compute (or memory) side is never active in the samples keeps its
    previous efficiency: the data say nothing about it.

    Args:
      profile: the device; its peaks and bandwidth stay fixed.
      samples: `(work, measured_seconds)` pairs on that device.
      fit_overhead: also fit `launch_overhead_s` (needs varied launch counts).
      iterations: active-set rounds per starting point.

    Returns:
      A new profile with fitted efficiencies and updated sources.

    Raises:
      ProfileError: no samples, or a non-positive time.
    """
    if not samples:
        raise ProfileError("calibrate: no samples; measure some layers first")
    times = np.array([float(t) for _, t in samples])
    if np.any(~np.isfinite(times)) or np.any(times <= 0):
        raise ProfileError("calibrate: every measured time must be a positive number")
    comp, mem = (np.array(a) for a in zip(*(_terms(profile, w) for w, _ in samples), strict=True))
    launches = np.array([float(w.launches) for w, _ in samples])
    w = 1.0 / times  # relative error: times span orders of magnitude
    n_cls = len(OP_CLASSES)
    u0 = np.array([1.0 / profile.efficiencies[c]["flops"] for c in OP_CLASSES])
    v0 = np.array([1.0 / profile.efficiencies[c]["bytes"] for c in OP_CLASSES])
    o0 = profile.launch_overhead_s

    def model(u, v, o):
        return np.maximum(comp * u, mem * v).sum(axis=1) + launches * o

    def loss(u, v, o):
        return float(np.sum(((model(u, v, o) - times) * w) ** 2))

    best = (loss(u0, v0, o0), u0, v0, o0)
    for start in (u0, np.ones(n_cls), np.full(n_cls, 10.0), np.full(n_cls, 100.0)):
        u, v, o = start.copy(), start.copy(), o0
        for _ in range(iterations):
            comp_side = comp * u >= mem * v
            a_cols = comp * comp_side  # coefficient of u_c
            b_cols = mem * ~comp_side  # coefficient of v_c
            cols, fixed_rhs, slots = [], np.zeros_like(times), []
            for kind, mat, params in (("u", a_cols, u), ("v", b_cols, v)):
                for c in range(n_cls):
                    col = mat[:, c]
                    if np.any(col * w > 1e-12):
                        # u = 1 + u' with u' >= 0 keeps the efficiency <= 1.
                        fixed_rhs += col
                        cols.append(col)
                        slots.append((kind, c))
                    else:
                        fixed_rhs += col * params[c]
            if fit_overhead:
                cols.append(launches)
                slots.append(("o", 0))
            else:
                fixed_rhs += launches * o
            if not cols:
                break
            design = np.stack(cols, axis=1) * w[:, None]
            rhs = (times - fixed_rhs) * w
            x, _ = nnls(design, rhs, maxiter=50 * design.shape[1])
            new_u, new_v, new_o = u.copy(), v.copy(), o
            for (kind, c), val in zip(slots, x, strict=True):
                if kind == "u":
                    new_u[c] = 1.0 + val
                elif kind == "v":
                    new_v[c] = 1.0 + val
                else:
                    new_o = val
            done = (
                np.allclose(new_u, u, rtol=1e-10)
                and np.allclose(new_v, v, rtol=1e-10)
                and np.isclose(new_o, o, rtol=1e-10)
            )
            u, v, o = new_u, new_v, new_o
            if done:
                break
        cand = (loss(u, v, o), u, v, o)
        if cand[0] < best[0]:
            best = cand
    final_loss, u, v, o = best
    effs = {
        c: {
            "flops": float(np.clip(1.0 / u[i], _MIN_EFF, 1.0)),
            "bytes": float(np.clip(1.0 / v[i], _MIN_EFF, 1.0)),
        }
        for i, c in enumerate(OP_CLASSES)
    }
    rel = np.abs(model(u, v, o) - times) / times
    logging.debug(
        "calibrated %s on %d samples: median |error| %.1f%%, max %.1f%%",
        profile.name, len(samples), 100 * np.median(rel), 100 * np.max(rel),
    )
    today = datetime.date.today().isoformat()
    sources = dict(profile.sources)
    sources["efficiencies"] = (
        f"calibrated {today} by non-negative least squares on {len(samples)} measured "
        f"samples (median |error| {100 * np.median(rel):.1f}%)"
    )
    changes: dict[str, Any] = {"efficiencies": effs, "sources": sources}
    if fit_overhead:
        changes["launch_overhead_s"] = float(o)
        sources["launch_overhead_s"] = f"fitted {today} with the efficiencies"
    return profile.replace(**changes)


def transfer_calibration(measured: DeviceProfile, spec_profile: DeviceProfile) -> DeviceProfile:
    """A spec-sheet profile with the calibration of a measured sibling.

    A device that is not present keeps its own peaks, bandwidth, memory,
    price and power from its spec sheet, and borrows what only measurement
    tells: the efficiencies per op class and the launch overhead (which
    depends on the runtime and host as much as on the chip). Siblings must
    share a class (cpu, gpu, tpu): see `nearest_sibling`.

    Raises:
      ProfileError: the two profiles are of different classes.
    """
    if measured.device_class != spec_profile.device_class:
        raise ProfileError(
            f"cannot transfer the calibration of {measured.name!r} "
            f"({measured.device_class}) to {spec_profile.name!r} "
            f"({spec_profile.device_class}): siblings must be of the same class"
        )
    sources = dict(spec_profile.sources)
    sources["efficiencies"] = f"transferred from {measured.name!r}: " + measured.sources.get(
        "efficiencies", "measured"
    )
    sources["launch_overhead_s"] = f"transferred from {measured.name!r}: " + measured.sources.get(
        "launch_overhead_s", "measured"
    )
    return spec_profile.replace(
        efficiencies={c: dict(e) for c, e in measured.efficiencies.items()},
        launch_overhead_s=measured.launch_overhead_s,
        sources=sources,
        origin="transferred",
    )
