"""Residual networks: ResNet-18/50 (He et al., 2016) and the CycleGAN generator.

ResNet follows torchvision (v1.5: the stride sits on the 3x3 conv of a
bottleneck). Residual blocks are direct children of the root, named like
torchvision's modules (`layer1_0` for `layer1.0`), so depth-1 grouping gives
one layer per block plus the stem and the classifier.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def _batch_norm(name: str) -> nn.BatchNorm:
    # Training mode; momentum 0.9 and eps 1e-5 match PyTorch's BatchNorm defaults.
    return nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5, name=name)


def _conv(features: int, kernel: int, strides: int, name: str) -> nn.Conv:
    pad = kernel // 2
    return nn.Conv(
        features,
        (kernel, kernel),
        strides=(strides, strides),
        padding=((pad, pad), (pad, pad)),
        use_bias=False,
        name=name,
    )


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a shortcut (ResNet-18/34)."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = nn.relu(_batch_norm("bn1")(_conv(self.features, 3, self.strides, "conv1")(x)))
        y = _batch_norm("bn2")(_conv(self.features, 3, 1, "conv2")(y))
        if residual.shape != y.shape:
            residual = _conv(self.features, 1, self.strides, "downsample_conv")(x)
            residual = _batch_norm("downsample_bn")(residual)
        return nn.relu(y + residual)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a shortcut (ResNet-50+)."""

    features: int
    strides: int = 1
    expansion: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = nn.relu(_batch_norm("bn1")(_conv(self.features, 1, 1, "conv1")(x)))
        y = nn.relu(_batch_norm("bn2")(_conv(self.features, 3, self.strides, "conv2")(y)))
        y = _batch_norm("bn3")(_conv(self.features * self.expansion, 1, 1, "conv3")(y))
        if residual.shape != y.shape:
            residual = _conv(self.features * self.expansion, 1, self.strides, "downsample_conv")(x)
            residual = _batch_norm("downsample_bn")(residual)
        return nn.relu(y + residual)


class ResNet(nn.Module):
    """ResNet for ImageNet-style inputs; BatchNorm statistics live in `batch_stats`.

    Attributes:
      blocks: Residual blocks per stage, (2, 2, 2, 2) for ResNet-18,
        (3, 4, 6, 3) for ResNet-50.
      bottleneck: Bottleneck blocks (ResNet-50) instead of basic blocks.
      width: Channels of the stem and first stage (64 in the paper).
      num_classes: Classifier outputs.
    """

    blocks: Sequence[int] = (2, 2, 2, 2)
    bottleneck: bool = False
    width: int = 64
    num_classes: int = 1000

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(_batch_norm("bn1")(_conv(self.width, 7, 2, "conv1")(x)))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        block = Bottleneck if self.bottleneck else BasicBlock
        for stage, n in enumerate(self.blocks):
            for i in range(n):
                strides = 2 if stage > 0 and i == 0 else 1
                x = block(self.width * 2**stage, strides, name=f"layer{stage + 1}_{i}")(x)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes, name="fc")(x)


def _reflect_pad(x: jax.Array, pad: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")


def _instance_norm(name: str) -> nn.InstanceNorm:
    # pytorch-CycleGAN-and-pix2pix uses InstanceNorm2d(affine=False): no parameters.
    return nn.InstanceNorm(epsilon=1e-5, use_scale=False, use_bias=False, name=name)


class ResnetBlock(nn.Module):
    """Reflect-pad, 3x3 conv, instance norm, ReLU, twice, with a shortcut."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        y = nn.Conv(features, (3, 3), padding="VALID", name="conv1")(_reflect_pad(x, 1))
        y = nn.relu(_instance_norm("norm1")(y))
        y = nn.Conv(features, (3, 3), padding="VALID", name="conv2")(_reflect_pad(y, 1))
        return x + _instance_norm("norm2")(y)


class CycleGANGenerator(nn.Module):
    """The ResNet-based CycleGAN generator (Zhu et al., 2017; Johnson et al., 2016).

    c7s1-64, d128, d256, `n_blocks` residual blocks, u128, u64, c7s1-3, tanh:
    11,378,179 parameters with 9 blocks and ngf 64. Transposed convs use
    SAME padding, which doubles the size as PyTorch's padding=1,
    output_padding=1 does (the kernel alignment differs by one pixel).
    """

    ngf: int = 64
    n_blocks: int = 9
    out_channels: int = 3

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        ngf = self.ngf
        x = nn.Conv(ngf, (7, 7), padding="VALID", name="conv_in")(_reflect_pad(x, 3))
        x = nn.relu(_instance_norm("norm_in")(x))
        for i, mult in enumerate((2, 4), start=1):
            down = nn.Conv(
                ngf * mult, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), name=f"down{i}"
            )
            x = down(x)
            x = nn.relu(_instance_norm(f"down{i}_norm")(x))
        for i in range(self.n_blocks):
            x = ResnetBlock(name=f"block{i}")(x)
        for i, mult in enumerate((2, 1), start=1):
            up = nn.ConvTranspose(ngf * mult, (3, 3), strides=(2, 2), padding="SAME", name=f"up{i}")
            x = up(x)
            x = nn.relu(_instance_norm(f"up{i}_norm")(x))
        x = nn.Conv(self.out_channels, (7, 7), padding="VALID", name="conv_out")(_reflect_pad(x, 3))
        return jnp.tanh(x)
