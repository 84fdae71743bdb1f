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
latency from what one more small all-reduce adds to a program of them
chained (an in-step collective pays no call's dispatch). It returns the
(bandwidth, latency) of the ring formulas (`hetpar.core.ring_allgather_s`:
n - 1 steps of bytes / n; `ring_allreduce_s`: 2 (n - 1)) that reproduce
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
#: Bytes each member all-reduces in the chain the latency is timed with:
#: the intercept of the line through SIZES came out 62 us on one calibration
#: of two H200s and 279 us on the next (experiments/results/fit_h200x2, runs
#: 45 and 46), and a step runs hundreds of collectives (the zoo's 5.04B fsdp
#: step: 342, 98 of them all-reduces of 8 kB, each charged its ring steps'
#: latency), so that intercept's noise was 4-70 ms of a ~110 ms step.
LATENCY_BYTES = 64 << 10
#: All-reduces chained in one program, against one: the latency is what each
#: adds. Timed instead as a small collective's call less a jitted no-op's,
#: two figures of ~100 us each, the latency came out 7, 96, 219 and 47 us on
#: four calibrations of two H200s (runs 61, 68, 70), and the same fsdp
#: plan was predicted 94-131 ms.
CHAIN = 33
_RUNS = 5
_LATENCY_RUNS = 21
_FLOOR_S = 5e-6  # an in-step collective's latency is never below this


def ring_figures(devices: Sequence[jax.Device], sizes: tuple[int, int] = SIZES,
                 latency_bytes: int = LATENCY_BYTES) -> tuple[float, float] | None:
    """(bandwidth bytes/s, latency s) of one ring step over `devices`: the
    bandwidth from an all-gather and a reduce-scatter of `sizes` (gathered
    bytes, two) timed there, the latency from what each all-reduce of
    `latency_bytes` a member adds to a program of `CHAIN` of them (what is
    left of it once its bytes are priced at that bandwidth,
    `chain_latency`); None for one device, or where the larger collective
    did not take longer than the smaller."""
    n = len(devices)
    if n < 2:
        return None
    gather = _over(devices, lambda x: jax.lax.all_gather(x, "ring", tiled=True), whole=True)
    scatter = _over(devices, lambda x: jax.lax.psum_scatter(x, "ring", tiled=True))

    def timed(size: int, runs: int) -> float:
        """The two collectives' mean of medians at `size`."""
        gathered = _split(devices, max(size // 4 // n, 1) * n, 0.0)
        # a reduce-scatter of `size` bytes: each member holds the whole before
        whole = _split(devices, max(size // 4 // n, 1) * n * n, 0.0)
        return (_timed_s(partial(gather, gathered), runs)
                + _timed_s(partial(scatter, whole), runs)) / 2

    t_small, t_big = (timed(size, _RUNS) for size in sizes)
    if t_big <= t_small:
        return None
    bandwidth = ring_bandwidth(n, sizes, (t_small, t_big))
    one, many = (_timed_s(partial(*allreduce_chain(devices, k, latency_bytes)), _LATENCY_RUNS)
                 for k in (1, CHAIN))
    return bandwidth, chain_latency(n, bandwidth, latency_bytes, (many - one) / (CHAIN - 1))


def allreduce_chain(devices: Sequence[jax.Device], k: int, nbytes: int):
    """(a jitted program of `k` all-reduces over `devices` of `nbytes` a
    member, each of the last's result, its argument). Nothing else runs
    between them (ones summed: 2^33 at most on two members, no overflow
    below 16), so what one more adds is an all-reduce's in-step time."""
    def op(x):
        for _ in range(k):
            x = jax.lax.psum(x, "ring")
        return x

    return (_over(devices, op),
            _split(devices, max(nbytes // 4, 1) * len(devices), 1.0))


def _over(devices, op, whole: bool = False):
    """`op` jitted as a `shard_map` over `devices` (one axis, "ring"), its
    argument split over them, its result split too, or whole."""
    from jax.sharding import Mesh, PartitionSpec

    try:
        from jax import shard_map
    except ImportError:  # older jax
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(list(devices)), ("ring",))
    out = PartitionSpec() if whole else PartitionSpec("ring")
    try:
        return jax.jit(shard_map(op, mesh=mesh, in_specs=PartitionSpec("ring"), out_specs=out,
                                 check_vma=False))
    except TypeError:  # jax before check_vma
        return jax.jit(shard_map(op, mesh=mesh, in_specs=PartitionSpec("ring"), out_specs=out,
                                 check_rep=False))


def _split(devices, size: int, value: float):
    """`size` float32s of `value`, split over `devices`."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(list(devices)), ("ring",))
    return jax.device_put(jnp.full((size,), value, jnp.float32),
                          NamedSharding(mesh, PartitionSpec("ring")))


def ring_bandwidth(n: int, sizes: tuple[int, int], seconds: tuple[float, float]) -> float:
    """The bandwidth of the ring formula, a collective of S bytes over n
    taking (n - 1) (latency + S / n / bandwidth), from two sizes' `seconds`
    (their difference: what the bytes take, no call's cost)."""
    per_byte = (seconds[1] - seconds[0]) / (sizes[1] - sizes[0])
    return (n - 1) / n / per_byte


def chain_latency(n: int, bandwidth: float, nbytes: int, per_allreduce: float) -> float:
    """The latency of a ring step from what one more all-reduce of `nbytes` a
    member added to a chain of them (`per_allreduce` s): 2 (n - 1) steps, each
    its latency and nbytes / n at `bandwidth` (`core.ring_allreduce_s`),
    never below `_FLOOR_S`."""
    steps = 2 * (n - 1)
    return max((per_allreduce - steps * nbytes / n / bandwidth) / steps, _FLOOR_S)
