"""Flax NNX steps under `hetpar.auto`: stateful ones as under `nnx.jit`, functional ones.

A step that updates NNX objects in place (`optimizer.update(model, grads)`)
trains under `@hetpar.auto` exactly as under `@nnx.jit`; under plain
`jax.jit` it would silently train nothing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hetpar

from . import oracle

X = np.linspace(-1, 1, 8 * 3, dtype=np.float32).reshape(8, 3)
Y = np.linspace(0, 1, 8 * 2, dtype=np.float32).reshape(8, 2)


class MLP(nnx.Module):
    def __init__(self, rngs, dropout=0.0, batch_norm=False):
        self.l1 = nnx.Linear(3, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs) if batch_norm else None
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.l2(self.drop(jax.nn.relu(h)))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def fresh(**kwargs):
    model = MLP(nnx.Rngs(0), **kwargs)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def train(step, objects, steps=3):
    return [float(step(*objects, X, Y)) for _ in range(steps)]


def values(tree):
    """The tree's arrays as numpy, PRNG keys (an Rngs' state) as their key data."""
    return [np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                       else x) for x in jax.tree.leaves(tree)]


def assert_same_state(a, b):
    """Every variable of `a` equals `b`'s, leaf by leaf (tests/oracle.py)."""
    bad = oracle.mismatches(values(nnx.state(a)), values(nnx.state(b)))
    assert not bad, bad


def two_device_plan(step, *args):
    layers = hetpar.auto(step, devices=["cpu:0"]).lower(*args).graph.layers
    assert len(layers) >= 2
    return {name: f"cpu:{i % 2}" for i, name in enumerate(layers)}


@pytest.mark.parametrize("placement", ["planned", "two devices"])
def test_stateful_nnx_step_trains_as_under_nnx_jit(placement):
    ref_model, ref_opt = fresh()
    ref_losses = train(nnx.jit(train_step), (ref_model, ref_opt))

    model, opt = fresh()
    plan = two_device_plan(train_step, model, opt, X, Y) if placement == "two devices" else None
    step = hetpar.auto(train_step, plan=plan)
    losses = train(step, (model, opt))

    assert losses[-1] < losses[0]  # it trains (under jax.jit it would not)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same_state(model, ref_model)
    assert_same_state(opt, ref_opt)
    assert int(opt.step[...]) == 3
    if placement == "two devices":
        assert set(step.assignment.values()) == {"cpu:0", "cpu:1"}


def test_dropout_batch_norm_and_eval_mode_as_under_nnx_jit():
    # Rng counters and batch statistics are state the step updates too; eval()
    # changes a static attribute, which compiles afresh.
    ref_model, ref_opt = fresh(dropout=0.5, batch_norm=True)
    model, opt = fresh(dropout=0.5, batch_norm=True)
    ref_step, step = nnx.jit(train_step), hetpar.auto(train_step, devices="cpu:0")
    np.testing.assert_allclose(train(step, (model, opt)), train(ref_step, (ref_model, ref_opt)),
                               rtol=1e-5)
    assert_same_state(model, ref_model)
    model.eval()
    ref_model.eval()
    np.testing.assert_allclose(float(hetpar.auto(loss_fn, devices="cpu:0")(model, X, Y)),
                               float(nnx.jit(loss_fn)(ref_model, X, Y)), rtol=1e-5)
    assert_same_state(model, ref_model)


def test_objects_sharing_variables_stay_shared():
    # ModelAndOptimizer holds the model: both arguments reach the same Params.
    def step(model, model_and_opt, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        model_and_opt.update(grads)
        return loss

    def make():
        model = MLP(nnx.Rngs(0))
        return model, nnx.ModelAndOptimizer(model, optax.sgd(0.1))

    ref_model, ref_mo = make()
    ref_losses = train(nnx.jit(step), (ref_model, ref_mo))
    model, mo = make()
    np.testing.assert_allclose(train(hetpar.auto(step, devices="cpu:0"), (model, mo)), ref_losses,
                               rtol=1e-5)
    assert mo.model is model
    assert_same_state(model, ref_model)


def test_returning_nnx_objects_is_a_clear_error():
    def step(model, optimizer, x, y):
        train_step(model, optimizer, x, y)
        return model

    with pytest.raises(hetpar.HetparError, match="may not return Flax NNX objects"):
        hetpar.auto(step, devices="cpu:0")(*fresh(), X, Y)


def test_changing_the_objects_structure_is_a_clear_error():
    def step(model, optimizer, x, y):
        loss = train_step(model, optimizer, x, y)
        model.extra = nnx.BatchStat(jnp.zeros(()))
        return loss

    with pytest.raises(hetpar.HetparError, match="changed the structure"):
        hetpar.auto(step, devices="cpu:0")(*fresh(), X, Y)


def test_functional_split_merge_step_equals_jax_jit():
    model, opt = fresh()
    graphdef, state = nnx.split((model, opt))

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, x, y)
        return nnx.state((model, optimizer)), loss

    results = []
    for wrap in (jax.jit, hetpar.auto):
        s, losses, f = state, [], wrap(step)
        for _ in range(3):
            s, loss = f(s, X, Y)
            losses.append(float(loss))
        results.append((s, losses))
    (ref_state, ref_losses), (got_state, losses) = results
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    bad = oracle.mismatches(values(got_state), values(ref_state))
    assert not bad, bad
