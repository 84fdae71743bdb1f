"""Cut a traced step into per-device stages: the StageGraph.

Given the LayerGraph and an assignment layer -> device, every equation gets
its layer's device (the tiny "shared" group goes to a home device: the first
layer's). Equations are then taken in a device-aware topological order: keep
taking ready equations of the current stage key before switching, so each
device gets as few stages as the data dependencies allow. A stage key is
(device, microbatch, phase): with microbatches (`hetpar.value_and_grad`
under `hetpar.auto(microbatches=M)`) each microbatch's forward and backward
become their own stages, which is what lets devices work on different
microbatches at once.

Each device runs its stages in a fixed order, its schedule: GPipe (all
forwards, then all backwards) or 1F1B (warm-up forwards, then one backward
and one forward in turn, bounding activations in flight). Any per-device
order that follows one global topological order of the stages cannot
deadlock; a 1F1B order that would is replaced by GPipe's.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping

from jax.extend import core as jcore

from hetpar._errors import PlanError
from hetpar.passes._layer_graph import LayerGraph
from hetpar.passes._layers import SHARED, is_backward, microbatch_of

_PHASE_RANK = {"pre": 0, "forward": 1, "main": 1, "backward": 2, "post": 3}
SCHEDULES = ("gpipe", "1f1b")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A run of equations on one device, compiled as one executable.

    Attributes:
      index: position in the StageGraph's global topological order.
      device: device name (`cpu:0`, `gpu:0`).
      eqns: program equation indices, in program order.
      microbatch: the microbatch it works on, or None.
      phase: "pre", "forward", "backward", "post" (with microbatches) or "main".
      layers: the layers its equations belong to.
      inputs: program variables it reads (defined by other stages or program inputs).
      outputs: program variables it defines that other stages or the result read.
      jaxpr: the stage as a closed jaxpr (consts it reads baked in).
    """

    index: int
    device: str
    eqns: tuple[int, ...]
    microbatch: int | None
    phase: str
    layers: tuple[str, ...]
    inputs: tuple[jcore.Var, ...]
    outputs: tuple[jcore.Var, ...]
    jaxpr: jcore.ClosedJaxpr

    def __repr__(self) -> str:
        mb = "" if self.microbatch is None else f" mb{self.microbatch}"
        return (f"Stage({self.index}: {self.device}{mb} {self.phase}, {len(self.eqns)} eqns, "
                f"layers={list(self.layers)})")


@dataclasses.dataclass(frozen=True)
class StageGraph:
    """The stages of a split step and how to run them.

    Attributes:
      graph: the LayerGraph it was cut from.
      assignment: layer -> device.
      stages: all stages, in one global topological order.
      device_order: device -> stage indices in the order that device runs them.
      input_devices: for every flat program input, the device it should live on.
      home: device of the shared group.
      schedule: "gpipe" or "1f1b" (what device_order realises).
    """

    graph: LayerGraph
    assignment: Mapping[str, str]
    stages: tuple[Stage, ...]
    device_order: Mapping[str, tuple[int, ...]]
    input_devices: tuple[str, ...]
    home: str
    schedule: str

    @property
    def devices(self) -> list[str]:
        return list(self.device_order)

    def stages_on(self, device: str) -> list[Stage]:
        return [self.stages[i] for i in self.device_order.get(device, ())]

    def __repr__(self) -> str:
        per = ", ".join(f"{d}: {len(v)}" for d, v in self.device_order.items())
        return f"StageGraph({len(self.stages)} stages; {per}; schedule={self.schedule})"


def split(graph: LayerGraph, assignment: Mapping[str, str], *,
          schedule: str = "gpipe") -> StageGraph:
    """Cuts `graph`'s program into per-device stages under `assignment`.

    Args:
      graph: the traced step.
      assignment: layer name -> device name, covering every layer.
      schedule: "gpipe" or "1f1b": each device's stage order when microbatched.

    Raises:
      PlanError: the assignment misses layers or names unknown ones.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    missing = [n for n in graph.layers if n not in assignment]
    unknown = [n for n in assignment if n not in set(graph.layers)]
    if missing or unknown:
        raise PlanError(
            "the plan does not fit this step's layers: "
            + (f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}; " if missing else "")
            + (f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}; " if unknown else "")
            + f"the step's layers are {graph.layers[:12]}{'...' if len(graph) > 12 else ''}. "
            "Was the plan made for another model or depth?")
    jaxpr = graph.program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    home = assignment[graph.layers[0]]
    device = _eqn_devices(graph, assignment, home)

    stacks = [str(e.source_info.name_stack) for e in eqns]
    mbs = [microbatch_of(s) for s in stacks]
    first_mb = next((i for i, m in enumerate(mbs) if m is not None), None)
    phase = []
    for i, m in enumerate(mbs):
        if m is not None:
            phase.append("backward" if is_backward(stacks[i]) else "forward")
        elif first_mb is None:
            phase.append("main")
        else:
            phase.append("pre" if i < first_mb else "post")
    keys = [(device[i], mbs[i], phase[i]) for i in range(len(eqns))]

    order = _device_aware_order(eqns, keys)
    runs: list[list[int]] = []
    for i in order:
        if runs and keys[runs[-1][-1]] == keys[i]:
            runs[-1].append(i)
        else:
            runs.append([i])

    stage_of = {}
    for s, run in enumerate(runs):
        for i in run:
            stage_of[i] = s
    readers: dict[jcore.Var, set[int]] = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                readers.setdefault(a, set()).add(stage_of[i])
    result_vars = {a for a in jaxpr.outvars if isinstance(a, jcore.Var)}
    consts = dict(zip(graph.program.jaxpr.jaxpr.constvars, graph.program.jaxpr.consts))

    stages = []
    for s, run in enumerate(runs):
        ids = sorted(run)
        defined, inputs, const_in, seen = set(), [], [], set()
        for i in ids:
            for a in eqns[i].invars:
                if isinstance(a, jcore.Var) and a not in defined and a not in seen:
                    seen.add(a)
                    (const_in if a in consts else inputs).append(a)
            defined.update(o for o in eqns[i].outvars if not isinstance(o, jcore.DropVar))
        outputs = [o for i in ids for o in eqns[i].outvars
                   if not isinstance(o, jcore.DropVar)
                   and (o in result_vars or readers.get(o, set()) - {s})]
        sub = [eqns[i] for i in ids]
        effects = frozenset().union(*(e.effects for e in sub))
        closed = jcore.ClosedJaxpr(
            jcore.Jaxpr(const_in, inputs, outputs, sub, effects, jaxpr.debug_info),
            [consts[c] for c in const_in])
        dev, mb, ph = keys[ids[0]]
        layers = tuple(dict.fromkeys(graph.eqn_layers[i] for i in ids))
        stages.append(Stage(s, dev, tuple(ids), mb, ph, layers, tuple(inputs),
                            tuple(outputs), closed))

    device_order = _gpipe_order(stages)
    if schedule == "1f1b" and first_mb is not None:
        device_order = _one_f_one_b(stages, device_order) or device_order
    # Shared inputs (the optimizer's step count) live where they are first read,
    # like the shared equations: otherwise every step would pull the new count
    # back from the accelerator to the home device and wait for it.
    first_read: dict[jcore.Var, str] = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                first_read.setdefault(a, device[i])
    input_devices = [
        first_read.get(v, home) if layer in (None, SHARED) else assignment[layer]
        for v, layer in zip(jaxpr.invars, graph.input_layers)
    ]
    return StageGraph(graph, dict(assignment), tuple(stages), device_order,
                      tuple(input_devices), home, schedule)


def _eqn_devices(graph: LayerGraph, assignment: Mapping[str, str], home: str) -> list[str]:
    """Each equation's device: its layer's; a shared (scalar) one runs where it is first read.

    Placing a shared scalar beside its first consumer keeps it off the
    critical path; other readers receive a few bytes. Shared equations that
    only feed the result (the new step count) run on the home device.
    """
    eqns = graph.program.jaxpr.jaxpr.eqns
    device: list[str | None] = [None if name == SHARED else assignment[name]
                                for name in graph.eqn_layers]
    first_reader: dict[jcore.Var, int] = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                first_reader.setdefault(a, i)
    for i in reversed(range(len(eqns))):
        if device[i] is None:
            readers = [first_reader[o] for o in eqns[i].outvars if o in first_reader]
            device[i] = device[min(readers)] if readers else home
    return device  # type: ignore[return-value]


def _device_aware_order(eqns, keys) -> list[int]:
    """A topological order that stays on the current stage key while it can.

    When the current key has nothing ready, the next key is the one with the
    best (phase, microbatch) priority, ties broken by program order: GPipe's
    order of work, and the fewest switches the dependencies allow.
    """
    producer: dict[jcore.Var, int] = {}
    for i, e in enumerate(eqns):
        for o in e.outvars:
            if not isinstance(o, jcore.DropVar):
                producer[o] = i
    waiting = [0] * len(eqns)
    users: list[list[int]] = [[] for _ in eqns]
    for i, e in enumerate(eqns):
        deps = {producer[a] for a in e.invars if isinstance(a, jcore.Var) and a in producer}
        waiting[i] = len(deps)
        for d in deps:
            users[d].append(i)
    ready: dict[tuple, list[int]] = {}
    for i in range(len(eqns)):
        if waiting[i] == 0:
            heapq.heappush(ready.setdefault(keys[i], []), i)

    def priority(key, head):
        _, mb, ph = key
        return (_PHASE_RANK[ph], -1 if mb is None else mb, head)

    order, current = [], None
    while ready:
        if current not in ready:
            current = min(ready, key=lambda k: priority(k, ready[k][0]))
        i = heapq.heappop(ready[current])
        if not ready[current]:
            del ready[current]
        order.append(i)
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready.setdefault(keys[j], []), j)
    if len(order) != len(eqns):  # cannot happen for a valid jaxpr
        raise PlanError("internal error: the step's equations form a cycle")
    return order


def _gpipe_order(stages) -> dict[str, tuple[int, ...]]:
    out: dict[str, list[int]] = {}
    for st in stages:  # the global order already runs forwards before backwards
        out.setdefault(st.device, []).append(st.index)
    return {d: tuple(v) for d, v in out.items()}


def _deps(stages) -> list[set[int]]:
    where = {v: st.index for st in stages for v in st.outputs}
    return [{where[v] for v in st.inputs if v in where} for st in stages]


def _one_f_one_b(stages, gpipe) -> dict[str, tuple[int, ...]] | None:
    """1F1B per device: (pipeline depth - position) warm-up forwards, then B/F in turn."""
    fwd_devices = []
    for st in stages:
        if st.phase == "forward" and st.device not in fwd_devices:
            fwd_devices.append(st.device)
    depth = len(fwd_devices)
    out = {}
    for dev, ids in gpipe.items():
        units: dict[tuple[str, int], list[int]] = {}
        head, tail = [], []
        for i in ids:
            st = stages[i]
            if st.microbatch is None:
                (head if st.phase == "pre" else tail).append(i)
            else:
                units.setdefault((st.phase, st.microbatch), []).append(i)
        fwd = sorted(k[1] for k in units if k[0] == "forward")
        bwd = sorted(k[1] for k in units if k[0] == "backward")
        warm = depth - fwd_devices.index(dev) if dev in fwd_devices else 0
        seq = [("forward", m) for m in fwd[:warm]]
        rest_f = fwd[warm:]
        for n, m in enumerate(bwd):
            seq.append(("backward", m))
            if n < len(rest_f):
                seq.append(("forward", rest_f[n]))
        seq += [("forward", m) for m in rest_f[len(bwd):]]
        order = head + [i for key in seq for i in units[key]] + tail
        out[dev] = tuple(order)
    return out if _runs(stages, out) else None


def _runs(stages, device_order) -> bool:
    """True if running each device's stages in order completes (no deadlock)."""
    deps = _deps(stages)
    pos = dict.fromkeys(device_order, 0)
    done: set[int] = set()
    progress = True
    while progress:
        progress = False
        for dev, ids in device_order.items():
            while pos[dev] < len(ids) and deps[ids[pos[dev]]] <= done:
                done.add(ids[pos[dev]])
                pos[dev] += 1
                progress = True
    return len(done) == len(stages)
