"""The `hetpar` command line: one absl app, one sub-command per module.

Each sub-command lives in `hetpar/cli/_<name>.py` and exposes
`register(subparsers)`, which adds its parser and sets `func` to a callable
taking the parsed args and returning an exit code. Heavy imports (jax) happen
inside those functions so `hetpar --help` stays fast.
"""

from __future__ import annotations

import importlib
import logging as pylogging
import os
import sys

from absl import app, flags, logging
from absl.flags import argparse_flags

from hetpar.cli._common import check_counts
from hetpar.core import HetparError

# Order is the order `hetpar --help` lists them.
_COMMANDS = ("models", "trace", "report", "hlo", "profile", "costs", "plan", "run")


def _parser() -> argparse_flags.ArgumentParser:
    parser = argparse_flags.ArgumentParser(
        prog="hetpar",
        description="Heterogeneous layer scheduling for JAX training steps.",
        epilog="Every command's options: hetpar COMMAND --help. MODEL is a zoo model "
               "(hetpar models); --small takes its test config.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"hetpar.cli._{name}")
        except ModuleNotFoundError as e:
            if e.name != f"hetpar.cli._{name}":
                raise
            continue  # not built yet
        module.register(sub)
    return parser


def _main(args) -> int:
    # JAX logs at INFO that it found no TPU; that is noise on every CPU/GPU machine.
    pylogging.getLogger("jax._src.xla_bridge").setLevel(pylogging.ERROR)
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # progress is printed; --verbosity=0 for logs
    try:
        check_counts(args)
        return int(args.func(args) or 0)
    except HetparError as e:
        logging.debug("hetpar error", exc_info=True)
        print(f"hetpar {args.command}: error: {e.for_cli()}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`hetpar plan ... | head -3`): what the command
        # writes to files is written; stop printing, quietly, as `cat` would.
        # stdout goes to /dev/null so that the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _SIGPIPE_STATUS


# What a shell reports for a command ended by SIGPIPE (128 + 13), as `yes | head` gives.
_SIGPIPE_STATUS = 141


def run(argv: list[str] | None = None) -> None:
    """Entry point of the `hetpar` console script and `python -m hetpar`."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    else:
        # A command started from the shell: huge pages for the host CPU's layers
        # (hetpar._host_memory says why); called with argv, the caller's
        # process stays as it is.
        from hetpar._host_memory import ensure_huge_pages

        ensure_huge_pages(sys.argv[1:])
    app.run(_main, flags_parser=lambda argv: _parser().parse_args(argv[1:]))
