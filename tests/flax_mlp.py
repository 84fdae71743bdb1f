"""A user-written Flax step the memory tests share: six tanh Dense layers and
a head, Adam, a mean-squared loss (tests/test_capacity.py,
tests/test_memory_check.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class MLP(nn.Module):
    width: int = 64

    @nn.compact
    def __call__(self, x):
        for i in range(6):
            x = nn.tanh(nn.Dense(self.width, name=f"dense{i}")(x))
        return nn.Dense(1, name="head")(x)


def mlp_step(width: int = 64):
    model, tx = MLP(width), optax.adam(1e-2)

    def step(params, opt_state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(
            lambda p: ((model.apply(p, x) - y) ** 2).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x, y = jnp.ones((8, width)), jnp.linspace(0.0, 1.0, 8)[:, None]
    params = model.init(jax.random.key(0), x)
    return step, (params, tx.init(params), (x, y))
