"""The transfer engine: moves arrays between devices by the fastest path.

Measured on the GPU machine (docs/measurements.md, experiments/results/profile_gpu_*):
GPU -> CPU through the GPU's pinned host memory ran 46 GB/s at 256 MB where
`jax.device_put(x, cpu)` ran 0.7 GB/s. Paths, by name (the same names
`hetpar profile` measures):

- `pinned_host` (GPU -> CPU, where the GPU offers pinned host memory):
  device_put into the GPU's `pinned_host` memory, view it with `np.asarray`,
  device_put that to the CPU device;
- `device_put`: `jax.device_put(x, dst)`, for everything else.

The choice is fixed, not read from measured link profiles: in
experiments/results/profile_gpu_h200.json `pinned_host` beat `device_put`
GPU -> CPU above about 120 kB (44 against 3.4 GB/s; 34 us slower below) and
tied CPU -> GPU (6.4 against 6.1 GB/s).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hetpar.cost_models import has_pinned_host


def _is_extended(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _nbytes(x) -> int:
    return int(getattr(x, "nbytes", 0) or 0)


class TransferEngine:
    """Moves arrays to a device along the fastest known path; counts the bytes it moves."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_moved = 0

    def path(self, src: jax.Device, dst: jax.Device) -> str:
        """The path a transfer from `src` to `dst` takes."""
        if src.platform == "gpu" and dst.platform == "cpu" and has_pinned_host(src):
            return "pinned_host"
        return "device_put"

    def move_many(self, xs: list, dst: jax.Device) -> list:
        """Each of `xs` on `dst`, arrays from one source device moved in one call.

        Every transfer call pays a fixed ~0.15-0.4 ms on the H200 host
        (`hetpar profile`'s link latencies), whatever its size: a stage whose
        inputs are a dozen activations and residuals paid it a dozen times.
        One batched `jax.device_put` per source pays it about once.
        """
        out = list(xs)
        groups: dict = {}
        for i, x in enumerate(xs):
            if not isinstance(x, jax.Array):
                out[i] = jax.device_put(x, dst)
                continue
            devs = x.devices()
            src = next(iter(devs))
            if len(devs) == 1 and src == dst:
                continue
            # PRNG keys (extended dtypes) have no NumPy view: they take device_put.
            groups.setdefault((src, _is_extended(x.dtype)), []).append(i)
        for (src, extended), idx in groups.items():
            arrays = [xs[i] for i in idx]
            n = sum(_nbytes(x) for x in arrays)
            with self._lock:
                self.bytes_moved += n
            if not extended and self.path(src, dst) == "pinned_host":
                staged = jax.device_put(
                    arrays, SingleDeviceSharding(src, memory_kind="pinned_host"))
                moved = jax.device_put([np.asarray(a) for a in staged], dst)
            else:
                moved = jax.device_put(arrays, dst)
            for i, y in zip(idx, moved):
                out[i] = y
        return out

    def move(self, x, dst: jax.Device):
        """`x` on `dst` (the same array when it is already there)."""
        return self.move_many([x], dst)[0]
