"""Where a step's cost tables get their figures: a `hetpar profile` file, spec
sheets, or (`profile="measure"`) what the first call times on the devices
present: the whole step under `jax.jit`, the runtime's cost per stage and
per crossing, and copy curves of the links a plan uses."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
from absl import logging

from hetpar._options import Options
from hetpar.core import HetparError


def whole_step_s(step: Callable, args: tuple, dev, batch_argnums: Sequence[int] = (-1,),
                 budget_s: float = 1.0, most: int = 20,
                 failed: str = "the step on {dev}; its layers keep their predicted times",
                 key: str | None = None, jitted: Callable | None = None) -> float | None:
    """Median seconds of `step` under `jax.jit` on `dev` (or data parallel over
    a list of devices) as a training loop runs it (`cost_models.measure_step`:
    state threaded, the batch as the caller passes it), or None where it does
    not run there (out of memory).

    Three timed runs at least, then more for a step short enough: up to
    `most`, about `budget_s` in all (a 3-run median of a millisecond step on
    a busy CPU was off by 3x: an Equinox step's PredictionWarning).

    With `key` (the step's fingerprint: a hash of its jaxpr), the figure is
    remembered on disk as layer timings are (`cost_models.cached_json`, keyed
    also on the argument shapes, the device kind and count, and the jax
    version): a later process, or another step object of the same program,
    skips the compile and the runs. `jitted`: the step's jit on `dev` that
    will run it later (`measure_step`'s)."""
    from hetpar.cost_models import cache_key, cached_json, measure_step

    def timed() -> dict:
        return {"median_s": measure_step(step, args, dev, batch_argnums=batch_argnums, k=most,
                                         warmup=1, budget_s=budget_s, jitted=jitted,
                                         donated=getattr(jitted, "donated", ())).median_s}

    try:
        if key is None:
            return timed()["median_s"]
        devs = list(dev) if isinstance(dev, (list, tuple)) else [dev]
        digest = cache_key(f"{key}/devices={len(devs)}", args, devs[0])
        return float(cached_json("step", digest, timed, required=("median_s",))["median_s"])
    except Exception as e:  # noqa: BLE001 - an accelerator too small: keep its predictions
        logging.warning("hetpar: the calibration could not time %s (%s: %s)",
                        failed.format(dev=dev), type(e).__name__, str(e).splitlines()[0][:200])
        return None


def step_key(program) -> str:
    """A whole step's fingerprint for `whole_step_s`'s cache: a hash of its jaxpr."""
    import hashlib

    return "step/" + hashlib.sha256(str(program).encode()).hexdigest()[:24]


# The runtime's own costs measured by profile="measure": a property of the
# process and its devices, so measured once (by device, or pair of devices).
OVERHEADS: dict = {}


def _once(key, what: str, measure: Callable[[], float]) -> float | None:
    """`measure()` the first time `key` is asked in this process; None (the
    figure stays as predicted, with a warning) where it fails."""
    if key not in OVERHEADS:
        try:
            OVERHEADS[key] = measure()
        except Exception as e:  # noqa: BLE001 - a calibration extra: keep planning
            logging.warning("hetpar: the calibration could not time %s (%s: %s); it stays "
                            "as predicted", what, type(e).__name__, str(e).splitlines()[0][:200])
            OVERHEADS[key] = None
    return OVERHEADS[key]


def runtime_costs() -> dict:
    """The per stage, per crossing and per copy callbacks of `scale_to_timed_step`."""
    from hetpar.runtime import (
        crossing_s,
        link_curve,
        place_link_figures,
        ring_figures,
        stage_overhead_s,
    )

    return dict(
        stage_overhead=lambda name, dev: _once(dev, f"the runtime's cost per stage on {name}",
                                               lambda: stage_overhead_s(name, dev)),
        crossing=lambda a, b, both: _once(frozenset((a[1], b[1])),
                                          f"a crossing {a[0]} <-> {b[0]}",
                                          lambda: crossing_s(a, b, both)),
        curve=lambda src, dst, sizes: _once(
            (src, dst, tuple(sizes)), f"copies {src} -> {dst}",
            lambda: _measured(link_curve(src, dst, sizes), max(sizes))),
        collective=lambda names, devs: _once(
            ("ring", *names), f"collectives over {'+'.join(names)}",
            lambda: ring_figures(devs)),
        place_links=lambda names, devs: _once(
            ("places", *names), f"copies to and from the pinned host memory of "
            f"{'+'.join(names)}", lambda: place_link_figures(devs)))


def _measured(curve, nbytes: float):
    """A measured link curve, or an error `_once` warns of (the link keeps its figure)."""
    if curve is None:
        raise HetparError(f"no copy up to {nbytes / 1e6:.0f} MB took longer than a 4 kB one")
    return curve


def profiles_of(options: Options):
    """The ProfileSet (or None: spec sheets) a step's cost tables come from."""
    from hetpar.cost_models import load_profiles

    profiles = options.profile
    if profiles in (None, "spec"):
        return None  # the spec sheets of the devices' kinds, alone
    if profiles in ("auto", "measure"):
        # A profile file `hetpar profile` wrote, named by the environment;
        # else the spec sheets of the devices' kinds (calibrated, where
        # `options.calibrates()`, at the first call).
        profiles = os.environ.get("HETPAR_PROFILES") or None
    if profiles is options.profile and isinstance(profiles, (str, os.PathLike)) \
            and not os.path.exists(profiles):
        raise HetparError(f"profile={str(profiles)!r} is not a file; pass 'auto' (calibrate "
                          "here at the first call, or $HETPAR_PROFILES), 'measure', 'spec' "
                          "(spec sheets alone), or the path of a `hetpar profile --out FILE` "
                          "file")
    if isinstance(profiles, (str, os.PathLike)):
        try:
            profiles = load_profiles(profiles)
        except HetparError as e:
            if profiles is options.profile:
                raise
            raise type(e)(f"{e} (the file $HETPAR_PROFILES names; unset it to plan from "
                          "spec sheets)") from e
    return profiles


def allreduce_across_processes_s(table, options: Options) -> float:
    """Seconds to all-reduce a step's gradients (the table's parameter bytes)
    around a ring of the processes, on the slowest network link of the ring
    (measured by `hetpar profile` under jax.distributed, else the default)."""
    from hetpar.core import ring_allreduce_s
    from hetpar.cost_models import load_profiles

    n = jax.process_count()
    profiles = profiles_of(options) or load_profiles()
    links = [profiles.network_link(q, (q + 1) % n) for q in range(n)]
    grads = sum(layer.param_bytes or 0.0 for layer in table.layers)
    return ring_allreduce_s(grads, n, min(ln.bandwidth_bytes_per_s for ln in links),
                            max(ln.latency_s for ln in links))
