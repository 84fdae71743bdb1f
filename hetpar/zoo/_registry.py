"""The zoo's catalogue: each model's reference config, small config and data.

`get` resolves a config (defaults, then the small overrides, then the
caller's), validates it once, and builds a `Workload` with a synthetic batch
drawn from a fixed key. `describe` does the same with `jax.eval_shape`, so
it allocates neither parameters nor the batch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import optax

from hetpar.core import HetparError, UnknownModelError
from hetpar.zoo import _augment, _data, _resnet, _text, _transformer, _vision
from hetpar.zoo._workload import (
    Objective,
    Workload,
    l1_loss,
    next_token_cross_entropy,
    run_once,
    softmax_cross_entropy,
)

# Synthetic data comes from this fixed key, so every Workload is reproducible.
_DATA_SEED = 1234


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How to build one zoo model."""

    defaults: dict
    small: dict
    build: Callable[[dict], nn.Module]
    make_batch: Callable[[dict, int, jax.Array], dict]
    optimizer: Callable[[dict], optax.GradientTransformation]
    objective: Objective = softmax_cross_entropy
    inputs: tuple[str, ...] = ("x",)
    min_image_size: int = 1
    max_values: dict = dataclasses.field(default_factory=dict)  # config key -> largest valid value
    lengths: dict = dataclasses.field(default_factory=dict)  # tuple config key -> required length


# --- the catalogue -----------------------------------------------------------


def _sgd(c: dict) -> optax.GradientTransformation:
    return optax.sgd(c["learning_rate"], momentum=0.9)


def _adam(c: dict) -> optax.GradientTransformation:
    return optax.adam(c["learning_rate"])


_SMALL_IMAGES = {"image_size": 32, "num_classes": 10, "batch_size": 2}

_SPECS: dict[str, _Spec] = {
    "conv6": _Spec(
        defaults={
            "image_size": 32,
            "num_classes": 10,
            "channels": (64, 64, 128, 128, 256, 256),
            "dense": (256, 256),
            "learning_rate": 3e-4,
            "batch_size": 60,
        },
        small={
            "image_size": 16,
            "channels": (8, 8, 16, 16, 32, 32),
            "dense": (32, 32),
            "batch_size": 4,
        },
        build=lambda c: _vision.Conv6(c["channels"], c["dense"], c["num_classes"]),
        make_batch=_data.images,
        optimizer=_adam,  # Frankle & Carbin train Conv-6 with Adam, lr 3e-4.
        min_image_size=8,
    ),
    "vgg16": _Spec(
        defaults={
            "image_size": 224,
            "num_classes": 1000,
            "channels": (64, 128, 256, 512, 512),
            "hidden": 4096,
            "learning_rate": 0.01,
            "batch_size": 32,
        },
        small={**_SMALL_IMAGES, "channels": (4, 8, 8, 16, 16), "hidden": 32},
        build=lambda c: _vision.VGG16(c["channels"], c["hidden"], c["num_classes"]),
        make_batch=_data.images,
        optimizer=_sgd,
        lengths={"channels": 5},
        min_image_size=32,
    ),
    "alexnet": _Spec(
        defaults={
            "image_size": 224,
            "num_classes": 1000,
            "channels": (64, 192, 384, 256, 256),
            "hidden": 4096,
            "learning_rate": 0.01,
            "batch_size": 128,
        },
        small={**_SMALL_IMAGES, "image_size": 64, "channels": (8, 16, 16, 16, 16), "hidden": 32},
        build=lambda c: _vision.AlexNet(c["channels"], c["hidden"], c["num_classes"]),
        make_batch=_data.images,
        optimizer=_sgd,
        lengths={"channels": 5},
        min_image_size=63,
    ),
    "resnet18": _Spec(
        defaults={
            "image_size": 224,
            "num_classes": 1000,
            "width": 64,
            "blocks": (2, 2, 2, 2),
            "learning_rate": 0.1,
            "batch_size": 32,
        },
        small={**_SMALL_IMAGES, "width": 4, "blocks": (1, 1, 1, 1)},
        build=lambda c: _resnet.ResNet(c["blocks"], False, c["width"], c["num_classes"]),
        make_batch=_data.images,
        optimizer=_sgd,
        lengths={"blocks": 4},
    ),
    "resnet50": _Spec(
        defaults={
            "image_size": 224,
            "num_classes": 1000,
            "width": 64,
            "blocks": (3, 4, 6, 3),
            "learning_rate": 0.1,
            "batch_size": 32,
        },
        small={**_SMALL_IMAGES, "width": 4, "blocks": (1, 1, 1, 1)},
        build=lambda c: _resnet.ResNet(c["blocks"], True, c["width"], c["num_classes"]),
        make_batch=_data.images,
        optimizer=_sgd,
        lengths={"blocks": 4},
    ),
    "mobilenet_v1": _Spec(
        defaults={
            "image_size": 224,
            "num_classes": 1000,
            "alpha": 1.0,
            "num_blocks": 13,
            "learning_rate": 0.045,
            "batch_size": 32,
        },
        small={**_SMALL_IMAGES, "alpha": 0.125, "num_blocks": 5},
        build=lambda c: _vision.MobileNetV1(c["alpha"], c["num_classes"], c["num_blocks"]),
        max_values={"num_blocks": 13},
        make_batch=_data.images,
        # The paper trains with RMSprop; these are TF-Slim's MobileNet settings.
        optimizer=lambda c: optax.rmsprop(c["learning_rate"], decay=0.9, eps=1.0, momentum=0.9),
    ),
    "cyclegan_generator": _Spec(
        defaults={
            "image_size": 256,
            "ngf": 64,
            "n_blocks": 9,
            "learning_rate": 2e-4,
            "batch_size": 1,
        },
        small={"image_size": 16, "ngf": 4, "n_blocks": 2, "batch_size": 2},
        build=lambda c: _resnet.CycleGANGenerator(c["ngf"], c["n_blocks"]),
        make_batch=_data.image_pairs,
        # CycleGAN: Adam, lr 2e-4, beta1 0.5, batch size 1.
        optimizer=lambda c: optax.adam(c["learning_rate"], b1=0.5),
        objective=l1_loss,
        min_image_size=8,
    ),
    "cnn_preprocess": _Spec(
        defaults={
            "image_size": 180,
            "num_classes": 5,
            "channels": (16, 32, 64),
            "hidden": 128,
            "rotation": 0.1,
            "zoom": 0.1,
            "learning_rate": 1e-3,
            "batch_size": 32,
        },
        small={"image_size": 32, "channels": (4, 8, 8), "hidden": 16, "batch_size": 2},
        build=lambda c: _augment.PreprocessCNN(
            c["channels"], c["hidden"], c["num_classes"], c["rotation"], c["zoom"]
        ),
        make_batch=_data.raw_images,
        optimizer=_adam,
        inputs=("x", "rng"),
        min_image_size=8,
    ),
    "lm_embed": _Spec(
        defaults={
            "vocab_size": 10000,
            "text_length": 256,
            "ngrams": 2,
            "embed_dim": 64,
            "hidden": (64,),
            "num_classes": 2,
            "learning_rate": 1e-3,
            "batch_size": 32,
        },
        small={
            "vocab_size": 128,
            "text_length": 32,
            "embed_dim": 8,
            "hidden": (8,),
            "batch_size": 4,
        },
        build=lambda c: _text.TextClassifier(
            c["vocab_size"], c["ngrams"], c["embed_dim"], c["hidden"], c["num_classes"]
        ),
        make_batch=_data.text_bytes,
        optimizer=_adam,
    ),
    "rnn": _Spec(
        defaults={
            "vocab_size": 10000,
            "seq_len": 64,
            "embed_dim": 512,
            "hidden": 512,
            "num_layers": 2,
            "learning_rate": 1e-3,
            "batch_size": 32,
        },
        small={"vocab_size": 64, "seq_len": 8, "embed_dim": 16, "hidden": 16, "batch_size": 2},
        build=lambda c: _text.LSTMLanguageModel(
            c["vocab_size"], c["embed_dim"], c["hidden"], c["num_layers"]
        ),
        make_batch=_data.tokens,
        optimizer=_adam,
        objective=next_token_cross_entropy,
    ),
    "mlp": _Spec(
        defaults={
            "input_dim": 784,
            "hidden": (1024, 1024),
            "num_classes": 10,
            "learning_rate": 1e-3,
            "batch_size": 128,
        },
        small={"input_dim": 64, "hidden": (32, 32), "batch_size": 4},
        build=lambda c: _vision.MLP(c["hidden"], c["num_classes"]),
        make_batch=_data.vectors,
        optimizer=_adam,
    ),
    "transformer": _Spec(
        defaults={
            "vocab_size": 50257,
            "seq_len": 128,
            "max_positions": 1024,
            "d_model": 768,
            "num_heads": 12,
            "num_layers": 12,
            "mlp_ratio": 4,
            "tie_embeddings": True,
            "learning_rate": 6e-4,
            "batch_size": 8,
        },
        small={
            "vocab_size": 256,
            "seq_len": 16,
            "max_positions": 16,
            "d_model": 64,
            "num_heads": 4,
            "num_layers": 2,
            "batch_size": 2,
        },
        build=lambda c: _transformer.GPT(
            c["vocab_size"],
            c["max_positions"],
            c["d_model"],
            c["num_heads"],
            c["num_layers"],
            c["mlp_ratio"],
            c["tie_embeddings"],
        ),
        make_batch=_data.tokens,
        # GPT-style AdamW (beta2 0.95, weight decay 0.1).
        optimizer=lambda c: optax.adamw(c["learning_rate"], b1=0.9, b2=0.95, weight_decay=0.1),
        objective=next_token_cross_entropy,
    ),
}


# --- config resolution -------------------------------------------------------


def _spec(name: str) -> _Spec:
    if not isinstance(name, str):
        raise TypeError(f"zoo model name must be a str, got {type(name).__name__} ({name!r})")
    if name not in _SPECS:
        close = difflib.get_close_matches(name, _SPECS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownModelError(
            f"Unknown zoo model {name!r}.{hint} Known models: {', '.join(names())}."
        )
    return _SPECS[name]


def _coerce(name: str, key: str, value: Any, default: Any) -> Any:
    """Checks an override against its default's type; returns it normalised."""
    where = f"zoo model {name!r}: config {key!r}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be a bool, got {type(value).__name__} ({value!r})")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where} must be an int, got {type(value).__name__} ({value!r})")
        if value <= 0:
            raise HetparError(f"{where} must be positive, got {value}")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a number, got {type(value).__name__} ({value!r})")
        return float(value)
    if isinstance(default, tuple):
        if not isinstance(value, (tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise TypeError(f"{where} must be a tuple of positive ints, got {value!r}")
        return tuple(value)
    return value


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def parse_config(name: str, overrides: dict[str, str]) -> dict:
    """Config overrides given as text (`--config key=value`), parsed by each key's type.

    Each value is read as its key's default is typed: an int, a number, a
    bool (true/false, yes/no, on/off, 1/0), or a tuple of positive ints
    (`2,2,2,2`, `(2, 2, 2, 2)` or `[2, 2, 2, 2]`), then checked as `get` checks it.

    Raises:
      UnknownModelError: `name`, or a key, is unknown.
      HetparError: a value that does not parse as its key's type, or is out of range;
        the message names the key, the value and the type expected.
    """
    spec = _spec(name)
    config = {}
    for key, text in overrides.items():
        _check_key(name, spec, key)
        default = spec.defaults[key]
        where = f"zoo model {name!r}: config {key!r}"
        try:
            value = _parse(text.strip(), default)
            config[key] = _coerce(name, key, value, default)
        except (TypeError, ValueError) as e:
            if isinstance(e, HetparError):
                raise
            raise HetparError(f"{where} must be {_KINDS[_kind(default)]}, got {text!r}") from None
    return config


def _kind(default: Any) -> type:
    return next(t for t in (bool, int, float, tuple, str) if isinstance(default, t))


_KINDS = {bool: "a bool (true or false)", int: "a positive int", float: "a number",
          tuple: "a tuple of positive ints (e.g. 2,2,2,2)", str: "a string"}


def _parse(text: str, default: Any) -> Any:
    """`text` read as the type of `default`; ValueError when it is not one."""
    kind = _kind(default)
    if not text:
        raise ValueError(text)
    if kind is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(text)
    if kind is int:
        return int(text)
    if kind is float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(text)
        return value
    if kind is tuple:
        inner = text[1:-1] if text[:1] + text[-1:] in ("()", "[]") else text
        parts = [p.strip() for p in inner.split(",")]
        if parts and not parts[-1]:
            parts.pop()  # "64," is (64,)
        return tuple(int(p) for p in parts)
    return text


def _check_key(name: str, spec: _Spec, key: str) -> None:
    if key not in spec.defaults:
        close = difflib.get_close_matches(key, spec.defaults, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownModelError(
            f"Unknown config key {key!r} for zoo model {name!r}.{hint} "
            f"Valid keys: {', '.join(sorted(spec.defaults))}."
        )


def _resolve(name: str, small: bool, batch: int | None, overrides: dict) -> tuple[_Spec, dict]:
    spec = _spec(name)
    config = dict(spec.defaults)
    if small:
        config.update(spec.small)
    for key, value in overrides.items():
        _check_key(name, spec, key)
        config[key] = _coerce(name, key, value, spec.defaults[key])
    if batch is not None:
        config["batch_size"] = _coerce(name, "batch_size", batch, 1)
    for key, length in spec.lengths.items():
        if len(config[key]) != length:
            raise HetparError(
                f"zoo model {name!r}: {key} needs {length} entries, got {config[key]!r}."
            )
    for key, limit in spec.max_values.items():
        if config[key] > limit:
            raise HetparError(f"zoo model {name!r}: {key} is {config[key]}; the most is {limit}.")
    size = config.get("image_size")
    if size is not None and size < spec.min_image_size:
        raise HetparError(
            f"zoo model {name!r}: image_size {size} is too small; "
            f"use at least {spec.min_image_size}."
        )
    if "num_heads" in config and config["d_model"] % config["num_heads"]:
        raise HetparError(
            f"zoo model {name!r}: d_model {config['d_model']} is not divisible by "
            f"num_heads {config['num_heads']}."
        )
    if "max_positions" in config and config["seq_len"] > config["max_positions"]:
        raise HetparError(
            f"zoo model {name!r}: seq_len {config['seq_len']} exceeds max_positions "
            f"{config['max_positions']}; raise max_positions."
        )
    return spec, config


# --- public API --------------------------------------------------------------


def names() -> list[str]:
    """Names of the zoo's models, sorted.

    Returns:
      The names `get` and `describe` accept.
    """
    return sorted(_SPECS)


def get(name: str, *, small: bool = False, batch: int | None = None, **config: Any) -> Workload:
    """Builds a zoo workload: model, optimizer, synthetic batch and train step.

    Args:
      name: One of `names()`, e.g. `"resnet50"`.
      small: Use a tiny config that compiles and runs in about a second on a
        laptop CPU (for tests); overrides still apply on top.
      batch: Batch size of the synthetic batch (else the model's default).
      **config: Overrides of the model's config keys (see `describe(name)`).

    Returns:
      A `Workload`; `jax.jit(w.train_step)(*w.example_args())` runs a step.

    Raises:
      UnknownModelError: `name`, or a config key, is unknown.
      TypeError: A config value has the wrong type.
    """
    spec, config = _resolve(name, small, batch, config)
    # One program, not dozens of eager ops.
    data = run_once(
        lambda key: spec.make_batch(config, config["batch_size"], key),
        jax.random.PRNGKey(_DATA_SEED),
    )
    return Workload(
        name=name,
        config=config,
        model=spec.build(config),
        optimizer=spec.optimizer(config),
        batch=data,
        objective=spec.objective,
        inputs=spec.inputs,
    )


def describe(name: str, small: bool = False, **config: Any) -> dict:
    """Parameter count, config and input shape of a zoo model, allocating nothing big.

    Shapes come from `jax.eval_shape`, so even VGG-16 costs no memory.

    Args:
      name: One of `names()`.
      small: Describe the small config.
      **config: Overrides, as for `get` (`batch_size` included).

    Returns:
      `{"name", "params", "config", "input_shape", "input_dtype"}`.

    Raises:
      UnknownModelError: `name`, or a config key, is unknown.
    """
    spec, config = _resolve(name, small, None, config)
    data = jax.eval_shape(
        lambda key: spec.make_batch(config, config["batch_size"], key), jax.random.PRNGKey(0)
    )
    model = spec.build(config)
    variables = jax.eval_shape(
        lambda key, batch: model.init(key, *[batch[k] for k in spec.inputs]),
        jax.random.PRNGKey(0),
        data,
    )
    params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(variables["params"]))
    return {
        "name": name,
        "params": int(params),
        "config": config,
        "input_shape": tuple(data["x"].shape),
        "input_dtype": str(data["x"].dtype),
    }
