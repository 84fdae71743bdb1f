"""`hetpar.value_and_grad` / `hetpar.grad`: JAX's, plus a mark for microbatching.

Outside `hetpar.auto` (or with one microbatch) they are exactly
`jax.value_and_grad` / `jax.grad`. When `hetpar.auto(..., microbatches=M)`
traces a step, they split the step's batch into M microbatches, take the
gradient of each inside a named scope `hetpar_mb<i>` and average them. The
trace then holds M independent forward/backward chains per layer (which the
stage splitter turns into a device pipeline) followed by one accumulation
and one optimizer update (Alpa's `alpa.grad` idea, done at trace time).

Which loss arguments are batch data? Those leaves that are the very arrays
`hetpar.auto` was given as the step's batch (`batch_argnums`); pass
`batch_argnums=` here when the loss receives data transformed beforehand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from hetpar.core import HetparError
from hetpar.passes import MICROBATCH_SCOPE


@dataclasses.dataclass
class _Microbatching:
    count: int
    batch_leaves: list  # the step's batch tracers, compared by identity


_state = threading.local()


@contextlib.contextmanager
def microbatching(count: int, batch_leaves: Sequence[Any]):
    """While tracing under this context, marked gradients run as `count` microbatches."""
    prev = getattr(_state, "mb", None)
    _state.mb = _Microbatching(count, list(batch_leaves))
    try:
        yield
    finally:
        _state.mb = prev


def microbatched(fn: Callable, microbatches: int,
                 batch_argnums: Sequence[int] | None = None) -> Callable:
    """`fn` with its batch arguments registered for `hetpar.value_and_grad`.

    Calling the result traces (or runs) `fn` as `hetpar.auto(...,
    microbatches=M)` does: marked gradients split those arguments' leaves into
    `microbatches` parts. With one microbatch it is `fn`'s computation unchanged.

    Args:
      fn: the step.
      microbatches: how many microbatches marked gradients take.
      batch_argnums: which of `fn`'s arguments are batch data (None: the last).
    """

    @functools.wraps(fn)
    def step(*args):
        nums = (len(args) - 1,) if batch_argnums is None else batch_argnums
        leaves = [leaf for k in nums for leaf in jax.tree_util.tree_leaves(args[k])]
        with microbatching(microbatches, leaves):
            return fn(*args)

    return step


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   *, batch_argnums: Sequence[int] | None = None, **kwargs) -> Callable:
    """Drop-in for `jax.value_and_grad` that marks where the gradient is.

    Args:
      fun, argnums, has_aux, **kwargs: as `jax.value_and_grad`.
      batch_argnums: positions of `fun`'s arguments that are batch data (split
        along axis 0 into microbatches). Default: the arguments whose leaves
        are the step's batch arrays.

    Returns:
      A function with `jax.value_and_grad`'s signature and results. Under
      microbatching, the value (and float aux leaves) are microbatch means and
      the gradient is the mean of the microbatch gradients: equal to the
      full-batch result when the loss is a mean over the batch.
    """
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux, **kwargs)

    def wrapped(*args):
        mb = getattr(_state, "mb", None)
        if mb is None or mb.count == 1:
            return vg(*args)
        split = _batch_positions(args, mb, batch_argnums)
        m = mb.count
        n = _batch_size([args[k] for k in split])
        results = []
        for i in range(m):
            # The slicing belongs to the microbatch too: it is where its forward starts.
            with jax.named_scope(f"{MICROBATCH_SCOPE}{i}"):
                part = [_slice(a, i, m, n) if k in split else a for k, a in enumerate(args)]
                results.append(vg(*part))
        return jax.tree_util.tree_map(lambda *xs: _mean(xs), *results)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         *, batch_argnums: Sequence[int] | None = None, **kwargs) -> Callable:
    """Drop-in for `jax.grad`; see `value_and_grad`."""
    vg = value_and_grad(fun, argnums, has_aux, batch_argnums=batch_argnums, **kwargs)

    def wrapped(*args):
        out = vg(*args)
        if has_aux:
            (_, aux), g = out
            return g, aux
        return out[1]

    return wrapped


def _batch_positions(args, mb: _Microbatching, batch_argnums) -> set[int]:
    if batch_argnums is not None:
        return {k % len(args) for k in batch_argnums}
    ids = {id(x) for x in mb.batch_leaves}
    found = {k for k, a in enumerate(args)
             if any(id(leaf) in ids for leaf in jax.tree_util.tree_leaves(a))}
    if not found:
        raise HetparError(
            "hetpar.value_and_grad was asked for microbatches but none of the loss's "
            "arguments is the step's batch (batch_argnums of hetpar.auto). Pass "
            "batch_argnums=... to hetpar.value_and_grad to say which loss arguments to split.")
    return found


def _batch_size(trees) -> int | None:
    """The batch size: the most common leading dimension among the batch leaves."""
    dims = [x.shape[0] for t in trees for x in jax.tree_util.tree_leaves(t)
            if getattr(x, "ndim", 0)]
    if not dims:
        return None
    return max(set(dims), key=lambda d: (dims.count(d), d))


def _slice(tree, i: int, m: int, n: int | None):
    """Microbatch i of m: leaves whose leading dimension is the batch size n are cut;
    others (a PRNG key, a scalar) go whole to every microbatch."""
    if n is not None and n % m:
        raise HetparError(
            f"batch size {n} is not divisible by microbatches={m}; choose a microbatch "
            f"count that divides the batch size (divisors of {n}).")

    def cut(x):
        if not getattr(x, "ndim", 0) or x.shape[0] != n:
            return x
        size = n // m
        return jax.lax.slice_in_dim(x, i * size, (i + 1) * size, axis=0)

    return jax.tree_util.tree_map(cut, tree)


def _mean(xs):
    x0 = xs[0]
    if not jnp.issubdtype(jnp.result_type(x0), jnp.inexact):
        return x0  # integer/bool aux (counters): identical across microbatches
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total / len(xs)
