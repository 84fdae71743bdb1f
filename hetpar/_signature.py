"""What a compiled step is keyed on: its arguments' structure, shapes and
dtypes and its static leaves, and where the batch is among them."""

from __future__ import annotations

import jax

from hetpar.core import HetparError
from hetpar.passes import StaticKey, static_where


def batch_positions(batch_argnums: tuple[int, ...] | None, n: int) -> tuple[int, ...]:
    """The batch arguments' positions among `n` arguments (None: the last), made non-negative."""
    if batch_argnums is None:
        return (n - 1,) if n else ()
    bad = [k for k in batch_argnums if not -n <= k < n]
    if bad:
        raise HetparError(f"batch_argnums {list(batch_argnums)} name arguments {bad} the step "
                          f"was not given: it was called with {n} arguments")
    return tuple(k % n for k in batch_argnums)


def donated_positions(donate_argnums: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The donated arguments' positions among `n` arguments, made non-negative."""
    bad = [k for k in donate_argnums if not -n <= k < n]
    if bad:
        raise HetparError(f"donate_argnums {list(donate_argnums)} name arguments {bad} the step "
                          f"was not given: it was called with {n} arguments")
    return tuple(sorted({k % n for k in donate_argnums}))


def signature(args) -> tuple:
    """What a compiled step is keyed on: the argument structure, the shapes and
    dtypes of the traced leaves (a Python number by its type, as jax.jit's weak
    types), and the static leaves themselves (`StaticKey`).

    Not on the fast path of a one-device plan (`AutoStep.__call__`).
    """
    leaves, tree = jax.tree_util.tree_flatten(args)
    static = set(static_where(args))
    return tree, tuple(StaticKey(x) if i in static else _leaf_signature(x)
                       for i, x in enumerate(leaves))


def _leaf_signature(x):
    return getattr(x, "shape", None), getattr(x, "dtype", type(x))


def fast_signature(args) -> tuple:
    """`signature` without the static-leaf scan: the structure and each
    leaf's shape and dtype (a function leaf by its type), for a step with no
    static leaves; a third of the time on GPT-2's 446 leaves."""
    return flat_signature(args)[0]


def flat_signature(args) -> tuple[tuple, list]:
    """(`fast_signature(args)`, the leaves it flattened): a caller checking
    the leaves too flattens once."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return (tree, tuple(map(_leaf_signature, leaves))), leaves
