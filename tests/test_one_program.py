"""A plan on one device with recomputed layers runs as one executable
(`passes/_fuse.py`), computing what `jax.jit` computes.

Whether the recomputation survives XLA is a GPU matter: XLA's CPU backend
drops the barriers before its common-subexpression pass and merges the
recomputed forward with the original, `jax.checkpoint`'s too (23 matmuls
lowered, 17 compiled, as without it). tests/test_gpu.py checks that the
executable recomputes and holds less than jit's on a GPU.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import hetpar
from hetpar.passes import fusable, one_program, split

from . import oracle


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(32, name="down")(jax.nn.gelu(nn.Dense(64, name="up")(x)))


class Mlp(nn.Module):
    """Written as Flax users write it: residual MLP blocks, a head."""

    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = Block(name=f"block{i}")(x)
        return nn.Dense(4, name="head")(x)


def _step():
    model = Mlp()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    x = jax.random.normal(jax.random.key(1), (16, 32))
    y = jax.random.normal(jax.random.key(2), (16, 4))
    params = model.init(jax.random.key(0), x)

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, (params, tx.init(params), {"x": x, "y": y})


def _remat(layers, which=lambda la: la.startswith("block")):
    return {la: {"compute": "cpu:0", "activations": "remat"} if which(la) else "cpu:0"
            for la in layers}


# Slow (4-5 s of compiles, over the fast tier's 3 minutes): the fast tier runs
# a fused plan against jax.jit in test_donation's "remat" case.
@pytest.mark.slow
def test_recomputed_layers_on_one_device_run_as_one_executable_equal_to_jit():
    train_step, args = _step()
    graph = hetpar.trace(train_step, *args)
    step = hetpar.auto(train_step, plan=_remat(graph.layers), profile=None)
    oracle.check_steps_equal_jit(step, train_step, args)
    stages = step._last.stages
    assert len(stages.stages) == 1 and set(graph.layers) <= set(stages.stages[0].layers)
    assert len(split(graph, _remat(graph.layers)).stages) > 2  # what it fused


@pytest.mark.parametrize("plan", ["two_devices", "state_in_pinned_host", "keep"])
def test_only_one_device_holding_everything_is_fused(plan):
    train_step, args = _step()
    graph = hetpar.trace(train_step, *args)
    if plan == "two_devices":
        assignment = _remat(graph.layers)
        assignment["head"] = "cpu:1"
    elif plan == "state_in_pinned_host":
        assignment = {la: {"compute": "cpu:0", "state": "cpu:0:pinned_host",
                           "activations": "remat"} for la in graph.layers}
    else:  # nothing recomputed: a one-device plan runs as jax.jit, never split
        assignment = dict.fromkeys(graph.layers, "cpu:0")
    stages = split(graph, assignment)
    if plan == "keep":  # one stage already: nothing to fuse
        assert len(stages.stages) == 1 and one_program(stages) is stages
    else:
        assert not fusable(stages) and one_program(stages) is stages


def test_a_recomputed_layer_recomputes_its_forward_only():
    """Recomputing a layer repeats its forward (about a third of its work),
    not its backward: the update stage reads the gradients the backward
    made. (It repeated both: a 6.74B Llama-style step with 31 of 35 layers
    recomputed ran at 1.96x jit's step on an H200; here the work was 1.77x
    the step's.)"""
    from hetpar.passes import jaxpr_work

    train_step, args = _step()
    graph = hetpar.trace(train_step, *args)
    step_flops = jaxpr_work(graph.program.jaxpr.jaxpr).flops
    stages = split(graph, _remat(graph.layers))
    recomputed = sum(jaxpr_work(st.jaxpr.jaxpr).flops for st in stages.stages) / step_flops
    assert 1.05 < recomputed < 1.4, recomputed
