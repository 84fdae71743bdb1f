"""The layer sweep: single-kind layers over a grid of sizes, to fit layer models on.

The zoo's models give a layer-time predictor few distinct layers to fit and
leave kinds out (transposed convolutions, 7x7 stems over 3 channels,
gathers). The sweep has dense layers (GEMM + GELU), convolutions (1x1, 3x3,
7x7; stride 1 and 2; few and many channels), depthwise and transposed
convolutions, layer norm, softmax attention, embedding lookups, elementwise
chains, reductions and pooling, each one `hetpar.layer` of a plain-JAX
training step (forward, backward and an SGD update, as a zoo layer holds
them). `hetpar profile --fit default` times them beside the zoo's fit models:
fitted with them, hetpar's per-equation layer model predicted held-out zoo
models' layers at 8.2% / 20.7% (median / p90) on an H100, from 10.7% / 35.1%
without (experiments/results/layer_model).

    step, params, batch = sweep_step(grid())        # accelerator sizes
    step, params, batch = sweep_step(grid(0.25, 0.5))  # a CPU's (CPU_SCALE)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

#: (scale, hw_scale) of the sweep on a CPU: batch-like sizes / 4, image sides
#: / 2, as the zoo's CPU records use its small configs.
CPU_SCALE = (0.25, 0.5)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One synthetic layer: `fn(params, x)` with its parameter and input shapes."""

    name: str
    fn: Callable
    params: dict
    x: tuple
    x_dtype: str = "float32"


def _dense(tokens, din, dout):
    import jax

    def fn(p, x):
        return jax.nn.gelu(x @ p["w"] + p["b"])

    return Spec(f"dense_t{tokens}_{din}x{dout}", fn, {"w": (din, dout), "b": (dout,)},
                (tokens, din))


def _conv(n, hw, cin, cout, k, stride, kind="conv"):
    import jax

    dn = ("NHWC", "HWIO", "NHWC")
    if kind == "depthwise":
        def fn(p, x):
            y = jax.lax.conv_general_dilated(x, p["w"], (stride, stride), "SAME",
                                             dimension_numbers=dn, feature_group_count=cin)
            return jax.nn.relu(y)
        w = (k, k, 1, cin)
    elif kind == "transposed":
        def fn(p, x):
            return jax.nn.relu(jax.lax.conv_transpose(x, p["w"], (stride, stride), "SAME",
                                                      dimension_numbers=dn))
        w = (k, k, cin, cout)
    else:
        def fn(p, x):
            return jax.nn.relu(jax.lax.conv_general_dilated(x, p["w"], (stride, stride),
                                                            "SAME", dimension_numbers=dn))
        w = (k, k, cin, cout)
    return Spec(f"{kind}_n{n}_hw{hw}_{cin}to{cout}_k{k}s{stride}", fn, {"w": w}, (n, hw, hw, cin))


def _layernorm(tokens, d):
    import jax.numpy as jnp

    def fn(p, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]

    return Spec(f"layernorm_t{tokens}_d{d}", fn, {"g": (d,), "b": (d,)}, (tokens, d))


def _attention(b, heads, t, dh):
    import jax

    def fn(p, x):
        q = x * p["s"]
        att = jax.nn.softmax(q @ x.swapaxes(-1, -2) / dh ** 0.5, axis=-1)
        return att @ x

    return Spec(f"attention_b{b}_h{heads}_t{t}_d{dh}", fn, {"s": (dh,)}, (b, heads, t, dh))


def _embedding(tokens, vocab, d):
    def fn(p, x):
        return p["e"][x]

    return Spec(f"embedding_t{tokens}_v{vocab}_d{d}", fn, {"e": (vocab, d)}, (tokens,),
                x_dtype="int32")


def _elementwise(n):
    import jax.numpy as jnp

    def fn(p, x):
        return jnp.tanh(x * p["a"]) * jnp.exp(-x * x) + x

    return Spec(f"elementwise_n{n}", fn, {"a": (1,)}, (n,))


def _reduction(rows, cols):
    def fn(p, x):
        return (x * p["a"]).sum(-1) + (x * x).max(-1)

    return Spec(f"reduction_{rows}x{cols}", fn, {"a": (cols,)}, (rows, cols))


def _pool(n, hw, c):
    import jax

    def fn(p, x):
        y = jax.lax.reduce_window(x * p["a"], -np.inf, jax.lax.max, (1, 3, 3, 1),
                                  (1, 2, 2, 1), "SAME")
        return y

    return Spec(f"maxpool_n{n}_hw{hw}_c{c}", fn, {"a": (c,)}, (n, hw, hw, c))


def _warp(n, hw, c):
    import jax
    import jax.numpy as jnp
    from jax.scipy import ndimage

    # A bilinear resample at computed coordinates (a data-augmentation warp:
    # gathers whose indices come from arithmetic on a parameter).
    def fn(p, x):
        rows, cols = jnp.meshgrid(jnp.arange(hw, dtype=jnp.float32),
                                  jnp.arange(hw, dtype=jnp.float32), indexing="ij")
        coords = [rows * 0.9 + p["a"][0], cols * 1.1 - p["a"][0]]

        def channel(ch):
            return ndimage.map_coordinates(ch, coords, order=1, mode="reflect")

        return jax.vmap(jax.vmap(channel, in_axes=-1, out_axes=-1))(x)

    return Spec(f"warp_n{n}_hw{hw}_c{c}", fn, {"a": (1,)}, (n, hw, hw, c))


def grid(scale: float = 1.0, hw_scale: float = 1.0) -> list[Spec]:
    """The sweep's layers; `scale` multiplies batch-like sizes (tokens, images),
    `hw_scale` image sides."""

    def s(v, least=1):
        return max(least, int(round(v * scale)))

    def h(v):
        return max(4, int(round(v * hw_scale)))

    specs = []
    for tokens, (din, dout) in itertools.product(
            (256, 2048, 16384), ((256, 256), (768, 768), (768, 3072), (3072, 768), (1024, 4096))):
        specs.append(_dense(s(tokens, 8), din, dout))
    for n, hw, (cin, cout), k, stride in [
            (32, 56, (64, 64), 3, 1), (32, 56, (64, 64), 1, 1), (32, 28, (128, 128), 3, 1),
            (32, 14, (256, 256), 3, 1), (32, 7, (512, 512), 3, 1), (32, 56, (64, 128), 3, 2),
            (32, 28, (128, 256), 1, 2), (32, 224, (3, 64), 7, 2), (32, 224, (3, 32), 3, 2),
            (32, 32, (3, 64), 3, 1), (8, 128, (64, 64), 3, 1), (128, 14, (256, 1024), 1, 1),
            (32, 112, (32, 64), 3, 1), (1, 256, (64, 64), 3, 1)]:
        specs.append(_conv(s(n), h(hw), cin, cout, k, stride))
    for n, hw, c, stride in [(32, 112, 32, 1), (32, 56, 128, 1), (32, 28, 256, 2),
                             (32, 14, 512, 1), (32, 7, 1024, 1)]:
        specs.append(_conv(s(n), h(hw), c, c, 3, stride, kind="depthwise"))
    for n, hw, (cin, cout) in [(4, 64, (256, 128)), (4, 128, (128, 64)), (32, 16, (128, 64)),
                               (1, 64, (128, 64))]:
        specs.append(_conv(s(n), h(hw), cin, cout, 3, 2, kind="transposed"))
    for tokens, d in [(2048, 768), (16384, 768), (65536, 1024)]:
        specs.append(_layernorm(s(tokens, 8), d))
    for b, heads, t, dh in [(8, 12, 256, 64), (8, 12, 1024, 64), (32, 8, 128, 64)]:
        specs.append(_attention(s(b), heads, t, dh))
    for tokens, vocab, d in [(4096, 50257, 768), (65536, 50257, 768), (16384, 1000, 256)]:
        specs.append(_embedding(s(tokens, 8), vocab, d))
    for n in (2 ** 16, 2 ** 20, 2 ** 24):
        specs.append(_elementwise(s(n, 64)))
    for rows, cols in [(4096, 1024), (65536, 1024), (1024, 65536)]:
        specs.append(_reduction(s(rows, 8), cols))
    for n, hw, c in [(32, 112, 64), (32, 56, 256)]:
        specs.append(_pool(s(n), h(hw), c))
    return specs


def small_grid() -> list[Spec]:
    """A CPU's sweep: many small layers at the sizes of the zoo's small configs
    (batch 8-32, sides 4-64, 3-128 channels, 32-2048 tokens), the sizes a
    CPU's fit models run at. The CPU's time there is fixed costs, packing and
    loop overheads, not FLOPs: the accelerators' grid, even scaled down
    (`CPU_SCALE`), fits a layer model that misses these layers."""
    specs = []
    for n, hw, (cin, cout), k, stride in [
            (32, 32, (3, 8), 3, 1), (32, 32, (4, 4), 3, 1), (32, 64, (3, 4), 3, 1),
            (32, 32, (3, 16), 7, 2), (32, 16, (8, 8), 3, 1), (32, 16, (8, 16), 3, 2),
            (32, 16, (16, 16), 1, 1), (8, 32, (16, 16), 3, 1), (32, 8, (16, 32), 3, 1),
            (32, 8, (32, 32), 3, 1), (32, 8, (32, 64), 1, 2), (8, 16, (64, 64), 3, 1),
            (32, 4, (64, 64), 3, 1), (32, 4, (128, 128), 3, 1)]:
        specs.append(_conv(n, hw, cin, cout, k, stride))
    for n, hw, c, stride in [(32, 32, 8, 1), (32, 16, 16, 2), (32, 8, 32, 1), (32, 4, 64, 1)]:
        specs.append(_conv(n, hw, c, c, 3, stride, kind="depthwise"))
    for n, hw, (cin, cout) in [(32, 16, (8, 4)), (32, 8, (16, 8)), (8, 4, (32, 16)),
                               (32, 4, (64, 32))]:
        specs.append(_conv(n, hw, cin, cout, 3, 2, kind="transposed"))
    for n, hw, c in [(32, 32, 4), (32, 16, 16), (32, 8, 64)]:
        specs.append(_pool(n, hw, c))
    for tokens, (din, dout) in itertools.product((32, 256, 2048), ((32, 32), (64, 256),
                                                                   (256, 64))):
        specs.append(_dense(tokens, din, dout))
    specs += [_layernorm(256, 64), _layernorm(2048, 128), _attention(8, 4, 64, 16),
              _attention(32, 2, 32, 16), _embedding(512, 1000, 64),
              _embedding(4096, 5000, 128), _elementwise(2 ** 12), _elementwise(2 ** 16),
              _reduction(256, 256), _reduction(32, 4096), _warp(32, 32, 3), _warp(32, 16, 8)]
    return specs


def sweep_step(specs, abstract: bool = False):
    """(step, params, batch): one plain-JAX training step, one `hetpar.layer` per spec.

    `abstract`: params and batch as `jax.ShapeDtypeStruct`s, for tracing alone
    (the H100 sweep's random arrays took 15 s of numpy to draw)."""
    import jax

    if abstract:
        params = {sp.name: {k: jax.ShapeDtypeStruct(shape, np.float32)
                            for k, shape in sp.params.items()} for sp in specs}
        batch = {sp.name: jax.ShapeDtypeStruct(sp.x, np.dtype(sp.x_dtype))
                 for sp in specs}
        return _sweep_train_step(specs), params, batch
    rng = np.random.default_rng(0)
    params = {sp.name: {k: (rng.standard_normal(shape) * 0.02).astype(np.float32)
                        for k, shape in sp.params.items()} for sp in specs}
    batch = {}
    for sp in specs:
        if sp.x_dtype == "int32":
            vocab = sp.params["e"][0]
            batch[sp.name] = rng.integers(0, vocab, sp.x).astype(np.int32)
        else:
            batch[sp.name] = rng.standard_normal(sp.x).astype(np.float32)

    return _sweep_train_step(specs), params, batch


def _sweep_train_step(specs):
    """The sweep's training step: each spec's layer under `hetpar.layer`, SGD."""
    import jax
    import jax.numpy as jnp

    import hetpar

    def step(params, batch):
        def loss_fn(params):
            total = 0.0
            for sp in specs:
                with hetpar.layer(sp.name):
                    y = sp.fn(params[sp.name], batch[sp.name])
                    total = total + jnp.mean(y.astype(jnp.float32) ** 2)
            return total

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), loss

    return step


def trace_sweep(cpu: bool = False, kinds: tuple[str, ...] | None = None):
    """The sweep's training step traced (`hetpar.trace`): a CPU's sizes or an
    accelerator's; with `kinds`, only the layers of those kinds (the start
    of their names: "transposed", "conv", "dense", ...)."""
    import hetpar

    specs = grid(*CPU_SCALE) if cpu else grid()
    if kinds is not None:
        specs = [sp for sp in specs if sp.name.startswith(tuple(kinds))]
        if not specs:
            raise ValueError(f"trace_sweep: no sweep layers of kinds {kinds}")
    step, params, batch = sweep_step(specs, abstract=True)
    return hetpar.trace(step, params, batch)
