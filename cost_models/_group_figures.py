"""Figures measured over several devices at once, set on a cost table.

Two figures depend on which devices work together, so no single device's or
link's profile holds them:

- a group's **collectives** (`meta["collectives"]`, by the members' names
  joined with "+"): the ring its all-gathers and reduce-scatters ran at,
  which prices sharded state and replicas (`hetpar.planner.ring_of`). On two
  H200s the ring ran 263 GB/s where a copy between the same GPUs ran 188;
- the **place links** (`meta["place_links"]`): what each accelerator copies
  each way to and from its pinned host memory while every one of them does
  the same (on two H200s 31 GB/s each way; one alone both ways, 43): one
  large array's bandwidth, a call's latency and what each array of a batch
  adds by its size (`hetpar.runtime.place_link_figures`).

The first call's calibration times both on the devices present
(`_calibrate_table`). `hetpar profile` stores them in the profile file's
`meta` under the same keys, and a table built from that file takes those
whose devices it plans for (`with_stored`): a plan made elsewhere for this
machine prices its collectives and streamed state as this machine ran them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from hetpar.core import CostTable, ProfileError, memory_place

#: The figures each kind of stored entry carries.
FIELDS = {"collectives": ("bandwidth_bytes_per_s", "latency_s"),
          "place_links": ("bandwidth_bytes_per_s",)}
#: Figures an entry may carry (older files have none): a place link's
#: latency; its `curve` is checked apart.
OPTIONAL = {"place_links": ("latency_s",)}


def check_stored(meta: Mapping, where: str = "profile file") -> None:
    """Raises ProfileError naming the entry where `meta`'s stored group
    figures are not {"a+b": {field: number >= 0, ...}} (a hand-edited file)."""
    for key, fields in FIELDS.items():
        entries = meta.get(key)
        if entries is None:
            continue
        if not isinstance(entries, Mapping):
            raise ProfileError(f"{where}: meta.{key} must map device groups (\"gpu:0+gpu:1\") "
                               f"to their figures, got {type(entries).__name__}; fix the entry "
                               "or measure again with `hetpar profile`")
        for group, figures in entries.items():
            def bad(what, v, key=key, group=group):
                return ProfileError(
                    f"{where}: meta.{key}[{group!r}] needs {what}, got {v!r}; fix the "
                    "entry or measure again with `hetpar profile`")

            for f in fields + OPTIONAL.get(key, ()):
                if f not in fields and not (isinstance(figures, Mapping) and f in figures):
                    continue
                v = figures.get(f) if isinstance(figures, Mapping) else None
                if not _number(v):
                    raise bad(f"{f} as a number >= 0", v)
            if key == "place_links" and "curve" in figures:
                curve = figures["curve"]
                points = curve if isinstance(curve, list) else []
                if not (points and all(
                        isinstance(p, list) and len(p) == 2 and all(map(_number, p))
                        for p in points)
                        and all(b > a for a, b in zip([0.0] + [p[0] for p in points],
                                                      [p[0] for p in points]))):
                    raise bad("curve as [[bytes, seconds], ...]: numbers >= 0, bytes above 0 "
                              "and rising", curve)


def _number(v) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and v >= 0)


def with_rings(table: CostTable, rings: Mapping[str, Mapping]) -> CostTable:
    """`table` with `rings` ({"gpu:0+gpu:1": {"bandwidth_bytes_per_s",
    "latency_s"}}) added to its `meta["collectives"]`."""
    if not rings:
        return table
    merged = {**(table.meta.get("collectives") or {}),
              **{g: {"bandwidth_bytes_per_s": float(r["bandwidth_bytes_per_s"]),
                     "latency_s": float(r["latency_s"])} for g, r in rings.items()}}
    return dataclasses.replace(table, meta={**table.meta, "collectives": merged})


def place_owners(table: CostTable) -> list[str]:
    """The accelerators of `table` that have a memory place, sorted."""
    return sorted({memory_place(d.name)[0] for d in table.devices
                   if memory_place(d.name)[1] is not None})


def with_place_links(table: CostTable, owners: Sequence[str], figures: Mapping) -> CostTable:
    """`table` with the links between each of `owners` and its memory place
    at `figures` (`hetpar.runtime.place_link_figures`: bandwidth_bytes_per_s
    each way; latency_s and curve where measured, else the link keeps its
    latency and prices by bandwidth), measured with all of `owners` copying
    both ways at once (`meta["place_links"]`)."""
    owners = sorted(owners)
    bandwidth = float(figures["bandwidth_bytes_per_s"])
    curve = tuple((float(b), float(t)) for b, t in figures.get("curve") or ())

    def measured(k):
        src, dst = memory_place(k.src), memory_place(k.dst)
        between = (src[0] == dst[0] and src[0] in owners
                   and (src[1] is None) != (dst[1] is None))
        if not between:
            return k
        return dataclasses.replace(
            k, bandwidth_bytes_per_s=bandwidth, curve=curve,
            latency_s=float(figures.get("latency_s", k.latency_s)))

    entry = {"bandwidth_bytes_per_s": bandwidth, "at_once": len(owners)}
    if "latency_s" in figures:
        entry["latency_s"] = float(figures["latency_s"])
    if curve:
        entry["curve"] = [list(p) for p in curve]
    return dataclasses.replace(table, links=tuple(measured(k) for k in table.links), meta={
        **table.meta, "place_links": {"+".join(owners): entry}})


def with_stored(table: CostTable, stored: Mapping) -> CostTable:
    """`table` with the figures a profile file stored (its `meta`): the rings
    of groups all of whose members `table` plans for, and the place links
    measured over exactly the accelerators with a memory place in `table`
    (measured with other accelerators streaming too, or fewer, the figure
    is another plan's: the links keep their own)."""
    check_stored(stored)
    names = {d.name for d in table.devices}
    rings = {g: r for g, r in (stored.get("collectives") or {}).items()
             if set(g.split("+")) <= names}
    table = with_rings(table, rings)
    owners = place_owners(table)
    links = (stored.get("place_links") or {}).get("+".join(owners)) if owners else None
    if links:
        table = with_place_links(table, owners, links)
    return table
