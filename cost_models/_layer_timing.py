"""Timing one layer alone on a present device, on random inputs of the right kind.

`measure_layer` runs the layer's stage (forward, backward and update: its
slice of the step's jaxpr) as its own executable, on arguments from
`random_inputs`, and caches the timing on disk under a hash of the layer's
jaxpr (`layer_key`); `measure_update` times the layer's optimizer update
alone. Integer inputs that index something (embedding rows, label classes)
are drawn below the bound their uses set, so gathers and dynamic slices stay
in range.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import numpy as np

from hetpar.cost_models._measure import Timing, measure_cached


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


def update_eqns(graph, layer: str) -> tuple[int, ...]:
    """The layer's optimizer update: its equations neither forward nor backward
    (`hetpar.passes.is_forward` / `is_backward` on the name stack)."""
    from hetpar.passes import is_backward, is_forward  # JAX: only with a graph

    eqns = graph.program.eqns
    return tuple(i for i in graph[layer].eqns
                 if not (is_forward(s := str(eqns[i].source_info.name_stack))
                         or is_backward(s)))


def _piece(graph, layer: str, update: bool):
    """(closed jaxpr, fn, input shapes) of the layer's stage, or of its update alone."""
    import jax
    from jax.extend import core as jcore

    from hetpar.passes import subjaxpr

    if not update:
        closed, _, _ = graph.layer_jaxpr(layer)
        return (closed, *graph.layer_callable(layer))
    closed, inputs, _ = subjaxpr(graph.program, update_eqns(graph, layer))
    return (closed, jcore.jaxpr_as_fun(closed),
            [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs])


def random_inputs(graph, layer: str, seed: int = 0, *, update: bool = False
                  ) -> tuple[Callable, list]:
    """The layer's callable (its update's alone with `update`) and random
    arguments of the right shapes and dtypes.

    Floats are standard normal, booleans fair coins, integers uniform below
    the bound their uses as indices set (embedding rows, label classes; 128
    when unused as an index), typed PRNG keys come from `jax.random.key`.
    Past `DRAWN` values an argument repeats its first `DRAWN`.

    Returns:
      (fn, args) for `measure`.
    """
    import jax

    closed, fn, shapes = _piece(graph, layer, update)
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
            args.append(_tiled(shape, lambda n: rng.random(n) < 0.5))
        elif np.issubdtype(np.dtype(dt), np.integer):
            hi = min(bounds.get(v, 128), int(np.iinfo(np.dtype(dt)).max) + 1)
            args.append(_tiled(shape, lambda n, hi=hi, dt=dt:
                               rng.integers(0, max(1, hi), size=n).astype(dt)))
        else:
            args.append(_tiled(shape, lambda n, dt=dt: rng.standard_normal(n).astype(dt)))
    return fn, args


#: Random values drawn per argument at most; a larger argument repeats them.
#: numpy draws ~50M normals a second: a 6.7B Llama block's update (its
#: weights, gradients and two Adam moments, 800M floats) took 16 s to draw,
#: at the first call, for a timing that the values do not change (dense
#: arithmetic runs as fast on repeated values as on fresh ones).
DRAWN = 1 << 20


def _tiled(shape: tuple, draw: Callable[[int], np.ndarray]) -> np.ndarray:
    """An array of `shape` from `draw(n)`: drawn whole up to `DRAWN` values,
    else `DRAWN` values repeated."""
    n = math.prod(shape)
    if n <= DRAWN:
        return draw(n).reshape(shape)
    block = draw(DRAWN)
    out = np.empty(n, block.dtype)
    whole = n // DRAWN * DRAWN
    out[:whole].reshape(-1, DRAWN)[:] = block  # a copy: 60x faster than drawing
    out[whole:] = block[:n - whole]
    return out.reshape(shape)


def layer_key(graph, layer: str, *, update: bool = False) -> str:
    """The layer's (or its update's) fingerprint for the measurement cache: a hash of its jaxpr."""
    return _key(_piece(graph, layer, update)[0], update)


def _key(closed, update: bool) -> str:
    return ("update/" if update else "layer/") + hashlib.sha256(
        str(closed).encode()).hexdigest()[:24]


#: Timed calls per layer (fewer, three at least, once they take
#: `LAYER_BUDGET_S`): the lower quartile (`Timing.typical_s`) of 40 runs
#: reproduced between runs to a p90 of 21% on an H200 and 19% on its host
#: CPU, the median of 10 runs to 28% and 26%
#: (experiments/results/measure_repro). A layer under 0.2 s gets 10 runs or
#: more, as before.
LAYER_RUNS = 40
LAYER_BUDGET_S = 2.0


#: Platforms whose layers are timed interleaved (`measure_layers`): a host
#: CPU's back-to-back runs were up to 2.9x faster than the same layer's
#: after the others, and drifted twice as much between passes
#: (experiments/results/cpu_timing). Accelerators, whose per-layer goals were
#: met back to back, keep that until they are measured the same way.
INTERLEAVED_PLATFORMS = ("cpu",)


def measure_layers(graph, layers, device, *, update: bool = False, k: int = LAYER_RUNS,
                   warmup: int = 2, budget_s: float | None = LAYER_BUDGET_S
                   ) -> list[Timing | None]:
    """Times several layers' stages (their updates alone with `update`) on a
    present device, each cached on disk.

    On `INTERLEAVED_PLATFORMS` the ones not cached yet are timed together
    (`measure_interleaved`: one run of each per round), as a step runs
    them, each after other work; elsewhere one after another
    (`measure_layer`, `measure_update`). Arguments as `measure_layer`'s.

    Returns:
      The Timings, in the order of `layers`; None for a layer without an
      update when `update`.
    """
    from hetpar.cost_models._devices import resolve_device
    from hetpar.cost_models._measure import Timed, measure_interleaved

    dev = resolve_device(device)
    if dev.platform not in INTERLEAVED_PLATFORMS:
        one = measure_update if update else measure_layer
        return [one(graph, layer, dev, k=k, warmup=warmup, budget_s=budget_s)
                for layer in layers]
    timed = [layer for layer in layers if not update or update_eqns(graph, layer)]

    def item(layer):
        closed, fn, shapes = _piece(graph, layer, update)
        # Keyed apart from back-to-back timings of the same stage.
        return Timed(_key(closed, update) + "/interleaved", fn, shapes,
                     lambda: random_inputs(graph, layer, update=update)[1],
                     name=f"{layer}'s update" if update else layer)

    got = dict(zip(timed, measure_interleaved([item(layer) for layer in timed], dev, k=k,
                                              warmup=warmup, budget_s=budget_s), strict=True))
    return [got.get(layer) for layer in layers]


def measure_layer(graph, layer: str, device, *, k: int = LAYER_RUNS, warmup: int = 2,
                  budget_s: float | None = LAYER_BUDGET_S) -> Timing:
    """Times one layer's stage alone on a present device (cached on disk).

    On `INTERLEAVED_PLATFORMS` it reads what `measure_layers` timed (the
    layer among others); timed here, the layer has no others to alternate
    with.

    Args:
      graph: the LayerGraph.
      layer: the layer's name.
      device: a JAX device or its name (`gpu:0`).
      k: timed runs (their lower quartile, `Timing.typical_s`, is what the
        cost table plans with).
      warmup: untimed runs first (the first compiles).
      budget_s: fewer than k runs (three at least) once they have taken
        this long (see `measure`); None: k always.

    Returns:
      The Timing; `cached` when it came from the disk cache.
    """
    from hetpar.cost_models._devices import resolve_device
    from hetpar.cost_models._measure import measure

    if resolve_device(device).platform in INTERLEAVED_PLATFORMS:
        return measure_layers(graph, [layer], device, k=k, warmup=warmup, budget_s=budget_s)[0]
    fn, shapes = graph.layer_callable(layer)

    def on_miss(fn, _shapes, device, *, k, warmup, budget_s=None):
        # Random inputs only when measuring: drawing a GPT-2 layer's at batch
        # 256 took seconds, at every cache hit too.
        return measure(fn, random_inputs(graph, layer)[1], device, k=k, warmup=warmup,
                       budget_s=budget_s)

    # Keyed by the inputs' shapes and dtypes, as random_inputs draws them.
    return measure_cached(layer_key(graph, layer), fn, shapes, device, k=k, warmup=warmup,
                          budget_s=budget_s, measure_fn=on_miss)


def measure_update(graph, layer: str, device, *, k: int = LAYER_RUNS, warmup: int = 2,
                   budget_s: float | None = LAYER_BUDGET_S) -> Timing | None:
    """Times the layer's optimizer update alone on a present device (cached on
    disk), as the runtime runs an update kept apart from the layer's compute
    (on the host CPU that holds its state): its own executable. None when the
    layer has no update. Arguments as `measure_layer`'s."""
    from hetpar.cost_models._devices import resolve_device
    from hetpar.cost_models._measure import measure

    if not update_eqns(graph, layer):
        return None
    if resolve_device(device).platform in INTERLEAVED_PLATFORMS:
        return measure_layers(graph, [layer], device, update=True, k=k, warmup=warmup,
                              budget_s=budget_s)[0]
    closed, fn, shapes = _piece(graph, layer, True)

    def on_miss(fn, _shapes, device, *, k, warmup, budget_s=None):
        return measure(fn, random_inputs(graph, layer, update=True)[1], device, k=k,
                       warmup=warmup, budget_s=budget_s)

    return measure_cached(_key(closed, True), fn, shapes, device, k=k,
                          warmup=warmup, budget_s=budget_s, measure_fn=on_miss)
