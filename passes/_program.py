"""A traced step as one flat jaxpr: what every other pass walks.

`jax.make_jaxpr` leaves nested `jit` equations in a training step (Optax's
update functions, Flax helpers, user-jitted functions). Those calls carry no
control flow, so hetpar inlines them: afterwards each top-level equation is
one unit of placement, and its name stack is absolute (the nested jaxpr's
relative stack is appended to the caller's).

Control flow (`scan`, `while`, `cond`), `custom_jvp`/`custom_vjp` calls,
`remat` and custom calls are never opened: they stay whole as one equation,
so no later pass can split them (docs/architecture/layers.md, "Layers"). One
exception: a top-level `cond` without effects whose results fall into
independent groups (Optax's `apply_if_finite` and `MultiSteps` write the
whole optimizer update as one `cond`) is cut into one `cond` per group and
phase, on the same index (`split_conds`). Each part is still a whole
`cond`; a `cond` whose results all depend on one tensor stays whole, and
`Program.notes` says why.

Leaves of the arguments and result that are not arrays (an Equinox model's
activation function, a `custom_jvp` such as `jax.nn.relu`, a string) are
static, as under `eqx.filter_jit`: `StaticLeaves` closes over them when the
step is traced and puts the result's back afterwards, so the jaxpr sees
arrays only. Python numbers are traced, as `jax.jit` traces them, except
inside an Equinox module or beside such static leaves (`static_where`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

# Nested calls that are plain function calls: safe to inline.
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})


# Leaves traced as arrays. Python numbers too: jax.jit traces them as weakly
# typed arrays, and hetpar keeps that (eqx.filter_jit would hold them static).
_TRACED = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, jax.core.Tracer,
           bool, int, float, complex)


def is_traced(leaf) -> bool:
    """Whether a pytree leaf is traced (an array, array-like or Python number), not static."""
    return isinstance(leaf, _TRACED) or hasattr(leaf, "__jax_array__")


_NUMBERS = (bool, int, float, complex)


def static_where(parts: Sequence) -> tuple[int, ...]:
    """Flat positions of the static leaves of `parts` (a step's arguments, or
    its result's elements), counted across all of them.

    A leaf that is not traced (`is_traced`) is static. So is a Python number
    inside a part that holds such leaves: an Equinox module's fields
    (`MaxPool2d`'s `-inf` init, a dropout rate) are static under
    `eqx.filter_jit`, and `lax.reduce_window` cannot differentiate through a
    traced init value; so is one inside an Equinox module (`_in_equinox_module`).
    A Python number passed on its own (a learning rate), or in a plain
    container or a Flax `TrainState` (its `step`), stays traced, as under
    jax.jit.
    """
    where, offset = [], 0
    for part in parts:
        leaves = jax.tree_util.tree_leaves(part)
        filtered = any(not is_traced(x) for x in leaves)
        modular = _in_equinox_module(part) if not filtered else None
        where.extend(offset + k for k, x in enumerate(leaves)
                     if not is_traced(x) or (isinstance(x, _NUMBERS) and (
                         filtered or (modular is not None and k in modular))))
        offset += len(leaves)
    return tuple(where)


def _in_equinox_module(part) -> set[int] | None:
    """Flat positions of the leaves of `part` inside an Equinox module, or None
    when there are none. An Equinox module's Python numbers and bools (a
    dropout's `inference` flag, which its `__call__` branches on) are static
    under `eqx.filter_jit` whether or not the module also holds a function."""
    eqx = sys.modules.get("equinox")  # not imported: no Equinox module can be here
    if eqx is None:
        return None
    pieces = jax.tree_util.tree_leaves(part, is_leaf=lambda x: isinstance(x, eqx.Module))
    if not any(isinstance(x, eqx.Module) for x in pieces):
        return None
    inside, k = set(), 0
    for piece in pieces:
        n = len(jax.tree_util.tree_leaves(piece)) if isinstance(piece, eqx.Module) else 1
        if isinstance(piece, eqx.Module):
            inside.update(range(k, k + n))
        k += n
    return inside


class StaticLeaves:
    """A step with the non-array leaves of its arguments and result held static.

    What `eqx.filter_jit` does with a model passed as an argument: a leaf
    that is not traced (`is_traced`: an activation function, a `custom_jvp`
    such as `jax.nn.relu`, a string) is closed over when the step is traced,
    not passed in. `pure_step` takes the arguments with those leaves replaced
    by None (empty subtrees: `pure_args`, `strip`) and returns the result
    likewise; `result` puts the result's static leaves back as the first
    trace produced them (the activation of the model `eqx.apply_updates`
    returns). `flat_step` is the same on flat lists of the traced leaves
    (`dynamic`, `result_of`): what a jit called on every step takes, so the
    caller's trees (Equinox modules flatten in Python) are flattened once a
    call. Who keys compiled steps compares the static leaves with
    `StaticKey` (`matches`).

    Args:
      fn: the step.
      args: its example arguments.
    """

    def __init__(self, fn: Callable, args: tuple):
        leaves, self._in_tree = jax.tree_util.tree_flatten(args)
        self._in_where = static_where(args)
        self._in_values = tuple(leaves[i] for i in self._in_where)
        static = set(self._in_where)
        self._in_traced = tuple(i for i in range(len(leaves)) if i not in static)
        self.pure_args = self.strip(args)
        # (structure, static positions, their values) of the first traced result.
        self._out: tuple | None = None

        @functools.wraps(fn)
        def pure_step(*pure_args):
            leaves = self._in_tree.flatten_up_to(pure_args)
            for i, v in zip(self._in_where, self._in_values):
                leaves[i] = v
            out = fn(*jax.tree_util.tree_unflatten(self._in_tree, leaves))
            leaves, tree = jax.tree_util.tree_flatten(out)
            where = static_where(out if isinstance(out, (tuple, list)) else (out,))
            if self._out is None:
                self._out = (tree, where, tuple(leaves[i] for i in where))
            for i in where:
                leaves[i] = None
            return jax.tree_util.tree_unflatten(tree, leaves)

        self.pure_step = pure_step
        pure_tree = jax.tree_util.tree_structure(self.pure_args)

        @functools.wraps(fn)
        def flat_step(*traced):
            return jax.tree_util.tree_leaves(pure_step(*pure_tree.unflatten(traced)))

        self.flat_step = flat_step

    @property
    def in_tree(self):
        """The structure of the example arguments, static leaves included."""
        return self._in_tree

    def matches(self, leaves: Sequence) -> bool:
        """Whether flat leaves of arguments structured as the example's hold its
        static leaves (the same objects, or equal as `StaticKey` compares)."""
        for i, v in zip(self._in_where, self._in_values):
            x = leaves[i]
            if x is not v and StaticKey(x) != StaticKey(v):
                return False
        return True

    def dynamic(self, leaves: Sequence) -> list:
        """The traced leaves among flat leaves of arguments structured as the example's."""
        return [leaves[i] for i in self._in_traced]

    def result_of(self, traced_out: Sequence):
        """The result from `flat_step`'s: the static leaves of the traced result put back."""
        if self._out is None:
            raise RuntimeError("result_of before the step was traced")
        tree, where, values = self._out
        leaves = list(traced_out)
        for i, v in zip(where, values):  # ascending: each lands at its own position
            leaves.insert(i, v)
        return jax.tree_util.tree_unflatten(tree, leaves)

    @property
    def in_args(self) -> bool:
        """Whether the arguments have static leaves."""
        return bool(self._in_where)

    @property
    def any(self) -> bool:
        """Whether the arguments or the (traced) result have static leaves."""
        return bool(self._in_where or (self._out is not None and self._out[1]))

    def strip(self, args: tuple) -> tuple:
        """`args` (structured as the example's) with the static leaves replaced by None."""
        if not self._in_where:
            return args
        leaves = self._in_tree.flatten_up_to(args)
        for i in self._in_where:
            leaves[i] = None
        return jax.tree_util.tree_unflatten(self._in_tree, leaves)

    def result(self, pure_out):
        """`pure_step`'s result with the static leaves of the traced result put back."""
        if self._out is None or not self._out[1]:
            return pure_out
        tree, where, values = self._out
        leaves = tree.flatten_up_to(pure_out)
        for i, v in zip(where, values):
            leaves[i] = v
        return jax.tree_util.tree_unflatten(tree, leaves)


class StaticKey:
    """A static leaf as a dict key: equal when the leaves are the same object or,
    both hashable and of one type, equal (as `eqx.filter_jit` compares its
    static part); an unhashable leaf is compared by identity."""

    __slots__ = ("leaf", "_hash", "_by_id")

    def __init__(self, leaf):
        self.leaf = leaf
        try:
            self._hash, self._by_id = hash((type(leaf), leaf)), False
        except TypeError:
            self._hash, self._by_id = id(leaf), True

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if not isinstance(other, StaticKey):
            return NotImplemented
        a, b = self.leaf, other.leaf
        if a is b:
            return True
        if self._by_id or other._by_id or type(a) is not type(b):
            return False
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001 - an __eq__ that does not answer: not equal
            return False

    def __repr__(self) -> str:
        return f"StaticKey({self.leaf!r})"


@dataclasses.dataclass(frozen=True)
class Program:
    """A step function traced to one flat closed jaxpr.

    Attributes:
      jaxpr: the flat ClosedJaxpr (nested plain calls inlined).
      in_tree: pytree structure of the step's positional arguments (static
        leaves, if any, left out: see `static`).
      out_tree: pytree structure of the step's result (likewise).
      in_paths: one readable key path per flat input (e.g. "[0]['params']['Dense_0']['kernel']").
      notes: one line per `cond` that stays whole although it has several
        outputs (why it could not be cut into independent parts); empty
        when there is none.
      static: the non-array leaves of the arguments and result, held static
        (None when there are none).
      in_types: per flat input, the class name of every node on its key path,
        one per key (`('Model', 'list', 'Block', 'LayerNorm', 'ArrayImpl')` for
        `[0].blocks[0].ln.weight`): which Equinox instance a parameter is in.
    """

    jaxpr: jcore.ClosedJaxpr
    in_tree: Any
    out_tree: Any
    in_paths: tuple[str, ...]
    notes: tuple[str, ...] = ()
    static: StaticLeaves | None = None
    in_types: tuple[tuple[str, ...], ...] = ()

    @property
    def eqns(self) -> list[jcore.JaxprEqn]:
        return self.jaxpr.jaxpr.eqns

    def __call__(self, *args):
        """Evaluates the program (unjitted) on arguments with the step's structure."""
        if self.static is not None:
            args = self.static.strip(args)
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise ValueError(f"arguments have structure {tree}, expected {self.in_tree}")
        out = jax.core.eval_jaxpr(self.jaxpr.jaxpr, self.jaxpr.consts, *flat)
        out = jax.tree_util.tree_unflatten(self.out_tree, out)
        return out if self.static is None else self.static.result(out)


def _abstract(x):
    """An array's shape and dtype (weak type kept); anything else as it is."""
    if isinstance(x, (jax.Array, np.ndarray)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
    return x


def trace_program(fn: Callable, *args) -> Program:
    """Traces `fn(*args)` to a flat `Program`.

    Leaves of the arguments and result that are not arrays or Python numbers
    are static (`StaticLeaves`).

    Raises:
      TraceError: when `fn` cannot be traced with these arguments; the message
        carries JAX's own explanation (shape mismatch, non-array argument...).
    """
    from hetpar.core import HetparError, TraceError

    static = StaticLeaves(fn, args)
    in_tree = jax.tree_util.tree_structure(static.pure_args)
    paths = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(static.pure_args)[0]]
    # Traced on shapes, not the arrays: nothing JAX keeps from tracing can
    # then hold the caller's arrays (a 40 GB optimizer state the step then
    # moves to the host would stay on the GPU).
    abstract = jax.tree_util.tree_map(_abstract, static.pure_args)
    try:
        closed, out_shape = jax.make_jaxpr(static.pure_step, return_shape=True)(*abstract)
    except HetparError:
        raise  # already says what is wrong (e.g. microbatches that do not divide the batch)
    except Exception as e:  # JAX raises many types; all mean "this step does not trace"
        name = getattr(fn, "__name__", repr(fn))
        raise TraceError(
            f"could not trace {name}(...) with the given example arguments: "
            f"{type(e).__name__}: {e}\nCheck that the arguments' shapes and dtypes fit the "
            "model (e.g. the batch's image size and channels) and that the function is "
            "jit-compatible (no Python control flow on traced values)."
        ) from e
    out_tree = jax.tree_util.tree_structure(out_shape)
    flat, notes = split_conds(inline_calls(closed))
    return Program(flat, in_tree, out_tree, tuple(paths), notes,
                   static if static.any else None, node_types(static.pure_args))


def node_types(tree) -> tuple[tuple[str, ...], ...]:
    """Per leaf of `tree` (in flattening order), the class name of each node on
    its key path, one per key: what `Program.in_types` holds."""
    out: list[tuple[str, ...]] = []

    def walk(node, types: tuple[str, ...]) -> None:
        tree = jax.tree_util.tree_structure(node)
        if tree.num_leaves == 0:  # an empty subtree (None: a static leaf taken out)
            return
        if tree.num_nodes == 1:
            out.append(types)
            return
        for _, child in jax.tree_util.tree_flatten_with_path(
                node, is_leaf=lambda x: x is not node)[0]:
            walk(child, (*types, type(child).__name__))

    walk(tree, ())
    return tuple(out)


def inline_calls(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """Returns an equivalent closed jaxpr with nested plain calls inlined."""
    jaxpr = closed.jaxpr
    constvars = list(jaxpr.constvars)
    consts = list(closed.consts)
    eqns: list[jcore.JaxprEqn] = []
    subst: dict[jcore.Var, Any] = {}

    def read(a):
        while isinstance(a, jcore.Var) and a in subst:
            a = subst[a]
        return a

    def emit(eqn: jcore.JaxprEqn, prefix) -> None:
        invars = [read(a) for a in eqn.invars]
        if prefix is not None:
            eqn = eqn.replace(
                source_info=eqn.source_info.replace(
                    name_stack=prefix + eqn.source_info.name_stack
                )
            )
        if eqn.primitive.name not in _INLINE:
            eqns.append(eqn.replace(invars=invars))
            return
        inner: jcore.ClosedJaxpr = eqn.params["jaxpr"]
        # Fresh variables for every inlining: one cached jaxpr may be called twice.
        renamed = {}
        for v, c in zip(inner.jaxpr.constvars, inner.consts):
            nv = jcore.Var(v.aval)
            constvars.append(nv)
            consts.append(c)
            renamed[v] = nv
        for v, a in zip(inner.jaxpr.invars, invars):
            renamed[v] = a
        ns = eqn.source_info.name_stack
        for ieqn in inner.jaxpr.eqns:
            outs = []
            for o in ieqn.outvars:
                if isinstance(o, jcore.DropVar):
                    outs.append(o)
                else:
                    nv = jcore.Var(o.aval)
                    renamed[o] = nv
                    outs.append(nv)
            ins = [renamed.get(a, a) if isinstance(a, jcore.Var) else a for a in ieqn.invars]
            emit(ieqn.replace(invars=ins, outvars=outs), ns)
        for o, io in zip(eqn.outvars, inner.jaxpr.outvars):
            if isinstance(o, jcore.DropVar):
                continue
            subst[o] = renamed.get(io, io) if isinstance(io, jcore.Var) else io

    for eqn in jaxpr.eqns:
        emit(eqn, None)
    outvars = [read(a) for a in jaxpr.outvars]
    effects = _join_effects(eqns)
    flat = jcore.Jaxpr(constvars, list(jaxpr.invars), outvars, eqns, effects, jaxpr.debug_info)
    return jcore.ClosedJaxpr(flat, consts)


def _size(v) -> int:
    shape = getattr(getattr(v, "aval", None), "shape", None)
    return math.prod(shape) if shape is not None else 1


def split_conds(closed: jcore.ClosedJaxpr) -> tuple[jcore.ClosedJaxpr, tuple[str, ...]]:
    """Cuts every top-level `cond` into parts that each touch one group of tensors.

    `cond(p, x)` runs branch p, a pure function. Its equations are grouped,
    in every branch at once, so that no tensor of more than one element (an
    operand, an intermediate or a result) is in two groups: each group is
    one parameter leaf's update under a per-leaf optimizer. One-element
    values may be recomputed by every part that needs them (a step count,
    `MultiSteps`' "emit" flag). A one-element value that combines several
    groups (a global gradient norm inside `MultiSteps(chain(clip, adamw))`)
    is computed in a shared part between the groups' parts: a group's part
    is then cut in phases, before and after the combine. Every part is a
    `cond` on the same index and runs that branch's own equations, so the
    parts together compute exactly what the `cond` did; a value one part
    hands another that the other branches do not compute is zeros there,
    and nothing reads it. A `cond` with effects is never cut.

    Returns:
      (closed jaxpr, notes): notes say, per `cond` with several results of
      more than one element that stays whole, which tensor ties them together.
    """
    jaxpr = closed.jaxpr
    eqns: list[jcore.JaxprEqn] = []
    notes: list[str] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "cond":
            eqns.append(eqn)
            continue
        parts, note = _split_cond(eqn)
        eqns.extend(parts)
        if note:
            notes.append(note)
    if len(eqns) == len(jaxpr.eqns):
        return closed, tuple(notes)
    flat = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns,
                       jaxpr.effects, jaxpr.debug_info)
    return jcore.ClosedJaxpr(flat, closed.consts), tuple(notes)


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, k):
        self.parent.setdefault(k, k)
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def union(self, a, b) -> None:
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[b] = a


# Where a branch value is computed: a group's part at a phase, the shared
# combine part at a phase, or anywhere (one-element values of operands alone).
_ANY = ("any",)


def _split_cond(eqn: jcore.JaxprEqn) -> tuple[list[jcore.JaxprEqn], str | None]:
    """(the parts replacing one `cond`, a note when several big results stay in one part)."""
    if eqn.effects or len(eqn.outvars) < 2:
        return [eqn], None
    # Conds nested in a branch (`apply_if_finite(MultiSteps(...))`) are cut first.
    branches = [split_conds(inline_calls(b))[0] for b in eqn.params["branches"]]
    groups, where = _cond_groups(branches)
    slot_part = _slot_parts(eqn, branches, groups, where)
    # Every part that computes something: results, or values handed to later parts.
    parts = list(dict.fromkeys([*slot_part, *(_tag_part(t) for w in where for t in w.values())]))
    # Parts run by phase: the groups' parts (in the order of their first result),
    # then the shared combine; values of operands alone first.
    group_rank = {}
    for p in parts:
        if p[0] == "g":
            group_rank.setdefault(p[1], len(group_rank))

    def order(p):
        if p[0] == "any":
            return (-1, 0, 0)
        return (p[1], 1, 0) if p[0] == "c" else (p[2], 0, group_rank[p[1]])

    parts.sort(key=order)
    big_groups = {slot_part[j][1] for j, o in enumerate(eqn.outvars)
                  if _size(o) > 1 and slot_part[j][0] == "g"}
    if len(parts) == 1 or len(big_groups) <= 1:
        return [eqn], _whole_note(eqn, branches)
    try:
        return _emit_parts(eqn, branches, where, slot_part, parts), None
    except Exception as e:  # noqa: BLE001 - whole is always exact; say why instead
        why = str(e) if isinstance(e, _CannotSplit) else f"{type(e).__name__}: {e}"
        return [eqn], (f"cond with {len(eqn.outvars)} results at "
                       f"{str(eqn.source_info.name_stack) or 'the top level'} stays whole "
                       f"(one layer): it could not be cut per layer ({why})")


class _CannotSplit(Exception):
    pass


def _cond_groups(branches):
    """Groups of big tensors (union-find) and, per branch, where each value is computed."""
    groups = _UnionFind()
    operand = [{v: k for k, v in enumerate(br.jaxpr.invars)} for br in branches]
    consts = [set(br.jaxpr.constvars) for br in branches]

    def key(b, br, a):
        """The union-find key of a big tensor (an operand is one key in every branch)."""
        if not isinstance(a, jcore.Var) or _size(a) <= 1 or a in consts[b]:
            return None
        return ("in", operand[b][a]) if a in operand[b] else ("v", b, a)

    for b, br in enumerate(branches):
        for e in br.jaxpr.eqns:
            ks = [k for a in [*e.invars, *e.outvars] if not isinstance(a, jcore.DropVar)
                  if (k := key(b, br, a)) is not None]
            for k in ks:
                groups.union(ks[0], k)
        for j, o in enumerate(br.jaxpr.outvars):
            if (k := key(b, br, o)) is not None:
                groups.union(("out", j), k)

    where: list[dict] = []  # per branch: var -> ("g", group, phase) | ("c", origins, phase)
    for b, br in enumerate(branches):
        w: dict = {}
        for e in br.jaxpr.eqns:
            ks = [k for a in [*e.invars, *e.outvars] if not isinstance(a, jcore.DropVar)
                  if (k := key(b, br, a)) is not None]
            srcs = [w[a] for a in e.invars if isinstance(a, jcore.Var) and a in w]
            group = groups.find(ks[0]) if ks else None
            if group is None:  # only one-element values: free, attached or a combine
                origins = {s[1] for s in srcs if s[0] == "g"}
                for s in srcs:
                    if s[0] == "c":
                        origins |= s[1]
                if not origins:
                    tag = _ANY
                elif len(origins) == 1 and all(s[0] == "g" for s in srcs):
                    group = next(iter(origins))  # one group's scalar work stays with it
                else:
                    tag = ("c", frozenset(origins), max(s[2] for s in srcs))
            if group is not None:
                phase = 0
                for s in srcs:
                    same = s[0] == "g" and s[1] == group
                    phase = max(phase, s[2] if same else s[2] + 1)
                tag = ("g", group, phase)
            for o in e.outvars:
                if not isinstance(o, jcore.DropVar) and tag is not _ANY:
                    w[o] = tag
        where.append(w)
    return groups, where


def _slot_parts(eqn, branches, groups, where) -> list[tuple]:
    """The part each result comes out of: ("g", group, phase), ("c", phase) or ("any",)."""
    out = []
    for j in range(len(eqn.outvars)):
        tags = [w.get(br.jaxpr.outvars[j], _ANY) if isinstance(br.jaxpr.outvars[j], jcore.Var)
                else _ANY for br, w in zip(branches, where)]
        placed = [t for t in tags if t is not _ANY]
        if ("out", j) in groups.parent:
            g = groups.find(("out", j))
            out.append(("g", g, max([t[2] for t in placed if t[0] == "g" and t[1] == g],
                                    default=0)))
        elif not placed:
            out.append(_ANY)
        elif all(t[0] == "g" for t in placed) and len({t[1] for t in placed}) == 1:
            out.append(("g", placed[0][1], max(t[2] for t in placed)))
        else:
            out.append(("c", max(t[2] for t in placed)))
    return out


def _tag_part(tag) -> tuple:
    return tag if tag[0] != "c" else ("c", tag[2])


def _emit_parts(eqn, branches, where, slot_part, parts) -> list[jcore.JaxprEqn]:
    """One `cond` per part, in `parts` order, handing each other values through new results."""
    rank = {p: k for k, p in enumerate(parts)}
    # (branch, var) handed from the part computing it to a later part.
    cross_out: dict[tuple, list] = {p: [] for p in parts}
    plans = {}
    for part in reversed(parts):  # later parts say first what they need from earlier ones
        per_branch = []
        for b, br in enumerate(branches):
            need = [br.jaxpr.outvars[j] for j, sp in enumerate(slot_part) if sp == part]
            need += [v for bb, v in cross_out[part] if bb == b]
            live = {a for a in need if isinstance(a, jcore.Var)}
            kept, cross_in = [], []
            for e in reversed(br.jaxpr.eqns):
                outs = [o for o in e.outvars if not isinstance(o, jcore.DropVar) and o in live]
                if not outs:
                    continue
                tag = where[b].get(outs[0], _ANY)
                home = _ANY if tag is _ANY else _tag_part(tag)
                if home is _ANY or home == part:
                    kept.append(e)
                    live.update(a for a in e.invars if isinstance(a, jcore.Var))
                    continue
                if rank.get(home, len(parts)) >= rank[part]:
                    raise _CannotSplit("its parts would depend on each other in a cycle")
                for o in outs:
                    cross_in.append((b, o))
                    cross_out[home].append((b, o))
                    live.discard(o)
            kept.reverse()
            per_branch.append((live, kept, cross_in))
        plans[part] = per_branch
    top = {}  # (branch, var) -> the new top-level variable carrying it
    for part in parts:
        for c in cross_out[part]:
            top.setdefault(c, jcore.Var(c[1].aval))
    out = []
    for part in parts:
        slots = [j for j, sp in enumerate(slot_part) if sp == part]
        cin = list(dict.fromkeys(c for _, _, ci in plans[part] for c in ci))
        cout = list(dict.fromkeys(cross_out[part]))
        if not cout and all(isinstance(eqn.outvars[j], jcore.DropVar) for j in slots):
            continue  # a pure part nothing reads
        ops = sorted({k for br, (live, _, _) in zip(branches, plans[part])
                      for k, v in enumerate(br.jaxpr.invars) if v in live})
        new_branches = [
            _part_branch(b, br, live, kept, ops, cin, slots, cout)
            for b, (br, (live, kept, _)) in enumerate(zip(branches, plans[part]))
        ]
        avals = {tuple(_aval_key(a) for a in nb.out_avals) for nb in new_branches}
        if len(avals) != 1:
            raise _CannotSplit("its branches' parts would not return the same types")
        out.append(eqn.replace(
            invars=[eqn.invars[0]] + [eqn.invars[1 + k] for k in ops] + [top[c] for c in cin],
            outvars=[eqn.outvars[j] for j in slots] + [top[c] for c in cout],
            params={**eqn.params, "branches": tuple(new_branches)},
        ))
    return out


def _aval_key(aval) -> tuple:
    return (tuple(aval.shape), str(aval.dtype))


def _part_branch(b, br, live, kept, ops, cin, slots, cout) -> jcore.ClosedJaxpr:
    """Branch `b` of one part: its operands and handed-in values in, its results and
    handed-out values out (zeros for values only other branches compute)."""
    invars = [br.jaxpr.invars[k] for k in ops]
    invars += [v if bb == b else jcore.Var(v.aval) for bb, v in cin]
    outvars = [br.jaxpr.outvars[j] for j in slots]
    outvars += [v for bb, v in cout if bb == b]
    cv = [(v, c) for v, c in zip(br.jaxpr.constvars, br.consts) if v in live]
    # Argument names and result paths no longer line up: drop them (lowering checks counts).
    dbg = br.jaxpr.debug_info.with_unknown_names()
    piece = jcore.ClosedJaxpr(
        jcore.Jaxpr([v for v, _ in cv], invars, outvars, kept, _join_effects(kept), dbg),
        [c for _, c in cv])
    if all(bb == b for bb, _ in cout):
        return piece
    n_real = len(slots)

    def with_zeros(*args):
        vals = jcore.jaxpr_as_fun(piece)(*args)
        handed = iter(vals[n_real:])
        full = [jnp.zeros(v.aval.shape, v.aval.dtype) if bb != b else next(handed)
                for bb, v in cout]
        return [*vals[:n_real], *full]

    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in invars]
    return jax.make_jaxpr(with_zeros)(*specs)


def _whole_note(eqn, branches) -> str | None:
    """Why a cond with several big results stays whole (None when it has fewer than two)."""
    big = [j for j, o in enumerate(eqn.outvars) if _size(o) > 1]
    if len(big) < 2:
        return None
    # What ties them: the equation inside that reads the most big tensors at once.
    tie, most = "one tensor computed inside it", 1
    for br in branches:
        for e in br.jaxpr.eqns:
            n = sum(1 for a in e.invars if isinstance(a, jcore.Var) and _size(a) > 1)
            if n > most and e.outvars:
                most = n
                tie = (f"one {e.primitive.name} of {n} tensors inside it "
                       f"({e.outvars[0].aval.str_short()})")
    where = str(eqn.source_info.name_stack) or "the top level"
    return (f"cond with {len(eqn.outvars)} results at {where} stays whole (one layer): its "
            f"{len(big)} results of more than one element all depend on {tie}, so no part "
            "of it touches only one layer's tensors (e.g. all gradients flattened into one "
            "vector); the state it updates lives in that one layer.")


def _join_effects(eqns) -> frozenset:
    return frozenset().union(*(e.effects for e in eqns))


def subjaxpr(
    program: Program, eqn_ids: Sequence[int]
) -> tuple[jcore.ClosedJaxpr, list[Any], list[jcore.Var]]:
    """Cuts the equations `eqn_ids` (in program order) out as their own jaxpr.

    Returns:
      (closed_jaxpr, inputs, outputs): `inputs` are the atoms of the whole
      program the piece reads (program inputs, consts, or other equations'
      outputs), in the order of the piece's invars; `outputs` are the
      variables it defines that something outside it (or the program's
      result) reads.
    """
    jaxpr = program.jaxpr.jaxpr
    ids = sorted(eqn_ids)
    chosen = set(ids)
    defined: set = set()
    inputs: list = []
    seen_in: set = set()
    for i in ids:
        for a in jaxpr.eqns[i].invars:
            if isinstance(a, jcore.Var) and a not in defined and a not in seen_in:
                seen_in.add(a)
                inputs.append(a)
        defined.update(o for o in jaxpr.eqns[i].outvars if not isinstance(o, jcore.DropVar))
    used_outside: set = {a for a in jaxpr.outvars if isinstance(a, jcore.Var)}
    for j, e in enumerate(jaxpr.eqns):
        if j not in chosen:
            used_outside.update(a for a in e.invars if isinstance(a, jcore.Var))
    outputs = [
        o
        for i in ids
        for o in jaxpr.eqns[i].outvars
        if not isinstance(o, jcore.DropVar) and o in used_outside
    ]
    # Consts the piece reads become ordinary inputs of the piece's jaxpr.
    eqns = [jaxpr.eqns[i] for i in ids]
    effects = _join_effects(eqns)
    piece = jcore.Jaxpr([], inputs, outputs, eqns, effects, jaxpr.debug_info)
    return jcore.ClosedJaxpr(piece, []), inputs, outputs
