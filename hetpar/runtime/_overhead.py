"""What the runtime itself costs per stage, measured on a present device.

A calibrated cost table (`hetpar.auto(profile="measure")`) scales its layers
to the whole step run as one `jax.jit` executable. A split step runs one
executable per stage, each dispatched by its device's worker thread after
its inputs are ready: time the one-executable step never pays. On a
millisecond CPU step this dominated (an Equinox plan alternating four layers
over two CPU devices measured 10.7 ms against 0.43 ms predicted); on 100 ms
GPU steps it is a few percent. The replay charges it per stage
(`Device.stage_overhead_s`), the closed form per crossing.

It is measured, not assumed: a chain of tiny layers, each layer's forward and
backward in stages of their own (recomputed activations cut them apart), runs
through the real `Executor` on the device, beside the same step under
`jax.jit`; the difference per extra stage is the overhead.

A crossing between devices costs more than its link's latency: the value
is copied by the transfer engine, and the consumer's worker wakes to it
(spec sheets say 5 us between two CPU devices; the runtime paid ~0.3 ms).
`crossing_s` measures it the same way, on a chain alternating two devices.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetpar.core import parse_placements

_WIDTH = 8  # tiny matmuls: the stages' work is microseconds, the overhead is the rest


def _chain_step(layers: int):
    from hetpar.passes import layer

    def step(ws, x):
        def loss(ws):
            h = x
            for i, w in enumerate(ws):
                with layer(f"l{i}"):
                    h = jnp.tanh(h @ w)
            return jnp.sum(h)

        val, g = jax.value_and_grad(loss)(ws)
        return [w - 0.01 * gw for w, gw in zip(ws, g)], val

    return step


def _timed_s(run, runs: int, stat=np.median) -> float:
    """The `stat` (default: median) of `runs` timed calls of `run`, after one untimed."""
    jax.block_until_ready(run())  # compile, warm caches
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t0)
    return float(stat(times))


def _split_and_whole_s(plan: Callable[[int], Any], devices: dict, layers: int, runs: int,
                       workers) -> tuple[float, float, object]:
    """(median step through the runtime, median under jax.jit on the first
    device, the StageGraph) of the tiny chain, layer i placed at `plan(i)`."""
    from hetpar.passes import split, trace
    from hetpar.runtime._executor import Executor
    from hetpar.runtime._transfer import TransferEngine

    step = _chain_step(layers)
    ws = [jnp.eye(_WIDTH) * 0.5 for _ in range(layers)]
    x = jnp.ones((4, _WIDTH))
    graph = trace(step, ws, x)
    stages = split(graph, parse_placements({n: plan(i) for i, n in enumerate(graph.layers)}))
    ex = Executor(stages, devices, TransferEngine(), workers)
    flat = ex.place_inputs(jax.tree_util.tree_leaves((ws, x)))
    split_s = _timed_s(lambda: ex(flat), runs)
    sharding = jax.sharding.SingleDeviceSharding(next(iter(devices.values())))
    jitted = jax.jit(step, in_shardings=sharding, out_shardings=sharding)
    args = jax.device_put((ws, x), sharding)
    return split_s, _timed_s(lambda: jitted(*args), runs), stages


def stage_overhead_s(name: str, device: jax.Device, *, layers: int = 6, runs: int = 30,
                     workers=None) -> float:
    """Seconds the runtime adds per stage it runs on `device` (named `name`).

    Args:
      name: the device's hetpar name (`gpu:0`, `cpu:1`).
      device: the jax.Device.
      layers: layers of the measured chain (2 x layers stages).
      runs: timed steps of each form (medians compared).
      workers: the `Workers` to run on (default: the executor's own).

    Returns:
      (median step through the runtime - median step under jax.jit) /
      (stages - 1), at least 0.
    """
    split_s, whole_s, stages = _split_and_whole_s(
        lambda i: {"compute": name, "activations": "remat"}, {name: device}, layers, runs,
        workers)
    n = len(stages.stages)
    return max(0.0, (split_s - whole_s) / max(n - 1, 1))


def crossing_s(a: tuple[str, jax.Device], b: tuple[str, jax.Device],
               overhead: tuple[float, float], *, layers: int = 6, runs: int = 30,
               workers=None) -> float:
    """Seconds a small value's crossing between two devices costs the runtime
    (either way: the measured chain alternates), beyond the stages' own overhead.

    Args:
      a, b: (hetpar name, jax.Device) of the two devices.
      overhead: their `stage_overhead_s`.

    Returns:
      (step through the runtime - step under jax.jit - each stage's
      overhead) / crossings, at least 0: a link latency for plans' values.
    """
    names = (a[0], b[0])
    split_s, whole_s, stages = _split_and_whole_s(
        lambda i: names[i % 2], dict((a, b)), layers, runs, workers)
    per = dict(zip(names, overhead))
    stage_s = sum(per[st.device] for st in stages.stages) - per[stages.stages[0].device]
    made_by = {v: st for st in stages.stages for v in st.outputs}
    # One transfer per (consumer, producer stage on another device), as the replay counts.
    crossings = sum(len({made_by[v].index for v in st.inputs
                         if v in made_by and made_by[v].device != st.device})
                    for st in stages.stages)
    return max(0.0, (split_s - whole_s - stage_s) / max(crossings, 1))


def _copy_timer(src: jax.Device, dst: jax.Device, runs: int) -> Callable[..., float]:
    """(count, stat=np.median) -> seconds the transfer engine takes to copy
    `count` float32 from `src` to `dst` (the path a plan's values take), the
    `stat` of `runs` copies."""
    from hetpar.runtime._transfer import TransferEngine

    engine = TransferEngine()

    def timed(count: int, stat=np.median) -> float:
        x = jax.device_put(jnp.ones((count,), jnp.float32), src)
        return _timed_s(lambda: engine.move(x, dst), runs, stat)

    return timed


#: The 4 kB copy every size is measured against: the fastest of its runs.
#: Noise only adds time, and a slowed small copy would price every size
#: low (on a loaded 2-core box it outlasted the median 1 MB copy, and the
#: link got no curve at all).
_BASE = np.min


def link_bandwidth(src: jax.Device, dst: jax.Device, nbytes: float, *,
                   runs: int = 5) -> float | None:
    """Bytes per second the transfer engine moves `src` -> `dst` at `nbytes`
    (a float32 array of about that size; at least 1 MB, at most 256 MB), the
    same path a plan's values take. The small-value cost is `crossing_s`'s;
    this is the slope at the sizes the plan moves, measured against a 4 kB copy
    (its fastest run, `_BASE`).
    None when the large copy took no longer than the small one (a GPU -> host
    copy once measured so on an H100: 1.5e17 B/s): the link keeps its figure.
    """
    timed = _copy_timer(src, dst, runs)
    n = int(min(max(nbytes, 1 << 20), 1 << 28)) // 4
    big, small = timed(n), timed(1024, _BASE)
    if big <= small * 1.01:
        return None
    return 4 * (n - 1024) / (big - small)


def link_curve(src: jax.Device, dst: jax.Device, sizes, *, runs: int = 5,
               most: int = 12) -> list[tuple[float, float]] | None:
    """Seconds the transfer engine's copies `src` -> `dst` take beyond a 4 kB
    copy (its fastest run, `_BASE`), at the sizes the link carries (`sizes`,
    bytes: at most `most` of the distinct ones from 1 MB to 256 MB, those
    within 2% as one, and 1 MB): a `Link.curve`, the same path a plan's
    values take.

    One bandwidth does not price every size, and neither does a curve
    measured at other sizes: on an H100 host, copies from the CPU device
    (then put to a SingleDeviceSharding) ran ~3-4 GB/s up to 28 MiB and
    ~1.1 GB/s from 32 MiB, so a ladder of powers of two priced GPT-2's
    27 MiB weights at 22 ms where they took 9 ms (experiments/results/links).
    The points' seconds never fall with size. None when no copy took longer
    than the small one (the link keeps its figure).
    """
    timed = _copy_timer(src, dst, runs)
    # Sizes within 2% are one point (GPT-2's embedding and its tied head's
    # weights differ by 8 kB).
    at = []
    for n in sorted({min(max(int(b) // 4, 1 << 18), 1 << 26) for b in sizes} | {1 << 18}):
        if not at or n > at[-1] * 1.02:
            at.append(n)
    if len(at) > most:  # evenly by rank, the smallest and largest kept
        at = [at[round(k * (len(at) - 1) / (most - 1))] for k in range(most)]
    small = timed(1024, _BASE)
    points, most_s = [], 0.0
    for n in at:  # a larger copy never prices cheaper (noise between sizes)
        most_s = max(most_s, timed(n) - small)
        points.append((4.0 * n, most_s))
    return points if most_s > 0 else None
