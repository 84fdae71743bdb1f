"""What a `hetpar.auto` step is keyed on, and the path a call takes.

Arguments' leaves that are neither arrays nor Python numbers are static, as
under `eqx.filter_jit`: part of the signature (the same leaf again reuses the
compiled step, another compiles afresh), closed over when tracing. Python
numbers are traced, as under `jax.jit`. A one-device plan's later calls go
straight to its jit executable, as do a data-parallel plan's
(tests/test_multi_accelerator.py); arguments jit has not run (one device) or
another batch shape (data parallel) take the full path.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import hetpar
from hetpar import _auto, _auto_step

CPU = jax.devices("cpu")
W = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2)
X = np.linspace(-2.0, 2.0, 12, dtype=np.float32).reshape(4, 3)


def counting(fn):
    """`fn` and the list of arguments it was traced (or called) with."""
    seen = []

    def step(w, how, x):
        seen.append(how)
        return fn(w, how, x)

    return step, seen


def activate(w, act, x):
    return jnp.sum(act(x @ w) ** 2)


def test_same_static_leaf_reuses_the_step_another_retraces():
    step, seen = counting(activate)
    auto = hetpar.auto(step, devices="cpu:0")
    relu = auto(W, jax.nn.relu, X)
    traced = len(seen)
    np.testing.assert_allclose(auto(W, jax.nn.relu, X), relu)
    assert len(seen) == traced
    tanh = auto(W, jnp.tanh, X)
    assert len(seen) > traced
    np.testing.assert_allclose(tanh, activate(W, jnp.tanh, X), rtol=1e-6)
    np.testing.assert_allclose(relu, activate(W, jax.nn.relu, X), rtol=1e-6)
    # Back to the first: its compiled step is still there.
    traced = len(seen)
    np.testing.assert_allclose(auto(W, jax.nn.relu, X), relu)
    assert len(seen) == traced


def test_static_leaf_steps_go_straight_to_jit_too(monkeypatch):
    signatures = []
    full = _auto.signature
    monkeypatch.setattr(_auto_step, "signature", lambda args: signatures.append(1) or full(args))
    step, seen = counting(activate)
    auto = hetpar.auto(step, devices="cpu:1")
    on_cpu0 = jax.device_put(X, CPU[0])
    for _ in range(3):
        out = auto(W, jax.nn.relu, on_cpu0)  # the batch moves to cpu:1 first
        np.testing.assert_allclose(out, activate(W, jax.nn.relu, X), rtol=1e-6)
        assert out.devices() == {CPU[1]}
    assert len(signatures) == 1
    auto(W, jnp.tanh, X)  # another static leaf: the full path
    assert len(signatures) == 2
    traced = len(seen)
    np.testing.assert_allclose(auto(W, jax.nn.relu, X), activate(W, jax.nn.relu, X), rtol=1e-6)
    assert len(signatures) == 3 and len(seen) == traced  # found, not traced again


def test_static_leaves_compare_by_equality_or_identity():
    def named(w, how, x):
        return jnp.sum({"relu": jax.nn.relu, "tanh": jnp.tanh}[how["name"]](x @ w))

    step, seen = counting(named)
    auto = hetpar.auto(step, devices="cpu:0")
    auto(W, {"name": "relu"}, X)
    traced = len(seen)
    auto(W, {"name": "".join(["re", "lu"])}, X)  # equal, another object
    assert len(seen) == traced

    class Unhashable:  # no __hash__: compared by identity
        __hash__ = None

        def __init__(self, name):
            self.name = name

        def __eq__(self, other):
            return self.name == other.name

    def by_object(w, how, x):
        return named(w, {"name": how.name}, x)

    step, seen = counting(by_object)
    auto = hetpar.auto(step, devices="cpu:0")
    relu = Unhashable("relu")
    auto(W, relu, X)
    traced = len(seen)
    auto(W, relu, X)
    assert len(seen) == traced
    auto(W, Unhashable("relu"), X)
    assert len(seen) > traced


def test_python_numbers_are_traced_not_static():
    def scaled(w, how, x):
        return jnp.sum(how(x @ w)) if callable(how) else jnp.sum(x @ w) * how

    step, seen = counting(scaled)
    auto = hetpar.auto(step, devices="cpu:0")
    a = auto(W, 0.5, X)
    traced = len(seen)
    b = auto(W, 0.25, X)
    assert len(seen) == traced  # one trace serves every float, as under jax.jit
    np.testing.assert_allclose(b, a / 2, rtol=1e-6)
    assert b.dtype == jnp.float32  # weakly typed, as jax.jit traces it
    # A function where a number was: jit refuses it, the full path holds it static.
    np.testing.assert_allclose(auto(W, jnp.tanh, X), jnp.sum(jnp.tanh(X @ W)), rtol=1e-6)


def test_static_leaves_of_the_result_are_returned_as_traced():
    def step(w, x):
        return jnp.sum(x @ w), "done", jax.nn.relu

    auto = hetpar.auto(step, devices="cpu:0")
    for _ in range(2):
        loss, word, act = auto(W, X)
        assert word == "done" and act is jax.nn.relu
        np.testing.assert_allclose(loss, jnp.sum(X @ W), rtol=1e-6)


def test_program_holds_static_leaves_out_of_the_jaxpr():
    from hetpar.passes import trace_program

    program = trace_program(activate, W, jax.nn.relu, X)
    assert program.static is not None
    assert len(program.jaxpr.jaxpr.invars) == 2
    np.testing.assert_allclose(program(W, jax.nn.relu, X), activate(W, jax.nn.relu, X),
                               rtol=1e-6)


class Dense2(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))


TX = optax.adam(1e-2)


def flax_step(params, opt_state, batch):
    def loss(p):
        return jnp.mean((Dense2().apply(p, batch["x"]) - batch["y"]) ** 2)

    loss_value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_value


def flax_args(n=4):
    params = Dense2().init(jax.random.key(0), jnp.ones((1, 3)))
    batch = {"x": np.linspace(0, 1, n * 3, dtype=np.float32).reshape(n, 3),
             "y": np.ones((n, 2), np.float32)}
    return params, TX.init(params), batch


def test_one_device_calls_go_straight_to_jit(monkeypatch):
    signatures = []
    full = _auto.signature
    monkeypatch.setattr(_auto_step, "signature", lambda args: signatures.append(1) or full(args))
    auto = hetpar.auto(flax_step, devices="cpu:1")
    jitted = jax.jit(flax_step)
    params, opt_state, batch = flax_args()
    state, ref = (params, opt_state), (params, opt_state)
    for _ in range(3):
        *state, loss = auto(*state, batch)
        *ref, ref_loss = jitted(*ref, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert len(signatures) == 1  # the first call only: plain Flax arguments, no static leaves
    assert {d for x in jax.tree.leaves(state) for d in x.devices()} == {CPU[1]}

    # New shapes: jit would trace, so the call takes the full path and compiles afresh.
    small = flax_args(2)[2]
    np.testing.assert_allclose(auto(*state, small)[-1], jitted(*state, small)[-1], rtol=1e-6)
    assert len(signatures) == 2
    assert auto.lower(*state, small) is not auto.lower(*state, batch)
    # Back to the first shapes, then straight to jit again.
    np.testing.assert_allclose(auto(*state, batch)[-1], jitted(*state, batch)[-1], rtol=1e-6)
    calls = len(signatures)
    auto(*state, batch)
    assert len(signatures) == calls

    # A batch committed to another device still moves with device_put first.
    on_cpu0 = jax.device_put(batch, CPU[0])
    *moved, loss = auto(*state, on_cpu0)
    assert {d for x in jax.tree.leaves(moved) for d in x.devices()} == {CPU[1]}
    np.testing.assert_allclose(loss, jitted(*state, batch)[-1], rtol=1e-6)


def test_split_plans_take_the_full_path():
    def two_layers(w, x):
        with hetpar.layer("first"):
            h = jnp.tanh(x @ w[0])
        with hetpar.layer("second"):
            return jnp.mean((h @ w[1]) ** 2)

    w = [W, jnp.ones((2, 2)) * 0.1]
    auto = hetpar.auto(two_layers, plan={"first": "cpu:0", "second": "cpu:1"})
    for _ in range(2):
        np.testing.assert_allclose(auto(w, X), two_layers(w, X), rtol=1e-6)
    assert auto.lower(w, X).stages is not None
    assert auto._direct is None
