"""`hetpar.value_and_grad` / `hetpar.grad`: JAX's, plus a mark for microbatching.

Outside `hetpar.auto` (or with one microbatch) they are exactly
`jax.value_and_grad` / `jax.grad`. When `hetpar.auto(..., microbatches=M)`
traces a step, they split the step's batch into M microbatches, take the
gradient of each inside a named scope `hetpar_mb<i>` and average them. The
trace then holds M independent forward/backward chains per layer (which the
stage splitter turns into a device pipeline) followed by one accumulation
and one optimizer update (Alpa's `alpa.grad` idea, done at trace time).

What each microbatch gets (docs/architecture/microbatching.md, "Microbatching and random
keys"): every array the loss reads, as an argument or closed over, is sorted
by where it comes from in the step being traced:

- the step's batch (`batch_argnums` of `hetpar.auto`), or an array computed
  from it that keeps the batch axis first: cut along axis 0;
- a PRNG key that does not come from the batch (a typed `jax.random.key`, or
  a raw `uint32[2]` `jax.random.PRNGKey`): microbatch i gets
  `jax.random.fold_in(key, i)`;
- anything else (parameters, optimizer state, constants, batch statistics):
  passed whole.

An array computed from the batch whose leading dimension is the batch size
but whose first axis is not the batch axis (`x.T` of a square batch) cannot
be sorted and raises `HetparError`. `batch_argnums=` here names loss arguments
to cut explicitly (the others are then passed whole, keys folded).

Closed-over arrays are found by tracing the loss once (`jax.make_jaxpr`: its
consts are the outer tracers it reads) and replaced by rebuilding the loss's
Python closure (cells of nested functions, `functools.partial` arguments,
pytrees such as dicts and Flax `TrainState`s) with the microbatch's values.
Where an array comes from is read from the data flow of the step traced so
far (JAX's tracing frame; `_frame_eqns`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import sys
import threading
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from hetpar.core import HetparError
from hetpar.passes import MICROBATCH_SCOPE
from hetpar.passes._program import StaticLeaves


@dataclasses.dataclass
class _Microbatching:
    count: int
    batch_leaves: list  # the step's batch tracers, compared by identity


_state = threading.local()


@contextlib.contextmanager
def microbatching(count: int | None, batch_leaves: Sequence[Any] = ()):
    """While tracing under this context, marked gradients run as `count` microbatches.

    `count=None` suspends microbatching (inside a microbatch's own gradient).
    """
    prev = getattr(_state, "mb", None)
    _state.mb = None if count is None else _Microbatching(count, list(batch_leaves))
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
        along axis 0 into microbatches; the other arguments go whole, PRNG keys
        among them folded per microbatch). Default: every input of `fun`,
        argument or closed-over, that is the step's batch or computed from it
        along the batch axis (see the module docstring).

    Returns:
      A function with `jax.value_and_grad`'s signature and results. Under
      microbatching, the value is the microbatch mean and the gradient the
      mean of the microbatch gradients: equal to the full-batch result when
      the loss is a mean over the batch and uses no randomness (microbatch i
      draws from `jax.random.fold_in(key, i)`). Aux outputs are recombined
      leaf by leaf (`_combine_aux`): per-example ones (logits) concatenated,
      as the full batch gives them; floats of the full batch's shape
      averaged (a mean over the batch, an accuracy, Flax BatchNorm's
      updated statistics: the mean of the microbatches'); anything else a
      HetparError naming the output.

      With Flax NNX objects among the arguments (an `nnx.Module`), the
      gradient is `nnx.value_and_grad`'s (with respect to their `nnx.Param`s),
      so an NNX step writes `hetpar.value_and_grad` where it wrote
      `nnx.value_and_grad`.

      Leaves of the arguments that are not arrays or Python numbers (an
      Equinox model's activation function), where JAX's would raise, are
      static as under `eqx.filter_value_and_grad`: the loss closes over them
      and their gradient is None.
    """
    def wrapped(*args):
        # Flax NNX objects among the arguments (a Module): the gradient is
        # nnx.value_and_grad's, with respect to their nnx.Param variables.
        transform = _nnx_value_and_grad() if _holds_nnx(args) else jax.value_and_grad
        static = StaticLeaves(fun, args)
        f = fun
        if static.in_args:
            f, args = static.pure_step, static.pure_args
        g = transform(f, argnums=argnums, has_aux=has_aux, **kwargs)
        mb = getattr(_state, "mb", None)
        if mb is None or mb.count == 1:
            value, grads = g(*args)
        else:
            with microbatching(None):  # a gradient inside the loss is a plain one
                grad_of = functools.partial(transform, argnums=argnums,
                                            has_aux=has_aux, **kwargs)
                value, grads = _microbatch(f, grad_of, args, mb, batch_argnums, has_aux)
        return static.result(value), grads

    return wrapped


def _holds_nnx(args) -> bool:
    nnx = sys.modules.get("flax.nnx")  # not imported: no NNX object can be here
    if nnx is None:
        return False
    is_object = lambda x: isinstance(x, nnx.Pytree)  # noqa: E731
    return any(map(is_object, jax.tree_util.tree_leaves(args, is_leaf=is_object)))


def _nnx_value_and_grad():
    return sys.modules["flax.nnx"].value_and_grad


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


# -- one marked gradient as M microbatches ------------------------------------


class _Role(enum.Enum):
    SLICE = "slice"  # batch data: microbatch i gets rows [i*n/M, (i+1)*n/M)
    FOLD = "fold"    # a PRNG key: microbatch i gets fold_in(key, i)
    WHOLE = "whole"  # everything else


def _microbatch(fun, grad_of, args, mb: _Microbatching, batch_argnums, has_aux=False):
    m = mb.count
    explicit = set() if batch_argnums is None else {k % len(args) for k in batch_argnums}
    n = _batch_size([args[k] for k in explicit] if explicit else mb.batch_leaves)
    if n is not None and n % m:
        raise HetparError(
            f"batch size {n} is not divisible by microbatches={m}; choose a microbatch "
            f"count that divides the batch size (divisors of {n}).")
    closed, whole_out = _closed_over(fun, args, with_shape=True)
    sorter = _Sorter(mb.batch_leaves, n)
    roles: dict[int, _Role] = {}
    for k, a in enumerate(args):
        for leaf in jax.tree_util.tree_leaves(a):
            if k in explicit and _leads_with(leaf, n) and not is_key(leaf):
                roles[id(leaf)] = _Role.SLICE
            elif explicit:
                roles.setdefault(id(leaf), _Role.FOLD if is_key(leaf) else _Role.WHOLE)
            else:
                roles.setdefault(id(leaf), sorter.role(leaf, "an argument of the loss"))
    for c in closed:
        roles.setdefault(id(c), sorter.role(c, "an array the loss closes over"))
    if _Role.SLICE not in roles.values():
        raise HetparError(
            "hetpar.value_and_grad was asked for microbatches but none of the loss's inputs "
            "(its arguments and the arrays it closes over) is the step's batch (batch_argnums "
            "of hetpar.auto) or computed from it along the batch axis. Pass the batch to the "
            "loss as an argument and name it with batch_argnums=... of hetpar.value_and_grad.")
    swapped = [c for c in closed if roles[id(c)] is not _Role.WHOLE]

    results, first = [], None
    for i in range(m):
        # The slicing belongs to the microbatch too: it is where its forward starts.
        with jax.named_scope(f"{MICROBATCH_SCOPE}{i}"):
            def part(x, i=i):
                role = roles.get(id(x), _Role.WHOLE)
                if role is _Role.SLICE:
                    return _cut(x, i, m, n)
                return _fold(x, i) if role is _Role.FOLD else x

            part_args = [jax.tree_util.tree_map(part, a) for a in args]
            # Each microbatch's loss gets its own copies of the dicts and lists
            # it closes over: a `batch.pop("labels")` in it (transformers'
            # run_clm_flax.py) then pops from its copy, once per microbatch.
            rebinder = _Rebinder({id(c): part(c) for c in swapped}, copy=True)
            fun_i = rebinder(fun, 0)
            _check_all_rebound(rebinder, swapped, roles)
            if swapped and i == 0:
                _check_rebound(fun_i, part_args, swapped)
            try:
                results.append(grad_of(fun_i)(*part_args))
            except (KeyError, IndexError) as e:
                if whole_out is None:  # the whole batch's trace failed too: not this
                    raise
                raise _lost_to_mutation(e) from e
            first = first or rebinder
    # What the loss did to the containers it closes over, it did to its copies:
    # done once more on the originals, the step then sees them as under JAX.
    first.replay()
    values, grads = zip(*results)
    grads = jax.tree_util.tree_map(lambda *xs: _mean(xs), *grads)
    if not has_aux:
        return _mean(values), grads
    aux = _combine_aux([v[1] for v in values], None if whole_out is None else whole_out[1], m)
    return (_mean([v[0] for v in values]), aux), grads


def _closed_over(fun, args, with_shape: bool = False):
    """The arrays `fun(*args)` reads besides its arguments (tracers of the step, constants),
    and, `with_shape`, the shapes of its result on these arguments (None where
    it does not trace).

    Traced on copies of the dicts and lists `fun` closes over and of the
    arguments' containers, so that a loss that pops from its batch dict
    leaves the step's dict as it was.
    """
    fun = _Rebinder({}, copy=True)(fun, 0)
    args = [jax.tree_util.tree_map(lambda x: x, a) for a in args]
    try:
        jaxpr, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    except Exception:  # noqa: BLE001 - the real call below raises JAX's own error
        return ([], None) if with_shape else []
    seen, out = set(), []
    for c in jaxpr.consts:
        if id(c) not in seen and hasattr(c, "shape"):
            seen.add(id(c))
            out.append(c)
    return (out, shape) if with_shape else out


def _leading(x) -> int | None:
    return x.shape[0] if getattr(x, "ndim", 0) else None


def _leads_with(x, n: int | None) -> bool:
    """Whether `x` (an array or an aval) has the batch size `n` as its leading dimension."""
    return n is not None and _leading(x) == n


@functools.cache
def _raw_key_shape(impl: str) -> tuple[int, ...]:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def is_key(x) -> bool:
    """A typed PRNG key (array), or a raw key of the default implementation (uint32[2])."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    impl = str(jax.config.jax_default_prng_impl)
    return dtype == jnp.uint32 and tuple(x.shape) == _raw_key_shape(impl)


def _fold(key, i: int):
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim:
        flat = jax.vmap(lambda k: jax.random.fold_in(k, i))(key.reshape(-1))
        return flat.reshape(key.shape)
    return jax.random.fold_in(key, i)


def _cut(x, i: int, m: int, n: int):
    size = n // m
    return jax.lax.slice_in_dim(x, i * size, (i + 1) * size, axis=0)


# -- where an input comes from ------------------------------------------------


_ROW, _OTHER = "row", "other"  # from the batch: batch axis first / batch axis elsewhere

# Calls whose inner jaxpr the data flow is followed through.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                    "custom_vjp_call", "checkpoint", "remat"})


def _frame_eqns(tracer):
    """The equations traced so far in `tracer`'s tracing frame (None if not a jaxpr trace).

    JAX internals (DynamicJaxprTracer.val, DynamicJaxprTrace.frame.get_eqns), checked by
    tests/test_microbatching.py::test_jax_tracing_frame_contract.
    """
    frame = getattr(getattr(tracer, "_trace", None), "frame", None)
    if frame is None or not hasattr(frame, "get_eqns") or not hasattr(tracer, "val"):
        return None
    return frame.get_eqns()


class _Sorter:
    """Gives each input of the loss its role, from the data flow of the step so far."""

    def __init__(self, batch_leaves, n):
        self.n = n
        self.batch_ids = {id(b) for b in batch_leaves}
        tracer = next((b for b in batch_leaves if isinstance(b, jax.core.Tracer)), None)
        self.trace = getattr(tracer, "_trace", None)
        eqns = _frame_eqns(tracer) if tracer is not None else None
        self.states: dict | None = None
        if eqns is not None:
            start = {}
            for b in batch_leaves:
                if is_key(b):
                    continue  # a key in the batch: what it draws is not the batch's rows
                if getattr(b, "_trace", None) is self.trace and isinstance(b.val, jcore.Var):
                    start[b.val] = _ROW if _leads_with(b, n) else _OTHER
            self.states = _flow(eqns, start, n)

    def role(self, x, what: str) -> _Role:
        if self._is_batch(x, what):
            return _Role.SLICE
        # A key not cut with the batch, wherever it comes from, gets a stream per microbatch.
        return _Role.FOLD if is_key(x) else _Role.WHOLE

    def _is_batch(self, x, what: str) -> bool:
        if id(x) in self.batch_ids:
            # A raw key (uint32[2]) in a batch of 2 leads with the batch size
            # too: it is a key all the same, folded, never cut.
            return _leads_with(x, self.n) and not is_key(x)
        if not isinstance(x, jax.core.Tracer):
            return False  # a constant of the step: never cut
        if self.states is not None and getattr(x, "_trace", None) is self.trace:
            state = self.states.get(x.val) if isinstance(x.val, jcore.Var) else None
            if state == _OTHER and _leads_with(x, self.n) and not is_key(x):
                raise self._ambiguous(x, what, "is computed from the step's batch, but an "
                                      "operation on the way (a transpose, a matrix product "
                                      "or reduction over the batch axis) put another axis first")
            # _OTHER without the batch size first (batch statistics): one value for all.
            return state == _ROW
        if _leads_with(x, self.n) and not is_key(x):
            raise self._ambiguous(x, what, "was computed inside a transformation in the step "
                                  "(vmap, scan, an inner jit), where hetpar cannot see whether "
                                  "it comes from the batch")
        return False

    def _ambiguous(self, x, what, why) -> HetparError:
        return HetparError(
            f"microbatching: {what} ({x.dtype}{list(x.shape)}) has the batch size {self.n} as "
            f"its leading dimension and {why}, so hetpar cannot tell whether to split it into "
            "microbatches. Pass it to the loss as an argument instead of closing over it, and "
            "list that argument in batch_argnums=... of hetpar.value_and_grad to split it "
            "along axis 0 (arguments left out of batch_argnums are passed whole); or compute "
            "it inside the loss from the batch.")


def _flow(eqns, states: dict, n) -> dict:
    """Propagates _ROW/_OTHER from the batch's vars through `eqns` (in program order)."""
    for eqn in eqns:
        ins = [states.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
        if not any(ins):
            continue
        outs = [o for o in eqn.outvars if isinstance(o, jcore.Var)]
        inner = _inner_jaxpr(eqn)
        if inner is not None:
            sub = _flow(inner.eqns, {v: s for v, s in zip(inner.invars, ins) if s}, n)
            for o, io in zip(eqn.outvars, inner.outvars):
                s = sub.get(io) if isinstance(io, jcore.Var) else None
                if s and isinstance(o, jcore.Var):
                    states[o] = s if s == _OTHER or _leads_with(o.aval, n) else _OTHER
            continue
        state = _ROW if _keeps_batch_first(eqn, ins, n) else _OTHER
        for o in outs:
            states[o] = state
    return states


def _inner_jaxpr(eqn):
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        j = getattr(j, "jaxpr", j)
        if isinstance(j, jcore.Jaxpr) and len(j.invars) == len(eqn.invars):
            return j
    return None


def _keeps_batch_first(eqn, ins, n) -> bool:
    """Whether an equation on batch-first operands (ins: their states) gives batch-first results.

    Results must still lead with n. Transposes, broadcasts, reductions, matrix
    products and convolutions can put another axis first and are checked; any
    other primitive keeps the batch axis where its operands had it (or mixes
    examples along it, as a permutation or a mixup does, which keeps it an
    axis of examples).
    """
    if _OTHER in ins or not all(_leads_with(o.aval, n) for o in eqn.outvars):
        return False
    name, p = eqn.primitive.name, eqn.params
    if name == "transpose":
        return p["permutation"][0] == 0
    if name == "broadcast_in_dim":
        return p["broadcast_dimensions"][:1] == (0,)
    if "axes" in p and isinstance(p["axes"], tuple):  # reductions, argmax/argmin
        return 0 not in p["axes"]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        lhs, rhs = ins[0], ins[1]
        if lb:  # batched product: the output starts with the batch dims
            return lb[0] == 0 and rb[0] == 0
        return lhs == _ROW and rhs is None and 0 not in lc
    if name == "conv_general_dilated":
        dn = p["dimension_numbers"]
        return (ins[0] == _ROW and ins[1] is None and dn.lhs_spec[0] == 0
                and dn.out_spec[0] == 0 and p.get("batch_group_count", 1) == 1)
    return True


# -- rebuilding the loss's closure ------------------------------------------


def _check_all_rebound(rebinder: _Rebinder, swapped, roles) -> None:
    missing = [c for c in swapped if id(c) not in rebinder.hit]
    if missing:
        c = missing[0]
        what = ("a PRNG key" if roles[id(c)] is _Role.FOLD else "the step's batch (or an "
                "array computed from it)")
        raise HetparError(
            f"microbatching: the loss reads {what} ({c.dtype}{list(c.shape)}) through "
            "something hetpar cannot rebuild per microbatch (a global, an object's attribute, "
            "a class instance's method). Pass it to the loss as an argument instead "
            "(e.g. loss(params, x, y, key)); arguments that are the step's batch are split "
            "into microbatches and keys folded per microbatch.")


def _lost_to_mutation(e: Exception) -> HetparError:
    """A microbatch's loss missing a key or item: the loss changed (popped
    from) a container hetpar does not copy per microbatch (one reached
    through a global or an object's attribute), so the first trace took what
    the next one looks for."""
    where = ""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/jax/" not in f.filename and not f.filename.endswith("hetpar/_grad.py")]
    if frames:
        f = frames[-1]
        where = f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"
    return HetparError(
        f"microbatching: the loss raised {type(e).__name__}: {e}{where}; a loss traced once "
        "per microbatch finds a container as the last trace left it, and hetpar copies per "
        "microbatch only the dicts and lists the loss closes over or takes as arguments, not "
        "one reached through a global or an object's attribute. Read it without changing "
        "it (batch['labels'] rather than batch.pop('labels')), or pass it to the loss.")


class _Rebinder:
    """Copies a callable with some closed-over arrays replaced; the original is untouched.

    Walks closure cells and defaults of Python functions, `functools.partial`
    and bound methods' functions, and pytrees (dicts, lists, dataclass states).
    """

    _ATOMS = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType)
    _MAX_DEPTH = 8

    def __init__(self, subst: dict[int, Any], copy: bool = False):
        self.subst = subst
        self.copy = copy  # copy every dict and list reached, changed or not
        self.hit: set[int] = set()
        self.memo: dict[int, Any] = {}
        self.copies: list[tuple[Any, Any, Any]] = []  # (original, copy, copy's first contents)

    def __call__(self, obj, depth: int):
        key = id(obj)
        if key in self.subst:
            self.hit.add(key)
            return self.subst[key]
        if key in self.memo:
            return self.memo[key]
        if (depth > self._MAX_DEPTH or isinstance(obj, self._ATOMS)
                or isinstance(obj, jax.Array) or hasattr(obj, "__array__")):
            return obj
        self.memo[key] = obj  # a cycle (a recursive function) keeps the original
        new = self._rebuild(obj, depth + 1)
        self.memo[key] = new
        return new

    def _rebuild(self, obj, depth):
        if self.copy and type(obj) in (dict, list):
            if type(obj) is dict:
                new = {k: self(v, depth) for k, v in obj.items()}
                self.copies.append((obj, new, dict(new)))
            else:
                new = [self(v, depth) for v in obj]
                self.copies.append((obj, new, list(new)))
            return new
        if isinstance(obj, types.FunctionType):
            return self._function(obj, depth)
        if isinstance(obj, functools.partial):
            func = self(obj.func, depth)
            pargs = [self(a, depth) for a in obj.args]
            kw = {k: self(v, depth) for k, v in obj.keywords.items()}
            if func is obj.func and all(a is b for a, b in zip(pargs, obj.args)) and all(
                    kw[k] is obj.keywords[k] for k in kw):
                return obj
            return functools.partial(func, *pargs, **kw)
        if isinstance(obj, types.MethodType):
            func, self_ = self(obj.__func__, depth), self(obj.__self__, depth)
            if func is obj.__func__ and self_ is obj.__self__:
                return obj
            return types.MethodType(func, self_)
        try:
            leaves, treedef = jax.tree_util.tree_flatten(obj)
        except Exception:  # noqa: BLE001 - not a pytree we can take apart
            return obj
        if treedef.num_leaves == 1 and leaves and leaves[0] is obj:
            return obj  # a leaf: an object hetpar does not look into
        new = [self(leaf, depth) for leaf in leaves]
        if all(a is b for a, b in zip(new, leaves)):
            return obj
        return jax.tree_util.tree_unflatten(treedef, new)

    def replay(self) -> None:
        """Applies to the originals what the loss did to their copies: keys it
        removed (`batch.pop("labels")`, `del batch["mask"]`) are removed.
        Raises HetparError where it set or replaced a value, or changed a
        list: that value is one microbatch's, not the batch's."""
        for orig, new, before in self.copies:
            if type(orig) is dict:
                gone = [k for k in before if k not in new]
                changed = [k for k in new if k not in before or new[k] is not before[k]]
            else:
                gone, changed = [], [] if new == before else ["an item"]
            if changed:
                raise HetparError(
                    f"microbatching: the loss sets {changed[0]!r} in a "
                    f"{type(orig).__name__} it closes over; under microbatches each "
                    "microbatch's loss would set its own value and the step could read only "
                    "one. Return the value from the loss instead (has_aux=True).")
            for k in gone:
                orig.pop(k, None)

    def _function(self, f, depth):
        cells = f.__closure__ or ()
        contents = []
        for cell in cells:
            try:
                contents.append(cell.cell_contents)
            except ValueError:  # an empty cell (a name not yet bound)
                contents.append(cell)
        new_contents = [c if isinstance(c, types.CellType) else self(c, depth)
                        for c in contents]
        defaults = f.__defaults__ or ()
        new_defaults = tuple(self(d, depth) for d in defaults)
        kwdefaults = f.__kwdefaults__ or {}
        new_kwdefaults = {k: self(v, depth) for k, v in kwdefaults.items()}
        if (all(a is b for a, b in zip(new_contents, contents))
                and all(a is b for a, b in zip(new_defaults, defaults))
                and all(new_kwdefaults[k] is v for k, v in kwdefaults.items())):
            return f
        closure = tuple(cell if new is old else types.CellType(new)
                        for cell, old, new in zip(cells, contents, new_contents))
        g = types.FunctionType(f.__code__, f.__globals__, f.__name__,
                               new_defaults or f.__defaults__, closure or None)
        g.__kwdefaults__ = new_kwdefaults or f.__kwdefaults__
        g.__dict__.update(f.__dict__)
        g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__
        return g


def _check_rebound(fun_i, part_args, swapped) -> None:
    """The rebuilt loss must read none of the arrays it replaces (no second path to them)."""
    left = {id(c) for c in _closed_over(fun_i, part_args)} & {id(c) for c in swapped}
    if left:
        c = next(c for c in swapped if id(c) in left)
        raise HetparError(
            f"microbatching: the loss still reads the whole {c.dtype}{list(c.shape)} array "
            "after hetpar rebuilt its closure for a microbatch (it reaches it a second way: "
            "a global or an object's attribute). Pass it to the loss as an argument instead.")


# -- batch size and accumulation ------------------------------------------------


def _batch_size(trees) -> int | None:
    """The batch size: the most common leading dimension among the batch
    leaves, PRNG keys (a raw key's 2) left out."""
    dims = [x.shape[0] for t in trees for x in jax.tree_util.tree_leaves(t)
            if getattr(x, "ndim", 0) and not is_key(x)]
    if not dims:
        return None
    return max(set(dims), key=lambda d: (dims.count(d), d))


def _combine_aux(auxes: list, whole, m: int):
    """The microbatches' aux outputs as one, leaf by leaf, by comparing each
    leaf's shape for a microbatch with its shape for the whole batch (`whole`,
    from tracing the loss on it; None where that failed):

    - per example (the whole batch's leaf has M times the rows): concatenated
      along axis 0, as the whole batch would give it;
    - the same shape (a reduction over the batch, or no batch in it): floats
      are the microbatches' mean, which is the whole batch's value for a mean
      over the batch (an accuracy; Flax BatchNorm's running mean); PRNG keys
      and arrays every microbatch returns alike are microbatch 0's;
      integers that differ between microbatches (a count over the batch)
      cannot be recombined;
    - any other shape cannot be recombined.

    Raises:
      HetparError: naming the aux leaf that cannot be recombined, and how to
        return it.
    """
    paths_leaves, tree = jax.tree_util.tree_flatten_with_path(auxes[0])
    columns = [[leaf] for _, leaf in paths_leaves]
    for aux in auxes[1:]:
        for col, leaf in zip(columns, tree.flatten_up_to(aux)):
            col.append(leaf)
    try:
        wholes = tree.flatten_up_to(whole) if whole is not None else [None] * len(columns)
    except (ValueError, TypeError):  # another structure for the whole batch
        wholes = [None] * len(columns)
    out = []
    for (path, x), xs, w in zip(paths_leaves, columns, wholes):
        shape = tuple(getattr(x, "shape", ()))
        full = None if w is None else tuple(getattr(w, "shape", ()))
        name = "aux" + jax.tree_util.keystr(path)

        if full is not None and shape and full != shape:
            if full[1:] == shape[1:] and full[0] == m * shape[0]:
                out.append(jnp.concatenate(xs, axis=0))
                continue
            raise _unrecombined(name, x, full, "cannot be recombined from its microbatches")
        dtype = jnp.result_type(x) if hasattr(x, "dtype") else None
        if (dtype is None or all(y is x for y in xs)
                or jnp.issubdtype(dtype, jax.dtypes.prng_key)):
            out.append(x)
        elif jnp.issubdtype(dtype, jnp.inexact):
            out.append(_mean(xs))
        else:
            raise _unrecombined(name, x, full, "differs between microbatches and is not a "
                                "mean, so cannot be recombined")
    return jax.tree_util.tree_unflatten(tree, out)


def _unrecombined(name: str, x, full, why: str) -> HetparError:
    shape = list(getattr(x, "shape", ()))
    return HetparError(
        f"microbatching: the loss's aux output {name} ({getattr(x, 'dtype', type(x).__name__)}"
        f"{shape} per microbatch" + ("" if full is None else f", {list(full)} for the whole "
                                     "batch")
        + f") {why}; return it per example (batch axis first: microbatches are concatenated) "
        "or as a float mean over the batch (microbatches are averaged).")


def _mean(xs):
    x0 = xs[0]
    if not jnp.issubdtype(jnp.result_type(x0), jnp.inexact):
        return x0  # integer/bool aux (counters): identical across microbatches
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total / len(xs)
