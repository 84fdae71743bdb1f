"""A present device's roofline efficiencies, fitted on measured layers (`hetpar profile --fit`).

`hetpar profile`'s microbenchmarks time a large matmul and a large copy:
peak-like figures. Training layers run far from them (launch-bound small
layers, convolutions, fusions), and the split between a layer's compute and
memory time decides how its time carries to another card: from one card's
microbenchmarks the roofline put the zoo's H100/H200 step ratio at 1.2-1.4,
where the cards measured 0.8-1.1 (they share the GH100 die); fitted on the
measured layers of one card, it says 1.0-1.1 (experiments/results/cross_card/).

So `fit_on_layers` measures every layer of a few traced models on a device
(each layer alone, the lower quartile of up to k runs, cached on disk), counts its work (with
XLA's after-fusion bytes on GPUs and TPUs), and fits the efficiencies and
per-call overheads (`calibrate(fit_overhead=True)`). A spec-sheet sibling
borrows them (`transfer_calibration`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from hetpar.core import ProfileError, seconds
from hetpar.cost_models._equation_model import (
    fit_equation_model,
    matmul_equations,
    predict_layer,
)
from hetpar.cost_models._layer_timing import (
    INTERLEAVED_PLATFORMS,
    LAYER_RUNS,
    layer_key,
    measure_layers,
)
from hetpar.cost_models._layer_work import graph_layer_work, layer_fused_bytes
from hetpar.cost_models._profile import DeviceProfile
from hetpar.cost_models._roofline import FUSED_BYTES_CLASSES, LayerWork, calibrate, predict


def layer_samples(graphs: Sequence, device, *, k: int = LAYER_RUNS,
                  progress: Callable[[str], None] | None = None
                  ) -> list[tuple[str, str, LayerWork, float]]:
    """(graph name, layer, work, measured seconds) of every layer of `graphs` on `device`.

    Args:
      graphs: `(name, LayerGraph)` pairs.
      device: a present JAX device.
      k: timed runs per layer.
      progress: called with a line per layer.

    Each work carries XLA's after-fusion bytes for the device's backend
    (where the compile gives them): the layer model prices them on every
    class, the roofline where `FUSED_BYTES_CLASSES` says.
    """
    out = []
    for name, graph in graphs:
        if progress:
            progress(f"timing {len(graph.layers)} layers of {name} on {device}")
        # A model's layers timed together (interleaved on a CPU: `measure_layers`).
        timings = measure_layers(graph, list(graph.layers), device, k=k)
        for layer, timing in zip(graph.layers, timings, strict=True):
            work = graph_layer_work(graph, layer)
            nbytes = layer_fused_bytes(graph, layer, device.platform)
            if nbytes is not None:
                work = dataclasses.replace(work, fused_bytes=nbytes)
            t = timing.typical_s
            out.append((name, layer, work, t))
            if progress:
                progress(f"{name}/{layer} on {device}: {seconds(t)}")
    return out


def fit_on_layers(profile: DeviceProfile, device, graphs: Sequence, *,
                  k: int = LAYER_RUNS,
                  progress: Callable[[str], None] | None = None,
                  layer_model_only: Sequence = ()) -> DeviceProfile:
    """`profile` with efficiencies and overheads fitted on `graphs`' layers measured on `device`.

    Its `sources["efficiencies"]` says what it was fitted on and how well
    (the fitted layers' median error).

    Args:
      layer_model_only: more `(name, LayerGraph)` pairs whose layers the
        per-equation layer model is fitted on too, never the roofline (a
        CPU's transposed convolutions: a class of their own there, which
        would drag the roofline's shared convolution efficiency).

    Raises:
      ProfileError: no layers to fit on (in `graphs`).
    """
    samples = layer_samples(graphs, device, k=k, progress=progress)
    if not samples:
        raise ProfileError("fit_on_layers: the models given have no layers to measure")
    extra = layer_samples(layer_model_only, device, k=k, progress=progress)
    names = ", ".join(sorted({n for n, *_ in samples}))
    what = f"{len(samples)} layers of {names} measured alone"
    fitted = fit_samples(profile, [(w, t) for _, _, w, t in samples], what=what)
    by_name = {**dict(graphs), **dict(layer_model_only)}

    def with_equations(rows):
        return [(n, matmul_equations(by_name[n], layer), w, t) for n, layer, w, t in rows]

    if extra:
        what += (f"; the layer model also on {len(extra)} of "
                 f"{', '.join(sorted({n for n, *_ in extra}))}")
    out = with_layer_model(profile, fitted, with_equations(samples), what=what,
                           extra=with_equations(extra))
    # What the fit saw, kept in the file, so a maintainer can audit it or
    # refit offline without the device (the after-fusion bytes need a compile
    # for it); `key`, the layer's fingerprint (`layer_key`), says which
    # configuration was traced, `timing` how it was timed (`measure_layers`).
    timing = "interleaved" if device.platform in INTERLEAVED_PLATFORMS else "back to back"
    return out.replace(benchmarks={**out.benchmarks, "fit_layers": [
        {"model": n, "layer": layer, "key": layer_key(by_name[n], layer), "measured_s": t,
         "fused_bytes": w.fused_bytes, "timing": timing}
        for n, layer, w, t in [*samples, *extra]]})


#: Layers faster than this are left out of the choice between the models
#: (their times are mostly fixed costs, and noise).
CHOICE_FLOOR_S = 100e-6

#: The per-equation model is kept unless, left-out model by model, its median
#: error exceeds the roofline's by more than this factor. On every device
#: measured (H100, H200, their hosts' CPUs) it predicted held-out models'
#: layers 2-5x better, while the left-out comparison on the five fit models
#: came within a point either way (H100: 18% vs 17% in one run, 19% vs 20%
#: in another; experiments/results/layer_model): the guard is for a device
#: unlike those (a 2-core laptop CPU: 44% vs 30%), not a coin flip.
KEEP_MARGIN = 1.1


def with_layer_model(profile: DeviceProfile, fitted: DeviceProfile, samples: Sequence,
                     *, what: str = "measured layers", extra: Sequence = ()) -> DeviceProfile:
    """`fitted` (the roofline fitted on `samples`) with the per-equation layer
    model fitted on them too (`DeviceProfile.layer_model`), unless it predicts
    clearly worse: each model's layers held out in turn, both fitted on the
    rest (the roofline from `profile`), and the held-out layers' median
    errors compared (`KEEP_MARGIN`). Its `sources["layer_model"]` says how
    each did.

    Args:
      samples: `(model name, matmul_equations, LayerWork, seconds)` per layer.
      extra: more such layers the layer model is always fitted on, neither
        left out nor scored, nor given to the roofline.
    """
    models = sorted({m for m, *_ in samples})
    if len(models) < 2:
        return fitted  # nothing to hold out: no evidence for either
    eq_err, roof_err = [], []
    for m in models:
        train = [s for s in samples if s[0] != m]
        test = [s for s in samples if s[0] == m and s[3] >= CHOICE_FLOOR_S] or [
            s for s in samples if s[0] == m]
        roof = fit_samples(profile, [(w, t) for _, _, w, t in train])
        eq = roof.replace(layer_model=fit_equation_model(
            roof, [(e, w, t) for _, e, w, t in [*train, *extra]]))
        for _, e, w, t in test:
            roof_err.append(abs(predict(roof, w) / t - 1))
            eq_err.append(abs(predict_layer(eq, w, e) / t - 1))
    eq_med, roof_med = float(np.median(eq_err)), float(np.median(roof_err))
    verdict = (f"each of {len(models)} models left out: median {eq_med:.0%} off, the "
               f"roofline {roof_med:.0%}")
    sources = dict(fitted.sources)
    if eq_med > KEEP_MARGIN * roof_med:
        sources["layer_model"] = f"not used (fitted on {what}; {verdict})"
        return fitted.replace(sources=sources, layer_model=None)
    sources["layer_model"] = f"fitted on {what}; {verdict}"
    coef = fit_equation_model(fitted, [(e, w, t) for _, e, w, t in [*samples, *extra]])
    return fitted.replace(layer_model=coef, sources=sources)


def fit_samples(profile: DeviceProfile, samples: Sequence[tuple[LayerWork, float]], *,
                what: str = "measured layers") -> DeviceProfile:
    """`profile` fitted on `(work, seconds)` samples, for tables with and without
    XLA's after-fusion bytes alike.

    Two fits. On hetpar's unfused byte counts: the per-class bytes
    efficiencies, which tables without after-fusion bytes use (a table for an
    absent GPU planned on a CPU host). Then on the after-fusion bytes, where
    known and the device's roofline prices them (`FUSED_BYTES_CLASSES`): the
    compute efficiencies, the fused-bytes efficiency and the per-call costs.
    A fit on fused bytes alone leaves the per-class bytes efficiencies
    unconstrained: on the H100's layers they fell to 0.1, and
    unfused predictions came out 15x the measured times.
    """
    unfused = calibrate(profile, [(dataclasses.replace(w, fused_bytes=None), t)
                                  for w, t in samples], fit_overhead=True)
    fitted = unfused
    # A CPU's roofline ignores fused bytes (`FUSED_BYTES_CLASSES`): a second
    # fit there would repeat the first.
    if profile.device_class in FUSED_BYTES_CLASSES and any(
            w.fused_bytes is not None for w, _ in samples):
        fused = calibrate(unfused, list(samples), fit_overhead=True)
        fitted = fused.replace(efficiencies={
            c: {"flops": e["flops"], "bytes": unfused.efficiencies[c]["bytes"]}
            for c, e in fused.efficiencies.items()})
    errors = sorted(abs(predict(fitted, w) / t - 1) for w, t in samples)
    median = errors[len(errors) // 2]
    sources = dict(fitted.sources)
    sources["efficiencies"] = (f"fitted on {what} (median {median:.0%} off after the fit); "
                               + sources["efficiencies"])
    return fitted.replace(sources=sources)
