"""The Workload type: a model, its optimizer, a synthetic batch and one train step.

Every zoo model shares the single `Workload.train_step` below, so the way
gradients are taken lives in one place: `hetpar.value_and_grad`, which is
`jax.value_and_grad` except under `hetpar.auto(..., microbatches=M)`, where it
marks the part of the step that runs per microbatch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from hetpar._grad import value_and_grad as _value_and_grad

Objective = Callable[[Any, Any], jax.Array]
"""Maps (model output, batch) to a scalar loss."""


def softmax_cross_entropy(logits: jax.Array, batch: dict) -> jax.Array:
    """Mean cross-entropy of `logits` against integer labels `batch["y"]`."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
    return losses.mean()


def next_token_cross_entropy(logits: jax.Array, batch: dict) -> jax.Array:
    """Mean cross-entropy of predicting token t+1 of `batch["x"]` from position t."""
    targets = batch["x"][:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), targets
    )
    return losses.mean()


def l1_loss(images: jax.Array, batch: dict) -> jax.Array:
    """Mean absolute difference between generated images and `batch["y"]`."""
    return jnp.abs(images.astype(jnp.float32) - batch["y"]).mean()


def run_once(fn: Callable, *args: Any) -> Any:
    """Compiles `fn` with XLA's backend optimisations off and calls it once.

    For one-off programs (parameter init, synthetic data): on CPU, XLA's
    optimising backend spends seconds on the random-number code of an init,
    which runs only once; level 0 compiles it about ten times faster.
    """
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(args)):
        return fn(*args)  # Under a transformation (eval_shape, jit): just trace.
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile({"xla_backend_optimization_level": 0})(*args)


def _count(tree: Any) -> int:
    return int(sum(leaf.size for leaf in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass(frozen=True, eq=False)
class Workload:
    """A ready-to-train zoo model.

    Attributes:
      name: The zoo name, e.g. `"resnet50"`.
      config: The resolved config (defaults plus overrides, and `batch_size`).
      model: The Flax linen module; its top-level layers are direct children.
      optimizer: The Optax transformation `train_step` applies.
      batch: A synthetic, deterministic example batch (a dict of arrays).
      objective: Maps (model output, batch) to the scalar loss.
      inputs: Batch keys passed, in order, as the model's positional arguments.
    """

    name: str
    config: dict
    model: nn.Module
    optimizer: optax.GradientTransformation
    batch: Any
    objective: Objective = dataclasses.field(repr=False)
    inputs: tuple[str, ...] = ("x",)

    def _loss_and_state(self, params: Any, state: dict, batch: Any) -> tuple[jax.Array, dict]:
        """Forward pass and loss; returns the updated non-parameter collections."""
        variables = {"params": params, **state}
        args = [batch[key] for key in self.inputs]
        if state:
            # BatchNorm models run in training mode and update their statistics.
            out, new_state = self.model.apply(variables, *args, mutable=list(state))
        else:
            out, new_state = self.model.apply(variables, *args), {}
        return self.objective(out, batch).astype(jnp.float32), dict(new_state)

    def loss(self, variables: dict, batch: Any) -> jax.Array:
        """The scalar f32 training loss (BatchNorm in training mode; new stats dropped).

        Args:
          variables: `{"params": ..., optionally "batch_stats": ...}`.
          batch: A batch shaped like `self.batch`.

        Returns:
          The mean loss over the batch.
        """
        state = {k: v for k, v in variables.items() if k != "params"}
        return self._loss_and_state(variables["params"], state, batch)[0]

    def train_step(
        self, variables: dict, opt_state: Any, batch: Any
    ) -> tuple[dict, Any, jax.Array]:
        """One full training step: forward, backward and optimizer update.

        Pure and not jitted, so callers may `jax.jit` or `jax.make_jaxpr` it.
        Gradients flow to `variables["params"]` only; other collections
        (BatchNorm's `batch_stats`) are updated by the forward pass.

        Args:
          variables: `{"params": ..., optionally "batch_stats": ...}`.
          opt_state: The optimizer state for `variables["params"]`.
          batch: A batch shaped like `self.batch`.

        Returns:
          `(new_variables, new_opt_state, loss)`, with the same tree structures.
        """
        params = variables["params"]
        state = {k: v for k, v in variables.items() if k != "params"}
        (loss, new_state), grads = _value_and_grad(self._loss_and_state, has_aux=True)(
            params, state, batch
        )
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return {"params": params, **new_state}, opt_state, loss

    def _init_variables(self, key: jax.Array) -> dict:
        args = [self.batch[k] for k in self.inputs]
        return dict(self.model.init(key, *args))

    def init(self, seed: int = 0) -> tuple[dict, Any]:
        """Fresh variables and optimizer state.

        Args:
          seed: Seed of the parameter initialisation.

        Returns:
          `(variables, opt_state)`.
        """

        def init(key):
            variables = self._init_variables(key)
            return variables, self.optimizer.init(variables["params"])

        # One program compiled cheaply: op-by-op initialisation costs seconds on CPU.
        return run_once(init, jax.random.PRNGKey(seed))

    def example_args(self, seed: int = 0) -> tuple[dict, Any, Any]:
        """`(variables, opt_state, batch)`, ready for `train_step`."""
        variables, opt_state = self.init(seed)
        return variables, opt_state, self.batch

    @functools.cached_property
    def param_count(self) -> int:
        """Number of trainable parameters (counted with `jax.eval_shape`)."""
        shapes = jax.eval_shape(self._init_variables, jax.random.PRNGKey(0))
        return _count(shapes["params"])
