"""Runs a data-parallel plan: the whole step jitted over a mesh of replicas.

The batch is split along axis 0 over the replicas and everything else (the
parameters, the optimizer state) is replicated; XLA's SPMD partitioner turns
the batch mean inside the loss into an all-reduce of the gradients, so every
replica applies the same update and the results equal one device's `jax.jit`
(up to the order of the reduction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetpar.core import HetparError


class Replicated:
    """`fn` under `jax.jit`, data parallel over `devices`.

    Args:
      fn: the training step.
      devices: the replicas (jax devices).
      args: example arguments (shapes decide how each batch leaf is split).
      batch_argnums: which arguments are batch data (None: the last).

    Raises:
      HetparError: a batch leaf whose leading axis does not split evenly.
    """

    def __init__(self, fn: Callable, devices: Sequence[jax.Device], args: tuple,
                 batch_argnums: Sequence[int] | None):
        n = len(devices)
        mesh = Mesh(np.array(devices), ("replica",))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.split = NamedSharding(mesh, PartitionSpec("replica"))
        nums = (len(args) - 1,) if batch_argnums is None else tuple(batch_argnums)

        def batch_sharding(x):
            shape = np.shape(x)
            if not shape:  # a scalar (a step count, an rng): every replica gets it
                return self.replicated
            if shape[0] % n:
                raise HetparError(
                    f"a batch array of shape {shape} does not split over {n} replicas: its "
                    f"leading axis ({shape[0]}) must be a multiple of {n}. Use such a batch "
                    "size, or plan with hetpar.auto(..., data_parallel=False).")
            return self.split

        leaf_shardings = [
            [batch_sharding(x) for x in jax.tree_util.tree_leaves(a)] if i in nums
            else [self.replicated] * len(jax.tree_util.tree_leaves(a))
            for i, a in enumerate(args)]
        self._leaf_shardings = leaf_shardings
        # jit and device_put take a tree prefix: one sharding per argument
        # where the whole argument is laid out alike.
        self.shardings = tuple(
            jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(a), ls) if i in nums
            else self.replicated for i, (a, ls) in enumerate(zip(args, leaf_shardings)))
        self._jit = jax.jit(fn, in_shardings=self.shardings, out_shardings=self.replicated)

    def _placed(self, args: tuple) -> tuple:
        """`args` with every array not already laid out as the step wants moved there.

        jit would copy misplaced committed arrays itself, but slowly (see
        CompiledStep._batch_here); resident state from the previous step and
        numpy arrays pass untouched.
        """
        out = None
        for i, (a, want) in enumerate(zip(args, self._leaf_shardings)):
            leaves = jax.tree_util.tree_leaves(a)
            if any(isinstance(x, jax.Array) and x.sharding != s for x, s in zip(leaves, want)):
                out = out or list(args)
                out[i] = jax.device_put(a, self.shardings[i])
        return args if out is None else tuple(out)

    def __call__(self, *args):
        return self._jit(*self._placed(args))
