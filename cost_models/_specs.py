"""Built-in spec sheets: what a device kind can do on paper, and what it costs.

Each kind has a file `specs/<kind>.json` in the profile file form, one
device named after the kind. Every figure names its source; figures that are
estimates say so.

Pricing model
-------------
`price_per_hour` is the on-demand cloud list price of one device-hour, US
dollars, from the cheapest hyperscaler instance that holds that device
(the instance price divided by its device count; no commitments, no spot).
Such a price already includes the instance's host CPU, RAM and disks. So when
a plan uses an accelerator *and* the host CPU of the same instance, the CPU
adds nothing to the bill: its marginal price is `host_price_per_hour`, 0 by
default. The CPU's own `price_per_hour` (a CPU-only instance of the same core
count) applies only when the CPU is rented alone, with no accelerator in the
plan. `plan_prices` applies this rule; pass `host_cpu_included=False` (or set
a non-zero `host_price_per_hour` in a profile file) when the host is billed
separately, for example on-premises hardware priced by amortised cost.
Energy (`watts_busy`, `watts_idle`) is physical and counts for every device.

README paragraph::

    Costs in dollars use on-demand cloud list prices per device-hour (the
    instance price divided by its GPU or TPU count), with the source and date
    of each price in the spec sheet. The host CPU of a GPU or TPU instance is
    already paid for with the instance, so a plan that runs layers on the host
    CPU next to its accelerator adds no dollars for the CPU (only joules); a
    CPU used alone is priced as a CPU-only instance of 16 cores. Override any
    price in a profile file (`price_per_hour`, `host_price_per_hour`) or call
    `plan_prices(..., host_cpu_included=False)` when your host is billed apart.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from collections.abc import Iterable

from hetpar.core import ProfileError
from hetpar.cost_models._profile import DeviceProfile, file_devices


@functools.cache
def _spec_files() -> dict[str, str]:
    root = importlib.resources.files("hetpar.cost_models") / "specs"
    return {
        p.name.removesuffix(".json"): p.read_text()
        for p in root.iterdir()
        if p.name.endswith(".json")
    }


def spec_kinds() -> list[str]:
    """The kinds that have a built-in spec sheet, sorted."""
    return sorted(_spec_files())


@functools.cache
def spec(kind: str) -> DeviceProfile:
    """The built-in spec-sheet profile of `kind` (named after the kind).

    Args:
      kind: one of `spec_kinds()`, e.g. `h100` or `tpu-v5e`.

    Raises:
      ProfileError: no spec sheet for that kind.
    """
    files = _spec_files()
    if kind not in files:
        raise ProfileError(
            f"unknown device kind {kind!r}; known kinds: {', '.join(spec_kinds())} "
            "(or name a present device such as 'cpu:0' / 'gpu:0')"
        )
    (entry,) = file_devices(json.loads(files[kind]), f"spec sheet {kind!r}")
    return DeviceProfile.from_json(entry)


def plan_prices(
    profiles: Iterable[DeviceProfile], *, host_cpu_included: bool = True
) -> dict[str, float]:
    """Dollars per hour of each device, for the devices of one plan.

    Args:
      profiles: the devices a plan may use.
      host_cpu_included: when an accelerator is among `profiles`, CPU devices
        are that instance's host and cost their `host_price_per_hour`
        (0 unless configured) instead of `price_per_hour`.

    Returns:
      name -> dollars per hour.
    """
    profiles = list(profiles)
    has_accel = any(p.device_class != "cpu" for p in profiles)
    out = {}
    for p in profiles:
        paired = host_cpu_included and has_accel and p.device_class == "cpu"
        out[p.name] = p.host_price_per_hour if paired else p.price_per_hour
    return out
