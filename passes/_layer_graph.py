"""LayerGraph: a traced training step, grouped into layers.

`trace(step_fn, *args)` is the tracing pass: the step's flat jaxpr (forward,
backward, optimizer update), every equation attributed to one layer (or to
the tiny "shared" group), and a networkx DiGraph whose nodes are layers and
whose edges are the tensors that cross between them, in bytes.

Edges always point from the earlier layer to the later one (program order).
A tensor flowing forward adds to the edge's `bytes`; one flowing back (a
gradient, an activation read by an earlier layer's backward) adds to its
`bytes_backward`: exactly the two figures graph.json's edges carry.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import jax
import networkx as nx
import numpy as np
from jax.extend import core as jcore

from hetpar.core import fingerprint
from hetpar.passes._costs import Work, eqn_work, eqns_work, nbytes
from hetpar.passes._layers import (
    SHARED,
    assign_layers,
    is_backward,
    is_forward,
    updating_eqns,
)
from hetpar.passes._program import Program, static_where, subjaxpr, trace_program

#: Roles of a flat input of the step.
PARAM, OPT_STATE, BATCH = "param", "opt_state", "batch"

#: Format tag and version of `LayerGraph.to_json` (`hetpar trace --out layers.json`).
LAYERS_FORMAT, LAYERS_VERSION = "hetpar.layers", 1


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """What a layer holds and does (a node of the LayerGraph)."""

    name: str
    eqns: tuple[int, ...]
    param_bytes: int
    opt_state_bytes: int
    activation_bytes: int  # forward results its backward (or a later layer's) keeps
    work: Work
    #: Share of the layer's forward work that recomputing its activations
    #: repeats (activations="remat"): only the forward equations whose results
    #: its backward reads, directly or through other such equations (the split
    #: pass recomputes exactly these, through cheap equations of other layers
    #: too). By FLOPs; by bytes where the forward has none. A GPT-2 block's is
    #: 0.68: its output and attention projections' results are not read by
    #: its backward.
    recompute_fraction: float = 1.0
    #: Bytes of its own results alive at once that live and die within one
    #: unbroken run of its equations: what its stage holds only while it
    #: runs, beyond what `memory_bytes` counts (a GPT-2 head's logits'
    #: softmax and gradient). Program order, unfused: XLA fuses elementwise
    #: chains away, so this bounds from above what they take.
    workspace_bytes: int = 0
    #: The same, its forward recomputed right before its backward
    #: (activations="remat"): the most bytes alive at once of its own results
    #: read only by its own forward and backward, activations included, run
    #: as one; never under `workspace_bytes` nor over it plus
    #: `activation_bytes`, and under that where the backward frees them as
    #: it goes (a 0.54B Llama block: 1.24 GB against 0.47 + 1.18; XLA's
    #: compiled stage, about 1.2 GB).
    remat_workspace_bytes: int = 0
    #: (role, shape, bytes) of each of its parameter and optimizer-state
    #: leaves: what a sharded-state plan can split (`Layer.state_leaves`).
    state_leaves: tuple[tuple[str, tuple[int, ...], int], ...] = ()

    @property
    def flops(self) -> float:
        return self.work.flops

    @property
    def bytes_accessed(self) -> float:
        return self.work.bytes_accessed

    @property
    def transcendentals(self) -> float:
        return self.work.transcendentals

    @property
    def memory_bytes(self) -> int:
        """Resident bytes while training: params, their gradients, optimizer state, activations."""
        return 2 * self.param_bytes + self.opt_state_bytes + self.activation_bytes


def _readers(jaxpr) -> dict:
    """{variable: the indices of the equations that read it, ascending}; the
    program's results are read after its last equation (`len(eqns)`)."""
    readers: dict = {}
    for i, e in enumerate(jaxpr.eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                readers.setdefault(a, []).append(i)
    for a in jaxpr.outvars:
        if isinstance(a, jcore.Var):
            readers.setdefault(a, []).append(len(jaxpr.eqns))
    return readers


def _peak(delta: Sequence[int]) -> int:
    """The most bytes alive at once, given what each position adds and frees."""
    return int(max(itertools.accumulate(delta[:-1], initial=0)))


def _recomputed_peak(eqns, ids: Sequence[int], readers: Mapping,
                     updating: Sequence[bool]) -> int:
    """The most bytes alive at once, in program order, of the results of the
    layer's forward and backward equations (its update's excluded: it runs
    apart) read by no other equation and not returned by the step, as if
    the two ran as one: its recomputed forward then its backward. The
    activations the backward reads are inside; what leaves the layer (its
    output, its input's and its parameters' gradients) is counted
    elsewhere."""
    seq = [i for i in sorted(ids) if not updating[i]]
    pos = {i: k for k, i in enumerate(seq)}
    delta = [0] * (len(seq) + 1)
    for k, i in enumerate(seq):
        for o in eqns[i].outvars:
            if isinstance(o, jcore.DropVar) or not hasattr(o.aval, "shape"):
                continue
            read = readers.get(o, ())
            if any(r not in pos for r in read):  # read by another, or a result
                continue
            size = math.prod(o.aval.shape) * o.aval.dtype.itemsize
            delta[k] += size
            delta[max((pos[r] for r in read), default=k) + 1] -= size
    return _peak(delta)


def _live_peak(eqns, ids: Sequence[int], readers: Mapping, kept: set,
               layered: Sequence[int]) -> int:
    """What the layer's stage holds only while it runs, beyond the
    activations it keeps (`memory_bytes` counts those across the step): the
    most bytes alive at once, in program order, of the equations' own
    results that live and die within one unbroken run of them (`peak`),
    less the kept activations among them (`inside`). Then what
    `memory_bytes` holds plus this is that peak, whether or not the kept
    ones are alive at it; a recomputed layer adds its activations back
    beside this, so a recomputed GPT-2 head (forward and backward unbroken,
    its logits kept and inside) needs what a kept one does: its peak. A
    result that outlives the run (an activation its backward reads later,
    an output to the next layer, a gradient for the update, the step's new
    state) is counted elsewhere. `layered[i]`: how many of the first i
    equations belong to a layer (not shared); shared equations (a label's
    index arithmetic) run with whichever stage reads them, so they do not
    break a run. Program order, unfused (XLA's CPU compiler gives GPT-2's
    head 1.23 GB of temporaries, this 1.23 GB), a loop body's temporaries
    not counted."""
    import bisect

    ids = sorted(ids)
    delta = [0] * (len(ids) + 1)
    inside = 0
    for k, i in enumerate(ids):
        for o in eqns[i].outvars:
            if isinstance(o, jcore.DropVar) or not hasattr(o.aval, "shape"):
                continue
            last = readers[o][-1] if o in readers else i
            stop = bisect.bisect_right(ids, last)  # after its last own equation up to `last`
            if last >= len(eqns) or layered[last + 1] - layered[i] != stop - k:
                continue  # read after another layer's equation, or a result
            size = math.prod(o.aval.shape) * o.aval.dtype.itemsize
            inside += size if o in kept else 0
            delta[k] += size
            delta[max(stop, k + 1)] -= size
    return max(_peak(delta) - inside, 0)


def _recompute_fraction(eqns, ids: Sequence[int], producer: Mapping,
                        program_inputs: set) -> float:
    """`LayerInfo.recompute_fraction` of the layer made of equations `ids`.

    The walk of the split pass (`_split.walk_back`) for the layer's
    backward stage with the layer recomputed: back from what its backward
    (and update) equations read, through the layer's own forward equations
    (any, at any depth) and other equations cheap enough to recompute
    (`RECOMPUTABLE`, up to `RECOMPUTE_DEPTH`: a ReLU's backward `select_n`,
    filed under the next layer, leads back to this layer's matmul). What it
    reaches of the layer's forward is recomputed.
    """
    from hetpar.passes._split import walk_back  # _split imports this module

    forward = [i for i in ids if is_forward(str(eqns[i].source_info.name_stack))]
    own = set(forward)
    run = [i for i in ids if i not in own]
    reached = walk_back(eqns, producer, run, program_inputs, lambda i: (i in own) or None)
    total = eqns_work(eqns[i] for i in forward)
    again = eqns_work(eqns[i] for i in reached & own)
    if total.flops > 0:
        return again.flops / total.flops
    if total.bytes_accessed > 0:
        return again.bytes_accessed / total.bytes_accessed
    return 1.0


class LayerGraph:
    """A traced step grouped into layers; see the module docstring.

    Attributes:
      program: the flat traced step.
      eqn_layers: layer name (or SHARED) of every equation.
      input_layers: layer name of every flat input (None when nothing reads it).
      input_roles: "param", "opt_state" or "batch" for every flat input.
      graph: networkx DiGraph, nodes = layers (attribute `info`: LayerInfo),
        edges carry `bytes` and `bytes_backward`.
      depth: module-path depth that named the layers.
    """

    def __init__(
        self,
        program: Program,
        eqn_layers: Sequence[str],
        input_layers: Sequence[str | None],
        input_roles: Sequence[str],
        depth: int,
    ):
        self.program = program
        self.eqn_layers = tuple(eqn_layers)
        self.input_layers = tuple(input_layers)
        self.input_roles = tuple(input_roles)
        self.depth = depth
        self.graph = self._build()

    # -- structure ---------------------------------------------------------

    @property
    def layers(self) -> list[str]:
        """Layer names in program order (shared group excluded)."""
        return list(self.graph.nodes)

    @property
    def notes(self) -> tuple[str, ...]:
        """Why parts of the step that could have been cut per layer stay whole
        (a `cond` over all parameters tied by one tensor, a scanned stack of
        blocks), one line each."""
        return self.program.notes + self._scan_notes()

    def _scan_notes(self) -> tuple[str, ...]:
        notes = []
        for i, e in enumerate(self.program.eqns):
            name = self.eqn_layers[i]
            if e.primitive.name == "scan" and name != SHARED and is_forward(
                    str(e.source_info.name_stack)) and e.params.get("length", 1) > 1:
                notes.append(
                    f"layer {name!r} is a scan over {e.params['length']} iterations: its "
                    "iterations run as one unit on one device (a stack is not cut into "
                    "pieces; unroll it, e.g. a Python loop over blocks, to let the planner "
                    "place blocks apart)")
        return tuple(dict.fromkeys(notes))

    @property
    def shared_eqns(self) -> tuple[int, ...]:
        return tuple(i for i, name in enumerate(self.eqn_layers) if name == SHARED)

    def __getitem__(self, layer: str) -> LayerInfo:
        try:
            return self.graph.nodes[layer]["info"]
        except KeyError:
            raise KeyError(f"no layer {layer!r}; layers are {self.layers}") from None

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

    def __repr__(self) -> str:
        return (f"LayerGraph({len(self)} layers, {self.graph.number_of_edges()} edges, "
                f"{len(self.program.eqns)} equations)")

    def _build(self) -> nx.DiGraph:
        eqns = self.program.jaxpr.jaxpr.eqns
        order, members = self._program_order()
        param_b, opt_b, state_leaves = self._state_bytes(order)
        saved, kept, flow = self._flows(order)
        producer = {o: i for i, e in enumerate(eqns) for o in e.outvars
                    if not isinstance(o, jcore.DropVar)}
        inputs = set(self.program.jaxpr.jaxpr.invars)
        readers = _readers(self.program.jaxpr.jaxpr)
        layered = [0, *itertools.accumulate(name != SHARED for name in self.eqn_layers)]
        updating = updating_eqns(eqns)
        g = nx.DiGraph()
        for name, ids in members.items():
            workspace = _live_peak(eqns, ids, readers, kept, layered)
            g.add_node(name, info=LayerInfo(
                name=name,
                eqns=tuple(ids),
                param_bytes=int(param_b[name]),
                opt_state_bytes=int(opt_b[name]),
                activation_bytes=int(saved[name]),
                work=eqns_work(eqns[i] for i in ids),
                recompute_fraction=_recompute_fraction(eqns, ids, producer, inputs),
                workspace_bytes=workspace,
                # Within what a run holds and all its activations beside it
                # (a bound by construction: microbatches' runs counted as one
                # could pass it).
                remat_workspace_bytes=min(max(workspace, _recomputed_peak(
                    eqns, ids, readers, updating)), workspace + int(saved[name])),
                state_leaves=tuple(state_leaves[name]),
            ))
        for (u, v), (fwd, bwd) in flow.items():
            g.add_edge(u, v, bytes=fwd, bytes_backward=bwd)
        return g

    def _program_order(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """({layer: rank in data-flow order}, {layer: its equations}), layers in that order.

        Layers are ranked by the forward data flow between them (a layer
        comes after the layers whose forward results it reads), ties broken
        by where each layer's forward starts. Program order alone misleads:
        JAX may emit a layer's first equation early (GPT-2's position ids,
        T5's relative-position bias of a decoder block) although its input
        comes later. Cycles (a tied embedding read again by the head) are
        broken at the layer whose forward starts first. With microbatches the
        labels are sliced up front by equations of the loss layer, which must
        not make it "earlier" than the layers before it.
        """
        eqns = self.program.jaxpr.jaxpr.eqns
        first: dict[str, int] = {}
        first_fwd: dict[str, int] = {}
        producer: dict[jcore.Var, str] = {}
        after: dict[str, set[str]] = {}  # layer -> layers whose forward results it reads
        for i, (name, e) in enumerate(zip(self.eqn_layers, eqns)):
            if name == SHARED:
                continue
            first.setdefault(name, i)
            after.setdefault(name, set())
            if is_forward(str(e.source_info.name_stack)):
                first_fwd.setdefault(name, i)
                for a in e.invars:
                    src = producer.get(a) if isinstance(a, jcore.Var) else None
                    if src is not None and src != name:
                        after[name].add(src)
                for o in e.outvars:
                    if not isinstance(o, jcore.DropVar):
                        producer[o] = name
        start = {n: (first_fwd.get(n, first[n]), first[n]) for n in first}
        ranked: list[str] = []
        done: set[str] = set()
        while len(ranked) < len(start):
            waiting = [n for n in start if n not in done]
            ready = [n for n in waiting if after[n] <= done] or waiting
            nxt = min(ready, key=start.__getitem__)
            ranked.append(nxt)
            done.add(nxt)
        order = {name: k for k, name in enumerate(ranked)}
        members: dict[str, list[int]] = {name: [] for name in order}
        for i, name in enumerate(self.eqn_layers):
            if name != SHARED:
                members[name].append(i)
        return order, members

    def _state_bytes(self, order: dict[str, int]) -> tuple[Counter, Counter, dict]:
        """(parameter bytes, optimizer-state bytes, state leaves) of each layer,
        from the step's inputs."""
        param_b: Counter = Counter()
        opt_b: Counter = Counter()
        leaves: dict[str, list] = {name: [] for name in order}
        jaxpr = self.program.jaxpr.jaxpr
        for v, layer, role in zip(jaxpr.invars, self.input_layers, self.input_roles):
            if layer in order and role in (PARAM, OPT_STATE):
                (param_b if role == PARAM else opt_b)[layer] += nbytes(v.aval)
                leaves[layer].append((role, tuple(v.aval.shape), nbytes(v.aval)))
        return param_b, opt_b, leaves

    def _flows(self, order: dict[str, int]
               ) -> tuple[Counter, set, dict[tuple[str, str], list[float]]]:
        """(saved activation bytes per layer, the saved activations,
        {(earlier, later): [forward, backward bytes]}).

        Every tensor a layer reads from another counts once per reader; a
        forward result read by backward code is an activation its producer
        saves.
        """
        jaxpr = self.program.jaxpr.jaxpr
        eqns = jaxpr.eqns
        producer: dict[jcore.Var, int] = {}
        for i, e in enumerate(eqns):
            for o in e.outvars:
                if not isinstance(o, jcore.DropVar):
                    producer[o] = i
        stacks = [str(e.source_info.name_stack) for e in eqns]
        saved: Counter = Counter()
        saved_seen: set = set()
        flow: dict[tuple[str, str], list[float]] = {}
        counted: set = set()
        # A step input lives on its owner layer's device; another layer that
        # reads it (a tied embedding's head, labels for the loss) receives it
        # from there every step, like a produced tensor.
        input_owner = {v: layer for v, layer in zip(jaxpr.invars, self.input_layers)
                       if layer in order}
        for j, e in enumerate(eqns):
            dst = self.eqn_layers[j]
            for a in e.invars:
                if not isinstance(a, jcore.Var):
                    continue
                if a in input_owner:
                    src = input_owner[a]
                elif a in producer:
                    i = producer[a]
                    src = self.eqn_layers[i]
                    # Activations saved for the backward pass: forward results read by
                    # backward code.
                    if is_forward(stacks[i]) and is_backward(stacks[j]) and \
                            a not in saved_seen and src != SHARED:
                        saved_seen.add(a)
                        saved[src] += nbytes(a.aval)
                else:
                    continue
                if src == dst or SHARED in (src, dst) or (a, dst) in counted:
                    continue
                counted.add((a, dst))
                b = nbytes(a.aval)
                if order[src] < order[dst]:
                    flow.setdefault((src, dst), [0.0, 0.0])[0] += b
                else:
                    flow.setdefault((dst, src), [0.0, 0.0])[1] += b
        return saved, saved_seen, flow

    # -- pieces ------------------------------------------------------------

    def update_reads(self) -> dict[str, tuple[str, ...] | str]:
        """{layer: the other layers whose backward its optimizer update reads,
        beyond those its own gradient already waits for (the layers above it,
        through the chain rule)}, for the layers whose update waits for more
        than their own gradient; "all" where that leaves no layer out. Under
        `optax.clip_by_global_norm` every update reads the norm, which every
        gradient makes: the split pass then runs a device's updates once the
        whole backward is done (on an H200 a plan's host CPU ran its 7
        layers' updates as one stage after the backward), and the planner's
        replay waits so too (`CostTable.meta["update_reads"]`). A tied
        embedding's update reads its head's backward alone."""
        eqns = self.program.eqns
        names = self.layers
        bit = {name: 1 << k for k, name in enumerate(names)}
        every = (1 << len(names)) - 1
        made: dict = {}  # var -> bits of the layers whose backward it reads
        own: dict[str, int] = {}  # layer -> what its backward reads (itself included)
        reads_of: dict[str, int] = {}  # layer -> what its update reads
        for i, e in enumerate(eqns):
            reads = 0
            for v in e.invars:
                if isinstance(v, jcore.Var):
                    reads |= made.get(v, 0)
            name = self.eqn_layers[i]
            if name != SHARED:
                stack = str(e.source_info.name_stack)
                if is_backward(stack):
                    reads |= bit[name]
                    own[name] = own.get(name, 0) | reads
                elif not is_forward(stack) and reads:
                    reads_of[name] = reads_of.get(name, 0) | reads
            for v in e.outvars:
                made[v] = reads
        out: dict[str, tuple[str, ...] | str] = {}
        for name, r in reads_of.items():
            mine = own.get(name, 0) | bit[name]
            if r & ~mine:  # beyond what its own gradient waits for
                out[name] = ("all" if (r | mine) == every else
                             tuple(n for n in names if r & ~mine & bit[n]))
        return out

    def layer_jaxpr(self, layer: str) -> tuple[jcore.ClosedJaxpr, list, list]:
        """The layer's equations as their own jaxpr: (closed_jaxpr, inputs, outputs).

        This is the computation the runtime will run for the layer (forward,
        backward and update together); inputs and outputs are variables of
        the whole program.
        """
        return subjaxpr(self.program, self[layer].eqns)

    def layer_callable(self, layer: str) -> tuple[Callable, list[jax.ShapeDtypeStruct]]:
        """(fn, example argument shapes) for compiling or timing one layer alone."""
        closed, inputs, _ = self.layer_jaxpr(layer)
        fn = jcore.jaxpr_as_fun(closed)
        return fn, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs]

    def total_work(self) -> Work:
        total = Work()
        for name in self.layers:
            total.add(self[name].work)
        total.add(eqns_work(self.program.eqns[i] for i in self.shared_eqns))
        return total

    def fingerprint(self) -> str:
        """A stable hash of the layers (in program order), edges and the step's input shapes.

        The same mechanism as `CostTable.fingerprint` (`hetpar.core.fingerprint`),
        over what identifies a traced step rather than a plan's graph: the
        input shapes and dtypes are in (the same model at another batch size
        is another step) and there are no devices yet. `hetpar costs` keeps it
        in graph.json's `meta` (`graph_fingerprint`).
        """
        return fingerprint({
            "layers": self.layers,
            "edges": sorted((u, v) for u, v in self.graph.edges),
            "inputs": [f"{v.aval.dtype}{list(v.aval.shape)}"
                       for v in self.program.jaxpr.jaxpr.invars],
        })

    def to_json(self) -> dict:
        """The layers file form (`hetpar trace --out layers.json`): layers and edges, no devices.

        Not the planner's input: `hetpar costs MODEL --devices LIST --out
        graph.json` adds per-device times, memory, devices and links. Each
        layer carries its FLOPs, bytes and memory parts, so a script can work
        from the file alone::

            {"format": "hetpar.layers", "version": 1,
             "layers": [{"name", "flops", "bytes_accessed", "transcendentals",
                         "param_bytes", "opt_state_bytes", "activation_bytes",
                         "resident_bytes", "recompute_fraction",
                         "workspace_bytes", "remat_workspace_bytes"}, ...],
             "edges": [{"src", "dst", "bytes", "bytes_backward"}, ...],
             "meta": {"fingerprint", "depth"}}
        """
        layers = []
        for name in self.layers:
            info = self[name]
            layers.append({
                "name": name,
                "flops": info.flops,
                "bytes_accessed": info.bytes_accessed,
                "transcendentals": info.transcendentals,
                "param_bytes": info.param_bytes,
                "opt_state_bytes": info.opt_state_bytes,
                "activation_bytes": info.activation_bytes,
                "resident_bytes": info.memory_bytes,
                "recompute_fraction": info.recompute_fraction,
                "workspace_bytes": info.workspace_bytes,
                "remat_workspace_bytes": info.remat_workspace_bytes,
            })
        edges = [
            {"src": u, "dst": v, "bytes": d["bytes"], "bytes_backward": d["bytes_backward"]}
            for u, v, d in self.graph.edges(data=True)
        ]
        return {"format": LAYERS_FORMAT, "version": LAYERS_VERSION,
                "layers": layers, "edges": edges,
                "meta": {"fingerprint": self.fingerprint(), "depth": self.depth}}


def trace(
    step_fn: Callable,
    *example_args,
    depth: int | None = None,
    batch_argnums: Sequence[int] | int | None = None,
    auto_layers: int = 8,
) -> LayerGraph:
    """Traces a training step and groups its equations into layers.

    Args:
      step_fn: the step, e.g. `train_step(params, opt_state, batch)`; forward,
        backward and optimizer update all inside.
      *example_args: arguments with the real shapes and dtypes (arrays or
        `jax.ShapeDtypeStruct`s).
      depth: how many module-path components name a layer (1: the model's
        direct children, e.g. `Block_3` of a transformer). Default: balanced,
        from the model's children down to submodules while a layer holds more
        than half the FLOPs or there are fewer than four (see
        `hetpar.passes.balanced_names`).
      batch_argnums: which positional arguments are data rather than state
        (default: the last one and the arguments just before it that are
        batches of as many rows, `batch_argnums_of`).
      auto_layers: how many balanced layers to form when nothing is named.

    Returns:
      The LayerGraph.

    Raises:
      TraceError: the step does not trace with these arguments.
    """
    depth = None if depth is None else int(depth)
    program = trace_program(step_fn, *example_args)
    flops = [eqn_work(e).flops for e in program.eqns]
    roles = input_roles(program, example_args, batch_argnums)
    eqn_layers, input_layers = assign_layers(program, depth, auto_layers, flops,
                                             [role == PARAM for role in roles])
    return LayerGraph(program, eqn_layers, input_layers, roles, depth)


def batch_argnums_of(args: Sequence) -> tuple[int, ...]:
    """The batch arguments of a step called with `args`, where none are named:
    the last argument and, before it, the run of arguments every leaf of
    which is an array of as many rows as the last one's (`x` of `step(params,
    opt_state, x, y)`). The first argument never is (the parameters),
    unless it is the only one.

    The batch size is the most common leading dimension of the last
    argument's array leaves, PRNG keys left out (a raw key's 2 is no batch).
    """
    n = len(args)
    if n <= 1:
        return tuple(range(n))
    rows = [np.shape(x)[0] for x in jax.tree_util.tree_leaves(args[-1])
            if np.ndim(x) and not _is_key_like(x)]
    found = [n - 1]
    if not rows:
        return tuple(found)
    size = max(set(rows), key=lambda d: (rows.count(d), d))
    for k in range(n - 2, 0, -1):
        leaves = jax.tree_util.tree_leaves(args[k])
        if not leaves or not all(hasattr(x, "shape") and len(x.shape) and x.shape[0] == size
                                 and not _is_key_like(x) for x in leaves):
            break
        found.insert(0, k)
    return tuple(found)


def _is_key_like(x) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == np.uint32 and tuple(np.shape(x)) == (2,)


def input_roles(program: Program, args: Sequence, batch_argnums) -> list[str]:
    """Role of every flat input: batch data, parameter (the forward reads it) or optimizer state."""
    n = len(args)
    if batch_argnums is None:
        batch = set(batch_argnums_of(args)) if n > 1 else set()
    else:
        batch = {batch_argnums} if isinstance(batch_argnums, int) else set(batch_argnums)
        batch = {b % n for b in batch}
    # The program's inputs are the traced leaves only: static ones (an
    # Equinox model's activation function) are closed over.
    static = set(static_where(args))
    arg_of: list[int] = []
    flat = 0
    for k, a in enumerate(args):
        for _ in jax.tree_util.tree_leaves(a):
            if flat not in static:
                arg_of.append(k)
            flat += 1
    read_forward: set = set()
    for e in program.eqns:
        if is_forward(str(e.source_info.name_stack)):
            read_forward.update(a for a in e.invars if isinstance(a, jcore.Var))
    no_jvp = not read_forward
    roles = []
    for v, k in zip(program.jaxpr.jaxpr.invars, arg_of):
        if k in batch:
            roles.append(BATCH)
        elif no_jvp or v in read_forward:
            roles.append(PARAM)
        else:
            roles.append(OPT_STATE)
    return roles
