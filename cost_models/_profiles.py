"""Sets of device profiles and links: the profile file, spec kinds, sibling calibration.

A `ProfileSet` is what `hetpar profile --out` writes and `load_profiles`
reads, merged over the built-in spec sheets: device profiles by name
(`DeviceProfile`, `_profile`) and the measured or declared links between
them. A spec-sheet kind that was not measured borrows the calibration of
its nearest measured sibling (`nearest_sibling`, `transfer_calibration`).

Links between processes (`jax.distributed`) are links between whole
processes, `p0` -> `p1` of path `network`: measured by `hetpar profile`
under several processes, declared with `with_network_link` (`--link
p0-p1=GBps[@LATENCY_us]`, `parse_network_link`), else the documented default
(`default_network_link`); `network_link` says which applies.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from absl import logging

from hetpar.core import ProfileError, load_json, save_json
from hetpar.cost_models._devices import process_of
from hetpar.cost_models._group_figures import check_stored
from hetpar.cost_models._profile import (
    FORMAT,
    NETWORK_PATH,
    VERSION,
    DeviceProfile,
    LinkProfile,
    default_network_link,
    file_devices,
    jsonable,
    process_link_name,
)
from hetpar.cost_models._specs import spec, spec_kinds


@dataclasses.dataclass(frozen=True)
class ProfileSet:
    """Device profiles by name, and the links between them.

    Attributes:
      devices: name -> DeviceProfile.
      links: every measured or declared transfer path.
      meta: free-form metadata (host, date, jax version) of the file.
    """

    devices: Mapping[str, DeviceProfile]
    links: tuple[LinkProfile, ...] = ()
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def device(self, name: str) -> DeviceProfile:
        """The profile named `name`; a spec kind not measured gets its sibling's calibration.

        Raises:
          ProfileError: no profile of that name and no spec sheet of that kind.
        """
        if name in self.devices:
            prof = self.devices[name]
            if prof.origin == "spec":
                sib = nearest_sibling(prof, self.devices.values())
                if sib is not None:
                    return transfer_calibration(sib, prof)
            return prof
        return self.replace_devices({name: spec(name)}).device(name)

    def replace_devices(self, devices: Mapping[str, DeviceProfile]) -> ProfileSet:
        """Returns a copy with `devices` added or replaced by name."""
        return dataclasses.replace(self, devices={**self.devices, **devices})

    def links_between(self, src: str, dst: str) -> list[LinkProfile]:
        """Every path from `src` to `dst`."""
        return [lk for lk in self.links if lk.src == src and lk.dst == dst]

    def fastest_link(self, src: str, dst: str, nbytes: float) -> LinkProfile:
        """The path from `src` to `dst` that moves `nbytes` soonest.

        Raises:
          ProfileError: no path between them is known.
        """
        cands = self.links_between(src, dst)
        if not cands:
            raise ProfileError(
                f"no transfer path from {src!r} to {dst!r} is known; run `hetpar profile` "
                "on a host that has both devices, or add a link to the profile file"
            )
        return min(cands, key=lambda lk: lk.time(nbytes))

    def network_link(self, src: int | str, dst: int | str,
                     sizes: Sequence[float] = ()) -> LinkProfile:
        """The link from process `src` to process `dst` (ints or `p0`), for
        every pair of their devices that has no link of its own.

        The fastest over `sizes` (bytes; by bandwidth when empty) of the
        `network` entries `p{src}` -> `p{dst}` (measured by `hetpar profile`
        under `jax.distributed`, or declared by `with_network_link`); else the
        entry the other way (its `source` says so); else the documented
        default (`default_network_link`: 12.5 GB/s, 20 us).
        """
        a, b = _process(src), _process(dst)
        na, nb = process_link_name(a), process_link_name(b)

        def best(cands: list[LinkProfile]) -> LinkProfile:
            if sizes:
                return min(cands, key=lambda lk: sum(lk.time(n) for n in sizes))
            return max(cands, key=lambda lk: lk.bandwidth_bytes_per_s)

        cands = self.links_between(na, nb)
        if cands:
            return best(cands)
        back = self.links_between(nb, na)
        if back:
            lk = best(back)
            return dataclasses.replace(lk, src=na, dst=nb,
                                       source=f"the link {nb} -> {na} (none measured this way): "
                                              + lk.source)
        return default_network_link(na, nb)

    def with_network_link(self, a: int | str, b: int | str, bandwidth_bytes_per_s: float,
                          latency_s: float | None = None, *, both_ways: bool = True,
                          source: str | None = None) -> ProfileSet:
        """A copy whose link from process `a` to process `b` (and back, with
        `both_ways`) is `bandwidth_bytes_per_s` and `latency_s`: for every pair
        of their devices, in cost tables built from it.

        Replaces the `p{a}` -> `p{b}` entries measured or declared before, and
        every link between a device of `a` and a device of `b`. `latency_s`
        None keeps the latency the pair had (`network_link`: measured,
        declared, else the default's 20 us).

        Args:
          a, b: process indices, or their names `p0`, `p1`; different.
          bandwidth_bytes_per_s: positive, finite.
          latency_s: seconds per transfer, >= 0; None: as it was.
          both_ways: also set `b` -> `a`.
          source: the figures' source (default: "declared ...").

        Raises:
          ProfileError: the same process twice, or a bandwidth or latency out of range.
        """
        a, b = _process(a), _process(b)
        if a == b:
            raise ProfileError(f"a network link joins two different processes, got p{a} twice")
        bw = float(bandwidth_bytes_per_s)
        if not (math.isfinite(bw) and bw > 0):
            raise ProfileError(f"network link p{a}-p{b}: bandwidth must be a positive number "
                               f"of bytes/s, got {bandwidth_bytes_per_s!r}")
        if latency_s is not None and not (math.isfinite(float(latency_s)) and latency_s >= 0):
            raise ProfileError(f"network link p{a}-p{b}: latency must be >= 0 seconds, "
                               f"got {latency_s!r}")
        pairs = [(a, b), (b, a)] if both_ways else [(a, b)]
        added = []
        for x, y in pairs:
            lat = float(latency_s) if latency_s is not None else self.network_link(x, y).latency_s
            added.append(LinkProfile(
                src=process_link_name(x), dst=process_link_name(y), path=NETWORK_PATH,
                latency_s=lat, bandwidth_bytes_per_s=bw,
                source=source or (f"declared: {bw / 1e9:g} GB/s, {lat * 1e6:g} us per transfer "
                                  f"(with_network_link / --link)")))

        def replaced(lk: LinkProfile) -> bool:
            ends = (_link_process(lk.src), _link_process(lk.dst))
            return ends in pairs

        kept = tuple(lk for lk in self.links if not replaced(lk))
        return dataclasses.replace(self, links=kept + tuple(added))

    def with_network_links(self, links: Iterable[NetworkLink | str]) -> ProfileSet:
        """`with_network_link` for each of `links` (`NetworkLink`s, or `--link`
        texts such as `"p0-p1=12.5@20"`), both ways, in order.

        Raises:
          ProfileError: a malformed text (see `parse_network_link`).
        """
        out = self
        for item in links:
            lk = parse_network_link(item) if isinstance(item, str) else item
            out = out.with_network_link(lk.a, lk.b, lk.bandwidth_bytes_per_s, lk.latency_s,
                                        source=lk.source())
        return out

    def to_json(self) -> dict[str, Any]:
        """Returns the file form."""
        out: dict[str, Any] = {"format": FORMAT, "version": VERSION}
        if self.meta:
            out["meta"] = jsonable(self.meta)
        out["devices"] = [d.to_json() for d in self.devices.values()]
        out["links"] = [lk.to_json() for lk in self.links]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProfileSet:
        """Validates and builds a ProfileSet from the file form.

        Raises:
          ProfileError: wrong format or version, or a bad device or link.
        """
        devs = file_devices(data)
        devices: dict[str, DeviceProfile] = {}
        for d in devs:
            p = DeviceProfile.from_json(d)
            if p.name in devices:
                raise ProfileError(f"profile file: device {p.name!r} appears twice")
            devices[p.name] = p
        links = tuple(
            LinkProfile.from_json(lk, f"link #{i}") for i, lk in enumerate(data.get("links", []))
        )
        meta = dict(data.get("meta", {}))
        check_stored(meta)  # what its devices measured together (`_group_figures`)
        return cls(devices, links, meta)


@dataclasses.dataclass(frozen=True)
class NetworkLink:
    """A declared link between two processes, both ways: what `--link
    pA-pB=GBps[@LATENCY_us]` says (`parse_network_link`).

    Attributes:
      a, b: process indices, different.
      bandwidth_bytes_per_s: positive.
      latency_s: seconds per transfer, or None to keep the measured (else
        default) latency.
      text: the text it was parsed from, if any.
    """

    a: int
    b: int
    bandwidth_bytes_per_s: float
    latency_s: float | None = None
    text: str | None = None

    def source(self) -> str:
        """The `source` of the links it declares."""
        lat = "latency as measured, else the default" if self.latency_s is None else \
            f"{self.latency_s * 1e6:g} us per transfer"
        how = f"--link {self.text}" if self.text else "with_network_link"
        return f"declared ({how}): {self.bandwidth_bytes_per_s / 1e9:g} GB/s, {lat}"


_LINK_FORM = "pA-pB=GBps or pA-pB=GBps@LATENCY_us, e.g. p0-p1=12.5 or p0-p1=12.5@20"
_LINK_TEXT = re.compile(r"^p(\d+)-p(\d+)=([^@]+?)(?:@(.+))?$")


def parse_network_link(text: str) -> NetworkLink:
    """`"p0-p1=12.5@20"` -> NetworkLink(0, 1, 12.5e9 bytes/s, 20e-6 s).

    The form of `--link`: `pA-pB=GBps`, optionally `@LATENCY_us`; GB are
    1e9 bytes, the latency is in microseconds (without it the pair keeps its
    measured, else default, latency). The link holds both ways, for every
    pair of a device of process A and a device of process B.

    Raises:
      ProfileError: not of that form, A == B, a bandwidth that is not a
        positive number, or a latency that is not a number >= 0.
    """
    raw = str(text)
    m = _LINK_TEXT.fullmatch(raw.replace(" ", ""))
    if m is None:
        raise ProfileError(f"--link expects {_LINK_FORM}; got {raw!r}")
    a, b = int(m.group(1)), int(m.group(2))
    if a == b:
        raise ProfileError(f"--link {raw!r}: a link joins two different processes "
                           f"(expected {_LINK_FORM})")
    gbps = _number(m.group(3))
    if not (gbps > 0 and math.isfinite(gbps)):
        raise ProfileError(f"--link {raw!r}: the bandwidth must be a positive number of GB/s "
                           f"(expected {_LINK_FORM})")
    lat = None
    if m.group(4) is not None:
        us = _number(m.group(4).removesuffix("us"))
        if not (us >= 0 and math.isfinite(us)):
            raise ProfileError(f"--link {raw!r}: the latency must be a number of microseconds "
                               f">= 0 (expected {_LINK_FORM})")
        lat = us * 1e-6
    return NetworkLink(a, b, gbps * 1e9, lat, raw)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _process(p: int | str) -> int:
    """0 for 0 or `p0`.

    Raises:
      ProfileError: neither.
    """
    if isinstance(p, int) and not isinstance(p, bool) and p >= 0:
        return p
    if isinstance(p, str) and re.fullmatch(r"p\d+", p):
        return int(p[1:])
    raise ProfileError(f"not a process: {p!r} (expected an index such as 1, or 'p1')")


def _link_process(end: str) -> int | None:
    """The process of a link end: `p1` (a whole process) or `p1/cpu:0` (a device)."""
    if re.fullmatch(r"p\d+", end):
        return int(end[1:])
    return process_of(end)


def nearest_sibling(
    target: DeviceProfile, candidates: Iterable[DeviceProfile]
) -> DeviceProfile | None:
    """The measured profile closest to `target`, or None.

    Nearest sibling: a measured device of the same class (cpu, gpu, tpu);
    among several, the same kind first, then the one whose f32 peak is
    closest on a log scale (an H200 borrows from an H100 before a T4).
    """
    sibs = [
        c
        for c in candidates
        if c.origin == "measured" and c.device_class == target.device_class
    ]
    if not sibs:
        return None

    def distance(c: DeviceProfile) -> tuple[int, float]:
        ratio = c.peak_flops_per_s["f32"] / target.peak_flops_per_s["f32"]
        return (c.kind != target.kind, abs(math.log(ratio)))

    return min(sibs, key=distance)


def save_profiles(path: str | os.PathLike, profiles: ProfileSet) -> None:
    """Writes `profiles` to `path` in the file form."""
    save_json(path, profiles.to_json())


def load_profiles(path: str | os.PathLike | None = None, *, specs: bool = True) -> ProfileSet:
    """Reads a profile file and merges it over the built-in spec sheets.

    Args:
      path: a file written by `hetpar profile`; None gives the spec sheets alone.
      specs: include every spec sheet (named by kind: `h100`, `cpu`, ...).
        Devices in the file override spec sheets of the same name.

    Returns:
      A ProfileSet whose `device(name)` answers for measured devices and,
      with their nearest measured sibling's calibration, for spec kinds.

    Raises:
      ProfileError: the file is missing, not JSON, or malformed.
    """
    base = {k: spec(k) for k in spec_kinds()} if specs else {}
    if path is None:
        return ProfileSet(base)
    loaded = load_json(path, ProfileSet.from_json, ProfileError, what="profile file",
                       how=f"hetpar profile --out {path}")
    if loaded.meta.get("mode") == "quick":
        # Seen on two H200s: a quick profile predicted a 2 ms transformer block
        # at 0.8 s, and its peer link (fitted up to 16 MB) at 46 GB/s where
        # 256-512 MB copies ran at 340-370 GB/s (experiments/results/probe_peer_h200x2.txt).
        logging.warning(
            "profile file %s was measured with `hetpar profile --quick`: its compute "
            "efficiencies are fitted on small, launch-bound sizes and can be off by 100x or "
            "more, and its links on transfers up to 16 MB (large transfers can run several "
            "times faster). Measure without --quick before planning.",
            path)
    return dataclasses.replace(loaded, devices={**base, **loaded.devices})


def transfer_calibration(measured: DeviceProfile, spec_profile: DeviceProfile) -> DeviceProfile:
    """A spec-sheet profile with the calibration of a measured sibling.

    A device that is not present keeps its own peaks, bandwidth, memory,
    price and power from its spec sheet, and borrows what only measurement
    tells: the efficiencies per op class and the launch overhead (which
    depends on the runtime and host as much as on the chip). Siblings must
    share a class (cpu, gpu, tpu): see `nearest_sibling`.

    Raises:
      ProfileError: the two profiles are of different classes.
    """
    if measured.device_class != spec_profile.device_class:
        raise ProfileError(
            f"cannot transfer the calibration of {measured.name!r} "
            f"({measured.device_class}) to {spec_profile.name!r} "
            f"({spec_profile.device_class}): siblings must be of the same class"
        )
    sources = dict(spec_profile.sources)
    sources["efficiencies"] = f"transferred from {measured.name!r}: " + measured.sources.get(
        "efficiencies", "measured"
    )
    sources["launch_overhead_s"] = f"transferred from {measured.name!r}: " + measured.sources.get(
        "launch_overhead_s", "measured"
    )
    if measured.buffer_overhead_s:
        sources["buffer_overhead_s"] = f"transferred from {measured.name!r}: " + \
            measured.sources.get("buffer_overhead_s", "measured")
    if measured.fused_bytes_efficiency is not None:
        sources["fused_bytes_efficiency"] = f"transferred from {measured.name!r}: " + \
            measured.sources.get("fused_bytes_efficiency", "measured")
    if measured.conv_efficiency is not None:
        sources["conv_efficiency"] = f"transferred from {measured.name!r}: " + \
            measured.sources.get("conv_efficiency", "measured")
    if measured.layer_model:
        sources["layer_model"] = f"transferred from {measured.name!r}: " + \
            measured.sources.get("layer_model", "measured")
    return spec_profile.replace(
        layer_model=dict(measured.layer_model) if measured.layer_model else None,
        efficiencies={c: dict(e) for c, e in measured.efficiencies.items()},
        fused_bytes_efficiency=measured.fused_bytes_efficiency,
        conv_efficiency=measured.conv_efficiency,
        launch_overhead_s=measured.launch_overhead_s,
        buffer_overhead_s=measured.buffer_overhead_s,
        sources=sources,
        origin="transferred",
    )
