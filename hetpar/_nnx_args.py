"""Flax NNX objects among a step's arguments, handled as `nnx.jit` handles them."""

from __future__ import annotations

import functools
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
