"""Microbenchmarks of the devices present: what `hetpar profile` measures.

Per device: matmul FLOP/s at several sizes and dtypes, memory bandwidth of an
elementwise op and of a reduction over large arrays, and the round-trip cost
of dispatching a tiny executable. These become `LayerWork` samples and go
through the same `calibrate` the per-layer measurements use, so a measured
profile's efficiencies come from one least-squares fit.

Per ordered device pair: transfer time at sizes from 4 KB to 256 MB for every
path the runtime could use (four sizes an octave from 1 MiB: cost tables
price copies by these samples as a curve), fitted to `latency + bytes /
bandwidth` too:

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

Under `jax.distributed` with several processes (`profile_devices`): each
process measures its own devices and the paths between them (names
`p{process}/cpu:0`), and every pair of processes the `network` link between
them (`profile_network`): a `jax.lax.ppermute` from one device of the one to
one of the other, timed on the receiver. Every process ends with the same
ProfileSet (shared through the job's key-value store).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from hetpar._host_memory import has_huge_pages
from hetpar.core import ProfileError, nbytes, seconds
from hetpar.cost_models._devices import (
    global_device_name,
    has_pinned_host,
    live_capacity,
    present_devices,
    resolve_device,
    spec_kind_of,
)
from hetpar.cost_models._measure import measure
from hetpar.cost_models._profile import (
    NETWORK_PATH,
    DeviceProfile,
    LinkProfile,
    process_link_name,
)
from hetpar.cost_models._profiles import ProfileSet
from hetpar.cost_models._roofline import LayerWork, calibrate, predict
from hetpar.cost_models._specs import spec, spec_kinds

_MB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """Sizes and repetitions of one profiling run.

    Attributes:
      matmul_sizes: n of the n x n x n matmuls, ascending.
      dtypes: matmul dtypes.
      stream_bytes: array sizes of the elementwise and reduction benchmarks.
      transfer_bytes: transfer sizes, ascending.
      k: timed repetitions (median reported).
      max_rep_s: skip a larger matmul once one repetition would exceed this.
      launch_calls: calls of the tiny op for the dispatch overhead.
    """

    matmul_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    stream_bytes: tuple[int, ...]
    transfer_bytes: tuple[int, ...]
    k: int
    max_rep_s: float
    launch_calls: int


#: 4 KB, 16 KB, 64 KB, 256 KB, then 1 MiB .. 256 MiB at four sizes an octave
#: (multiples of 4 kB). The copies' seconds become a link's curve
#: (`LinkProfile.copy_curve`), and a curve interpolates across whatever
#: happens between two samples: on an H200 host, pinned host memory -> GPU
#: ran 31 GB/s at 27 MiB and 11 GB/s at 38 MiB, which a ladder of powers of
#: four (16, 64 MiB) would put anywhere between them
#: (experiments/results/links). Between samples 19% apart a fall costs at
#: most that step.
_TRANSFER_LADDER = (4096, 16384, 65536, 262144) + tuple(
    int(round(_MB * 2 ** (i / 4) / 4096)) * 4096 for i in range(33))

FULL = BenchConfig(
    matmul_sizes=(256, 512, 1024, 2048, 4096, 8192),
    dtypes=("f32", "bf16"),
    stream_bytes=(_MB, 16 * _MB, 256 * _MB),
    transfer_bytes=_TRANSFER_LADDER,
    k=7,
    max_rep_s=0.3,
    launch_calls=200,
)
QUICK = BenchConfig(
    matmul_sizes=(64, 128, 256),
    dtypes=("f32", "bf16"),
    stream_bytes=(256 * 1024, 4 * _MB),
    transfer_bytes=(4096, 64 * 1024, _MB, 16 * _MB),
    k=3,
    max_rep_s=0.1,
    launch_calls=50,
)

_JNP_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def _host_id() -> str:
    return f"{socket.gethostname()} ({platform.processor() or platform.machine()}, " \
           f"{os.cpu_count()} cores)"


def _block(x):
    import jax

    return jax.block_until_ready(x)


def _matmul_samples(dev, cfg: BenchConfig, say: Callable[[str], None]):
    import jax.numpy as jnp

    samples, results = [], {}
    for dt in cfg.dtypes:
        dtype = jnp.dtype(_JNP_DTYPES[dt])
        prev = None
        for n in cfg.matmul_sizes:
            if prev is not None and prev[1] * (n / prev[0]) ** 3 > cfg.max_rep_s:
                say(f"  matmul {dt} {n}^3: skipped (would take over {cfg.max_rep_s} s a run)")
                break
            a = jnp.ones((n, n), dtype, device=dev)
            b = jnp.ones((n, n), dtype, device=dev)
            t = measure(jnp.matmul, (a, b), dev, k=cfg.k, warmup=2).median_s
            flops = 2.0 * n**3
            work = LayerWork({"matmul": flops}, {"matmul": 3.0 * n * n * dtype.itemsize},
                             launches=1, dtype=dt)
            samples.append((work, t))
            results[f"{dt}/{n}"] = flops / t
            say(f"  matmul {dt} {n}^3: {seconds(t)}, {flops / t / 1e12:.3f} TFLOP/s")
            prev = (n, t)
            del a, b
    return samples, results


def _stream_samples(dev, cfg: BenchConfig, say: Callable[[str], None]):
    import jax.numpy as jnp

    samples, results = [], {}
    for size in cfg.stream_bytes:
        n = size // 4
        x = jnp.ones((n,), jnp.float32, device=dev)
        t = measure(lambda v: v * 2.0 + 1.0, (x,), dev, k=cfg.k, warmup=2).median_s
        samples.append((LayerWork({"elementwise": 2.0 * n}, {"elementwise": 2.0 * size}), t))
        results[f"elementwise/{size}"] = 2.0 * size / t
        say(f"  elementwise x*2+1 over {nbytes(size)}: {2 * size / t / 1e9:.2f} GB/s")
        t = measure(jnp.sum, (x,), dev, k=cfg.k, warmup=2).median_s
        samples.append((LayerWork({"reduction": float(n)}, {"reduction": float(size)}), t))
        results[f"reduction/{size}"] = size / t
        say(f"  reduction sum over {nbytes(size)}: {size / t / 1e9:.2f} GB/s")
        del x
    return samples, results


def _launch_overhead(dev, cfg: BenchConfig) -> tuple[float, float, float]:
    """(round trip of one blocking call, per call when pipelined, per extra
    input or output array) of a tiny op.

    The last is the round trip of the op over 16 arrays in and 16 out, less
    that over one, per array: a layer's call passes its parameters, optimizer
    state and gradients (GPT-2 blocks under Adam: dozens), and each costs the
    runtime a little, apart from any work (`DeviceProfile.buffer_overhead_s`).
    On XLA:CPU the 16 arrays compile to 16 fusions, so there it holds a
    kernel's dispatch too.
    """
    import jax
    import jax.numpy as jnp

    def roundtrip(f, args) -> float:
        for _ in range(5):
            _block(f(*args))
        rt = []
        for _ in range(cfg.launch_calls):
            t0 = time.perf_counter()
            _block(f(*args))
            rt.append(time.perf_counter() - t0)
        return statistics.median(rt)

    x = jax.device_put(jnp.zeros((1,), jnp.float32), dev)
    f = jax.jit(lambda v: v + 1.0)
    one = roundtrip(f, (x,))
    t0 = time.perf_counter()
    y = x
    for _ in range(cfg.launch_calls):
        y = f(y)
    _block(y)
    pipelined = (time.perf_counter() - t0) / cfg.launch_calls
    n = _BUFFER_ARRAYS
    xs = tuple(jax.device_put(jnp.full((1,), float(i), jnp.float32), dev) for i in range(n))
    many = roundtrip(jax.jit(lambda *vs: tuple(v + 1.0 for v in vs)), xs)
    return one, pipelined, max(0.0, (many - one) / (2 * (n - 1)))


#: Arrays in (and out) of the tiny op that prices a call's arrays.
_BUFFER_ARRAYS = 16


def profile_device(
    device, cfg: BenchConfig = FULL, progress: Callable[[str], None] | None = None
) -> DeviceProfile:
    """Measures one device and returns its profile (origin `measured`).

    Peaks stay the spec sheet's (a CPU's scaled to the cores present), raised
    to the best measured figure where a measurement beats them; efficiencies
    and launch overhead come from the measurements.

    Raises:
      ProfileError: the device is not present.
    """
    dev = resolve_device(device)
    name = global_device_name(dev)
    say = progress or (lambda m: None)
    kind = spec_kind_of(dev)
    say(f"{name}: {dev.device_kind} (spec sheet: {kind if kind in spec_kinds() else 'none'})")
    today = datetime.date.today().isoformat()
    where = f"measured {today} on {_host_id()}, jax {_jax_version()}"

    mm_samples, mm = _matmul_samples(dev, cfg, say)
    st_samples, st = _stream_samples(dev, cfg, say)
    roundtrip, pipelined, per_buffer = _launch_overhead(dev, cfg)
    say(f"  dispatch: {seconds(roundtrip)} round trip, {seconds(pipelined)} pipelined, "
        f"{seconds(per_buffer)} per array in or out")
    # The tiny op's round trip passes two arrays, which `predict` prices apart.
    launch = max(0.0, roundtrip - 2 * per_buffer)

    base, peaks, bw, sources = _paper_figures(dev, kind)
    _raise_to_measured(peaks, sources, mm, cfg.dtypes, where)
    best_bw = max(st.values())
    if best_bw > bw:
        bw = best_bw
        sources["memory_bandwidth_bytes_per_s"] = f"best streaming benchmark, {where}"
    mem, mem_src = live_capacity(dev)
    if mem is not None:
        sources["memory_bytes"] = f"{mem_src}, {where}"
    sources["launch_overhead_s"] = (
        f"round trip of a tiny jitted op (median of {cfg.launch_calls}), less its two "
        f"arrays' buffer_overhead_s, {where}"
    )
    if per_buffer > 0:
        sources["buffer_overhead_s"] = (
            f"round trip of a tiny jitted op over {_BUFFER_ARRAYS} arrays in and out, less "
            f"over one, per array (medians of {cfg.launch_calls}), {where}")
    prof = base.replace(
        name=name,
        kind=kind,
        peak_flops_per_s=peaks,
        memory_bandwidth_bytes_per_s=bw,
        memory_bytes=mem if mem is not None else base.memory_bytes,
        launch_overhead_s=launch,
        buffer_overhead_s=per_buffer,
        sources=sources,
        origin="measured",
        benchmarks={
            "device_kind": dev.device_kind,
            "matmul_flops_per_s": mm,
            "stream_bytes_per_s": st,
            "dispatch_roundtrip_s": roundtrip,
            "dispatch_pipelined_s": pipelined,
            "dispatch_per_buffer_s": per_buffer,
        },
    )
    return _calibrated(prof, mm_samples + st_samples, say)


def _paper_figures(dev, kind: str) -> tuple[DeviceProfile, dict, float, dict]:
    """(base profile, peaks, bandwidth, sources) before measurement: the spec sheet's.

    A CPU's peaks scale with the cores present (its sheet is a 16-core part).
    A device without a spec sheet starts from nothing: no peaks, no
    bandwidth, free, and no power figures.
    """
    if kind in spec_kinds():
        base = spec(kind)
        sources = dict(base.sources)
        peaks = dict(base.peak_flops_per_s)
        bw = base.memory_bandwidth_bytes_per_s
        if kind == "cpu":
            # The cpu sheet is a 16-core part; peak FLOP/s scales with cores.
            scale = (os.cpu_count() or 16) / 16.0
            for dt in peaks:
                peaks[dt] *= scale
                sources[f"peak_flops_per_s.{dt}"] += f"; scaled to {os.cpu_count()} cores"
        return base, peaks, bw, sources
    base = spec("h100" if dev.platform == "gpu" else "cpu")
    sources = {k: f"no spec sheet for {dev.device_kind!r}: set by hand" for k in base.sources}
    base = base.replace(price_per_hour=0.0, watts_busy=0.0, watts_idle=0.0, host_link=None)
    return base, {}, 0.0, sources


def _raise_to_measured(peaks: dict, sources: dict, mm: dict, dtypes: Sequence[str],
                       where: str) -> None:
    """Raises each dtype's peak (in place) to the best measured matmul where it beats it.

    A measurement above the paper peak means the paper is wrong for this
    part (or the dtype runs on other units): raise the peak, never exceed it.
    """
    for dt in dtypes:
        best = max((v for k, v in mm.items() if k.startswith(dt + "/")), default=0.0)
        key = "f32_matmul" if dt == "f32" and "f32_matmul" in peaks else dt
        if best > peaks.get(key, 0.0):
            peaks[key] = best
            sources[f"peak_flops_per_s.{key}"] = f"best matmul, {where}"
    peaks.setdefault("f32", peaks.get("f32_matmul", 1.0))


def _calibrated(prof: DeviceProfile, samples, say: Callable[[str], None]) -> DeviceProfile:
    """`prof` calibrated on the benchmark samples, `other` filled in from its neighbours."""
    prof = calibrate(prof, samples)
    # No benchmark isolates `other` (gathers, sorts): assume it moves bytes
    # like a reduction and computes like an elementwise op.
    effs = {c: dict(e) for c, e in prof.efficiencies.items()}
    effs["other"] = {"flops": effs["elementwise"]["flops"], "bytes": effs["reduction"]["bytes"]}
    srcs = dict(prof.sources)
    errs = [abs(predict(prof, w) - t) / t for w, t in samples]
    say(f"  calibrated on {len(errs)} samples: median |error| {100 * np.median(errs):.0f}%")
    srcs["efficiencies"] += "; 'other' copied from elementwise (flops) and reduction (bytes)"
    return prof.replace(efficiencies=effs, sources=srcs)


def _jax_version() -> str:
    import jax

    return jax.__version__


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


def profile_devices(
    devices: Sequence | None = None,
    *,
    quick: bool = False,
    config: BenchConfig | None = None,
    transfers: bool = True,
    progress: Callable[[str], None] | None = None,
) -> ProfileSet:
    """Measures the devices present (or `devices`) and every path between them.

    Under `jax.distributed` with several processes, every process must call
    it (with the same arguments): each measures its own devices among
    `devices` and the paths between them, then (with `transfers`) every pair
    of processes measures its `network` link (`profile_network`); every
    process returns the same ProfileSet, its devices named `p{process}/cpu:0`.

    Args:
      devices: JAX devices or names (`cpu:0`, `p1/cpu:0`); default: every
        device present (`jax.devices()` plus `jax.devices("cpu")`).
      quick: small sizes and few repetitions (transfers up to 16 MB).
      config: explicit sizes (overrides `quick`).
      transfers: also measure every ordered device pair (and, across
        processes, every network link).
      progress: called with one line per step (the CLI prints them).

    Returns:
      A ProfileSet of measured devices and links, with host metadata.

    Raises:
      ProfileError: a named device is not present.
    """
    import jax

    cfg = config or (QUICK if quick else FULL)
    devs = [resolve_device(d) for d in devices] if devices else list(present_devices().values())
    multi = jax.process_count() > 1
    me = jax.process_index()
    mine = [d for d in devs if d.process_index == me] if multi else devs
    say = progress or (lambda m: None)

    def log(msg: str) -> None:
        # The CLI prints progress itself; without a callback, log it.
        if progress is None:
            logging.info("%s", msg)
        say(msg)

    t0 = time.perf_counter()
    profiles = {}
    for d in mine:
        p = profile_device(d, cfg, log)
        profiles[p.name] = p
    links = []
    if transfers and len(mine) > 1:
        fresh = _Fresh()
        log("transfers:")
        for s in mine:
            for t in mine:
                if s is t:
                    continue
                for path in transfer_paths(s, t):
                    links.append(profile_link(s, t, path, cfg, log, fresh))
    mode = "quick" if cfg is QUICK else ("full" if cfg is FULL else "custom")
    meta = {
        "host": _host_id(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax_version": _jax_version(),
        "mode": mode,
        # Whether malloc had huge pages: a large CPU layer runs 15-25% apart
        # with and without them (hetpar._host_memory).
        "huge_pages": has_huge_pages(),
    }
    if multi:
        ends = {}
        for d in devs:
            ends.setdefault(d.process_index, d)
        network = profile_network(cfg, log, endpoints=ends) if transfers else []
        shared = _share("devices", json.dumps({
            "host": _host_id(), "devices": [p.to_json() for p in profiles.values()],
            "links": [lk.to_json() for lk in links]}))
        profiles, links = {}, []
        for part in map(json.loads, shared):
            for d in part["devices"]:
                p = DeviceProfile.from_json(d)
                profiles[p.name] = p
            links += [LinkProfile.from_json(lk) for lk in part["links"]]
        links += network
        meta["host"] = json.loads(shared[0])["host"]
        meta["processes"] = jax.process_count()
        meta["hosts"] = {process_link_name(i): json.loads(t)["host"]
                         for i, t in enumerate(shared)}
    log(f"profiled {len(profiles)} device(s), {len(links)} path(s) in "
        f"{time.perf_counter() - t0:.1f} s")
    return ProfileSet(profiles, tuple(links), meta)


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
                           "hetpar._distributed.initialize() first)")
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


def summary_table(profiles: ProfileSet) -> str:
    """A plain-text table of measured devices and links."""
    rows = [
        f"{'device':<10} {'kind':<8} {'f32 TFLOP/s':>12} {'bf16 TFLOP/s':>13} "
        f"{'stream GB/s':>12} {'dispatch us':>12}  eff matmul/elem(bytes)/red(bytes)"
    ]
    for p in profiles.devices.values():
        if p.origin != "measured":
            continue
        mm = p.benchmarks.get("matmul_flops_per_s", {})

        def best(dt, mm=mm):
            v = [x for k, x in mm.items() if k.startswith(dt + "/")]
            return f"{max(v) / 1e12:.3f}" if v else "-"

        st = max(p.benchmarks.get("stream_bytes_per_s", {"": math.nan}).values())
        e = p.efficiencies
        rows.append(
            f"{p.name:<10} {p.kind:<8} {best('f32'):>12} {best('bf16'):>13} "
            f"{st / 1e9:>12.2f} {p.launch_overhead_s * 1e6:>12.1f}  "
            f"{e['matmul']['flops']:.2f}/{e['elementwise']['bytes']:.2f}/"
            f"{e['reduction']['bytes']:.2f}"
        )
    if profiles.links:
        rows.append("")
        rows.append(f"{'link':<24} {'path':<20} {'latency us':>11} {'fit GB/s':>9}  "
                    "measured GB/s by size")
        for lk in profiles.links:
            n = len(lk.samples)  # at most nine sizes, evenly by rank
            shown = [lk.samples[i] for i in sorted({round(k * (n - 1) / 8) for k in range(9)})
                     ] if n else []
            by_size = ", ".join(f"{nbytes(b)}: {b / t / 1e9:.2f}" for b, t in shown)
            rows.append(
                f"{lk.src + ' -> ' + lk.dst:<24} {lk.path:<20} {lk.latency_s * 1e6:>11.1f} "
                f"{lk.bandwidth_bytes_per_s / 1e9:>9.2f}  {by_size}"
            )
    return "\n".join(rows)
