"""FLOPs, transcendentals and bytes, counted by hetpar on the jaxpr.

This is the "before optimisation" column: every equation is counted as if
XLA ran it alone (it reads its operands and writes its results once). XLA's
own `cost_analysis` (the "after" column, `layer_costs` in `_xla`) counts a loop
body once and reports nothing for cuDNN convolutions and custom calls, so it
cannot be the only source (DESIGN, "Costs").

Conventions, chosen to match XLA's HloCostAnalysis where it is right:
- a multiply-add counts as 2 FLOPs; dot_general = 2 x output size x contracted size;
- a convolution counts 2 x the multiply-adds that touch real input: taps on
  padding or on a dilated input's holes are left out (XLA does the same);
- elementwise arithmetic and comparisons: 1 FLOP per output element;
  transcendental functions count as transcendentals, not FLOPs;
- reductions: 1 FLOP per input element;
- data movement (reshape, transpose, gather, ...): 0 FLOPs, bytes only;
- loops: body x trip count (scan: its length; fori-style while loops: the
  trip count read from literal bounds, else once, flagged as unknown);
  cond: the most expensive branch.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
from jax.extend import core as jcore

#: The op classes of hetpar's count (`op_class`, `Work.by_class`): the one
#: definition. The roofline predictor's coarser classes are derived from
#: these by `hetpar.cost_models.ROOFLINE_CLASS`, which must map every one.
OP_CLASSES = ("matmul", "elementwise", "reduction", "data_movement", "control_flow")

_TRANSCENDENTAL = frozenset(
    "exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh "
    "asinh acosh atanh sqrt rsqrt cbrt pow erf erfc erf_inv lgamma digamma igamma "
    "igammac random_gamma_grad bessel_i0e bessel_i1e".split()
)
_REDUCTION = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor "
    "argmax argmin reduce_precision cumsum cumprod cummax cummin cumlogsumexp "
    "reduce reduce_window reduce_window_sum reduce_window_max reduce_window_min "
    "select_and_scatter_add select_and_gather_add sort top_k".split()
)
_DATA_MOVEMENT = frozenset(
    "reshape broadcast_in_dim transpose squeeze expand_dims slice dynamic_slice "
    "dynamic_update_slice concatenate pad gather rev copy copy_p iota "
    "convert_element_type bitcast_convert_type device_put stop_gradient "
    "split real imag optimization_barrier".split()
)
_SCATTER = frozenset({"scatter", "scatter-add", "scatter_add", "scatter_mul", "scatter_min",
                      "scatter_max", "scatter_sub"})
_CONTROL = frozenset({"scan", "while", "cond"})


@dataclasses.dataclass
class Work:
    """What some equations cost: totals and per op class.

    Attributes:
      flops: floating-point (and integer arithmetic) operations.
      transcendentals: exp, log, tanh, ... evaluations.
      bytes_accessed: operand bytes read plus result bytes written, unfused.
      launches: equations that would be a kernel each without fusion.
      by_class: {op class: [flops, transcendentals, bytes]}.
      unknown_trip_counts: loops whose trip count could not be read (counted once).
    """

    flops: float = 0.0
    transcendentals: float = 0.0
    bytes_accessed: float = 0.0
    launches: int = 0
    by_class: dict = dataclasses.field(default_factory=lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    by_primitive: dict = dataclasses.field(
        default_factory=lambda: defaultdict(lambda: [0.0, 0.0, 0.0])
    )
    unknown_trip_counts: int = 0

    def add(self, other: Work, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.transcendentals += times * other.transcendentals
        self.bytes_accessed += times * other.bytes_accessed
        self.launches += int(times * other.launches)
        self.unknown_trip_counts += other.unknown_trip_counts
        for src, dst in ((other.by_class, self.by_class), (other.by_primitive, self.by_primitive)):
            for k, v in src.items():
                d = dst[k]
                for n in range(3):
                    d[n] += times * v[n]

    def _record(self, prim: str, cls: str, flops: float, trans: float, nbytes: float) -> None:
        self.flops += flops
        self.transcendentals += trans
        self.bytes_accessed += nbytes
        self.launches += 1
        for d in (self.by_class[cls], self.by_primitive[prim]):
            d[0] += flops
            d[1] += trans
            d[2] += nbytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte (0 when no bytes move)."""
        return self.flops / self.bytes_accessed if self.bytes_accessed else 0.0

    def to_json(self) -> dict:
        return {
            "flops": self.flops,
            "transcendentals": self.transcendentals,
            "bytes_accessed": self.bytes_accessed,
            "launches": self.launches,
            "by_class": {k: dict(zip(("flops", "transcendentals", "bytes_accessed"), v))
                         for k, v in self.by_class.items()},
        }


def _size(aval) -> int:
    shape = getattr(aval, "shape", None)
    return int(np.prod(shape)) if shape is not None else 0


def itemsize(dtype) -> int:
    """Bytes per element; PRNG key types report their key data's size."""
    if dtype is None:
        return 0
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys) are not numpy dtypes
        return int(getattr(dtype, "itemsize", 0) or 0)


def nbytes(aval) -> int:
    """Bytes of an abstract value (0 for tokens and other non-arrays)."""
    return _size(aval) * itemsize(getattr(aval, "dtype", None))


_bytes = nbytes


def _aval(a):
    return a.aval


def op_class(primitive: str) -> str:
    """The op class of a primitive: matmul, elementwise, reduction, data_movement, control_flow."""
    if primitive in ("dot_general", "conv_general_dilated", "ragged_dot_general"):
        return "matmul"
    if primitive in _REDUCTION:
        return "reduction"
    if primitive in _DATA_MOVEMENT or primitive in _SCATTER:
        return "data_movement"
    if primitive in _CONTROL:
        return "control_flow"
    return "elementwise"


def dot_general_flops(lhs_shape, rhs_shape, dimension_numbers) -> int:
    """2 x (output elements) x (contracted elements)."""
    (lc, rc), (lb, rb) = dimension_numbers
    contract = math.prod(lhs_shape[d] for d in lc)
    batch = math.prod(lhs_shape[d] for d in lb)
    lhs_free = math.prod(s for d, s in enumerate(lhs_shape) if d not in lc and d not in lb)
    rhs_free = math.prod(s for d, s in enumerate(rhs_shape) if d not in rc and d not in rb)
    return 2 * batch * lhs_free * rhs_free * contract


def ragged_dot_flops(lhs_shape, rhs_shape, ragged_dimension_numbers) -> int:
    """A grouped matmul's (`jax.lax.ragged_dot`, a mixture of experts'): each
    row of the ragged dimension meets one group, so the FLOPs are a
    dot_general's over the operands with the rhs's group dimensions left out."""
    (lc, rc), (lb, rb) = ragged_dimension_numbers.dot_dimension_numbers
    groups = set(ragged_dimension_numbers.rhs_group_dimensions)
    keep = [d for d in range(len(rhs_shape)) if d not in groups]
    at = {d: i for i, d in enumerate(keep)}
    return dot_general_flops(lhs_shape, [rhs_shape[d] for d in keep],
                             ((lc, [at[d] for d in rc]), (lb, [at[d] for d in rb])))


def conv_flops(lhs_shape, rhs_shape, out_shape, params) -> int:
    """2 x (real multiply-adds): output positions x kernel taps that land on real input.

    Taps that fall on padding or on the holes of a dilated input (the
    backward pass of a strided convolution) are not counted, as XLA's cost
    analysis does not count them. Feature groups enter through the kernel's
    input-feature dimension (C_in / groups).
    """
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    taps = 1
    for d, (pad_lo, _) in enumerate(params["padding"]):
        n = lhs_shape[lhs_spec[2 + d]]
        k = rhs_shape[rhs_spec[2 + d]]
        o = out_shape[out_spec[2 + d]]
        ld = params["lhs_dilation"][d] if params.get("lhs_dilation") else 1
        rd = params["rhs_dilation"][d] if params.get("rhs_dilation") else 1
        stride = params["window_strides"][d]
        pos = (np.arange(o)[:, None] * stride + np.arange(k)[None, :] * rd) - pad_lo
        real = (pos >= 0) & (pos <= (n - 1) * ld) & (pos % ld == 0)
        taps *= int(real.sum())
    out_batch = out_shape[out_spec[0]]
    out_features = out_shape[out_spec[1]]
    in_features = rhs_shape[rhs_spec[1]]
    return 2 * out_batch * out_features * in_features * taps


def _while_trip_count(eqn) -> int | None:
    """Trip count of a fori_loop-style while: `i < N` with literal N and literal start."""
    cond = eqn.params["cond_jaxpr"].jaxpr
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    lhs, rhs = cond.eqns[0].invars
    if not isinstance(rhs, jcore.Literal) or not isinstance(lhs, jcore.Var):
        return None
    try:
        pos = cond.invars.index(lhs) - eqn.params["cond_nconsts"]
    except ValueError:
        return None
    init = eqn.invars[eqn.params["cond_nconsts"] + eqn.params["body_nconsts"] + pos]
    if not isinstance(init, jcore.Literal):
        return None
    return max(0, int(rhs.val) - int(init.val))


def inner_jaxprs(eqn) -> list[tuple[jcore.Jaxpr, float]] | None:
    """The jaxprs a control-flow or call equation runs, each with how many
    times a step runs it; None for an equation that holds none.

    A scan's body `length` times; a while's body and condition by its trip
    count (`_while_trip_count`; once when not literal bounds); a cond's
    costliest branch (FLOPs, then bytes) once; a call's (pjit, remat,
    custom_jvp/vjp_call, closed_call) primal body once: its jvp, fwd and bwd
    rules are not what runs. The one place these choices are made:
    `eqn_work` and `leaf_equations` both walk by them.
    """
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        return [(params["jaxpr"].jaxpr, float(params["length"]))]
    if name == "while":
        known = _while_trip_count(eqn)
        trips = 1.0 if known is None else float(known)  # a known 0 runs nothing
        return [(params["body_jaxpr"].jaxpr, trips), (params["cond_jaxpr"].jaxpr, trips)]
    if name == "cond":
        def cost(branch):
            w = jaxpr_work(branch.jaxpr)
            return (w.flops, w.bytes_accessed)

        return [(max(params["branches"], key=cost).jaxpr, 1.0)]
    sub = [v for v in params.values() if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))]
    if sub:
        s = sub[0]
        return [(s.jaxpr if isinstance(s, jcore.ClosedJaxpr) else s, 1.0)]
    return None


def leaf_equations(eqns, times: float = 1.0):
    """(equation, times, producers) for every equation under `eqns` that
    holds no jaxpr, walked into control flow and calls by `inner_jaxprs`;
    `times` is how many times a step runs it, and `producers` maps the
    outputs of its own level's equations (by id) to their primitive's name."""
    producers = {id(o): e.primitive.name for e in eqns for o in e.outvars}
    for e in eqns:
        inner = inner_jaxprs(e)
        if inner is None:
            yield e, times, producers
        else:
            for jaxpr, n in inner:
                yield from leaf_equations(jaxpr.eqns, times * n)


def eqn_work(eqn) -> Work:
    """What one equation costs, recursing into the jaxprs it holds."""
    w = Work()
    name = eqn.primitive.name
    params = eqn.params
    inner = inner_jaxprs(eqn)
    if inner is not None:
        for jaxpr, times in inner:
            w.add(jaxpr_work(jaxpr), times=times)
        if name == "while" and _while_trip_count(eqn) is None:
            w.unknown_trip_counts += 1
        return w
    in_avals = [_aval(a) for a in eqn.invars]
    out_avals = [_aval(o) for o in eqn.outvars]
    io_bytes = sum(_bytes(a) for a in in_avals) + sum(_bytes(a) for a in out_avals)
    out_size = sum(_size(a) for a in out_avals)

    cls = op_class(name)
    flops = trans = 0.0
    nbytes = float(io_bytes)
    if name == "dot_general":
        flops = dot_general_flops(in_avals[0].shape, in_avals[1].shape,
                                  params["dimension_numbers"])
    elif name == "conv_general_dilated":
        flops = conv_flops(in_avals[0].shape, in_avals[1].shape, out_avals[0].shape, params)
    elif name == "ragged_dot_general":
        flops = ragged_dot_flops(in_avals[0].shape, in_avals[1].shape,
                                 params["ragged_dot_dimension_numbers"])
    elif cls == "reduction":
        flops = float(sum(_size(a) for a in in_avals[:1]))
    elif name in ("gather", "dynamic_slice"):
        # Reads only the gathered elements of the operand, not all of it.
        nbytes = float(sum(_bytes(a) for a in in_avals[1:]) + 2 * sum(_bytes(a) for a in out_avals))
    elif name in _SCATTER or name == "dynamic_update_slice":
        upd = in_avals[-1]
        flops = float(_size(upd)) if name != "scatter" and name != "dynamic_update_slice" else 0.0
        # In place: reads indices and updates, read-modify-writes the touched elements.
        nbytes = float(sum(_bytes(a) for a in in_avals[1:]) + 2 * _bytes(upd))
    elif cls == "data_movement":
        pass
    elif name in _TRANSCENDENTAL:
        trans = float(out_size)
    elif name == "integer_pow":
        y = abs(int(params["y"]))
        flops = float(out_size * max(1, y.bit_length() + bin(y).count("1") - 2))
    else:
        flops = float(out_size)
    w._record(name, cls, float(flops), trans, nbytes)
    return w


def jaxpr_work(jaxpr: jcore.Jaxpr) -> Work:
    """Sum of `eqn_work` over a jaxpr's equations."""
    return eqns_work(jaxpr.eqns)


def eqns_work(eqns: Iterable) -> Work:
    total = Work()
    for e in eqns:
        total.add(eqn_work(e))
    return total
