"""Microbatching of steps written as Flax users write them (project issue 14, items 6-7).

The steps here use `flax.training.train_state.TrainState`, a `loss_fn(params)`
that closes over the batch, and `nn.Dropout` with `rngs={"dropout": key}`;
only `hetpar.value_and_grad` and `hetpar.auto` are hetpar's. Two oracles:
the same step microbatched the same way under plain `jax.jit` on one device
(what every runtime test compares against), and, for models without dropout,
the full-batch step (a mean loss over M equal microbatches has the full
batch's gradient), which checks that closed-over batch values really are cut.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hetpar
from hetpar._grad import microbatched
from hetpar.core import HetparError

from . import oracle

CPU = jax.devices("cpu")
BATCH = 8


class MLP(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, training: bool = True):
        x = nn.relu(nn.Dense(16, name="fc1")(x))
        x = nn.Dropout(self.dropout, deterministic=not training)(x)
        x = nn.relu(nn.Dense(16, name="fc2")(x))
        return nn.Dense(3, name="head")(x)


class TrainState(train_state.TrainState):
    key: jax.Array  # the dropout key, as in Flax's dropout guide


def make_state(dropout=0.0, key_fn=jax.random.key):
    model = MLP(dropout)
    x = jnp.zeros((BATCH, 5))
    params = model.init(jax.random.key(0), x, training=False)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1),
                              key=key_fn(7))
    # An array step count from the start (create() gives a Python 0), so the
    # second step has the first one's signature and compiles nothing new.
    return state.replace(step=jnp.zeros((), jnp.int32))


def make_batch(n=BATCH):
    x = jax.random.normal(jax.random.key(1), (n, 5))
    return {"image": x, "label": jnp.arange(n, dtype=jnp.int32) % 3}


def train_step(state, batch):
    """Flax's TrainState example: the loss closes over the batch and the dropout key."""
    dropout_key = jax.random.fold_in(state.key, state.step)
    image = batch["image"] * 0.5  # computed from the batch: cut along with it

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, image, training=True,
                                rngs={"dropout": dropout_key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, grads = hetpar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def float_leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)
            if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            and jnp.issubdtype(x.dtype, jnp.floating)]


def assert_close(a, b, rtol=1e-5):
    """Leaf by leaf (tests/oracle.py), without the op-by-op floor: these
    compare two formulations of one step under jit (microbatches summed by
    hand, a batch cut in two), whose sums associate differently."""
    bad = oracle.mismatches(a, b, rtol=rtol)
    assert not bad, bad


def assert_bitwise(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def split_plan(step, *args):
    layers = hetpar.trace(step, *args).layers
    half = len(layers) // 2
    return {name: ("cpu:0" if i < half else "cpu:1") for i, name in enumerate(layers)}


@pytest.mark.parametrize("microbatches", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_closure_step_on_split_plan_equals_jit(microbatches):
    state, batch = make_state(), make_batch()
    plan = split_plan(train_step, state, batch)
    step = hetpar.auto(train_step, microbatches=microbatches, plan=plan)
    assert step.lower(state, batch).stages is not None  # really split over two devices
    fn = microbatched(train_step, microbatches)
    reference = jax.jit(fn)
    for _ in range(3):
        out = step(state, batch)
        oracle.assert_equals_jit(out, fn, (state, batch), jitted=reference)
        state = out[0]


def test_closed_over_batch_is_cut_per_microbatch():
    """The old error case ('none of the loss's arguments is the step's batch')."""
    state, batch = make_state(), make_batch()
    traced = jax.make_jaxpr(microbatched(train_step, 2))(state, batch)
    cuts = [e for e in traced.eqns if e.primitive.name == "slice"]
    assert {tuple(e.outvars[0].aval.shape) for e in cuts} == {(BATCH // 2, 5), (BATCH // 2,)}
    # No dropout: M equal microbatches of a mean loss give the full batch's
    # gradient, which holds only if the closed-over batch really was cut.
    assert_close(jax.jit(microbatched(train_step, 2))(state, batch),
                 jax.jit(train_step)(state, batch), rtol=1e-4)


def test_parameters_and_constants_with_batch_sized_rows_go_whole():
    """An (n, k) array that does not come from the batch is never cut."""
    state, batch = make_state(), make_batch()
    table = jnp.linspace(0.0, 1.0, BATCH * 5).reshape(BATCH, 5)  # a constant

    def step(state, scale, batch):
        def loss_fn(params):
            x = batch["image"] + jnp.mean(scale) + jnp.mean(table)
            logits = state.apply_fn({"params": params}, x, training=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = hetpar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    scale = jnp.arange(BATCH * 2, dtype=jnp.float32).reshape(BATCH, 2)  # not the batch
    args = (state, scale, batch)
    assert_close(jax.jit(microbatched(step, 2))(*args), jax.jit(step)(*args), rtol=1e-4)


def test_ambiguous_closure_raises_clear_error():
    """x.T of a square batch leads with the batch size, but its first axis is features."""
    state = make_state()
    x = jax.random.normal(jax.random.key(1), (5, 5))
    batch = {"image": x, "label": jnp.arange(5) % 3}

    def step(state, batch):
        xt = batch["image"].T

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, xt, training=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        return hetpar.value_and_grad(loss_fn)(state.params)

    with pytest.raises(HetparError, match="cannot tell whether to split.*batch_argnums"):
        jax.make_jaxpr(microbatched(step, 5))(state, batch)

    # The way out the message gives: an argument, named in batch_argnums.
    def explicit(state, batch):
        def loss_fn(params, xt, labels):
            logits = state.apply_fn({"params": params}, xt, training=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return hetpar.value_and_grad(loss_fn, batch_argnums=(1, 2))(
            state.params, batch["image"].T, batch["label"])

    jax.make_jaxpr(microbatched(explicit, 5))(state, batch)


# -- random keys ---------------------------------------------------------------

KEYS = {"typed": jax.random.key, "raw": jax.random.PRNGKey}


def by_hand(state, batch, microbatches, same_masks=False):
    """The microbatched step written out: microbatch i uses fold_in(dropout key, i)
    (with same_masks, every microbatch uses microbatch 0's key)."""
    dropout_key = jax.random.fold_in(state.key, state.step)
    size = BATCH // microbatches
    losses, grads = [], []
    for i in range(microbatches):
        x = batch["image"][i * size:(i + 1) * size] * 0.5
        y = batch["label"][i * size:(i + 1) * size]
        key = jax.random.fold_in(dropout_key, 0 if same_masks else i)

        def loss_fn(params, x=x, y=y, key=key):
            logits = state.apply_fn({"params": params}, x, training=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, g = jax.value_and_grad(loss_fn)(state.params)
        losses.append(loss)
        grads.append(g)
    grads = jax.tree_util.tree_map(lambda *g: sum(g) / microbatches, *grads)
    return state.apply_gradients(grads=grads), sum(losses) / microbatches


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_each_microbatch_has_its_own_dropout_stream(kind):
    state = make_state(dropout=0.5, key_fn=KEYS[kind])
    # Both halves of the batch hold the same examples: the two microbatches
    # differ only by their dropout masks.
    half = make_batch(BATCH // 2)
    batch = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, a]), half)
    got = jax.jit(microbatched(train_step, 2))(state, batch)
    folded, same = jax.jit(lambda s, b: (by_hand(s, b, 2), by_hand(s, b, 2, True)))(state, batch)
    assert_close(got, folded)
    # Microbatch 1 with microbatch 0's mask would be microbatch 0 again: another result.
    assert not np.allclose(float_leaves(got)[-1], float_leaves(same)[-1], rtol=1e-3)


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_key_passed_as_argument_is_folded_too():
    state, batch = make_state(dropout=0.5, key_fn=jax.random.PRNGKey), make_batch()

    def step(state, batch):
        def loss_fn(params, images, labels, key):
            logits = state.apply_fn({"params": params}, images * 0.5, training=True,
                                    rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        key = jax.random.fold_in(state.key, state.step)
        loss, grads = hetpar.value_and_grad(loss_fn)(state.params, batch["image"],
                                                     batch["label"], key)
        return state.apply_gradients(grads=grads), loss

    assert_close(jax.jit(microbatched(step, 2))(state, batch),
                 jax.jit(by_hand, static_argnums=2)(state, batch, 2))


@pytest.mark.parametrize("kind", ["typed", pytest.param("raw", marks=pytest.mark.slow)])
def test_one_microbatch_is_the_step_unchanged(kind):
    state, batch = make_state(dropout=0.5, key_fn=KEYS[kind]), make_batch()
    expected = jax.jit(train_step)(state, batch)
    step = hetpar.auto(train_step, microbatches=1, devices=["cpu:0"])
    assert_bitwise(step(*jax.device_put((state, batch), CPU[0])), expected)


def test_jax_tracing_frame_contract():
    """What hetpar._grad reads of JAX's tracing frame to tell where an array comes from."""
    from jax.extend import core as jcore

    seen = {}

    def f(x):
        y = x * 2.0
        eqns = y._trace.frame.get_eqns()
        seen["ok"] = (isinstance(x.val, jcore.Var) and isinstance(y.val, jcore.Var)
                      and any(y.val in e.outvars and x.val in e.invars for e in eqns))
        return y

    jax.make_jaxpr(f)(jnp.ones(3))
    assert seen["ok"], (
        f"JAX's tracing frame changed (jax {jax.__version__}): hetpar/_grad.py's _frame_eqns "
        "and _Sorter read DynamicJaxprTracer.val and frame.get_eqns() to find which arrays a "
        "loss closes over come from the batch; pyproject pins jax<0.12 until it is updated.")


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_raw_key_in_a_batch_of_two_is_folded_not_cut():
    """A `jax.random.PRNGKey` (uint32[2]) carried in a batch of 2 leads with the
    batch size; it is still a key: folded per microbatch, never cut."""
    state = make_state(dropout=0.5)
    batch = {**make_batch(2), "dropout_rng": jax.random.PRNGKey(3)}

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"], training=True,
                                    rngs={"dropout": batch["dropout_rng"]})
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        loss, grads = hetpar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def by_hand(state, batch):  # microbatch i: row i, fold_in(key, i)
        grads, losses = [], []
        for i in range(2):
            def loss_fn(params, i=i):
                logits = state.apply_fn(
                    {"params": params}, batch["image"][i:i + 1], training=True,
                    rngs={"dropout": jax.random.fold_in(batch["dropout_rng"], i)})
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, batch["label"][i:i + 1]).mean()

            loss, g = jax.value_and_grad(loss_fn)(state.params)
            losses.append(loss)
            grads.append(g)
        grads = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, *grads)
        return state.apply_gradients(grads=grads), (losses[0] + losses[1]) / 2

    got = hetpar.auto(step, microbatches=2, devices="cpu:0")(state, batch)
    assert_close(got, jax.jit(by_hand)(state, batch))


def test_batch_of_two_arguments_is_cut_as_one():
    """`step(params, opt_state, x, y)`: x and y are both the batch (the default
    batch_argnums takes the arguments before the last with as many rows)."""
    model = MLP()
    x, y = make_batch()["image"], jax.nn.one_hot(make_batch()["label"], 3)
    params = model.init(jax.random.key(0), x, training=False)
    tx = optax.adam(1e-2)

    def step(params, opt_state, x, y):
        def loss_fn(params, x, y):
            return jnp.mean((model.apply(params, x, training=False) - y) ** 2)

        loss, grads = hetpar.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, tx.init(params), x, y)
    # No dropout: two equal microbatches of a mean loss give the full batch's gradient.
    assert_close(hetpar.auto(step, microbatches=2, devices="cpu:0")(*args),
                 jax.jit(step)(*args), rtol=1e-4)


# -- a loss that pops from the batch ---------------------------------------------


def pop_step(value_and_grad):
    """As transformers' run_clm_flax.py writes its loss: `labels = batch.pop(...)`."""

    def train_step(state, batch):
        def compute_loss(params):
            labels = batch.pop("label")
            logits = state.apply_fn({"params": params}, batch["x"], training=False)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = value_and_grad(compute_loss)(state.params)
        # After the loss, the step's batch has no labels, as under JAX.
        popped = jnp.asarray("label" not in batch, jnp.float32)
        return state.apply_gradients(grads=grads), loss, popped

    return train_step


def test_loss_popping_labels_from_the_batch_is_microbatched():
    state, batch = make_state(), make_batch()
    batch = {"x": batch["image"], "label": batch["label"]}
    got = hetpar.auto(pop_step(hetpar.value_and_grad), microbatches=2,
                      devices="cpu:0")(state, batch)
    expected = jax.jit(pop_step(jax.value_and_grad))(state, dict(batch))
    assert sorted(batch) == ["label", "x"]  # the caller's dict is untouched
    assert float(got[2]) == float(expected[2]) == 1.0
    assert_close(got, expected, rtol=1e-4)  # two equal halves: the full batch's gradient


OPTIONS = {}  # a module's global: hetpar cannot copy it per microbatch


def test_pop_from_a_dict_hetpar_cannot_copy_names_the_line():
    state, batch = make_state(), make_batch()
    OPTIONS["smoothing"] = 0.1

    def step(state, batch):
        def compute_loss(params):
            smoothing = OPTIONS.pop("smoothing")
            logits = state.apply_fn({"params": params}, batch["image"], training=False)
            labels = optax.smooth_labels(jax.nn.one_hot(batch["label"], 3), smoothing)
            return optax.softmax_cross_entropy(logits, labels).mean()

        loss, grads = hetpar.value_and_grad(compute_loss)(state.params)
        return state.apply_gradients(grads=grads), loss

    with pytest.raises(HetparError, match=r"KeyError: 'smoothing' at .*test_microbatching.py:"
                                          r"\d+ \(`smoothing = OPTIONS.pop\(\"smoothing\"\)`\)"
                                          r".*batch\['labels'\] rather than"):
        jax.make_jaxpr(microbatched(step, 2))(state, batch)


# -- aux outputs: the Flax BatchNorm guide's step --------------------------------


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(3)(nn.relu(x))


class BatchNormState(train_state.TrainState):
    batch_stats: dict


def batch_norm_state():
    model = BatchNormNet()
    variables = model.init(jax.random.key(0), jnp.zeros((BATCH, 5)), train=False)
    state = BatchNormState.create(apply_fn=model.apply, params=variables["params"],
                                  tx=optax.sgd(0.1), batch_stats=variables["batch_stats"])
    return state.replace(step=jnp.zeros((), jnp.int32))


def batch_norm_step(state, batch):
    """The Flax BatchNorm guide's `train_step`, with hetpar's value_and_grad."""

    def loss_fn(params):
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            x=batch["image"], train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]).mean()
        return loss, (logits, updates)

    grad_fn = hetpar.value_and_grad(loss_fn, has_aux=True)
    (loss, (logits, updates)), grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads)
    state = state.replace(batch_stats=updates["batch_stats"])
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
               "logits": logits}
    return state, metrics


def batch_norm_by_hand(state, batch, microbatches=2):
    """The same step written out: each microbatch normalised by its own
    statistics; logits concatenated; batch statistics, loss and gradients
    averaged (the documented recombination)."""
    size = BATCH // microbatches
    outs = []
    for i in range(microbatches):
        x, y = batch["image"][i * size:(i + 1) * size], batch["label"][i * size:(i + 1) * size]

        def loss_fn(params, x=x, y=y):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats},
                x=x, train=True, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), (
                logits, updates)

        outs.append(jax.value_and_grad(loss_fn, has_aux=True)(state.params))
    mean = lambda *xs: sum(xs) / len(xs)  # noqa: E731
    loss = mean(*[o[0][0] for o in outs])
    logits = jnp.concatenate([o[0][1][0] for o in outs])
    stats = jax.tree_util.tree_map(mean, *[o[0][1][1]["batch_stats"] for o in outs])
    grads = jax.tree_util.tree_map(mean, *[o[1] for o in outs])
    state = state.apply_gradients(grads=grads).replace(batch_stats=stats)
    return state, {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
                   "logits": logits}


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_batch_norm_guide_step_microbatched_equals_jit():
    state, batch = batch_norm_state(), make_batch()
    step = hetpar.auto(batch_norm_step, microbatches=2, plan=split_plan(
        batch_norm_step, state, batch))
    reference = jax.jit(batch_norm_by_hand)
    for _ in range(2):
        got, expected = step(state, batch), reference(*jax.device_put((state, batch), CPU[0]))
        assert got[1]["logits"].shape == (BATCH, 3)  # per example: concatenated
        assert_close(got, expected)
        state = got[0]


def test_aux_that_cannot_be_recombined_is_a_one_line_error():
    """A count over the batch (an integer, not per example, not a mean)."""
    state, batch = make_state(), make_batch()

    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["image"], training=False)
            correct = jnp.sum(jnp.argmax(logits, -1) == batch["label"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
            return loss, {"correct": correct}

        (loss, aux), grads = hetpar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), loss, aux

    with pytest.raises(HetparError, match=r"^[^\n]*aux output aux\['correct'\] \(int32\[\] per "
                                          r"microbatch, \[\] for the whole batch\).*float mean"):
        jax.make_jaxpr(microbatched(step, 2))(state, batch)
