"""Synthetic batches for the zoo's models: shapes and dtypes of real data, no downloads.

Each maker takes (resolved config, batch size, key) and returns the batch dict
the model's `Workload` feeds to its train step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def images(config: dict, batch: int, key: jax.Array) -> dict:
    """Normalised images `x` [N, S, S, 3] and class labels `y`."""
    kx, ky = jax.random.split(key)
    size = config["image_size"]
    return {
        "x": jax.random.normal(kx, (batch, size, size, 3), jnp.float32),
        "y": jax.random.randint(ky, (batch,), 0, config["num_classes"]),
    }


def raw_images(config: dict, batch: int, key: jax.Array) -> dict:
    """Images in [0, 255], labels, and the augmentation key `rng`."""
    # Pixel values in [0, 255], as a decoded JPEG would give; plus the key the
    # augmentation draws from, so the train step stays pure.
    kx, ky, kr = jax.random.split(key, 3)
    size = config["image_size"]
    return {
        "x": jax.random.uniform(kx, (batch, size, size, 3), jnp.float32, 0.0, 255.0),
        "y": jax.random.randint(ky, (batch,), 0, config["num_classes"]),
        # A typed key (shape ()): one key for the whole batch, never cut into
        # microbatches the way the per-sample leaves are.
        "rng": jax.random.wrap_key_data(kr) if kr.dtype == jnp.uint32 else kr,
    }


def image_pairs(config: dict, batch: int, key: jax.Array) -> dict:
    """Source images `x` and target images `y`, both in [-1, 1] (tanh range)."""
    kx, ky = jax.random.split(key)
    shape = (batch, config["image_size"], config["image_size"], 3)
    return {
        "x": jax.random.uniform(kx, shape, jnp.float32, -1.0, 1.0),
        "y": jax.random.uniform(ky, shape, jnp.float32, -1.0, 1.0),
    }


def vectors(config: dict, batch: int, key: jax.Array) -> dict:
    """Flat feature vectors `x` and class labels `y`."""
    kx, ky = jax.random.split(key)
    return {
        "x": jax.random.normal(kx, (batch, config["input_dim"]), jnp.float32),
        "y": jax.random.randint(ky, (batch,), 0, config["num_classes"]),
    }


def text_bytes(config: dict, batch: int, key: jax.Array) -> dict:
    """Zero-padded printable-ASCII byte strings `x` (uint8) and labels `y`."""
    kx, kl, ky = jax.random.split(key, 3)
    length = config["text_length"]
    text = jax.random.randint(kx, (batch, length), 32, 127).astype(jnp.uint8)  # printable ASCII
    # Texts of varying length, zero-padded at the end like a real batch.
    lengths = jax.random.randint(kl, (batch, 1), max(1, length // 2), length + 1)
    text = jnp.where(jnp.arange(length)[None] < lengths, text, jnp.uint8(0))
    return {"x": text, "y": jax.random.randint(ky, (batch,), 0, config["num_classes"])}


def tokens(config: dict, batch: int, key: jax.Array) -> dict:
    """Token ids `x` [N, seq_len]; the model learns to predict each next one."""
    return {"x": jax.random.randint(key, (batch, config["seq_len"]), 0, config["vocab_size"])}
