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
   the producers of their inputs. They carry activations, so they must not
   form a group of their own that would force extra transfers.
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

When nothing is named (plain JAX), the forward equations are clustered into
contiguous layers of balanced FLOPs, cut after heavy (dot/conv) equations,
and rules 2-5 place the rest.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from jax.extend import core as jcore

from hetpar.passes._program import Program

SHARED = "shared"
#: Name scope `hetpar.value_and_grad` puts around microbatch i: `hetpar_mb<i>`.
MICROBATCH_SCOPE = "hetpar_mb"
_MICROBATCH = re.compile(rf"^{MICROBATCH_SCOPE}(\d+)$")

_WRAPPER = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
_HEAVY = frozenset({"dot_general", "conv_general_dilated"})


def module_path(name_stack: str) -> tuple[str, ...]:
    """Module path of a name stack: transform wrappers stripped, empty parts dropped.

    >>> module_path("transpose(jvp(ResNet))/layer1/Conv_0")
    ('ResNet', 'layer1', 'Conv_0')
    """
    parts = []
    for part in str(name_stack).split("/"):
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if _MICROBATCH.match(part):
            continue  # microbatch scopes say when, not which layer
        # Rematerialised regions repeat the scope they were traced in
        # (`transpose(jvp(M))/jvp(M)`): collapse the repeat.
        if part and (not parts or parts[-1] != part):
            parts.append(part)
    return tuple(parts)


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


def _strip_root(paths: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Drops the root module (Flax's model class) shared by the named paths.

    A few equations may carry a stack that does not start at the root (Flax's
    lifted `scan` names its body `Cell_0.scan_fn/...`); they are treated as
    unnamed and placed by data flow.
    """
    named = [p for p in paths if p]
    if not named:
        return list(paths)
    root, count = Counter(p[0] for p in named).most_common(1)[0]
    if count < 0.9 * len(named) or not any(len(p) > 1 and p[0] == root for p in named):
        return list(paths)
    return [p[1:] if p and p[0] == root else () for p in paths]


def _is_scalar(v) -> bool:
    return isinstance(v, jcore.Var) and getattr(v.aval, "shape", None) == ()


def _size(v) -> int:
    shape = getattr(getattr(v, "aval", None), "shape", None)
    return math.prod(shape) if shape is not None else 1


def is_tiny(v) -> bool:
    """A value of one element (a scalar, or a `[1]` array): free to move or recompute.

    "Tiny" is a size, not a role: a one-element value costs one transfer's
    latency and a few bytes wherever it goes, so it never decides where a
    layer's parameters or optimizer state live (docs/architecture.md, "Layers").
    """
    return _size(v) == 1


#: The most elements a stack of tiny values (`jnp.array([flag, ...])`) may have and
#: still count as tiny partial results.
TINY_STACK_MAX = 4096


def _stacks_tiny(eqn, light: set) -> bool:
    """Whether `eqn` only gathers tiny values: all its inputs are tiny (or such
    gathers) and no result is bigger than its inputs together (`concatenate` of
    per-leaf flags, a `reduce_and` over them; not a broadcast to a leaf's shape)."""
    ins = [a for a in eqn.invars if isinstance(a, jcore.Var)]
    if not ins or not all(a in light or is_tiny(a) for a in ins):
        return False
    size_in = sum(_size(a) for a in ins)
    return all(_size(o) <= min(size_in, TINY_STACK_MAX) for o in eqn.outvars)


def assign_layers(
    program: Program, depth: int = 1, auto_layers: int = 8, flops: Sequence[float] | None = None
) -> tuple[list[str], list[str | None]]:
    """Assigns every equation to a layer (or to `SHARED`).

    Args:
      program: the flat traced step.
      depth: how many module-path components name a layer (1: the model's
        direct children).
      auto_layers: how many layers to form when nothing is named.
      flops: per-equation FLOPs, used to balance automatic clusters.

    Returns:
      (eqn_layers, input_layers): one layer name (or "shared") per equation,
      and one layer name (or None, when nothing reads it) per flat input.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    jaxpr = program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    stacks = [str(e.source_info.name_stack) for e in eqns]
    paths = _strip_root([module_path(s) for s in stacks])
    layer: list[str | None] = ["/".join(p[:depth]) or None for p in paths]  # rule 1
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
