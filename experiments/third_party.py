"""Third-party models under hetpar: what hetpar makes of steps written the libraries' way.

Small random-weight models built from configs the way each library's users
build them (Hugging Face Flax GPT-2, BERT (also with gradient checkpointing),
ViT, ResNet and T5; an Equinox MLP, CNN and GPT; a plain-JAX Llama-style
model; a Haiku ResNet-18; a Flax linen `nn.scan` transformer stack), batch 4,
each with the optimizer and step of a Hugging Face Flax script (Equinox:
`eqx.filter_value_and_grad`, `eqx.apply_updates`, baseline `eqx.filter_jit`);
HF models train with dropout (`dropout_rng` in the state) except at M=2::

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

Columns (issue 14's acceptance table):

- **layers**: `hetpar.trace` at the default granularity (through
  `hetpar.auto(...).lower`);
- **updates in own layer**: parameter leaves whose update (the equation
  producing the step's output leaf) and optimizer-state leaves (input and
  output) all sit in the parameter's own layer;
- **FLOPs**: hetpar's count (sum over layers) against XLA's cost analysis of
  the whole step compiled for the CPU (`hetpar.passes.step_cost`). XLA counts
  a loop body once, hetpar body x trip count (flax_scan: 4 blocks, 2.9);
- **split**: 3 steps under `hetpar.auto(step, plan=...)`, the first half of
  the layers on cpu:0 and the rest on cpu:1, each against `jax.jit` on the
  same inputs (the state hetpar returned): the relative L2 error over all
  float leaves and the loss, largest of the 3 (integer leaves, PRNG keys and
  counters, compared for equality only); the notes name the leaf with the
  largest max |a - b| / max |b|;
- **floor**: the same error for one step of the traced program run equation
  by equation (no fusion) against `jax.jit`: the rounding any change of
  fusion makes, against which the split's error reads;
- **M=2**: the split plan with 2 microbatches (`hetpar.value_and_grad`,
  deterministic forward) against `jax.jit`'s full-batch step, where no layer
  couples the batch (BatchNorm in training mode does);
- **steady**: `hetpar.auto(step, devices="cpu:0")` over `jax.jit` per step,
  interleaved step by step, medians (hetpar / jit);
- **first call**: the split plan's first call (trace, plan, compile included)
  over `jax.jit`'s (jit first, in the same process).

Why step by step rather than two independent 3-step trajectories: in the
attention models the worst leaf is an attention key bias (or its Adam
moments), whose gradient is zero in exact arithmetic (softmax ignores a shift
shared by all keys), so Adam's first steps turn rounding noise into +-lr
updates there. `jax.jit` against the same step run equation by equation (the
floor) differs in those leaves as much as hetpar's split does: any two
compilations of the step drift apart there by O(1) of their size.

Usage (from the repository root; XLA's 4 virtual CPU devices are set here):
  python experiments/third_party.py [--models hf_gpt2,hf_bert] [--quick] [--out PREFIX]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import host_cpu, write_results  # noqa: E402

import hetpar  # noqa: E402
from hetpar.passes import SHARED, step_cost  # noqa: E402

warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")

BATCH, SEQ, VOCAB = 4, 8, 128


def make_tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


@dataclasses.dataclass
class Case:
    """One model's step, as its library's users write it.

    `step(*state, batch) -> (*new_state, loss)`; `args` is `(*state, batch)`.
    `mb_step` is the same step with `hetpar.value_and_grad` and a deterministic
    forward, `mb_ref` its twin with JAX's gradient (the full-batch reference).
    """

    library: str
    step: Callable
    args: tuple
    jit: Callable = jax.jit  # how the library's users compile the step
    param_arg: int = 0
    opt_arg: int = 1
    mb_step: Callable | None = None
    mb_ref: Callable | None = None
    mb_args: tuple | None = None
    mb_skip: str | None = None
    note: str = ""


# -- Hugging Face Flax ------------------------------------------------------


def optax_steps(loss_of, tx=None):
    """`with_(value_and_grad)` -> `step(params, opt_state, batch) -> (params, opt_state,
    loss)` as Flax and plain-JAX scripts write it, for `loss_of(params, batch)`."""
    tx = tx or make_tx()

    def with_(value_and_grad):
        def train_step(params, opt_state, batch):
            loss, grads = value_and_grad(lambda params: loss_of(params, batch))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return train_step
    return with_


def _optax_case(library, loss_of, params, batch, note=""):
    """The step with JAX's gradient; its microbatched twin with hetpar's."""
    with_ = optax_steps(loss_of)
    args = (params, make_tx().init(params), batch)
    return Case(library, with_(jax.value_and_grad), args, mb_step=with_(hetpar.value_and_grad),
                mb_ref=with_(jax.value_and_grad), mb_args=args, note=note)


def _hf_case(model, inputs, loss, batch, note=""):
    """The train step with dropout as run_clm_flax / run_mlm_flax write it, and a
    deterministic twin for microbatching. `inputs`: the batch keys the model
    takes; `loss(logits, batch)`."""
    tx = make_tx()

    def loss_of(params, batch, train, rng):
        rngs = {"dropout_rng": rng} if train else {}
        return loss(model(**{k: batch[k] for k in inputs}, params=params, train=train,
                          **rngs).logits, batch)

    def train_step(params, opt_state, dropout_rng, batch):
        dropout_rng, new_dropout_rng = jax.random.split(dropout_rng)
        loss, grads = jax.value_and_grad(lambda p: loss_of(p, batch, True, dropout_rng))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_dropout_rng, loss

    det = _optax_case("transformers (Flax)", lambda p, b: loss_of(p, b, False, None),
                      model.params, batch, note)
    *state, _ = det.args
    return dataclasses.replace(det, step=train_step,
                               args=(*state, jax.random.PRNGKey(0), batch))


def _next_token_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["input_ids"][:, 1:]).mean()


def _labels_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def _ids(seed=0):
    return jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, VOCAB)


def build_gpt2():
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    return _hf_case(FlaxGPT2LMHeadModel(config, seed=0), ["input_ids"], _next_token_loss,
                    {"input_ids": _ids()})


def _bert(checkpointing: bool):
    from transformers import BertConfig, FlaxBertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=128,
                        max_position_embeddings=32)
    model = FlaxBertForMaskedLM(config, seed=0)
    if checkpointing:
        model.enable_gradient_checkpointing()

    def loss(logits, batch):  # over the batch's tokens, so microbatches average to the batch
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return (ce * (batch["labels"] > 0)).sum() / batch["labels"].size

    ids = _ids()
    labels = jnp.where(jax.random.bernoulli(jax.random.key(3), 0.3, ids.shape), ids, 0)
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids), "labels": labels}
    return _hf_case(model, ["input_ids", "attention_mask"], loss, batch,
                    note="MLM loss normalised by the batch's token count (not by the masked "
                         "count) so microbatches average to the full batch")


def build_bert():
    return _bert(False)


def build_bert_ckpt():
    return _bert(True)


def build_vit():
    from transformers import FlaxViTForImageClassification, ViTConfig

    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                       num_labels=10)
    batch = {"pixel_values": jax.random.normal(jax.random.key(1), (BATCH, 3, 16, 16)),
             "labels": jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)}
    return _hf_case(FlaxViTForImageClassification(config, seed=0), ["pixel_values"],
                    _labels_loss, batch)


def build_resnet():
    from transformers import FlaxResNetForImageClassification, ResNetConfig

    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          layer_type="basic", num_labels=10)
    model = FlaxResNetForImageClassification(config, seed=0)
    tx = make_tx()
    variables = model.params  # {"params", "batch_stats"}
    params, batch_stats = variables["params"], variables["batch_stats"]

    # As the Flax image-classification examples write a BatchNorm step: the batch
    # statistics ride along as auxiliary output of the loss.
    def train_step(params, batch_stats, opt_state, batch):
        def loss_fn(params):
            outputs, new_state = model(batch["pixel_values"],
                                       params={"params": params, "batch_stats": batch_stats},
                                       train=True)
            loss = optax.softmax_cross_entropy_with_integer_labels(
                outputs.logits, batch["labels"]).mean()
            return loss, new_state["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    batch = {"pixel_values": jax.random.normal(jax.random.key(1), (BATCH, 3, 32, 32)),
             "labels": jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)}
    return Case("transformers (Flax)", train_step, (params, batch_stats, tx.init(params), batch),
                opt_arg=2, mb_skip="BatchNorm in training mode couples the batch")


def build_t5():
    from transformers import FlaxT5ForConditionalGeneration, T5Config

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=1,
                      num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)
    ids = _ids()
    batch = {"input_ids": ids, "decoder_input_ids": jnp.roll(ids, 1, axis=1), "labels": ids}
    return _hf_case(FlaxT5ForConditionalGeneration(config, seed=0),
                    ["input_ids", "decoder_input_ids"], _labels_loss, batch)


# -- Equinox ----------------------------------------------------------------


def _eqx_case(model, loss, batch, note=""):
    """The Equinox way: the model is an argument, `eqx.filter_value_and_grad`,
    optimizer on `eqx.filter(model, eqx.is_array)`, `eqx.filter_jit` to compile."""
    import equinox as eqx

    tx = make_tx()

    def train_step(model, opt_state, batch):
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, batch["x"], batch["y"])
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss_value

    def det_step(value_and_grad):
        # Microbatching needs a JAX-style gradient: split the model into arrays and
        # the rest, as Equinox's docs do for `jax.grad`.
        def step(model, opt_state, batch):
            params, static = eqx.partition(model, eqx.is_array)

            def loss_fn(params, x, y):
                return loss(eqx.combine(params, static), x, y)

            loss_value, grads = value_and_grad(loss_fn)(params, batch["x"], batch["y"])
            updates, opt_state = tx.update(grads, opt_state, params)
            return eqx.apply_updates(model, updates), opt_state, loss_value
        return step

    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    args = (model, opt_state, batch)
    note = note or ("baseline `eqx.filter_jit` (jax.jit cannot take the model: its "
                    "activation functions are leaves), which filters the model in Python "
                    "on every call")
    return Case("equinox", train_step, args, jit=eqx.filter_jit,
                mb_step=det_step(hetpar.value_and_grad), mb_ref=det_step(jax.value_and_grad),
                mb_args=args, note=note)


def build_eqx_mlp():
    import equinox as eqx

    model = eqx.nn.MLP(in_size=16, out_size=4, width_size=64, depth=3, key=jax.random.key(0))

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    batch = {"x": jax.random.normal(jax.random.key(1), (BATCH, 16)),
             "y": jax.random.normal(jax.random.key(2), (BATCH, 4))}
    return _eqx_case(model, loss, batch)


def build_eqx_cnn():
    import equinox as eqx

    class CNN(eqx.Module):
        layers: list

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.layers = [
                eqx.nn.Conv2d(1, 8, kernel_size=3, key=k1), jax.nn.relu,
                eqx.nn.MaxPool2d(kernel_size=2),
                eqx.nn.Conv2d(8, 16, kernel_size=3, key=k2), jax.nn.relu,
                jnp.ravel,
                eqx.nn.Linear(16 * 9 * 9, 10, key=k3),
            ]

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = CNN(jax.random.key(0))

    def loss(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    batch = {"x": jax.random.normal(jax.random.key(1), (BATCH, 1, 14, 14)),
             "y": jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)}
    return _eqx_case(model, loss, batch)


def build_eqx_gpt():
    import equinox as eqx

    class Block(eqx.Module):
        norm1: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        norm2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, width, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
            self.attention = eqx.nn.MultiheadAttention(4, width, key=k1)
            self.up = eqx.nn.Linear(width, 4 * width, key=k2)
            self.down = eqx.nn.Linear(4 * width, width, key=k3)

        def __call__(self, x):
            h = jax.vmap(self.norm1)(x)
            causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            x = x + self.attention(h, h, h, mask=causal)
            h = jax.vmap(self.norm2)(x)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))

    class GPT(eqx.Module):
        embedding: eqx.nn.Embedding
        pos: jax.Array
        blocks: list
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key, width=64, layers=4):
            keys = jax.random.split(key, layers + 3)
            self.embedding = eqx.nn.Embedding(VOCAB, width, key=keys[0])
            self.pos = 0.02 * jax.random.normal(keys[1], (SEQ, width))
            self.blocks = [Block(width, k) for k in keys[3:]]
            self.norm = eqx.nn.LayerNorm(width)
            self.head = eqx.nn.Linear(width, VOCAB, key=keys[2])

        def __call__(self, ids):
            x = jax.vmap(self.embedding)(ids) + self.pos
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    def loss(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    ids = _ids()
    return _eqx_case(GPT(jax.random.key(0)), loss, {"x": ids, "y": jnp.roll(ids, -1, 1)},
                     note="4 blocks of (LayerNorm, eqx.nn.MultiheadAttention, LayerNorm, MLP), "
                          "a bare learned `pos`; no field holds a function")


# -- plain JAX --------------------------------------------------------------


def build_jax_llama():
    """A Llama-style model in plain JAX: a params dict, RMSNorm, causal
    `jax.nn.dot_product_attention`, SwiGLU; nothing named."""
    width, heads, blocks = 64, 4, 4
    keys = iter(jax.random.split(jax.random.key(0), 7 * blocks + 2))

    def dense(n, m):
        return jax.random.normal(next(keys), (n, m)) / np.sqrt(n)

    params = {"embed": dense(VOCAB, width),
              "blocks": [{"attn_norm": jnp.ones(width), "wq": dense(width, width),
                          "wk": dense(width, width), "wv": dense(width, width),
                          "wo": dense(width, width), "mlp_norm": jnp.ones(width),
                          "w1": dense(width, 4 * width), "w3": dense(width, 4 * width),
                          "w2": dense(4 * width, width)} for _ in range(blocks)],
              "norm": jnp.ones(width), "head": dense(width, VOCAB)}

    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w

    def block(p, x):
        b, t, d = x.shape
        h = rms(x, p["attn_norm"])
        q, k, v = ((h @ p[w]).reshape(b, t, heads, d // heads) for w in ("wq", "wk", "wv"))
        x = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d) @ p["wo"]
        h = rms(x, p["mlp_norm"])
        return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]

    def loss_of(params, batch):
        x = params["embed"][batch["input_ids"]]
        for p in params["blocks"]:
            x = block(p, x)
        logits = rms(x, params["norm"]) @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["input_ids"][:, 1:]).mean()

    return _optax_case("jax", loss_of, params, {"input_ids": _ids()},
                       note="4 blocks, params dict, jax.nn.dot_product_attention")


# -- Haiku ------------------------------------------------------------------


def build_haiku_resnet18():
    import haiku as hk

    def forward(images, is_training):
        return hk.nets.ResNet18(num_classes=10)(images, is_training)

    model = hk.transform_with_state(forward)
    tx = make_tx()
    images = jax.random.normal(jax.random.key(1), (BATCH, 32, 32, 3))
    labels = jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)
    params, state = model.init(jax.random.key(0), images, is_training=True)

    # As Haiku's ImageNet example writes it: the loss returns the new state as aux.
    def train_step(params, state, opt_state, batch):
        def loss_fn(params):
            logits, state_ = model.apply(params, state, None, batch["images"], is_training=True)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
            return loss, state_

        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss

    return Case("haiku", train_step,
                (params, state, tx.init(params), {"images": images, "labels": labels}),
                opt_arg=2, mb_skip="BatchNorm in training mode couples the batch",
                note="hk.nets.ResNet18 at 32x32 images")


# -- Flax linen nn.scan -----------------------------------------------------


def build_flax_scan():
    import flax.linen as nn

    class Block(nn.Module):
        dim: int
        heads: int

        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            h = nn.SelfAttention(num_heads=self.heads, deterministic=True)(
                h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
            x = x + h
            h = nn.LayerNorm()(x)
            h = nn.Dense(self.dim)(nn.gelu(nn.Dense(4 * self.dim)(h)))
            return x + h, None

    class ScanLM(nn.Module):
        vocab: int = VOCAB
        dim: int = 64
        heads: int = 2
        layers: int = 4

        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(self.vocab, self.dim)(ids)
            x = x + self.param("pos", nn.initializers.normal(0.02), (SEQ, self.dim))
            Stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=self.layers)
            x, _ = Stack(self.dim, self.heads, name="blocks")(x, None)
            return nn.Dense(self.vocab)(nn.LayerNorm()(x))

    model = ScanLM()
    ids = _ids()
    params = model.init(jax.random.key(0), ids)["params"]

    def loss_of(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1], batch["input_ids"][:, 1:]).mean()

    return _optax_case("flax linen", loss_of, params, {"input_ids": ids},
                       note="4 blocks under nn.scan (XLA counts the scan body once)")


MODELS: dict[str, Callable[[], Case]] = {
    "hf_gpt2": build_gpt2,
    "hf_bert": build_bert,
    "hf_bert_ckpt": build_bert_ckpt,
    "hf_vit": build_vit,
    "hf_resnet": build_resnet,
    "hf_t5": build_t5,
    "eqx_mlp": build_eqx_mlp,
    "eqx_cnn": build_eqx_cnn,
    "eqx_gpt": build_eqx_gpt,
    "jax_llama": build_jax_llama,
    "haiku_resnet18": build_haiku_resnet18,
    "flax_scan": build_flax_scan,
}


# -- measurements -----------------------------------------------------------


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _is_int(x) -> bool:
    return hasattr(x, "dtype") and (jnp.issubdtype(x.dtype, jnp.integer)
                                    or jnp.issubdtype(x.dtype, jnp.bool_))


def compare(a, b, names=None) -> dict:
    """How far tree `a` is from the reference `b`, float leaves only.

    `rel_l2`: the runtime tests' measure (tests/test_runtime.py): the L2 norm of
    the difference over all float leaves over the L2 norm of the reference.
    `worst_leaf`, `worst_leaf_err`: the leaf with the largest max |a - b| / max |b|.
    `ints_equal`: integer leaves (counters, raw PRNG keys) are not compared as
    floats, only for equality; typed keys and non-array leaves are skipped.
    `names`: one name per leaf of `b` (default: its key paths).
    """
    la = jax.tree_util.tree_leaves(a)
    lb = jax.tree_util.tree_leaves_with_path(b)
    if len(la) != len(lb):
        raise ValueError(f"trees differ: {len(la)} leaves against {len(lb)}")
    num = den = worst = 0.0
    worst_path, ints_equal, compared = None, True, 0
    for k, (x, (path, y)) in enumerate(zip(la, lb)):
        if _is_float(y):
            x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
            num += float(np.sum((x - y) ** 2))
            den += float(np.sum(y ** 2))
            if y.size:
                scale, diff = float(np.max(np.abs(y))), float(np.max(np.abs(x - y)))
                err = diff / scale if scale > 0 else diff
                if err >= worst:
                    worst, worst_path = err, names[k] if names else jax.tree_util.keystr(path)
            compared += 1
        elif _is_int(y):
            ints_equal &= bool(np.array_equal(np.asarray(x), np.asarray(y)))
    if not compared:
        raise ValueError("no float leaves to compare")
    return {"rel_l2": float(np.sqrt(num / den)) if den else float(np.sqrt(num)),
            "worst_leaf": worst_path, "worst_leaf_err": worst, "ints_equal": ints_equal}


def _to(device, tree):
    """`tree` with its arrays on `device`; other leaves (an Equinox model's functions) kept."""
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, tree)


def _arrays(tree) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, (jax.Array, np.ndarray))]


def compare_steps(fn, ref, args, steps: int = 3) -> dict:
    """`steps` steps of `fn`, each against `ref` on the same inputs (the state `fn`
    returned last, moved to cpu:0), as tests/test_runtime.py checks: two
    independent trajectories drift apart by more than rounding once Adam has
    turned one rounding difference into a +-lr update (see the notes)."""
    cpu0 = jax.devices("cpu")[0]
    *state, batch = args
    worst: dict = {"rel_l2": 0.0, "worst_leaf_err": 0.0, "ints_equal": True}
    per_step, first = [], None
    for _ in range(steps):
        t, out = timed(fn, *state, batch)
        first = t if first is None else first
        expected = ref(*_to(cpu0, (*state, batch)))
        c = compare(out, expected)
        per_step.append(c["rel_l2"])
        worst["rel_l2"] = max(worst["rel_l2"], c["rel_l2"])
        worst["ints_equal"] &= c["ints_equal"]
        if c["worst_leaf_err"] >= worst["worst_leaf_err"]:
            worst["worst_leaf_err"], worst["worst_leaf"] = c["worst_leaf_err"], c["worst_leaf"]
        state = out[:-1]
    worst["rel_l2_per_step"] = per_step
    worst["first_call_s"] = first
    return worst


def floor(g, case: Case, jitted) -> dict:
    """The step's own rounding floor: one step evaluated equation by equation (no
    fusion at all: the traced program's equations one at a time) against `jax.jit`'s,
    from the same inputs. Array leaves only: hetpar traces the step on those."""
    jaxpr = g.program.jaxpr
    flat = _arrays(case.args)
    if len(flat) != len(jaxpr.jaxpr.invars):
        raise ValueError(f"{len(flat)} array leaves, {len(jaxpr.jaxpr.invars)} traced inputs")
    out = jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *flat)
    # The outputs mirror the state inputs, then the loss: name them by the inputs' paths.
    paths = g.program.in_paths
    names = [*paths[:len(out) - 1], "loss"] if len(out) - 1 <= len(paths) else None
    return compare(out, _arrays(jitted(*case.args)), names)


def half_plan(layers: list[str]) -> dict[str, str]:
    half = max(1, len(layers) // 2)
    return {name: "cpu:0" if k < half else "cpu:1" for k, name in enumerate(layers)}


def _arg_of(path: str) -> int:
    """The positional argument a flat input's key path starts in ("[2]['x']" -> 2)."""
    return int(path[1:path.index("]")])


def updates_in_own_layer(g, case: Case) -> dict:
    """Which parameter leaves are updated in their own layer with their optimizer state.

    A parameter leaf is "own" when the equation producing its output leaf runs in
    the parameter's input layer, and every optimizer-state leaf of that parameter
    (the optimizer-state leaves whose key path ends with the parameter's, same
    shape) lives in that layer and is produced there too. The step returns
    `(*new_state, loss)`, so its flat outputs mirror its flat state inputs.
    """
    prog = g.program
    jaxpr = prog.jaxpr.jaxpr
    args_of = [_arg_of(p) for p in prog.in_paths]
    if len(args_of) != len(jaxpr.invars):
        raise ValueError(f"{len(args_of)} input paths but {len(jaxpr.invars)} jaxpr inputs")
    batch_arg = max(args_of)
    n_state = sum(a != batch_arg for a in args_of)
    if len(jaxpr.outvars) != n_state + 1:
        raise ValueError(f"{len(jaxpr.outvars)} outputs do not mirror {n_state} state inputs")
    producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    invar_index = {v: k for k, v in enumerate(jaxpr.invars)}

    def out_layer(k):
        v = jaxpr.outvars[k]
        if v in producer:
            return g.eqn_layers[producer[v]]
        if v in invar_index:
            return g.input_layers[invar_index[v]]
        return None  # a literal

    def rel(k):  # key path inside its argument
        p = prog.in_paths[k]
        return p[p.index("]") + 1:]

    opt = [k for k, a in enumerate(args_of) if a == case.opt_arg]
    own, shared, other = 0, 0, []
    params = [k for k, a in enumerate(args_of) if a == case.param_arg]
    for k in params:
        path, home = rel(k), g.input_layers[k]
        shape = jaxpr.invars[k].aval.shape
        places = {out_layer(k)}
        for j in opt:
            if rel(j).endswith(path) and jaxpr.invars[j].aval.shape == shape:
                places |= {g.input_layers[j], out_layer(j)}
        if places == {home}:
            own += 1
        elif SHARED in places and jaxpr.invars[k].aval.size == 1:
            shared += 1
        else:
            other.append(f"{path} (in {home}; update/state in {sorted(map(str, places))})")
    n = len(params)
    return {"own": own, "tiny_shared": shared, "params": n,
            "fraction": own / n if n else None, "elsewhere": other[:10],
            "elsewhere_count": len(other)}


def timed(fn, *args):
    """(seconds, result) of `fn(*args)`, waited for to the last output."""
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def steady(case: Case, steps: int) -> dict:
    """hetpar on one device against the library's jit, interleaved step by step."""
    a = hetpar.auto(case.step, devices="cpu:0")
    j = case.jit(case.step)
    *sa, batch = case.args
    sj = list(sa)
    ta, tj = [], []
    for i in range(steps + 2):
        t, out = timed(j, *sj, batch)
        *sj, _ = out
        u, out = timed(a, *sa, batch)
        *sa, _ = out
        if i >= 2:  # the first two: compile and warm-up
            tj.append(t)
            ta.append(u)
    mj, ma = statistics.median(tj), statistics.median(ta)
    return {"hetpar_s": ma, "jit_s": mj, "ratio": ma / mj, "steps": steps}


def measure(name: str, quick: bool) -> dict:
    row: dict[str, Any] = {"model": name}
    try:
        t0 = time.perf_counter()
        case = MODELS[name]()
        row["build_s"] = time.perf_counter() - t0
    except ImportError as e:
        row["error"] = f"not installed: {e}"
        return row
    except Exception as e:
        row["error"] = (f"does not run under jax {jax.__version__}: building it raised "
                        f"{type(e).__name__}: {e}")
        return row
    row["library"], row["note"] = case.library, case.note
    row["param_leaves"] = len(jax.tree_util.tree_leaves(case.args[case.param_arg]))
    row["params"] = int(sum(np.size(x) for x in jax.tree_util.tree_leaves(case.args[case.param_arg])
                            if hasattr(x, "shape")))

    def attempt(key, fn):
        try:
            row[key] = fn()
        except Exception as e:
            msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
            row[key] = {"error": msg}
            print(f"  {name} {key}: {msg}", flush=True)
            if os.environ.get("THIRD_PARTY_TRACEBACK"):
                traceback.print_exc()

    # A plain jax.jit run first: does the step run under JAX at all?
    jit_first = {}

    def reference():
        jitted = case.jit(case.step)
        *state, batch = case.args
        t, out = timed(jitted, *state, batch)
        jit_first["s"], jit_first["fn"] = t, jitted
        return {"first_call_s": t, "loss": float(out[-1])}

    attempt("jit", reference)
    if "error" in row["jit"]:
        row["error"] = f"does not run under jax {jax.__version__}: {row['jit']['error']}"
        return row

    graph = {}

    def layers():
        # Through hetpar.auto, which traces with hetpar.trace after handling what
        # only it handles (Flax NNX objects, non-array leaves of the arguments).
        g = hetpar.auto(case.step, devices="cpu:0").lower(*case.args).graph
        graph["g"] = g
        return {"count": len(g), "names": g.layers, "notes": list(g.notes),
                "shared_eqns": len(g.shared_eqns), "eqns": len(g.program.eqns)}

    attempt("layers", layers)
    if "g" in graph:
        g = graph["g"]
        attempt("updates", lambda: updates_in_own_layer(g, case))

        def flops():
            counted = sum(g[n].flops for n in g.layers)
            xla = step_cost(g).flops
            return {"hetpar": counted, "with_shared": g.total_work().flops, "xla": xla,
                    "ratio": counted / xla if xla else None}

        attempt("flops", flops)

        def split():
            if len(g) < 2:
                raise ValueError(f"{len(g)} layer: nothing to split")
            plan = half_plan(g.layers)
            out = compare_steps(hetpar.auto(case.step, plan=plan), jit_first["fn"], case.args)
            return {"plan": plan, **out, "jit_first_call_s": jit_first["s"],
                    "first_call_ratio": out["first_call_s"] / jit_first["s"]}

        attempt("split", split)
        attempt("floor", lambda: floor(g, case, jit_first["fn"]))

    def microbatched():
        if case.mb_skip:
            return {"skipped": case.mb_skip}
        probe = hetpar.auto(case.mb_step, microbatches=2, devices="cpu:0").lower(*case.mb_args)
        plan = half_plan(probe.graph.layers)
        if len(plan) < 2:
            plan = {n: "cpu:0" for n in plan}
        auto = hetpar.auto(case.mb_step, microbatches=2, plan=plan)
        return {"plan": plan, **compare_steps(auto, case.jit(case.mb_ref), case.mb_args)}

    attempt("microbatched", microbatched)
    attempt("steady", lambda: steady(case, 8 if quick else 30))
    return row


#: The table's measured columns: (row key, cell of its dict).
COLUMNS = (
    ("layers", lambda v: str(v["count"])),
    ("updates", lambda v: f"{v['own']}/{v['params']}"),
    ("flops", lambda v: f"{v['hetpar'] / 1e6:.2f}M / {v['xla'] / 1e6:.2f}M = {v['ratio']:.2f}"),
    ("split", lambda v: f"{v['rel_l2']:.1e}"),
    ("floor", lambda v: f"{v['rel_l2']:.1e}"),
    ("microbatched", lambda v: f"n/a ({v['skipped']})" if "skipped" in v
     else f"{v['rel_l2']:.1e}"),
    ("steady", lambda v: f"{v['ratio']:.2f} ({v['hetpar_s'] * 1e3:.1f} / "
                         f"{v['jit_s'] * 1e3:.1f} ms)"),
    ("split", lambda v: f"{v['first_call_ratio']:.2f} ({v['first_call_s']:.1f} / "
                        f"{v['jit_first_call_s']:.1f} s)"),
)


def _cell(row: dict, key: str, fmt: Callable[[dict], str]) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if isinstance(v, dict) and "error" in v:
        return "error (see below)"
    try:
        return fmt(v)
    except Exception:
        return "-"


def markdown(meta: dict, rows: list[dict]) -> str:
    out = [
        "# Third-party models under hetpar (CPU)",
        "",
        f"Host: {meta['cpu']}, {meta['cores']} cores; jax {meta['jax']}, flax {meta['flax']}, "
        f"transformers {meta['transformers']}, equinox {meta['equinox']}, "
        f"dm-haiku {meta['haiku']}; 4 virtual CPU devices "
        "(`--xla_force_host_platform_device_count=4`). Command: "
        f"`{meta['command'].strip()}` ({meta['date']}). Load average (1 min) "
        f"{meta['loadavg_start'][0]:.1f} at the start, {meta['loadavg_end'][0]:.1f} at the "
        "end: other jobs shared the cores, so the time ratios carry a few percent of noise "
        "(more where the load changed between the two sides).",
        "",
        __doc__.split("\n", 2)[2].split("\nUsage")[0],
        "| model | library | params | layers | updates in own layer | FLOPs hetpar / XLA "
        "| split rel. err | floor | M=2 rel. err | steady ratio | first-call ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r and "jit" not in r or (r.get("error") and "does not run" in r["error"]):
            out.append(f"| {r['model']} | {r.get('library', '-')} | - | - | - | - | - | - | - "
                       f"| - | - |")
            continue
        out.append(f"| {r['model']} | {r['library']} | {r['params']:,} | "
                   + " | ".join(_cell(r, key, fmt) for key, fmt in COLUMNS) + " |")
    out += ["", "## Errors and notes", ""]
    for r in rows:
        lines = []
        if r.get("error"):
            lines.append(r["error"])
        for key in ("layers", "updates", "flops", "split", "floor", "microbatched", "steady"):
            v = r.get(key)
            if isinstance(v, dict) and "error" in v:
                lines.append(f"{key}: {v['error']}")
            elif isinstance(v, dict) and v.get("worst_leaf"):
                lines.append(f"{key}: worst leaf {v['worst_leaf']}, max |a-b| / max |b| = "
                             f"{v['worst_leaf_err']:.1e}"
                             + ("" if v.get("ints_equal", True) else "; INTEGER LEAVES DIFFER"))
        up = r.get("updates")
        if isinstance(up, dict) and up.get("elsewhere"):
            more = up["elsewhere_count"] - len(up["elsewhere"])
            lines.append("not in own layer: " + "; ".join(up["elsewhere"])
                         + (f"; and {more} more" if more > 0 else ""))
        if isinstance(up, dict) and up.get("tiny_shared"):
            lines.append(f"{up['tiny_shared']} one-element parameters updated in the shared group")
        if r.get("note"):
            lines.append(r["note"])
        lay = r.get("layers")
        if isinstance(lay, dict) and "names" in lay:
            names = lay["names"]
            shown = ", ".join(names[:24]) + (f", ... ({len(names)} in all)"
                                             if len(names) > 24 else "")
            lines.append(f"layers: {shown}")
            lines += [f"not cut per layer: {n}" for n in lay.get("notes", [])]
        if lines:
            out.append(f"- **{r['model']}**: " + lines[0])
            out += [f"  - {x}" for x in lines[1:]]
    return "\n".join(out) + "\n"


def _version(mod: str) -> str:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return "absent"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--quick", action="store_true", help="fewer timed steps (8 instead of 30)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "third_party_cpu"),
                   help="output prefix (.md and .json are written)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    meta = {"cpu": host_cpu(), "cores": os.cpu_count(), "jax": jax.__version__,
            "flax": _version("flax"), "optax": _version("optax"),
            "transformers": _version("transformers"), "equinox": _version("equinox"),
            "haiku": _version("dm-haiku"), "python": platform.python_version(),
            "command": "python experiments/third_party.py " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"),
            "loadavg_start": os.getloadavg()}
    rows = []
    for name in names:
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            row = measure(name, args.quick)
        except Exception as e:  # anything measure() did not catch: record it, go on
            row = {"model": name, "error": f"{type(e).__name__}: {e}"}
        row["total_s"] = time.perf_counter() - t0
        print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
        rows.append(row)
    meta["loadavg_end"] = os.getloadavg()
    write_results(args.out, markdown(meta, rows), {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
