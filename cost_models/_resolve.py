"""A device list's graph.json devices, and the links between them.

Device names
------------
A device list mixes two kinds of entries:

- present (or profiled) devices by their JAX name, `platform:id`
  (`cpu:0`, `gpu:0`). Their graph.json name is that JAX name, so the runtime
  can find them; their `kind` is the spec-sheet kind (`cpu`, `h200`, ...).
  A name that a profile file describes may be planned for on a machine where
  it is absent, but not measured there.
- spec-sheet kinds (`h100`, `tpu-v5e`, `cpu`) for what-if planning. Each
  becomes a device named `<kind>:<i>` (`h100:0`, `h100:1` when listed twice),
  with the first index no present device already uses; `h100:1` may also be
  written out. They are always predicted, never measured: no JAX device
  stands behind them.

Links
-----
Measured links from the profile set, the fastest path per ordered pair over
the graph's edge sizes (the runtime takes the fastest path; the
`pinned_host_staged` path is left out because it times only half a
transfer). CPU devices of one host share its memory: between them a copy
runs at the host's memory bandwidth. An accelerator without a measured path
to a CPU uses its spec sheet's host link, and two accelerators without a
measured path go through the host (two hops in series).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from absl import logging

from hetpar.core import Link, ProfileError
from hetpar.cost_models._devices import present_devices, spec_kind_of
from hetpar.cost_models._profile import DeviceProfile, LinkProfile
from hetpar.cost_models._profiles import ProfileSet
from hetpar.cost_models._specs import spec_kinds

# Not a whole transfer path: it times only pinned host -> device (see LinkProfile).
_PARTIAL_PATHS = frozenset({"pinned_host_staged"})

_NAME = re.compile(r"^([A-Za-z0-9_.\-]+):(\d+)$")


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
    """A present device's profile: measured by name, else a measured one of its kind, else spec."""
    if name in profiles.devices:
        return profiles.device(name)
    kind = spec_kind_of(dev) if dev is not None else name.split(":")[0]
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
    spec_entries: list[tuple[str, int | None]] = []
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
        kind, idx = (m.group(1), int(m.group(2))) if m else (entry, None)
        if kind in spec_kinds():
            spec_entries.append((kind, idx))
            continue
        if m and kind in ("cpu", "gpu", "tpu", "cuda", "rocm"):
            raise ProfileError(
                f"device {entry!r} is not present (present: {', '.join(present)})"
                + ("; --measure needs a present device" if measure else "")
                + "; to plan for a device that is not here, name its spec-sheet kind "
                f"({', '.join(spec_kinds())}) or pass a profile file that describes it"
            )
        raise ProfileError(
            f"unknown device kind {entry!r}; known kinds: {', '.join(spec_kinds())}; "
            f"present devices: {', '.join(present)}"
        )
    taken |= {d.name for d in out}
    for kind, idx in spec_entries:
        if idx is None:
            idx = 0
            while f"{kind}:{idx}" in taken:
                idx += 1
        name = f"{kind}:{idx}"
        if name in taken:
            raise ProfileError(f"device {name!r} is listed twice or names a present device")
        taken.add(name)
        out.append(ResolvedDevice(name, profiles.device(kind).replace(name=name), None))
    return out


# -- links -----------------------------------------------------------------------


def _series(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """Two hops one after the other: latencies add, 1/bandwidths add."""
    return a[0] + b[0], 1.0 / (1.0 / a[1] + 1.0 / b[1])


def _link(src: ResolvedDevice, dst: ResolvedDevice, profiles: ProfileSet,
          sizes: Sequence[float], cpu_names: Sequence[str]) -> tuple[float, float] | None:
    """(latency_s, bandwidth) of the best path src -> dst, or None when unknown."""

    def measured(a: str, b: str) -> LinkProfile | None:
        cands = [lk for lk in profiles.links_between(a, b) if lk.path not in _PARTIAL_PATHS]
        if not cands:
            return None
        return min(cands, key=lambda lk: sum(lk.time(n) for n in sizes))

    lk = measured(src.name, dst.name)
    if lk is not None:
        return lk.latency_s, lk.bandwidth_bytes_per_s
    s_cpu, d_cpu = src.profile.device_class == "cpu", dst.profile.device_class == "cpu"
    if s_cpu and d_cpu:
        host = src.profile
        return host.launch_overhead_s, host.memory_bandwidth_bytes_per_s / 2  # read + write

    def to_host(acc: ResolvedDevice, outbound: bool) -> tuple[float, float] | None:
        # Any measured CPU of the host will do: its CPU devices share one memory.
        for c in cpu_names:
            lk = measured(acc.name, c) if outbound else measured(c, acc.name)
            if lk is not None:
                return lk.latency_s, lk.bandwidth_bytes_per_s
        hl = acc.profile.host_link
        return (hl.latency_s, hl.bandwidth_bytes_per_s) if hl else None

    if d_cpu:
        return to_host(src, True)
    if s_cpu:
        return to_host(dst, False)
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
            links.append(Link(a.name, b.name, bandwidth_bytes_per_s=lk[1], latency_s=lk[0]))
    return links
