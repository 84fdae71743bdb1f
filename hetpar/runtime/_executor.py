"""Runs a StageGraph: one compiled executable per stage, one worker per device.

JAX dispatch from one Python thread did not overlap CPU and GPU work on the
GPU machine; one thread per device did (docs/measurements.md). So every device gets a
worker thread that runs its stages in the schedule's order. A stage waits for
the stages that produce its inputs, pulls those inputs onto its device
through the transfer engine (so a transfer starts as soon as its producer is
done, while other stages compute) and runs its executable.

Worker threads belong to a `Workers` object (`_workers`) that several
executors may share.

Failures: an exception inside a stage stops the step and surfaces as a
`StageError` naming the stage's layers and device (for accelerator stages
whose error only shows when their results are read: as JAX's own error, as
with `jax.jit`). Unless the step donates them (`donate`), none of the
caller's buffers is donated, so the caller's parameters and optimizer state
are never left half-updated or deleted (the price: the old and new state
coexist in memory during a step, as with `jax.jit` without
`donate_argnums`). The runtime's own copies are another matter: on an
accelerator a stage takes the state (and fetched weights) copied in for it
alone donated and writes its new state into it (`_copies_donated`).

Donation (`donate`, from `hetpar.auto(..., donate_argnums=...)`): a donated
input is given up by its last reader. Where one stage reads it on its own
device after every other reader was dispatched (`_last_readers`), that
stage's executable takes it donated (XLA writes the new state into it);
otherwise (state read from another device or a memory place, a move per
read) the buffer is deleted once its last reader was dispatched (JAX frees
it when the copies reading it are done). Either way the old state goes as
the new is made, on the device and on the host alike, and the caller's
donated arrays end the step deleted, as `jax.jit` leaves them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import SingleDeviceSharding

from hetpar.core import HetparError, PlanError, memory_place
from hetpar.cost_models import has_pinned_host, host_cores
from hetpar.passes import Stage, StageGraph
from hetpar.runtime._network import Crossing, Network, crossings, global_order, local_part
from hetpar.runtime._run import StageError, StageEvent, _give_up, _Run
from hetpar.runtime._transfer import TransferEngine, copied_apart
from hetpar.runtime._workers import Workers


def _compile(stage: Stage, device: jax.Device, donate: tuple[int, ...] = ()):
    """The stage as a `jax.jit` function, compiled now for its device, and
    XLA's memory analysis of the executable (None where the backend gives none).

    Calls go through jit's C++ dispatch; the compile below fills the cache it
    reads, so the first step does not pay for compilation. `donate`: the
    positions of inputs the stage is the last reader of (`Executor._donate`).
    """
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding)
            for v in stage.inputs]
    fn = jax.jit(jcore.jaxpr_as_fun(stage.jaxpr), in_shardings=sharding,
                 out_shardings=sharding, donate_argnums=donate)
    with warnings.catch_warnings():
        # A donated input no output can reuse is still given up (freed after
        # the stage), which is all donation promises here.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        executable = fn.lower(*args).compile()
    try:
        memory = executable.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without it: the check skips the stage
        memory = None
    return fn, memory


class Executor:
    """Compiles the stages of a StageGraph and runs them, one thread per device.

    State kept in a memory place (`gpu:0:pinned_host`, a layer's optimizer
    state in its GPU's pinned host memory) comes to the device when the
    streaming stage before the one that reads it is dispatched (`_Run._stage`
    says why), and the new state goes back as soon as the stage that computed
    it is dispatched, not at the step's end: the device then holds a few
    layers' optimizer state at a time, not the model's. Since dispatch runs
    ahead of the device, and a stage's outputs are allocated when it is
    dispatched, a worker lets at most `prefetch` stages be in flight on its
    device (and the next streaming stage's state arrive meanwhile): before
    dispatching another, it waits for the oldest to finish.

    Args:
      stages: the split step.
      devices: device name -> jax.Device, for every device the stages name
        (a memory place maps to its device, or is derived from it).
      transfer: the transfer engine (default: a new one).
      workers: the per-device worker threads (default: the executor's own).
      prefetch: stages in flight per device (default: `Executor.PREFETCH`).
      donate: positions of the step's flat inputs it donates (the leaves of
        `donate_argnums`), given up by their last reader (module docstring);
        one process only.
      across: a hierarchical plan under several processes: every process
        runs all the stages on its own devices (`devices`), on its share of
        the batch, and `across[name]` lists device `name`'s counterpart on
        every process, in process order. What the update reads from the
        forward and backward (the gradients), and the floating-point results
        they make (the loss), are averaged over the processes first, so
        every process applies the same update (the split needs
        `update_apart=True`).
    """

    #: Default stages in flight per device (one computing, one queued),
    #: besides the next streaming stage's state arriving. The compiled
    #: memory check (`hetpar._memory_check.compiled_peaks`) counts the
    #: queued stage's outputs and copied inputs beside the running one's.
    PREFETCH = 2

    def __init__(self, stages: StageGraph, devices: Mapping[str, jax.Device],
                 transfer: TransferEngine | None = None, workers: Workers | None = None,
                 prefetch: int | None = None,
                 across: Mapping[str, Sequence[jax.Device]] | None = None,
                 donate: Sequence[int] = ()):
        self.stages = stages
        self.devices = dict(devices)
        self.transfer = transfer or TransferEngine()
        self.workers = workers or Workers()
        self.prefetch = max(int(prefetch or self.PREFETCH), 1)
        # Under several processes (jax.distributed) this process runs the
        # stages of its own devices; values cross to others' devices as
        # collectives (hetpar.runtime._network).
        self.across = dict(across) if across else None
        self.multi_process = jax.process_count() > 1 and self.across is None
        me = jax.process_index()
        self.local = [d for d in stages.device_order
                      if self._process_of(d) == me or not self.multi_process]
        self.stage_memory: list = [None] * len(stages.stages)  # set by _compile_all
        jaxpr = stages.graph.program.jaxpr.jaxpr
        self._invars = list(jaxpr.invars)
        self._is_input = set(self._invars)
        self._outvars = list(jaxpr.outvars)
        if donate and (self.multi_process or self.across):
            raise HetparError("donate_argnums: a plan over several processes does not donate "
                              "yet; drop donate_argnums", api="hetpar.auto(donate_argnums=())")
        self.donated = tuple(sorted(set(donate)))
        # Stages that read state kept away from their device: an offloaded
        # layer's parameters or optimizer state (streamed state).
        homes = {d for p in stages.placements.values() if p.offloaded
                 for d in (p.params, p.state) if d != p.compute}
        home_of = {v: d for v, d in zip(self._invars, stages.input_devices) if d in homes}
        streamed = [tuple(v for v in st.inputs if home_of.get(v, st.device) != st.device)
                    for st in stages.stages]
        self._streams = [bool(vs) for vs in streamed]
        # Step inputs read by several stages of one device move there once a
        # step (a weight read by a layer's forward and backward); the rest
        # (optimizer state streamed to its update) move per read and are freed after.
        per_device: dict = {}
        for st in stages.stages:
            for v in st.inputs:
                if v in self._is_input:
                    per_device[v, st.device] = per_device.get((v, st.device), 0) + 1
        # Never state streamed from a memory place: cached, every layer's
        # optimizer state, and every layer's weights where its parameters
        # live there too, would stay on the device until the step ends: a
        # 6.74B model's 27 GB of weights beside its activations, where the
        # plan (`planner._arrays.held_bytes`, way "fetched") counts only
        # those in flight. Such weights move for each read instead (the
        # forward, the backward, the update), as ZeRO-Infinity moves them.
        roles = stages.graph.input_roles
        placed = {v for v, d, role in zip(self._invars, stages.input_devices, roles)
                  if memory_place(d)[1] is not None and role in ("param", "opt_state")}
        self._cache_inputs = {k for k, n in per_device.items() if n > 1 and k[0] not in placed}
        # What a streaming stage's state copy brings ahead: its streamed
        # inputs, less those moved once a step and cached.
        self._streamed = [tuple(v for v in vs if (v, st.device) not in self._cache_inputs)
                          for vs, st in zip(streamed, stages.stages)]
        # Per stage, the positions of its streamed copies it takes donated.
        self._donated_copies = [tuple(self._copies_donated(st)) for st in stages.stages]
        self._donate, self._free_at = self._donation(stages)
        self.compiled = self._compile_all(stages.stages)
        self._input_devices = [self.target(d) for d in stages.input_devices]
        self._producer = {v: st.index for st in stages.stages for v in st.outputs}
        # Program outputs sent to their memory place as soon as they are
        # computed: {var: target}. A device_put into a memory place is
        # asynchronous; the GPU -> CPU device path waits for the value, so
        # state homed on a CPU device goes back at the step's end instead.
        wanted = stages.output_devices or (None,) * len(self._outvars)
        self._send_home = {v: self.target(d) for v, d in zip(self._outvars, wanted)
                           if d is not None and isinstance(v, jcore.Var)
                           and memory_place(d)[1] is not None}
        # Per streaming stage, the next one on its device: its state's copy in
        # is issued before this stage's copy out (see _Run._stage).
        self._next_stream: dict[int, int] = {}
        for order in stages.device_order.values():
            ids = [i for i in order if self._streams[i]]
            self._next_stream.update(zip(ids, ids[1:]))
        # Values are dropped once their last reader is dispatched (JAX keeps
        # them alive until that reader ran): a step frees gradients and
        # activations as it goes, as one jit program does.
        readers: dict = {}
        for st in stages.stages:
            if st.device in self.local:
                for v in st.inputs:
                    readers[v] = readers.get(v, 0) + 1
        self._crossings: list = []
        self._reductions: list = []
        self._received: set = set()
        if self.multi_process:
            self._init_crossings(stages)
        if self.across:
            self._reductions = self._init_reductions(stages)
        for c in (*self._crossings, *self._reductions):
            if self._process_of(c.src) == me:  # sent: the network thread reads it
                for v in c.vars:
                    readers[v] = readers.get(v, 0) + 1
        kept = set(self._outvars) | self._is_input
        self._readers = {v: n for v, n in readers.items() if v not in kept}
        self._offload_out, self._offload_vars = self._activations_offloaded(stages)
        self.last_events: list[StageEvent] = []
        # Timelines: record_events times each stage to its end (which
        # serialises the step); watch_events has threads wait for each
        # stage's copies in, compute and copies out while the step runs as
        # usual (no host sync added), each kind in issue order.
        self.record_events = False
        # record_memory (serialises the step too): each stage's device's
        # allocator read once the stage ran, in `last_memory` as (stage,
        # device, bytes in use), beside the replay's (`compiled_peaks`' walk).
        self.record_memory = False
        self.last_memory: list = []
        self.watch_events = False

    def _donation(self, stages: StageGraph) -> tuple[list, dict]:
        """Where each donated input is given up (module docstring).

        Returns per stage the positions of its inputs its executable takes
        donated (its streamed copies, `_donated_copies`, among them), and
        {var: readers} for the donated inputs deleted once that many reading
        stages were dispatched instead. A stage takes an input
        donated where it reads it on the input's own device and every other
        reader was dispatched before it (`_dispatched_before`): JAX then
        orders the donation after their reads. Inputs the step returns as
        they are are never given up.
        """
        donate: list = [list(d) for d in self._donated_copies]
        if not self.donated:
            return [tuple(d) for d in donate], {}
        home = dict(zip(self._invars, stages.input_devices))
        wanted = {self._invars[i] for i in self.donated} - set(self._outvars)
        readers: dict = {}
        for st in stages.stages:
            for v in st.inputs:
                if v in wanted:
                    readers.setdefault(v, []).append(st.index)
        before = _dispatched_before(stages)
        free_at = {}
        for v, rs in readers.items():
            last = [r for r in rs if all(before[r] >> o & 1 for o in rs if o != r)]
            st = stages.stages[last[0]] if last else None
            if st is not None and st.device == home[v] and st.inputs.count(v) == 1:
                if st.inputs.index(v) not in donate[st.index]:
                    donate[st.index].append(st.inputs.index(v))
            else:
                free_at[v] = len(rs)
        return [tuple(sorted(d)) for d in donate], free_at

    def _copies_donated(self, st: Stage) -> list[int]:
        """The positions of `st`'s streamed inputs (`_streamed`: state or
        weights moved in for this stage alone) that its executable takes
        donated, on an accelerator: the copy is the runtime's own, and
        donated, the new state is written into it (the update's outputs
        alias its inputs), so a streaming stage holds its state once, not
        old and new (`planner._arrays.streamed_in_flight`). (A copy that
        turns out to be the value itself, already on the device, is copied
        first: `_Run.inputs_on`.) Not on a CPU device, where a copy out of
        pinned host memory may alias its source."""
        dev = self.devices.get(st.device)
        if dev is None or dev.platform == "cpu" or st.device not in self.local:
            return []
        return _reusable(st, set(self._streamed[st.index]))

    def _process_of(self, name: str) -> int:
        """The process owning a device (or memory place) name."""
        dev = self.devices.get(name) or self.devices[memory_place(name)[0]]
        return dev.process_index

    def _init_crossings(self, stages: StageGraph) -> None:
        """What crosses processes in a step, and each output's owner (see
        `_outputs_across`): scalar results (the loss) go to every process, on
        an anchor device of each (its first device in the plan, else its first
        device)."""
        me = jax.process_index()
        self.network = Network()
        anchors: dict[int, str] = {}
        for name in stages.device_order:
            anchors.setdefault(self._process_of(name), name)
        for q in range(jax.process_count()):
            if q not in anchors:
                dev = jax.local_devices(process_index=q)[0]
                anchors[q] = name = f"p{q}/anchor"
                self.devices[name] = dev
        self._anchors = anchors
        producer = {v: st for st in stages.stages for v in st.outputs}
        home = dict(zip(self._invars, stages.input_devices))
        wanted = stages.output_devices or (None,) * len(self._outvars)
        self._owner: list = []  # per output: (device or place it ends on, its device)
        for v, d in zip(self._outvars, wanted):
            if not isinstance(v, jcore.Var):
                self._owner.append(None)
                continue
            made = producer[v].device if v in producer else home[v]
            d = d or made
            if self._process_of(d) != self._process_of(made):
                raise PlanError(f"an output computed on {made} is kept on {d}, another "
                                "process's device; across processes a layer's state stays "
                                "on its compute device's process")
            self._owner.append((d, memory_place(d)[0]))
        broadcast = [v for v in self._outvars if isinstance(v, jcore.Var) and not v.aval.shape]
        self._crossings = crossings(stages, self._process_of, broadcast=broadcast,
                                    anchors=anchors)
        self._received = {(v, c.dst) for c in self._crossings
                          if self._process_of(c.dst) == me for v in c.vars}
        self._broadcast = set(broadcast)

    def _init_reductions(self, stages: StageGraph) -> list:
        """A hierarchical plan's averages: floating-point values the update
        stages read from the others, and results the others make, grouped by
        the stage that makes them, in the order every process issues them."""
        made = {v: st for st in stages.stages for v in st.outputs}
        updating = ("update", "post")

        def averaged(v):
            return (isinstance(v, jcore.Var) and v in made
                    and made[v].phase not in updating
                    and jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact))

        wanted = [v for st in stages.stages if st.phase in updating for v in st.inputs]
        groups: dict = {}
        for v in (*wanted, *self._outvars):
            if averaged(v):
                vs = groups.setdefault(made[v].index, [])
                if v not in vs:
                    vs.append(v)
        if not any(st.phase in updating for st in stages.stages):
            raise PlanError("a hierarchical plan needs the update in stages of its own "
                            "(split(..., update_apart=True))")
        position = {s: k for k, s in enumerate(global_order(stages.device_order,
                                                            stages.stages))}
        out = [Crossing(tuple(vs), stages.stages[i].device, stages.stages[i].device, i)
               for i, vs in groups.items()]
        out.sort(key=lambda c: position[c.producer])
        self._received = {(v, "*") for c in out for v in c.vars}
        self.network = Network()
        return out

    def sent_away(self, idx: int) -> list:
        """Stage `idx`'s outputs copied to a memory place as they are made: new
        state sent home (`_send_home`) and activations offloaded until the
        backward (`_offload_vars`). Their device buffers live until the
        copies end: a worker waits for them (`_run`), and the compiled check
        counts them meanwhile (`_memory_check.sent_home_bytes`)."""
        offloaded = set(self._offload_vars[idx])
        return [v for v in self.stages.stages[idx].outputs
                if v in self._send_home or v in offloaded]

    def _activations_offloaded(self, stages: StageGraph) -> tuple[list, list]:
        """Per stage, the memory place its offloaded activations go to (or
        None) and which outputs: a stage of one layer planned with
        activations="offload" sends the values only that layer's later stages
        on its device read (its residuals, read by its backward) to the
        device's pinned host memory; the backward brings them back."""
        readers: dict = {}
        for st in stages.stages:
            for v in st.inputs:
                readers.setdefault(v, []).append(st)
        results = set(self._outvars)
        places: list = [None] * len(stages.stages)
        outs: list = [()] * len(stages.stages)
        for st in stages.stages:
            p = stages.placements.get(st.layers[0]) if len(st.layers) == 1 else None
            if p is None or p.activations != "offload":
                continue
            dev = self.devices[st.device]
            if not has_pinned_host(dev):
                raise PlanError(f"layer {st.layers[0]!r}: activations='offload' needs pinned "
                                f"host memory on {st.device}, which has none; use 'remat'")
            vs = tuple(v for v in st.outputs if v not in results and readers.get(v) and all(
                r.layers == st.layers and r.device == st.device and r.index > st.index
                for r in readers[v]))
            if vs:
                places[st.index], outs[st.index] = f"{st.device}:pinned_host", vs
        return places, outs

    def target(self, name: str):
        """Where a device or memory place name puts arrays: a jax.Device, or
        for a memory place a SingleDeviceSharding of its device's memory kind."""
        device, kind = memory_place(name)
        dev = self.devices.get(name) or self.devices[device]
        if kind is None:
            return dev
        return SingleDeviceSharding(dev, memory_kind=kind)

    def _compile_all(self, stages: Sequence[Stage]) -> list:
        """One executable per stage, compiled in parallel threads.

        Microbatches repeat the same stage computations: each distinct
        (jaxpr, consts, device) compiles once. A jaxpr's text names its
        variables by position, so structurally equal stages print alike.
        XLA compiles with the GIL released, so the stages' compilations (and
        one stage's lowering, in Python, beside another's compilation) overlap:
        a split step's first call then costs about its largest stage's
        compilation, not their sum, where cores allow.
        """
        keys = [(str(st.jaxpr.jaxpr), tuple(id(c) for c in st.jaxpr.consts), st.device,
                 self._donate[st.index]) if st.device in self.local else None for st in stages]
        first = {}
        for key, st in zip(keys, stages):
            if key is not None:  # another process runs it
                first.setdefault(key, st)
        threads = min(len(first), host_cores())
        if not first:
            self.stage_memory = [None] * len(keys)
            return [None] * len(keys)
        def compile_one(key, st):  # (the donated positions only where any)
            return _compile(st, self.devices[st.device], *(key[3:] if key[3] else ()))

        if threads <= 1:
            done = {k: compile_one(k, st) for k, st in first.items()}
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="hetpar-compile") as pool:
                futures = {k: pool.submit(compile_one, k, st)
                           for k, st in first.items()}
                done = {k: f.result() for k, f in futures.items()}
        self.stage_memory = [None if k is None else done[k][1] for k in keys]
        return [None if k is None else done[k][0] for k in keys]

    def place_inputs(self, flat_args: Sequence, only: Sequence[int] | None = None) -> list:
        """Each input on its planned device (a no-op for state already resident);
        `only`: those positions only, the others as given."""
        by_device: dict = {}
        out = list(flat_args)
        me = jax.process_index()
        for i in range(len(self._input_devices)) if only is None else only:
            d = self._input_devices[i]
            if self.across:  # a replicated result of the last step: this process's copy
                out[i] = local_part(out[i])
            elif self.multi_process:
                # Another process keeps this input (and sends it where read here).
                if self._process_of(self.stages.input_devices[i]) != me:
                    out[i] = None
                    continue
                out[i] = local_part(out[i])
                if out[i] is None:
                    raise HetparError(
                        f"step input {i} is an array held by another process, but the plan "
                        f"keeps it on {self.stages.input_devices[i]}, a device of this one "
                        f"(process {me}); pass the step's own results back, or host arrays")
            by_device.setdefault(d, []).append(i)
        for d, idx in by_device.items():
            for i, y in zip(idx, self.transfer.move_many([out[i] for i in idx], d)):
                out[i] = y
        return out

    def __call__(self, flat_args: Sequence) -> list:
        placed = self.place_inputs(flat_args)
        for i in self.donated:
            # The caller's donated array, copied to where the plan keeps it:
            # the copy is the step's, the original is given up now (not where
            # the "copy" holds its buffer: a replicated array's shard).
            if copied_apart(flat_args[i], placed[i]):
                _give_up(flat_args[i])
        run = _Run(self, dict(zip(self._invars, placed)))
        calls = {name: functools.partial(run.device, name) for name in self.local}
        if self._crossings:
            calls["network"] = run.network
        if self._reductions:
            calls["network"] = run.reduce
        try:
            self.workers.run(calls)
        finally:
            run.stop_watching()
        if run.failure:
            # A failed stage's results poison its consumers' inputs: blame the earliest.
            st, e = min(run.failure, key=lambda fe: fe[0].index)
            raise StageError(
                f"stage {st.index} ({st.phase}"
                f"{'' if st.microbatch is None else f', microbatch {st.microbatch}'}) on "
                f"{st.device} failed, running layers {list(st.layers)}: "
                f"{type(e).__name__}: {e}. "
                + ("Arrays passed in donate_argnums may be deleted; the others are unchanged."
                   if self.donated else "The inputs you passed are unchanged."),
                device=st.device) from e
        self.last_events = sorted(run.events, key=lambda ev: ev.start_s)
        self.last_memory = list(run.memory)
        returned = {id(x) for x in (run.env.get(v) for v in self._outvars
                                    if isinstance(v, jcore.Var))}
        for i in self.donated:
            # Donated inputs no stage read, or that a stage took donated but
            # could not reuse: given up too, as jax.jit leaves them.
            if id(placed[i]) not in returned:
                _give_up(placed[i])
        if self.multi_process:
            return self._outputs_across(run)
        outs = self._return_state([self._read(run.env, v) for v in self._outvars])
        return self._replicated_across(outs) if self.across else outs

    def _replicated_across(self, outs: list) -> list:
        """A hierarchical plan's results as global arrays, replicated over the
        processes: every process computed the same (the update read averaged
        gradients), so each holds a copy that `np.asarray` reads, and
        `hetpar.gather` and the next step treat alike on every process."""
        peers = {dev.id: self.across[name] for name, dev in self.devices.items()
                 if name in self.across}
        done = []
        for x in outs:
            if isinstance(x, jax.Array) and len(x.devices()) == 1:
                (dev,) = x.devices()
                mesh = jax.sharding.Mesh(np.array(peers[dev.id]), ("p",))
                sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(),
                                                      memory_kind=x.sharding.memory_kind)
                x = jax.make_array_from_single_device_arrays(x.shape, sharding, [x])
            done.append(x)
        return done

    def _outputs_across(self, run: _Run) -> list:
        """The step's results under several processes, the same on every process:

        - a scalar (the loss) as a global array replicated on one device of
          every process, so each reads it with `np.asarray`;
        - anything else as a global array on the one device that holds it:
          the owning process can read it, the others pass it back into the
          next step (or `hetpar.gather` it).
        """
        me = jax.process_index()
        outs = []
        mine = [i for i, o in enumerate(self._owner)
                if o is not None and self._process_of(o[1]) == me]
        local = dict(zip(mine, self._return_state_of(
            [self._read(run.env, self._outvars[i]) for i in mine],
            [self._owner[i][0] for i in mine])))
        for i, v in enumerate(self._outvars):
            if self._owner[i] is None:
                outs.append(self._read(run.env, v))
                continue
            place, device = self._owner[i]
            owner = self._process_of(device)
            if v in self._broadcast:
                devs = [self.devices[device] if q == owner else self.devices[self._anchors[q]]
                        for q in range(jax.process_count())]
                x = (self.transfer.move(local[i], devs[me]) if owner == me
                     else run.moved_inputs[v, self._anchors[me]])
                sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devs), ("p",)),
                                                      jax.sharding.PartitionSpec())
                outs.append(jax.make_array_from_single_device_arrays((), sharding, [x]))
            elif owner == me:
                outs.append(local[i])
            else:
                dev = self.devices[device]
                sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([dev]), ("p",)),
                                                      jax.sharding.PartitionSpec())
                outs.append(jax.make_array_from_single_device_arrays(
                    v.aval.shape, sharding, [], dtype=v.aval.dtype))
        return outs

    def _return_state_of(self, outs: list, where: list) -> list:
        """`outs[i]` moved to `where[i]` (a device or memory place name)."""
        by_device: dict = {}
        for i, d in enumerate(where):
            by_device.setdefault(d, []).append(i)
        outs = list(outs)
        for d, idx in by_device.items():
            for i, y in zip(idx, self.transfer.move_many([outs[i] for i in idx],
                                                         self.target(d))):
                outs[i] = y
        return outs

    def _return_state(self, outs: list) -> list:
        """Outputs moved to where the plan keeps them: the new state of a layer
        whose update ran away from its state device (streamed) goes back
        there, so the next step finds it in place."""
        wanted = self.stages.output_devices
        if not any(wanted):
            return outs
        idx = [i for i, d in enumerate(wanted) if d is not None]
        for i, y in zip(idx, self._return_state_of([outs[i] for i in idx],
                                                   [wanted[i] for i in idx])):
            outs[i] = y
        return outs

    def _read(self, env, v):
        if isinstance(v, jcore.Literal):
            return np.asarray(v.val)
        return env[v]


def _reusable(st: Stage, copies: set) -> list[int]:
    """The positions of `st`'s inputs among `copies` that an output of the
    same shape and type can be written into (XLA aliases donated inputs so):
    a streamed state's, not a forward's fetched weights, which no output
    reuses (donated, JAX warns that they were not usable)."""
    outputs: dict = {}
    for v in st.outputs:
        key = (tuple(v.aval.shape), v.aval.dtype)
        outputs[key] = outputs.get(key, 0) + 1
    out = []
    for k, v in enumerate(st.inputs):
        key = (tuple(v.aval.shape), v.aval.dtype)
        if v in copies and st.inputs.count(v) == 1 and outputs.get(key, 0) > 0:
            outputs[key] -= 1
            out.append(k)
    return out


def _dispatched_before(stages: StageGraph) -> list[int]:
    """Per stage, a bit set of the stages surely dispatched before it: those
    making its inputs (a worker waits for them) and those its device runs
    earlier (one worker dispatches them in order), transitively."""
    preds: list[set] = [set() for _ in stages.stages]
    producer = {v: st.index for st in stages.stages for v in st.outputs}
    for st in stages.stages:
        preds[st.index].update(producer[v] for v in st.inputs if v in producer)
    for order in stages.device_order.values():
        for a, b in zip(order, order[1:]):
            preds[b].add(a)
    before = [0] * len(preds)
    waiting = [len(p) for p in preds]
    after: list[list] = [[] for _ in preds]
    for s, ps in enumerate(preds):
        for p in ps:
            after[p].append(s)
    ready = [s for s, n in enumerate(waiting) if n == 0]
    while ready:
        s = ready.pop()
        for p in preds[s]:
            before[s] |= before[p] | (1 << p)
        for t in after[s]:
            waiting[t] -= 1
            if waiting[t] == 0:
                ready.append(t)
    return before
