"""The compiled stages of a split step checked against the devices' memory,
before the first step runs (issue 41, item 2).

The planner prices a layer's memory from its arrays (`held_bytes`); XLA's
executables hold more (temporaries, layouts, code) or less (buffers reused).
Once the `Executor` has compiled the stages, each executable's
`memory_analysis()` is known; `compiled_peaks` replays each device's stages
in its order and keeps the largest total:

    resident   the step's inputs kept on the device (state homed there), the
               executables' code, and inputs moved there once a step (cached)
    + live     values computed there and not yet read by their last reader:
               activations waiting for the backward, results waiting to
               cross to another device, the new state (nothing is donated)
    + in flight  what the running stage brought in (state streamed from a
               memory place, values from another device) and the state of
               the next streaming stage, prefetched while it runs
    + working  the running stage's temporaries and its outputs (less those
               aliased to its inputs)

Stages on other devices are taken to run in the global stage order (their
index), which decides when a value read across devices is freed.

`misfits` compares that peak with the capacity the plan used, less
`MARGIN`; `AutoStep` plans again with the device capped by the excess
(`smaller_cap`), at most `MAX_REPLANS` times, before anything runs, and
gives up with one line (`InfeasibleError`) naming the device and the bytes.

Not checked: one-device and data-parallel plans (one jit executable, whose
own compile reports them: `step.report()` shows their figure after the
first call), and the host RAM that CPU devices and memory places share
(each CPU device is compared with its own capacity).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hetpar.core import InfeasibleError, memory_place, nbytes

#: Capacity kept back from what the plan may use: the allocator's own
#: rounding and fragmentation (XLA's BFC allocator rounds every buffer up to
#: 256 bytes and splits free chunks, so a peak of N bytes needs somewhat
#: more than N), cuDNN/cuBLAS workspaces that `memory_analysis()` does not
#: list, and the runtime's small arrays (PRNG keys, step counters).
MARGIN = 0.05


class MemoryCheckWarning(UserWarning):
    """A plan given (or with one device to run on) does not fit its compiled stages."""


@dataclasses.dataclass(frozen=True)
class Misfit:
    """A device whose compiled stages need more than the plan may use there.

    Attributes:
      device: the device name.
      compiled_bytes: the compiled stages' peak there (`compiled_peaks`).
      capacity_bytes: the capacity the plan used (`memory=` cap included).
      usable_bytes: `capacity_bytes` less `MARGIN`.
      predicted_bytes: what the planner predicted the device holds (None if unknown).
      stage: where the peak falls, for messages ("stage 7 (backward) of [layers]").
    """

    device: str
    compiled_bytes: float
    capacity_bytes: float
    usable_bytes: float
    predicted_bytes: float | None
    stage: str

    @property
    def excess_bytes(self) -> float:
        return self.compiled_bytes - self.usable_bytes

    def describe(self) -> str:
        return (f"the compiled stages need {nbytes(self.compiled_bytes)} on {self.device} at "
                f"their peak ({self.stage}), over the {nbytes(self.usable_bytes)} the plan may "
                f"use there ({nbytes(self.capacity_bytes)} less a {MARGIN:.0%} margin)")


def _bytes(v) -> int:
    aval = v.aval
    try:
        return int(aval.size) * int(aval.dtype.itemsize)
    except (AttributeError, TypeError):  # a PRNG key and the like: small
        return 0


def stage_working_bytes(m) -> float:
    """What one executable allocates beyond its arguments while it runs: XLA's
    own peak (`peak_memory_in_bytes`, its buffer assignment's liveness over
    arguments, outputs and temporaries) less the arguments, where the
    backend gives it; else temporaries + outputs not aliased to inputs."""
    peak = getattr(m, "peak_memory_in_bytes", 0) or 0
    if peak > 0:
        return max(peak - m.argument_size_in_bytes, 0)
    return m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def compiled_peaks(executor) -> tuple[dict[str, float], dict[str, str]]:
    """({device: peak bytes over the step}, {device: the stage where it falls})
    from the executor's compiled stages (`Executor.stage_memory`); devices
    whose stages have no memory analysis are left out."""
    stages = executor.stages
    memory = executor.stage_memory
    peaks: dict[str, float] = {}
    where: dict[str, str] = {}
    last_read: dict = {}
    for st in stages.stages:
        for v in st.inputs:
            last_read[v] = max(last_read.get(v, -1), st.index)
    outputs = set(executor._outvars)
    away = set(executor._send_home)  # new state sent to a memory place as it is made
    for vs in executor._offload_vars:  # activations waiting in pinned host memory
        away.update(vs)
    home = dict(zip(executor._invars, stages.input_devices))
    producer = executor._producer
    for device in executor.local:
        order = stages.device_order.get(device, ())
        if not order or any(memory[i] is None for i in order):
            continue
        resident = float(sum(_bytes(v) for v, d in home.items() if d == device))
        code: dict = {}  # one copy of each distinct executable's code
        for i in order:
            code[id(executor.compiled[i])] = memory[i].generated_code_size_in_bytes
        resident += sum(code.values())
        live: dict = {}  # values made here, alive until their last reader
        cached: set = set()  # step inputs moved here once a step
        peak, at = resident, "the step's inputs"
        for i in order:
            st, m = stages.stages[i], memory[i]
            here = {v for v in st.inputs
                    if v in live or home.get(v) == device or v in cached}
            brought = [v for v in st.inputs if v not in here]
            for v in brought:
                if (v, device) in executor._cache_inputs:
                    cached.add(v)
            transient = sum(_bytes(v) for v in brought if v not in cached)
            nxt = executor._next_stream.get(i)
            ahead = sum(_bytes(v) for v in executor._streamed[nxt]) if nxt is not None else 0
            working = stage_working_bytes(m)
            now = (resident + sum(live.values()) + sum(_bytes(v) for v in cached)
                   + transient + ahead + working)
            if now > peak:
                peak = now
                at = (f"stage {i} ({st.phase}"
                      + ("" if st.microbatch is None else f", microbatch {st.microbatch}")
                      + f") of {list(st.layers)[:3]}" + ("..." if len(st.layers) > 3 else ""))
            for v in st.outputs:
                if v not in away and (v in outputs or last_read.get(v, -1) > i):
                    live[v] = _bytes(v)
            for v in list(live):
                if v not in outputs and last_read.get(v, -1) <= i:
                    del live[v]
        # Results computed elsewhere that come home here at the step's end.
        wanted = stages.output_devices or ()
        back = sum(_bytes(v) for v, d in zip(executor._outvars, wanted)
                   if d == device and hasattr(v, "aval")
                   and producer.get(v) is not None
                   and stages.stages[producer[v]].device != device)
        end = resident + sum(live.values()) + back
        if end > peak:
            peak, at = end, "the step's end, the old and the new state both held"
        peaks[device] = peak
        where[device] = at
    return peaks, where


def capacities(step, devices) -> dict[str, float]:
    """{device: the capacity the plan used}: its cost table's figure (this
    machine's, for a present device) under the `memory=` caps, else what the
    device holds here (`live_capacity`)."""
    from hetpar.cost_models import live_capacity

    memory = step.options.memory or {}
    table = step.table
    if table is not None and memory:
        from hetpar.planner._solve import with_memory

        table = with_memory(table, memory)
    known = {d.name: d.memory_bytes for d in table.devices} if table is not None else {}
    out = {}
    for d in devices:
        cap = known.get(d)
        if cap is None:
            cap = live_capacity(step.devices[memory_place(d)[0]])[0]
            if cap is not None and d in memory:
                cap = min(cap, float(memory[d]))
        if cap:
            out[d] = float(cap)
    return out


def predicted_peaks(step, given: bool = False) -> Mapping[str, float]:
    """What the planner predicted each device holds ({} where nothing was
    predicted); `given`: a plan given or one device costed too (`predicted()`)."""
    predicted = (step.predicted() if given else
                 step.plan.predicted if step.plan is not None else None)
    if predicted is None:
        return {}
    return predicted.peak_memory_bytes or predicted.memory_bytes or {}


def misfits(step) -> list[Misfit]:
    """The devices whose compiled peak (`step.compiled_memory`) exceeds the
    capacity the plan used less `MARGIN`, worst first."""
    peaks, where = step.compiled_memory or ({}, {})
    caps = capacities(step, list(peaks))
    predicted = predicted_peaks(step)
    out = [Misfit(d, peak, caps[d], (1 - MARGIN) * caps[d], predicted.get(d), where[d])
           for d, peak in peaks.items() if d in caps and peak > (1 - MARGIN) * caps[d]]
    return sorted(out, key=lambda m: -m.excess_bytes)


def replan_cap(misfit: Misfit) -> float:
    """The cap the next plan gets on the device: what the planner predicted it
    holds there (or the capacity, if less or unknown) less the excess the
    compiled stages showed, so that a plan the planner fits under it fits
    compiled too, if the planner's undercount stays what it was."""
    base = misfit.capacity_bytes
    if misfit.predicted_bytes:
        base = min(base, misfit.predicted_bytes)
    return base - misfit.excess_bytes


def does_not_fit(misfit: Misfit, *, tries: int, why: Exception | None = None,
                 cap: float | None = None) -> InfeasibleError:
    """The one-line error once no plan's compiled stages fit (nothing ran)."""
    if why is not None:
        tried = (f"; planned again with {misfit.device} capped at {nbytes(cap)}, no plan fits "
                 f"({str(why).splitlines()[0]})")
    elif cap is not None and cap <= 0:
        tried = "; no smaller plan can be asked for"
    else:
        tried = f"; {tries} plans tried, each over" if tries else ""
    return InfeasibleError(
        f"{misfit.describe()}{tried}. Nothing ran and your arguments are unchanged",
        api="try a smaller batch, microbatches=M with hetpar.value_and_grad, more devices, "
            "or a CPU among the devices to hold state in host memory")


def memory_summary(step) -> dict:
    """{device: {"predicted", "compiled", "measured", "capacity"}} in bytes (None
    where unknown), for `step.report()`: the planner's figure, the compiled
    stages' peak (`compiled_peaks`; a one-device step's executable's own),
    and JAX's allocator's `peak_bytes_in_use` where the backend keeps memory
    statistics (not on CPU; the process's peak on that device, not this
    step's alone)."""
    peaks = dict((step.compiled_memory or ({}, {}))[0])
    one = step.jit_memory() if getattr(step, "_jit", None) is not None else None
    if one is not None:
        (device,) = {d for p in step.placements.values() for d in p.devices}
        peaks[device] = float(one)
    predicted = predicted_peaks(step, given=True)
    devices = sorted(set(peaks) | {d for d in predicted if d in step.devices})
    caps = capacities(step, devices)
    out = {}
    for d in devices:
        measured = None
        dev = step.devices.get(memory_place(d)[0])
        try:
            stats = dev.memory_stats() if dev is not None else None
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            measured = float(stats["peak_bytes_in_use"])
        out[d] = {"predicted": predicted.get(d), "compiled": peaks.get(d),
                  "measured": measured, "capacity": caps.get(d)}
    return out
