"""Replays a pipelined step's schedule on the cost table: the step time the runtime will see.

The ILP prices a pipelined plan with a closed form, T1 + (M - 1) x bottleneck
(`evaluate`), which holds for a chain of contiguous stages. It does not see
the order each device runs its work in. A plan that visits a device twice
(gpu:0 -> gpu:1 -> gpu:0) makes gpu:0 wait for gpu:1 inside every
microbatch under GPipe's per-device order, and on two H200s such a plan ran
at 0.78-0.90x one GPU where the closed form promised 1.19-1.30x
(experiments/results/two_gpus_transformer_b256_planned_h200x2.md).

So the planner also replays the schedule: the same work items, stage cuts and
per-device orders as the split pass and the runtime (`hetpar/core/_schedule.py`),
at layer granularity, with each layer's time from the table:

- every layer has a forward and a backward item per microbatch; the forward
  takes FORWARD_SHARE of the layer's per-microbatch time (fixed part whole,
  the rest / M), the backward the rest; the update runs in the backward
  with one microbatch, and with several in a "post" stage per device after
  its last backward, as the runtime runs it (the gradients accumulated);
- consecutive items with one (device, microbatch, phase) key form a stage,
  as in the split pass; a stage starts when its device has finished the
  previous stage of its order and its inputs have arrived, and takes its
  items' time plus its device's `stage_overhead_s` (the runtime's cost per
  executable call, measured by `profile="measure"`; 0 otherwise);
- inputs from another device travel over the directed link (latency +
  bytes / bandwidth, one transfer per producer stage, links first-come
  first-served) once their producer stage ends;
- devices of one `compute_group` (the virtual CPU devices of one process)
  share one compute resource: a stage on one of them waits until no stage
  runs on the others, so their work never overlaps.

A layer whose state lives apart from its compute (a `Placement` with its
state on a host CPU device or a memory place) runs as the runtime runs it:

- its compute is stages of its own (a fourth part of the stage key, as the
  split pass cuts them), so its weights' copy host -> compute device (when
  its parameters live on the host) is
  issued at the step's start, in stage order, one copy after another on the
  link direction, and overlaps earlier layers' compute;
- host update: its gradient goes compute device -> host after its backward
  (each microbatch's), and its update runs on the host as a stage of its
  own once the gradient is there; the host's work is serialised (it is one
  compute resource with whatever else runs there). Its update time leaves
  the compute device's share;
- streamed: its optimizer state goes host -> compute device (issued at the
  start, after the weights, in stage order) for the update there, and the
  new state goes back after it; its new parameters go back too only when
  they live off the compute device (with its parameters resident, as JAX's
  host offload keeps them, no weights move at all). Fetched (its
  parameters in a memory place too), its weights come in for each stage
  that reads them: every microbatch's forward and backward, and the update. The host is a CPU
  device or a memory place (`gpu:0:pinned_host`), each over its own link;
- copies to and from a memory place queue on one bus with its host CPU
  device's copies (one PCIe link each way carries both);
- the step ends when the last stage and the last transfer end.

The replay's makespan is the predicted step time of pipelined plans and of
plans with state apart from compute.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping

import numpy as np
from absl import logging

from hetpar.core import (
    SCHEDULES,
    CostTable,
    PlanError,
    device_aware_order,
    device_orders,
    runs,
    stage_deps,
)
from hetpar.planner._arrays import Arrays, Placed, Predicted, held_bytes
from hetpar.planner._closed_form import closed_form, microbatches_of

# A backward pass costs about twice its forward (two matmuls per forward one).
FORWARD_SHARE = 1.0 / 3.0


@dataclasses.dataclass(frozen=True)
class StageRun:
    """One stage of the replay: seconds from the step's start."""

    device: str
    microbatch: int | None
    phase: str
    layers: tuple[str, ...]
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class Replay:
    """The replayed step.

    Attributes:
      step_time_s: when the last stage ends.
      schedule: the schedule the device orders realise ("gpipe" or "1f1b").
      stages: every stage as it ran, in start order.
      busy_s: seconds each device computes.
      transfer_s: seconds of all transfers (activations, gradients and
        state), summed over links.
    """

    step_time_s: float
    schedule: str
    stages: tuple[StageRun, ...]
    busy_s: Mapping[str, float]
    transfer_s: float = 0.0

    def timeline(self) -> list[dict]:
        """The stages as dicts, the form of the runtime's recorded events."""
        return [dataclasses.asdict(s) for s in self.stages]


#: Above this many microbatches x layers, a replay logs a progress line
#: (about 1 s of replaying on a 2-core machine).
REPLAY_PROGRESS_WORK = 4096


def simulate(table: CostTable, assignment: Mapping, microbatches: int = 1,
             schedule: str = "gpipe", *, arrays: Arrays | None = None) -> Replay:
    """Replays the step under `assignment` with M microbatches and `schedule`.

    Args:
      table: the cost table.
      assignment: {layer: device or Placement} for every layer.
      microbatches: M; 1 replays the unpipelined split step.
      schedule: "gpipe" or "1f1b".
      arrays: a precomputed `Arrays(table)`.

    Raises:
      PlanError: a bad assignment or schedule, or an edge between devices
        without a link.
    """
    arr = arrays or Arrays(table)
    if microbatches * len(arr.layers) > REPLAY_PROGRESS_WORK:
        # A long replay should not be a silent one (`hetpar plan` prints these lines).
        logging.info("hetpar: replaying the %s schedule of %d microbatches over %d layers",
                     schedule, microbatches, len(arr.layers))
    placed = arr.placed(assignment)
    a = placed.compute
    M = int(microbatches)
    if M < 1:
        raise PlanError(f"microbatches must be >= 1, got {microbatches}")
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    L = len(a)
    rows = np.arange(L)
    step_t = arr.t_at(M)[rows, a]
    if not np.all(np.isfinite(step_t)):
        bad = [arr.layers[i] for i in range(L) if not np.isfinite(step_t[i])]
        raise PlanError(f"layers {bad[:5]} have no time on their assigned devices")
    # An update run as its own stage leaves the layer's backward: a layer's
    # whose state lives apart, and with microbatches every layer's (the
    # runtime accumulates the gradients and updates once, in a "post" stage
    # after the last microbatch: on 2 H200s the last device's post stage
    # ended the step 5 ms after its last backward).
    upd_here = np.nan_to_num(arr.upd[rows, a])
    own = placed.apart | ((M > 1) & (upd_here > 0))
    per_mb = np.where(own, np.maximum(step_t - upd_here, 0.0), step_t) / M
    items = _work_items(arr, a, per_mb, np.maximum(step_t - upd_here, 0.0) / M, M, placed,
                        post=own)
    st = _stages(items, schedule)
    st.dur = st.dur + _unfused_s(st, items, arr)
    # Each stage pays its device's runtime overhead (dispatch, handoff) once.
    st.dur = st.dur + np.array([arr.overhead[arr.dindex[k[0]]] for k in st.keys])
    stats: dict[str, float] = {}
    start, end = _replay(st, arr, stats)
    S = len(st.cut)
    runs_out = sorted(
        (StageRun(st.keys[s][0], st.keys[s][1], st.keys[s][2],
                  tuple(dict.fromkeys(arr.layers[items.layer_of[i]] for i in st.cut[s])),
                  float(start[s]), float(end[s])) for s in range(S)),
        key=lambda r: (r.start_s, r.device))
    busy = {d: float(sum(st.dur[s] for s in ids)) for d, ids in st.per_device.items()}
    step = max(float(np.nanmax(end)) if S else 0.0, stats.get("last_s", 0.0))
    return Replay(step, st.schedule, tuple(runs_out), busy, float(stats.get("transfer_s", 0.0)))


@dataclasses.dataclass
class _Items:
    """The step's work items, numbered in program order.

    Attributes:
      keys: per item, its stage key (device, microbatch or None, phase).
      dur: [n] seconds per item.
      layer_of: [n] the layer each item belongs to.
      deps: per item, the items it reads from.
      xbytes: {(consumer, producer): bytes} of the tensors between items.
      compute: [n] the part of `dur` that is the layer's forward or backward
        (no update): what a whole step fuses across layers (`_unfused_s`).
      state_in: {item: [(source device, bytes, leaves)]}: state it reads
        from another device, copied from the step's start (`leaves`: the
        bytes of the arrays the copy moves, `Arrays.state_leaves`).
      state_out: {item: [(destination device, bytes, leaves)]}: state it
        sends back once done.
      weights_in: {item: [(source device, bytes, layer, leaves)]}: a
        fetched layer's weights it reads, copied in once per stage that
        reads them (its backward and its update in one stage read one copy).
    """

    keys: list
    dur: np.ndarray
    layer_of: np.ndarray
    deps: list[set[int]]
    xbytes: dict[tuple[int, int], float]
    compute: np.ndarray
    state_in: dict[int, list[tuple]] = dataclasses.field(default_factory=dict)
    state_out: dict[int, list[tuple]] = dataclasses.field(default_factory=dict)
    weights_in: dict[int, list[tuple]] = dataclasses.field(
        default_factory=dict)


@dataclasses.dataclass
class _Stages:
    """The items cut into stages, and each device's order of them.

    Attributes:
      cut: per stage, its items.
      keys: per stage, its key (device, microbatch or None, phase).
      deps: per stage, the stages it reads from.
      xbytes: {(consumer, producer): bytes} between stages on different devices.
      dur: [S] seconds per stage.
      per_device: {device: its stages in the order it runs them}.
      schedule: the schedule those orders realise.
      state_in, state_out: per stage, its items' state copies (see `_Items`).
    """

    cut: list[list[int]]
    keys: list
    deps: list
    xbytes: dict[tuple[int, int], float]
    dur: np.ndarray
    per_device: Mapping[str, list[int]]
    schedule: str
    state_in: dict[int, list[tuple]] = dataclasses.field(default_factory=dict)
    state_out: dict[int, list[tuple]] = dataclasses.field(default_factory=dict)


def _work_items(arr: Arrays, a: np.ndarray, per_mb: np.ndarray, compute_mb: np.ndarray,
                M: int, placed: Placed | None = None,
                post: np.ndarray | None = None) -> _Items:
    """A forward and a backward item per layer and microbatch, with their dependencies;
    and an update item per layer whose state lives apart from its compute, and
    per layer of `post` ([L] bool: with microbatches, every layer with an update).
    `compute_mb` ([L]): each layer's seconds per microbatch without its
    update, what `_Items.compute` counts.

    Program order: per microbatch, forwards in topological order, then
    backwards in reverse (the order `hetpar.value_and_grad` traces), then the
    separate updates in the order their gradients are final.
    """
    L = len(a)
    pos = np.empty(L, dtype=int)
    pos[arr.order] = np.arange(L)
    apart = np.zeros(L, bool) if placed is None else placed.apart
    fetched = np.zeros(L, bool) if placed is None else placed.fetched(arr.place)
    remat = np.zeros(L, bool) if placed is None else placed.remat
    own = apart | remat  # cut into stages of their own, as the split pass does
    split_keys = bool(own.any())

    def fwd(i, m):
        return m * 2 * L + pos[i]

    def bwd(i, m):
        return m * 2 * L + 2 * L - 1 - pos[i]

    updated = apart if post is None else (apart | post)
    apart_layers = sorted(np.nonzero(updated)[0], key=lambda i: -pos[i])
    upd_item = {int(i): 2 * L * M + k for k, i in enumerate(apart_layers)}
    n = 2 * L * M + len(upd_item)
    keys: list = [None] * n
    dur = np.zeros(n)
    compute = np.zeros(n)
    layer_of = np.zeros(n, dtype=int)
    deps: list[set[int]] = [set() for _ in range(n)]
    xbytes: dict[tuple[int, int], float] = {}  # (consumer, producer) item -> bytes

    def key(dev, mb, phase, i):
        if not split_keys:
            return (dev, mb, phase)
        return (dev, mb, phase, arr.layers[i] if own[i] else None)

    for m in range(M):
        mb, (pf, pb) = (None, ("main", "main")) if M == 1 else (m, ("forward", "backward"))
        for i in range(L):
            dev = arr.devices[a[i]]
            keys[fwd(i, m)], keys[bwd(i, m)] = key(dev, mb, pf, i), key(dev, mb, pb, i)
            dur[fwd(i, m)] = FORWARD_SHARE * per_mb[i]
            # Recomputed activations: the backward runs (the part it reads of) the
            # forward again.
            again = FORWARD_SHARE * arr.recompute[i] if remat[i] else 0.0
            dur[bwd(i, m)] = (1 - FORWARD_SHARE + again) * per_mb[i]
            compute[fwd(i, m)] = FORWARD_SHARE * compute_mb[i]
            compute[bwd(i, m)] = (1 - FORWARD_SHARE + again) * compute_mb[i]
            layer_of[fwd(i, m)] = layer_of[bwd(i, m)] = i
            deps[bwd(i, m)].add(fwd(i, m))
        for k in range(len(arr.eu)):
            u, v = int(arr.eu[k]), int(arr.ev[k])
            deps[fwd(v, m)].add(fwd(u, m))
            _add(xbytes, (fwd(v, m), fwd(u, m)), arr.fwd[k] / M)
            if arr.bwd[k] > 0:
                deps[bwd(u, m)].add(bwd(v, m))
                _add(xbytes, (bwd(u, m), bwd(v, m)), arr.bwd[k] / M)
    state_in: dict[int, list[tuple]] = {}
    state_out: dict[int, list[tuple]] = {}
    weights_in: dict[int, list[tuple]] = {}
    # An update that reads other layers' backward waits for it (the table's
    # `update_reads`: under a global-norm clip, every gradient): on an H200
    # a plan's host CPU ran its layers' updates after the whole backward,
    # where a replay starting each as its own gradient arrived predicted
    # 487 ms for a 1095 ms step (experiments/results/fit_h200, run 19).
    reads = arr.table.meta.get("update_reads") or {}
    for i, item in upd_item.items():
        waits = reads.get(arr.layers[i])
        if waits:
            for j in (range(L) if waits == "all" else
                      (arr.lindex[n] for n in waits if n in arr.lindex)):
                deps[item].add(bwd(int(j), M - 1))
        c = arr.devices[a[i]]
        if apart[i]:
            s, w = arr.devices[placed.state[i]], arr.devices[placed.params[i]]
            host, where = bool(placed.host_update[i]), placed.update[i]
        else:  # state, weights and update on the compute device
            s, w, host, where = c, c, False, a[i]
        p, o = float(np.nan_to_num(arr.param[i])), float(np.nan_to_num(arr.opt[i, a[i]]))
        dev = s if host else c
        keys[item] = key(dev, None, "main" if M == 1 else "post", i)
        dur[item] = float(np.nan_to_num(arr.upd[i, where]))
        layer_of[item] = i
        if fetched[i]:  # the weights for each read: every forward and backward, the update
            for read in (*(fwd(i, m) for m in range(M)), *(bwd(i, m) for m in range(M)), item):
                weights_in.setdefault(read, []).append((w, p, i, arr.state_leaves(i, "param")))
        elif w != c:  # the weights, once a step
            state_in.setdefault(fwd(i, 0), []).append((w, p, arr.state_leaves(i, "param")))
        for m in range(M):
            deps[item].add(bwd(i, m))
            if host:
                xbytes[item, bwd(i, m)] = p  # each microbatch's gradient
        if not host:  # the update on c: what lives apart comes in and its new value back
            back = {s: (o, arr.state_leaves(i, "opt_state"))} if s != c else {}
            if w != c:  # one copy when they live together
                b, leaves = back.get(w, (0.0, ()))
                back[w] = (b + p, leaves + arr.state_leaves(i, "param"))
            if s != c:
                state_in.setdefault(item, []).append((s, o, arr.state_leaves(i, "opt_state")))
            state_out.setdefault(item, []).extend((d, b, lv) for d, (b, lv) in back.items())
    return _Items(keys, dur, layer_of, deps, xbytes, compute, state_in, state_out, weights_in)


def _stages(items: _Items, schedule: str) -> _Stages:
    """Cuts the items into stages as the split pass does, and orders each device's stages."""
    order = device_aware_order(items.deps, items.keys)
    cut = runs(order, items.keys)
    stage_of = np.empty(len(items.keys), dtype=int)
    for s, members in enumerate(cut):
        stage_of[members] = s
    sdeps = stage_deps(stage_of, items.deps, len(cut))
    skeys = [items.keys[members[0]] for members in cut]
    per_device, realised = device_orders(skeys, sdeps, schedule)
    sbytes: dict[tuple[int, int], float] = {}
    for (c, p), b in items.xbytes.items():
        sc, sp = stage_of[c], stage_of[p]
        if sc != sp and skeys[sc][0] != skeys[sp][0]:
            _add(sbytes, (sc, sp), b)
    sdur = np.array([items.dur[members].sum() for members in cut])
    state_in: dict[int, list[tuple]] = {}
    state_out: dict[int, list[tuple]] = {}
    for src, dst in ((items.state_in, state_in), (items.state_out, state_out)):
        for i, copies in src.items():
            dst.setdefault(int(stage_of[i]), []).extend(copies)
    fetched: dict[tuple[int, int], tuple] = {}  # (stage, layer): one copy
    for i, copies in items.weights_in.items():
        for w, b, layer, leaves in copies:
            fetched[int(stage_of[i]), layer] = (w, b, leaves)
    for (s, _), copy in sorted(fetched.items()):
        state_in.setdefault(s, []).append(copy)
    return _Stages(cut, skeys, sdeps, sbytes, sdur, per_device, realised, state_in, state_out)


def _unfused_s(st: _Stages, items: _Items, arr: Arrays) -> np.ndarray:
    """[S] seconds each stage runs beyond its scaled layers: fusion it cannot have.

    A table scaled to a device's whole step (`scale_to_step`, factor f < 1)
    prices every layer at f x its time alone: what one executable of all L
    layers gains by fusing across their boundaries. A stage holds k of those
    layers and gains across its own k - 1 boundaries only, so its layers run
    at 1 - (1 - f) (k - 1) / (L - 1) of their time alone: a stage of one
    layer at its time alone (GPT-2's head on an H100's host CPU, alone in its
    stage: 0.709 s against 0.697 s alone, scaled 0.627 s), the whole step at
    f. A factor >= 1 (the step slower than its layers, as on GPUs at small
    batches) is kept for every stage. Updates keep their figure: timed
    apart they were never scaled, and an update in its layer's backward
    stays at the scaled time (a small share, left as it is).
    """
    extra = np.zeros(len(st.cut))
    L = len(arr.layers)
    if L < 2:
        return extra
    for s, members in enumerate(st.cut):
        f = float(arr.step_scale[arr.dindex[st.keys[s][0]]])
        if not 0.0 < f < 1.0:
            continue
        layers = {int(items.layer_of[i]) for i in members if items.compute[i] > 0}
        if layers:
            kept = 1.0 - (1.0 - f) * (len(layers) - 1) / (L - 1)
            extra[s] = float(items.compute[members].sum()) * (kept / f - 1.0)
    return extra


def _replay(st: _Stages, arr: Arrays, stats: dict | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Runs the stages in each device's order; returns their (start, end) seconds.

    Event-driven: each device's next stage is queued with the time it can
    start once its producers have run and its compute resource is free; the
    earliest queued stage runs next. A stage whose resource another device
    of its compute group took meanwhile is queued again, at the time that
    resource frees. Transfers are priced (and their links taken) when queued;
    state copies in are issued at the start in stage order, copies back when
    their stage ends. `stats` receives `transfer_s` (all transfers' seconds)
    and `last_s` (when the last state copy back ends).
    """
    S = len(st.cut)
    end = np.full(S, np.nan)
    start = np.full(S, np.nan)
    res_of = {dev: int(arr.resource[arr.dindex[dev]]) for dev in st.per_device}
    res_free = dict.fromkeys(res_of.values(), 0.0)
    head = dict.fromkeys(st.per_device, 0)
    link_free: dict[tuple[str, str], float] = {}
    arrived: dict[tuple[int, int], float] = {}
    stats = {} if stats is None else stats
    stats.setdefault("transfer_s", 0.0)
    stats.setdefault("last_s", 0.0)
    state_ready = np.zeros(S)
    for s in sorted(st.state_in):
        for src, b, leaves in st.state_in[s]:
            state_ready[s] = max(state_ready[s], _send(arr, link_free, stats, src,
                                                       st.keys[s][0], b, 0.0, leaves))
    heap: list[tuple[float, int, str]] = []
    queued: set[str] = set()
    placed = 0
    while True:
        for dev, stages in st.per_device.items():
            if dev in queued or head[dev] >= len(stages):
                continue
            s = stages[head[dev]]
            t = _arrivals(s, st, end, arr, link_free, arrived, stats)
            if t is not None:
                t = max(t, state_ready[s])
                heapq.heappush(heap, (max(t, res_free[res_of[dev]]), s, dev))
                queued.add(dev)
        if not heap:
            break
        t, s, dev = heapq.heappop(heap)
        if res_free[res_of[dev]] > t:  # a device sharing its cores ran first
            heapq.heappush(heap, (res_free[res_of[dev]], s, dev))
            continue
        queued.discard(dev)
        start[s], end[s] = t, t + st.dur[s]
        res_free[res_of[dev]] = end[s]
        head[dev] += 1
        placed += 1
        for dst, b, leaves in st.state_out.get(s, ()):
            stats["last_s"] = max(stats["last_s"], _send(arr, link_free, stats, dev, dst, b,
                                                         float(end[s]), leaves))
    if placed != S:  # cannot happen: the orders were checked to complete
        raise PlanError("internal error: the replayed schedule deadlocked")
    return start, end


def _add(d: dict, key, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def _send(arr: Arrays, link_free: dict, stats: dict, src: str, dst: str, nbytes: float,
          ready: float, leaves: tuple = ()) -> float:
    """Sends `nbytes` (as arrays of `leaves` bytes) src -> dst once `ready` and
    the link is free; returns when it arrives."""
    if src == dst:
        return ready
    i, j = arr.dindex[src], arr.dindex[dst]
    if arr.bw[i, j] <= 0:
        raise PlanError(f"no link {src} -> {dst} for a transfer the plan needs")
    # A memory place's copies share the bus with its host CPU device's (`Arrays.ram`).
    bus = (int(arr.ram[i]), int(arr.ram[j]))
    go = max(ready, link_free.get(bus, 0.0))
    took = arr.link_s(i, j, nbytes, leaves)
    stats["transfer_s"] = stats.get("transfer_s", 0.0) + took
    link_free[bus] = go + took
    return go + took


def _arrivals(s: int, st: _Stages, end: np.ndarray, arr: Arrays, link_free: dict,
              arrived: dict, stats: dict) -> float | None:
    """When all of stage s's inputs are on its device, or None if a producer has not run.

    Prices each cross-device input once, on first ask: the transfer starts
    when its producer ends and its link is free.
    """
    dst = st.keys[s][0]
    t = 0.0
    for p in st.deps[s]:
        if np.isnan(end[p]):
            return None
        if (s, p) not in arrived:
            b = st.xbytes.get((s, p))
            if b is None:
                arrived[s, p] = end[p]
            else:
                arrived[s, p] = _send(arr, link_free, stats, st.keys[p][0], dst, b, end[p])
        t = max(t, arrived[s, p])
    return t


def evaluate_replayed(table: CostTable, assignment: Mapping, microbatches: int,
                      schedule: str, *, arrays: Arrays | None = None) -> Predicted:
    """`evaluate` in pipelined mode, with the step time (and so cost, energy) replayed.

    The closed form stays in `closed_form_s`; bottleneck, memory and busy
    times are the closed form's. An assignment with state apart from compute
    (`Placement`s) has no closed form: everything comes from the replay
    (`microbatches` 1 replays a sequential step), memory from `held_bytes`.
    """
    arr = arrays or Arrays(table)
    placed = arr.placed(assignment)
    if placed.any_apart:
        return _evaluate_apart(arr, assignment, placed, microbatches, schedule)
    p = closed_form(arr, placed, "pipelined", microbatches_of("pipelined", microbatches))
    if not np.isfinite(p.step_time_s):
        return p
    step = simulate(table, assignment, microbatches, schedule, arrays=arr).step_time_s
    used = np.array([d in p.busy_s for d in arr.devices])
    busy = np.array([p.busy_s.get(d, 0.0) for d in arr.devices])
    return dataclasses.replace(
        p, step_time_s=step, cost_usd_per_step=step * arr.hourly_price(used) / 3600.0,
        energy_j_per_step=arr.joules(used, busy, step), schedule=schedule,
        closed_form_s=p.step_time_s)


def _evaluate_apart(arr: Arrays, assignment: Mapping, placed: Placed, microbatches: int,
                    schedule: str) -> Predicted:
    """The replayed Predicted of an assignment with some state apart from compute."""
    M = int(microbatches)
    replay = simulate(arr.table, assignment, M, schedule, arrays=arr)
    D = len(arr.devices)
    used = np.zeros(D, bool)
    for where in (placed.compute, placed.state, placed.update, placed.params):
        used[where] = True
    busy = np.array([replay.busy_s.get(d, 0.0) for d in arr.devices])
    step = replay.step_time_s
    held = held_bytes(arr, placed, M)
    memory = {arr.devices[j]: float(held[j]) for j in range(D) if used[j]}
    return Predicted(
        step_time_s=step, cost_usd_per_step=step * arr.hourly_price(used) / 3600.0,
        energy_j_per_step=arr.joules(used, busy, step),
        busy_s={arr.devices[j]: float(busy[j]) for j in range(D)
                if used[j] and not arr.place[j]},  # a memory place never computes
        compute_s=float(busy.sum()), transfer_s=replay.transfer_s, memory_bytes=memory,
        schedule=replay.schedule if M > 1 else None, peak_memory_bytes=memory)
