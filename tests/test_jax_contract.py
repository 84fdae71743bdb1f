"""What hetpar relies on in JAX's internals, checked on a real Flax training step.

hetpar attributes every equation of a traced step to a layer, and to the
forward or the backward, by reading name stacks (passes/_layers.py): JAX
wraps a model's forward in `jvp(...)` and its backward in `transpose(jvp(...))`.
passes/_split.py assembles each stage's jaxpr by hand from equations of the
traced step. Neither is a public JAX API: when a JAX release changes them,
these tests fail first, with a message saying where hetpar needs updating.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import hetpar
from hetpar._grad import microbatched
from hetpar.passes import is_backward, is_forward, microbatch_of, module_path, split

NAME_STACKS = (f"JAX's name-stack format changed (jax {jax.__version__}): hetpar's layer "
               "attribution in passes/_layers.py needs updating; pyproject pins jax<0.12 until "
               "it does.")
JAXPRS = (f"JAX's jaxpr internals changed (jax {jax.__version__}): the stage jaxprs that "
          "passes/_split.py assembles by hand no longer evaluate as the step does; pyproject "
          "pins jax<0.12 until it is updated.")


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(4, name="hidden")(x))
        return nn.Dense(2, name="out")(h)


MODEL, TX = Model(), optax.sgd(0.1)


def train_step(params, opt_state, batch):
    def loss(p, x, y):
        return jnp.mean((MODEL.apply(p, x) - y) ** 2)

    value, grads = hetpar.value_and_grad(loss)(params, batch["x"], batch["y"])
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


@pytest.fixture(scope="module")
def args():
    x = jax.random.normal(jax.random.key(0), (4, 3))
    y = jax.random.normal(jax.random.key(1), (4, 2))
    params = MODEL.init(jax.random.key(2), x)
    return params, TX.init(params), {"x": x, "y": y}


def dots(closed):
    """(name stack, equation) of every matrix product, in program order."""
    return [(str(e.source_info.name_stack), e) for e in closed.jaxpr.eqns
            if e.primitive.name == "dot_general"]


def test_forward_and_backward_carry_jvp_and_transpose(args):
    found = dots(jax.make_jaxpr(train_step)(*args))
    stacks = [s for s, _ in found]
    # Two layers: the forward's 2 products (x @ W_hidden, h @ W_out) come first
    # in program order, then the backward's 3 (dW_out, dh, dW_hidden).
    assert len(found) == 5, f"{NAME_STACKS} Matrix products: {stacks}"
    for s in stacks[:2]:
        assert is_forward(s) and not is_backward(s), \
            f"{NAME_STACKS} A forward product's name stack is {s!r}; expected 'jvp(Model)/...'"
    for s in stacks[2:]:
        assert is_backward(s) and not is_forward(s), (
            f"{NAME_STACKS} A backward product's name stack is {s!r}; "
            "expected 'transpose(jvp(Model))/...'")
    # Stripping the wrappers leaves the module path: forward and backward of a
    # layer name the same module.
    paths = [module_path(s) for s in stacks]
    assert paths[:2] == [("Model", "hidden"), ("Model", "out")], f"{NAME_STACKS} {stacks}"
    assert sorted(paths[2:]) == [("Model", "hidden"), ("Model", "out"), ("Model", "out")], \
        f"{NAME_STACKS} {stacks}"


def test_the_update_is_neither_and_the_loss_is_forward(args):
    closed = jax.make_jaxpr(train_step)(*args)
    maker = {o: str(e.source_info.name_stack) for e in closed.jaxpr.eqns for o in e.outvars}
    outs = closed.jaxpr.outvars
    n_params = len(jax.tree_util.tree_leaves(args[0]))
    for v in outs[:n_params]:  # SGD's `params - lr * grad`, outside the gradient
        s = maker[v]
        assert not is_forward(s) and not is_backward(s), \
            f"{NAME_STACKS} The update's name stack is {s!r}; expected no 'jvp(' or 'transpose('"
    s = maker[outs[-1]]  # the loss value: the forward's last equation
    assert is_forward(s), f"{NAME_STACKS} The loss's name stack is {s!r}; expected 'jvp(...)'"


def test_microbatch_scope_survives_the_transforms(args):
    found = dots(jax.make_jaxpr(microbatched(train_step, 2))(*args))
    assert len(found) == 10, f"{NAME_STACKS} {[s for s, _ in found]}"
    for mb in (0, 1):
        mine = [s for s, _ in found if microbatch_of(s) == mb]
        assert sum(map(is_forward, mine)) == 2 and sum(map(is_backward, mine)) == 3, (
            f"{NAME_STACKS} Microbatch {mb}'s products carry {mine}; expected "
            f"'hetpar_mb{mb}' with 2 'jvp(' and 3 'transpose(' stacks")


@pytest.mark.parametrize("microbatches", [1, 2])
def test_hand_assembled_stage_jaxprs_evaluate_as_the_step(args, microbatches):
    step = microbatched(train_step, microbatches)
    graph = hetpar.trace(step, *args)
    assert graph.layers[:2] == ["hidden", "out"], graph.layers
    stages = split(graph, {"hidden": "cpu:0", "out": "cpu:1"})
    assert len(stages.stages) > 2
    # Run the stages one after another, in their global order, as plain jitted
    # functions of their closed jaxprs (what the runtime compiles per device).
    jaxpr = graph.program.jaxpr.jaxpr
    env = dict(zip(jaxpr.invars, jax.tree_util.tree_leaves(args)))
    for st in stages.stages:
        try:
            outs = jax.jit(jcore.jaxpr_as_fun(st.jaxpr))(*[env[v] for v in st.inputs])
        except Exception as e:  # noqa: BLE001 - re-raised with what to update
            raise AssertionError(f"{JAXPRS} Stage {st}: {type(e).__name__}: {e}") from e
        env.update(zip(st.outputs, outs))
    got = [env[v] if isinstance(v, jcore.Var) else v.val for v in jaxpr.outvars]
    want = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    assert len(got) == len(want), JAXPRS
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7,
                                   err_msg=JAXPRS)


def test_a_result_passed_through_a_jit_is_a_buffer_of_its_execution():
    # The step clock waits for one result a device of a one-executable step
    # (hetpar/_step_clock.py, one_per_device): that holds only while every
    # result, an argument returned as it is included, is the execution's own,
    # ready when it is.
    a, b = jnp.ones(3), jnp.ones(3)
    for jitted in (jax.jit(lambda x, y: (x, y + 1)),
                   jax.jit(lambda x, y: (x, y + 1), donate_argnums=(0,))):
        x = jnp.ones(3)  # (a fresh one: the second jit donates it)
        out = jitted(x, b)
        assert out[0] is not x, (
            f"jax {jax.__version__} returns an argument passed through a jit as itself: "
            "the step clock's one_per_device must wait for such results too")
    out = jax.jit(lambda x, y: (x, y + 1))(a, b)
    assert out[0].unsafe_buffer_pointer() != a.unsafe_buffer_pointer()
