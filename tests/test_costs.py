"""FLOP and byte counts of single primitives against hand formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetpar.passes import eqn_work, jaxpr_work, leaf_equations, op_class


def work_of(fn, *args):
    return jaxpr_work(jax.make_jaxpr(fn)(*args).jaxpr)


def only_eqn(fn, *args, primitive):
    eqns = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == primitive]
    assert len(eqns) == 1, [e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]
    return eqn_work(eqns[0])


def test_dense_matmul_flops_and_bytes():
    x = jnp.ones((8, 32), jnp.float32)
    w = jnp.ones((32, 16), jnp.float32)
    w_ = only_eqn(lambda a, b: a @ b, x, w, primitive="dot_general")
    assert w_.flops == 2 * 8 * 32 * 16
    assert w_.bytes_accessed == 4 * (8 * 32 + 32 * 16 + 8 * 16)
    assert w_.by_class["matmul"][0] == w_.flops


def test_batched_einsum_flops():
    a = jnp.ones((3, 5, 7))
    b = jnp.ones((3, 7, 2))
    w_ = only_eqn(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), a, b, primitive="dot_general")
    assert w_.flops == 2 * 3 * 5 * 7 * 2


def conv(x, k, stride=1, padding="SAME", groups=1, dilation=1):
    return jax.lax.conv_general_dilated(
        x, k, (stride, stride), padding, rhs_dilation=(dilation, dilation),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups)


@pytest.mark.parametrize(
    "h,kh,cin,cout,stride,padding,groups,dilation",
    [
        (16, 3, 8, 4, 1, "SAME", 1, 1),
        (16, 3, 8, 4, 1, "VALID", 1, 1),
        (17, 5, 6, 12, 2, "SAME", 1, 1),
        (16, 3, 8, 8, 2, "VALID", 1, 1),
        (16, 3, 8, 8, 1, "SAME", 8, 1),  # depthwise
        (16, 3, 8, 16, 1, "SAME", 4, 1),  # grouped
        (16, 3, 4, 4, 1, "VALID", 1, 2),  # dilated kernel
    ],
)
def test_conv_flops_hand_formula(h, kh, cin, cout, stride, padding, groups, dilation):
    x = jnp.ones((2, h, h, cin))
    k = jnp.ones((kh, kh, cin // groups, cout))
    w_ = only_eqn(lambda x, k: conv(x, k, stride, padding, groups, dilation), x, k,
                  primitive="conv_general_dilated")
    eff = (kh - 1) * dilation + 1
    if padding == "SAME":
        out = -(-h // stride)
        lo = max((out - 1) * stride + eff - h, 0) // 2
    else:
        out, lo = (h - eff) // stride + 1, 0
    # Kernel taps that land inside the image, per spatial dimension.
    taps = sum(0 <= o * stride + t * dilation - lo < h for o in range(out) for t in range(kh))
    assert w_.flops == 2 * 2 * cout * (cin // groups) * taps * taps
    if padding == "VALID":
        assert w_.flops == 2 * 2 * out * out * cout * (cin // groups) * kh * kh


@pytest.mark.parametrize("stride,padding", [(1, "SAME"), (2, "SAME"), (2, "VALID")])
def test_conv_and_its_gradients_match_xla(stride, padding):
    """Forward, input-gradient (dilated input) and kernel-gradient convs against XLA's count."""
    x = jnp.ones((2, 15, 15, 6))
    k = jnp.ones((3, 3, 6, 8))
    f = lambda x, k: jnp.sum(conv(x, k, stride, padding) ** 2)
    step = jax.grad(f, argnums=(0, 1))
    ours = work_of(step, x, k).by_primitive["conv_general_dilated"][0]
    convs_only = jax.jit(lambda x, k: jax.vjp(lambda x, k: conv(x, k, stride, padding), x, k)[1](
        conv(x, k, stride, padding)))
    xla = convs_only.lower(x, k).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    # Both hold three convolutions: forward (also the cotangent here), input and
    # kernel gradients, and nothing else that XLA counts as FLOPs.
    assert ours == pytest.approx(xla["flops"], rel=0.01)


def test_reductions_count_input_elements():
    x = jnp.ones((4, 10, 6))
    assert only_eqn(lambda x: x.sum(axis=1), x, primitive="reduce_sum").flops == 240
    assert only_eqn(lambda x: x.max(), x, primitive="reduce_max").flops == 240


def test_elementwise_and_transcendentals():
    x = jnp.ones((100,))
    assert only_eqn(lambda x: x * 2.0, x, primitive="mul").flops == 100
    t = only_eqn(jnp.tanh, x, primitive="tanh")
    assert t.flops == 0 and t.transcendentals == 100
    assert op_class("tanh") == "elementwise"


def test_data_movement_moves_bytes_not_flops():
    x = jnp.ones((8, 4))
    r = only_eqn(lambda x: x.T, x, primitive="transpose")
    assert r.flops == 0 and r.bytes_accessed == 2 * 8 * 4 * 4


def test_gather_reads_only_gathered_rows():
    table = jnp.ones((1000, 16))
    idx = jnp.array([1, 2, 3])
    g = only_eqn(lambda t, i: t[i], table, idx, primitive="gather")
    assert g.bytes_accessed < 1000 * 16 * 4  # not the whole table


@pytest.mark.parametrize("n", [3, 12])
def test_scan_flops_scale_with_trip_count(n):
    w = jnp.ones((8, 8))

    def f(x):
        def body(c, _):
            return c @ w, None
        return jax.lax.scan(body, x, None, length=n)[0]

    total = work_of(f, jnp.ones((4, 8)))
    assert total.flops == n * 2 * 4 * 8 * 8


def test_while_loop_trip_count_is_read():
    w = jnp.ones((8, 8))

    def f(n):
        def run(x):
            return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]
        return run

    assert "while" in str(jax.make_jaxpr(f(5))(jnp.ones((4, 8))))
    w5 = work_of(f(5), jnp.ones((4, 8)))
    w10 = work_of(f(10), jnp.ones((4, 8)))
    assert w5.by_primitive["dot_general"][0] == 5 * 2 * 4 * 8 * 8
    assert w10.by_primitive["dot_general"][0] == 10 * 2 * 4 * 8 * 8
    assert w5.unknown_trip_counts == 0


def test_fori_loop_flops_scale_with_trip_count():
    w = jnp.ones((8, 8))
    f = lambda n: (lambda x: jax.lax.fori_loop(0, n, lambda i, c: c @ w, x))
    w5 = work_of(f(5), jnp.ones((4, 8)))
    w10 = work_of(f(10), jnp.ones((4, 8)))
    assert w10.by_primitive["dot_general"][0] == 2 * w5.by_primitive["dot_general"][0]


def test_cond_counts_the_costlier_branch():
    w = jnp.ones((8, 8))
    f = lambda p, x: jax.lax.cond(p, lambda x: x @ w @ w, lambda x: x, x)
    assert work_of(f, True, jnp.ones((4, 8))).flops == 2 * (2 * 4 * 8 * 8)


def test_leaf_equations_walk_loops_branches_and_calls_as_eqn_work_counts_them():
    # The per-equation layer model and the work counts walk one way: a scan's
    # body `length` times, a while's by its literal bound (a fori_loop with
    # literal bounds is a scan), a cond's costlier branch, a jitted call's
    # body; a while that never runs counts nothing. The walk's FLOPs are
    # eqn_work's, summed equation by equation.
    w = jnp.ones((8, 8))

    def while_dot(start, stop):
        def body(c):
            return c[0] + 1, c[1] @ w
        return lambda x: jax.lax.while_loop(lambda c: c[0] < stop, body, (start, x))[1]

    def f(p, x):
        x = jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=3)[0]
        x = while_dot(0, 5)(x)
        x = while_dot(4, 2)(x)  # zero trips
        x = jax.lax.cond(p, lambda x: x @ w @ w, lambda x: x, x)
        return jax.jit(lambda x: x @ w)(x)

    jaxpr = jax.make_jaxpr(f)(True, jnp.ones((4, 8))).jaxpr
    assert [e.primitive.name for e in jaxpr.eqns].count("while") == 2
    dots = [t for e, t, _ in leaf_equations(jaxpr.eqns) if e.primitive.name == "dot_general"]
    assert sorted(dots) == [0.0, 1.0, 1.0, 1.0, 3.0, 5.0]
    flops = sum(t * eqn_work(e).flops for e, t, _ in leaf_equations(jaxpr.eqns))
    assert flops == pytest.approx(jaxpr_work(jaxpr).flops)
    assert flops == pytest.approx((3 + 5 + 0 + 2 + 1) * 2 * 4 * 8 * 8, rel=0.01)


def test_a_while_that_never_runs_costs_nothing():
    w = jnp.ones((8, 8))
    f = lambda x: jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ w),
                                     (4, x))[1]
    work = work_of(f, jnp.ones((4, 8)))
    assert work.by_primitive.get("dot_general", [0.0])[0] == 0.0
    assert work.unknown_trip_counts == 0


def test_intensity():
    x = np.ones((64, 64), np.float32)
    w_ = work_of(lambda a: a @ a, x)
    assert w_.intensity == pytest.approx(2 * 64**3 / (3 * 64 * 64 * 4))
