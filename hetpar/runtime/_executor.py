"""Runs a StageGraph: one compiled executable per stage, one worker per device.

JAX dispatch from one Python thread did not overlap CPU and GPU work on the
GPU machine; one thread per device did (docs/measurements.md). So every device gets a
worker thread that runs its stages in the schedule's order. A stage waits for
the stages that produce its inputs, pulls those inputs onto its device
through the transfer engine (so a transfer starts as soon as its producer is
done, while other stages compute) and runs its executable.

Worker threads belong to a `Workers` object that several executors may
share: `hetpar.auto` gives one to all the signatures a step compiles, so
retracing on new shapes adds executables, never threads.

Failures: an exception inside a stage stops the step and surfaces as a
`StageError` naming the stage's layers and device (for accelerator stages
whose error only shows when their results are read: as JAX's own error, as
with `jax.jit`). No input buffer is
donated, so the caller's parameters and optimizer state are never left
half-updated or deleted (the price: the old and new state coexist in memory
during a step, as with `jax.jit` without `donate_argnums`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import SingleDeviceSharding

from hetpar.core import HetparError
from hetpar.passes import Stage, StageGraph
from hetpar.runtime._transfer import TransferEngine


class StageError(HetparError, RuntimeError):
    """A stage failed while running; the message names its layers and device."""


@dataclasses.dataclass(frozen=True)
class StageEvent:
    """One stage run, for timelines: wall-clock seconds since the step began."""

    stage: int
    device: str
    microbatch: int | None
    phase: str
    start_s: float
    end_s: float


def _compile(stage: Stage, device: jax.Device):
    """The stage as a `jax.jit` function, compiled now for its device.

    Calls go through jit's C++ dispatch; the compile below fills the cache it
    reads, so the first step does not pay for compilation.
    """
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding)
            for v in stage.inputs]
    fn = jax.jit(jcore.jaxpr_as_fun(stage.jaxpr), in_shardings=sharding,
                 out_shardings=sharding)
    fn.lower(*args).compile()
    return fn


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Workers:
    """One worker thread per device, shared by every Executor given this object.

    Threads start on first use. A step's calls to its devices' workers are
    queued together under a lock: every worker then runs concurrent steps
    (two signatures of one `hetpar.auto` step called from two threads) in the
    same order, so no step waits on a worker that waits on it. The threads
    end on `close()` or when this object is garbage collected.
    """

    def __init__(self):
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def run(self, calls: Mapping[str, Callable[[], None]]) -> None:
        """Runs `calls[device]()` on each device's worker and waits for them all."""
        with self._lock:
            futures = [self._pool(name).submit(fn) for name, fn in calls.items()]
        for f in futures:
            f.result()

    def _pool(self, name: str) -> ThreadPoolExecutor:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = ThreadPoolExecutor(1, thread_name_prefix=f"hetpar-{name}")
        return pool

    def close(self) -> None:
        """Ends the threads (after the work queued on them); later runs start new ones."""
        with self._lock:
            pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.shutdown(wait=False)


class Executor:
    """Compiles the stages of a StageGraph and runs them, one thread per device.

    Args:
      stages: the split step.
      devices: device name -> jax.Device, for every device the stages name.
      transfer: the transfer engine (default: a new one).
      workers: the per-device worker threads (default: the executor's own).
    """

    def __init__(self, stages: StageGraph, devices: Mapping[str, jax.Device],
                 transfer: TransferEngine | None = None, workers: Workers | None = None):
        self.stages = stages
        self.devices = dict(devices)
        self.transfer = transfer or TransferEngine()
        self.workers = workers or Workers()
        self.compiled = self._compile_all(stages.stages)
        jaxpr = stages.graph.program.jaxpr.jaxpr
        self._invars = list(jaxpr.invars)
        self._is_input = set(self._invars)
        self._outvars = list(jaxpr.outvars)
        self._input_devices = [self.devices[d] for d in stages.input_devices]
        self._producer = {v: st.index for st in stages.stages for v in st.outputs}
        self.last_events: list[StageEvent] = []
        self.record_events = False

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
        keys = [(str(st.jaxpr.jaxpr), tuple(id(c) for c in st.jaxpr.consts), st.device)
                for st in stages]
        first = {}
        for key, st in zip(keys, stages):
            first.setdefault(key, st)
        threads = min(len(first), _cores())
        if threads <= 1:
            done = {k: _compile(st, self.devices[st.device]) for k, st in first.items()}
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="hetpar-compile") as pool:
                futures = {k: pool.submit(_compile, st, self.devices[st.device])
                           for k, st in first.items()}
                done = {k: f.result() for k, f in futures.items()}
        return [done[k] for k in keys]

    def place_inputs(self, flat_args: Sequence) -> list:
        """Each input on its planned device (a no-op for state already resident)."""
        by_device: dict = {}
        for i, d in enumerate(self._input_devices):
            by_device.setdefault(d, []).append(i)
        out = list(flat_args)
        for d, idx in by_device.items():
            for i, y in zip(idx, self.transfer.move_many([flat_args[i] for i in idx], d)):
                out[i] = y
        return out

    def __call__(self, flat_args: Sequence) -> list:
        run = _Run(self, dict(zip(self._invars, self.place_inputs(flat_args))))
        self.workers.run({name: functools.partial(run.device, name)
                          for name in self.stages.device_order})
        if run.failure:
            # A failed stage's results poison its consumers' inputs: blame the earliest.
            st, e = min(run.failure, key=lambda fe: fe[0].index)
            raise StageError(
                f"stage {st.index} ({st.phase}"
                f"{'' if st.microbatch is None else f', microbatch {st.microbatch}'}) on "
                f"{st.device} failed, running layers {list(st.layers)}: "
                f"{type(e).__name__}: {e}. The inputs you passed are unchanged.") from e
        self.last_events = sorted(run.events, key=lambda ev: ev.start_s)
        outs = [self._read(run.env, v) for v in self._outvars]
        return self._return_state(outs)

    def _return_state(self, outs: list) -> list:
        """Outputs moved to where the plan keeps them: the new state of a layer
        whose update ran away from its state device (streamed) goes back
        there, so the next step finds it in place."""
        wanted = self.stages.output_devices
        if not any(wanted):
            return outs
        by_device: dict = {}
        for i, d in enumerate(wanted):
            if d is not None:
                by_device.setdefault(d, []).append(i)
        for d, idx in by_device.items():
            for i, y in zip(idx, self.transfer.move_many([outs[i] for i in idx],
                                                         self.devices[d])):
                outs[i] = y
        return outs

    def _read(self, env, v):
        if isinstance(v, jcore.Literal):
            return np.asarray(v.val)
        return env[v]


class _Run:
    """One call of an Executor: the values so far, which stages are done, what failed."""

    def __init__(self, ex: Executor, env: dict):
        self.ex = ex
        self.env = env
        self.done = [threading.Event() for _ in ex.stages.stages]
        self.failure: list = []
        self.events: list[StageEvent] = []
        self.t0 = time.perf_counter()
        # Step inputs (parameters) read on another device move there once per
        # step, not once per microbatch stage that reads them (a tied GPT-2
        # embedding is 154 MB). Keyed by device: each has one worker, no lock.
        self.moved_inputs: dict = {}

    def inputs_on(self, st: Stage, name: str, dev) -> list:
        """The stage's inputs, moved onto its device."""
        moved = self.moved_inputs
        args = [moved.get((v, name), self.env[v]) for v in st.inputs]
        todo = [k for k, v in enumerate(st.inputs) if (v, name) not in moved]
        for k, y in zip(todo, self.ex.transfer.move_many([args[k] for k in todo], dev)):
            args[k] = y
            if st.inputs[k] in self.ex._is_input:
                moved[st.inputs[k], name] = y
        return args

    def device(self, name: str) -> None:
        """Runs the stages of device `name` in its order (on that device's worker)."""
        ex = self.ex
        dev = ex.devices[name]
        dispatched = []
        for idx in ex.stages.device_order[name]:
            st = ex.stages.stages[idx]
            for v in st.inputs:
                p = ex._producer.get(v)
                if p is not None:
                    self.done[p].wait()
            if self.failure:
                return
            try:
                outs = self._stage(idx, st, name, dev)
            except Exception as e:  # noqa: BLE001 - re-raised by the caller with context
                self.fail(st, e)
                return
            dispatched.append((st, outs))
            self.done[idx].set()
        # Execution is asynchronous: errors surface when results are awaited.
        # A CPU worker awaits its stages' results in order once all are
        # dispatched: that names a failing stage without serialising the
        # queue. Accelerator workers return as soon as their stages are
        # queued, like `jax.jit`: the step returns while the accelerator
        # still computes, so the caller's next step can start its
        # parameter-free CPU stages (input augmentation) meanwhile. Errors
        # there surface when the results are read.
        if dev.platform != "cpu":
            return
        for st, outs in dispatched:
            try:
                jax.block_until_ready(outs)
            except Exception as e:  # noqa: BLE001
                self.fail(st, e)
                return

    def _stage(self, idx: int, st: Stage, name: str, dev):
        """Dispatches one stage; its outputs join the values so far."""
        start = time.perf_counter()
        outs = self.ex.compiled[idx](*self.inputs_on(st, name, dev))
        if self.ex.record_events:
            jax.block_until_ready(outs)
            self.events.append(StageEvent(idx, name, st.microbatch, st.phase,
                                          start - self.t0, time.perf_counter() - self.t0))
        self.env.update(zip(st.outputs, outs))
        return outs

    def fail(self, st: Stage, e: Exception) -> None:
        self.failure.append((st, e))
        for ev in self.done:
            ev.set()
