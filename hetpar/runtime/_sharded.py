"""Runs a sharded-state plan: the whole step jitted over a device group,
its state sharded across the group (ZeRO-1, FSDP).

As `Replicated`, the batch is split along axis 0 and every device runs the
whole step on its share; unlike it, state leaves are sharded over the
group, each on its largest axis that the group size divides (MaxText's
rule), a leaf no axis divides staying replicated. Which leaves are sharded
is the stage's choice: "zero1" shards the optimizer state and keeps the
parameters replicated; "fsdp" (ZeRO-3) shards both. ZeRO-2 (gradients
sharded too) is not a stage of its own here: the gradients live inside the
one jitted program, where GSPMD lays them out as the update needs them, so
it collapses into ZeRO-1.

Nothing here moves a byte between devices by hand: `jax.jit`'s in and out
shardings say where every array lives, and XLA's SPMD partitioner inserts
the all-gathers (parameters before use) and reduce-scatters (gradients)
and schedules them. The state the step returns keeps the layout it came in
with (an output with the structure, shapes and dtypes of a state argument
gets that argument's shardings), so step N+1 starts with no reshard.

Several processes work as for `Replicated` (its `global_args`): the mesh is
global, and each process fills its devices' shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hetpar.runtime._replicated import Replicated

#: Sharded-state stages: optimizer state sharded (ZeRO-1), or parameters too (FSDP, ZeRO-3).
STAGES = ("zero1", "fsdp")


def shard_axis(shape: Sequence[int], n: int) -> int | None:
    """The axis a leaf of `shape` is sharded on over `n` devices: its largest
    axis that `n` divides (the first of equals), or None (it stays replicated)."""
    axes = [a for a, size in enumerate(shape) if size > 0 and size % n == 0]
    return max(axes, key=lambda a: (shape[a], -a)) if axes else None


class Sharded(Replicated):
    """`fn` under `jax.jit`, data parallel over `devices`, state sharded across them.

    Args:
      fn, devices, args, batch_argnums, batch, donate_argnums: as `Replicated`.
      shard: per argument, per leaf (`jax.tree_util.tree_leaves` order),
        whether that state leaf is sharded: the optimizer state's for
        ZeRO-1, the parameters' too for FSDP. Batch arguments are split
        whatever it says. None: every leaf of every other argument (FSDP).
      unmatched: how a result that mirrors no state argument (a loss, a
        metric, returned gradients) is laid out: "replicated", or "sharded"
        by the same rule as state.
    """

    def __init__(self, fn: Callable, devices: Sequence[jax.Device], args: tuple,
                 batch_argnums: Sequence[int] | None, *,
                 shard: Sequence[Sequence[bool]] | None = None,
                 unmatched: str = "replicated", batch: str = "global",
                 donate_argnums: Sequence[int] = ()):
        self._shard = shard
        self._unmatched = unmatched
        super().__init__(fn, devices, args, batch_argnums, batch=batch,
                         donate_argnums=donate_argnums)

    def leaf_sharding(self, x) -> NamedSharding:
        """A state leaf's layout: split on `shard_axis`, else replicated."""
        axis = shard_axis(np.shape(x), self.size)
        if axis is None:
            return self.replicated
        return NamedSharding(self.mesh, PartitionSpec(*[None] * axis, "replica"))

    def state_sharding(self, arg: int, leaf: int, x) -> NamedSharding:
        if self._shard is not None and not self._shard[arg][leaf]:
            return self.replicated
        return self.leaf_sharding(x)

    def out_shardings(self, fn: Callable, args: tuple):
        """One sharding per result leaf: a state argument's own where a result
        (the whole, or one element of a returned tuple) has its structure,
        shapes and dtypes; else as `unmatched` says."""
        out = jax.eval_shape(fn, *self.global_shapes(args))
        like: dict = {}
        for i, a in enumerate(args):
            if i not in self._nums:
                like.setdefault(_signature(a), self._leaf_shardings[i])

        def laid_out(tree) -> list:
            found = like.get(_signature(tree))
            if found is not None:
                return list(found)
            if self._unmatched == "sharded":
                return [self.leaf_sharding(x) for x in jax.tree_util.tree_leaves(tree)]
            return [self.replicated] * len(jax.tree_util.tree_leaves(tree))

        if _signature(out) in like or not isinstance(out, (tuple, list)):
            leaves = laid_out(out)
        else:  # a tuple's leaves are its elements' leaves, in order
            leaves = [s for element in out for s in laid_out(element)]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out), leaves)


def _signature(tree) -> tuple:
    """A tree's structure and its leaves' shapes and dtypes: what makes a
    result the new value of a state argument."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    return structure, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", None)
                                                      or np.result_type(x))) for x in leaves)
