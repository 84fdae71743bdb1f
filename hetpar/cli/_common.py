"""Arguments and helpers shared by the sub-commands that take a zoo MODEL."""

from __future__ import annotations

import ast

from hetpar.core import HetparError


def add_model_args(parser, *, batch: bool = True) -> None:
    """MODEL, --small, --batch and --config key=value (repeatable)."""
    parser.add_argument("model", metavar="MODEL", help="zoo model name (see `hetpar models`)")
    parser.add_argument("--small", action="store_true", help="the model's small test config")
    if batch:
        parser.add_argument("--batch", type=int, default=None, help="batch size")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="model config override, e.g. --config image_size=128 (repeatable)")


def parse_config(items: list[str]) -> dict:
    """['image_size=128', 'name=x'] -> {'image_size': 128, 'name': 'x'}."""
    config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise HetparError(f"--config expects KEY=VALUE, got {item!r}")
        try:
            config[key.strip()] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            config[key.strip()] = value
    return config


def workload(args):
    """The zoo Workload the parsed args ask for."""
    from hetpar import zoo

    return zoo.get(args.model, small=args.small, batch=getattr(args, "batch", None),
                   **parse_config(args.config))


def step_and_args(w, mode: str = "train", abstract: bool = True):
    """(fn, example args) of a workload: the train step, or the forward loss.

    With `abstract`, arguments are `jax.ShapeDtypeStruct`s: nothing big is
    allocated, which is all tracing and compiling need.
    """
    import jax

    if mode not in ("train", "forward"):
        raise HetparError(f"--mode must be 'train' or 'forward', got {mode!r}")
    args = jax.eval_shape(w.example_args) if abstract else w.example_args()
    if mode == "train":
        return w.train_step, tuple(args)
    variables, _, batch = args
    return w.loss, (variables, batch)
