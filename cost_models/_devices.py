"""The devices present, and hetpar's names for them (`cpu:0`, `gpu:0`).

One definition of a device's name, used by the cost models, the runtime and
`hetpar.auto`: the plan files and graph.json name devices this way; and of a
device's spec-sheet kind (`h100`, `cpu`), which picks its built-in profile.
"""

from __future__ import annotations

import os

from hetpar.core import ProfileError
from hetpar.core._placement import local_name, process_of  # noqa: F401 (names, in core)


def device_name(device) -> str:
    """`platform:id` of a JAX device, e.g. `cpu:0`, `gpu:0`."""
    return f"{device.platform}:{device.id}"


def global_device_name(device) -> str:
    """The name `present_devices` gives a JAX device: `cpu:0` with one process,
    `p1/cpu:0` under several (`hetpar._distributed.device_name`)."""
    from hetpar._distributed import device_name as distributed_name

    return distributed_name(device)


def present_devices() -> dict:
    """Every device JAX sees here by name: the default backend's first, then the CPU's.

    Under `jax.distributed` with several processes: every process's devices
    (`jax.devices()` is global), named `p{process}/{platform}:{index}`
    (`hetpar._distributed.device_name`), the same dict on every process. The
    CPU devices are those `jax.devices("cpu")` lists: every process's where the
    CPU backend is the distributed one (a CPU-only job), else this process's.
    """
    import jax

    devs = list(jax.devices())
    try:
        devs += [d for d in jax.devices("cpu") if d not in devs]
    except RuntimeError:
        pass  # a build without a CPU backend
    if jax.process_count() > 1:
        from hetpar._distributed import device_names

        return dict(zip(device_names(devs), devs))
    return {device_name(d): d for d in devs}


def spec_kind_of(device) -> str:
    """The spec-sheet kind of a JAX device (`h100`, `cpu`, ...), else its platform."""
    if device.platform == "cpu":
        return "cpu"
    dk = device.device_kind.lower()
    table = [("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("t4", "t4"),
             ("v4", "tpu-v4"), ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e")]
    for needle, kind in table:
        if needle in dk:
            return kind
    return device.platform


def resolve_device(device):
    """The JAX device for a name (`cpu:0`, `gpu:0`), or the device itself.

    Raises:
      ProfileError: no such device is present.
    """
    if not isinstance(device, str):
        return device
    devs = present_devices()
    if device in devs:
        return devs[device]
    raise ProfileError(
        f"device {device!r} is not present (present: {', '.join(devs)}); to plan for a device "
        "that is not here, use its spec-sheet kind (e.g. 'h100') instead of measuring it"
    )


def runtime_path(src_class: str, dst_class: str, pinned_host: bool) -> str:
    """The path the runtime's transfer engine takes from a `src_class` device to a
    `dst_class` one (`cpu`, `gpu`, `tpu`): GPU -> CPU through the GPU's pinned
    host memory where it has some (`pinned_host`), everything else by
    `jax.device_put`. The names are `hetpar profile`'s paths, so a cost table
    prices a copy by the path that will carry it."""
    if src_class == "gpu" and dst_class == "cpu" and pinned_host:
        return "pinned_host"
    return "device_put"


def has_pinned_host(device) -> bool:
    """True if `device` (a GPU) offers `pinned_host` memory: the fast GPU <-> CPU path."""
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - backends without memory kinds
        return False


def live_capacity(device) -> tuple[float | None, str]:
    """(bytes, source) a present device can hold, as this machine has it; (None, "")
    where it cannot be read (another process's accelerator, a backend without
    `memory_stats`).

    An accelerator's is JAX's allocator limit (`memory_stats()["bytes_limit"]`),
    not the card's: JAX takes 75% of a GPU by default (a 143 GB H200 gives
    112.6 GB), and `XLA_PYTHON_CLIENT_MEM_FRACTION` sets it; a plan sized to
    the spec sheet's 141 GB ran out of memory mid-step. A CPU's is the host's
    RAM that this process's arrays may use (`host_room`), which every CPU
    device and memory place of the host shares.
    """
    if device.platform == "cpu":
        from hetpar._host_memory import physical_ram

        total = physical_ram()
        if total is None:
            return None, ""
        room = host_room(total)
        if room >= total:
            return float(total), f"host RAM from sysconf on this machine ({total / 1e9:.1f} GB)"
        return room, (f"host RAM for arrays on this machine ({room / 1e9:.1f} GB of its "
                      f"{total / 1e9:.1f} GB from sysconf: what the OS has available and "
                      "this process's host arrays, less what other processes and this "
                      "one hold beside them)")
    try:
        import jax

        if device.process_index != jax.process_index():
            return None, ""
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend implements memory_stats
        stats = {}
    if "bytes_limit" in stats:
        limit = float(stats["bytes_limit"])
        return limit, (f"JAX allocator bytes_limit on this machine ({limit / 1e9:.1f} GB; "
                       "XLA_PYTHON_CLIENT_MEM_FRACTION sets it)")
    return None, ""


def host_room(total: float) -> float:
    """Bytes of the host's RAM (`total`) that this process's arrays may
    hold: what the OS has available (`MemAvailable`) and what its JAX arrays
    in host memory hold already, never over `total`. The rest is other
    processes' and this one's own (Python, the libraries, compiled code,
    malloc's free lists), which a plan cannot use. On an H200 host of 134 GB
    a 6.74B plan checked at 115 GB of host arrays was killed by the OS at
    134 GB: the process held ~9 GB beside its arrays before the step
    (fit_h200, run 51). XLA's pinned pool's spare regions count as the
    arrays' too (`pool_spare`). `total` where the OS does not say (not Linux)."""
    got = os_memory()
    if got is None:
        return total
    available, rss = got
    arrays, pinned = host_arrays()
    return room_for_arrays(total, available, rss, arrays + pool_spare(pinned))


def os_memory() -> tuple[float, float] | None:
    """(the host's `MemAvailable`, this process's resident bytes) from the
    OS, None where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: v for k, v in (line.split(":", 1) for line in f)}
        available = float(info["MemAvailable"].split()[0]) * 1024
        with open("/proc/self/statm") as f:
            rss = float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return available, rss


def pool_spare(pinned: float, limit: float | None = None) -> float:
    """What XLA's pinned pool holds beyond the `pinned` bytes of arrays in
    it: the regions it grew to (`hetpar.core.pinned_pool_reserved`) stay
    the process's (a pool gives nothing back), room for what a plan keeps
    there again, which the OS counts neither available nor the arrays'
    (a replan after a step ran). `limit`: the pool's (`pinned_pool_bytes`)."""
    from hetpar._host_memory import pinned_pool_bytes
    from hetpar.core import pinned_pool_reserved

    if pinned <= 0:
        return 0.0
    limit = pinned_pool_bytes() if limit is None else limit
    return max(pinned_pool_reserved(pinned, limit) - pinned, 0.0)


def room_for_arrays(total: float, available: float, rss: float, arrays: float) -> float:
    """What arrays may hold of `total` bytes of RAM: what is `available` and
    what the arrays hold already (at most the process's resident `rss`)."""
    return min(total, available + min(arrays, rss))


def host_array_bytes() -> float:
    """Bytes of this process's live JAX arrays in host memory: on CPU
    devices, or in an accelerator's host memory kinds (`pinned_host`)."""
    return host_arrays()[0]


def host_arrays() -> tuple[float, float]:
    """(`host_array_bytes`, the part of it in a GPU's `pinned_host` memory:
    XLA's pinned pool)."""
    import sys

    jax = sys.modules.get("jax")
    if jax is None:
        return 0.0, 0.0
    # `live_arrays()` lists the default backend's alone: on a GPU host the
    # state built on the CPU device was missed, and the 6.74B model's host
    # was planned with 52 GB of its 134 (fit_h200, run 52).
    arrays = {}
    for platform in dict.fromkeys(("cpu", jax.default_backend())):
        try:
            arrays.update((id(x), x) for x in jax.live_arrays(platform))
        except RuntimeError:  # no such backend here
            continue
    # Each buffer once: two arrays may share one (a put that found the
    # value in place), and an array over several CPU devices holds a
    # buffer on each (this process's shards only).
    seen: dict = {}
    for x in arrays.values():
        try:
            if x.is_deleted():
                continue
            kind = x.sharding.memory_kind
            host_kind = kind in ("pinned_host", "unpinned_host")
            for shard in x.addressable_shards:
                if host_kind or shard.device.platform == "cpu":
                    key = (shard.device, shard.data.unsafe_buffer_pointer())
                    seen[key] = (float(shard.data.nbytes),
                                 kind == "pinned_host" and shard.device.platform == "gpu")
        except Exception:  # noqa: BLE001 - an array deleted meanwhile
            continue
    return (float(sum(b for b, _ in seen.values())),
            float(sum(b for b, pooled in seen.values() if pooled)))


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, else the count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
