"""Sets of device profiles and links: the profile file, spec kinds, sibling calibration.

A `ProfileSet` is what `hetpar profile --out` writes and `load_profiles`
reads, merged over the built-in spec sheets: device profiles by name
(`DeviceProfile`, `_profile`) and the measured or declared links between
them. A spec-sheet kind that was not measured borrows the calibration of
its nearest measured sibling (`nearest_sibling`, `transfer_calibration`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from absl import logging

from hetpar.core import ProfileError, load_json, save_json
from hetpar.cost_models._profile import (
    FORMAT,
    VERSION,
    DeviceProfile,
    LinkProfile,
    file_devices,
    jsonable,
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
        return cls(devices, links, dict(data.get("meta", {})))


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
        # 256-512 MB copies ran at 340-370 GB/s (experiments/probe_peer.py).
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
    return spec_profile.replace(
        efficiencies={c: dict(e) for c, e in measured.efficiencies.items()},
        fused_bytes_efficiency=measured.fused_bytes_efficiency,
        launch_overhead_s=measured.launch_overhead_s,
        buffer_overhead_s=measured.buffer_overhead_s,
        sources=sources,
        origin="transferred",
    )
