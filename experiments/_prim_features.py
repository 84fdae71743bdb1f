"""Per-primitive features of zoo layers, from their jaxpr (no device).

`layer_features(graph, layer)` walks the layer's equations (forward,
backward and update, as the layer holds them), recursing into pjit /
custom_jvp / remat bodies and into loops (a scan's body counts `length`
times), and sums per primitive group: equation count, FLOPs (transcendental
evaluations count as FLOPs of the `trans` group) and bytes in + out
(`hetpar.passes.eqn_work`'s unfused count). dot_general and convolution
FLOPs are also binned by FLOPs per equation (`SIZE_BINS`). Equations inside
loops also count in the `loop` group (count = trips x inner equations).
"""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

GROUPS = ("dot", "conv", "conv_dw", "conv_tr", "ew", "trans", "red", "gather", "layout",
          "loop", "other")

#: FLOPs-per-equation bins of the GEMM-size-aware term (dot and conv together).
SIZE_BINS = (1e7, 1e9)

_TRANS = frozenset(
    "exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh "
    "asinh acosh atanh sqrt rsqrt cbrt pow erf erfc erf_inv lgamma digamma igamma "
    "igammac".split())
_RED = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin "
    "cumsum cumprod cummax cummin cumlogsumexp reduce reduce_window reduce_window_sum "
    "reduce_window_max reduce_window_min select_and_scatter_add select_and_gather_add sort "
    "top_k reduce_precision".split())
_GATHER = frozenset(
    "gather scatter scatter-add scatter_add scatter_mul scatter_min scatter_max scatter_sub "
    "dynamic_slice dynamic_update_slice".split())
_LAYOUT = frozenset(
    "reshape broadcast_in_dim transpose squeeze expand_dims slice concatenate pad rev copy "
    "copy_p iota split".split())
_EW = frozenset(
    "add sub mul div neg max min abs sign floor ceil round select_n eq ne lt le gt ge and or "
    "not xor integer_pow square convert_element_type clamp rem nextafter is_finite "
    "shift_left shift_right_logical shift_right_arithmetic add_any stop_gradient".split())


def group_of(eqn) -> str:
    name = eqn.primitive.name
    if name == "dot_general":
        return "dot"
    if name == "conv_general_dilated":
        p = eqn.params
        if p["feature_group_count"] > 1 or p["batch_group_count"] > 1:
            return "conv_dw"
        if any(d > 1 for d in (p.get("lhs_dilation") or ())):
            return "conv_tr"
        return "conv"
    if name in _TRANS:
        return "trans"
    if name in _RED:
        return "red"
    if name in _GATHER:
        return "gather"
    if name in _LAYOUT:
        return "layout"
    if name in _EW:
        return "ew"
    return "other"


def leaf_equations(eqns, times: float = 1, in_loop: bool = False):
    """Yields `(eqn, times, in_loop, producers)` for every equation that is no
    control flow or call, walked as hetpar walks them (`hetpar.passes.inner_jaxprs`:
    a scan's body `length` times, a while's by its trip count, a cond's
    costliest branch, a call's primal body), less a while's condition (these
    features never counted it). `producers` maps each output variable of the
    equation's own level (by id) to its primitive's name."""
    from hetpar.passes import inner_jaxprs

    producers = {id(o): e.primitive.name for e in eqns for o in e.outvars}
    for e in eqns:
        inner = inner_jaxprs(e)
        if inner is None:
            yield e, times, in_loop, producers
            continue
        name = e.primitive.name
        for jaxpr, n in inner[:1] if name == "while" else inner:
            yield from leaf_equations(jaxpr.eqns, times * n, in_loop or name in ("scan", "while"))


def _walk(eqns, times, in_loop, acc):
    from hetpar.passes import eqn_work

    for e, reps, looped, _ in leaf_equations(eqns, times, in_loop):
        w = eqn_work(e)
        g = group_of(e)
        f = w.flops + w.transcendentals
        b = w.bytes_accessed
        for key in ([g, "loop"] if looped else [g]):
            acc["n_" + key] += reps
            acc["f_" + key] += reps * f
            acc["b_" + key] += reps * b
        if g in ("dot", "conv", "conv_dw", "conv_tr"):
            per = f
            k = sum(per >= t for t in SIZE_BINS)
            acc[f"n_mm{k}"] += reps
            acc[f"f_mm{k}"] += reps * f
            acc[f"b_mm{k}"] += reps * b
        acc["n_all"] += reps
        acc["b_all"] += reps * b
        acc["f_all"] += reps * f


def layer_features(graph, layer: str) -> dict[str, float]:
    acc: dict[str, float] = defaultdict(float)
    _walk([graph.program.eqns[i] for i in graph[layer].eqns], 1, False, acc)
    return dict(acc)


def key_of(r) -> str:
    return f"{r['model']}|{int(r['small'])}|{r['batch']}|{r['layer']}"


def features(records, cache: pathlib.Path | None = None) -> dict[str, dict[str, float]]:
    """{key_of(record): features} for every layer the zoo still has (re-traces)."""
    have = json.loads(cache.read_text()) if cache and cache.exists() else {}
    traced = {k.rsplit("|", 1)[0] for k in have}
    todo = sorted({(r["model"], r["small"], r["batch"]) for r in records
                   if f"{r['model']}|{int(r['small'])}|{r['batch']}" not in traced})
    if todo:
        from hetpar.zoo import trace_model

        for model, small, batch in todo:
            _, g = trace_model(model, small=small, batch=batch)
            for name in g.layers:
                have[f"{model}|{int(small)}|{batch}|{name}"] = layer_features(g, name)
        if cache:
            cache.write_text(json.dumps(have, indent=0, sort_keys=True) + "\n")
    return have
