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
deadlock; a 1F1B order that would is replaced by GPipe's. The orders live in
`passes/_schedule.py`, shared with the planner's schedule simulator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax.extend import core as jcore

from hetpar.core import (
    ACTIVATIONS_RUN,
    SCHEDULES,
    Placement,
    PlanError,
    device_aware_order,
    device_orders,
    parse_placements,
    stage_deps,
)
from hetpar.core import runs as cut_runs
from hetpar.passes._layer_graph import OPT_STATE, PARAM, LayerGraph
from hetpar.passes._layers import SHARED, is_backward, is_forward, microbatch_of, updating_eqns


@dataclasses.dataclass(frozen=True)
class Stage:
    """A run of equations on one device, compiled as one executable.

    Attributes:
      index: position in the StageGraph's global topological order.
      device: device name (`cpu:0`, `gpu:0`).
      eqns: program equation indices, in program order.
      microbatch: the microbatch it works on, or None.
      phase: "pre", "forward", "backward", "post" (with microbatches) or "main"
        (and "update", see `split`'s update_apart).
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
      assignment: layer -> compute device.
      stages: all stages, in one global topological order.
      device_order: device -> stage indices in the order that device runs them.
      input_devices: for every flat program input, the device (or memory
        place, `gpu:0:pinned_host`) it should live on.
      home: device of the shared group.
      schedule: "gpipe" or "1f1b" (what device_order realises).
      placements: layer -> Placement (compute, state and update devices).
      output_devices: for every flat program output, the device or memory
        place it must be returned to, or None where it stays where it was
        computed. A layer whose update runs away from its state (streamed)
        returns its new state (and parameters) to their homes, so the next
        step finds them there.
    """

    graph: LayerGraph
    assignment: Mapping[str, str]
    stages: tuple[Stage, ...]
    device_order: Mapping[str, tuple[int, ...]]
    input_devices: tuple[str, ...]
    home: str
    schedule: str
    placements: Mapping[str, Placement] = dataclasses.field(default_factory=dict)
    output_devices: tuple[str | None, ...] = ()

    def stages_on(self, device: str) -> list[Stage]:
        return [self.stages[i] for i in self.device_order.get(device, ())]

    def __repr__(self) -> str:
        per = ", ".join(f"{d}: {len(v)}" for d, v in self.device_order.items())
        return f"StageGraph({len(self.stages)} stages; {per}; schedule={self.schedule})"


def split(graph: LayerGraph, assignment: Mapping[str, str | Placement | Mapping], *,
          schedule: str = "gpipe", update_apart: bool = False) -> StageGraph:
    """Cuts `graph`'s program into per-device stages under `assignment`.

    Args:
      graph: the traced step.
      assignment: layer name -> device name, or -> Placement (or its dict
        form) for a layer whose state and update live apart from its compute
        (docs/architecture/offload.md, "State apart from compute"). Covers every layer.
      schedule: "gpipe" or "1f1b": each device's stage order when microbatched.
      update_apart: without microbatches, put the update (the optimizer) in
        stages of its own, phase "update", so that what it reads from the
        forward and backward (the gradients) can be changed in between: a
        hierarchical plan averages them across processes. (With microbatches
        the update is apart already: phase "post".)

    Raises:
      PlanError: the assignment misses layers or names unknown ones, or asks
        for an activation policy the runtime does not carry out.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not graph.layers:
        raise PlanError("the step has no layers to place: it computes nothing (its results "
                        "are its inputs); call it as it is")
    check_covers(graph, assignment)
    placements = parse_placements(assignment)
    for layer, p in placements.items():
        if p.activations not in ACTIVATIONS_RUN:
            raise PlanError(f"layer {layer!r}: activations={p.activations!r} is planned for but "
                            f"not run yet; use one of {ACTIVATIONS_RUN}")
    compute = {layer: p.compute for layer, p in placements.items()}
    eqns = graph.program.jaxpr.jaxpr.eqns
    home = compute[graph.layers[0]]
    updating = updating_eqns(eqns)
    device = _eqn_devices(graph, placements, home, updating)
    keys = _stage_keys(eqns, device)
    if update_apart:
        keys = [(d, mb, "update") if ph == "main" and up else (d, mb, ph)
                for (d, mb, ph), up in zip(keys, updating)]
    reads = _eqn_deps(eqns)
    deps = [set(d) for d in reads]
    _update_after_backward(graph, updating, deps)
    cut_keys = _cut_keys(graph, placements, keys)
    try:
        order = device_aware_order(deps, cut_keys)
    except ValueError:  # cannot happen for a valid jaxpr
        raise PlanError("internal error: the step's equations form a cycle") from None
    runs = _sink_free(eqns, cut_runs(order, cut_keys), cut_keys, reads,
                      graph.program.jaxpr.jaxpr.outvars, after=deps)
    stage_of = {i: s for s, run in enumerate(runs) for i in run}
    input_devices = _input_devices(graph, placements, device, home)
    remat = frozenset(la for la, p in placements.items() if p.activations == "remat")
    stages = _stages(graph, runs, keys, stage_of,
                     dict(zip(graph.program.jaxpr.jaxpr.invars, input_devices)), remat)
    device_order, schedule = device_orders(
        [(st.device, st.microbatch, st.phase) for st in stages],
        stage_deps([stage_of[i] for i in range(len(eqns))], deps, len(stages)), schedule)
    return StageGraph(graph, compute, tuple(stages), device_order, input_devices, home, schedule,
                      placements, _output_devices(graph, placements, updating))


def _sink_free(eqns, runs: list[list[int]], keys, deps, outvars,
               after: list[set[int]] | None = None) -> list[list[int]]:
    """`runs` with the work that reads nothing computed elsewhere moved to its readers.

    An equation whose inputs are all program inputs, constants or results
    of such equations of its own stage key (a loss's cotangent scattered by
    the labels, a mask from an iota, a cast of a weight) is ready from the
    start, so the device-aware order takes it into the first stage of its
    key, where it is materialised and handed on. GPT-2's cross-entropy
    gradient is such a scatter: a (batch, 127, 50257) f32 tensor, 408 MB at
    batch 16, made in the embedding's stage and read by the head's, whose
    stage then ran 1.1-1.4x the head timed alone, 1.0x since
    (experiments/results/plan_memory). Each such equation goes to the
    earliest stage that reads it when that stage has its key (device,
    microbatch, phase), placed before the stage's own equations in program
    order; there one executable fuses it as `jax.jit` does. Equations whose
    results are program outputs stay.

    `deps` are what each equation reads; `after` adds the order
    `_update_after_backward` imposes, which a moved equation keeps: it goes
    only to a stage after those it must follow. So Adam's `b1 * mu` and
    `b2 * nu` go to the layer's update, not its backward stage, which
    handed them on to the update, two copies of the moments beside the old
    ones until the step's end: a 2.9B Hugging Face Llama's offload plan at
    38 GB replayed at 47.2 GB on the GPU, 9.7 GB of it those copies
    (experiments/results/fit_h200, run 20).
    """
    after = deps if after is None else after
    outs = {v for v in outvars if isinstance(v, jcore.Var)}
    free = set()
    for i, e in enumerate(eqns):  # program order is a topological order
        # What it reads that no equation makes is a program input or a constant.
        if not e.effects and all(j in free and keys[j] == keys[i] for j in deps[i]):
            free.add(i)
    if not free:
        return runs
    run_of = {i: r for r, run in enumerate(runs) for i in run}
    readers: dict[int, set[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            readers.setdefault(j, set()).add(i)
    target: dict[int, int] = {}
    for i in sorted(free, reverse=True):  # readers first: a chain moves together
        dests = {target.get(u, run_of[u]) for u in readers.get(i, ())}
        if not dests or any(o in outs for o in eqns[i].outvars):
            continue
        r = min(dests)
        if r > run_of[i] and keys[runs[r][0]] == keys[i] and all(
                run_of[j] < r for j in after[i] - deps[i]):
            target[i] = r
    if not target:
        return runs
    out = [[i for i in run if i not in target] for run in runs]
    for r in set(target.values()):
        out[r] = sorted(i for i, t in target.items() if t == r) + out[r]
    return [run for run in out if run]


def _output_devices(graph: LayerGraph, placements: Mapping[str, Placement],
                    updating: list[bool]) -> tuple[str | None, ...]:
    """Where each program output goes back to: for the values a layer's update
    computed away from where they live (a streamed layer), the new parameters
    to its `params` home and the new optimizer state to its `state` home;
    None (where computed) for the rest.

    A new value is the layer's parameters when the equation that makes it
    reads a parameter input itself (optax's `apply_updates`: p + u, then a
    cast); the new moments read the old moments and a gradient, even where
    weight decay folded the parameters into that gradient earlier.
    """
    jaxpr = graph.program.jaxpr.jaxpr
    casts = ("convert_element_type", "copy")
    # The parameter inputs and their casts; then what update equations make
    # from them directly, and casts of that.
    params = {v for v, role in zip(jaxpr.invars, graph.input_roles) if role == PARAM}
    reads_params: set = set()
    producer = {}
    for i, e in enumerate(jaxpr.eqns):
        for o in e.outvars:
            producer[o] = i
        ins = [a for a in e.invars if isinstance(a, jcore.Var)]
        if e.primitive.name in casts and ins and ins[0] in params:
            params.update(e.outvars)
        elif e.primitive.name in casts and ins and ins[0] in reads_params:
            reads_params.update(e.outvars)
        elif updating[i] and any(a in params for a in ins):
            reads_params.update(e.outvars)
    out: list[str | None] = []
    for v in jaxpr.outvars:
        i = producer.get(v) if isinstance(v, jcore.Var) else None
        layer = graph.eqn_layers[i] if i is not None else None
        p = placements.get(layer) if layer is not None else None
        wanted = None
        if p is not None and updating[i]:
            home = p.params if v in reads_params else p.state
            if home != p.update:
                wanted = home
        out.append(wanted)
    return tuple(out)


def _cut_keys(graph: LayerGraph, placements: Mapping[str, Placement], keys: list) -> list:
    """Stage keys, with each offloaded layer's compute as stages of its own.

    An offloaded layer's weights come from another device every step. As
    its own stage, its weights' copy starts while the layers before it
    compute, instead of every weight arriving before one big stage starts.
    A layer whose activations are offloaded or recomputed gets stages of its
    own too: its forward and backward must be apart for its residuals to
    leave the device, or not be kept, in between.
    """
    def own(p):
        return p is not None and (p.offloaded or p.activations != "keep")

    if not any(own(p) for p in placements.values()):
        return keys
    out = []
    for i, key in enumerate(keys):
        layer = graph.eqn_layers[i]
        p = placements.get(layer)
        part = layer if own(p) and key[0] == p.compute else None
        out.append((*key, part))
    return out


def check_covers(graph: LayerGraph, assignment: Mapping[str, str]) -> None:
    """The assignment names every layer of the step and no other.

    Raises:
      PlanError: naming the unknown and missing layers and the step's own.
    """
    missing = [n for n in graph.layers if n not in assignment]
    unknown = [n for n in assignment if n not in set(graph.layers)]
    if missing or unknown:
        raise PlanError(
            "the plan does not fit this step's layers: "
            + (f"unknown {unknown[:8]}{'...' if len(unknown) > 8 else ''}; " if unknown else "")
            + (f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}; " if missing else "")
            + f"the step's layers are {graph.layers[:12]}{'...' if len(graph) > 12 else ''}. "
            "Was the plan made for another model or depth?")


def _stage_keys(eqns, device: list[str]) -> list[tuple[str, int | None, str]]:
    """Each equation's stage key: (device, microbatch, phase).

    Without microbatches every phase is "main"; with them, equations of a
    microbatch are its "forward" or "backward", and the rest come "pre" (before
    the first microbatch's equations) or "post" (the accumulation and update).
    """
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
    return [(device[i], mbs[i], phase[i]) for i in range(len(eqns))]


#: Primitives cheap enough to recompute in a consumer stage instead of
#: carrying their result across the stage boundary: elementwise arithmetic
#: and layout changes (under one jit, XLA fuses them into their consumers).
RECOMPUTABLE = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "exp", "log", "log1p", "tanh",
    "logistic", "sqrt", "rsqrt", "integer_pow", "pow", "abs", "sign", "select_n", "erf",
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "transpose", "copy", "square", "exp2", "erf_inv", "is_finite", "eq", "ne", "lt", "le",
    "gt", "ge", "and", "or", "not", "stop_gradient",
})
#: How far back a consumer recomputes a chain of such equations.
RECOMPUTE_DEPTH = 8


def _recomputed(eqns, runs, keys, stage_of: Mapping[int, int], program_inputs: set,
                input_home: Mapping, eqn_layers=(), remat: frozenset = frozenset(),
                params: frozenset = frozenset()) -> list[list[int]]:
    """Per stage, the equations of other stages it recomputes.

    Split at layer boundaries, a forward stage hands its backward every
    residual the backward reads: dozens of elementwise intermediates per
    transformer block (GELU and layer-norm pieces), which one jit would fuse
    away. Measured on a d_model 4096 block: about 3 GB of residuals against
    0.8 GB of weights, so a 24-block model that fits the GPU's memory as one
    jit ran out of it split. A stage therefore recomputes the cheap
    (`RECOMPUTABLE`) equations behind the values it reads from other stages,
    up to RECOMPUTE_DEPTH back, and reads their inputs instead: matmul and
    reduction outputs, program inputs. Only equations of its own device and
    microbatch whose inputs are on its device too: never one that would read
    a value from another device or a program input kept elsewhere (streamed
    optimizer state) again.

    A layer in `remat` (activations="remat") recomputes every equation of
    its own forward that its later stages read, matmuls included, at any
    depth: its forward stage then hands on only what other layers made (its
    input, the checkpoint), as `jax.checkpoint` would at the layer's edge.
    It reads the parameters its own equations read again wherever they
    live (`params`: the program's parameter inputs; a tied embedding's
    too, which another layer owns): streamed from host memory, a block's
    weights come to its backward stage anyway (its input gradient reads
    them), so recomputing costs the small ones (biases, norms) another
    trip, where keeping the matmuls' results would free nothing of what the
    plan recomputes for.
    """
    producer = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    # A remat layer recomputes its forward only: admitted whole, its backward
    # (what its update stage reads, the gradients) was recomputed too, and a
    # 6.74B Llama-style step with 31 of 35 layers recomputed ran at 1.96x
    # jit's step where recomputing their forwards costs about 1.3x.
    forward = [is_forward(str(e.source_info.name_stack)) for e in eqns] if remat else []
    out = []
    for s, run in enumerate(runs):
        here = keys[run[0]][0]
        where = keys[run[0]][:2]
        layers = {eqn_layers[i] for i in run} if remat else set()

        def may(i: int, s=s, run=run, here=here, where=where, layers=layers) -> bool | None:
            # Only work of the same device and microbatch: recomputing another
            # device's values would pull their inputs across instead (a host
            # update re-summing every microbatch's gradient). Nor into an
            # update kept apart from the work it reads (update_apart): what
            # crosses there is what a hierarchical plan averages.
            apart = (keys[i][2] == "update") != (keys[run[0]][2] == "update")
            if stage_of[i] == s or keys[i][:2] != where or apart:
                return False
            own_remat = (bool(remat) and forward[i] and eqn_layers[i] in remat
                         and eqn_layers[i] in layers)
            for b in eqns[i].invars:
                if not isinstance(b, jcore.Var):
                    continue
                if b in program_inputs:
                    if input_home.get(b, here) != here and not (own_remat and b in params):
                        return False
                elif b in producer and keys[producer[b]][0] != here:
                    return False
            # A remat layer's own forward is recomputed whole; else only cheap
            # equations (`walk_back`).
            return True if own_remat else None

        out.append(sorted(walk_back(eqns, producer, run, program_inputs, may)))
    return out


def walk_back(eqns, producer: Mapping, run, program_inputs, may) -> set[int]:
    """The equations a stage made of `run` recomputes rather than reads.

    Back from what `run` reads (program inputs excepted), through
    equations `may(i)` admits: True recomputes it at any depth (a remat
    layer's own forward), None only if cheap (`RECOMPUTABLE`, fewer than
    `RECOMPUTE_DEPTH` steps back), False never. Effectful equations never.
    """
    own = set(run)
    reached: set[int] = set()
    frontier = [(a, 0) for i in run for a in eqns[i].invars
                if isinstance(a, jcore.Var) and a not in program_inputs]
    while frontier:
        a, depth = frontier.pop()
        i = producer.get(a)
        if i is None or i in own or i in reached or eqns[i].effects:
            continue
        admit = may(i)
        if admit is False or (admit is None and not (
                eqns[i].primitive.name in RECOMPUTABLE and depth < RECOMPUTE_DEPTH)):
            continue
        reached.add(i)
        frontier.extend((b, depth + 1) for b in eqns[i].invars
                        if isinstance(b, jcore.Var) and b not in program_inputs)
    return reached


def _stages(graph: LayerGraph, runs, keys, stage_of: Mapping[int, int],
            input_home: Mapping, remat: frozenset = frozenset()) -> list[Stage]:
    """One Stage per run of equations: its inputs, outputs and closed jaxpr.

    A stage's jaxpr also holds the cheap equations it recomputes from other
    stages (`_recomputed`); their results are never its outputs.
    """
    jaxpr = graph.program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    consts = dict(zip(jaxpr.constvars, graph.program.jaxpr.consts))
    params = frozenset(v for v, role in zip(jaxpr.invars, graph.input_roles) if role == PARAM)
    extra = _recomputed(eqns, runs, keys, stage_of, set(jaxpr.invars) | set(consts), input_home,
                        graph.eqn_layers, remat, params)
    members = [sorted(set(run) | set(more)) for run, more in zip(runs, extra)]
    readers: dict[jcore.Var, set[int]] = {}
    for s, ids in enumerate(members):
        for i in ids:
            for a in eqns[i].invars:
                if isinstance(a, jcore.Var):
                    readers.setdefault(a, set()).add(s)
    result_vars = {a for a in jaxpr.outvars if isinstance(a, jcore.Var)}
    defines = [{o for i in ids for o in eqns[i].outvars} for ids in members]

    stages = []
    for s, run in enumerate(runs):
        ids = members[s]
        own = set(run)
        defined, inputs, const_in, seen = set(), [], [], set()
        for i in ids:
            for a in eqns[i].invars:
                if isinstance(a, jcore.Var) and a not in defined and a not in seen:
                    seen.add(a)
                    (const_in if a in consts else inputs).append(a)
            defined.update(o for o in eqns[i].outvars if not isinstance(o, jcore.DropVar))
        # Another stage that recomputes a value reads its inputs, not it.
        outputs = [o for i in sorted(own) for o in eqns[i].outvars
                   if not isinstance(o, jcore.DropVar)
                   and (o in result_vars or any(
                       t != s and o not in defines[t]
                       for t in readers.get(o, set())))]
        sub = [eqns[i] for i in ids]
        effects = frozenset().union(*(e.effects for e in sub))
        closed = jcore.ClosedJaxpr(
            jcore.Jaxpr(const_in, inputs, outputs, sub, effects, jaxpr.debug_info),
            [consts[c] for c in const_in])
        first = min(own)
        dev, mb, ph = keys[first]
        layers = tuple(dict.fromkeys(graph.eqn_layers[i] for i in sorted(own)))
        stages.append(Stage(s, dev, tuple(sorted(own)), mb, ph, layers, tuple(inputs),
                            tuple(outputs), closed))
    return stages


def _input_devices(graph: LayerGraph, placements: Mapping[str, Placement], device: list[str],
                   home: str) -> tuple[str, ...]:
    """The device every flat program input should live on.

    Parameters live in their layer's `params` home, optimizer state in its
    `state` home (a device or a memory place), other inputs (the batch) on
    its compute device. Shared inputs (the optimizer's
    step count) live where they are first read, like the shared equations:
    otherwise every step would pull the new count back from the accelerator
    to the home device and wait for it.
    """
    jaxpr = graph.program.jaxpr.jaxpr
    first_read: dict[jcore.Var, str] = {}
    for i, e in enumerate(jaxpr.eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                first_read.setdefault(a, device[i])
    out = []
    for v, layer, role in zip(jaxpr.invars, graph.input_layers, graph.input_roles):
        if layer in (None, SHARED):
            out.append(first_read.get(v, home))
        else:
            p = placements[layer]
            out.append(p.params if role == PARAM else p.state if role == OPT_STATE
                       else p.compute)
    return tuple(out)


def _eqn_devices(graph: LayerGraph, placements: Mapping[str, Placement], home: str,
                 updating: list[bool]) -> list[str]:
    """Each equation's device: its layer's compute device for the forward and
    backward, its update device for the rest once the backward has begun (the
    optimizer update, gradient accumulation). A shared (scalar) equation runs
    where it is first read.

    Placing a shared scalar beside its first consumer keeps it off the
    critical path; other readers receive a few bytes. Shared equations that
    only feed the result (the new step count) run on the home device.
    """
    eqns = graph.program.jaxpr.jaxpr.eqns
    device: list[str | None] = []
    for i, name in enumerate(graph.eqn_layers):
        if name == SHARED:
            device.append(None)
            continue
        p = placements[name]
        device.append(p.update if updating[i] else p.compute)
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


def _update_after_backward(graph: LayerGraph, updating: list[bool],
                           deps: list[set[int]]) -> None:
    """Makes each layer's update work wait for that layer's backward to begin.

    Some update equations read only the step's inputs (Adam's `b1 * mu`
    needs no gradient), so a topological order is free to run them in the
    layer's forward stage, which then hands the scaled moments, the size of
    the optimizer state, to the backward across the whole step. Measured on
    a 5B model with optimizer state streamed from pinned host memory: every
    forward stage pulled its layer's 1.6 GB of moments in, and the GPU held
    them all until the backward. Program order already puts the update
    after the backward, so the extra edges can make no cycle.
    """
    stacks = [str(e.source_info.name_stack) for e in graph.program.jaxpr.jaxpr.eqns]
    # The anchor is the layer's last backward equation (its gradient made
    # final), not its first: that may need no input at all (the zeros a
    # gather's transpose scatters into) and so run in the forward too.
    last_backward: dict[str, int] = {}
    for i, (layer, s) in enumerate(zip(graph.eqn_layers, stacks)):
        if is_backward(s) and layer != SHARED:  # (shared scalars: the step count's)
            last_backward[layer] = i
    for i, layer in enumerate(graph.eqn_layers):
        b = last_backward.get(layer)
        if updating[i] and b is not None and b < i:
            deps[i].add(b)


def _eqn_deps(eqns) -> list[set[int]]:
    """For each equation, the equations whose outputs it reads."""
    producer: dict[jcore.Var, int] = {}
    for i, e in enumerate(eqns):
        for o in e.outvars:
            if not isinstance(o, jcore.DropVar):
                producer[o] = i
    return [{producer[a] for a in e.invars if isinstance(a, jcore.Var) and a in producer}
            for e in eqns]
