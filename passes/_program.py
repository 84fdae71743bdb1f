"""A traced step as one flat jaxpr: what every other pass walks.

`jax.make_jaxpr` leaves nested `jit` equations in a training step (Optax's
update functions, Flax helpers, user-jitted functions). Those calls carry no
control flow, so hetpar inlines them: afterwards each top-level equation is
one unit of placement, and its name stack is absolute (the nested jaxpr's
relative stack is appended to the caller's).

Control flow (`scan`, `while`, `cond`), `custom_jvp`/`custom_vjp` calls,
`remat` and custom calls are never opened: they stay whole as one equation,
so no later pass can split them (DESIGN, "Layers").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

# Nested calls that are plain function calls: safe to inline.
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call"})


@dataclasses.dataclass(frozen=True)
class Program:
    """A step function traced to one flat closed jaxpr.

    Attributes:
      jaxpr: the flat ClosedJaxpr (nested plain calls inlined).
      in_tree: pytree structure of the step's positional arguments.
      out_tree: pytree structure of the step's result.
      in_paths: one readable key path per flat input (e.g. "[0]['params']['Dense_0']['kernel']").
    """

    jaxpr: jcore.ClosedJaxpr
    in_tree: Any
    out_tree: Any
    in_paths: tuple[str, ...]

    @property
    def eqns(self) -> list[jcore.JaxprEqn]:
        return self.jaxpr.jaxpr.eqns

    def __call__(self, *args):
        """Evaluates the program (unjitted) on arguments with the step's structure."""
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise ValueError(f"arguments have structure {tree}, expected {self.in_tree}")
        out = jax.core.eval_jaxpr(self.jaxpr.jaxpr, self.jaxpr.consts, *flat)
        return jax.tree_util.tree_unflatten(self.out_tree, out)


def trace_program(fn: Callable, *args) -> Program:
    """Traces `fn(*args)` to a flat `Program`.

    Raises:
      TraceError: when `fn` cannot be traced with these arguments; the message
        carries JAX's own explanation (shape mismatch, non-array argument...).
    """
    from hetpar.core import TraceError

    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    from hetpar.core import HetparError

    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
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
    del flat_args
    return Program(inline_calls(closed), in_tree, out_tree, tuple(paths))


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
