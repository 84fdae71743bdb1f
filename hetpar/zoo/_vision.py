"""Plain image classifiers: Conv-6, VGG-16, AlexNet, MobileNet v1, and the MLP.

Layers are direct children of the root module with the names the papers and
torchvision use (`conv1_1`, `fc6`, ...), so grouping equations by module path
at depth 1 gives one layer per paper layer. Pooling and activations are plain
functions and join the layer that produced their input. Dropout is left out
so every train step is a deterministic function of its arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _pool_matrix(size: int, out: int) -> np.ndarray:
    """Averaging weights of torchvision's adaptive pooling along one axis."""
    weights = np.zeros((out, size), np.float32)
    for i in range(out):
        start = (i * size) // out
        end = -((-(i + 1) * size) // out)  # ceil division
        weights[i, start:end] = 1.0 / (end - start)
    return weights


def adaptive_avg_pool(x: jax.Array, out: int) -> jax.Array:
    """torchvision's `AdaptiveAvgPool2d((out, out))` on an NHWC batch.

    Written as two small matmuls with constant weights, so it works for any
    input size (including smaller than `out`, where it repeats pixels).
    """
    h, w = x.shape[1], x.shape[2]
    if h == out and w == out:
        return x
    ph = jnp.asarray(_pool_matrix(h, out), x.dtype)
    pw = jnp.asarray(_pool_matrix(w, out), x.dtype)
    x = jnp.einsum("oh,nhwc->nowc", ph, x)
    return jnp.einsum("pw,nowc->nopc", pw, x)


class AdaptiveAvgPool(nn.Module):
    """Parameter-free module around `adaptive_avg_pool`, named like torchvision's
    `avgpool`, so the pooling is a layer of its own rather than loose equations."""

    size: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return adaptive_avg_pool(x, self.size)


def _max_pool(x: jax.Array) -> jax.Array:
    return nn.max_pool(x, (2, 2), strides=(2, 2))


class Conv6(nn.Module):
    """Conv-6 of Frankle & Carbin (2019), "The Lottery Ticket Hypothesis".

    Six 3x3 convolutions in pairs, 2x2 max pooling after each pair, then dense
    layers. 32x32x3 input, 10 classes: 2,262,602 parameters.
    """

    channels: Sequence[int] = (64, 64, 128, 128, 256, 256)
    dense: Sequence[int] = (256, 256)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, features in enumerate(self.channels):
            x = nn.relu(nn.Conv(features, (3, 3), padding="SAME", name=f"conv{i + 1}")(x))
            if i % 2 == 1:
                x = _max_pool(x)
        x = x.reshape(x.shape[0], -1)
        for i, features in enumerate(self.dense):
            x = nn.relu(nn.Dense(features, name=f"fc{i + 1}")(x))
        return nn.Dense(self.num_classes, name=f"fc{len(self.dense) + 1}")(x)


class VGG16(nn.Module):
    """VGG-16 (configuration D) as in torchvision, without dropout.

    Adaptive average pooling to `pool_size` before the classifier (as
    torchvision does) keeps the parameter count at 138,357,544 for any
    image size with 1000 classes.
    """

    channels: Sequence[int] = (64, 128, 256, 512, 512)
    hidden: int = 4096
    num_classes: int = 1000
    pool_size: int = 7

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        convs_per_stage = (2, 2, 3, 3, 3)
        for stage, (features, n) in enumerate(zip(self.channels, convs_per_stage), start=1):
            for j in range(1, n + 1):
                conv = nn.Conv(features, (3, 3), padding="SAME", name=f"conv{stage}_{j}")
                x = nn.relu(conv(x))
            x = _max_pool(x)
        x = AdaptiveAvgPool(self.pool_size, name="avgpool")(x).reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden, name="fc6")(x))
        x = nn.relu(nn.Dense(self.hidden, name="fc7")(x))
        return nn.Dense(self.num_classes, name="fc8")(x)


class AlexNet(nn.Module):
    """AlexNet as in torchvision (one-GPU variant of Krizhevsky et al., 2012).

    61,100,840 parameters at 1000 classes; adaptive pooling to 6x6 keeps the
    count at any image size. Dropout is left out (deterministic step).
    """

    channels: Sequence[int] = (64, 192, 384, 256, 256)
    hidden: int = 4096
    num_classes: int = 1000
    pool_size: int = 6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c1, c2, c3, c4, c5 = self.channels

        def pool(y):
            return nn.max_pool(y, (3, 3), strides=(2, 2))

        conv1 = nn.Conv(c1, (11, 11), strides=(4, 4), padding=((2, 2), (2, 2)), name="conv1")
        x = nn.relu(conv1(x))
        x = pool(x)
        x = nn.relu(nn.Conv(c2, (5, 5), padding=((2, 2), (2, 2)), name="conv2")(x))
        x = pool(x)
        x = nn.relu(nn.Conv(c3, (3, 3), padding=((1, 1), (1, 1)), name="conv3")(x))
        x = nn.relu(nn.Conv(c4, (3, 3), padding=((1, 1), (1, 1)), name="conv4")(x))
        x = nn.relu(nn.Conv(c5, (3, 3), padding=((1, 1), (1, 1)), name="conv5")(x))
        x = pool(x)
        x = AdaptiveAvgPool(self.pool_size, name="avgpool")(x).reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden, name="fc6")(x))
        x = nn.relu(nn.Dense(self.hidden, name="fc7")(x))
        return nn.Dense(self.num_classes, name="fc8")(x)


def _batch_norm(name: str) -> nn.BatchNorm:
    # Training mode; momentum 0.9 and eps 1e-5 match PyTorch's BatchNorm defaults.
    return nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, name=name)


class DepthwiseSeparable(nn.Module):
    """MobileNet's 3x3 depthwise conv + BN + ReLU, then 1x1 conv + BN + ReLU."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        channels = x.shape[-1]
        x = nn.Conv(
            channels,
            (3, 3),
            strides=(self.strides, self.strides),
            padding="SAME",
            feature_group_count=channels,
            use_bias=False,
            name="depthwise",
        )(x)
        x = nn.relu(_batch_norm("depthwise_bn")(x))
        x = nn.Conv(self.features, (1, 1), use_bias=False, name="pointwise")(x)
        return nn.relu(_batch_norm("pointwise_bn")(x))


class MobileNetV1(nn.Module):
    """MobileNet v1 (Howard et al., 2017): 4,231,976 parameters at alpha 1.0, 1000 classes.

    Attributes:
      alpha: Width multiplier.
      num_classes: Classifier outputs.
      num_blocks: Keep the first this many of the 13 depthwise-separable
        blocks (13 is the paper's network; fewer makes a fast test model).
    """

    alpha: float = 1.0
    num_classes: int = 1000
    num_blocks: int = 13

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def width(c):
            return max(1, int(c * self.alpha))

        conv1 = nn.Conv(
            width(32), (3, 3), strides=(2, 2), padding="SAME", use_bias=False, name="conv1"
        )
        x = conv1(x)
        x = nn.relu(_batch_norm("bn1")(x))
        blocks = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)]
        blocks += [(512, 1)] * 5 + [(1024, 2), (1024, 1)]
        for i, (features, strides) in enumerate(blocks[: self.num_blocks], start=1):
            x = DepthwiseSeparable(width(features), strides, name=f"block{i}")(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, name="fc")(x)


class MLP(nn.Module):
    """A multilayer perceptron on flattened inputs (784-1024-1024-10 by default)."""

    hidden: Sequence[int] = (1024, 1024)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for i, features in enumerate(self.hidden, start=1):
            x = nn.relu(nn.Dense(features, name=f"fc{i}")(x))
        return nn.Dense(self.num_classes, name=f"fc{len(self.hidden) + 1}")(x)
