"""Text models: a hashed byte n-gram classifier and an LSTM language model."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

# Odd 32-bit multipliers (from MurmurHash3 / FNV) to mix bytes into n-gram hashes.
_MIX = (0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1)


class TextVectorization(nn.Module):
    """Hash byte n-grams of raw text into token ids, with integer ops only.

    Byte 0 is padding. Every n-gram (n = 1..`ngrams`) at every position is
    hashed into `[1, vocab_size)`; n-grams that touch padding get id 0. The
    output concatenates the n-gram orders along the sequence axis.
    Parameter-free, like Keras' `TextVectorization` after `adapt`.
    """

    vocab_size: int
    ngrams: int = 2

    @nn.compact
    def __call__(self, text: jax.Array) -> jax.Array:
        text = text.astype(jnp.uint32)
        length = text.shape[1]
        ids = []
        for n in range(1, min(self.ngrams, length) + 1):
            span = length - n + 1
            h = jnp.full((text.shape[0], span), n, jnp.uint32)
            valid = jnp.ones((text.shape[0], span), bool)
            for k in range(n):
                byte = text[:, k : k + span]
                # uint32 arithmetic wraps, which is what a hash wants.
                h = (h ^ byte) * jnp.uint32(_MIX[k % len(_MIX)])
                h = h ^ (h >> 15)
                valid &= byte != 0
            token = (h % jnp.uint32(self.vocab_size - 1)).astype(jnp.int32) + 1
            ids.append(jnp.where(valid, token, 0))
        return jnp.concatenate(ids, axis=1)


class TextClassifier(nn.Module):
    """Text vectorization, embedding, masked mean pooling, dense layers.

    In the style of Keras' text classification tutorial, on raw bytes.
    """

    vocab_size: int = 10000
    ngrams: int = 2
    embed_dim: int = 64
    hidden: Sequence[int] = (64,)
    num_classes: int = 2

    @nn.compact
    def __call__(self, text: jax.Array) -> jax.Array:
        tokens = TextVectorization(self.vocab_size, self.ngrams, name="vectorize")(text)
        x = nn.Embed(self.vocab_size, self.embed_dim, name="embedding")(tokens)
        # Mean over real tokens only; id 0 is padding.
        mask = (tokens > 0).astype(x.dtype)[..., None]
        x = (x * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
        for i, features in enumerate(self.hidden, start=1):
            x = nn.relu(nn.Dense(features, name=f"fc{i}")(x))
        return nn.Dense(self.num_classes, name=f"fc{len(self.hidden) + 1}")(x)


class LSTMLanguageModel(nn.Module):
    """Embedding, stacked LSTMs (each scanned over time), and a vocabulary head.

    Each LSTM is one `nn.RNN` (a `scan`), so a whole layer stays together.
    """

    vocab_size: int = 10000
    embed_dim: int = 512
    hidden: int = 512
    num_layers: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab_size, self.embed_dim, name="embedding")(tokens)
        for i in range(1, self.num_layers + 1):
            x = nn.RNN(nn.OptimizedLSTMCell(self.hidden), name=f"lstm{i}")(x)
        return nn.Dense(self.vocab_size, name="head")(x)
