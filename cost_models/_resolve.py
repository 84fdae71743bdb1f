"""A device list's graph.json devices, and the links between them.

Device names
------------
A device list mixes two kinds of entries:

- present (or profiled) devices by their JAX name, `platform:id`
  (`cpu:0`, `gpu:0`). Their graph.json name is that JAX name, so the runtime
  can find them; their `kind` is the spec-sheet kind (`cpu`, `h200`, ...).
  A name that a profile file describes may be planned for on a machine where
  it is absent, but not measured there; any other such name that is absent
  (`cpu:7`) is an error, even where its platform is also a spec-sheet kind.
- spec-sheet kinds (`h100`, `tpu-v5e`, `cpu`) for what-if planning. Each
  becomes a device named `<kind>:<i>` (`h100:0`, `h100:1` when listed twice),
  with the first index no present device already uses; `h100:1` may also be
  written out. They are always predicted, never measured: no JAX device
  stands behind them.

- under `jax.distributed`, names carry their process: `p1/cpu:0` (present
  or profiled), and `p1/h100` / `p1/h100:0` for a spec-sheet device placed on
  process 1 (what-if planning across hosts). A name without `p<i>/` belongs
  to no process in particular.

Links
-----
Measured links from the profile set: per ordered pair, the path the
runtime's transfer engine takes (`runtime_path`: GPU -> CPU through pinned
host memory, else `jax.device_put`), else the fastest measured path over
the graph's edge sizes (the `pinned_host_staged` path is left out because it
times only half a transfer). A measured path's samples price its copies as a
curve (`LinkProfile.copy_curve`, `Link.curve`), not as the straight line
fitted through them. CPU devices of one host share its memory: between them a copy
runs at the host's memory bandwidth. An accelerator without a measured path
to a CPU uses its spec sheet's host link, and two accelerators without a
measured path go through the host (two hops in series), unless both are
of one class whose spec sheet names a `peer_link` (NVLink between SXM
GPUs): then that.

Two devices of different processes (`p0/...` and `p1/...`) without a link of
their own are joined by the network link between their processes,
`ProfileSet.network_link`: measured by `hetpar profile` under
`jax.distributed`, declared (`ProfileSet.with_network_link`, `--link
p0-p1=GBps`), else the documented default (12.5 GB/s, 20 us; docs/formats.md).
Within one process (or between names without a process) links are as above.
`override_network_links` sets the network links of a table already built
(`hetpar plan --graph ... --link`).

Memory places
-------------
An accelerator's pinned host memory (JAX's `pinned_host` memory kind) is a
place where state can live off the accelerator: host RAM the accelerator
copies to and from at bus speed. Measured on an H100 host, those copies
run ~50 GB/s each way while copies between the GPU and the CPU *device* run
~7 GB/s. So beside every accelerator of a list that also has a CPU device
(a host whose RAM can hold the state), the table gets a device named
`<accelerator>:pinned_host` (`gpu:0:pinned_host`, `h100:0:pinned_host`) of
kind `pinned_host` (`memory_places`): the host CPU device's memory, no
price, no power, no compute group, no layer times (no layer computes
there), linked both ways to its accelerator only. Those links are the
measured `pinned_host_staged` paths of that accelerator (the copy between
pinned memory and the device, which is all a state home in pinned memory
needs), else its spec sheet's host link. A present accelerator without
pinned host memory gets no place. A memory place named in the device list
is kept even without a CPU device (the host memory then comes from the CPU
profile), so a table rebuilt for a plan's devices has the same names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import NamedTuple

from absl import logging

from hetpar._host_memory import pinned_pool_bytes
from hetpar.core import CostTable, Link, ProfileError, memory_place
from hetpar.core._graph import curve_rate
from hetpar.cost_models._devices import (
    has_pinned_host,
    host_cores,
    live_capacity,
    local_name,
    present_devices,
    process_of,
    runtime_path,
    spec_kind_of,
)
from hetpar.cost_models._profile import DEFAULT_NETWORK_LATENCY_S, DeviceProfile, LinkProfile
from hetpar.cost_models._profiles import NetworkLink, ProfileSet, parse_network_link
from hetpar.cost_models._specs import spec_kinds

# Not whole transfer paths: they time only the copy between pinned host memory
# and the device (see LinkProfile), one way or both at once.
_PARTIAL_PATHS = frozenset({"pinned_host_staged", "pinned_host_duplex"})

# `cpu:0`, `h100:1`, `p1/cpu:0`; and a bare kind, `h100`, `p1/h100`.
_NAME = re.compile(r"^(?:p(\d+)/)?([A-Za-z0-9_.\-]+):(\d+)$")
_KIND = re.compile(r"^(?:p(\d+)/)?([A-Za-z0-9_.\-]+)$")
#: The kind (and memory kind) of the memory places a table gets.
PLACE_KIND = "pinned_host"


# -- devices ---------------------------------------------------------------------


class ResolvedDevice:
    """One device of the table: its graph.json name, profile and JAX device (or None)."""

    def __init__(self, name: str, profile: DeviceProfile, jax_device=None):
        self.name = name
        self.profile = profile
        self.jax_device = jax_device

    @property
    def kind(self) -> str:
        return self.profile.kind


def _profile_for_present(name: str, dev, profiles: ProfileSet) -> DeviceProfile:
    """A present device's profile as this machine has it (`as_present`): measured
    by name, else a measured one of its kind, else its spec sheet."""
    return as_present(_named_profile(name, dev, profiles), dev)


def as_present(prof: DeviceProfile, dev) -> DeviceProfile:
    """`prof` with what a present device `dev` reads off this machine: its
    capacity (`live_capacity`: the allocator's limit, the host's RAM), and for
    a CPU described by its spec sheet (a 16-core part), peaks scaled to the
    cores here. A profile measured elsewhere keeps its times; capacity is
    always the machine's own: a plan that fits the spec sheet's 141 GB ran
    out of memory under an H200's 112.6 GB allocator limit."""
    if dev is None:
        return prof
    changes: dict = {}
    sources = dict(prof.sources)
    mem, src = live_capacity(dev)
    if mem is not None:
        changes["memory_bytes"] = mem
        sources["memory_bytes"] = src
    if dev.platform == "cpu" and prof.origin == "spec":
        scale = host_cores() / float(_SPEC_CPU_CORES)
        changes["peak_flops_per_s"] = {dt: f * scale for dt, f in prof.peak_flops_per_s.items()}
        for dt in prof.peak_flops_per_s:
            sources[f"peak_flops_per_s.{dt}"] = (
                f"{prof.sources.get(f'peak_flops_per_s.{dt}', 'spec sheet')}; scaled to the "
                f"{host_cores()} cores here")
    if not changes:
        return prof
    return prof.replace(sources=sources, **changes)


#: The cores of the part the `cpu` spec sheet describes (cost_models/specs/cpu.json).
_SPEC_CPU_CORES = 16


def _named_profile(name: str, dev, profiles: ProfileSet) -> DeviceProfile:
    if name in profiles.devices:
        return profiles.device(name)
    kind = spec_kind_of(dev) if dev is not None else local_name(name).split(":")[0]
    # Virtual devices of one host (cpu:1 beside a measured cpu:0) are the same silicon.
    for p in profiles.devices.values():
        if p.origin == "measured" and p.kind == kind:
            return p
    if kind not in spec_kinds():
        raise ProfileError(
            f"device {name!r} (kind {kind!r}) has no measured profile and no spec sheet; "
            f"run `hetpar profile --out profiles.json` and pass --profiles profiles.json"
        )
    return profiles.device(kind)


def resolve_devices(
    devices: Sequence[str], profiles: ProfileSet, *, measure: bool = False
) -> list[ResolvedDevice]:
    """Graph.json devices for a device list; see the module docstring for the names.

    Raises:
      ProfileError: an entry is neither a present or profiled device nor a
        spec-sheet kind; or `measure` asks for a device that is not present.
    """
    if not devices:
        raise ProfileError("no devices given; list some, e.g. --devices cpu:0,gpu:0,h100")
    present = present_devices()
    out: list[ResolvedDevice] = []
    taken: set[str] = set(present)
    spec_entries: list[tuple[int | None, str, int | None]] = []
    for raw in devices:
        entry = raw.strip()
        m = _NAME.match(entry)
        if entry in present or (entry in profiles.devices and m and \
                profiles.devices[entry].origin == "measured"):
            if any(d.name == entry for d in out):
                raise ProfileError(f"device {entry!r} is listed twice")
            if measure and entry not in present:
                raise ProfileError(
                    f"cannot measure {entry!r}: it is not present on this machine (present: "
                    f"{', '.join(present)}); drop --measure to predict it from its profile"
                )
            jd = present.get(entry)
            prof = _profile_for_present(entry, jd, profiles).replace(name=entry)
            out.append(ResolvedDevice(entry, prof, jd))
            continue
        if m:
            proc, kind, idx = m.group(1), m.group(2), int(m.group(3))
        else:
            k = _KIND.match(entry)
            proc, kind, idx = (k.group(1), k.group(2), None) if k else (None, entry, None)
        # One rule for every platform, `cpu` included though it is also a spec
        # kind: a JAX name with an index (`cpu:7`, `gpu:0`) means that device,
        # refused when absent; the bare kind (`cpu`) is the spec sheet.
        if m and kind in ("cpu", "gpu", "tpu", "cuda", "rocm"):
            raise ProfileError(
                f"device {entry!r} is not present (present: {', '.join(present)})"
                + ("; --measure needs a present device" if measure else "")
                + "; to plan for a device that is not here, name its spec-sheet kind "
                f"({', '.join(spec_kinds())}) or pass a profile file that describes it"
            )
        if kind in spec_kinds():
            spec_entries.append((None if proc is None else int(proc), kind, idx))
            continue
        raise ProfileError(
            f"unknown device kind {entry!r}; known kinds: {', '.join(spec_kinds())}; "
            f"present devices: {', '.join(present)}"
        )
    taken |= {d.name for d in out}
    for proc, kind, idx in spec_entries:
        prefix = "" if proc is None else f"p{proc}/"
        if idx is None:
            idx = 0
            while f"{prefix}{kind}:{idx}" in taken:
                idx += 1
        name = f"{prefix}{kind}:{idx}"
        if name in taken:
            raise ProfileError(f"device {name!r} is listed twice or names a present device")
        taken.add(name)
        out.append(ResolvedDevice(name, profiles.device(kind).replace(name=name), None))
    return out


# -- links -----------------------------------------------------------------------


class _Path(NamedTuple):
    """A priced path: `latency_s + bytes / bandwidth`, or `latency_s + curve(bytes)`
    where measured samples give a curve (`Link`)."""

    latency_s: float
    bandwidth: float
    curve: tuple[tuple[float, float], ...] = ()

    @classmethod
    def of(cls, lk: LinkProfile, sizes: Sequence[float]) -> _Path:
        """`lk` priced by its samples' curve where they give one. What reads a
        bandwidth alone (collectives, reports) gets the curve's rate at the
        graph's typical copy (`typical_copy`), as `profile="measure"` does,
        and at 1 MiB at least, as its curves start: below that the latency
        is most of a copy, and the rate is the samples' noise (a small
        model's kB copies read 1.5 to 240 GB/s off one H200 host's curves)."""
        curve = lk.copy_curve()
        rate = curve_rate(curve, max(typical_copy(sizes), float(1 << 20))) if curve else None
        return cls(lk.latency_s, rate or lk.bandwidth_bytes_per_s, curve)

    def link(self, src: str, dst: str) -> Link:
        return Link(src, dst, bandwidth_bytes_per_s=self.bandwidth, latency_s=self.latency_s,
                    curve=self.curve)


def typical_copy(sizes: Sequence[float]) -> float:
    """The size that half the bytes of `sizes` come in copies of at most (a
    byte-weighted median): where one bandwidth is read off a link's curve.
    Copies from an H100 host's CPU device (put to a SingleDeviceSharding, as
    the engine then did) ran 1.2 GB/s at 154 MB, where a plan's 28 MB weights
    arrived at ~3 GB/s."""
    ordered = sorted(float(b) for b in sizes if b > 0) or [1.0]
    half, run = sum(ordered) / 2.0, 0.0
    for b in ordered:
        run += b
        if run >= half:
            return b
    return ordered[-1]


def _series(a: _Path, b: _Path) -> _Path:
    """Two hops one after the other: latencies add, 1/bandwidths add (each
    hop's straight line: the curves are not composed)."""
    return _Path(a.latency_s + b.latency_s, 1.0 / (1.0 / a.bandwidth + 1.0 / b.bandwidth))


def _link(src: ResolvedDevice, dst: ResolvedDevice, profiles: ProfileSet,
          sizes: Sequence[float], cpu_names: Sequence[str]) -> _Path | None:
    """The path src -> dst the runtime takes, or None when unknown."""

    def measured(a: str, b: str, a_class: str, b_class: str) -> LinkProfile | None:
        cands = [lk for lk in profiles.links_between(a, b) if lk.path not in _PARTIAL_PATHS]
        # The transfer engine's path where it was measured (its choice is
        # fixed), else the fastest over the graph's edge sizes.
        pinned = any(lk.path == "pinned_host" for lk in cands)
        taken = [lk for lk in cands if lk.path == runtime_path(a_class, b_class, pinned)]
        return min(taken or cands, key=lambda lk: sum(lk.time(n) for n in sizes),
                   default=None)

    s_class, d_class = src.profile.device_class, dst.profile.device_class
    lk = measured(src.name, dst.name, s_class, d_class)
    if lk is not None:
        return _Path.of(lk, sizes)
    s_proc, d_proc = process_of(src.name), process_of(dst.name)
    if s_proc is not None and d_proc is not None and s_proc != d_proc:
        net = profiles.network_link(s_proc, d_proc, sizes)
        return _Path(net.latency_s, net.bandwidth_bytes_per_s)
    s_cpu, d_cpu = s_class == "cpu", d_class == "cpu"
    if s_cpu and d_cpu:
        host = src.profile
        return _Path(host.launch_overhead_s, host.memory_bandwidth_bytes_per_s / 2)  # r + w

    def to_host(acc: ResolvedDevice, outbound: bool) -> _Path | None:
        # Any measured CPU of the host will do: its CPU devices share one memory.
        a_class = acc.profile.device_class
        for c in cpu_names:
            lk = (measured(acc.name, c, a_class, "cpu") if outbound
                  else measured(c, acc.name, "cpu", a_class))
            if lk is not None:
                return _Path.of(lk, sizes)
        hl = acc.profile.host_link
        return _Path(hl.latency_s, hl.bandwidth_bytes_per_s) if hl else None

    if d_cpu:
        return to_host(src, True)
    if s_cpu:
        return to_host(dst, False)
    peer = src.profile.peer_link
    if peer is not None and s_class == d_class:  # NVLink between two SXM GPUs
        return _Path(peer.latency_s, peer.bandwidth_bytes_per_s)
    a, b = to_host(src, True), to_host(dst, False)
    return _series(a, b) if a and b else None


def resolve_links(devs: Sequence[ResolvedDevice], profiles: ProfileSet,
                  sizes: Sequence[float]) -> list[Link]:
    """The graph.json links between every ordered pair of `devs`; see the module docstring.

    Args:
      devs: from `resolve_devices`.
      profiles: the profile set whose measured links count.
      sizes: transfer sizes (the graph's edge bytes) that pick the fastest path.

    Returns:
      One Link per ordered pair whose path is known; a pair without one is
      logged and left out (its devices cannot hold adjacent layers).
    """
    cpu_names = [d.name for d in devs if d.profile.device_class == "cpu"]
    cpu_names += [n for n, p in profiles.devices.items()
                  if p.origin == "measured" and p.device_class == "cpu" and n not in cpu_names]
    links = []
    for a in devs:
        for b in devs:
            if a is b:
                continue
            lk = _link(a, b, profiles, sizes, cpu_names)
            if lk is None:
                logging.warning("no link from %s to %s: they cannot hold adjacent layers",
                                a.name, b.name)
                continue
            links.append(lk.link(a.name, b.name))
    return links


# -- memory places ------------------------------------------------------------


class MemoryPlace:
    """A memory place of the table: its name, its accelerator, its host's memory and
    the paths both ways."""

    def __init__(self, name: str, device: ResolvedDevice, memory_bytes: float,
                 host: str | None, to_place: _Path, from_place: _Path):
        self.name = name
        self.device = device
        self.memory_bytes = memory_bytes
        self.host = host
        self.to_place = to_place
        self.from_place = from_place

    def links(self) -> list[Link]:
        """The graph.json links accelerator -> place and place -> accelerator."""
        acc = self.device.name
        return [self.to_place.link(acc, self.name), self.from_place.link(self.name, acc)]


def split_places(devices: Sequence[str]) -> tuple[list[str], list[str]]:
    """(devices, memory places) of a device list: `gpu:0:pinned_host` names a place."""
    devs, places = [], []
    for raw in devices:
        (places if memory_place(raw.strip())[1] is not None else devs).append(raw)
    return devs, [p.strip() for p in places]


def memory_places(devs: Sequence[ResolvedDevice], profiles: ProfileSet,
                  sizes: Sequence[float], listed: Sequence[str] = ()) -> list[MemoryPlace]:
    """The pinned host memory place of every accelerator of `devs` when a CPU device
    is among them, and of those `listed`; see the module docstring.

    Raises:
      ProfileError: a listed place whose accelerator is not in `devs`, or whose
        memory kind is not `pinned_host`.
    """
    by_name = {d.name: d for d in devs}
    cpus = [d for d in devs if d.profile.device_class == "cpu"]
    wanted = {}
    for name in listed:
        acc, kind = memory_place(name)
        if kind != PLACE_KIND:
            raise ProfileError(f"memory place {name!r}: only {PLACE_KIND!r} places are "
                               "planned for")
        if acc not in by_name:
            raise ProfileError(f"memory place {name!r} names {acc!r}, which is not in the "
                               f"device list ({', '.join(by_name)}); list it too")
        wanted[acc] = name
    if cpus:
        for d in devs:
            if d.profile.device_class != "cpu":
                wanted.setdefault(d.name, f"{d.name}:{PLACE_KIND}")
    cpu_names = [d.name for d in cpus] + [n for n, p in profiles.devices.items()
                                          if p.origin == "measured" and p.device_class == "cpu"]
    out = []
    for d in devs:
        if d.name not in wanted or d.profile.device_class == "cpu":
            continue
        # The host is a CPU of the accelerator's process where the list has one.
        mine = [c for c in cpus if process_of(c.name) == process_of(d.name)] or cpus
        if mine:
            memory, host = float(mine[0].profile.memory_bytes), mine[0].name
        else:
            memory, host = float(profiles.device("cpu").memory_bytes), None
        jd = d.jax_device
        if jd is not None and (jd.platform == "cpu" or not has_pinned_host(jd)):
            continue  # no pinned host memory behind it (or a CPU standing in for a GPU)
        if jd is not None and jd.platform == "gpu":
            # One pool per process (XLA's GPU client makes one pinned host
            # allocator): its GPUs' places share it, an equal part each.
            sharing = sum(1 for e in devs if e.name in wanted and e.jax_device is not None
                          and e.jax_device.platform == "gpu"
                          and e.jax_device.process_index == jd.process_index)
            memory = min(memory, pinned_pool_bytes() / max(sharing, 1))
        to_place = _staged(d, profiles, cpu_names, sizes, outbound=True)
        from_place = _staged(d, profiles, cpu_names, sizes, outbound=False)
        if to_place is None or from_place is None or memory <= 0:
            logging.warning("no pinned host memory place for %s: no host link known", d.name)
            continue
        out.append(MemoryPlace(wanted[d.name], d, memory, host, to_place, from_place))
    return out


def _staged(acc: ResolvedDevice, profiles: ProfileSet, cpu_names: Sequence[str],
            sizes: Sequence[float], *, outbound: bool) -> _Path | None:
    """The path between `acc` and its pinned host memory, as streamed state
    sees it: copies in and out at once.

    The measured `pinned_host_duplex` path (both ways at once; any CPU of
    the host), else the measured one-way `pinned_host_staged` path, else the
    spec sheet's host link at its duplex bandwidth where the sheet gives one.
    On an H100 host one way ran 53.6 GB/s and each way 46.5 GB/s with both
    at once: planned with the one-way figure, a 5B offload step was predicted
    35% short of the measured one.
    """
    for path in ("pinned_host_duplex", "pinned_host_staged"):
        for c in cpu_names:
            src, dst = (acc.name, c) if outbound else (c, acc.name)
            cands = [lk for lk in profiles.links_between(src, dst) if lk.path == path]
            if cands:
                return _Path.of(min(cands, key=lambda lk: sum(lk.time(n) for n in sizes)), sizes)
    hl = acc.profile.host_link
    if hl is None and acc.kind in spec_kinds():
        hl = profiles.device(acc.kind).host_link
    if hl is None:
        return None
    return _Path(hl.latency_s, hl.duplex_bandwidth_bytes_per_s or hl.bandwidth_bytes_per_s)


# -- network links of a built table ---------------------------------------------


def override_network_links(table: CostTable,
                           links: Sequence[NetworkLink | str]) -> CostTable:
    """`table` with the links between the devices of two processes set to `links`.

    For each link (a `NetworkLink`, or `--link` text such as
    `"p0-p1=12.5@20"`, see `parse_network_link`), every ordered pair of a
    device of process A (named `pA/...`) and one of process B, both ways,
    gets its bandwidth, and its latency when given (else the pair keeps the
    latency it had, or the default's 20 us where it had no link). Memory
    places keep their links. Later links win. No JAX is imported: `hetpar
    plan --graph` uses this.

    Raises:
      ProfileError: a malformed text, or a process with no device in `table`.
    """
    parsed = [parse_network_link(lk) if isinstance(lk, str) else lk for lk in links]
    if not parsed:
        return table
    names = [d.name for d in table.devices if memory_place(d.name)[1] is None]
    by_pair = {(lk.src, lk.dst): lk for lk in table.links}
    for net in parsed:
        ends = {}
        for p in (net.a, net.b):
            ends[p] = [n for n in names if process_of(n) == p]
            if not ends[p]:
                what = f"--link {net.text}" if net.text else f"network link p{net.a}-p{net.b}"
                raise ProfileError(
                    f"{what}: the table has no device of process {p} (its devices: "
                    f"{', '.join(names)}); devices of several processes are named "
                    "p0/cpu:0, p1/cpu:0, ...")
        for x, y in ((net.a, net.b), (net.b, net.a)):
            for s in ends[x]:
                for d in ends[y]:
                    old = by_pair.get((s, d))
                    lat = net.latency_s if net.latency_s is not None else (
                        old.latency_s if old is not None else DEFAULT_NETWORK_LATENCY_S)
                    by_pair[(s, d)] = Link(s, d, bandwidth_bytes_per_s=net.bandwidth_bytes_per_s,
                                           latency_s=lat)
    meta = dict(table.meta)
    meta["network_links"] = [net.source() for net in parsed]
    return dataclasses.replace(table, links=tuple(by_pair.values()), meta=meta)
