"""What a ring collective over a group of present devices costs, measured.

Sharded state moves its bytes by all-gather and reduce-scatter (XLA's, from
the shardings), not by the transfer engine's copies: on two H200s joined by
NVLink a 1 GB all-gather ran at 414 GB/s of gathered bytes and a
reduce-scatter at 451 GB/s, where `jax.device_put` between the two measured
188 GB/s at the sizes a plan's activations cross
(experiments/results/collectives_h200x2.json). Priced on the copy link, a
6.74B model's FSDP step was predicted at 469 ms and ran in 266 ms.

`ring_figures(devices)` times both collectives over `devices` (jitted
`shard_map`s, median of a few runs): the bandwidth from two large sizes, the
latency from a small one, what dispatching a jitted call over the same
arrays costs taken out (an in-step collective pays no dispatch). It returns
the (bandwidth, latency) of the ring formula
(`hetpar.core.ring_allgather_s`: n - 1 steps of bytes / n) that reproduces
them: what `planner.ring_of` prices a group's collectives with
(`CostTable.meta["collectives"]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hetpar.runtime._overhead import _timed_s

#: Gathered bytes the collectives are timed at: two sizes a line is fitted
#: through (a layer's parameters: 2-800 MB in the models measured).
SIZES = (64 << 20, 512 << 20)
#: Gathered bytes the latency is timed at, apart: the intercept of the line
#: through SIZES came out 62 us on one calibration of two H200s and 279 us on
#: the next (experiments/results/fit_h200x2, runs 45 and 46), and a step runs
#: hundreds of collectives (the zoo's 5.04B fsdp step: 254), so that
#: intercept's noise was 4-70 ms of a ~110 ms step.
LATENCY_BYTES = 64 << 10
_RUNS = 5
_LATENCY_RUNS = 21
_FLOOR_S = 5e-6  # an in-step collective's latency is never below this


def ring_figures(devices: Sequence[jax.Device], sizes: tuple[int, int] = SIZES,
                 latency_bytes: int = LATENCY_BYTES) -> tuple[float, float] | None:
    """(bandwidth bytes/s, latency s) of one ring step over `devices`: the
    bandwidth from an all-gather and a reduce-scatter of `sizes` (gathered
    bytes, two) timed there, the latency from the same of `latency_bytes`
    (what is left of it once its bytes are priced at that bandwidth); None
    for one device, or where the larger collective did not take longer than
    the smaller."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = len(devices)
    if n < 2:
        return None
    try:
        from jax import shard_map
    except ImportError:  # older jax
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(list(devices)), ("ring",))
    split = NamedSharding(mesh, PartitionSpec("ring"))

    def jitted(op, out):
        try:
            return jax.jit(shard_map(op, mesh=mesh, in_specs=PartitionSpec("ring"),
                                     out_specs=out, check_vma=False))
        except TypeError:  # jax before check_vma
            return jax.jit(shard_map(op, mesh=mesh, in_specs=PartitionSpec("ring"),
                                     out_specs=out, check_rep=False))

    gather = jitted(lambda x: jax.lax.all_gather(x, "ring", tiled=True), PartitionSpec())
    scatter = jitted(lambda x: jax.lax.psum_scatter(x, "ring", tiled=True),
                     PartitionSpec("ring"))
    nothing = jitted(lambda x: x + 0, PartitionSpec("ring"))
    def timed(size: int, runs: int) -> tuple[float, float]:
        """(the two collectives' mean of medians, a jitted call's dispatch) at `size`."""
        gathered = jax.device_put(jnp.zeros((max(size // 4 // n, 1) * n,), jnp.float32), split)
        # a reduce-scatter of `size` bytes: each member holds the whole before
        whole = jax.device_put(jnp.zeros((max(size // 4 // n, 1) * n * n,), jnp.float32), split)
        dispatch = _timed_s(partial(nothing, gathered), runs)
        return ((_timed_s(partial(gather, gathered), runs)
                 + _timed_s(partial(scatter, whole), runs)) / 2, dispatch)

    (t_small, _), (t_big, _) = (timed(size, _RUNS) for size in sizes)
    if t_big <= t_small:
        return None
    return ring_fit(n, sizes, (t_small, t_big), latency_bytes,
                    timed(latency_bytes, _LATENCY_RUNS))


def ring_fit(n: int, sizes: tuple[int, int], seconds: tuple[float, float],
             latency_bytes: int, tiny: tuple[float, float]) -> tuple[float, float]:
    """(bandwidth, latency) of the ring formula, a collective of S bytes over
    n taking (n - 1) (latency + S / n / bandwidth): the bandwidth from the
    two large sizes' `seconds`, the latency from the small one's (`tiny`:
    its seconds and a jitted call's dispatch there, taken out)."""
    per_byte = (seconds[1] - seconds[0]) / (sizes[1] - sizes[0])
    bandwidth = (n - 1) / n / per_byte
    latency = (tiny[0] - tiny[1] - latency_bytes * per_byte) / (n - 1)
    return bandwidth, max(latency, _FLOOR_S)
