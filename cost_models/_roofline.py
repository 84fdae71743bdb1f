"""Roofline prediction of layer time, with efficiencies calibrated from measurements.

For one layer on one device::

    t = sum over op classes c of max(flops_c / (eff_flops_c * peak),
                                     bytes_c / (eff_bytes_c * bandwidth))
        + launches * launch_overhead + buffers * buffer_overhead

and never less than `max(flops / peak, io_bytes / bandwidth)`.

When the layer's after-fusion traffic is known (`fused_bytes`: XLA's
`bytes accessed` of the layer compiled for the device), it replaces the
unfused per-class byte counts, which overstate what fused kernels move:
it is shared among the classes in proportion to their unfused bytes and
charged at one efficiency of its own (`fused_bytes_efficiency`, <= 1
against the peak bandwidth, since fused bytes are real traffic)::

    bytes_c = max(fused_bytes, io_bytes) * unfused_bytes_c / sum(unfused_bytes)

The matmul class's FLOPs may hold convolutions (`conv_flops`); a profile
calibrated with `calibrate(fit_conv=True)` charges those at an efficiency
of their own (`conv_efficiency`: cuDNN's convolutions and cuBLAS's GEMMs do
not reach the same fraction of the peak), so the matmul compute side is::

    (flops_matmul - conv_flops) / (eff_flops_matmul * peak) + conv_flops / (conv_eff * peak)

The classes are summed, not maxed together, because a layer's matmuls,
elementwise ops and reductions run as separate kernels one after another.
`buffers` counts the arrays a call takes and returns: on a GPU nearly every
layer stage costs 0.1-0.2 ms even with almost no work, and that floor grows
with the number of parameter and optimizer-state leaves it passes.
Efficiencies lie in (0, 1] and `io_bytes` (the call's inputs and outputs,
read or written at least once) bounds the memory side, so no prediction
beats the device's peak. `calibrate` fits the efficiencies and overheads by
non-negative least squares on relative error, then refines them in log
space (a robust fit of the ratio predicted / measured).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from hetpar.core import ProfileError
from hetpar.cost_models._profile import OP_CLASSES, DeviceProfile

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
      buffers: input plus output arrays of the call (0: unknown); each costs
        the profile's `buffer_overhead_s`.
      io_bytes: bytes of those arrays; every one is read or written at
        least once, so `io_bytes / bandwidth` is a lower bound on the time.
      fused_bytes: bytes the layer moves after XLA's fusion on the device
        it runs on (None: unknown, e.g. a spec-sheet device that is not
        present); when known the predictor uses it for the bytes term.
      conv_flops: the part of the matmul class's FLOPs that are
        convolutions (`conv_general_dilated`); 0: none, or not counted.
    """

    flops_by_class: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bytes_by_class: Mapping[str, float] = dataclasses.field(default_factory=dict)
    launches: int = 1
    transcendentals: float = 0.0
    dtype: str = "f32"
    buffers: int = 0
    io_bytes: float = 0.0
    fused_bytes: float | None = None
    conv_flops: float = 0.0

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
        if self.buffers < 0 or self.io_bytes < 0:
            raise ProfileError(
                f"LayerWork: negative buffers ({self.buffers}) or io_bytes ({self.io_bytes})")
        if self.fused_bytes is not None and not self.fused_bytes >= 0:
            raise ProfileError(f"LayerWork: fused_bytes must be >= 0, got {self.fused_bytes}")
        matmul = float(self.flops_by_class.get("matmul", 0.0))
        if not 0.0 <= self.conv_flops <= matmul * (1 + 1e-9):
            raise ProfileError(
                f"LayerWork: conv_flops ({self.conv_flops}) must lie in [0, matmul FLOPs "
                f"({matmul})]: convolutions are part of the matmul class")

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


def fused_by_class(work: LayerWork) -> np.ndarray | None:
    """The after-fusion bytes shared among the classes (None: not known).

    Shares follow the unfused byte counts; no less than `io_bytes` in all
    (XLA leaves custom calls' operands out on some backends).
    """
    if work.fused_bytes is None:
        return None
    total = max(float(work.fused_bytes), float(work.io_bytes))
    unfused = np.array([work.bytes(c) for c in OP_CLASSES])
    if unfused.sum() > 0:
        return total * unfused / unfused.sum()
    return total * np.array([c == "other" for c in OP_CLASSES], dtype=float)


def _conv_time(profile: DeviceProfile, work: LayerWork) -> float:
    """Seconds of the layer's convolution FLOPs at the matmul peak (part of `_terms`' matmul)."""
    return work.conv_flops / profile.peak(work.dtype, "matmul")


def _compute_times(profile: DeviceProfile, work: LayerWork, comp: np.ndarray) -> np.ndarray:
    """Per-class compute seconds at the profile's FLOP efficiencies (convolutions at theirs).

    `comp`: the compute seconds at peak (`_terms`).
    """
    ef = np.array([profile.efficiencies[c]["flops"] for c in OP_CLASSES])
    t = comp / ef
    conv = _conv_time(profile, work)
    if conv > 0 and profile.conv_efficiency is not None:
        m = OP_CLASSES.index("matmul")
        t[m] = (comp[m] - conv) / ef[m] + conv / profile.conv_efficiency
    return t


#: Device classes whose roofline prices after-fusion bytes where a layer has
#: them. Measured on the H200 host (experiments/results/accuracy_h200_v2.md):
#: they cut the GPU's held-out error (28.8% -> 25.6% median) but raised the
#: CPU's (24.8% -> 43.5%: XLA:CPU's byte count says little about its
#: loop-nest time), so on a CPU the roofline keeps hetpar's unfused count.
#: The per-equation layer model uses them on every class: its bytes term is
#: the non-matmul share of the fused traffic, and on the two hosts' CPUs it
#: predicted held-out layers at 10.9% / 18.2% median with them, 34.5% /
#: 39.8% without (experiments/results/layer_model).
FUSED_BYTES_CLASSES = frozenset({"gpu", "tpu"})


def _terms(profile: DeviceProfile, work: LayerWork) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class times at efficiency 1: (compute, unfused memory, fused memory) seconds.

    Exactly one of the two memory arrays is non-zero: fused when known and
    the device's class prices them (`FUSED_BYTES_CLASSES`).
    """
    bw = profile.memory_bandwidth_bytes_per_s
    comp = np.array([work.flops(c) / profile.peak(work.dtype, c) for c in OP_CLASSES])
    fused = fused_by_class(work) if profile.device_class in FUSED_BYTES_CLASSES else None
    if fused is None:
        return comp, np.array([work.bytes(c) / bw for c in OP_CLASSES]), np.zeros(len(comp))
    return comp, np.zeros(len(comp)), fused / bw


def physical_floor(profile: DeviceProfile, work: LayerWork) -> float:
    """Seconds `work` takes at the device's peak FLOP/s and bandwidth, no less."""
    comp, mem, fused = _terms(profile, work)
    io = work.io_bytes / profile.memory_bandwidth_bytes_per_s
    return float(max(comp.sum(), mem.max(initial=0.0), fused.sum(), io))


def predict(profile: DeviceProfile, work: LayerWork) -> float:
    """Predicted seconds for `work` on the device of `profile`.

    Args:
      profile: the device (measured, spec sheet, or transferred).
      work: per-op-class FLOPs and bytes (after fusion when `fused_bytes`
        is known), the launch and buffer counts.

    Returns:
      Seconds; never less than the time at the device's physical peak.
    """
    comp, mem, fused = _terms(profile, work)
    eb = np.array([profile.efficiencies[c]["bytes"] for c in OP_CLASSES])
    comp = _compute_times(profile, work, comp)
    t = np.maximum(np.maximum(comp, mem / eb), fused / profile.fused_efficiency()).sum()
    t += work.launches * profile.launch_overhead_s + work.buffers * profile.buffer_overhead_s
    return float(max(t, physical_floor(profile, work)))


def calibrate(
    profile: DeviceProfile,
    samples: Sequence[tuple[LayerWork, float]],
    *,
    fit_overhead: bool = False,
    iterations: int = 50,
    log_refine: bool = True,
    fit_conv: bool = False,
) -> DeviceProfile:
    """Fits the efficiencies (and optionally the per-call overheads) to measurements.

    The model is linear in the inverse efficiencies once it is known which
    side of each max() is active; we alternate between fixing the active
    sides and solving non-negative least squares on relative error, from a
    few starting points, and keep the best fit. Then (`log_refine`) a robust
    least-squares fit of log(predicted / measured) starts from that best
    fit: relative-error least squares is pulled by the few layers it
    overpredicts most, the log fit by none. Inverse efficiencies are
    constrained to >= 1, so the fitted efficiencies lie in (0, 1]. Samples
    whose after-fusion bytes are known (`LayerWork.fused_bytes`) fit one
    more efficiency, `fused_bytes_efficiency`, in place of the per-class
    bytes efficiencies. A class
    whose compute (or memory) side is never active in the samples keeps its
    previous efficiency: the data say nothing about it.

    Args:
      profile: the device; its peaks and bandwidth stay fixed.
      samples: `(work, measured_seconds)` pairs on that device.
      fit_overhead: also fit `launch_overhead_s` (the fixed cost per call:
        a layer's stage is one launch) and, when the samples count buffers,
        `buffer_overhead_s` (the cost per input or output array).
      iterations: active-set rounds per starting point.
      log_refine: refine in log space after the least-squares fit.
      fit_conv: also fit `conv_efficiency`, the efficiency of the samples'
        convolution FLOPs (`LayerWork.conv_flops`), apart from the matmul
        class's (dot_general) one; off, convolutions share the matmul
        efficiency, or the profile's `conv_efficiency` where it has one.

    Returns:
      A new profile with fitted efficiencies and updated sources.

    Raises:
      ProfileError: no samples, or a non-positive time.
    """
    data = _Samples.of(profile, samples, fit_overhead, fit_conv)
    n_cls = len(OP_CLASSES)
    u0 = np.array([1.0 / profile.efficiencies[c]["flops"] for c in OP_CLASSES])
    v0 = np.array([1.0 / profile.efficiencies[c]["bytes"] for c in OP_CLASSES])
    first: _Params = (u0, v0, 1.0 / profile.fused_efficiency(), profile.launch_overhead_s,
                      profile.buffer_overhead_s, 1.0 / profile.conv_flops_efficiency())
    best = (data.loss(first), first)
    for start in (u0, np.ones(n_cls), np.full(n_cls, 10.0), np.full(n_cls, 100.0)):
        params = _active_set_fit(data, start, first[3], first[4], first[5], iterations)
        loss = data.loss(params)
        if loss < best[0]:
            best = (loss, params)
    params = best[1]
    if log_refine:
        params = _log_refine(data, params)
    return _fitted_profile(profile, data, params, log_refine)


#: Inverse efficiencies per class of flops (u) and of bytes (v), the inverse
#: fused-bytes efficiency (f), the launch (o) and buffer (b) overheads, the
#: inverse convolution efficiency (c: used only where `_Samples.fit_conv`,
#: else convolutions run at the matmul class's u).
_Params = tuple[np.ndarray, np.ndarray, float, float, float, float]

#: Index of the matmul class, whose compute side holds the convolutions.
_MM = OP_CLASSES.index("matmul")


@dataclasses.dataclass(frozen=True)
class _Samples:
    """Measured samples as arrays: per-class times at efficiency 1 (`_terms`) and counts."""

    times: np.ndarray
    comp: np.ndarray  # (samples, classes) seconds of compute at peak
    conv: np.ndarray  # (samples,) seconds of convolution at peak (part of comp's matmul)
    mem: np.ndarray  # unfused memory at peak bandwidth
    fmem: np.ndarray  # fused memory at peak bandwidth
    launches: np.ndarray
    buffers: np.ndarray
    floor: np.ndarray  # physical_floor of each sample
    fit_overhead: bool
    fit_buffers: bool
    fit_conv: bool = False
    conv_fixed: float | None = None  # a fixed conv_efficiency's inverse (not fitted)

    @classmethod
    def of(cls, profile: DeviceProfile, samples: Sequence[tuple[LayerWork, float]],
           fit_overhead: bool, fit_conv: bool = False) -> _Samples:
        if not samples:
            raise ProfileError("calibrate: no samples; measure some layers first")
        times = np.array([float(t) for _, t in samples])
        if np.any(~np.isfinite(times)) or np.any(times <= 0):
            raise ProfileError("calibrate: every measured time must be a positive number")
        comp, mem, fmem = (np.array(a) for a in zip(*(_terms(profile, w) for w, _ in samples),
                                                   strict=True))
        buffers = np.array([float(w.buffers) for w, _ in samples])
        conv = np.array([_conv_time(profile, w) for w, _ in samples])
        fitted = fit_conv and bool(np.any(conv > 0))
        fixed = None if fitted or profile.conv_efficiency is None else 1.0 / profile.conv_efficiency
        return cls(
            times=times, comp=comp, conv=conv, mem=mem, fmem=fmem,
            launches=np.array([float(w.launches) for w, _ in samples]),
            buffers=buffers,
            floor=np.array([physical_floor(profile, w) for w, _ in samples]),
            fit_overhead=fit_overhead,
            fit_buffers=fit_overhead and bool(np.any(buffers > 0)),
            fit_conv=fitted, conv_fixed=fixed,
        )

    @property
    def weights(self) -> np.ndarray:
        """1 / time: the fit is on relative error, as times span orders of magnitude."""
        return 1.0 / self.times

    def conv_inverse(self, params: _Params) -> float | None:
        """The convolutions' inverse efficiency: fitted, fixed by the profile, or None (u's)."""
        return params[5] if self.fit_conv else self.conv_fixed

    def compute(self, params: _Params) -> np.ndarray:
        """(samples, classes) compute seconds at these inverse efficiencies."""
        comp = self.comp * params[0]
        c = self.conv_inverse(params)
        if c is not None:
            comp[:, _MM] += self.conv * (c - params[0][_MM])
        return comp

    def model(self, params: _Params) -> np.ndarray:
        """Predicted seconds of every sample (`predict` with these parameters)."""
        _, v, f, o, b, _ = params
        side = np.maximum(np.maximum(self.compute(params), self.mem * v), self.fmem * f)
        t = side.sum(axis=1) + self.launches * o + self.buffers * b
        return np.maximum(t, self.floor)

    def loss(self, params: _Params) -> float:
        """Sum of squared relative errors."""
        return float(np.sum(((self.model(params) - self.times) * self.weights) ** 2))


def _active_set_fit(data: _Samples, start: np.ndarray, o0: float, b0: float, c0: float,
                    iterations: int) -> _Params:
    """From one starting point, alternates fixing the active sides and NNLS until it settles."""
    params: _Params = (start.copy(), start.copy(), float(start[0]), o0, b0,
                       float(start[_MM]) if data.fit_conv else c0)
    for _ in range(iterations):
        new = _nnls_round(data, params)
        if new is None:
            break
        done = all(np.allclose(a, b, rtol=1e-10) for a, b in zip(new, params, strict=True))
        params = new
        if done:
            break
    return params


def _nnls_round(data: _Samples, params: _Params) -> _Params | None:
    """One active-set round: which side of each max() is active, then NNLS on the free terms.

    Returns None when no term is free (nothing to fit).
    """
    from scipy.optimize import nnls  # scipy loads only when a fit runs

    u, v, f, o, b, c = params
    comp, mem, fmem, w = data.comp, data.mem, data.fmem, data.weights
    n_cls = comp.shape[1]
    comp_side = data.compute(params) >= np.maximum(mem * v, fmem * f)
    fused_side = ~comp_side & (fmem * f >= mem * v) & (fmem > 0)
    mem_side = ~comp_side & ~fused_side
    cols, fixed_rhs, slots = [], np.zeros_like(data.times), []
    conv_inv = data.conv_inverse(params)
    if conv_inv is not None:  # the convolutions leave u's matmul column
        comp = comp.copy()
        comp[:, _MM] -= data.conv
        conv_col = data.conv * comp_side[:, _MM]
        if data.fit_conv and np.any(conv_col * w > 1e-12):
            fixed_rhs += conv_col
            cols.append(conv_col)
            slots.append(("c", 0))
        else:
            fixed_rhs += conv_col * conv_inv
    for kind, mat, current in (("u", comp * comp_side, u), ("v", mem * mem_side, v)):
        for c in range(n_cls):
            col = mat[:, c]
            if np.any(col * w > 1e-12):
                # u = 1 + u' with u' >= 0 keeps the efficiency <= 1.
                fixed_rhs += col
                cols.append(col)
                slots.append((kind, c))
            else:
                fixed_rhs += col * current[c]
    fcol = (fmem * fused_side).sum(axis=1)  # one efficiency for all fused bytes
    if np.any(fcol * w > 1e-12):
        fixed_rhs += fcol
        cols.append(fcol)
        slots.append(("f", 0))
    if data.fit_overhead:
        cols.append(data.launches)
        slots.append(("o", 0))
    else:
        fixed_rhs += data.launches * o
    if data.fit_buffers:
        cols.append(data.buffers)
        slots.append(("b", 0))
    else:
        fixed_rhs += data.buffers * b
    if not cols:
        return None
    design = np.stack(cols, axis=1) * w[:, None]
    rhs = (data.times - fixed_rhs) * w
    x, _ = nnls(design, rhs, maxiter=50 * design.shape[1])
    new_u, new_v, new_f, new_o, new_b, new_c = u.copy(), v.copy(), f, o, b, c
    for (kind, i), val in zip(slots, x, strict=True):
        if kind == "u":
            new_u[i] = 1.0 + val
        elif kind == "v":
            new_v[i] = 1.0 + val
        elif kind == "f":
            new_f = 1.0 + val
        elif kind == "c":
            new_c = 1.0 + val
        elif kind == "o":
            new_o = val
        else:
            new_b = val
    return new_u, new_v, new_f, new_o, new_b, new_c


def _fitted_profile(profile: DeviceProfile, data: _Samples, params: _Params,
                    log_refined: bool) -> DeviceProfile:
    """`profile` with the fitted figures, and sources that say how they were fitted."""
    u, v, f, o, b, c = params
    effs = {
        c: {
            "flops": float(np.clip(1.0 / u[i], _MIN_EFF, 1.0)),
            "bytes": float(np.clip(1.0 / v[i], _MIN_EFF, 1.0)),
        }
        for i, c in enumerate(OP_CLASSES)
    }
    rel = np.abs(data.model(params) - data.times) / data.times
    logging.debug(
        "calibrated %s on %d samples: median |error| %.1f%%, max %.1f%%",
        profile.name, len(data.times), 100 * np.median(rel), 100 * np.max(rel),
    )
    today = datetime.date.today().isoformat()
    sources = dict(profile.sources)
    how = "non-negative least squares" + (", refined in log space," if log_refined else "")
    sources["efficiencies"] = (
        f"calibrated {today} by {how} on {len(data.times)} measured "
        f"samples (median |error| {100 * np.median(rel):.1f}%)"
    )
    changes: dict[str, Any] = {"efficiencies": effs, "sources": sources}
    comp, mem, fmem = data.compute(params), data.mem, data.fmem
    n_fused = int(np.sum(fmem.sum(axis=1) > 0))
    fused_active = (fmem * f >= np.maximum(comp, mem * v)) & (fmem > 0)
    if n_fused and np.any(fused_active):  # else the data say nothing about it
        changes["fused_bytes_efficiency"] = float(np.clip(1.0 / f, _MIN_EFF, 1.0))
        sources["fused_bytes_efficiency"] = (
            f"calibrated {today} with the efficiencies ({n_fused} samples with fused bytes)")
    conv_active = (data.conv > 0) & (comp[:, _MM] >= np.maximum(mem[:, _MM] * v[_MM],
                                                               fmem[:, _MM] * f))
    if data.fit_conv and np.any(conv_active):  # else the data say nothing about it
        changes["conv_efficiency"] = float(np.clip(1.0 / c, _MIN_EFF, 1.0))
        sources["conv_efficiency"] = (
            f"calibrated {today} with the efficiencies ({int(np.sum(data.conv > 0))} samples "
            "with convolutions)")
    if data.fit_overhead:
        changes["launch_overhead_s"] = float(o)
        sources["launch_overhead_s"] = f"fitted {today} with the efficiencies"
    if data.fit_buffers:
        changes["buffer_overhead_s"] = float(b)
        sources["buffer_overhead_s"] = f"fitted {today} with the efficiencies"
    return profile.replace(**changes)


def _log_refine(data: _Samples, params: _Params) -> _Params:
    """Robust least squares on log(model / times) from `params`; keeps the bounds."""
    from scipy.optimize import least_squares

    u, v, f, o, b, c = params
    n = len(u)
    x0 = np.concatenate([u, v, [f, o, b, c]])
    free = np.array([True] * (2 * n + 1) + [data.fit_overhead, data.fit_buffers, data.fit_conv])
    lo = np.concatenate([np.ones(2 * n + 1), [0.0, 0.0, 1.0]])
    # Overheads in microseconds keep the variables on comparable scales.
    scale = np.concatenate([np.ones(2 * n + 1), [1e-6, 1e-6, 1.0]])

    def unpack(z) -> _Params:
        x = x0.copy()
        x[free] = z * scale[free]
        return x[:n], x[n:2 * n], x[2 * n], x[2 * n + 1], x[2 * n + 2], x[2 * n + 3]

    def resid(z):
        return np.log(data.model(unpack(z))) - np.log(data.times)

    z0 = np.maximum(x0[free] / scale[free], lo[free] / scale[free])
    try:
        res = least_squares(resid, z0, bounds=(lo[free] / scale[free], np.inf),
                            loss="soft_l1", f_scale=0.1, max_nfev=2000)
    except (ValueError, np.linalg.LinAlgError) as e:  # degenerate data: keep the LS fit
        logging.debug("log refinement failed: %s", e)
        return params
    z = res.x * scale[free]
    # least_squares keeps strictly inside its bounds: snap what sits on one.
    z = np.where(z <= lo[free] * (1 + 1e-6) + 1e-15, lo[free], z) / scale[free]
    return unpack(z)
