"""A Llama-style language model written the way users write one (not hetpar's zoo).

Flax linen: token embedding, blocks of (RMSNorm, multi-head attention with
rotary position embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an
untied head; trained with `optax.chain(clip_by_global_norm(1.0), adamw)` by a
step written with `jax.value_and_grad`, as in the Flax and MaxText examples.
Used by experiments/bench_fit.py; sizes from the Llama papers' shapes.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32000
    d_model: int = 2048
    num_layers: int = 8
    num_heads: int = 16
    hidden: int = 5504  # SwiGLU: about 8/3 d_model, rounded as Llama rounds it


class RMSNorm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * scale


def rotary(x, positions):
    """Rotary position embedding over the last axis of x: [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Attention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        h = self.cfg.num_heads
        q, k, v = (nn.Dense(d, use_bias=False, name=n)(x).reshape(b, t, h, d // h)
                   for n in ("wq", "wk", "wv"))
        pos = jnp.arange(t, dtype=jnp.float32)
        q, k = rotary(q, pos), rotary(k, pos)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // h).astype(x.dtype)
        mask = jnp.tril(jnp.ones((t, t), bool))
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), v)
        return nn.Dense(d, use_bias=False, name="wo")(out.reshape(b, t, d))


class SwiGLU(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        gate = nn.Dense(self.cfg.hidden, use_bias=False, name="w1")(x)
        up = nn.Dense(self.cfg.hidden, use_bias=False, name="w3")(x)
        return nn.Dense(x.shape[-1], use_bias=False, name="w2")(nn.silu(gate) * up)


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        x = x + Attention(self.cfg, name="attention")(RMSNorm(name="attention_norm")(x))
        return x + SwiGLU(self.cfg, name="feed_forward")(RMSNorm(name="ffn_norm")(x))


class Llama(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.cfg.vocab, self.cfg.d_model, name="tok_embeddings")(tokens)
        for i in range(self.cfg.num_layers):
            x = Block(self.cfg, name=f"layers_{i}")(x)
        x = RMSNorm(name="norm")(x)
        return nn.Dense(self.cfg.vocab, use_bias=False, name="output")(x)


def make(cfg: Config, batch: int, seq: int):
    """(train_step, init) for the model: `init(key)` gives (params, opt_state, batch)."""
    model = Llama(cfg)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))

    def train_step(params, opt_state, batch):
        def loss_fn(p):
            logits = model.apply(p, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch["targets"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init(key):
        tokens = jax.random.randint(key, (batch, seq + 1), 0, cfg.vocab)
        data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        params = model.init(key, data["inputs"][:1])
        return params, tx.init(params), data

    return train_step, init


def parameter_count(cfg: Config) -> int:
    d, h = cfg.d_model, cfg.hidden
    return 2 * cfg.vocab * d + cfg.num_layers * (4 * d * d + 3 * d * h + 2 * d) + d
