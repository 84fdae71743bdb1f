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


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
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


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_trace_of_a_stateful_step_holds_its_update():
    """`hetpar.trace` takes NNX objects as `hetpar.auto` does: the graph returns
    the loss and the objects' new state, and running it equals `nnx.jit`'s step."""
    model, opt = fresh()
    graph = hetpar.trace(train_step, model, opt, X, Y)
    ref_model, ref_opt = fresh()
    ref_loss = nnx.jit(train_step)(ref_model, ref_opt, X, Y)

    from hetpar._nnx_args import NnxArgs

    pure = NnxArgs((model, opt, X, Y)).pure_args
    loss, state = graph.program(*pure)  # the traced graph, run op by op
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    nnx.update((model, opt), state)
    assert_same_state(model, ref_model)
    assert_same_state(opt, ref_opt)
    assert int(opt.step[...]) == 1


# -- microbatched, with metrics ------------------------------------------------


def metrics_step(value_and_grad):
    """The NNX MNIST tutorial's step: the loss returns the logits as aux, and
    an `nnx.MultiMetric` is updated from them."""

    def loss_fn(model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    def train_step(model, optimizer, metrics, batch):
        (loss, logits), grads = value_and_grad(loss_fn, has_aux=True)(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    return train_step


def fresh_with_metrics():
    model, optimizer = fresh()
    return model, optimizer, nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                             loss=nnx.metrics.Average("loss"))


def test_microbatched_metrics_step_equals_nnx_jit():
    """Per-example aux outputs (the logits) come back concatenated: the
    metrics are the full batch's, not averaged halves."""
    batch = {"x": X, "label": np.arange(8, dtype=np.int32) % 2}
    ref = fresh_with_metrics()
    got = fresh_with_metrics()
    ref_step = nnx.jit(metrics_step(nnx.value_and_grad))
    step = hetpar.auto(metrics_step(hetpar.value_and_grad), microbatches=2, devices="cpu:0")
    for _ in range(2):
        ref_step(*ref, batch)
        step(*got, batch)
    for a, b in zip(got, ref, strict=True):
        assert_same_state(a, b)
    for name, value in ref[2].compute().items():
        np.testing.assert_allclose(got[2].compute()[name], value, rtol=1e-5)


def test_later_calls_follow_objects_changed_between_steps():
    """Calls after the first skip the split (`NnxFastCall`), but a submodule
    replaced by an equal one, a value set by hand, or eval() mode between
    steps is seen, as under nnx.jit."""
    objects, ref = fresh(), fresh()
    step, ref_step = hetpar.auto(train_step, devices="cpu:0"), nnx.jit(train_step)
    np.testing.assert_allclose(train(step, objects, 2), train(ref_step, ref, 2), rtol=1e-5)
    assert step._nnx_direct is not None  # the later call took the fast path
    for model, _ in (objects, ref):
        model.l2 = nnx.Linear(16, 2, rngs=nnx.Rngs(5))  # new Variables, same structure
        model.l1.bias[...] = jnp.full((16,), 0.1)
    np.testing.assert_allclose(train(step, objects, 2), train(ref_step, ref, 2), rtol=1e-5)
    for a, b in zip(objects, ref, strict=True):
        assert_same_state(a, b)


# -- a GPT: NNX names no module in the trace (issue 44, item 3) --------------


class Block(nnx.Module):
    def __init__(self, width, rngs):
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        # No biases: a key bias's gradient is zero in exact arithmetic, so Adam
        # turns rounding noise there into +-lr steps under any two compilations.
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=width, decode=False,
                                           use_bias=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.fc = nnx.Linear(width, 2 * width, rngs=rngs)
        self.proj = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.proj(nnx.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, rngs, blocks=4, vocab=16, width=8, length=6):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (length, width)) * 0.02)
        self.blocks = nnx.List([Block(width, rngs) for _ in range(blocks)])
        self.ln_f = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...]
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def gpt_loss(model, tokens, labels):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), labels).mean()


def gpt_step(model, optimizer, tokens, labels):
    loss, grads = nnx.value_and_grad(gpt_loss)(model, tokens, labels)
    optimizer.update(model, grads)
    return loss


def fresh_gpt():
    model = GPT(nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 16)
    return (model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), tokens,
            jnp.roll(tokens, -1, 1))


@pytest.mark.slow  # 3-4 s of tracing: over the fast tier's 3-minute budget (CI runs it)
def test_gpt_layers_are_its_blocks():
    # The attention's einsum subscripts (`BTNH,BSNH->BNTS`) were the only
    # names: two layers, one holding most of the optimizer state.
    graph = hetpar.auto(gpt_step, devices="cpu:0").lower(*fresh_gpt()).graph
    blocks = [f"blocks[{k}]" for k in range(4)]
    assert graph.layers == ["embed", "pos", *blocks, "ln_f", "head"]
    held = {n: graph[n].opt_state_bytes for n in graph.layers}
    assert max(held.values()) < 0.5 * sum(held.values())
    assert len({held[n] for n in blocks}) == 1  # equal blocks, equal state


@pytest.mark.slow  # compiles the GPT's stages on two devices
def test_gpt_split_over_two_devices_trains_as_under_nnx_jit():
    ref_model, ref_opt, tokens, labels = fresh_gpt()
    ref = [float(nnx.jit(gpt_step)(ref_model, ref_opt, tokens, labels)) for _ in range(2)]
    model, opt, _, _ = fresh_gpt()
    step = hetpar.auto(gpt_step, plan=two_device_plan(gpt_step, model, opt, tokens, labels))
    losses = [float(step(model, opt, tokens, labels)) for _ in range(2)]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert_same_state(model, ref_model)
    assert set(step.assignment.values()) == {"cpu:0", "cpu:1"}
