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

from hetpar.core import ProfileError, seconds
from hetpar.cost_models._layer_timing import LAYER_RUNS, measure_layer
from hetpar.cost_models._layer_work import graph_layer_work, layer_fused_bytes
from hetpar.cost_models._profile import DeviceProfile
from hetpar.cost_models._roofline import LayerWork, calibrate, predict

#: Device classes whose fit counts XLA's after-fusion bytes (as the cost table
#: does with measured layers: `FUSED_BYTES_CLASSES`).
_FUSED = frozenset({"gpu", "tpu"})


def layer_samples(graphs: Sequence, device, profile: DeviceProfile, *, k: int = LAYER_RUNS,
                  progress: Callable[[str], None] | None = None
                  ) -> list[tuple[str, str, LayerWork, float]]:
    """(graph name, layer, work, measured seconds) of every layer of `graphs` on `device`.

    Args:
      graphs: `(name, LayerGraph)` pairs.
      device: a present JAX device.
      profile: the device's profile (its class decides the byte count).
      k: timed runs per layer.
      progress: called with a line per layer.
    """
    fused = profile.device_class in _FUSED
    out = []
    for name, graph in graphs:
        for layer in graph.layers:
            work = graph_layer_work(graph, layer)
            if fused:
                nbytes = layer_fused_bytes(graph, layer, device.platform)
                if nbytes is not None:
                    work = dataclasses.replace(work, fused_bytes=nbytes)
            t = measure_layer(graph, layer, device, k=k).typical_s
            out.append((name, layer, work, t))
            if progress:
                progress(f"{name}/{layer} on {device}: {seconds(t)}")
    return out


def fit_on_layers(profile: DeviceProfile, device, graphs: Sequence, *,
                  k: int = LAYER_RUNS,
                  progress: Callable[[str], None] | None = None) -> DeviceProfile:
    """`profile` with efficiencies and overheads fitted on `graphs`' layers measured on `device`.

    Its `sources["efficiencies"]` says what it was fitted on and how well
    (the fitted layers' median error).

    Raises:
      ProfileError: no layers to fit on.
    """
    samples = layer_samples(graphs, device, profile, k=k, progress=progress)
    if not samples:
        raise ProfileError("fit_on_layers: the models given have no layers to measure")
    names = ", ".join(sorted({n for n, *_ in samples}))
    return fit_samples(profile, [(w, t) for _, _, w, t in samples],
                       what=f"{len(samples)} layers of {names} measured alone")


def fit_samples(profile: DeviceProfile, samples: Sequence[tuple[LayerWork, float]], *,
                what: str = "measured layers") -> DeviceProfile:
    """`profile` fitted on `(work, seconds)` samples, for tables with and without
    XLA's after-fusion bytes alike.

    Two fits. On hetpar's unfused byte counts: the per-class bytes
    efficiencies, which tables without after-fusion bytes use (a table for an
    absent GPU planned on a CPU host). Then on the after-fusion bytes, where
    known: the compute efficiencies, the fused-bytes efficiency and the
    per-call costs. A fit on fused bytes alone leaves the per-class bytes
    efficiencies unconstrained: on the H100's layers they fell to 0.1, and
    unfused predictions came out 15x the measured times.
    """
    unfused = calibrate(profile, [(dataclasses.replace(w, fused_bytes=None), t)
                                  for w, t in samples], fit_overhead=True)
    fitted = unfused
    if any(w.fused_bytes is not None for w, _ in samples):
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
