"""Per-equation layer times: a layer's matmul-like equations priced by class.

The roofline (`predict`) prices a layer as one (FLOPs, bytes) pair per op
class. Matmuls and convolutions run far from it, each kind its own way:
cuDNN's forward and data-gradient convolutions (`conv`), weight-gradient
ones whose output is kernel-shaped (`wgrad`), grouped and depthwise ones
(`dw`), input-dilated ones whose kernel is not reversed (`tr`: a
ConvTranspose, run densely over the zero-stuffed input), and dot_general
(`dot`). A tiled GEMM also issues whole tiles, in whole waves over the
device's units, so a small or ragged one does less useful work per issued
FLOP. This model prices each class's equations at their useful fraction of
the issued work, plus the layer's non-matmul traffic after fusion and the
call's fixed costs:

    t = c0 + b buffers
        + sum_c (a_c sum_e flops_e / (peak u_e) + kappa_c calls_c)
        + g nonmatmul_bytes / bandwidth

with every coefficient >= 0, fitted per device on measured layers
(`fit_equation_model`: non-negative least squares on the relative error,
refined in log space). `u_e` is the useful fraction of a tiled GEMM's work
on an accelerator (tile padding x the idle units of the last wave: a
GPU's 64x64x32 tiles over its SMs, a TPU's 8x128x128 over its MXUs); 1 on
a CPU. A class the fit never saw borrows its parent's
coefficients (wgrad, dw, tr -> conv -> dot).

On held-out zoo models (experiments/results/measure_repro, fitted on the
layer sweep and the zoo's train models, scored against times that
reproduce): 8.2% median / 20.7% p90 on an H100, 6.3% / 32.8% on an H200,
against 15-25% median for the calibrated roofline. `hetpar profile --fit`
fits it beside the roofline's efficiencies and keeps it unless, each fit
model left out in turn, it predicts their layers clearly worse
(`with_layer_model`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetpar.core import ProfileError
from hetpar.cost_models._roofline import physical_floor, predict

#: The matmul-like equation classes, and the one each borrows from when the
#: fit saw none of it.
MATMUL_CLASSES = ("dot", "conv", "wgrad", "dw", "tr")
_PARENT = {"wgrad": "conv", "dw": "conv", "tr": "conv", "conv": "dot", "dot": "conv"}

#: A GEMM's tile (M x N x K) for the useful-work fraction.
TILE = (64, 64, 32)


@dataclasses.dataclass(frozen=True)
class MatmulEquation:
    """One matmul-like equation of a layer: its class, how many times a step
    runs it (a scan's body: once per trip), its FLOPs (an unreversed
    input-dilated convolution's over the zero-stuffed input) and its GEMM
    shape (M rows, N columns, K reduction; batch dimensions folded into M)."""

    cls: str
    reps: float
    flops: float
    m: int
    n: int
    k: int


def _matmul(e, reps: float, producers: Mapping) -> MatmulEquation | None:
    from hetpar.passes import eqn_work

    name = e.primitive.name
    if name not in ("dot_general", "conv_general_dilated", "ragged_dot_general"):
        return None
    w = eqn_work(e)
    flops = float(w.flops + w.transcendentals)
    lhs, rhs = (v.aval.shape for v in e.invars[:2])
    if name in ("dot_general", "ragged_dot_general"):
        if name == "dot_general":
            (lc, rc), (lb, rb) = e.params["dimension_numbers"]
        else:  # a mixture of experts' grouped matmul: a GEMM per group
            rdn = e.params["ragged_dot_dimension_numbers"]
            (lc, rc), (lb, rb) = rdn.dot_dimension_numbers
            rb = (*rb, *rdn.rhs_group_dimensions)  # not free: one group per row
        batch = math.prod(lhs[d] for d in lb)
        m = math.prod(s for d, s in enumerate(lhs) if d not in lc and d not in lb)
        n = math.prod(s for d, s in enumerate(rhs) if d not in rc and d not in rb)
        return MatmulEquation("dot", reps, flops, m * batch, n, math.prod(lhs[d] for d in lc))
    p, dn = e.params, e.params["dimension_numbers"]
    out = e.outvars[0].aval.shape
    groups = p["feature_group_count"] * p["batch_group_count"]
    lhs_dil = tuple(p.get("lhs_dilation") or ())
    m = out[dn.out_spec[0]] * math.prod(out[d] for d in dn.out_spec[2:])
    n = rhs[dn.rhs_spec[0]] // max(1, p["feature_group_count"])
    k = rhs[dn.rhs_spec[1]] * math.prod(rhs[d] for d in dn.rhs_spec[2:])
    if groups > 1:
        cls = "dw"
    elif any(d > 1 for d in lhs_dil) and producers.get(id(e.invars[1])) != "rev":
        # Not cuDNN's backward-data pattern (which reverses the kernel): run
        # densely over the zero-stuffed input; as "conv" such layers ran
        # 4-14x slower than fitted on an H100.
        cls, flops = "tr", flops * math.prod(lhs_dil)
    elif dn.lhs_spec[0] != 0 or any(d > 1 for d in (p.get("rhs_dilation") or ())):
        # JAX's weight gradient: the input's batch is the contracted dimension
        # (its "batch" dimension is not the leading one), dilated by the
        # forward's strides. Not "output smaller than the kernel": a ViT's
        # 16x16 patch embedding's forward is that too.
        cls = "wgrad"
    else:
        cls = "conv"
    return MatmulEquation(cls, reps, flops, m, n, k)


def matmul_equations(graph, layer: str) -> tuple[MatmulEquation, ...]:
    """The matmul-like equations of one traced layer (forward, backward and
    update, as the layer holds them)."""
    eqns = [graph.program.eqns[i] for i in graph[layer].eqns]
    from hetpar.passes import leaf_equations  # loads JAX: only when tracing

    out = (_matmul(e, reps, producers) for e, reps, producers in leaf_equations(eqns))
    return tuple(m for m in out if m is not None)


def useful_fraction(m: int, n: int, k: int, units: int, tile: Sequence[int] = TILE) -> float:
    """The useful fraction of a tiled GEMM's issued work: tile padding times
    the busy share of its waves of tiles over `units` parallel units."""
    tm, tn, tk = tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    pad = m * n * k / (math.ceil(m / tm) * tm * math.ceil(n / tn) * tn * math.ceil(k / tk) * tk)
    return pad * tiles / (math.ceil(tiles / units) * units)


def terms(eqs: Sequence[MatmulEquation], work, *, peak: float, bandwidth: float, units: int,
          cpu: bool, tile: Sequence[int] = TILE) -> dict[str, float]:
    """The model's terms of one layer, each in seconds at the device's peak
    (or a count), in the order of `TERMS`.

    Args:
      eqs: the layer's `matmul_equations`.
      work: its `LayerWork` (buffers, unfused bytes by class; the
        after-fusion bytes where known).
      peak: the device's f32 matmul FLOP/s (sets units only: the fit absorbs it).
      bandwidth: its memory bandwidth, bytes/s (likewise).
      units: its parallel units (SMs, MXUs): tiles that run at once.
      cpu: whether the device is a CPU (its GEMMs count whole, not in tiles).
      tile: the (M, N, K) block one unit works on (`device_tiling`).
    """
    out = {"c0": 1.0, "buffers": float(work.buffers)}
    for c in MATMUL_CLASSES:
        out["flops_" + c] = 0.0
        out["calls_" + c] = 0.0
    for e in eqs:
        # A CPU's GEMMs are not issued in waves of tiles: on its layers the
        # fraction made held-out predictions worse (21% median, from 9%).
        u = 1.0 if e.cls == "dw" or cpu else useful_fraction(e.m, e.n, e.k, units, tile)
        out["flops_" + e.cls] += e.reps * e.flops / max(u, 1e-9) / peak
        out["calls_" + e.cls] += e.reps
    unfused = sum(work.bytes_by_class.values()) or 1.0
    moved = unfused if work.fused_bytes is None else max(work.fused_bytes, work.io_bytes)
    # The non-matmul share of what the layer moves after fusion, by its
    # share of the unfused count.
    out["bytes"] = moved * (1 - work.bytes_by_class.get("matmul", 0.0) / unfused) / bandwidth
    return out


#: The model's terms, the names of its coefficients.
TERMS = ("c0", "buffers", *(f"{p}_{c}" for c in MATMUL_CLASSES for p in ("flops", "calls")),
         "bytes")


#: Streaming multiprocessors of the spec-sheet GPUs (public spec sheets:
#: H100 SXM and H200 132, A100 108, L4 58, T4 40).
_SMS = {"h100": 132, "h200": 132, "a100": 108, "l4": 58, "t4": 40}

#: A TPU's matrix units (Cloud TPU system architecture pages: a v4 chip has
#: two TensorCores of four 128x128 MXUs each, a v5e chip one of four). An
#: MXU holds a 128x128 block of the weights (K x N) and streams the rows
#: through, which XLA pads to 8 (a vreg's sublanes).
_MXUS = {"tpu-v4": 8, "tpu-v5e": 4}
TPU_TILE = (8, 128, 128)


def device_tiling(profile) -> tuple[tuple[int, int, int], int]:
    """The (M, N, K) tile one parallel unit of the profile's device works on,
    and how many units run at once: a GPU's 64x64x32 over its spec sheet's
    SMs (132, an H100's, for a GPU without one), a TPU's 8x128x128 over its
    MXUs (4 for a TPU without a spec sheet). Unused on CPUs."""
    if profile.device_class == "tpu":  # one without a spec sheet: a v5e's 4 MXUs
        return TPU_TILE, _MXUS.get(profile.kind, 4)
    return TILE, _SMS.get(profile.kind, 132)


def _terms_of(profile, eqs: Sequence[MatmulEquation], work) -> dict[str, float]:
    """`terms` on the profile's device (its peak, bandwidth and tiling)."""
    tile, units = device_tiling(profile)
    return terms(eqs, work, peak=profile.peak("f32", "matmul"),
                 bandwidth=profile.memory_bandwidth_bytes_per_s, units=units,
                 cpu=profile.device_class == "cpu", tile=tile)


def predict_equations(profile, eqs: Sequence[MatmulEquation], work) -> float | None:
    """Seconds for a layer on `profile`'s device by its fitted equation model;
    None when the profile has none (`DeviceProfile.layer_model`)."""
    coef = profile.layer_model
    if not coef:
        return None
    t = _terms_of(profile, eqs, work)
    return float(sum(coef.get(name, 0.0) * v for name, v in t.items()))


def predict_layer(profile, work, eqs: Sequence[MatmulEquation] = ()) -> float:
    """Seconds for a layer on `profile`'s device: its equation model where it
    has one (`DeviceProfile.layer_model`), else the roofline; never less than
    the time at the device's physical peak."""
    t = predict_equations(profile, eqs, work)
    if t is None:
        return predict(profile, work)
    return float(max(t, physical_floor(profile, work)))


def fit_equation_model(profile, samples: Sequence[tuple[Sequence[MatmulEquation], Any, float]]
                       ) -> dict[str, float]:
    """Coefficients of the equation model for `profile`'s device, fitted on
    `(equations, work, measured seconds)` of measured layers.

    Non-negative least squares on the relative error, then a robust fit of
    log(predicted / measured) from there (the relative-error fit is pulled
    by the few layers it overpredicts most, the log fit by none). A class
    with no equations among the samples borrows its parent's coefficients.

    Raises:
      ProfileError: no samples, or a measured time that is not positive.
    """
    from scipy.optimize import least_squares, nnls

    if not samples:
        raise ProfileError("fit_equation_model: no measured layers to fit on")
    t = np.array([s for *_, s in samples], dtype=float)
    if not np.all(t > 0):
        raise ProfileError("fit_equation_model: every measured time must be positive")
    names = list(TERMS)
    rows = [_terms_of(profile, eqs, work) for eqs, work, _ in samples]
    X = np.array([[r[n] for n in names] for r in rows])
    A = X / t[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    z, _ = nnls(A / scale, np.ones(len(t)), maxiter=100 * X.shape[1])
    x = z / scale
    active = X.max(axis=0) > 0
    sc = np.where(x > 0, x, np.where(active, 1e-3 * np.median(t) / np.where(
        active, X.max(axis=0), 1.0), 1.0))
    sol = least_squares(lambda u: np.log(np.maximum(X @ (u * sc), 1e-12)) - np.log(t),
                        np.where(x > 0, 1.0, 1e-3), bounds=(0, np.inf), loss="soft_l1",
                        f_scale=0.1, x_scale="jac", max_nfev=5000)
    coef = dict(zip(names, (float(v) for v in sol.x * sc)))
    seen = [c for c in MATMUL_CLASSES if active[names.index("flops_" + c)]]
    for c in MATMUL_CLASSES:  # unseen classes borrow their parent's, else any seen
        if c in seen or not seen:
            continue
        p = next((q for q in (_PARENT[c], _PARENT[_PARENT[c]]) if q in seen), seen[0])
        for part in ("flops_", "calls_"):
            coef[part + c] = coef[part + p]
    return coef
