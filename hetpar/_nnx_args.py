"""Flax NNX objects among a step's arguments, handled as `nnx.jit` handles them."""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Callable
from typing import Any

import jax

from hetpar.core import HetparError
from hetpar.passes import LayerGraph
from hetpar.passes import trace as trace_pure

NNX_MARK = object()  # AutoStep._compiled's mark of a signature holding Flax NNX objects


class NnxArgs:
    """Flax NNX objects among a step's arguments, split out as `nnx.jit` does.

    `pure_args` are the arguments with each NNX object replaced by its state
    (one `nnx.split` over all of them, so references they share stay shared);
    `pure_step(fn)` takes those and returns `(fn's output, the objects' new
    state)`; `update` writes that state back into the caller's objects.
    """

    def __init__(self, args: tuple):
        nnx = self._nnx = sys.modules["flax.nnx"]
        is_object = _nnx_object_test(nnx)
        leaves, tree = jax.tree_util.tree_flatten(args, is_leaf=is_object)
        where = tuple(i for i, x in enumerate(leaves) if is_object(x))
        self.objects = tuple(leaves[i] for i in where)
        self._where, self._tree = where, tree
        self.graphdef, state = nnx.split(self.objects)
        for k, i in enumerate(where):
            # An object all of whose variables an earlier one also holds has no entry.
            leaves[i] = state[k] if k in state else nnx.State({})
        self.pure_args = jax.tree_util.tree_unflatten(tree, leaves)
        # The GraphDef holds the objects' static attributes (a `train()` flag
        # included): a change compiles afresh, as in nnx.jit.
        self.key = (NNX_MARK, self.graphdef, tree, where)

    @staticmethod
    def present(args: tuple) -> bool:
        nnx = sys.modules.get("flax.nnx")  # not imported: no NNX object can be here
        if nnx is None:
            return False
        is_object = _nnx_object_test(nnx)
        return any(map(is_object, jax.tree_util.tree_leaves(args, is_leaf=is_object)))

    def pure_step(self, fn: Callable) -> Callable:
        nnx, graphdef, tree, where = self._nnx, self.graphdef, self._tree, self._where
        is_object = _nnx_object_test(nnx)

        @functools.wraps(fn)
        def pure(*pure_args):
            leaves = tree.flatten_up_to(pure_args)
            objects = nnx.merge(graphdef, nnx.State({k: leaves[i] for k, i in enumerate(where)}))
            for k, i in enumerate(where):
                leaves[i] = objects[k]
            out = fn(*jax.tree_util.tree_unflatten(tree, leaves))
            if any(map(is_object, jax.tree_util.tree_leaves(out, is_leaf=is_object))):
                raise HetparError(
                    "a step under hetpar.auto may not return Flax NNX objects; the NNX objects "
                    "it was given are updated in place, so return arrays only (e.g. the loss)")
            new_graphdef, state = nnx.split(objects)
            if new_graphdef != graphdef:
                raise HetparError(
                    "the step changed the structure of the Flax NNX objects it was given "
                    "(added, removed or replaced a Variable, submodule or static attribute); "
                    "under hetpar.auto a step may only update their values")
            return out, state

        return pure

    def update(self, state) -> None:
        self._nnx.update(self.objects, state)


class NnxFastCall:
    """A later call with the same Flax NNX objects, unchanged in structure,
    without `NnxArgs`' split and update.

    `NnxArgs` pays, per call, `nnx.split` (a walk of the objects' graph and
    a `State` built from it), a signature of the objects' leaves, and
    `nnx.update` (another walk): 1.4-1.6x `nnx.jit`'s step on small NNX
    models. Here one walk (`graphlib.flatten`, as `nnx.split` does, without
    the State) gives the GraphDef, compared with the first call's, and the
    variables' values; the objects' nodes and Variables must be the very
    ones of the first call (a submodule replaced by an equal one is not).
    The step's arguments are rebuilt in the first call's tree, and the new
    state is written straight into those Variables.
    """

    def __init__(self, n: int, positions: dict[int, list[int]], types: tuple, graphdef,
                 in_tree, refs: list, variables: list, perm_out: list, others: dict):
        self._graphlib = sys.modules["flax.nnx.graphlib"]
        self._n = n
        self._positions = positions  # object argument -> its leaves' places among the values
        self._types = types
        self._graphdef = graphdef
        self._in_tree = in_tree
        self._refs = refs
        self._variables = variables
        self._perm_out = perm_out
        self._others = others  # other argument -> its tree structure

    @classmethod
    def build(cls, args: tuple, nnx_args: NnxArgs, state) -> NnxFastCall | None:
        """After `nnx_args.update(state)`, the fast call for arguments like
        `args`; None where the objects are not top-level arguments or their
        values are not distinct arrays (then every call takes `NnxArgs`)."""
        nnx = nnx_args._nnx
        graphlib = sys.modules["flax.nnx.graphlib"]
        is_object = _nnx_object_test(nnx)
        objects = [k for k, a in enumerate(args) if is_object(a)]
        if len(objects) != len(nnx_args.objects) or any(
                args[k] is not o for k, o in zip(objects, nnx_args.objects)):
            return None  # objects nested in a tuple or dict: the full path
        ref_index = graphlib.RefMap()
        graphdef, values = graphlib.flatten(nnx_args.objects, with_paths=False,
                                            ref_index=ref_index)
        refs = list(ref_index)
        variables = [r for r in refs if isinstance(r, nnx.Variable)]
        where = {id(x): i for i, x in enumerate(values)}
        if (len(variables) != len(values) or len(where) != len(values)
                or any(v.get_raw_value() is not x for v, x in zip(variables, values))):
            return None
        # Each object argument's leaves, as the step takes them, located among
        # the variables' values (distinct arrays: by identity).
        positions = {}
        for k in objects:
            places = [where.get(id(x)) for x in jax.tree_util.tree_leaves(nnx_args.pure_args[k])]
            if None in places:
                return None
            positions[k] = places
        perm_out = [where.get(id(x)) for x in jax.tree_util.tree_leaves(state)]
        if None in perm_out or sorted(perm_out) != list(range(len(values))):
            return None
        others = {k: jax.tree_util.tree_structure(a) for k, a in enumerate(args)
                  if k not in positions}
        return cls(len(args), positions, tuple(type(args[k]) for k in objects), graphdef,
                   jax.tree_util.tree_structure(nnx_args.pure_args), refs, variables,
                   perm_out, others)

    def pure_args(self, args: tuple) -> tuple | None:
        """The step's arguments for `args`, or None where they are not like the
        first call's (then the full path decides)."""
        if len(args) != self._n:
            return None
        objects = tuple(args[k] for k in self._positions)
        if any(type(o) is not t for o, t in zip(objects, self._types)):
            return None
        ref_index = self._graphlib.RefMap()
        graphdef, values = self._graphlib.flatten(objects, with_paths=False,
                                                  ref_index=ref_index)
        if graphdef != self._graphdef or len(ref_index) != len(self._refs) or not all(
                map(operator.is_, ref_index, self._refs)):
            return None
        leaves = []
        for k, a in enumerate(args):
            places = self._positions.get(k)
            if places is not None:
                leaves.extend(values[i] for i in places)
                continue
            flat, tree = jax.tree_util.tree_flatten(a)
            if tree != self._others[k]:
                return None
            leaves.extend(flat)
        return jax.tree_util.tree_unflatten(self._in_tree, leaves)

    def update(self, state) -> None:
        """Writes the step's new state into the objects' Variables."""
        variables = self._variables
        for i, x in zip(self._perm_out, jax.tree_util.tree_leaves(state)):
            variables[i].set_raw_value(x)


def _nnx_object_test(nnx) -> Callable[[Any], bool]:
    # Module, Optimizer, Rngs and Object are Pytrees. Not Variables: the State
    # of the functional form (`nnx.split`) holds them, as values.
    return lambda x: isinstance(x, nnx.Pytree)


def trace(step_fn: Callable, *example_args, **kwargs) -> LayerGraph:
    """`hetpar.passes.trace`, with Flax NNX objects among the arguments taken
    as `hetpar.auto` takes them (`NnxArgs`): the graph is the step on their
    state, returning `(the step's output, their new state)`.

    A step that updates NNX objects in place (`optimizer.update(model,
    grads)`) returns only its loss; traced on the objects themselves, its
    update would be dead code, cut from the graph. Other arguments are
    traced as `hetpar.passes.trace` traces them; see it for the options.
    """
    if NnxArgs.present(example_args):
        nnx_args = NnxArgs(example_args)
        step_fn, example_args = nnx_args.pure_step(step_fn), nnx_args.pure_args
    return trace_pure(step_fn, *example_args, **kwargs)
