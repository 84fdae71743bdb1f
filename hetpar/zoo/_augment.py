"""Image augmentation as real JAX ops, and the Keras "flowers" tutorial CNN.

The augmentation modules have no parameters; they are Flax modules only so
that each shows up as its own layer in the name stack (a planner may put it
on the host, or run it ahead for the next step). Their randomness comes from
a key the caller passes in (the batch's `"rng"` entry), so the train step
stays a pure function of its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.scipy import ndimage


def _warp(images: jax.Array, matrices: jax.Array) -> jax.Array:
    """Resample each image with its 2x2 matrix about the image centre.

    Output pixel p reads input pixel `A @ (p - c) + c` (bilinear, reflected at
    the border like Keras' default `fill_mode="reflect"`).

    Args:
      images: `[N, H, W, C]` floats.
      matrices: `[N, 2, 2]`, one inverse transform per image.

    Returns:
      The warped images, same shape and dtype.
    """
    _, h, w, _ = images.shape
    rows, cols = jnp.meshgrid(
        jnp.arange(h, dtype=jnp.float32), jnp.arange(w, dtype=jnp.float32), indexing="ij"
    )
    centre = jnp.array([(h - 1) / 2.0, (w - 1) / 2.0], jnp.float32)
    grid = jnp.stack([rows, cols]) - centre[:, None, None]  # [2, H, W]

    def one_image(image, matrix):
        coords = jnp.einsum("ij,jhw->ihw", matrix, grid) + centre[:, None, None]

        def one_channel(channel):
            return ndimage.map_coordinates(channel, [coords[0], coords[1]], order=1, mode="reflect")

        return jax.vmap(one_channel, in_axes=-1, out_axes=-1)(image)

    return jax.vmap(one_image)(images.astype(jnp.float32), matrices).astype(images.dtype)


class RandomRotation(nn.Module):
    """Keras `RandomRotation(factor)`: rotate each image by a random angle.

    Angles are uniform in `[-factor, factor] * 2 pi`.
    """

    factor: float = 0.1

    @nn.compact
    def __call__(self, images: jax.Array, rng: jax.Array) -> jax.Array:
        bound = self.factor * 2.0 * jnp.pi
        angles = jax.random.uniform(rng, (images.shape[0],), minval=-bound, maxval=bound)
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        # Inverse rotation: where each output pixel reads from.
        matrices = jnp.stack([jnp.stack([cos, sin], -1), jnp.stack([-sin, cos], -1)], -2)
        return _warp(images, matrices)


class RandomZoom(nn.Module):
    """Keras `RandomZoom(factor)`: zoom each image in or out by up to `factor`.

    A zoom z in `[-factor, factor]` samples the input at `(1 + z)` times the
    output coordinates (z < 0 zooms in), one z per image for both axes.
    """

    factor: float = 0.1

    @nn.compact
    def __call__(self, images: jax.Array, rng: jax.Array) -> jax.Array:
        n = images.shape[0]
        zoom = 1.0 + jax.random.uniform(rng, (n,), minval=-self.factor, maxval=self.factor)
        matrices = zoom[:, None, None] * jnp.eye(2, dtype=jnp.float32)
        return _warp(images, matrices)


class Rescaling(nn.Module):
    """Keras `Rescaling(scale, offset)`: `x * scale + offset`."""

    scale: float = 1.0 / 255.0
    offset: float = 0.0

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        return images * self.scale + self.offset


def _augment(model: PreprocessCNN, images: jax.Array, rng: jax.Array) -> jax.Array:
    # A plain function, not a method: Flax wraps every module method in a name
    # scope ("PreprocessCNN.augment"), which would nest the three augmentation
    # layers one level deeper than the convs.
    images = model.random_rotation(images, jax.random.fold_in(rng, 0))
    images = model.random_zoom(images, jax.random.fold_in(rng, 1))
    return model.rescaling(images)


class PreprocessCNN(nn.Module):
    """Augmentation, rescaling and a small CNN (TensorFlow's flowers tutorial).

    RandomRotation, RandomZoom, Rescaling(1/255), then conv16-pool-conv32-pool-
    conv64-pool-dense128-dense5: 3,989,285 parameters at 180x180x3 (the
    tutorial's RandomFlip and Dropout are left out).
    """

    channels: Sequence[int] = (16, 32, 64)
    hidden: int = 128
    num_classes: int = 5
    rotation: float = 0.1
    zoom: float = 0.1

    def setup(self):
        self.random_rotation = RandomRotation(self.rotation)
        self.random_zoom = RandomZoom(self.zoom)
        self.rescaling = Rescaling(1.0 / 255.0)
        for i, features in enumerate(self.channels, start=1):
            setattr(self, f"conv{i}", nn.Conv(features, (3, 3), padding="SAME"))
        self.fc1 = nn.Dense(self.hidden)
        self.fc2 = nn.Dense(self.num_classes)

    def augment(self, images: jax.Array, rng: jax.Array) -> jax.Array:
        """The parameter-free part: rotate, zoom and rescale `[0, 255]` images.

        Use as `model.apply(variables, images, rng, method=PreprocessCNN.augment)`.
        """
        return _augment(self, images, rng)

    def __call__(self, images: jax.Array, rng: jax.Array) -> jax.Array:
        x = _augment(self, images, rng)
        for i in range(1, len(self.channels) + 1):
            conv = getattr(self, f"conv{i}")
            x = nn.max_pool(nn.relu(conv(x)), (2, 2), strides=(2, 2))
        x = nn.relu(self.fc1(x.reshape(x.shape[0], -1)))
        return self.fc2(x)
