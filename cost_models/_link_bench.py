"""Microbenchmarks of the links between devices: what a copy costs, by size.

Per ordered device pair: transfer time at sizes from 4 KB to 256 MB for every
path the runtime could use (four sizes an octave from 1 MiB: cost tables
price copies by these samples as a curve), fitted to `latency + bytes /
bandwidth` (`fit_link`):

- `device_put`: `jax.device_put(x, dst)`.
- `pinned_host` (GPU <-> CPU): through the GPU's pinned host memory.
  GPU -> CPU: device_put to `memory_kind="pinned_host"`, `np.asarray`,
  device_put to the CPU device. CPU -> GPU: `np.asarray`, device_put to
  pinned_host, then to the GPU's `device` memory. docs/measurements.md measured the
  GPU -> CPU direction about 56x faster than plain device_put at 256 MB.
- `pinned_host_staged` (GPU <-> CPU): only the copy between pinned host
  memory and the GPU; a lower bound for when the producer writes (or the
  consumer reads) pinned memory directly.
- `pinned_host_duplex` (GPU <-> CPU): the same copy with one of equal size
  running the other way at once; each direction's rate under the load
  streamed optimizer state puts on the bus (state in, new state out).

Every repetition moves a freshly generated buffer: `np.asarray` keeps a host
copy of an array, so timing the same array twice measures a cache.

Under `jax.distributed` with several processes, every pair of processes
measures the `network` link between them (`profile_network`): a
`jax.lax.ppermute` from one device of the one to one of the other, timed on
the receiver; the results go to every process through the job's key-value
store (`_share`, which `profile_devices` uses for the device profiles too).
"""

from __future__ import annotations

import datetime
import itertools
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hetpar.core import ProfileError, nbytes, seconds
from hetpar.cost_models._bench_config import (
    _MB,
    FULL,
    BenchConfig,
    _block,
    _host_id,
    _jax_version,
)
from hetpar.cost_models._devices import (
    global_device_name,
    has_pinned_host,
    resolve_device,
)
from hetpar.cost_models._profile import (
    NETWORK_PATH,
    LinkProfile,
    process_link_name,
)


def fit_link(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares `latency + bytes / bandwidth` on relative error.

    Args:
      samples: `(bytes, seconds)` pairs.

    Returns:
      `(latency_s, bandwidth_bytes_per_s)`, latency >= 0.
    """
    from scipy.optimize import nnls  # scipy loads only when a fit runs

    x = np.array([s[0] for s in samples], float)
    t = np.array([s[1] for s in samples], float)
    w = 1.0 / t  # relative: 4 KB and 256 MB both count
    (lat, inv_bw), _ = nnls(np.stack([w, x * w], axis=1), np.ones_like(t))
    if inv_bw <= 0:
        inv_bw = 1.0 / float(np.max(x / t))
    return float(lat), float(1.0 / inv_bw)


class _Fresh:
    """Fresh device buffers of a given size, generated on the device."""

    def __init__(self):
        self._fns: dict[Any, Callable] = {}
        self._seed = 0.0

    def __call__(self, dev, size: int):
        import jax
        import jax.numpy as jnp
        from jax.sharding import SingleDeviceSharding

        key = (dev.platform, dev.id, size)
        if key not in self._fns:
            n = size // 4
            self._fns[key] = jax.jit(
                lambda s: jnp.full((n,), s, jnp.float32), out_shardings=SingleDeviceSharding(dev)
            )
        self._seed += 1.0
        return _block(self._fns[key](self._seed))


def transfer_paths(src, dst) -> list[str]:
    """The transfer paths the runtime could use from `src` to `dst`."""
    paths = ["device_put"]
    pair = {src.platform, dst.platform}
    if pair == {"gpu", "cpu"}:
        gpu = src if src.platform == "gpu" else dst

        if has_pinned_host(gpu):
            paths += ["pinned_host", "pinned_host_staged", "pinned_host_duplex"]
    return paths


def _time_transfer(src, dst, path: str, size: int, fresh: _Fresh) -> float:
    """Seconds for one transfer of a fresh buffer of `size` bytes along `path`."""
    import jax
    from jax.sharding import SingleDeviceSharding

    if path == "device_put":
        x = fresh(src, size)
        t0 = time.perf_counter()
        _block(jax.device_put(x, dst))
        return time.perf_counter() - t0
    gpu_to_cpu = src.platform == "gpu"
    gpu = src if gpu_to_cpu else dst
    pinned = SingleDeviceSharding(gpu, memory_kind="pinned_host")
    on_device = SingleDeviceSharding(gpu, memory_kind="device")
    if path == "pinned_host_duplex":
        # Both ways at once, `size` bytes each, whichever pair asked: what
        # streamed optimizer state does (the next layer's state in, this
        # layer's new state out).
        cpu = dst if gpu_to_cpu else src
        x = fresh(gpu, size)
        p = _block(jax.device_put(np.asarray(fresh(cpu, size)), pinned))
        t0 = time.perf_counter()
        _block((jax.device_put(x, pinned), jax.device_put(p, on_device)))
        return time.perf_counter() - t0
    if gpu_to_cpu:
        x = fresh(src, size)
        t0 = time.perf_counter()
        y = _block(jax.device_put(x, pinned))
        if path == "pinned_host":
            _block(jax.device_put(np.asarray(y), dst))
        return time.perf_counter() - t0
    if path == "pinned_host":
        x = fresh(src, size)
        t0 = time.perf_counter()
        p = jax.device_put(np.asarray(x), pinned)
        _block(jax.device_put(p, on_device))
        return time.perf_counter() - t0
    # Staged host -> GPU: the buffer already sits in pinned memory.
    p = _block(jax.device_put(np.asarray(fresh(src, size)), pinned))
    t0 = time.perf_counter()
    _block(jax.device_put(p, on_device))
    return time.perf_counter() - t0


def _repetitions(cfg: BenchConfig, size: int) -> int:
    """Timed copies of `size` bytes: large copies vary little between
    repetitions and take longest."""
    return cfg.k if size <= 16 * _MB else max(3, cfg.k - 2) if size <= 64 * _MB else 3


def profile_link(
    src, dst, path: str, cfg: BenchConfig = FULL,
    progress: Callable[[str], None] | None = None, fresh: _Fresh | None = None,
) -> LinkProfile:
    """Measures one transfer path at every size of `cfg` and fits it."""
    src, dst = resolve_device(src), resolve_device(dst)
    fresh = fresh or _Fresh()
    say = progress or (lambda m: None)
    samples = []
    for size in cfg.transfer_bytes:
        k = _repetitions(cfg, size)
        _time_transfer(src, dst, path, size, fresh)  # warm-up: compiles, allocates
        t = statistics.median(_time_transfer(src, dst, path, size, fresh) for _ in range(k))
        samples.append((float(size), t))
    lat, bw = fit_link(samples)
    big_b, big_t = samples[-1]
    say(
        f"  {global_device_name(src)} -> {global_device_name(dst)} [{path}]: "
        f"latency {seconds(lat)}, "
        f"fit {bw / 1e9:.2f} GB/s; {nbytes(big_b)} at {big_b / big_t / 1e9:.2f} GB/s"
    )
    today = datetime.date.today().isoformat()
    return LinkProfile(
        src=global_device_name(src),
        dst=global_device_name(dst),
        path=path,
        latency_s=lat,
        bandwidth_bytes_per_s=bw,
        source=f"measured {today} on {_host_id()}, jax {_jax_version()}: median of fresh "
        f"buffers at {len(samples)} sizes, least squares on relative error",
        samples=tuple(samples),
    )


# -- across processes ---------------------------------------------------------------

#: How long a process waits for the others (at a barrier, or for their
#: results): they may still be measuring their devices.
_WAIT_MS = 3600 * 1000
_calls = itertools.count()


def _client():
    """The `jax.distributed` coordination client (barriers, key-value store).

    Raises:
      ProfileError: JAX runs one process, or this JAX hides the client.
    """
    try:
        from jax._src import distributed
        client = distributed.global_state.client
    except (ImportError, AttributeError):
        client = None
    if client is None:
        raise ProfileError("measuring across processes needs jax.distributed: start the job "
                           "with `python -m hetpar.launch` (or call "
                           "hetpar.distributed.initialize() first)")
    return client


def _share(what: str, text: str) -> list[str]:
    """Every process's `text`, by process index: a collective (each process
    must call it, in the same order), through the job's key-value store."""
    import jax

    client = _client()
    key = f"hetpar/profile/{next(_calls)}/{what}"
    client.key_value_set(f"{key}/{jax.process_index()}", text)
    return [client.blocking_key_value_get(f"{key}/{i}", _WAIT_MS)
            for i in range(jax.process_count())]


def _shard_map():
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map  # JAX before 0.7

    return shard_map


def _collectives(dev) -> str:
    """What carries a collective between processes on `dev`'s platform."""
    import jax

    if dev.platform == "cpu":
        return f"{jax.config.jax_cpu_collectives_implementation or 'default'} CPU collectives"
    return {"gpu": "NCCL"}.get(dev.platform, f"{dev.platform} collectives")


def _network_samples(ends: Sequence, sender: int, cfg: BenchConfig) -> list[tuple[float, float]]:
    """(bytes, seconds) of `jax.lax.ppermute` from `ends[sender]` to the other
    end at every size of `cfg`, as the receiver timed it (empty on the sender).

    Both ends' processes must call it together. Before every timed transfer
    a 4-byte exchange both ways lines the two processes up (each leaves it
    within one latency of the other); the receiver then times its call to
    the arrival of the payload (block_until_ready), the median of `cfg.k`.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    me = jax.process_index()
    pos = next(i for i, d in enumerate(ends) if d.process_index == me)
    mesh = Mesh(np.array(list(ends)), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    shard_map = _shard_map()

    def permute(perm):
        return jax.jit(shard_map(lambda x: jax.lax.ppermute(x, "x", perm), mesh=mesh,
                                 in_specs=P("x"), out_specs=P("x")))

    send = permute([(sender, 1 - sender)])
    sync = permute([(0, 1), (1, 0)])

    def global_array(local: np.ndarray):
        return jax.make_array_from_single_device_arrays(
            (2 * local.shape[0],), sharding, [jax.device_put(local, ends[pos])])

    tick = global_array(np.zeros(1, np.float32))
    samples = []
    for size in cfg.transfer_bytes:
        n = max(1, size // 4)
        x = global_array(np.full(n, 1.0, np.float32) if pos == sender
                         else np.zeros(n, np.float32))
        _block(sync(tick))
        _block(send(x))  # warm-up: compiles, allocates
        k = _repetitions(cfg, size)
        times = []
        for _ in range(k):
            _block(sync(tick))
            t0 = time.perf_counter()
            _block(send(x))
            times.append(time.perf_counter() - t0)
        samples.append((float(4 * n), statistics.median(times)))
    return samples if pos != sender else []


def profile_network(
    cfg: BenchConfig = FULL,
    progress: Callable[[str], None] | None = None,
    *,
    endpoints: Mapping[int, Any] | None = None,
) -> list[LinkProfile]:
    """Measures the `network` link between every pair of processes, both ways.

    Under `jax.distributed` with several processes; every process must call
    it, in the same order as its other collectives. The pairs take turns (a
    barrier of the two opens each; processes outside the pair do not take
    part), each direction timed by `_network_samples` on its receiver and
    fitted with `fit_link`. The links are between whole processes (`p0` ->
    `p1`, path `network`): cost tables apply them to every pair of devices
    of the two processes (`ProfileSet.network_link`); `source` names the two
    devices measured.

    Args:
      cfg: the transfer sizes (`cfg.transfer_bytes`) and repetitions.
      progress: called with one line per measured direction.
      endpoints: process index -> the JAX device that sends and receives for
        it; default: each process's first device of the default backend.

    Returns:
      Every process's measured links (the same list on every process);
      empty with one process.
    """
    import jax

    n = jax.process_count()
    if n <= 1:
        return []
    say = progress or (lambda m: None)
    ends = dict(endpoints or {})
    for d in jax.devices():
        ends.setdefault(d.process_index, d)
    me = jax.process_index()
    client = _client()
    run = next(_calls)
    today = datetime.date.today().isoformat()
    mine = []
    for a in range(n):
        for b in range(a + 1, n):
            if me not in (a, b):
                continue
            client.wait_at_barrier(f"hetpar/profile/{run}/network/{a}-{b}", _WAIT_MS,
                                   process_ids=[a, b])
            pair = (ends[a], ends[b])
            for sender in (0, 1):
                src, dst = pair[sender], pair[1 - sender]
                samples = _network_samples(pair, sender, cfg)
                if not samples:
                    continue
                lat, bw = fit_link(samples)
                big_b, big_t = samples[-1]
                s_name, d_name = global_device_name(src), global_device_name(dst)
                say(f"  {s_name} -> {d_name} [{NETWORK_PATH}]: latency {seconds(lat)}, fit "
                    f"{bw / 1e9:.2f} GB/s; {nbytes(big_b)} at {big_b / big_t / 1e9:.2f} GB/s")
                mine.append(LinkProfile(
                    src=process_link_name(src.process_index),
                    dst=process_link_name(dst.process_index),
                    path=NETWORK_PATH, latency_s=lat, bandwidth_bytes_per_s=bw,
                    source=f"measured {today} on {_host_id()} (the receiver), jax "
                    f"{_jax_version()}: jax.lax.ppermute from {s_name} to {d_name} over "
                    f"{_collectives(src)}, timed on the receiver after a 4-byte exchange; "
                    f"median at {len(samples)} sizes, least squares on relative error; "
                    "for every device pair of the two processes",
                    samples=tuple(samples)))
    shared = _share("network", json.dumps([lk.to_json() for lk in mine]))
    return [LinkProfile.from_json(lk) for text in shared for lk in json.loads(text)]
