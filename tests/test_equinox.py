"""Equinox steps under `hetpar.auto`, written as Equinox users write them.

The model is passed as it is, activation functions (`jax.nn.relu`, a
`custom_jvp`) and all: its non-array leaves are static, as under
`eqx.filter_jit`, and the updated model comes back with them. Results equal
`eqx.filter_jit`'s (and `jax.jit`'s on the array part) on one device, on two,
and with microbatches.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetpar

from . import oracle

TX = optax.adam(1e-2)


def mlp_data():
    x = jax.random.normal(jax.random.key(1), (8, 6))
    y = jax.random.normal(jax.random.key(2), (8, 3))
    return x, y


def mlp_step(model, opt_state, x, y):
    def loss(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss_value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss_value


def fresh_mlp():
    model = eqx.nn.MLP(6, 3, 16, 2, key=jax.random.key(0))
    return model, TX.init(eqx.filter(model, eqx.is_array))


class CNN(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 4, kernel_size=3, padding=1, key=k1)
        self.head = eqx.nn.Linear(4 * 6 * 6, 3, key=k2)

    def __call__(self, x):  # one example, channels first as Equinox has it
        return self.head(jax.nn.relu(self.conv(x)).reshape(-1))


def cnn_data():
    x = jax.random.normal(jax.random.key(3), (4, 2, 6, 6))
    y = jax.random.normal(jax.random.key(4), (4, 3))
    return x, y


def cnn_step(model, opt_state, batch):
    x, y = batch

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    # hetpar.value_and_grad takes the model as eqx.filter_value_and_grad
    # does (non-array leaves static, their gradient None) and microbatches.
    loss_value, grads = hetpar.value_and_grad(loss)(model, x, y)
    updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss_value


def fresh_cnn():
    model = CNN(jax.random.key(0))
    return model, TX.init(eqx.filter(model, eqx.is_array))


def train(step, model, opt_state, *batch, steps=3):
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state, *batch)
    return model, opt_state, loss


def assert_close(a, b):
    """Every array leaf equal, leaf by leaf (tests/oracle.py); non-array
    leaves (activation functions) are the model's static part."""
    bad = oracle.mismatches(eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array))
    assert not bad, bad


def two_device_plan(step, *args):
    layers = hetpar.trace(step, *args).layers
    assert len(layers) >= 2, layers
    return {name: f"cpu:{i % 2}" for i, name in enumerate(layers)}


@pytest.mark.slow  # fast-tier time; the plan-dict test traces activation fields too
def test_model_with_activation_functions_traces():
    model, opt_state = fresh_mlp()
    graph = hetpar.trace(mlp_step, model, opt_state, *mlp_data())
    assert graph.layers
    # One flat input per array leaf: the activations are static, not inputs.
    n_arrays = len(jax.tree.leaves(eqx.filter((model, opt_state, *mlp_data()), eqx.is_array)))
    assert len(graph.program.in_paths) == n_arrays
    assert "[0].layers[0].weight" in graph.program.in_paths


# Fast-tier time: in the fast tier, the plan-dict test covers split Equinox
# steps and test_numbers_inside_a_module_are_static_as_under_filter_jit
# hetpar.auto's own plan; one-device plans given run in the slow tier.
@pytest.mark.slow
def test_one_device_step_equals_filter_jit():
    model, opt_state = fresh_mlp()
    data = mlp_data()
    ref = train(eqx.filter_jit(mlp_step), model, opt_state, *data)
    step = hetpar.auto(mlp_step, devices="cpu:0")
    out = train(step, model, opt_state, *data)
    assert_close(out, ref)
    # The updated model is an MLP with its activation, as the step returned it.
    assert out[0].activation is jax.nn.relu
    assert jax.tree.structure(out[0]) == jax.tree.structure(model)
    # The array part equals jax.jit on the partitioned model.
    params, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def jit_step(params, opt_state, x, y):
        model, opt_state, loss = mlp_step(eqx.combine(params, static), opt_state, x, y)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    jp, jo, jl = train(jit_step, params, opt_state, *data)
    assert_close((eqx.filter(out[0], eqx.is_array), out[1], out[2]), (jp, jo, jl))


@pytest.mark.slow  # 3-5 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_lower_takes_the_model_as_given():
    model, opt_state = fresh_mlp()
    data = mlp_data()
    step = hetpar.auto(mlp_step, devices="cpu:0")
    compiled = step.lower(model, opt_state, *data)
    new_model, _, loss = compiled(model, opt_state, *data)
    _, _, ref_loss = eqx.filter_jit(mlp_step)(model, opt_state, *data)
    assert new_model.activation is jax.nn.relu
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


def test_hetpar_value_and_grad_filters_like_equinox():
    model, _ = fresh_cnn()
    x, y = cnn_data()

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    value, grads = eqx.filter_jit(hetpar.value_and_grad(loss))(model, x, y)
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, x, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert_close(grads, ref_grads)


def test_mlp_under_a_plan_dict_equals_filter_jit():
    model, opt_state = fresh_mlp()
    data = mlp_data()
    layers = hetpar.trace(mlp_step, model, opt_state, *data).layers
    step = hetpar.auto(mlp_step, plan={name: f"cpu:{i % 2}" for i, name in enumerate(layers)})
    out = train(step, model, opt_state, *data)
    assert_close(out, train(eqx.filter_jit(mlp_step), model, opt_state, *data))
    assert out[0].activation is jax.nn.relu


@pytest.mark.slow  # times every layer, the step and the runtime's costs
def test_mlp_plan_dict_calibrated_at_the_first_call_equals_filter_jit(monkeypatch):
    # profile="measure" on an Equinox step: layers timed alone (static leaves
    # closed over), the whole step, and the runtime's per-stage cost, which
    # the plan dict's replayed prediction then carries.
    from hetpar import _calibration

    monkeypatch.setattr(_calibration, "OVERHEADS", {})
    model, opt_state = fresh_mlp()
    data = mlp_data()
    layers = hetpar.trace(mlp_step, model, opt_state, *data).layers
    plan = {name: f"cpu:{i % 2}" for i, name in enumerate(layers)}
    step = hetpar.auto(mlp_step, plan=plan, profile="measure")
    out = train(step, model, opt_state, *data)
    assert_close(out, train(eqx.filter_jit(mlp_step), model, opt_state, *data))
    measured = step.lower(model, opt_state, *data)
    assert measured.predicted().step_time_s > 0
    per_stage = [v for k, v in _calibration.OVERHEADS.items() if isinstance(k, jax.Device)]
    assert per_stage and all(v is not None and v > 0 for v in per_stage)
    spec = hetpar.auto(mlp_step, plan=plan).lower(model, opt_state, *data).predicted()
    assert measured.predicted().step_time_s != spec.step_time_s


@pytest.mark.slow  # the MLP plan-dict test covers split Equinox steps fast
def test_cnn_split_over_two_devices_equals_filter_jit():
    model, opt_state = fresh_cnn()
    batch = cnn_data()
    plan = two_device_plan(cnn_step, model, opt_state, batch)
    step = hetpar.auto(cnn_step, plan=plan)
    out = train(step, model, opt_state, batch)
    assert set(step.assignment.values()) == {"cpu:0", "cpu:1"}
    ref = train(eqx.filter_jit(cnn_step), model, opt_state, batch)
    assert_close(out, ref)
    assert isinstance(out[0], CNN)


def test_cnn_microbatched_pipeline_equals_filter_jit():
    model, opt_state = fresh_cnn()
    batch = cnn_data()
    plan = two_device_plan(cnn_step, model, opt_state, batch)
    step = hetpar.auto(cnn_step, plan=plan, microbatches=2)
    out = train(step, model, opt_state, batch)
    ref = train(eqx.filter_jit(cnn_step), model, opt_state, batch)
    assert_close(out, ref)


class PooledCNN(eqx.Module):
    """A CNN with pooling: `MaxPool2d` keeps its `-inf` init as a Python float field."""

    conv: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(2, 4, kernel_size=3, padding=1, key=k1)
        self.pool = eqx.nn.MaxPool2d(kernel_size=2, stride=2)
        self.head = eqx.nn.Linear(4 * 3 * 3, 3, key=k2)

    def __call__(self, x):
        return self.head(self.pool(jax.nn.relu(self.conv(x))).reshape(-1))


def test_numbers_inside_a_module_are_static_as_under_filter_jit():
    # Traced, the pool's init value would need a tangent: reduce_window refuses.
    model = PooledCNN(jax.random.key(0))
    opt_state = TX.init(eqx.filter(model, eqx.is_array))
    batch = cnn_data()
    expected = train(eqx.filter_jit(cnn_step), model, opt_state, batch)
    got = train(hetpar.auto(cnn_step), model, opt_state, batch)
    assert_close(got, expected)


# -- transformers: user blocks of library layers (issue 44, items 1, 2, 7) ------


class NormLinearBlock(eqx.Module):
    """A user's block: its own class, so Equinox names no scope for it."""

    norm1: eqx.nn.LayerNorm
    linear1: eqx.nn.Linear
    norm2: eqx.nn.LayerNorm
    linear2: eqx.nn.Linear

    def __init__(self, width, key):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
        self.linear1 = eqx.nn.Linear(width, width, key=k1)
        self.linear2 = eqx.nn.Linear(width, width, key=k2)

    def __call__(self, x):
        x = x + self.linear1(self.norm1(x))
        return x + self.linear2(self.norm2(x))


class NormedStack(eqx.Module):
    """Two blocks, a final LayerNorm and a head; a bare learned offset `pos`."""

    pos: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.pos = jnp.zeros(6)
        self.blocks = [NormLinearBlock(6, k) for k in keys[:2]]
        self.norm = eqx.nn.LayerNorm(6)
        self.head = eqx.nn.Linear(6, 3, key=keys[2])

    def __call__(self, x):
        x = x + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def fresh_stack():
    model = NormedStack(jax.random.key(0))
    return model, TX.init(eqx.filter(model, eqx.is_array))


def param_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def test_blocks_with_a_final_norm_give_one_layer_per_block():
    model, opt_state = fresh_stack()
    graph = hetpar.trace(mlp_step, model, opt_state, *mlp_data_for(6), batch_argnums=(2, 3))
    # Each block's LayerNorms and Linears are one layer; `pos` joins the layer
    # that reads it first, with its Adam state and its update.
    assert graph.layers == ["blocks[0]", "blocks[1]", "norm", "head"]
    for k, extra in ((0, model.pos.nbytes), (1, 0)):
        own = param_bytes(model.blocks[k]) + extra
        assert graph[f"blocks[{k}]"].param_bytes == own
        assert graph[f"blocks[{k}]"].opt_state_bytes == 2 * own
    held = {layer for layer, path in zip(graph.input_layers, graph.program.in_paths)
            if path.endswith(".pos")}
    assert len(held) == 1  # the array, its mu and its nu
    jaxpr = graph.program.jaxpr.jaxpr
    producer = {o: graph.eqn_layers[i] for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    # mlp_step returns (model, opt_state, loss): outputs in input order.
    new_pos = [jaxpr.outvars[k] for k, path in enumerate(graph.program.in_paths)
               if path.endswith(".pos")]
    assert {producer[v] for v in new_pos} == held


def mlp_data_for(width):
    x = jax.random.normal(jax.random.key(1), (8, width))
    y = jax.random.normal(jax.random.key(2), (8, 3))
    return x, y


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_blocks_with_a_final_norm_split_over_two_devices_equal_filter_jit():
    model, opt_state = fresh_stack()
    data = mlp_data_for(6)
    step = hetpar.auto(mlp_step, plan=two_device_plan(mlp_step, model, opt_state, *data))
    out = train(step, model, opt_state, *data)
    assert set(step.assignment.values()) == {"cpu:0", "cpu:1"}
    assert_close(out, train(eqx.filter_jit(mlp_step), model, opt_state, *data))


class AttentionBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(2, width, key=k1)
        self.up = eqx.nn.Linear(width, 2 * width, key=k2)
        self.down = eqx.nn.Linear(2 * width, width, key=k3)

    def __call__(self, x):  # one sequence: [tokens, width]
        h = jax.vmap(self.norm1)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attention(h, h, h, mask=causal)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class GPT(eqx.Module):
    """Embedding, two attention blocks, a final LayerNorm and a head. No field
    holds a function, so only Equinox's rule makes the dropouts' `inference`
    flags static."""

    embedding: eqx.nn.Embedding
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key, vocab=16, width=8):
        keys = jax.random.split(key, 4)
        self.embedding = eqx.nn.Embedding(vocab, width, key=keys[0])
        self.blocks = [AttentionBlock(width, k) for k in keys[1:3]]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, key=keys[3])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def gpt_step_with(tx):
    """The GPT's training step under the optimizer `tx`."""
    def gpt_step(model, opt_state, tokens, labels):
        def loss(model):
            logits = jax.vmap(model)(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss_value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss_value

    return gpt_step


gpt_step = gpt_step_with(TX)


def gpt_args():
    model = GPT(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 16)
    return model, TX.init(eqx.filter(model, eqx.is_array)), tokens, jnp.roll(tokens, -1, 1)


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_gpt_layers_follow_its_blocks():
    args = gpt_args()
    graph = hetpar.trace(gpt_step, *args, batch_argnums=(2, 3))
    assert graph.layers == ["embedding", "blocks[0]", "blocks[1]", "norm", "head"]
    model = args[0]
    for k in range(2):
        assert graph[f"blocks[{k}]"].param_bytes == param_bytes(model.blocks[k])
        assert graph[f"blocks[{k}]"].opt_state_bytes == 2 * param_bytes(model.blocks[k])


@pytest.mark.slow  # compiles the GPT's stages on two devices: ~15 s on 2 cores
def test_gpt_split_over_two_devices_equals_filter_jit():
    args = gpt_args()
    plan = two_device_plan(gpt_step, *args)
    out = train(hetpar.auto(gpt_step, plan=plan), *args)
    assert_close(out, train(eqx.filter_jit(gpt_step), *args))


@pytest.mark.slow  # compiles the GPT; test_gpt_layers_follow_its_blocks traces it fast
def test_gpt_on_one_device_equals_filter_jit():
    args = gpt_args()
    out = train(hetpar.auto(gpt_step, devices="cpu:0"), *args)
    assert_close(out, train(eqx.filter_jit(gpt_step), *args))
    assert out[0].blocks[0].attention.dropout.inference is False  # static, given back


# The optimizer large models train with: clip, then AdamW.
CHAIN = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
chained_gpt_step = gpt_step_with(CHAIN)


@pytest.mark.slow  # compiles the GPT over two devices twice: ~10 s on 2 cores
@pytest.mark.parametrize("stage", ["fsdp", "zero1"])
def test_gpt_with_sharded_state_over_two_devices_equals_filter_jit(stage, monkeypatch):
    """An Equinox model's state split over two devices (its batch split too,
    GSPMD inserting the collectives): the model comes back whole, its static
    leaves as given, and equals `eqx.filter_jit`'s. As for a step without
    static leaves, its executable's memory is checked before it runs and its
    collectives are read for the report."""
    from hetpar import _memory_check

    monkeypatch.setattr(_memory_check, "CHECK_FROM", 0.0)  # checked whatever the prediction
    model = GPT(jax.random.key(0), width=16)
    tokens = jax.random.randint(jax.random.key(1), (4, 5), 0, 16)
    args = (model, CHAIN.init(eqx.filter(model, eqx.is_array)), tokens, jnp.roll(tokens, -1, 1))
    step = hetpar.auto(chained_gpt_step, devices=["cpu:0", "cpu:1"], data_parallel=stage,
                       batch_argnums=(2, 3))
    out = train(step, *args)
    assert step.lower(*args).plan.sharding == stage
    assert_close(out, train(eqx.filter_jit(chained_gpt_step), *args))
    assert out[0].blocks[0].attention.dropout.inference is False
    report = step.report().step
    assert all(m["compiled"] for m in report["memory"].values())
    assert report["collectives"]["compiled"]["all-gather" if stage == "fsdp" else "all-reduce"]


@pytest.mark.slow  # compiles the GPT over two devices: ~5 s on 2 cores each
@pytest.mark.parametrize("stage", ["always", "fsdp"])
def test_gpt_data_parallel_donates_the_model_and_optimizer_state(stage):
    """`donate_argnums` on a data-parallel Equinox step, as `eqx.filter_jit(donate=...)`
    has it: the steps equal `eqx.filter_jit`'s on a fresh copy; replicated,
    the state passed is given up (its arrays deleted). (Sharded, what is
    donated is its split copy.)"""
    def args():
        model = GPT(jax.random.key(0), width=16)
        tokens = jax.random.randint(jax.random.key(1), (4, 5), 0, 16)
        return model, CHAIN.init(eqx.filter(model, eqx.is_array)), tokens, jnp.roll(tokens, -1, 1)

    given = args()
    step = hetpar.auto(chained_gpt_step, devices=["cpu:0", "cpu:1"], data_parallel=stage,
                       batch_argnums=(2, 3), donate_argnums=(0, 1))
    out = train(step, *given)
    if stage == "always":
        assert all(x.is_deleted() for x in jax.tree.leaves(eqx.filter(given[:2], eqx.is_array)))
    assert_close(out, train(eqx.filter_jit(chained_gpt_step), *args()))


def test_mlp_with_weights_fetched_from_pinned_host_memory_equals_filter_jit():
    """Equinox's MLP with every layer's parameters and Adam state in cpu:0's
    pinned host memory, its weights fetched for each stage that reads them
    (the fetched offload way): the same as `eqx.filter_jit`, the static
    leaves (activations) kept."""
    model, opt_state = fresh_mlp()
    data = mlp_data()
    layers = hetpar.trace(mlp_step, model, opt_state, *data).layers
    place = "cpu:0:pinned_host"
    fetched = {"compute": "cpu:0", "params": place, "state": place, "update": "cpu:0"}
    step = hetpar.auto(mlp_step, plan=dict.fromkeys(layers, fetched))
    out = train(step, model, opt_state, *data)
    assert_close(out, train(eqx.filter_jit(mlp_step), model, opt_state, *data))
    assert out[0].activation is jax.nn.relu
    assert {x.sharding.memory_kind for x in jax.tree_util.tree_leaves(eqx.filter(
        out[0], eqx.is_array))} == {"pinned_host"}


def test_an_equinox_step_without_a_clip_updates_each_layer_from_its_own_gradient():
    """An Equinox MLP under plain adam (`eqx.filter_value_and_grad`,
    `eqx.apply_updates`): no update waits for another layer's gradient, and
    the cost table says so, so a streamed layer's gradient counts only in
    its backward (`quick_gradients`)."""
    from hetpar.cost_models import cost_table
    from hetpar.planner import Arrays

    model, opt_state = fresh_mlp()
    graph = hetpar.trace(mlp_step, model, opt_state, *mlp_data())
    table = cost_table(graph, ["cpu:0"])
    assert table.meta["update_reads"] == {} and not Arrays(table).waits.any()
