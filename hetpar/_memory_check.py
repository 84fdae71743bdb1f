"""The compiled step checked against the devices' memory, before the first
step runs (issue 41, item 2).

The planner prices a layer's memory from its arrays (`held_bytes`); XLA's
executables hold more (temporaries, layouts, code) or less (buffers reused).
Once the step is compiled, each executable's `memory_analysis()` is known.

A one-device plan is one `jax.jit` executable, a data-parallel one one
partitioned executable: their peak is the analysis's own (`executable_peak`:
arguments + outputs + temporaries, less the outputs aliased to donated
arguments, + code; per replica for data parallel). They are compiled when the
step is built, and jit's cache serves the first call that executable: the
check adds no compile.

A split plan's (`compiled_peaks`) replays each device's stages in its order
and keeps the largest total:

    resident   the step's inputs kept on the device (state homed there; a
               donated one given up once its last reader ran), the
               executables' code, and inputs moved there once a step (cached)
    + live     values computed there and not yet read by their last reader:
               activations waiting for the backward, results waiting to
               cross to another device, the new state
    + in flight  what the running stage brought in (state streamed from a
               memory place, values from another device), the state of
               the next streaming stage, prefetched while it runs, and the
               new state the stage before sent home, until its copy ends
    + queued   the next stage on the device, dispatched while this one runs
               (`Executor.prefetch`): its outputs and the inputs copied to it,
               allocated at dispatch
    + working  the running stage's temporaries and its outputs (less those
               aliased to its donated inputs)

and what holds state but runs no stage (a memory place, a device keeping an
offloaded layer's state: `_place_peaks`): the state homed there, the new
state as it arrives, offloaded activations until their backward.
Stages on other devices are taken to run in the global stage order (their
index), which decides when a value read across devices is freed.

`misfits` compares each peak with the capacity the plan used (a `memory=`
cap included), or the device's own less a margin where that is less
(`margin_of`: `MARGIN` for one executable, `SPLIT_MARGIN` for a split
plan's replayed peak), and the CPU devices and memory places together with the host's
RAM as the OS gives it (`host_misfit`: they share it, and the planner's
table gives each of them the whole; a GPU's places as the regions XLA's
pinned pool holds for them, `host_draws`); `AutoStep` plans again with the
devices over capped by their excess, and their twins (accelerators of the
same kind) with the same cap (`replan_caps`), at most `MAX_REPLANS` times,
before anything runs, and gives up with one line (`InfeasibleError`) naming
the device, the bytes and the plan tried that came closest.
A plan given, or a step with one device to run on, runs with a warning.

Not checked: a step under several processes (each process's executables
are its own: they run with the warning, or unchecked for data parallel
across processes).

A CPU device's compiled figure gets what no executable's analysis shows:
the parameters it feeds an accelerator each step, which pass through the
accelerator client's pinned staging pool (`with_host_staging`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping

import numpy as np

from hetpar._host_memory import physical_ram, pinned_pool_bytes
from hetpar.core import InfeasibleError, memory_place, nbytes, pinned_pool_reserved, seconds

#: Capacity kept back from what the plan may use: the allocator's own
#: rounding and fragmentation (XLA's BFC allocator rounds every buffer up to
#: 256 bytes and splits free chunks, so a peak of N bytes needs somewhat
#: more than N), cuDNN/cuBLAS workspaces that `memory_analysis()` does not
#: list, and the runtime's small arrays (PRNG keys, step counters).
#: Measured on an H200 (experiments/results/fit_h200, runs 10-13): the
#: allocator's peak ran 0.5-1.8% over the compiled figure for hetpar's
#: plans, 3.1% for jit's 6.74B step at 99% of the limit. At 5% that step
#: (108 GB compiled, 112.6 GB limit) was kept off the GPU it runs on under
#: jax.jit (which then peaked at 111.4 GB), and planned to recompute 31 of
#: its layers at 1.96x jit's step. The margin cannot be spent freely: JAX
#: gives donated buffers up even where the executable then fails to get
#: its memory (tests/test_gpu.py), so a donating step that runs out loses
#: its state, as under jax.jit.
MARGIN = 0.035

#: The margin for a split plan's peak, which `compiled_peaks` replays from
#: many executables and the transfers between them: on an H200 a
#: Hugging Face Llama (2.9B) offload plan at 45 GB peaked at 43.4 GB
#: against a replayed 39.4 GB (10% over), and a 0.54B Llama-style offload
#: plan at 7.5 GB ran out of memory mid-step with 3.5% kept back
#: (experiments/results/fit_h200, runs 15 and 16).
SPLIT_MARGIN = 0.12


def margin_of(step) -> float:
    """`SPLIT_MARGIN` for a step run as several executables, else `MARGIN`."""
    stages = getattr(step, "stages", None)
    return SPLIT_MARGIN if stages is not None and len(stages.stages) > 1 else MARGIN


#: How far over a device's capacity the planner may put the whole step on
#: it alone before the step is compiled there to see whether it fits
#: (`_step_planning.fits_compiled`). Since activations and gradients count
#: once for one batch (`planner.Arrays.overlap`), the planner's figure for a
#: whole step ran 1.12-1.27x the compiled one on an H200 (6.74B Llama-style
#: 121/108 GB, Hugging Face Llama 2.9B 58.8/47.4, 0.54B Llama-style
#: 17.8/14.0; experiments/results/fit_h200, runs 11 and 19): over 1.3x the
#: capacity, the executable cannot fit within the margin, and each such
#: compile cost 35-42 s of those first calls (run 19).
COMPILE_WITHIN = 1.3


class MemoryCheckWarning(UserWarning):
    """A plan given (or with one device to run on) does not fit its compiled stages."""


@dataclasses.dataclass(frozen=True)
class Misfit:
    """A device whose compiled stages need more than the plan may use there.

    Attributes:
      device: the device name.
      compiled_bytes: the compiled stages' peak there (`compiled_peaks`).
      capacity_bytes: the capacity the plan used (`memory=` cap included).
      usable_bytes: `capacity_bytes`, or the device's own capacity less
        `margin` where that is less.
      predicted_bytes: what the planner predicted the device holds (None if unknown).
      stage: where the peak falls, for messages ("stage 7 (backward) of [layers]").
    """

    device: str
    compiled_bytes: float
    capacity_bytes: float
    usable_bytes: float
    predicted_bytes: float | None
    stage: str
    host: bool = False  # the host's RAM, which `device` shares with others (`host_misfit`)
    margin: float = MARGIN  # the share of `capacity_bytes` kept back (`margin_of`)

    @property
    def excess_bytes(self) -> float:
        return self.compiled_bytes - self.usable_bytes

    def describe(self) -> str:
        if self.host:
            return (f"the compiled stages need {nbytes(self.compiled_bytes)} of the host's RAM "
                    f"at their peaks ({self.stage}), over the {nbytes(self.usable_bytes)} it may "
                    f"give ({nbytes(self.capacity_bytes)} for arrays, from the OS, less a "
                    f"{self.margin:.1%} margin)")
        kept = (f"{nbytes(self.usable_bytes / (1 - self.margin))} less a {self.margin:.1%} "
                "margin" if self.usable_bytes < self.capacity_bytes else
                f"its cap; the device's own capacity less a {self.margin:.1%} margin is more")
        return (f"the compiled stages need {nbytes(self.compiled_bytes)} on {self.device} at "
                f"their peak ({self.stage}), over the {nbytes(self.usable_bytes)} the plan may "
                f"use there ({kept})")


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


def compiled_peaks(executor, walk: list | None = None
                   ) -> tuple[dict[str, float], dict[str, str]]:
    """({device: peak bytes over the step}, {device: the stage where it falls})
    from the executor's compiled stages (`Executor.stage_memory`), memory
    places (`gpu:0:pinned_host`) included (`_place_peaks`); devices whose
    stages have no memory analysis are left out.

    `walk`, a list, gets one entry per stage replayed: {"device", "stage",
    "during" (bytes while it runs), "after" (held once it ran and what it
    was the last reader of is freed)}, to set beside what the device's
    allocator holds after each stage (`Executor.record_memory`)."""
    stages = executor.stages
    memory = executor.stage_memory
    peaks: dict[str, float] = {}
    where: dict[str, str] = {}
    last_read: dict = {}
    for st in stages.stages:
        for v in st.inputs:
            last_read[v] = max(last_read.get(v, -1), st.index)
    outputs = set(executor._outvars)
    donated = _donated(executor)
    away = set(executor._send_home)  # new state sent to a memory place as it is made
    for vs in executor._offload_vars:  # activations waiting in pinned host memory
        away.update(vs)
    home = dict(zip(executor._invars, stages.input_devices))
    producer = executor._producer
    for device in executor.local:
        order = stages.device_order.get(device, ())
        if not order or any(memory[i] is None for i in order):
            continue
        # The step's inputs homed here; a donated one is given up once its
        # last reader ran (taken donated by it: its result written into it,
        # which that executable's analysis counts once).
        held = {v: _bytes(v) for v, d in home.items() if d == device}
        code: dict = {}  # one copy of each distinct executable's code
        for i in order:
            code[id(executor.compiled[i])] = memory[i].generated_code_size_in_bytes
        resident = sum(code.values())
        live: dict = {}  # values made here, alive until their last reader
        cached: set = set()  # step inputs moved here once a step
        # New state on its way home (`Executor._send_home`): its device
        # buffer lives until the copy ends, and a worker waits for a
        # stage's copies out only when it dispatches the stage `prefetch`
        # after it (`runtime._run`), so the last prefetch - 1 stages' are
        # still here. Not counted, the zoo 5.04B plan streaming 25 layers'
        # state at 45 GB of an H200 was compiled at 23.0 GB and measured at
        # 26.0 (fit_h200, run 57): a 1.6 GB state and more.
        sending = [0.0] * max(executor.prefetch - 1, 0)
        peak, at = resident + sum(held.values()), "the step's inputs"
        for pos, i in enumerate(order):
            st, m = stages.stages[i], memory[i]
            for v in [v for v in held if v in donated and last_read.get(v, -1) < i]:
                del held[v]
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
            queued = _queued_bytes(executor, order[pos + 1] if pos + 1 < len(order) else None,
                                   device, st, live, home, cached, nxt)
            now = (resident + sum(held.values()) + sum(live.values())
                   + sum(_bytes(v) for v in cached) + transient + ahead + working + queued
                   + sum(sending))
            if now > peak:
                peak = now
                at = (f"stage {i} ({st.phase}"
                      + ("" if st.microbatch is None else f", microbatch {st.microbatch}")
                      + f") of {list(st.layers)[:3]}" + ("..." if len(st.layers) > 3 else "")
                      + _parts(inputs=sum(held.values()) + sum(_bytes(v) for v in cached),
                               made=sum(live.values()), brought=transient + ahead,
                               sending=sum(sending),
                               working=working, queued=queued, code=resident))
            for v in st.outputs:
                if v not in away and (v in outputs or last_read.get(v, -1) > i):
                    live[v] = _bytes(v)
            if sending:
                sending = [*sending[1:], sent_home_bytes(executor, st)]
            for v in list(live):
                if v not in outputs and last_read.get(v, -1) <= i:
                    del live[v]
            if walk is not None:
                kept_inputs = sum(b for v, b in held.items()
                                  if not (v in donated and last_read.get(v, -1) <= i))
                walk.append({"device": device, "stage": i, "during": now,
                             "after": resident + kept_inputs + sum(live.values())
                             + sum(_bytes(v) for v in cached)})
        # Results computed elsewhere that come home here at the step's end.
        wanted = stages.output_devices or ()
        back = sum(_bytes(v) for v, d in zip(executor._outvars, wanted)
                   if d == device and hasattr(v, "aval")
                   and producer.get(v) is not None
                   and stages.stages[producer[v]].device != device)
        kept = {v: b for v, b in held.items() if v not in donated}
        end = resident + sum(kept.values()) + sum(live.values()) + back
        if end > peak:
            peak, at = end, ("the step's end, the new state held" if donated else
                             "the step's end, the old and the new state both held")
        peaks[device] = peak
        where[device] = at
    for place, (peak, at) in _place_peaks(executor, last_read, donated).items():
        peaks[place], where[place] = peak, at
    return peaks, where


def sent_home_bytes(executor, st) -> float:
    """Bytes of stage `st`'s outputs the runtime sends away as they are made
    (`Executor.sent_away`: new state for a memory place, activations
    offloaded to pinned host memory until the backward)."""
    return sum(_bytes(v) for v in executor.sent_away(st.index))


def _member_bytes(aval, sharding) -> float:
    """Bytes one member of `sharding`'s devices holds of a value `aval`."""
    try:
        shape = sharding.shard_shape(tuple(aval.shape))
        return float(np.prod(shape, dtype=float)) * int(aval.dtype.itemsize)
    except (AttributeError, TypeError, ValueError):  # a PRNG key and the like: small
        return 0.0


def group_peaks(runner, members: Mapping[str, tuple[str, ...]]
                ) -> tuple[dict[str, float], dict[str, str]]:
    """({member device: peak bytes over the step}, {member device: the stage
    where it falls}) of a group plan (`hetpar.runtime.GroupRunner`; `members`:
    each group's device names): its stages replayed in the order it
    dispatches them, one at a time.

    A group's members hold alike: per member, the state resting on the
    group (the caller's copy, given up by its last reader where donated), each
    value a stage made there until its last reader ran (new state sent to
    pinned host memory leaves as it is made), and while a stage runs its
    inputs brought from elsewhere, its outputs and its working set
    (`stage_working_bytes`). ({}, {}) where a stage has no memory analysis."""
    stages = runner.stages.stages
    if any(m is None for m in runner.stage_memory):
        return {}, {}
    last_read: dict = {}  # the last stage reading each value, in dispatch order
    for i in runner._order:
        for v in stages[i].inputs:
            last_read[v] = i
    live: dict[str, dict] = {g: {} for g in runner.groups}  # group -> {var: bytes}
    for v, group in zip(runner._invars, runner.stages.input_devices):
        sharding = runner._home.get(v)
        if sharding is not None and getattr(sharding, "memory_kind", None) != "pinned_host":
            live[group][v] = _member_bytes(v.aval, sharding)
    peak: dict[str, float] = {}
    where: dict[str, str] = {}
    kept = set(runner._outvars) | set(runner._invars)
    donated = runner.donated
    for i in runner._order:
        st, g = stages[i], stages[i].device
        held = live[g]
        brought = sum(_member_bytes(v.aval, s) for v, s in zip(st.inputs, runner._in[i])
                      if v not in held)
        made = sum(_member_bytes(v.aval, s) for v, s in zip(st.outputs, runner._out[i]))
        working = stage_working_bytes(runner.stage_memory[i])
        during = sum(held.values()) + brought + max(working, made)
        if during > peak.get(g, -1.0):
            peak[g] = during
            where[g] = (f"stage {i} ({', '.join(list(st.layers)[:3])}): held "
                        f"{nbytes(sum(held.values()))}, brought {nbytes(brought)}, "
                        f"working {nbytes(max(working, made))}")
        for v, s in zip(st.outputs, runner._out[i]):
            if v not in runner._send_home:
                held[v] = _member_bytes(v.aval, s)
        for v in st.inputs:
            if (v not in kept or v in donated) and last_read.get(v) == i:
                for values in live.values():
                    values.pop(v, None)
    out, told = {}, {}
    for g in peak:
        for d in members[g]:
            out[d], told[d] = peak[g], f"group {g}, {where[g]}"
    return out, told


def _queued_bytes(executor, j, device, st, live, home, cached, nxt) -> float:
    """What stage `j`, dispatched while `st` runs on `device` (a worker keeps
    `Executor.prefetch` = 2 stages in flight), holds there already: its
    outputs (allocated at dispatch, less those written into its donated
    inputs) and the inputs copied to it (less the streamed state `ahead`
    counts). Its temporaries reuse the running stage's (one stream)."""
    if j is None or executor.prefetch < 2:
        return 0.0
    m = executor.stage_memory[j]
    out = max(m.output_size_in_bytes - m.alias_size_in_bytes, 0)
    streamed = set(executor._streamed[j]) if nxt == j else set()
    made = set(st.outputs)
    return out + sum(_bytes(v) for v in executor.stages.stages[j].inputs
                     if v not in live and v not in made and home.get(v) != device
                     and v not in cached and v not in streamed)


def _parts(**parts: float) -> str:
    """What a peak is made of, for messages: ": inputs 20 GB + made 15 GB + ..."
    (the step's inputs held there, values made there not yet read, what the
    stage brought in or prefetched, its working set, code), largest first."""
    shown = [f"{k} {nbytes(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
             if v >= 0.01 * max(parts.values(), default=0) and v > 0]
    return ": " + " + ".join(shown) if shown else ""


def _donated(executor) -> set:
    """The step's inputs it gives up (`donate_argnums`), less those it returns as they are."""
    return ({executor._invars[i] for i in getattr(executor, "donated", ())}
            - set(executor._outvars))


def _place_peaks(executor, last_read: dict, donated: set) -> dict[str, tuple[float, str]]:
    """{holder: (peak bytes, where)} for what holds the step's state and runs
    none of its stages: a memory place (`gpu:0:pinned_host`), or a device
    that only keeps an offloaded layer's state. Replayed in the global stage
    order: the state homed there (a donated leaf freed once its last reader
    ran), the new state (sent to a memory place as each stage makes it, to a
    device at the step's end) and activations offloaded there until their
    backward reads them."""
    stages = executor.stages
    home = dict(zip(executor._invars, stages.input_devices))
    back = {v: d for v, d in zip(executor._outvars, stages.output_devices or ())
            if d is not None and hasattr(v, "aval")}
    holders = ({d for d in home.values()} | set(back.values())
               | {p for p in executor._offload_out if p is not None})
    holders = {d for d in holders if not stages.device_order.get(d)}
    out = {}
    for holder in sorted(holders):
        as_made = memory_place(holder)[1] is not None
        held = {v: _bytes(v) for v, d in home.items() if d == holder}
        arrived: dict = {}
        waiting: dict = {}  # offloaded activations
        peak, at = sum(held.values()), "the step's inputs"
        for st in stages.stages:
            i = st.index
            for v in [v for v in held if v in donated and last_read.get(v, -1) < i]:
                del held[v]
            if as_made:
                arrived.update((v, _bytes(v)) for v in st.outputs if back.get(v) == holder)
            if executor._offload_out[i] == holder:
                waiting.update((v, _bytes(v)) for v in executor._offload_vars[i])
            now = sum(held.values()) + sum(arrived.values()) + sum(waiting.values())
            if now > peak:
                peak, at = now, f"after stage {i} ({st.phase}) of {list(st.layers)[:3]}"
            for v in [v for v in waiting if last_read.get(v, -1) <= i]:
                del waiting[v]
        end = (sum(b for v, b in held.items() if v not in donated)
               + sum(_bytes(v) for v, d in back.items() if d == holder))
        if end > peak:
            peak, at = end, ("the step's end, the new state held" if donated else
                             "the step's end, the old and the new state both held")
        out[holder] = (peak, at)
    return out


def host_ram() -> float | None:
    """The host's RAM this process's arrays may use, from the OS
    (`live_capacity` of a CPU device, `cost_models._devices.host_room`):
    what every CPU device and memory place of this process shares."""
    import jax

    from hetpar.cost_models import live_capacity

    return live_capacity(jax.devices("cpu")[0])[0]


def on_host(step, name: str) -> bool:
    """Whether device or memory place `name` draws on the host's RAM: a CPU
    device, or a memory place (pinned host memory is the host's)."""
    device, kind = memory_place(name)
    if kind is not None:
        return True
    dev = step.devices.get(device)
    return dev is not None and dev.platform == "cpu"


# A one-device or data-parallel step is compiled ahead of its first call, to
# check its memory, only where its predicted peak is over this share of a
# device's capacity (or unknown). Below it, a misfit would need the memory
# model to undercount by over 2x (measured 0.92-1.17x on an H200:
# experiments/results/fit_h200); the step then compiles at its first call
# as under jax.jit, and `lower()` compiles nothing.
CHECK_FROM = 0.5


def worth_compiling(step, devices) -> bool:
    """Whether a one-device or data-parallel step's memory check can matter
    on `devices` (see `CHECK_FROM`). A step nothing planned (one device) is
    costed here from its spec table, unless the first call calibrates (that
    costing would time the step before its check): then it is checked."""
    predicted = predicted_peaks(step, given=not step.options.calibrates())
    caps = capacities(step, devices)
    return any(predicted.get(d) is None or d not in caps or predicted[d] > CHECK_FROM * caps[d]
               for d in devices)


def capacities(step, devices, capped: bool = True,
               memory: Mapping[str, float] | None = None) -> dict[str, float]:
    """{device: the capacity the plan used}: its cost table's figure (this
    machine's, for a present device) under the `memory=` caps (`memory`,
    where given, instead of the step's), else what the device holds here
    (`live_capacity`). `capped=False`: what each holds, the caps aside."""
    from hetpar.cost_models import live_capacity

    if memory is None:
        memory = step.options.memory
    memory = (memory or {}) if capped else {}
    table = step.table
    if table is not None and memory:
        from hetpar.planner._solve import with_memory

        table = with_memory(table, memory)
    known = {d.name: d.memory_bytes for d in table.devices} if table is not None else {}
    out = {}
    for d in devices:
        cap = known.get(d)
        if cap is None:
            device, kind = memory_place(d)
            if kind is None:
                cap = live_capacity(step.devices[device])[0]
            else:  # a memory place: the host's RAM, and a GPU's within XLA's pinned pool
                cap = host_ram()
                if cap is not None and step.devices[device].platform == "gpu":
                    cap = min(cap, pinned_pool_bytes())
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


def staged_bytes(step) -> dict[str, float]:
    """{CPU device: bytes} the accelerators' pinned staging holds on the host
    for the step's parameters that live on a CPU device and compute on an
    accelerator (the planner's `staging_bytes`, from the step's layers and
    placements, so a plan given as a dict is counted too)."""
    out: dict[str, float] = {}
    for name, pl in step.placements.items():
        home, kind = memory_place(pl.params)
        dev, compute = step.devices.get(home), step.devices.get(pl.compute)
        if (kind is None and home != pl.compute and dev is not None and compute is not None
                and dev.platform == "cpu" and compute.platform != "cpu"):
            out[home] = out.get(home, 0.0) + float(step.graph[name].param_bytes or 0)
    return out


def with_host_staging(step, compiled: tuple[dict, dict]) -> tuple[dict, dict]:
    """`compiled` (`compiled_peaks`) with the parameters the step's CPU
    devices feed accelerators added to their figures (`staged_bytes`)."""
    peaks, where = compiled
    staged = {d: b for d, b in staged_bytes(step).items() if d in peaks and b > 0}
    if not staged:
        return compiled
    peaks, where = dict(peaks), dict(where)
    for d, b in staged.items():
        peaks[d] += b
        where[d] = f"{where[d]} + {nbytes(b)} of parameters staged for the accelerators"
    return peaks, where


def misfits(step, limits: Mapping[str, float] | None = None) -> list[Misfit]:
    """The devices whose compiled peak (`step.compiled_memory`) exceeds the
    capacity the plan used less its margin (`margin_of`), worst first; then, where the CPU
    devices and memory places together exceed the host's RAM (the OS's
    figure, less `MARGIN`: `host_misfit`), that one. `limits`: the caps the
    compiled peaks answer to, where not the step's own `memory=` (the
    caller's, without the caps a replan set to steer the planner:
    `replan_caps`)."""
    peaks, where = step.compiled_memory or ({}, {})
    caps = capacities(step, list(peaks), memory=limits)
    usable = usable_capacities(step, list(peaks), limits=limits)
    predicted = predicted_peaks(step)
    m = margin_of(step)
    out = [Misfit(d, peak, caps[d], usable[d], predicted.get(d), where[d], margin=m)
           for d, peak in peaks.items() if d in caps and peak > usable[d]]
    out = sorted(out, key=lambda m: -m.excess_bytes)
    host = host_misfit(step, peaks, predicted)
    return out if host is None else [*out, host]


def usable_capacities(step, devices, limits: Mapping[str, float] | None = None
                      ) -> dict[str, float]:
    """{device: what the plan's compiled peak may reach there}: the capacity
    the plan used (under `limits` where given, as `misfits`), or the
    device's own less the step's margin (`margin_of`) where that is less."""
    caps = capacities(step, devices, memory=limits)
    held = capacities(step, devices, capped=False)
    m = margin_of(step)
    # The margin is kept back from what the device holds, not from a cap under
    # it: a cap (the caller's, or the one a replan set after the compiled
    # stages or a step ran over) is what the plan may use, and a plan
    # planned to a cap was replanned again for the margin taken off it (run
    # 23: a 0.54B plan capped at 4.56 GB after running out of memory on a
    # 7.5 GB GPU replayed at 4.53 GB, over the 4.02 GB then allowed).
    return {d: min(c, (1 - m) * held.get(d, c)) for d, c in caps.items()}


def host_misfit(step, peaks: Mapping[str, float], predicted: Mapping[str, float]
                ) -> Misfit | None:
    """The host's RAM overdrawn: what the step's CPU devices and memory
    places (`on_host`) draw on it, the sum of their compiled peaks with the
    places' as the regions XLA's pinned pool holds to serve them
    (`host_draws`), against the OS's figure (`host_ram`) less `MARGIN`.
    (Their peaks may fall at different times: the sum is an upper bound.)
    Checked where two or more draw on it, or a place alone draws more than
    it holds. The misfit names the largest of them, which a plan again gets
    capped."""
    shared = {d: p for d, p in peaks.items() if on_host(step, d)}
    drawn, pool = host_draws(step, shared)
    ram = host_ram() if len(shared) > 1 or drawn > sum(shared.values()) else None
    if not ram or drawn <= (1 - MARGIN) * ram:
        return None
    largest = max(shared, key=shared.get)
    parts = " + ".join(f"{d} {nbytes(p)}" for d, p in sorted(shared.items(), key=lambda x: -x[1]))
    if pool:
        parts += f" (XLA's pinned pool holding {nbytes(pool)} for its places)"
    # Capped again below what it holds now (compiled), or was predicted to.
    own = min(shared[largest], predicted.get(largest) or float("inf"))
    return Misfit(largest, drawn, ram, (1 - MARGIN) * ram, own,
                  f"host RAM, shared: {parts}", host=True)


def host_draws(step, shared: Mapping[str, float]) -> tuple[float, float]:
    """(bytes of the host's RAM that `shared` {CPU device or memory place:
    peak} draws, of which XLA's pinned pool): a process's GPU places share
    one pool, which holds its regions to serve them
    (`pinned_pool_reserved`, up to `pinned_pool_bytes`); other places (a
    CPU device's own) draw their bytes."""
    pooled = {d for d in shared if _gpu_place(step, d)}
    served = sum(shared[d] for d in pooled)
    pool = pinned_pool_reserved(served, pinned_pool_bytes()) if pooled else 0.0
    return sum(p for d, p in shared.items() if d not in pooled) + pool, pool


def _gpu_place(step, name: str) -> bool:
    """Whether `name` is the pinned host memory of one of this process's GPUs
    (its pool: one per process)."""
    import jax

    device, kind = memory_place(name)
    dev = step.devices.get(device) if kind == "pinned_host" else None
    return (dev is not None and dev.platform == "gpu"
            and getattr(dev, "process_index", jax.process_index()) == jax.process_index())


def replan_cap(misfit: Misfit) -> float:
    """The cap the next plan gets on the device: what the planner predicted it
    holds there (or the capacity, if less or unknown) less the excess the
    compiled stages showed, so that a plan the planner fits under it fits
    compiled too, if the planner's undercount stays what it was; and never
    more than the compiled peak may reach there, so that where the planner
    overcounted (planned to the whole capacity, replayed lower but still
    over what the margin leaves) one replan fits if it still overcounts (a
    6.74B Llama over two 45 GB H200s: planned at 45 GB, replayed at 41.2,
    capped at 43.4 and replayed at 40.4, over 39.6 each time; fit_h200x2, run 32)."""
    base = misfit.capacity_bytes
    if misfit.predicted_bytes:
        base = min(base, misfit.predicted_bytes)
    return min(base - misfit.excess_bytes, misfit.usable_bytes)


def replan_caps(step, found: list[Misfit]) -> dict[str, float]:
    """{device: cap} for the next plan: each device over (`replan_cap`;
    the host's RAM, `host_misfit`, on its largest user), and each other
    accelerator of the same kind as one over given the same cap, or what the
    planner put there where more (that fitted compiled), but never more than
    it may reach (`usable_capacities`): devices of one kind are the same to
    the planner, which moved what a cap took off one GPU onto its twin, and
    that one went over in turn (fit_h200x2, run 33: four plans, the two
    GPUs over by turns). The caps steer the planner: the compiled peaks
    still answer to the devices' own capacities and the caller's caps
    (`AutoStep._new_step` passes those to `misfits`)."""
    caps: dict[str, float] = {}
    for m in found:
        caps[m.device] = min(replan_cap(m), caps.get(m.device, float("inf")))
    table = getattr(step, "table", None)
    if table is None:
        return caps
    kinds = {d.name: d.kind for d in table.devices}
    per_kind: dict[str, float] = {}
    for m in found:
        if not m.host and not on_host(step, m.device):
            k = kinds.get(m.device)
            per_kind[k] = min(caps[m.device], per_kind.get(k, float("inf")))
    peers = [d for d, k in kinds.items() if k in per_kind and d not in caps
             and d in step.devices and not on_host(step, d)]
    usable = usable_capacities(step, peers)
    predicted = predicted_peaks(step)
    for d in peers:
        if d in usable:  # (what it was planned to hold fitted compiled: it may keep that)
            caps[d] = min(usable[d], max(per_kind[kinds[d]], predicted.get(d) or 0.0))
    return caps


#: A plan replanned by the memory check predicted more than this many times
#: the step of the plan it replaces is said so in a warning (`slower_replan`).
SLOWER_REPLAN = 2.0


def slower_replan(before, after, misfit: Misfit, cap: float) -> str | None:
    """The warning for a replanned plan (`after`) predicted over
    `SLOWER_REPLAN` x the step of the first plan (`before`), naming the
    devices it now computes on and how many layers each: under a cap, the
    planner may move layers to a far slower host CPU (a 2.9B Llama at 45 GB
    of an H200 was replanned with 16 of its 27 layers there, predicted at
    seconds a layer; experiments/results/fit_h200, run 19). None otherwise."""
    def step_s(plan):
        p = getattr(plan, "predicted", None)
        return None if p is None else p.step_time_s

    b, a = step_s(before), step_s(after)
    if not b or not a or a <= SLOWER_REPLAN * b:
        return None

    def tally(devices) -> str:
        return ", ".join(f"{n} on {d}" for d, n in Counter(devices).most_common())

    places = list(after.placements.values())
    apart = tally(p.state for p in places if p.state != p.compute)
    return (f"hetpar: planned again with {misfit.device} capped at {nbytes(cap)} (its compiled "
            f"stages were over), the step is predicted {a / b:.1f}x slower ({seconds(a)} "
            f"against {seconds(b)}): layers compute {tally(p.compute for p in places)}"
            + (f", their state {apart}" if apart else "")
            + ". A smaller batch, more devices or microbatches=M with hetpar.value_and_grad "
            "may run faster")


def does_not_fit(misfit: Misfit, *, tries: int, why: Exception | None = None,
                 cap: float | None = None, closest: Misfit | None = None) -> InfeasibleError:
    """The one-line error once no plan's compiled stages fit (nothing ran),
    naming, where plans were tried, the one that came closest (`closest`: its
    worst misfit, the least over of the plans')."""
    if why is not None:
        tried = (f"; planned again with {misfit.device} capped at {nbytes(cap)}, no plan fits "
                 f"({str(why).splitlines()[0]})")
    elif cap is not None and cap <= 0:
        tried = "; no smaller plan can be asked for"
    else:
        tried = f"; {tries} plans tried, each over" if tries else ""
    if closest is not None and (tries or why is not None):
        tried += (f"; the smallest footprint found needs {nbytes(closest.compiled_bytes)} on "
                  f"{closest.device}, over its {nbytes(closest.usable_bytes)}")
    return InfeasibleError(
        f"{misfit.describe()}{tried}. Nothing ran and your arguments are unchanged",
        api="try a smaller batch, microbatches=M with hetpar.value_and_grad, more devices, "
            "or a CPU among the devices to hold state in host memory")


def memory_summary(step) -> dict:
    """{device: {"predicted", "compiled", "measured", "capacity"}} in bytes (None
    where unknown), for `step.report()`: the planner's figure, the compiled
    stages' peak (`compiled_peaks`; a one-device step's executable's own; a
    data-parallel or sharded step's, per replica, once its first call ran),
    and JAX's allocator's `peak_bytes_in_use` where the backend keeps memory
    statistics (not on CPU; the process's peak on that device, not this
    step's alone). The capacity is what the compiled peak answers to (the
    device's, or the caller's cap); where a replan capped the planner below
    it (`replan_caps`), "planned_under" gives that cap."""
    peaks = dict((step.compiled_memory or ({}, {}))[0])
    if not peaks and getattr(step, "_replicated", None) is not None:
        each = step.replicated_memory()  # (checked before running only near capacity)
        if each is not None:
            peaks = dict.fromkeys(step.plan.replicas, float(each))
    one = step.jit_memory() if getattr(step, "_jit", None) is not None else None
    if one is not None:
        (device,) = {d for p in step.placements.values() for d in p.devices}
        peaks[device] = float(one)
    predicted = predicted_peaks(step, given=True)
    devices = sorted(set(peaks) | {d for d in predicted if d in step.devices})
    limits = getattr(step, "memory_limits", None)
    caps = capacities(step, devices, memory=limits)
    steered = capacities(step, devices) if limits is not None else caps
    out = {}
    before = getattr(step, "peaks_before_run", None) or {}
    for d in devices:
        # A memory place (`gpu:0:pinned_host`) has no figure of its own: its
        # device's allocator counts the device's memory, not the place's.
        measured = allocator_peak(step, d) if memory_place(d)[1] is None else None
        out[d] = {"predicted": predicted.get(d), "compiled": peaks.get(d),
                  "measured": measured, "capacity": caps.get(d)}
        if steered.get(d) is not None and caps.get(d) is not None and steered[d] < caps[d]:
            out[d]["planned_under"] = steered[d]
        if measured is not None and before.get(memory_place(d)[0]) == measured:
            # The allocator's peak cannot be reset: one reached before the
            # first step ran (the calibration timing the step on its own copy
            # of the state, place()) says nothing of the step's own.
            out[d]["measured_before_step"] = True
    return out


def host_memory_summary(memory: dict, step) -> dict | None:
    """For `step.report()` (`step["host_memory"]`): the host's RAM, which the
    step's CPU devices and memory places share and which the OS kills the
    process for overdrawing (fit_h200, run 50: planned at 113 GB on a 134 GB
    host, killed at 130). Their `memory` figures (`memory_summary`) summed,
    beside the process's resident high-water mark (`process_rss_peak`: the
    process's, not the step's alone) and the RAM the OS gives. None where
    the step has no CPU device or memory place."""
    host = [d for d in memory if on_host(step, d)]
    if not host:
        return None

    def total(field):  # a GPU's places as the pinned pool draws for them (`host_draws`)
        got = {d: memory[d].get(field) for d in host}
        return None if any(v is None for v in got.values()) else host_draws(step, got)[0]

    return {"devices": host, "predicted": total("predicted"), "compiled": total("compiled"),
            "measured": process_rss_peak(), "capacity": host_total(),
            "for_arrays": host_ram()}


def host_total() -> float | None:
    """The host's RAM (`physical_ram`), None where the OS does not say: what
    the process's resident peak (`process_rss_peak`) answers to."""
    return physical_ram()


def process_rss_peak() -> float | None:
    """This process's resident memory high-water mark in bytes (`VmHWM`,
    Linux), None where the OS does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def allocator_peak(step, name: str) -> float | None:
    """The allocator's `peak_bytes_in_use` on device (or memory place) `name`'s
    device, None where the backend keeps no statistics (CPU)."""
    dev = step.devices.get(memory_place(name)[0])
    try:
        stats = dev.memory_stats() if dev is not None else None
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = None
    return float(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
