"""Which layer every equation of a traced step belongs to.

A layer is a set of equations: its forward, its backward and its parameter
update, all placed on one device (DESIGN, "Layers"). The rules, in order:

1. Named equations: Flax (and `hetpar.layer` / `jax.named_scope`) put module
   paths in each equation's name stack: forward `jvp(Model)/Dense_0`,
   backward `transpose(jvp(Model))/Dense_0`. Stripping the transform
   wrappers gives the module path; its first `depth` components name the layer.
2. Program inputs (parameters, optimizer state, batch) take the layer of
   their first named consumer; inputs nothing named reads (optimizer state),
   that of their first consumer. A tiny one (one element) that several
   layers read is shared.
3. Unnamed equations (optimizer updates, glue between modules, the loss) join
   the layer of their producer: the most recent layer, in layer order, among
   the producers of their inputs (in the backward, for leaf glue, the
   earliest that has a backward of its own, so glue's gradient joins the
   layer its forward joined). They carry activations, so
   they must not form a group of their own that would force extra transfers.
4. Tiny unnamed scalar equations that read no layer's data (the step counter,
   Adam's bias-correction powers) form the explicit "shared" group: the
   runtime recomputes them wherever they are needed.
   Tiny combines join it too (checked before rule 3): an unnamed equation
   that reads only tiny values (one element each: a per-leaf partial norm,
   a per-leaf all-finite flag) or earlier combines' results, whose inputs
   come from two or more layers, and whose results are no bigger than its
   inputs (the sum of partial norms, its sqrt, the stack of flags, the
   clip/finite decision). A global reduction across all parameters
   (`clip_by_global_norm`, `apply_if_finite`) thus splits into per-layer
   partial results (rule 3: they read one layer's gradient) and a shared
   combine; the per-leaf scaling that reads the combined scalar joins its
   leaf's layer by rule 3, since shared producers never pull.
5. What is left joins the layer of its first consumer; failing that, its
   program-order predecessor's layer.
6. A parameter's unnamed gradient and update join the parameter's layer
   (`_parameter_updates`); rules 3-5 then place the rest again around them.

When nothing is named (plain JAX, Flax NNX; `jnp.einsum`'s subscripts name
nothing), equations are named by the parameters they read (`owner_paths`);
when those carry no names either, the forward equations are clustered into
contiguous layers of balanced FLOPs, cut after heavy (dot/conv) equations,
and rules 2-6 place the rest.

Naming by key path (`owner_paths`, Equinox's instances `split_instances`,
the granularity `balanced_names`) lives in `_layer_names`; what counts as
tiny (`is_tiny`) in `_tiny`. This module holds the rules that use them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from jax.extend import core as jcore

from hetpar.passes._layer_names import (
    _common_prefix,
    balanced_names,
    owner_paths,
    split_instances,
)
from hetpar.passes._program import Program
from hetpar.passes._tiny import _stacks_tiny, is_tiny

#: The shared group's name: not a module name, so a model's own `shared` module
#: (T5's embedding) stays a layer.
SHARED = "<shared>"
#: Name scope `hetpar.value_and_grad` puts around microbatch i: `hetpar_mb<i>`.
MICROBATCH_SCOPE = "hetpar_mb"
_MICROBATCH = re.compile(rf"^{MICROBATCH_SCOPE}(\d+)$")

_WRAPPER = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
_HEAVY = frozenset({"dot_general", "conv_general_dilated"})


#: Scopes JAX itself adds, which name no module: `jax.checkpoint` wraps the
#: recomputed forward of a rematerialised region in `rematted_computation`.
_JAX_SCOPES = frozenset({"rematted_computation"})
#: `jnp.einsum` names its call after its subscripts (`jax.named_call(...,
#: name=spec)`): `BTNH,BSNH->BNTS` inside `jax.nn.dot_product_attention`
#: names an operation, not a module, so it names no layer.
_EINSUM = re.compile(r"^[A-Za-z. ]*(,[A-Za-z. ]*)*->[A-Za-z. ]*$|^[A-Za-z. ]*(,[A-Za-z. ]*)+$")


def module_path(name_stack: str) -> tuple[str, ...]:
    """Module path of a name stack: transform wrappers stripped, empty parts dropped.

    >>> module_path("transpose(jvp(ResNet))/layer1/Conv_0")
    ('ResNet', 'layer1', 'Conv_0')
    >>> module_path("transpose(jvp(M))/enc/layer/jvp(M)/enc/layer")
    ('M', 'enc', 'layer')
    """
    parts: list[str] = []
    for part in str(name_stack).split("/"):
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if _MICROBATCH.match(part) or part in _JAX_SCOPES or _EINSUM.match(part):
            continue  # microbatch scopes say when, not which layer
        # Rematerialised regions repeat the scope they were traced in
        # (`transpose(jvp(M))/jvp(M)`): collapse the repeat.
        if part and (not parts or parts[-1] != part):
            parts.append(part)
    return _collapse_repeat(tuple(parts))


def _collapse_repeat(parts: tuple[str, ...]) -> tuple[str, ...]:
    """`A + A` -> `A`: the transpose of a rematerialised module carries the
    module's path twice (`transpose(jvp(M))/bert/layer/jvp(M)/bert/layer`)."""
    n = len(parts)
    for k in range(1, n // 2 + 1):
        if parts[k] == parts[0] and parts[k:2 * k] == parts[:k] and n - k >= k:
            return _collapse_repeat(parts[k:])
    return parts


def _subjaxprs(eqn):
    """The jaxprs a higher-order equation runs (a scan's body, a remat's region,
    a cond's branches), as plain Jaxprs."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jcore.Jaxpr):
                yield item


def eqn_path(eqn) -> tuple[str, ...]:
    """Module path of an equation. A higher-order equation (scan, remat, a
    custom-gradient call) carries only its caller's scope; the modules it
    runs are named inside its body, relative to that scope. Its path is the
    caller's plus what all named body equations share: a scan over
    `ScanBlock_0` belongs to `ScanBlock_0`, the backward of a checkpointed
    `layer/3` to `layer/3`, forward and backward alike."""
    outer = module_path(str(eqn.source_info.name_stack))
    inner = [p for sub in _subjaxprs(eqn) for e in sub.eqns if (p := eqn_path(e))]
    return _collapse_repeat(outer + _common_prefix(inner)) if inner else outer


def microbatch_of(name_stack: str) -> int | None:
    """The microbatch an equation belongs to (`hetpar_mb<i>` in its stack), or None."""
    for part in str(name_stack).split("/"):
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if (m := _MICROBATCH.match(part)) is not None:
            return int(m.group(1))
    return None


def is_backward(name_stack: str) -> bool:
    return "transpose(" in str(name_stack)


def is_forward(name_stack: str) -> bool:
    s = str(name_stack)
    return "jvp(" in s and "transpose(" not in s


def updating_eqns(eqns) -> list[bool]:
    """Per equation: whether it is update work (neither forward nor backward,
    after the backward began: the optimizer, gradient accumulation)."""
    stacks = [str(e.source_info.name_stack) for e in eqns]
    first_bwd = next((i for i, s in enumerate(stacks) if is_backward(s)), len(eqns))
    return [i > first_bwd and not is_forward(s) and not is_backward(s)
            for i, s in enumerate(stacks)]


def _strip_root(paths: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Drops the root module (Flax's model class) shared by the named paths.

    A few equations may carry a stack that does not start at the root (Flax's
    lifted `scan` names its body `Cell_0.scan_fn/...`); they are treated as
    unnamed and placed by data flow.
    """
    named = [p for p in paths if p]
    if not named:
        return list(paths)
    root = Counter(p[0] for p in named).most_common(1)[0][0]
    # Loop-invariant work JAX hoists out of a scan keeps the body's relative
    # stack (`blocks/LayerNorm_0`, no root): it belongs under the root.
    children = {p[1] for p in named if len(p) > 1 and p[0] == root}
    paths = [(root, *p) if p and p[0] != root and p[0] in children else p for p in paths]
    named = [p for p in paths if p]
    count = sum(1 for p in named if p[0] == root)
    if count < 0.9 * len(named) or not any(len(p) > 1 and p[0] == root for p in named):
        return list(paths)
    return [p[1:] if p and p[0] == root else () for p in paths]


def _merge_methods(paths: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """`decoder.bias` -> `decoder` where `decoder` is also a scope: Flax names a
    call of a module's method other than `__call__` `module.method`, but it
    runs in that module (Equinox's `eqx.nn.Linear` has no `eqx` beside it)."""
    scopes = {p[:k + 1] for p in paths for k in range(len(p))}

    def merged(p: tuple[str, ...]) -> tuple[str, ...]:
        out = list(p)
        for k, part in enumerate(p):
            base = part.split(".", 1)[0]
            if base != part and p[:k] + (base,) in scopes:
                out[k] = base
        return tuple(out)

    return [merged(p) for p in paths]


def _is_scalar(v) -> bool:
    return isinstance(v, jcore.Var) and getattr(v.aval, "shape", None) == ()


def assign_layers(
    program: Program, depth: int | None = None, auto_layers: int = 8,
    flops: Sequence[float] | None = None, params: Sequence[bool] | None = None
) -> tuple[list[str], list[str | None]]:
    """Assigns every equation to a layer (or to `SHARED`).

    Args:
      program: the flat traced step.
      depth: how many module-path components name a layer (1: the model's
        direct children); None: balanced (see `balanced_names`).
      auto_layers: how many layers to form when nothing is named.
      flops: per-equation FLOPs, used to balance automatic clusters.
      params: per flat input, whether it is a parameter (the forward reads
        it and it is not batch data); None: no input is.

    Returns:
      (eqn_layers, input_layers): one layer name (or SHARED) per equation,
      and one layer name (or None, when nothing reads it) per flat input.
    """
    if depth is not None and depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    jaxpr = program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    stacks = [str(e.source_info.name_stack) for e in eqns]
    paths = _strip_root(_merge_methods([eqn_path(e) for e in eqns]))
    paths = split_instances(eqns, paths, jaxpr.invars, program.in_paths,
                            program.in_types)
    param_vars = {v for v, p in zip(jaxpr.invars, params or ()) if p and not is_tiny(v)}
    if not any(paths):
        paths = owner_paths(eqns, jaxpr.invars, program.in_paths, param_vars)
    if depth is None:
        weights = [float(f) for f in flops] if flops is not None else [1.0] * len(eqns)
        inputs = set(jaxpr.invars)
        holds = [any(isinstance(a, jcore.Var) and a in inputs and not is_tiny(a)
                     for a in e.invars) for e in eqns]
        layer: list[str | None] = balanced_names(paths, weights, holds)  # rule 1
    else:
        layer = ["/".join(p[:depth]) or None for p in paths]  # rule 1
    if not any(layer):
        layer = _auto_cluster(eqns, stacks, auto_layers, flops)

    first_named_consumer: dict[jcore.Var, str] = {}
    for i, e in enumerate(eqns):
        if layer[i] is not None:
            for a in e.invars:
                if isinstance(a, jcore.Var):
                    first_named_consumer.setdefault(a, layer[i])
    consumers: dict[jcore.Var, list[int]] = {}
    for i, e in enumerate(eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                consumers.setdefault(a, []).append(i)
    named = list(layer)
    _place_unnamed(eqns, layer, consumers)
    seeds = _parameter_updates(eqns, layer, named, param_vars, first_named_consumer, consumers)
    if seeds:  # rule 6 decided: place the rest again around it
        layer = list(named)
        for i, name in seeds.items():
            layer[i] = name
        _place_unnamed(eqns, layer, consumers)

    # Rule 2. Inputs nothing named reads (optimizer state): the layer of their first
    # consumer. A tiny one read by several layers (a step count that every
    # per-layer part of an optimizer `cond` recomputes from) is shared.
    input_layers: list[str | None] = []
    for v in jaxpr.invars:
        owner = first_named_consumer.get(v)
        if owner is None:
            owners = [layer[j] for j in consumers.get(v, []) if layer[j] != SHARED]
            if is_tiny(v) and len(set(owners)) > 1:
                owners = []
            owner = owners[0] if owners else (SHARED if consumers.get(v) else None)
        input_layers.append(owner)
    return layer, input_layers  # type: ignore[return-value]


def _place_unnamed(eqns, layer: list[str | None], consumers: dict[jcore.Var, list[int]]) -> None:
    """Rules 3 to 5: gives every unnamed equation a layer (or `SHARED`), in place."""
    order: dict[str, int] = {}
    for name in layer:
        if name is not None and name not in order:
            order[name] = len(order)
    # Step inputs are not produced by any layer: an unnamed equation that reads
    # only inputs (labels sliced from the batch) waits for its first consumer
    # (rule 5) instead of joining the first layer that happened to read the
    # same input. Before, GPT-2's loss scattered a [batch, seq, vocab]
    # gradient inside `wte`, because `wte` reads the tokens the labels come
    # from: an 817 MB edge that was never the model's.
    producer: dict[jcore.Var, str] = {}  # var -> layer (or SHARED) that defines it
    # Results of tiny combines (rule 4) -> the layers whose data they combine.
    combined: dict[jcore.Var, frozenset[str]] = {}
    # Tiny values and gathers of them: the partial results a combine may read.
    light: set[jcore.Var] = set()
    for e in eqns:
        stack = _stacks_tiny(e, light)
        light.update(o for o in e.outvars
                     if not isinstance(o, jcore.DropVar) and (stack or is_tiny(o)))

    def define(i: int) -> None:
        for o in eqns[i].outvars:
            if not isinstance(o, jcore.DropVar):
                producer[o] = layer[i]

    # Layers with a backward of their own (named backward equations): where
    # the gradient of glue may go. A layer without one (a tokenizer, a mask
    # builder) would gain a backward stage and send the gradient forward.
    backward = {layer[i] for i, e in enumerate(eqns)
                if layer[i] is not None and is_backward(str(e.source_info.name_stack))}

    pending: list[int] = []
    for i, e in enumerate(eqns):
        if layer[i] is None:
            srcs = [producer.get(a) for a in e.invars if isinstance(a, jcore.Var)]
            layered = [s for s in srcs if s is not None and s != SHARED]
            origins = _combine_origins(e, producer, combined, light)
            if origins is not None:  # rule 4: a tiny combine across layers
                layer[i] = SHARED
                combined.update((o, origins) for o in e.outvars
                                if not isinstance(o, jcore.DropVar))
            elif layered:  # rule 3
                # The backward mirrors the forward: glue between two layers
                # joined the earlier one (its producer), so its gradient,
                # reading the later layer's cotangent and the earlier one's
                # saved input, joins the earlier one too. Else a max-pool
                # between a stem and a block sends its 4x larger input
                # forward and its gradient back across that cut. Only leaf
                # glue: a region (a remat's whole backward at a split scope)
                # keeps the latest layer.
                # And only when no named reader of its results, through
                # unnamed ones, is a later layer: glue reading several layers
                # (a gate written in the parent) would send a gradient forward
                # during the backward.
                earlier = [s for s in layered if s in backward]
                first = min(earlier, key=order.__getitem__) if earlier else None
                if first is not None and is_backward(str(e.source_info.name_stack)) and next(
                        _subjaxprs(e), None) is None:
                    readers = _named_readers(eqns, i, layer, consumers)
                    if readers is not None and all(order.get(r, -1) <= order[first]
                                                   for r in readers):
                        layer[i] = first
                        define(i)
                        continue
                layer[i] = max(layered, key=order.__getitem__)
            elif all(_is_scalar(o) for o in e.outvars) and all(
                s is None or s == SHARED for s in srcs
            ) and all(_is_scalar(a) or not isinstance(a, jcore.Var) for a in e.invars):
                layer[i] = SHARED  # rule 4
            else:
                pending.append(i)
                continue
        define(i)

    # Rule 5: first consumer, walking backwards so chains of pending equations resolve.
    for i in reversed(pending):
        found = None
        for o in eqns[i].outvars:
            for j in consumers.get(o, []):
                if layer[j] is not None and layer[j] != SHARED:
                    found = layer[j] if found is None else min(found, layer[j], key=order.get)
        if found is None:
            prev = [layer[j] for j in range(i - 1, -1, -1) if layer[j] not in (None, SHARED)]
            found = prev[0] if prev else (next(iter(order)) if order else "layer_0")
            order.setdefault(found, len(order))
        layer[i] = found
        define(i)


#: How far `_follow_parameters` walks an update before it gives up.
UPDATE_WALK = 256


def _parameter_updates(eqns, layer: Sequence[str | None], named: Sequence[str | None],
                       params: set, first_named_consumer: dict, consumers: dict
                       ) -> dict[int, str]:
    """Rule 6: {unnamed equation: layer} for a parameter's gradient and update
    placed away from the parameter's layer (`layer`: rules 1-5's placement).

    Data flow alone (rule 3) puts a parameter's update where its gradient is
    computed. That is the parameter's own layer when a named module reads
    it, but not when unnamed code does: the gradient of a bare learned array
    (`x + pos`) is the sum of a later layer's cotangent, so the sum, the
    Adam update and the state it reads went there while the array stayed
    where its forward ran. And an update that reads the parameter itself
    (Adafactor's parameter scale, `rms(p)`) read no layer's data, so it
    followed its consumers or program order, into a neighbouring layer that
    then received the whole parameter every step.

    So an unnamed equation of the optimizer (neither forward nor backward),
    or an unnamed backward equation whose results only the optimizer reads
    (a parameter's gradient), whose results lead (through the optimizer's
    equations, following values of more than one element) to the update of
    exactly one parameter, or which reads one itself, joins that parameter's
    layer (rule 2's: its first named consumer's, else its first consumer's).
    Tiny values are not followed: a global norm's partial sums stay where
    they are (rule 4 combines them). Rules 3-5 then place the rest again
    around these equations, so what reads their results follows them.
    """
    if not params:
        return {}
    stacks = [str(e.source_info.name_stack) for e in eqns]
    optimizer = [not is_forward(st) and not is_backward(st) for st in stacks]

    def owner_of(v) -> str | None:
        owner = first_named_consumer.get(v)
        if owner is None:
            owner = next((layer[j] for j in consumers.get(v, ())
                          if layer[j] not in (None, SHARED)), None)
        return owner

    owners = {v: o for v in params if (o := owner_of(v)) is not None}

    def big_outs(i):
        return [o for o in eqns[i].outvars if not isinstance(o, jcore.DropVar) and not is_tiny(o)]

    seeds: dict[int, str] = {}
    for i, e in enumerate(eqns):
        if named[i] is not None or layer[i] in (None, SHARED):
            continue
        if not optimizer[i]:
            if not is_backward(stacks[i]) or next(_subjaxprs(e), None) is not None:
                continue
            outs = big_outs(i)
            if not outs or not all(optimizer[j] for o in outs for j in consumers.get(o, ())):
                continue
        found: set = set()
        frontier, seen = [i], {i}
        while frontier and len(seen) <= UPDATE_WALK:
            j = frontier.pop()
            found.update(a for a in eqns[j].invars if isinstance(a, jcore.Var) and a in owners)
            for o in big_outs(j):
                for c in consumers.get(o, ()):
                    if c not in seen and optimizer[c]:
                        seen.add(c)
                        frontier.append(c)
        if len(found) == 1 and len(seen) <= UPDATE_WALK:
            seeds[i] = owners[found.pop()]
    # All of them, where one moves: placed again, the others must not move away.
    return seeds if any(layer[i] != name for i, name in seeds.items()) else {}


def _named_readers(eqns, i: int, layer: list[str | None], consumers: dict,
                   limit: int = 256) -> list[str] | None:
    """The layers of the named equations that read equation i's results,
    directly or through unnamed ones (not yet placed); None past `limit`
    equations, when it is not worth knowing."""
    out: list[str] = []
    frontier, visited = [i], {i}
    while frontier:
        for o in eqns[frontier.pop()].outvars:
            if isinstance(o, jcore.DropVar):
                continue
            for j in consumers.get(o, ()):
                if j in visited:
                    continue
                visited.add(j)
                if len(visited) > limit:
                    return None
                if layer[j] is None:
                    frontier.append(j)
                elif layer[j] != SHARED:
                    out.append(layer[j])
    return out


def _combine_origins(eqn, producer: dict, combined: dict, light: set) -> frozenset[str] | None:
    """The layers a tiny combine reads from, or None when `eqn` is not one (rule 4).

    A tiny combine gathers tiny values (or earlier combines' results, or
    stacks of tiny values) from two or more layers and returns nothing
    bigger than it reads: a norm broadcast to a leaf's shape belongs to that
    leaf's layer.
    """
    if not _stacks_tiny(eqn, light):
        return None
    origins: set[str] = set()
    for a in eqn.invars:
        if not isinstance(a, jcore.Var):
            continue
        if a in combined:
            origins |= combined[a]
        elif producer.get(a) not in (None, SHARED):
            origins.add(producer[a])
    return frozenset(origins) if len(origins) >= 2 else None


def _auto_cluster(eqns, stacks, k: int, flops) -> list[str | None]:
    """Contiguous clusters of balanced FLOPs, forward and (mirrored) backward.

    The forward equations are cut into `k` contiguous clusters of similar
    FLOPs, each cut right after a heavy (dot/conv) equation. JAX emits the
    backward in reverse order, so the backward equations are cut at the
    mirrored FLOP fractions and named in reverse: a cluster's forward and
    backward then mostly share a layer. Without names this is a heuristic;
    the split program stays correct whatever it decides.
    """
    weight = [float(flops[i]) if flops is not None else 1.0 for i in range(len(eqns))]
    fwd = [i for i, s in enumerate(stacks) if is_forward(s)]
    bwd = [i for i, s in enumerate(stacks) if is_backward(s)]
    if not fwd:  # a forward-only function: cluster everything
        fwd, bwd = list(range(len(eqns))), []
    layer: list[str | None] = [None] * len(eqns)
    if not fwd:
        return layer
    total = sum(weight[i] for i in fwd) or 1.0
    heavy = sum(1 for i in fwd if eqns[i].primitive.name in _HEAVY)
    k = max(1, min(k, heavy or len(fwd)))
    cluster, acc, cuts = 0, 0.0, []
    for i in fwd:
        # Clusters start at a heavy equation; cut where the running sum lands
        # closest to the next balanced target.
        target = total * (cluster + 1) / k
        cut_ok = heavy == 0 or eqns[i].primitive.name in _HEAVY
        if cut_ok and cluster < k - 1 and acc > 0 and abs(acc - target) <= abs(
            acc + weight[i] - target
        ):
            cluster += 1
            cuts.append(acc / total)
        layer[i] = f"layer_{cluster}"
        acc += weight[i]
    btotal = sum(weight[i] for i in bwd) or 1.0
    acc = 0.0
    for i in bwd:
        passed = sum(1 for c in cuts if acc / btotal >= 1.0 - c)
        layer[i] = f"layer_{len(cuts) - passed}"
        acc += weight[i]
    return layer


def layer(name: str):
    """Names a layer in plain JAX or Flax NNX code (a `jax.named_scope`).

    Example:
      >>> with hetpar.layer("encoder"):
      ...     h = jnp.tanh(x @ w)
    """
    import jax

    return jax.named_scope(name)
