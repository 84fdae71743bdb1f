"""Where a layer computes, where its state lives, where its update runs.

DESIGN, "State apart from compute": on an 80 GB GPU beside 128 GiB of host
RAM, what the host adds is memory, not FLOPs. So a layer has separate
decisions:

- `compute`: the device that runs its forward and backward;
- `state`: where its optimizer state lives between steps: a device (the
  host CPU device for an offloaded layer) or a memory place, a device's
  other memory: `gpu:0:pinned_host` is gpu:0's pinned host memory (JAX's
  `pinned_host` memory kind), from which the GPU copies at PCIe speed;
- `params`: where its parameters live between steps (default: with its
  optimizer state). Streaming only the optimizer state to the compute
  device for the update, parameters stay resident (JAX's own host offload
  does this): half the traffic of streaming both;
- `update`: the device that runs its optimizer update (the CPU on
  host-resident state, as ZeRO-Offload does, or the compute device with the
  state streamed in and the new state sent back);
- `activations`: what happens to the values its backward reads from its
  forward: "keep" them on the compute device; "offload" them to the
  compute device's pinned host memory between the two; "remat": keep only
  the layer's input and recompute the rest in the backward (the runtime
  runs all three; the planner chooses "keep" or, where memory is tight,
  "remat").

A plain device name is the placement of every plan so far: all on one
device. Plans and `hetpar.auto(plan=...)` accept either form:
`{"h0": "gpu:0", "h1": {"compute": "gpu:0", "state": "cpu:0", "update": "cpu:0"},
"h2": {"compute": "gpu:0", "params": "gpu:0", "state": "gpu:0:pinned_host"}}`.
Compute and update run on devices; state and parameters may also live in a
memory place.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from hetpar.core._errors import PlanError

ACTIVATIONS = ("keep", "offload", "remat")
#: Activation policies the runtime carries out today.
ACTIVATIONS_RUN = ("keep", "remat", "offload")
_KEYS = ("compute", "params", "state", "update", "activations")
#: Memory kinds a memory place may name (JAX's names; "device" is the device itself).
MEMORY_KINDS = ("pinned_host", "unpinned_host")


def memory_place(name: str) -> tuple[str, str | None]:
    """(device, memory kind or None) of a state home: `gpu:0:pinned_host` ->
    ("gpu:0", "pinned_host"); a plain device name -> (name, None)."""
    head, _, kind = name.rpartition(":")
    if kind in MEMORY_KINDS and head:
        return head, kind
    return name, None


# `p1/cpu:0`, `p0/h100:1`, `p2/gpu:0:pinned_host`: a process, then a name of one process.
_PROCESS_PREFIX = re.compile(r"^p(\d+)/(.+)$")


def process_of(name: str) -> int | None:
    """The process a device name belongs to: `p1/cpu:0` -> 1, `p0/h100:0` -> 0.

    None for a name without a process (`cpu:0`, `h100:0`: one process's
    naming, or a what-if device placed on no process in particular). Works on
    any name with the prefix (spec kinds, memory places), unlike
    `hetpar._distributed.parse_device_name`, which takes only JAX names.
    """
    m = _PROCESS_PREFIX.match(name)
    return int(m.group(1)) if m else None


def local_name(name: str) -> str:
    """`name` without its process: `p1/cpu:0` -> `cpu:0`; `cpu:0` as it is."""
    m = _PROCESS_PREFIX.match(name)
    return m.group(2) if m else name


#: A GPU's pinned host memory (XLA's `xla_gpu_host_bfc` pool, one per
#: process) takes memory from the OS in regions as it grows: the first of
#: this size, each next twice the last, the last cut to what the pool's
#: limit leaves. What it holds of the host's RAM is the smallest sum of
#: regions that covers what it serves, up to its limit
#: (`pinned_pool_reserved`): up to twice the arrays it holds. With its
#: limit at the host's whole RAM (125 GiB), a 6.74B plan keeping 77 GB there
#: grew the pool past 64 GiB by a region of 60.7 GiB, and the OS killed the
#: process (fit_h200, run 56).
PINNED_POOL_FIRST_REGION = 2 << 20


def pinned_pool_regions(limit: float) -> list[float]:
    """The bytes a pinned pool of `limit` bytes holds after each region it
    adds: PINNED_POOL_FIRST_REGION, then each region twice the last, the
    last cut at the limit (empty for no limit)."""
    if limit <= 0:
        return []
    ends, total, region = [], 0.0, float(PINNED_POOL_FIRST_REGION)
    while total < limit:
        total = min(total + region, limit)
        ends.append(total)
        region *= 2
    return ends


def pinned_pool_reserved(served: float, limit: float) -> float:
    """Bytes of the host's RAM a pinned pool of `limit` bytes holds when it
    serves `served` bytes: its regions (PINNED_POOL_FIRST_REGION, doubling)
    up to the first sum that covers them, at most `limit` (and what it
    serves, were that over the limit, for the planner's diagnoses); 0 for
    nothing. A lower bound where one buffer is large: XLA's allocator also
    doubles a region until it holds the buffer asked for, and a buffer
    never spans two."""
    if served <= 0:
        return 0.0
    covering = next((t for t in pinned_pool_regions(limit) if t >= served), limit)
    return float(max(covering, served))


def placing_growth(served: float, from_host: float, limit: float,
                   already: float = 0.0) -> float:
    """Bytes of the host's RAM placing state adds at most, beyond what the
    host holds as it starts: XLA's pinned pool (of `limit` bytes, serving
    `already` as placing starts) grows by regions to serve `served` bytes,
    `from_host` of them copied from the caller's arrays in host RAM, each
    given up once copied (`place` with donation), after the rest. Just as a
    region is added the pool holds it and the full regions before it, and
    the host arrays not yet copied are still there. The 6.74B model at 45 GB
    of an H200 (77 GB into a 94 GiB pool, all from the host): 34 GB, where
    the process rose from about 92 GB (its 81 GB state and ~11 beside it)
    to 122.8 while placing (fit_h200, run 58)."""
    held = pinned_pool_reserved(already, limit)
    ends = pinned_pool_regions(limit)
    growth = 0.0
    for before, total in zip([0.0, *ends], ends):
        if before >= served:
            break
        if total > held:
            given_up = max(0.0, before - (served - from_host))
            growth = max(growth, total - held - given_up)
    return growth


def is_memory_place(name: str) -> bool:
    """Whether `name` is a memory place (a device's other memory), not a device."""
    return memory_place(name)[1] is not None


@dataclasses.dataclass(frozen=True)
class Placement:
    """One layer's placement; `state` and `update` default to `compute`,
    `params` to `state`."""

    compute: str
    state: str | None = None
    update: str | None = None
    activations: str = "keep"
    params: str | None = None

    def __post_init__(self):
        for key in ("compute", "state", "update", "params"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise PlanError(f"placement {key} must be a device name, got {value!r}")
        for key in ("compute", "update"):
            if getattr(self, key) is not None and is_memory_place(getattr(self, key)):
                raise PlanError(f"placement {key} {getattr(self, key)!r} is a memory place; "
                                f"{key} runs on a device (a memory place holds state only)")
        if self.activations not in ACTIVATIONS:
            raise PlanError(f"activations must be one of {ACTIVATIONS}, got "
                            f"{self.activations!r}")
        if self.state is None:
            object.__setattr__(self, "state", self.compute)
        if self.update is None:
            object.__setattr__(self, "update", self.compute)
        if self.params is None:
            object.__setattr__(self, "params", self.state)

    @property
    def offloaded(self) -> bool:
        """Whether any part of the layer lives or runs away from its compute device."""
        return (self.state != self.compute or self.update != self.compute
                or self.params != self.compute)

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices and memory places it uses."""
        return tuple(dict.fromkeys((self.compute, self.params, self.state, self.update)))

    def to_json(self) -> str | dict:
        """The plan.json form: a device name when nothing is apart, else an object."""
        if not self.offloaded and self.activations == "keep":
            return self.compute
        out: dict[str, str] = {"compute": self.compute}
        if self.params != self.state:
            out["params"] = self.params
        out.update(state=self.state, update=self.update)
        if self.activations != "keep":
            out["activations"] = self.activations
        return out

    @classmethod
    def parse(cls, value: Any, layer: str = "?") -> Placement:
        """From a device name or a {"compute", "state", "update", "activations"} object.

        Raises:
          PlanError: naming the layer and what is wrong.
        """
        if isinstance(value, Placement):
            return value
        if isinstance(value, str):
            if not value:
                raise PlanError(f"layer {layer!r}: the device name is empty")
            return cls(value)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(_KEYS))
            if unknown:
                raise PlanError(f"layer {layer!r}: unknown placement keys {unknown}; a "
                                f"placement has {list(_KEYS)}")
            if "compute" not in value:
                raise PlanError(f"layer {layer!r}: a placement object needs 'compute' "
                                f"(got {dict(value)!r})")
            try:
                return cls(value["compute"], value.get("state"), value.get("update"),
                           value.get("activations", "keep"), value.get("params"))
            except PlanError as e:
                raise PlanError(f"layer {layer!r}: {e}") from None
        raise PlanError(f"layer {layer!r}: a placement is a device name or an object with "
                        f"{list(_KEYS)}, got {type(value).__name__} {value!r}")


def parse_placements(plan: Mapping[str, Any]) -> dict[str, Placement]:
    """{layer: Placement} from a plan dict whose values are names or placement objects."""
    if not isinstance(plan, Mapping):
        raise PlanError(f"a plan maps layer names to placements, got {type(plan).__name__}")
    out = {}
    for layer, value in plan.items():
        if not isinstance(layer, str):
            raise PlanError(f"layer names must be strings, got {layer!r}")
        out[layer] = Placement.parse(value, layer)
    return out
