"""Tiny values: what is small enough never to decide where a layer lives.

**Tiny** is a size: one element (a scalar or a `[1]` array); a *stack* of
tiny values is a result of equations that read only tiny values and return
no more elements than they read, at most `TINY_STACK_MAX`
(`jnp.array([flag, ...])`). Moving one costs a transfer's latency and a few
bytes, so the layer rules (`_layers`) share them rather than let them pull
parameters or optimizer state, and the naming of layers by key path
(`_layer_names`) ignores them when it asks which parameters an equation
reads (docs/architecture/layers.md, "Tiny").
"""

from __future__ import annotations

import math

from jax.extend import core as jcore


def _size(v) -> int:
    shape = getattr(getattr(v, "aval", None), "shape", None)
    return math.prod(shape) if shape is not None else 1


def is_tiny(v) -> bool:
    """A value of one element (a scalar, or a `[1]` array): free to move or recompute.

    "Tiny" is a size, not a role: a one-element value costs one transfer's
    latency and a few bytes wherever it goes, so it never decides where a
    layer's parameters or optimizer state live (docs/architecture/layers.md, "Layers").
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
