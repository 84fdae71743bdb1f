"""Microbenchmarks of the devices present: what `hetpar profile` measures.

Per device: matmul FLOP/s at several sizes and dtypes, memory bandwidth of an
elementwise op and of a reduction over large arrays, and the round-trip cost
of dispatching a tiny executable. These become `LayerWork` samples and go
through the same `calibrate` the per-layer measurements use, so a measured
profile's efficiencies come from one least-squares fit (`profile_device`).

`profile_devices` runs them on every device, and times every transfer path
between the devices (`_link_bench`: `profile_link` over `transfer_paths`).
Under `jax.distributed` with several processes: each process measures its
own devices and the paths between them (names `p{process}/cpu:0`), and
every pair of processes the `network` link between them
(`_link_bench.profile_network`). Every process ends with the same
ProfileSet (shared through the job's key-value store). The sizes and
repetitions of a run are `_bench_config`'s.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from hetpar._host_memory import has_huge_pages
from hetpar.core import nbytes, seconds
from hetpar.cost_models._bench_config import (
    FULL,
    QUICK,
    BenchConfig,
    _block,
    _host_id,
    _jax_version,
)
from hetpar.cost_models._devices import (
    global_device_name,
    live_capacity,
    present_devices,
    resolve_device,
    spec_kind_of,
)
from hetpar.cost_models._link_bench import (
    _Fresh,
    _share,
    profile_link,
    profile_network,
    transfer_paths,
)
from hetpar.cost_models._measure import measure
from hetpar.cost_models._profile import (
    DeviceProfile,
    LinkProfile,
    process_link_name,
)
from hetpar.cost_models._profiles import ProfileSet
from hetpar.cost_models._roofline import LayerWork, calibrate, predict
from hetpar.cost_models._specs import spec, spec_kinds

_JNP_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


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
