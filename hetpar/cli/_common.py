"""Arguments and helpers shared by the sub-commands that take a zoo MODEL."""

from __future__ import annotations

from hetpar.core import HetparError


def add_model_args(parser, *, batch: bool = True) -> None:
    """MODEL, --small, --batch and --config key=value (repeatable)."""
    parser.add_argument("model", metavar="MODEL", help="zoo model name (see `hetpar models`)")
    parser.add_argument("--small", action="store_true", help="the model's small test config")
    if batch:
        parser.add_argument("--batch", type=int, default=None,
                            help="batch size (default: the model's)")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                        help="model config override, e.g. --config image_size=128 (repeatable)")


def parse_config(model: str, items: list[str]) -> dict:
    """['image_size=128', 'blocks=2,2,2,2'] -> {'image_size': 128, 'blocks': (2, 2, 2, 2)}.

    Each value is parsed as MODEL's config types it and checked before any
    use; a bad one is a HetparError naming the key, the value and the type.
    """
    from hetpar.zoo import parse_config as parse  # loads JAX

    text = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise HetparError(f"--config expects KEY=VALUE, got {item!r}")
        text[key.strip()] = value
    return parse(model, text)


LINK_HELP = ("the network link between processes A and B, both ways, for every pair of "
             "their devices (named pA/..., pB/...): GB/s (1e9 bytes), optionally @latency in "
             "microseconds, e.g. --link p0-p1=12.5 or --link p0-p1=12.5@20 (repeatable; "
             "default: measured by `hetpar profile` under jax.distributed, else 12.5 GB/s, "
             "20 us)")


def add_link_arg(parser) -> None:
    """--link pA-pB=GBps[@LATENCY_us] (repeatable)."""
    parser.add_argument("--link", action="append", default=[], metavar="pA-pB=GBps[@US]",
                        help=LINK_HELP)


def parse_links(items: list[str]) -> list:
    """['p0-p1=12.5@20'] -> [NetworkLink(0, 1, 12.5e9, 2e-5)], checked before any work.

    Raises:
      HetparError: an item not of the form pA-pB=GBps[@LATENCY_us] (the
        message gives the form).
    """
    from hetpar.cost_models import parse_network_link  # no JAX

    return [parse_network_link(item) for item in items]


# Flags that count something: a positive int wherever a command takes them.
_COUNTS = ("batch", "steps", "microbatches", "depth", "k")


def check_counts(args) -> None:
    """Every count flag the command was given (--batch, --steps, ...) is a positive int."""
    for name in _COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise HetparError(f"--{name} must be a positive int, got {value}")


def workload(args):
    """The zoo Workload the parsed args ask for."""
    from hetpar import zoo

    return zoo.get(args.model, small=args.small, batch=getattr(args, "batch", None),
                   **parse_config(args.model, args.config))


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
