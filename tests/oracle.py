"""The one "equals `jax.jit`" oracle of the test suite, leaf by leaf.

A step's result under hetpar (`got`) is compared with the same step under
`jax.jit` on cpu:0 applied to the very same inputs (`want`), every leaf of
the returned tree on its own: parameters, optimizer state, model state
(BatchNorm statistics), PRNG keys, auxiliary outputs and the loss.

Per leaf, on its own scale (one error over the whole state hid a stale
bias: ResNet-18's fc bias, un-updated, moved the whole-state error by 5e-8):

* integer, boolean and key leaves (step counts, PRNG keys) must be equal;
* a float leaf passes when ||got - want|| <= RTOL x ||want|| (L2 norms of
  the leaf), f32 rounding between one fused program and several stages;
* else it passes only within the same step's own rounding: FLOOR_FACTOR x
  ||apart - want||, where `apart` is the same step from the same inputs with
  nothing fused (`unfused`: one XLA compile with its fusion pass off, each
  operation its own kernel as op by op). That is where a leaf's true value
  is zero or rounding-dominated: a bias whose gradient is zero in exact
  arithmetic (it feeds a normalisation, or softmax ignores it), to which
  Adam gives +-lr updates of rounding noise's sign. The floor is computed,
  not guessed, and only when some leaf needs it.

The floor is issue 42's op-by-op-versus-jit gap, computed in one compile
instead of hundreds: op by op (`eagerly`, `jax.disable_jit()`) compiles each
primitive and shape alone (140 s for a one-block transformer step on 2
loaded cores, against 60 s unfused). Measured on the zoo's small configs,
the unfused step equals op by op bitwise on every leaf of ResNet-18, and
its gap is 1.00-1.09x op by op's on the transformer's key biases; on
leaves that are rounding noise through and through (CycleGAN's
instance-normed conv biases and their Adam moments, both gaps 30-400% of
the leaf) 0.4-4x, median 1.0. XLA at optimisation level 0 is no stand-in:
it changes the convolution kernels, and its gap on ResNet-18 was up to 36x
op by op's. tests/test_oracle.py::test_the_unfused_floor_is_op_by_ops_gap
keeps checking it on an attention head's key bias and its Adam moments.

Two independent trajectories are never compared: each step is checked from
the same inputs (tests/test_runtime.py's `check_steps` feeds the state hetpar
returned, checked, into the next step of both), since tiny BatchNorm batches
make training chaotic and rounding at step 1 grows whatever the implementation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

# Per leaf. Measured (2 steps, small configs, CPU): ResNet-18 and MobileNet
# split layer by layer equal jit bitwise; the transformer pipelined (M=2)
# is within 2.4e-7 of every leaf. 1e-5 is well above that and an order
# under the 1e-4 perturbations the oracle must catch (tests/test_oracle.py).
RTOL = 1e-5
# Two different orders of f32 rounding (stages against one program, op by
# op against one program) differ by comparable amounts, not equal ones:
# CycleGAN split layer by layer put its noise leaves (instance-normed conv
# biases and their Adam moments) up to 2.5x further from jit than op by op.
FLOOR_FACTOR = 4.0


def on_cpu0(tree):
    """`tree` on this process's first CPU device, where the reference runs."""
    # A sharding, not the device: device_put to a bare device keeps the
    # buffer of an array in another memory of it (pinned_host) and fails.
    # An array sharded over several devices' pinned host memory comes to
    # their device memory first: JAX's reshard path refuses to change the
    # memory kind and the devices in one put.
    def device_memory(x):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
        if kind in (None, "device") or len(x.sharding.device_set) == 1:
            return x
        return jax.device_put(x, x.sharding.with_memory_kind("device"))

    tree = jax.tree_util.tree_map(device_memory, tree)
    return jax.device_put(tree, SingleDeviceSharding(jax.local_devices(backend="cpu")[0]))


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(x) -> np.ndarray:
    if _is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _is_float(a: np.ndarray) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)  # bfloat16 too


def _norm(a: np.ndarray) -> float:
    return float(np.sqrt(np.sum(np.asarray(a, np.float64) ** 2)))


#: ||want|| of recent float leaves, by identity: the oracle's own tests
#: compare hundreds of copies of one step's result, each wrong in one leaf
#: and sharing every other with it. The leaf is kept with its norm, so its
#: id cannot be reused while cached.
_SCALES: dict[int, tuple[object, float | None]] = {}
_SCALES_KEPT = 4096


def _scale(w) -> float | None:
    """||w|| (NaNs as 0), None where w holds an infinity (inf - inf is no
    error of 0: `leaf_errors` computes it in full)."""
    hit = _SCALES.get(id(w))
    if hit is not None and hit[0] is w:
        return hit[1]
    a = np.asarray(_host(w), np.float64)
    scale = None if np.isinf(a).any() else _norm(np.where(np.isnan(a), 0.0, a))
    if len(_SCALES) >= _SCALES_KEPT:
        _SCALES.clear()
    _SCALES[id(w)] = (w, scale)
    return scale


def leaf_errors(got, want) -> list[tuple[str, float, float]]:
    """(path, ||got - want||, ||want||) of every leaf, in tree order.

    Non-float leaves count as error 0 or inf (equal or not)."""
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    want_tree = jax.tree_util.tree_structure(want)
    assert got_tree == want_tree, f"tree structure differs:\n got  {got_tree}\n want {want_tree}"
    out = []
    for (path, w), g in zip(flat, got_leaves):
        name = jax.tree_util.keystr(path)
        if g is w and hasattr(w, "dtype") and _is_float(w) and not _is_key(w):
            scale = _scale(w)
            if scale is not None:
                out.append((name, 0.0, scale))  # the very same array: no error
                continue
        g, w = _host(g), _host(w)
        assert g.shape == w.shape, f"{name}: shape {g.shape} != {w.shape}"
        if not _is_float(w):
            out.append((name, 0.0 if np.array_equal(g, w) else float("inf"), 0.0))
            continue
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        same_nan = np.isnan(g) & np.isnan(w)
        d = np.where(same_nan, 0.0, g - w)
        err = _norm(d) if np.all(np.isfinite(d)) else float("inf")
        out.append((name, err, _norm(np.where(same_nan, 0.0, w))))
    return out


def relative_errors(got, want) -> dict[str, float]:
    """{leaf path: ||got - want|| / ||want||}; 0 or inf for an all-zero or
    non-float `want` leaf (equal or not)."""
    return {name: err / scale if scale else (0.0 if err == 0 else float("inf"))
            for name, err, scale in leaf_errors(got, want)}


def mismatches(got, want, eager: Callable[[], object] | object | None = None, *,
               rtol: float = RTOL) -> list[str]:
    """The leaves of `got` that do not equal `want` (see the module docstring).

    Args:
      got: the tree under test.
      want: the same step under `jax.jit`, from the same inputs.
      eager: the same step from the same inputs with nothing fused
        (`unfused` or `eagerly`), or a function that computes it (called at
        most once, when a leaf needs the floor); None: no floor.
      rtol: the per-leaf relative tolerance.

    Returns:
      One line per leaf that fails, empty when all pass.
    """
    errors = leaf_errors(got, want)
    failing = [k for k, (_, err, scale) in enumerate(errors) if err > rtol * scale]
    if failing and eager is not None:
        eager = eager() if callable(eager) else eager
        gaps = leaf_errors(eager, want)
        failing = [k for k in failing if errors[k][1] > FLOOR_FACTOR * gaps[k][1]]
    else:
        gaps = None
    lines = []
    for k in failing:
        name, err, scale = errors[k]
        floor = "" if gaps is None else f", unfused gap {gaps[k][1]:.3g}"
        lines.append(f"{name}: |got - jit| {err:.3g}, |jit| {scale:.3g}"
                     f" (relative {err / scale if scale else float('inf'):.3g}{floor})")
    return lines


# One unfused executable per step function and input shapes: a test checks
# several steps of one function, and each would compile it again.
_UNFUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unfused(fn: Callable, *args):
    """`fn(*args)` with nothing fused: each operation rounds on its own, as
    op by op, in one compile (XLA's fusion pass off)."""
    key = (jax.tree_util.tree_structure(args),
           tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))))
                 for x in jax.tree_util.tree_leaves(args)))
    by_shape = _UNFUSED.setdefault(fn, {})
    if key not in by_shape:
        by_shape[key] = jax.jit(fn).lower(*args).compile(
            compiler_options={"xla_disable_hlo_passes": "fusion"})
    return jax.block_until_ready(by_shape[key](*args))


def eagerly(fn: Callable, *args):
    """`fn(*args)` op by op: each primitive dispatched alone, nothing fused."""
    with jax.disable_jit():
        return jax.block_until_ready(fn(*args))


def assert_equals_jit(got, fn: Callable, inputs: Sequence, *, rtol: float = RTOL,
                      jitted: Callable | None = None):
    """Asserts `got` equals `jax.jit(fn)(*inputs)` leaf by leaf (module docstring).

    Args:
      got: hetpar's result of `fn` on `inputs`.
      fn: the step as written (microbatched already where that matters).
      inputs: the arguments both ran on.
      rtol: per-leaf relative tolerance.
      jitted: `jax.jit(fn)` when the caller keeps one (saves retracing).

    Returns:
      The reference `jax.jit(fn)(*inputs)`.
    """
    inputs = on_cpu0(tuple(inputs))
    want = (jitted or jax.jit(fn))(*inputs)
    bad = mismatches(got, want, lambda: unfused(fn, *inputs), rtol=rtol)
    assert not bad, "not equal to jax.jit, leaf by leaf:\n  " + "\n  ".join(bad)
    return want


def perturbations(before, after, *, relative: float = 1e-4, seed: int = 0):
    """Copies of `after` each wrong in one leaf, for testing the oracle.

    Yields (description, tree): for every float leaf of `after` with a
    nonzero value, the leaf moved by `relative` of its own L2 norm (a random
    direction); for every float leaf the step changed, the leaf left as it
    was in `before` (stale, un-updated). `before` is the step's input with
    `after`'s structure (the loss, which has no input, is left out there).
    """
    leaves, tree = jax.tree_util.tree_flatten_with_path(after)
    paths = [jax.tree_util.keystr(p) for p, _ in leaves]
    values = [x for _, x in leaves]
    old = jax.tree_util.tree_leaves(before) if before is not None else None
    rng = np.random.default_rng(seed)
    for k, (name, x) in enumerate(zip(paths, values)):
        a = _host(x)
        if not _is_float(a):
            continue
        norm = _norm(a)
        if norm > 0:
            d = rng.standard_normal(a.shape)
            d *= relative * norm / max(_norm(d), 1e-300)
            yield f"perturbed {name}", tree.unflatten(
                [*values[:k], jnp.asarray(a + d.astype(a.dtype)), *values[k + 1:]])
        if old is not None and k < len(old) and not np.array_equal(_host(old[k]), a):
            yield f"stale {name}", tree.unflatten([*values[:k], old[k], *values[k + 1:]])


def check_steps_equal_jit(auto_step: Callable, fn: Callable, args: Sequence, *,
                          batches: Sequence | None = None, steps: int = 3,
                          rtol: float = RTOL):
    """Runs `auto_step` for `steps` steps (or one per batch of `batches`),
    each checked against `jax.jit(fn)` from the same inputs, leaf by leaf.

    `fn(*state, batch)` returns `(*new_state, loss)`; the state hetpar
    returned, once checked, is both runs' next input. Returns the last result.
    """
    jitted = jax.jit(fn)
    *state, batch = args
    out = None
    for b in batches if batches is not None else [batch] * steps:
        out = auto_step(*state, b)
        assert_equals_jit(out, fn, (*state, b), rtol=rtol, jitted=jitted)
        state = out[:-1]
    return out
