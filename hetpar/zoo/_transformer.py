"""A GPT-2-style decoder-only transformer (Radford et al., 2019).

Attention is written out with einsum and softmax so every FLOP is visible in
the jaxpr. Blocks are direct children of the root (`h0` ... `h11`, GPT-2's
names), next to `wte`, `wpe`, `ln_f` and `lm_head`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

_init = nn.initializers.normal(stddev=0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.num_heads
        qkv = nn.Dense(3 * d_model, kernel_init=_init, name="c_attn")(x)
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3, self.num_heads, head_dim), 3, axis=2)
        q, k, v = (t[:, :, 0] for t in (q, k, v))  # [batch, seq, heads, head_dim]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d_model)
        return nn.Dense(d_model, kernel_init=_init, name="c_proj")(out)


class MLPBlock(nn.Module):
    """Position-wise feed-forward: dense, GELU (tanh), dense."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.gelu(nn.Dense(self.hidden, kernel_init=_init, name="c_fc")(x), approximate=True)
        return nn.Dense(x.shape[-1], kernel_init=_init, name="c_proj")(y)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and MLP, each with a residual."""

    num_heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        attn = CausalSelfAttention(self.num_heads, name="attn")
        x = x + attn(nn.LayerNorm(epsilon=1e-5, name="ln_1")(x))
        mlp = MLPBlock(self.mlp_ratio * x.shape[-1], name="mlp")
        return x + mlp(nn.LayerNorm(epsilon=1e-5, name="ln_2")(x))


class TiedHead(nn.Module):
    """Logits from the token embedding matrix (GPT-2 ties input and output)."""

    @nn.compact
    def __call__(self, x: jax.Array, embedding: jax.Array) -> jax.Array:
        return jnp.einsum("bsd,vd->bsv", x, embedding.astype(x.dtype))


class GPT(nn.Module):
    """GPT-2 small by default: 124,439,808 parameters with the tied head.

    Attributes:
      vocab_size: Token vocabulary (50257 for GPT-2's BPE).
      max_positions: Rows of the learned position embedding (1024 in GPT-2).
      d_model: Width of the residual stream.
      num_heads: Attention heads.
      num_layers: Transformer blocks.
      mlp_ratio: MLP hidden width over `d_model`.
      tie_embeddings: Reuse `wte` as the output projection (GPT-2 does). The
        head is then its own parameter-free module, `lm_head`, so its compute
        groups at the end of the model rather than with `wte`.
    """

    vocab_size: int = 50257
    max_positions: int = 1024
    d_model: int = 768
    num_heads: int = 12
    num_layers: int = 12
    mlp_ratio: int = 4
    tie_embeddings: bool = True

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        wte = nn.Embed(self.vocab_size, self.d_model, embedding_init=_init, name="wte")
        x = wte(tokens)
        positions = jnp.arange(tokens.shape[1])
        wpe = nn.Embed(self.max_positions, self.d_model, embedding_init=_init, name="wpe")
        x = x + wpe(positions)[None]
        for i in range(self.num_layers):
            x = Block(self.num_heads, self.mlp_ratio, name=f"h{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, name="ln_f")(x)
        if self.tie_embeddings:
            return TiedHead(name="lm_head")(x, wte.embedding)
        return nn.Dense(self.vocab_size, use_bias=False, kernel_init=_init, name="lm_head")(x)
