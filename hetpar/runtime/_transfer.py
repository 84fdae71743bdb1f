"""The transfer engine: moves arrays between devices by a fixed path per pair of platforms.

Measured on the GPU machine (docs/measurements.md, experiments/results/profile_gpu_*):
GPU -> CPU through the GPU's pinned host memory ran 46 GB/s at 256 MB where
`jax.device_put(x, cpu)` ran 0.7 GB/s. Paths, by name (the same names
`hetpar profile` measures):

- `pinned_host` (GPU -> CPU, where the GPU offers pinned host memory):
  device_put into the GPU's `pinned_host` memory, view it with `np.asarray`,
  device_put that to the CPU device;
- `device_put`: `jax.device_put(x, dst)`, for everything else, including
  copies between a device and one of its memory places (a destination given
  as a `SingleDeviceSharding` with a memory kind, `gpu:0:pinned_host`):
  those are DMA copies within the device's own client, about 50 GB/s each
  way on an H100 host against ~7 GB/s between the GPU and the CPU device.

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

from hetpar.cost_models import has_pinned_host, runtime_path


def _is_extended(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _nbytes(x) -> int:
    return int(getattr(x, "nbytes", 0) or 0)


def _target(dst) -> tuple[jax.Device, str | None]:
    """(device, memory kind or None for the default) of a destination: a
    `jax.Device` or a `SingleDeviceSharding` naming a memory kind."""
    if isinstance(dst, jax.sharding.Sharding):
        return next(iter(dst.device_set)), dst.memory_kind
    return dst, None


def _memory_kind(x) -> str | None:
    """The memory kind of an array's buffers (None: its device's default)."""
    kind = getattr(x.sharding, "memory_kind", None)
    return None if kind in (None, "device") else kind


class TransferEngine:
    """Moves arrays to a device along its path (`path`); counts the bytes it moves."""

    #: Put plain copies to the bare destination Device (see `move_many`);
    #: False puts them to its SingleDeviceSharding, as hetpar did before
    #: (experiments compare the two in one run).
    PUT_TO_DEVICE = True
    #: GPU -> CPU through pinned memory: the CPU array may alias the GPU's
    #: pinned staging buffer (zero-copy); False copies it into memory the
    #: CPU device owns (experiments/probe_host_stage.py compares the two).
    ALIAS_PINNED = True

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_moved = 0

    def path(self, src: jax.Device, dst: jax.Device) -> str:
        """The path a transfer from `src` to `dst` takes."""
        return runtime_path(src.platform, dst.platform,
                             src.platform == "gpu" and has_pinned_host(src))

    def move_many(self, xs: list, dst) -> list:
        """Each of `xs` on `dst`, arrays from one source device moved in one call.

        `dst` is a `jax.Device` (its default memory) or a `SingleDeviceSharding`
        naming a memory kind (a memory place).

        Every transfer call pays a fixed ~0.15-0.4 ms on the H200 host
        (`hetpar profile`'s link latencies), whatever its size: a stage whose
        inputs are a dozen activations and residuals paid it a dozen times.
        One batched `jax.device_put` per source pays it about once.
        """
        out = list(xs)
        groups: dict = {}
        dev, kind = _target(dst)
        # Into or out of a memory place, an explicit sharding: device_put to a
        # bare Device would keep a source's memory kind on some backends.
        # Otherwise the bare Device: on an H200 host, CPU device -> GPU copies
        # of 57-154 MiB ran 5-8 GB/s put to the Device and 1.2-1.4 GB/s put to
        # its SingleDeviceSharding (experiments/results/links, put_forms).
        put_to = SingleDeviceSharding(dev, memory_kind=kind)
        plain_to = dev if kind is None and self.PUT_TO_DEVICE else put_to
        for i, x in enumerate(xs):
            if not isinstance(x, jax.Array):
                out[i] = jax.device_put(x, plain_to)
                continue
            devs = x.devices()
            src = next(iter(devs))
            src_kind = _memory_kind(x)
            if len(devs) == 1 and src == dev and src_kind == kind:
                continue
            # PRNG keys (extended dtypes) have no NumPy view: they take
            # device_put, as do copies into or out of a memory place.
            plain = _is_extended(x.dtype) or kind is not None or src_kind is not None
            groups.setdefault((src, plain), []).append(i)
        for (src, plain), idx in groups.items():
            arrays = [xs[i] for i in idx]
            n = sum(_nbytes(x) for x in arrays)
            with self._lock:
                self.bytes_moved += n
            if not plain and self.path(src, dev) == "pinned_host":
                staged = jax.device_put(
                    arrays, SingleDeviceSharding(src, memory_kind="pinned_host"))
                moved = jax.device_put([np.asarray(a) for a in staged], plain_to,
                                       may_alias=None if self.ALIAS_PINNED else False)
            else:
                moved = jax.device_put(arrays, put_to if plain else plain_to)
            for i, y in zip(idx, moved):
                out[i] = y
        return out

    def move(self, x, dst):
        """`x` on `dst` (the same array when it is already there)."""
        return self.move_many([x], dst)[0]


def copied_apart(x, y) -> bool:
    """Whether `y` holds none of JAX array `x`'s buffers: a put may hand back
    `x`'s own buffer in a new array (already in place; a replicated array's
    shard on the target), which deleting `x` would delete. Unsure: no."""
    if not isinstance(x, jax.Array) or y is x:
        return False
    try:
        mine = {(s.device, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}
        return not mine & {(s.device, s.data.unsafe_buffer_pointer())
                           for s in y.addressable_shards}
    except Exception:  # noqa: BLE001 - no pointer to compare (a backend without one)
        return False
