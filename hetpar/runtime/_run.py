"""One call of an `Executor`: the step's values as they are made, its stages
dispatched on their devices' workers, transfers and the state's return home,
and what failed (`StageError`) or was watched (`StageEvent`)."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import jax

from hetpar.core import HetparError, memory_place
from hetpar.passes import Stage
from hetpar.runtime._transfer import copied_apart

if TYPE_CHECKING:
    from hetpar.runtime._executor import Executor


class StageError(HetparError, RuntimeError):
    """A stage failed while running; the message names its layers and device.

    Attributes:
      device: the name of the device the stage ran on (None if not known).
    """

    def __init__(self, message: str, device: str | None = None):
        super().__init__(message)
        self.device = device


@dataclasses.dataclass(frozen=True)
class StageEvent:
    """One stage run, for timelines: wall-clock seconds since the step began.

    `what` is "compute" (the stage's executable), or, watched without
    serialising the step (`Executor.watch_events`), "copy in" (its inputs,
    or the state it streams, arriving) or "copy out" (its new state going
    home). A watched event runs from when the work was issued, or when the
    previous one of its kind on the device finished if later, to when its
    arrays were ready: what the device's stream, or the link, spent on it.
    """

    stage: int
    device: str
    microbatch: int | None
    phase: str
    start_s: float
    end_s: float
    what: str = "compute"


def _deleted(x) -> bool:
    """Whether `x` is a JAX array whose buffers were deleted (donated)."""
    return isinstance(x, jax.Array) and x.is_deleted()


class _Run:
    """One call of an Executor: the values so far, which stages are done, what failed."""

    def __init__(self, ex: Executor, env: dict):
        self.ex = ex
        self.env = env
        self.done = [threading.Event() for _ in ex.stages.stages]
        self.failure: list = []
        self.events: list[StageEvent] = []
        self.memory: list = []  # (stage, device, bytes in use after it): record_memory
        self.t0 = time.perf_counter()
        # Step inputs (parameters) read on another device move there once per
        # step, not once per microbatch stage that reads them (a tied GPT-2
        # embedding is 154 MB). Keyed by device: each has one worker, no lock.
        self.moved_inputs: dict = {}
        self.left: dict = {}  # readers not yet dispatched, per value
        # Streamed state already on its way to the stage that reads it: {stage: {var: array}}.
        self.ahead: dict[int, dict] = {}
        # Event watchers (Executor.watch_events): one thread per device and
        # kind, in issue order (one per kind alone would read a device's end
        # late while it waits on another's).
        self.watchers: dict = {}
        self.ready: dict = {}  # (device, kind) -> when its last watched work was ready
        self.copied: dict = {}  # device -> what its stage being dispatched had copied in
        if ex.watch_events:
            self.watchers = {(d, k): ThreadPoolExecutor(1, thread_name_prefix="hetpar-watch")
                             for d in ex.local
                             for k in ("copy in", "compute", "copy out")}
        self.lock = threading.Lock()
        # Values from other processes, set once the collective bringing each is issued.
        self.arrived = {key: threading.Event() for key in ex._received}

    def watch(self, what: str, st: Stage, name: str, arrays: list, after: list = ()) -> None:
        """Records, from a watcher thread, when `arrays` (issued now) are ready.

        The work began when issued, or once the previous work of its kind on
        the device and the arrays it waits for (`after`: a copy out's values,
        a stage's copied inputs) were ready, whichever came last.
        """
        if not arrays:
            return
        issued = time.perf_counter()

        def wait():
            # A stage takes its streamed copies donated (`_copies_donated`):
            # once it was dispatched they are deleted, and waiting on them
            # would raise. Its compute is timed without them; a copy in
            # donated before this thread saw it goes unrecorded.
            ready = [x for x in after if not _deleted(x)]
            live = [x for x in arrays if not _deleted(x)]
            if not live:
                return
            try:
                jax.block_until_ready(ready)
                deps = time.perf_counter() if ready else issued
                jax.block_until_ready(live)
            except Exception:  # noqa: BLE001 - the step reports failures itself
                return
            end = time.perf_counter()
            start = max(issued, deps, self.ready.get((name, what), issued))
            self.ready[name, what] = end
            self.events.append(StageEvent(st.index, name, st.microbatch, st.phase,
                                          start - self.t0, end - self.t0, what))

        self.watchers[name, what].submit(wait)

    def stop_watching(self) -> None:
        """Waits for the watchers to record the step's last events."""
        for pool in self.watchers.values():
            pool.shutdown(wait=True)

    def inputs_on(self, st: Stage, name: str, dev) -> list:
        """The stage's inputs, moved onto its device."""
        moved = self.moved_inputs
        ahead = self.ahead.pop(st.index, {})
        args = [moved[v, name] if (v, name) in moved else ahead[v] if v in ahead else self.env[v]
                for v in st.inputs]
        todo = [k for k, v in enumerate(st.inputs) if (v, name) not in moved and v not in ahead]
        fresh = self.ex.transfer.move_many([args[k] for k in todo], dev)
        for k, y in zip(todo, fresh):
            args[k] = y
            if (st.inputs[k], name) in self.ex._cache_inputs:
                moved[st.inputs[k], name] = y
        for k in self.ex._donated_copies[st.index]:
            # Donated as the runtime's own copy: one that shares the value's
            # own buffer (a put may hand it back: already on the device) is
            # copied first, or the donation would delete the value.
            home = self.env.get(st.inputs[k])
            if args[k] is home or not copied_apart(home, args[k]):
                args[k] = jax.device_put(args[k], dev, may_alias=False)
        if self.watchers:
            copied = [y for k, y in zip(todo, fresh) if y is not self.env.get(st.inputs[k])]
            self.watch("copy in", st, name, copied)
            self.copied[name] = copied + list(ahead.values())
        return args

    def release(self, st: Stage) -> None:
        """Drops the values whose last reader `st` was (not the step's inputs or
        results), and gives up the donated inputs it was the last reader of."""
        self.release_sent(st.inputs)
        free_at = self.ex._free_at
        if free_at:
            with self.lock:
                for v in st.inputs:
                    if v in free_at:
                        left = self.left[v] = self.left.get(v, free_at[v]) - 1
                        if left == 0:
                            _give_up(self.env[v])

    def device(self, name: str) -> None:
        """Runs the stages of device `name` in its order (on that device's worker)."""
        ex = self.ex
        dev = ex.devices[name]
        dispatched = []
        in_flight: list = []  # (stage, its outputs and the state it sent home), oldest first
        for idx in ex.stages.device_order[name]:
            st = ex.stages.stages[idx]
            for v in st.inputs:
                if (v, name) in self.arrived:
                    self.arrived[v, name].wait()
                    continue
                if (v, "*") in self.arrived:  # averaged over the processes
                    self.arrived[v, "*"].wait()
                    continue
                p = ex._producer.get(v)
                if p is not None:
                    self.done[p].wait()
            if self.failure:
                return
            try:
                # At most `prefetch` stages in flight on the device: a stage's
                # outputs and the inputs copied to it are allocated when it is
                # dispatched, not when it runs, so a worker dispatching the
                # whole backward ahead would hold every layer's gradient at
                # once, where the compiled check (`compiled_peaks`) counts
                # the running stage and one queued.
                if len(in_flight) >= ex.prefetch:
                    earlier, arrays = in_flight.pop(0)
                    try:
                        jax.block_until_ready(arrays)
                    except Exception as e:  # noqa: BLE001 - an earlier stage failed
                        self.fail(earlier, e)
                        return
                    del arrays  # (its first output would live until the next wait)
                outs = self._stage(idx, st, name, dev)
                # Waiting on what it sent away too (`Executor.sent_away`: new
                # state, offloaded activations): a device->host copy frees
                # its device buffer only once done, and the copies back lag
                # the compute (measured: ~28 GB of a 5B model's new
                # optimizer state queued on an H100 without this). (One
                # output names the execution's end; holding them all would
                # keep what the next stages free alive.)
                in_flight.append((st, [*outs[:1], *(self.env[v] for v in ex.sent_away(idx))]))
            except Exception as e:  # noqa: BLE001 - re-raised by the caller with context
                self.fail(st, e)
                return
            if dev.platform == "cpu":
                dispatched.append((st, outs[:1]))  # one result names a failed execution
            self.release(st)
            del outs
            if ex.record_memory:
                # What the allocator holds once the stage ran (serialised)
                # and what it was the last reader of was dropped.
                self.memory.append((idx, name, (dev.memory_stats() or {}).get("bytes_in_use")))
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
        if self.watchers:
            self.watch("compute", st, name, list(outs), after=self.copied[name])
        nxt = self.ex._next_stream.get(idx)
        if nxt is not None:
            # The next streaming stage's state starts coming in now, before
            # this stage's new state is sent out: PJRT queues copies between
            # a device and its memory places on a few streams in issue order,
            # so a copy in issued after a copy out (which waits for this
            # stage's compute) waited for it too, and the two directions ran
            # one after the other. Measured on an H100, 24 layers of 1.6 GB:
            # 1.19 s issued in that order, 0.95 s this way, against 0.94 s
            # for the copies alone (experiments/results/offload_h100_5b).
            vs = self.ex._streamed[nxt]
            self.ahead[nxt] = dict(zip(vs, self.ex.transfer.move_many(
                [self.env[v] for v in vs], dev)))
            if self.watchers:
                self.watch("copy in", self.ex.stages.stages[nxt], name,
                           list(self.ahead[nxt].values()))
        if self.ex.record_events or self.ex.record_memory:
            jax.block_until_ready(outs)
            self.events.append(StageEvent(idx, name, st.microbatch, st.phase,
                                          start - self.t0, time.perf_counter() - self.t0))
        self.env.update(zip(st.outputs, outs))
        # The new state leaves for its home now (asynchronously), so the
        # device frees it as the step goes instead of at its end; one
        # batched copy per home, as a call costs a fixed ~0.2 ms.
        homes: dict = {}
        for v in st.outputs:
            if v in self.ex._send_home:
                homes.setdefault(self.ex._send_home[v], []).append(v)
        for target, vs in homes.items():
            self.env.update(zip(vs, self.ex.transfer.move_many([self.env[v] for v in vs],
                                                               target)))
            if self.watchers:
                self.watch("copy out", st, name, [self.env[v] for v in vs], after=list(outs))
        place = self.ex._offload_out[idx]
        if place is not None:
            # Offloaded activations wait in pinned host memory for the backward.
            vs = self.ex._offload_vars[idx]
            self.env.update(zip(vs, self.ex.transfer.move_many([self.env[v] for v in vs],
                                                               self.ex.target(place))))
            if self.watchers:
                self.watch("copy out", st, name, [self.env[v] for v in vs], after=list(outs))
        return outs

    def fail(self, st: Stage, e: Exception) -> None:
        self.failure.append((st, e))
        for ev in (*self.done, *self.arrived.values()):
            ev.set()

    def network(self) -> None:
        """Issues this process's crossings, in the order every process issues
        them (hetpar.runtime._network says why that cannot deadlock)."""
        ex = self.ex
        me = jax.process_index()
        for c in ex._crossings:
            src, dst = ex._process_of(c.src), ex._process_of(c.dst)
            if me not in (src, dst):
                continue
            st = ex.stages.stages[c.producer] if c.producer is not None else ex.stages.stages[0]
            try:
                if me == src:
                    if c.producer is not None:
                        self.done[c.producer].wait()
                    if self.failure:
                        return
                    ex.network.cross([self.env[v] for v in c.vars], [v.aval for v in c.vars],
                                     ex.devices[memory_place(c.src)[0]], ex.devices[c.dst])
                    self.release_sent(c.vars)
                else:
                    got = ex.network.cross(None, [v.aval for v in c.vars],
                                           ex.devices[memory_place(c.src)[0]], ex.devices[c.dst])
                    for v, y in zip(c.vars, got):
                        self.moved_inputs[v, c.dst] = y
                        self.arrived[v, c.dst].set()
            except Exception as e:  # noqa: BLE001 - re-raised by the caller with context
                self.fail(st, e)
                return

    def reduce(self) -> None:
        """Averages a hierarchical plan's values over the processes as they are
        made, in the order every process issues them; readers wait for the means."""
        ex = self.ex
        for c in ex._reductions:
            self.done[c.producer].wait()
            if self.failure:
                return
            try:
                means = ex.network.mean([self.env[v] for v in c.vars], [v.aval for v in c.vars],
                                        ex.across[c.src])
            except Exception as e:  # noqa: BLE001 - re-raised by the caller with context
                self.fail(ex.stages.stages[c.producer], e)
                return
            self.env.update(zip(c.vars, means))
            self.release_sent(c.vars)
            for v in c.vars:
                self.arrived[v, "*"].set()

    def release_sent(self, vs) -> None:
        """Counts one read of each of `vs` (a stage's, or a collective's that sent or
        averaged them) and drops those nothing here reads any more."""
        readers = self.ex._readers
        with self.lock:
            for v in vs:
                if v in readers:
                    left = self.left[v] = self.left.get(v, readers[v]) - 1
                    if left == 0:
                        self.env.pop(v, None)


def _give_up(x) -> None:
    """Deletes a donated JAX array's buffer (JAX frees it once the work
    already issued on it is done); anything else (NumPy) is left alone."""
    if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()
