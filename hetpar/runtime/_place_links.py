"""What copies between an accelerator and its pinned host memory cost, measured.

A plan streaming or fetching state moves it between each GPU and its
pinned host memory (a memory place, `gpu:0:pinned_host`) every step, a
layer's arrays in one call, often with every GPU doing the same both ways
at once. `place_link_figures(devices)` times that (`meta["place_links"]`,
`cost_models/_group_figures.py`): one large array's bandwidth, a call's own
cost, and what each array of a batched call adds by its size, the curve
the planner prices each array of a state copy on (`Link.copy_s`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hetpar.runtime._overhead import _timed_s

_RUNS = 5


#: Bytes each way per accelerator the copies to and from pinned host memory
#: are timed at: a layer's state in the models measured is 0.2-2.4 GB, moved
#: as arrays of 50-800 MB.
PLACE_BYTES = 512 << 20
#: Array sizes the copies are also timed at (those below the whole's), each
#: in one call of a batch of up to `PLACE_BATCH` arrays: a stage's state moves as
#: one call of a few dozen arrays of 8 kB-800 MB, and each array adds a cost
#: of its own. Priced as one array, a 0.54B model's plan fetching its weights
#: (27 arrays a layer, 16-46 MB) ran 1.15-1.17x its prediction on an H200
#: (experiments/results/fit_h200, runs 54 and 60).
PLACE_SIZES = (16 << 10, 256 << 10, 4 << 20, 32 << 20, 128 << 20)
PLACE_BATCH = 32
#: Bytes of the one array a call's own cost is timed with.
_CALL_BYTES = 4 << 10


def place_link_figures(devices: Sequence[jax.Device], nbytes: int = PLACE_BYTES
                       ) -> dict | None:
    """What copies between each of `devices` and its pinned host memory take,
    with every one of them copying both ways at once: what a plan streaming
    state on all of them meets. On two H200s of one host (PCIe gen 5) a GPU
    copied 52 GB/s one way alone, 43 GB/s each way with both ways at once,
    and 31 GB/s each way with the other GPU doing the same; a plan streaming
    on both, priced at the spec sheet's 38 GB/s, ran 1.30x its prediction
    (experiments/results/fit_h200x2, runs 34 and 35).

    Returns `meta["place_links"]`'s figures (None where a device has no
    pinned host memory):
      bandwidth_bytes_per_s: each way, one array of `nbytes`;
      latency_s: a call copying one 4 kB array each way;
      curve: [[size, seconds], ...]: what one more array of `size` bytes adds
        to a call copying a batch of them (`Link.copy_s` with leaves), the
        call's own cost taken out.
    """
    from jax.sharding import SingleDeviceSharding

    def on(dev, kind):
        return SingleDeviceSharding(dev, memory_kind=kind)

    def timed(size: int, k: int) -> float:
        n = max(size // 4, 1)
        try:
            host = [[jax.device_put(jnp.zeros((n,), jnp.float32), on(d, "pinned_host"))
                     for _ in range(k)] for d in devices]
            dev = [[jax.device_put(jnp.zeros((n,), jnp.float32), on(d, "device"))
                    for _ in range(k)] for d in devices]
        except (ValueError, RuntimeError):  # no such memory kind
            return math.nan

        def both_ways():
            return [y for i, d in enumerate(devices)
                    for y in (*jax.device_put(host[i], on(d, "device")),
                              *jax.device_put(dev[i], on(d, "pinned_host")))]

        return _timed_s(both_ways, _RUNS)

    whole = timed(nbytes, 1)
    if not math.isfinite(whole):
        return None
    call = timed(_CALL_BYTES, 1)
    curve = []
    for size in [s for s in PLACE_SIZES if s < nbytes] + [nbytes]:
        k = max(1, min(PLACE_BATCH, nbytes // size))  # nbytes a call at most
        t = whole if size == nbytes else timed(size, k)
        if math.isfinite(t):  # (a size that could not be placed is left out)
            curve.append([float(size), max((t - call) / k, 0.0)])
    return {"bandwidth_bytes_per_s": nbytes / whole, "latency_s": call,
            "curve": monotone(curve)}


def monotone(curve: list) -> list:
    """`curve`'s points with seconds never falling as bytes grow (noise in a
    small size's timing must not price a larger array cheaper)."""
    out, top = [], 0.0
    for b, t in sorted(curve):
        top = max(top, t)
        out.append([b, top])
    return out


def place_line(figures: dict) -> str:
    """`place_link_figures`' figures in one line, for progress and reports."""
    from hetpar.core import seconds

    line = f"{figures['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s each way"
    if "latency_s" in figures:
        line += f", a call {seconds(figures['latency_s'])}"
    if figures.get("curve"):
        line += "; each array of a batch: " + ", ".join(
            f"{b / 1e6:.3g} MB {seconds(t)}" for b, t in figures["curve"])
    return line
