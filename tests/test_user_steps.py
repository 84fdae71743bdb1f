"""Training steps written the way Flax and Optax users write them.

Optimizers that read all parameters at once (issue 14, item 1):
`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))`, the
standard in Hugging Face scripts, `optax.apply_if_finite` and
`optax.MultiSteps`. Each parameter's update and optimizer state must land
in that parameter's own layer: the global reduction (a gradient norm, an
all-finite check) becomes per-layer partial results plus a tiny shared
combine, and no optimizer state crosses between layers. A plan that splits
the layers over two devices must compute what `jax.jit` computes.

The only hetpar code below is `hetpar.trace` and `hetpar.auto`.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.extend import core as jcore

import hetpar

from . import oracle


class Net(nn.Module):
    """A tiny MLP with a norm: three Dense layers and a LayerNorm."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(16)(x))
        x = nn.LayerNorm()(x)
        x = nn.gelu(nn.Dense(16)(x))
        return nn.Dense(8)(x)


LAYERS = ["Dense_0", "LayerNorm_0", "Dense_1", "Dense_2"]


def make_step(tx):
    model = Net()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    y = jax.random.normal(jax.random.key(2), (4, 8))
    params = model.init(jax.random.key(0), x)

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            pred = model.apply(params, batch["x"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, (params, tx.init(params), {"x": x, "y": y})


def plain(tx):
    """The same step traced with a per-leaf optimizer: the reference for layer edges."""
    step, args = make_step(tx)
    return hetpar.trace(step, *args)


def leaf_layer(path: str) -> str:
    """The layer a parameter or optimizer-state leaf belongs to, from its key path."""
    return re.search(r"\['params'\]\['([^']+)'\]", path).group(1)


def check_state_in_own_layer(g):
    """Every parameter and optimizer-state leaf (more than one element) lives in its
    parameter's layer; its update is computed there; only that layer reads it."""
    jaxpr = g.program.jaxpr.jaxpr
    producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    readers = {}
    for i, e in enumerate(jaxpr.eqns):
        for a in e.invars:
            if isinstance(a, jcore.Var):
                readers.setdefault(a, set()).add(g.eqn_layers[i])
    checked = 0
    for k, (v, role, path) in enumerate(zip(jaxpr.invars, g.input_roles, g.program.in_paths)):
        if role not in ("param", "opt_state") or v.aval.size == 1:
            continue  # step counts, flags: tiny shared scalars
        want = leaf_layer(path)
        assert g.input_layers[k] == want, path
        assert readers.get(v, {want}) == {want}, (path, readers[v])
        # train_step returns (params, opt_state, loss): outputs in input order.
        out = jaxpr.outvars[k]
        assert g.eqn_layers[producer[out]] == want, path
        checked += 1
    assert checked > 0


def check_no_optimizer_edges(g, g_plain):
    """The layers exchange exactly what they do under a per-leaf optimizer: activations
    and their gradients, no optimizer state, no partial results."""
    def edges(graph):
        return {(u, v): (d["bytes"], d["bytes_backward"])
                for u, v, d in graph.graph.edges(data=True)}

    assert edges(g) == edges(g_plain)


def check_split_equals_jit(step, args, batches=None, steps=3):
    """Layers alternate over cpu:0 / cpu:1; `steps` steps equal `jax.jit`'s,
    leaf by leaf from the same inputs (tests/oracle.py)."""
    g = hetpar.trace(step, *args)
    plan = {name: f"cpu:{k % 2}" for k, name in enumerate(g.layers)}
    oracle.check_steps_equal_jit(hetpar.auto(step, plan=plan), step, args, batches=batches,
                                 steps=steps)
    return g


@pytest.mark.slow  # multi_steps[clip_adamw] runs a clipped chain fast
def test_clip_by_global_norm_chain_keeps_state_per_layer():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    step, args = make_step(tx)
    g = hetpar.trace(step, *args)
    assert g.layers == LAYERS
    check_state_in_own_layer(g)
    check_no_optimizer_edges(g, plain(optax.adamw(1e-3)))
    # The norm's combine (sum of per-leaf partial norms, sqrt, comparison) is
    # shared; every per-leaf square-and-sum sits in its leaf's layer.
    eqns = g.program.eqns
    shared = [eqns[i].primitive.name for i in g.shared_eqns]
    assert "sqrt" in shared
    assert all(eqns[i].outvars[0].aval.size == 1 for i in g.shared_eqns)
    check_split_equals_jit(step, args)


@pytest.mark.slow  # fast-tier time
def test_apply_if_finite_keeps_state_per_layer_and_rejects_like_jit():
    # Optax writes the accept/reject as one `lax.cond` over the whole inner
    # update, here with a global-norm clip inside. The cond is cut per layer:
    # each layer's part squares-and-sums its gradients, a shared part combines
    # the norm, and each layer's second part scales and updates its leaves.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    tx = optax.apply_if_finite(inner, max_consecutive_errors=3)
    step, args = make_step(tx)
    g = hetpar.trace(step, *args)
    check_state_in_own_layer(g)
    check_no_optimizer_edges(g, plain(optax.adamw(1e-3)))
    conds = [i for i, e in enumerate(g.program.eqns) if e.primitive.name == "cond"]
    assert {g.eqn_layers[i] for i in conds} >= set(LAYERS)
    assert not g.notes
    # The second batch has a NaN: its update is rejected on both sides.
    batch = args[-1]
    bad = {"x": batch["x"].at[0, 0].set(jnp.nan), "y": batch["y"]}
    check_split_equals_jit(step, args, batches=[batch, bad, batch])


@pytest.mark.parametrize("clip", [pytest.param(False, marks=pytest.mark.slow),
                                  pytest.param(True, marks=pytest.mark.slow)],
                         ids=["adamw", "clip_adamw"])
def test_multi_steps_splits_per_layer_and_equals_jit(clip):
    # Gradient accumulation over 2 steps: Optax's update is one `lax.cond`.
    # Grouping: its results are independent per parameter leaf (accumulate,
    # Adam, emit every k-th step), so it is cut into one cond per leaf, each in
    # its parameter's layer; the mini-step and step counters (one element each)
    # are shared. With a global-norm clip inside, each leaf's part is cut in two
    # phases around a shared cond that combines the norm.
    inner = optax.adamw(1e-3)
    if clip:
        inner = optax.chain(optax.clip_by_global_norm(1.0), inner)
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    step, args = make_step(tx)
    g = hetpar.trace(step, *args)
    check_state_in_own_layer(g)
    check_no_optimizer_edges(g, plain(optax.adamw(1e-3)))
    assert not g.notes
    check_split_equals_jit(step, args)


@pytest.mark.slow  # 3-7 s of compiles: over the fast tier's 3-minute budget (CI runs it)
def test_cond_tied_by_one_tensor_stays_whole_and_says_why():
    # A user's own cond that works on all gradients flattened into one vector:
    # its results cannot be cut per layer. It stays whole (one layer), the
    # graph says why, and the split step still equals jit.
    from jax.flatten_util import ravel_pytree

    model = Net()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    params = model.init(jax.random.key(0), x)
    _, unravel = ravel_pytree(params)

    def train_step(params, step_count, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates = jax.lax.cond(step_count > 0,
                               lambda g: unravel(ravel_pytree(g)[0] * 0.5),
                               lambda g: g, grads)
        params = jax.tree_util.tree_map(lambda p, u: p - 1e-2 * u, params, updates)
        return params, step_count + 1, loss

    args = (params, jnp.array(1), x)
    g = hetpar.trace(train_step, *args)
    conds = [i for i, e in enumerate(g.program.eqns) if e.primitive.name == "cond"]
    assert len(conds) == 1
    assert len(g.notes) == 1 and "stays whole" in g.notes[0], g.notes
    check_split_equals_jit(train_step, args)
    # The user sees it too.
    one = hetpar.auto(train_step, devices=["cpu:0"])
    one(*args)
    assert f"not cut per layer: {g.notes[0]}" in one.explain()


# The fast tier's check of the remat policy; offload is slow-tier here and
# in test_offload_runtime.
@pytest.mark.parametrize("activations", ["remat", pytest.param("offload", marks=pytest.mark.slow)])
def test_optax_chain_with_state_in_pinned_memory_and_activation_policies_equals_jit(activations):
    """A Flax step with a clipped AdamW chain, written as users write it, with
    every layer's optimizer state in pinned host memory and its activations
    recomputed or offloaded: three steps equal jax.jit."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    step, args = make_step(tx)
    layers = hetpar.trace(step, *args).layers
    plan = {la: {"compute": "cpu:0", "params": "cpu:0", "state": "cpu:0:pinned_host",
                 "activations": activations} for la in layers}
    auto_step = hetpar.auto(step, plan=plan)
    oracle.check_steps_equal_jit(auto_step, step, auto_step.place(*args))


def test_recomputed_layers_read_their_parameters_again_from_where_they_live():
    """Parameters and their update on cpu:1, compute on cpu:0, activations
    recomputed: the backward reads each layer's parameters again from cpu:1
    to recompute its forward, and keeps none of the forward's results alive
    until then (before: it kept the matmul's, freeing nothing the planner
    counted on). Three steps equal jax.jit."""
    from hetpar.passes import split

    def train_step(params, x):
        def loss(p):
            with hetpar.layer("first"):
                h = jax.nn.gelu(x @ p["w0"] + p["b0"])
            with hetpar.layer("second"):  # reads the first layer's w0 too (tied)
                y = jax.nn.gelu(h @ p["w1"] + p["b1"] + (h @ p["w0"].T)[:, :4])
            return jnp.mean(y ** 2)

        val, g = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, g), val

    keys = jax.random.split(jax.random.key(0), 3)
    params = {"w0": jax.random.normal(keys[0], (8, 16)), "b0": jnp.zeros(16),
              "w1": jax.random.normal(keys[1], (16, 4)), "b1": jnp.zeros(4)}
    args = (params, jax.random.normal(keys[2], (4, 8)))
    graph = hetpar.trace(train_step, *args)

    def place(activations):
        return {la: {"compute": "cpu:0", "params": "cpu:1", "state": "cpu:1",
                     "update": "cpu:1", "activations": activations} for la in graph.layers}

    def forward_and_backward(stages, layer):
        own = sorted((st for st in stages.stages if st.layers == (layer,)),
                     key=lambda st: st.index)
        return own[0], own[-1]

    remat, kept = split(graph, place("remat")), split(graph, place("keep"))
    invars = graph.program.jaxpr.jaxpr.invars
    fwd, bwd = forward_and_backward(kept, "first")
    assert set(fwd.outputs) & set(bwd.inputs)  # kept: alive from forward to backward
    fwd, bwd = forward_and_backward(remat, "first")
    assert not set(fwd.outputs) & set(bwd.inputs)  # recomputed instead
    assert {params["w0"].shape, params["b0"].shape} <= {
        v.aval.shape for v in bwd.inputs if v in invars}  # from cpu:1 again
    fwd, bwd = forward_and_backward(remat, "second")  # a tied weight is read again too
    assert not set(fwd.outputs) & set(bwd.inputs)
    assert params["w0"].shape in {v.aval.shape for v in bwd.inputs if v in invars}
    homes = dict(zip(invars, remat.input_devices))
    for st in remat.stages:  # what comes from cpu:1 to cpu:0: parameters alone
        for v in st.inputs:
            if st.device == "cpu:0" and homes.get(v) == "cpu:1":
                assert graph.input_roles[invars.index(v)] == "param"
    oracle.check_steps_equal_jit(hetpar.auto(train_step, plan=place("remat")), train_step, args)
