"""The transfer engine: moves arrays between devices by the fastest path.

Measured on the GPU machine (docs/measurements.md, experiments/results/profile_gpu_*):
GPU -> CPU through the GPU's pinned host memory ran 46 GB/s at 256 MB where
`jax.device_put(x, cpu)` ran 0.7 GB/s. Paths, by name (the same names
`hetpar profile` measures):

- `device_put`: `jax.device_put(x, dst)`;
- `pinned_host` (GPU <-> CPU): GPU -> CPU: device_put into the GPU's
  `pinned_host` memory, view it with `np.asarray`, device_put that to the CPU
  device. CPU -> GPU: into pinned host memory, then to the GPU's memory.

With measured link profiles the engine takes, per size, the path whose
`latency + bytes / bandwidth` is lowest; without them, GPU -> CPU uses
`pinned_host` and everything else `device_put`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from hetpar.cost_models import has_pinned_host


def _is_extended(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _nbytes(x) -> int:
    return int(getattr(x, "nbytes", 0) or 0)


class TransferEngine:
    """Moves arrays to a device along the fastest known path.

    Args:
      links: optional {(src name, dst name): {path: (latency_s, bandwidth_bytes_per_s)}}
        from measured link profiles.
      names: jax.Device -> hetpar device name (`cpu:0`), to look links up.
    """

    def __init__(self, links: Mapping | None = None, names: Mapping | None = None):
        self._links = dict(links or {})
        self._names = dict(names or {})
        self._lock = threading.Lock()
        self.bytes_moved = 0
        self.seconds = 0.0  # not timed here: the executor's trace times transfers

    def path(self, src: jax.Device, dst: jax.Device, nbytes: int) -> str:
        """The path a transfer of `nbytes` from `src` to `dst` takes."""
        gpu_cpu = {src.platform, dst.platform} == {"gpu", "cpu"}
        gpu = src if src.platform == "gpu" else dst
        candidates = ["device_put"]
        if gpu_cpu and has_pinned_host(gpu):
            candidates.append("pinned_host")
        fits = self._links.get((self._names.get(src), self._names.get(dst)))
        if fits:
            known = [p for p in candidates if p in fits]
            if known:
                return min(known, key=lambda p: fits[p][0] + nbytes / fits[p][1])
        if "pinned_host" in candidates and src.platform == "gpu":
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
            if not extended and self.path(src, dst, n) == "pinned_host":
                if src.platform == "gpu":
                    staged = jax.device_put(
                        arrays, SingleDeviceSharding(src, memory_kind="pinned_host"))
                    moved = jax.device_put([np.asarray(a) for a in staged], dst)
                else:
                    staged = jax.device_put([np.asarray(a) for a in arrays],
                                            SingleDeviceSharding(dst, memory_kind="pinned_host"))
                    moved = jax.device_put(staged, SingleDeviceSharding(dst, memory_kind="device"))
            else:
                moved = jax.device_put(arrays, dst)
            for i, y in zip(idx, moved):
                out[i] = y
        return out

    def move(self, x, dst: jax.Device):
        """`x` on `dst` (the same array when it is already there)."""
        return self.move_many([x], dst)[0]
