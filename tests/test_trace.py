"""The tracing pass: every equation in one layer, forward/backward/update together."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import hetpar
from hetpar import zoo
from hetpar.passes import PARAM, SHARED, is_backward, is_forward, module_path, trace


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(8)(x))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(4, (3, 3))(x)
        x = Block()(x.reshape(x.shape[0], -1))
        x = jax.checkpoint(jnp.tanh)(x)  # remat at the parent level: must stay whole
        return nn.Dense(2)(x)


def _net_step():
    model, tx = Net(), optax.adam(1e-3)
    x = jnp.ones((2, 5, 5, 1))
    params = model.init(jax.random.key(0), x)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), x)


def test_module_path_strips_transforms():
    assert module_path("transpose(jvp(ResNet))/layer1/Conv_0") == ("ResNet", "layer1", "Conv_0")
    assert module_path("jvp()") == ()
    assert module_path("transpose(jvp(M))/jvp(M)") == ("M",)


def test_flax_layers_and_program_equals_jit():
    step, args = _net_step()
    g = trace(step, *args)
    assert g.layers == ["Conv_0", "Block_0", "Dense_0"]
    # The flat program computes exactly what the step computes.
    out, ref = jax.jit(g.program)(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # No nested plain jit survives (Optax's update uses them).
    assert not any(e.primitive.name in ("pjit", "jit") for e in g.program.eqns)
    # The remat stays one equation.
    assert sum(e.primitive.name.startswith("remat") or e.primitive.name == "checkpoint"
               for e in g.program.eqns) == 1


def test_depth_two_names_sublayers():
    step, args = _net_step()
    g = trace(step, *args, depth=2)
    assert "Block_0/Dense_0" in g.layers


def test_edges_carry_forward_and_backward_bytes():
    step, args = _net_step()
    g = trace(step, *args)
    e = g.graph.edges["Conv_0", "Block_0"]
    # conv output 2x5x5x4 f32 forward, its gradient backward.
    assert e["bytes"] == 2 * 5 * 5 * 4 * 4
    assert e["bytes_backward"] == 2 * 5 * 5 * 4 * 4


def test_fingerprint_names_layers_edges_and_input_shapes():
    step, args = _net_step()
    g = trace(step, *args)
    assert g.fingerprint().startswith("sha256:")
    assert trace(step, *args).fingerprint() == g.fingerprint()
    assert trace(step, *args, depth=2).fingerprint() != g.fingerprint()
    wider = (args[0], args[1], jnp.ones((3, 5, 5, 1)))  # another batch: another step
    assert trace(step, *wider).fingerprint() != g.fingerprint()
    data = g.to_json()
    assert (data["format"], data["meta"]["fingerprint"]) == ("hetpar.layers", g.fingerprint())


def test_named_scopes_in_plain_jax():
    def step(w, x):
        def loss(w):
            with hetpar.layer("first"):
                h = jnp.tanh(x @ w[0])
            with hetpar.layer("second"):
                h = jnp.tanh(h @ w[1])
            return h.sum()

        val, g = jax.value_and_grad(loss)(w)
        return [a - 0.1 * b for a, b in zip(w, g)], val

    w = [jnp.ones((4, 4)), jnp.ones((4, 4))]
    g = trace(step, w, jnp.ones((2, 4)))
    assert g.layers == ["first", "second"]
    assert g.input_layers[:2] == ("first", "second")


def test_recompute_fraction_is_the_forward_the_backward_reads():
    """`first` is linear: its backward reads only its input, nothing of its
    forward to recompute. `second`'s tanh backward reads tanh's result, so
    recomputing it repeats its matmul and tanh, but not the loss's sum."""
    def step(w, x):
        def loss(w):
            with hetpar.layer("first"):
                h = x @ w[0]
            with hetpar.layer("second"):
                h = jnp.tanh(h @ w[1])
            return h.sum()

        val, g = jax.value_and_grad(loss)(w)
        return [a - 0.1 * b for a, b in zip(w, g)], val

    g = trace(step, [jnp.ones((4, 4)), jnp.ones((4, 4))], jnp.ones((2, 4)))
    assert g["first"].recompute_fraction == 0.0
    assert 0.85 < g["second"].recompute_fraction < 1.0


def test_recompute_fraction_follows_the_split_pass_through_other_layers():
    # Flax's `nn.relu(nn.Dense(...)(x))`: the ReLU's backward (`select_n`) is
    # filed under the next layer, reads this layer's mask, and leads back to
    # its matmul: the split pass recomputes (nearly) the whole forward.
    from hetpar.core import Placement
    from hetpar.passes import _split
    from hetpar.passes._costs import eqns_work

    _, g = zoo.trace_model("mlp", small=True)
    eqns = g.program.eqns
    seen = {}
    real = _split._recomputed

    def spy(*args, **kwargs):
        seen["extra"], seen["runs"] = real(*args, **kwargs), args[1]
        return seen["extra"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_split, "_recomputed", spy)
        _split.split(g, {n: Placement("cpu:0", activations="remat").to_json() for n in g.layers})
    for name in g.layers:
        forward = [i for i in g[name].eqns if is_forward(str(eqns[i].source_info.name_stack))]
        again = {i for run, extra in zip(seen["runs"], seen["extra"])
                 if name in {g.eqn_layers[j] for j in run}
                 for i in extra if g.eqn_layers[i] == name}
        split = eqns_work(eqns[i] for i in again).flops / eqns_work(
            eqns[i] for i in forward).flops
        assert g[name].recompute_fraction == pytest.approx(split, abs=0.01), name
    assert g["fc1"].recompute_fraction > 0.9


def test_automatic_clustering_when_nothing_is_named():
    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return h.sum()

        val, g = jax.value_and_grad(loss)(ws)
        return [a - 0.1 * b for a, b in zip(ws, g)], val

    ws = [jnp.ones((16, 16))] * 6
    g = trace(step, ws, jnp.ones((4, 16)), auto_layers=3)
    assert g.layers == ["layer_0", "layer_1", "layer_2"]
    flops = [g[n].flops for n in g.layers]
    assert max(flops) < 2.5 * min(flops)  # balanced


def test_untraceable_step_is_a_clear_error():
    def bad(x):
        if x.sum() > 0:  # Python control flow on a traced value
            return x
        return -x

    with pytest.raises(hetpar.TraceError, match="could not trace bad"):
        trace(bad, jnp.ones(3))


def test_wrong_input_shape_is_a_clear_error():
    w = zoo.get("mlp", small=True)
    variables, opt_state, batch = w.example_args()
    bad = dict(batch, x=jnp.ones((2, 7)))
    with pytest.raises(hetpar.TraceError, match="shapes"):
        trace(w.train_step, variables, opt_state, bad)


def _check_attribution(g):
    jaxpr = g.program.jaxpr.jaxpr
    eqns = jaxpr.eqns
    names = set(g.layers)
    # Every equation belongs to exactly one layer, or to the small shared group.
    assert len(g.eqn_layers) == len(eqns)
    assert all(n in names or n == SHARED for n in g.eqn_layers)
    shared_out = sum(o.aval.size * o.aval.dtype.itemsize
                     for i in g.shared_eqns for o in eqns[i].outvars)
    assert shared_out <= 64, "the shared group must stay tiny (step counters)"
    # Forward and backward of a named module land in the same layer.
    for i, e in enumerate(eqns):
        path = module_path(str(e.source_info.name_stack))
        if len(path) >= 2 and (is_forward(str(e.source_info.name_stack))
                               or is_backward(str(e.source_info.name_stack))):
            assert g.eqn_layers[i] == path[1], (e, path)
    # Every layer that has parameters runs forward and backward code.
    for n in g.layers:
        if g[n].param_bytes:
            stacks = [str(eqns[i].source_info.name_stack) for i in g[n].eqns]
            assert any(map(is_forward, stacks)) and any(map(is_backward, stacks)), n
    # Updates land with their parameter's layer: the new value of every
    # parameter leaf is computed in the layer the parameter belongs to.
    producer = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    for k, role in enumerate(g.input_roles):
        if role != PARAM:
            continue
        out = jaxpr.outvars[k]  # train_step returns (variables, opt_state, loss) in input order
        if isinstance(out, jcore.Var) and out in producer:
            assert g.eqn_layers[producer[out]] == g.input_layers[k], g.program.in_paths[k]


@pytest.mark.parametrize("name", zoo.names())
def test_every_zoo_step_is_fully_attributed(name):
    w = zoo.get(name, small=True)
    args = jax.eval_shape(w.example_args)
    g = trace(w.train_step, *args)
    assert len(g) >= 2
    _check_attribution(g)


def test_workspace_bytes_counts_what_a_layer_holds_only_while_it_runs():
    """A language-model head's logits' softmax and their gradient live only
    while its stage runs: its working set is at least the logits' size,
    beyond the activations it keeps; a small dense body's is near nothing.
    It round-trips through layers.json."""
    batch, width, vocab = 8, 16, 512

    def step(params, x, labels):
        def loss(p):
            with hetpar.layer("body"):
                h = jnp.tanh(x @ p["body"])
            with hetpar.layer("head"):
                logits = h @ p["head"]
                logp = jax.nn.log_softmax(logits)
                nll = -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()
            return nll

        val, g = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, g), val

    params = {"body": jnp.ones((width, width)) * 0.1, "head": jnp.ones((width, vocab)) * 0.1}
    g = hetpar.trace(step, params, jnp.ones((batch, width)), jnp.zeros(batch, jnp.int32))
    logits = batch * vocab * 4
    assert g["head"].workspace_bytes >= logits
    assert g["body"].workspace_bytes < logits / 4
    # The head's forward and backward run unbroken (the labels' shared index
    # arithmetic between them does not break the run), so the logits it keeps
    # are inside its peak: counted in activation_bytes, not again on top.
    # Unfused, its peak is 4 logits-sized arrays (logits, log-softmax, their
    # gradients).
    assert g["head"].activation_bytes >= logits
    assert g["head"].workspace_bytes + g["head"].activation_bytes <= 4 * logits + 1024
    layers = {row["name"]: row for row in g.to_json()["layers"]}
    assert layers["head"]["workspace_bytes"] == g["head"].workspace_bytes


def test_a_recomputed_layer_counts_its_forward_and_backward_as_one_run():
    """Recomputed (activations="remat"), a block's forward runs again right
    before its backward: its activations come back, and its backward frees
    them as it goes. Its working set then (`remat_workspace_bytes`) is at
    least its working set's and under that plus all its activations (what
    the planner took before: 1.65 GB for a 0.54B Llama block, 1.24 counted
    so, about 1.2 compiled), and bounds what XLA's compiled recomputation
    holds beyond its results. It reaches layers.json and the cost table."""
    batch, width, hidden = 64, 128, 512

    def block(p, h):
        return h + (jax.nn.gelu(h @ p["up"]) * jax.nn.sigmoid(h @ p["gate"])) @ p["down"]

    def step(params, x):
        def loss(p):
            with hetpar.layer("block"):
                h = block(p["block"], x)
            with hetpar.layer("out"):
                y = (h ** 2).mean()
            return y

        val, grads = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, grads), val

    keys = jax.random.split(jax.random.key(0), 3)
    params = {"block": {n: jax.random.normal(k, s) * 0.05 for n, k, s in zip(
        ("up", "gate", "down"), keys, ((width, hidden), (width, hidden), (hidden, width)))},
        "out": {}}
    x = jnp.ones((batch, width))
    g = hetpar.trace(step, params, x)
    b = g["block"]
    assert b.workspace_bytes <= b.remat_workspace_bytes \
        < b.workspace_bytes + b.activation_bytes
    assert b.remat_workspace_bytes >= b.activation_bytes  # all back before the backward

    def recomputed(p, h, cotangent):
        _, vjp = jax.vjp(jax.checkpoint(block), p, h)
        return vjp(cotangent)

    xla = jax.jit(recomputed).lower(params["block"], x, x).compile().memory_analysis()
    assert b.remat_workspace_bytes >= xla.temp_size_in_bytes
    layers = {row["name"]: row for row in g.to_json()["layers"]}
    assert layers["block"]["remat_workspace_bytes"] == b.remat_workspace_bytes
    from hetpar.cost_models import cost_table

    table = cost_table(g, ["cpu:0"])
    again = type(table).from_json(table.to_json())
    for t in (table, again):
        assert {la.name: la.remat_workspace_bytes for la in t.layers}["block"] \
            == b.remat_workspace_bytes


def test_workspace_of_a_result_a_shared_equation_reads_last():
    """A step that returns its gradients' global norm: each layer's gradient
    is last read by shared equations after every equation of its own (a
    trace that indexed past the layer's run crashed here)."""
    def step(params, x):
        def loss(p):
            with hetpar.layer("a"):
                h = jnp.tanh(x @ p["a"])
            with hetpar.layer("b"):
                y = jnp.tanh(h @ p["b"])
            return (y ** 2).mean()

        value, grads = jax.value_and_grad(loss)(params)
        new = jax.tree_util.tree_map(lambda a, g: a - 0.1 * g, params, grads)
        return new, value, optax.global_norm(grads)  # after the updates

    params = {"a": jnp.ones((8, 8)) * 0.1, "b": jnp.ones((8, 8)) * 0.1}
    g = hetpar.trace(step, params, jnp.ones((4, 8)))
    assert all(g[layer].workspace_bytes >= 0 for layer in g.layers)


def test_update_reads_names_updates_that_wait_for_other_gradients():
    """Under a global-norm clip every layer's update reads every gradient:
    each waits for the layers below it too, whose backward comes after its
    own (the bottom layer's gradient waits for all the others already).
    Under plain Adam a layer's update reads only what made its own gradient
    (its backward, and the layers above it through the chain rule)."""
    import optax

    from hetpar import passes
    from tests.flax_mlp import MLP

    model = MLP(16)
    x, y = jnp.ones((4, 16)), jnp.zeros((4, 1))
    params = model.init(jax.random.key(0), x)

    def step_of(tx):
        def step(params, opt_state):
            loss, grads = jax.value_and_grad(
                lambda p: ((model.apply(p, x) - y) ** 2).mean())(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return step, (params, tx.init(params))

    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    step, args = step_of(clipped)
    graph = passes.trace(step, *args)
    assert graph.update_reads() == dict.fromkeys(graph.layers[1:], "all")
    step, args = step_of(optax.adam(1e-2))
    assert passes.trace(step, *args).update_reads() == {}
