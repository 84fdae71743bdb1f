"""What XLA says a step or a layer costs, after its optimisation passes.

Each layer is compiled alone for a backend and `Compiled.cost_analysis()` is
read: the "after optimisation" column of the cost report. XLA's figures are
best effort: it counts a loop body once and reports -1 (or nothing) for
cuDNN convolutions and other custom calls on GPU. Those come back as None,
shown as unknown, never as zero.
"""

from __future__ import annotations

import dataclasses

import jax
from absl import logging
from jax.extend import core as jcore

from hetpar.core import HetparError
from hetpar.passes._layer_graph import LayerGraph


@dataclasses.dataclass(frozen=True)
class XlaCost:
    """XLA's cost analysis of one compiled computation (None: XLA did not say)."""

    flops: float | None
    bytes_accessed: float | None
    transcendentals: float | None

    @staticmethod
    def unknown() -> XlaCost:
        return XlaCost(None, None, None)


def _device(backend: str) -> jax.Device:
    try:
        return jax.devices(backend)[0]
    except RuntimeError as e:
        raise HetparError(
            f"backend {backend!r} is not present on this machine ({e}); "
            f"present: {sorted({d.platform for d in jax.devices()} | {'cpu'})}"
        ) from e


def _lower(closed: jcore.ClosedJaxpr, avals, backend: str):
    dev = _device(backend)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
    return jax.jit(jcore.jaxpr_as_fun(closed)).lower(*args)


def _read(analysis) -> XlaCost:
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per computation
        analysis = analysis[0] if analysis else None
    if not analysis:
        return XlaCost.unknown()

    def get(key):
        v = analysis.get(key)
        return None if v is None or v < 0 else float(v)

    return XlaCost(get("flops"), get("bytes accessed"), get("transcendentals"))


def compiled_cost(closed: jcore.ClosedJaxpr, avals, backend: str = "cpu") -> XlaCost:
    """Compiles a closed jaxpr for `backend` and reads XLA's cost analysis."""
    compiled = _lower(closed, avals, backend).compile()
    try:
        return _read(compiled.cost_analysis())
    except Exception as e:  # some backends do not implement it
        logging.warning("XLA cost analysis failed on %s: %s", backend, e)
        return XlaCost.unknown()


def lowered_cost(closed: jcore.ClosedJaxpr, avals, backend: str = "cpu") -> XlaCost:
    """XLA's cost analysis of the HLO as lowered, before optimisation passes.

    Some backends (GPU, seen with jax 0.11) return nothing here: unknown.
    """
    try:
        return _read(_lower(closed, avals, backend).cost_analysis())
    except Exception as e:
        logging.warning("XLA cost analysis of the lowered HLO failed on %s: %s", backend, e)
        return XlaCost.unknown()


def layer_costs(graph: LayerGraph, backend: str = "cpu") -> dict[str, XlaCost]:
    """XLA's cost of every layer compiled alone for `backend`."""
    out = {}
    for name in graph.layers:
        closed, inputs, _ = graph.layer_jaxpr(name)
        out[name] = compiled_cost(closed, [v.aval for v in inputs], backend)
    return out


def _whole(graph: LayerGraph) -> tuple[jcore.ClosedJaxpr, list]:
    """The whole step as one jaxpr whose consts are ordinary inputs."""
    closed = graph.program.jaxpr
    full = jcore.ClosedJaxpr(
        jcore.Jaxpr([], list(closed.jaxpr.constvars) + list(closed.jaxpr.invars),
                    closed.jaxpr.outvars, closed.jaxpr.eqns, closed.jaxpr.effects,
                    closed.jaxpr.debug_info),
        [],
    )
    return full, [v.aval for v in full.jaxpr.invars]


def step_cost(graph: LayerGraph, backend: str = "cpu", *, optimized: bool = True) -> XlaCost:
    """XLA's cost of the whole step as one program, after (or before) optimisation."""
    full, avals = _whole(graph)
    return (compiled_cost if optimized else lowered_cost)(full, avals, backend)


def hlo_text(graph: LayerGraph, layer: str | None = None, *, optimized: bool = False,
             backend: str = "cpu") -> str:
    """HLO text of the whole step, or of one layer alone.

    Args:
      graph: the traced step.
      layer: a layer name, or None for the whole step.
      optimized: after XLA's optimisation passes (compiled) instead of as lowered.
      backend: "cpu", "gpu" or "tpu".
    """
    if layer is None:
        piece, avals = _whole(graph)
    else:
        piece, inputs, _ = graph.layer_jaxpr(layer)
        avals = [v.aval for v in inputs]
    lowered = _lower(piece, avals, backend)
    if optimized:
        return lowered.compile().as_text()
    return lowered.as_text(dialect="hlo")
