"""`hetpar.auto`'s options, checked when the decorator is applied (`Options`),
and the checks of devices and memory places made at the first call, when
JAX's devices may be asked for."""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from hetpar.core import SCHEDULES, HetparError, Placement, PlanError, memory_place, parse_placements
from hetpar.cost_models import ProfileSet

_OBJECTIVES = ("time", "cost", "energy")
_ON_MISSING_DEVICE = ("error", "replan")
_BATCH = ("global", "local")
# `auto`'s profile names: calibrate by default, always, or spec sheets alone.
PROFILE_CHOICES = ("auto", "measure", "spec")
#: data_parallel's values besides True and False: the planner may choose only
#: replicated state ("replicated"), or no ILP runs and the step runs over
#: `devices` with its state replicated ("always") or sharded ("zero1", "fsdp").
DATA_PARALLEL = ("replicated", "always", "zero1", "fsdp")
#: The data_parallel values that force a whole-step plan, and its sharding.
FORCED = {"always": None, "zero1": "zero1", "fsdp": "fsdp"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """What `hetpar.auto` was asked for (see `auto`), checked when built.

    Raises:
      HetparError: a bad option (PlanError for `plan` and `devices`); the
        message names the option and what it accepts.
    """

    devices: tuple[str, ...] | None = None
    objective: str = "time"
    plan: Any = None
    microbatches: int = 1
    batch_argnums: tuple[int, ...] | None = None
    schedule: str = "gpipe"
    profile: Any = "auto"
    depth: int | None = None
    on_missing_device: str = "error"
    data_parallel: bool | str = True
    memory: Mapping[str, float] | None = None
    batch: str = "global"
    hierarchical: bool | str = "auto"
    donate_argnums: tuple[int, ...] = ()
    groups: tuple[tuple[str, ...], ...] | None = None
    group_state: str = "device"

    def __post_init__(self):
        if not (isinstance(self.hierarchical, bool) or self.hierarchical == "auto"):
            raise HetparError(f"hierarchical must be True, False or 'auto', got "
                              f"{self.hierarchical!r}")
        _check_choice("objective", self.objective, _OBJECTIVES)
        _check_choice("batch", self.batch, _BATCH)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("on_missing_device", self.on_missing_device, _ON_MISSING_DEVICE)
        if not is_int(self.microbatches) or self.microbatches < 1:
            raise HetparError(f"microbatches must be a positive int, got {self.microbatches!r}")
        if self.depth is not None and (not is_int(self.depth) or self.depth < 1):
            raise HetparError(f"depth must be a positive int or None, got {self.depth!r}")
        if self.batch_argnums is not None and not (
                isinstance(self.batch_argnums, tuple) and all(map(is_int, self.batch_argnums))):
            raise HetparError("batch_argnums must be an int, a sequence of ints or None, got "
                              f"{self.batch_argnums!r}")
        if not (isinstance(self.donate_argnums, tuple)
                and all(map(is_int, self.donate_argnums))):
            raise HetparError("donate_argnums must be an int or a sequence of ints, got "
                              f"{self.donate_argnums!r}")
        if not (isinstance(self.data_parallel, bool) or self.data_parallel in DATA_PARALLEL):
            raise HetparError(f"data_parallel must be True, False or one of {DATA_PARALLEL}, "
                              f"got {self.data_parallel!r}")
        if not (self.profile in (None, *PROFILE_CHOICES)
                or isinstance(self.profile, (str, os.PathLike, ProfileSet))):
            raise HetparError("profile must be 'auto', 'measure', 'spec', a path to a `hetpar "
                              f"profile` file or a ProfileSet, got {type(self.profile).__name__}")
        _check_devices(self.devices)
        _check_groups(self.groups, self.devices, self.plan)
        _check_choice("group_state", self.group_state, ("device", "pinned_host"))
        _check_plan(self.plan)
        _check_memory(self.memory)

    def calibrates(self) -> bool:
        """Whether the first call times the step and its layers here (see `auto`'s
        `profile`): "measure" always; "auto" (the default) unless $HETPAR_PROFILES
        names a profile file, $HETPAR_CALIBRATE is 0 (or false, no, off), or the step runs under
        jax.distributed (one process cannot time the others' devices)."""
        if self.profile == "measure":
            return True
        return (self.profile == "auto" and not os.environ.get("HETPAR_PROFILES")
                and os.environ.get("HETPAR_CALIBRATE", "1").strip().lower()
                not in ("0", "false", "no", "off")
                and jax.process_count() == 1)


def _check_memory(memory) -> None:
    if memory is None:
        return
    if not isinstance(memory, Mapping) or not all(
            isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
            and v > 0 for k, v in memory.items()):
        raise HetparError("memory caps a device's memory for planning: a dict {device: bytes}, "
                          f"e.g. {{'gpu:0': 40e9}}; got {memory!r}")


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_choice(name: str, value, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise HetparError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def _check_devices(devices) -> None:
    if devices is None:
        return
    if not isinstance(devices, tuple) or not all(isinstance(d, str) for d in devices):
        raise PlanError("devices must be a device name ('cpu:0') or a sequence of them, got "
                        f"{devices!r}")
    if len(set(devices)) != len(devices):
        raise PlanError(f"devices {list(devices)} name a device twice")


def _check_groups(groups, devices, plan) -> None:
    """Device groups are disjoint lists of device names, inside `devices` when given."""
    if groups is None:
        return
    names = [d for g in groups for d in g]
    if not groups or not all(g and all(isinstance(d, str) and d for d in g) for g in groups):
        raise PlanError(f"groups must be a list of device lists, e.g. [['gpu:0', 'gpu:1'], "
                        f"['gpu:2', 'gpu:3']], got {[list(g) for g in groups]!r}")
    twice = sorted({d for d in names if names.count(d) > 1})
    if twice:
        raise PlanError(f"groups name {', '.join(twice)} more than once: a device computes "
                        "in one group")
    if devices is not None:
        outside = [d for d in names if d not in devices]
        if outside:
            raise PlanError(f"groups name {', '.join(outside)}, which devices= leaves out",
                            api="add them to devices=, or leave devices= out")
    if plan is not None:
        raise PlanError("groups= asks the planner to place layers over these groups; a plan "
                        "given places them already", api="pass groups= or plan=, not both")


def check_groups_present(groups, present: Mapping[str, jax.Device]) -> None:
    """At the first call: every device a group names is present, and each
    group's devices are of one platform and kind (the runtime runs one
    program over a group's mesh)."""
    for g in groups or ():
        absent = [d for d in g if d not in present]
        if absent:
            raise PlanError(f"group {'+'.join(g)} names {', '.join(absent)}, which "
                            f"{'is' if len(absent) == 1 else 'are'} not present (present: "
                            f"{', '.join(sorted(present))})")
        kinds = {d: present[d].device_kind for d in g}
        if len(set(kinds.values())) > 1:
            raise PlanError(f"group {'+'.join(g)} mixes device kinds ("
                            + ", ".join(f"{d}: {k}" for d, k in kinds.items())
                            + "); a group runs one program sharded over its devices, which "
                              "must be of one kind", api="group devices of one kind")


def check_places(names, present: Mapping[str, jax.Device]) -> None:
    """Each memory place a plan names (`gpu:0:pinned_host`) is a memory its
    present device has."""
    for name in names:
        device, kind = memory_place(name)
        dev = present.get(device)
        if kind is None or dev is None:
            continue
        kinds = sorted({m.kind for m in dev.addressable_memories()})
        if kind not in kinds:
            raise PlanError(f"the plan keeps state in {name!r}, but {device} has no "
                            f"{kind!r} memory (its memories: {kinds}); keep the state on "
                            f"a device instead, e.g. 'cpu:0'")


def check_present(devices: tuple[str, ...] | None, present: Mapping[str, jax.Device]) -> None:
    """At the first call, not in `auto(...)`: asking JAX for its devices starts its
    backends, which must wait until the program has run `jax.distributed.initialize`."""
    if devices is None:
        return
    absent = [d for d in devices if d not in present]
    if absent:
        hint = ("; pass several devices as a list, e.g. devices=['cpu:0', 'gpu:0']"
                if any("," in d for d in absent) else
                "; to plan for devices that are not here use `hetpar plan` offline")
        raise PlanError(f"devices {absent} are not present (present: {sorted(present)}){hint}")


def _check_plan(plan) -> None:
    if plan is None or isinstance(plan, (str, os.PathLike)):
        return
    if isinstance(plan, Mapping):
        bad = {k: v for k, v in plan.items()
               if not (isinstance(k, str) and isinstance(v, (str, Mapping, Placement)))}
        if bad:
            raise PlanError("a plan dict maps layer names to device names (strings, e.g. "
                            "{'Dense_0': 'cpu:0'}) or to placements ({'compute': 'gpu:0', "
                            f"'state': 'cpu:0', 'update': 'cpu:0'}}); these entries are not: "
                            f"{bad!r}")
        parse_placements(plan)  # names the layer and what is wrong
        return
    from hetpar.planner import Plan

    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be a path to plan.json, a hetpar.Plan or a dict "
                        f"{{layer: device}}, got {type(plan).__name__}")
