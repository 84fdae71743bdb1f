"""`hetpar plan`: graph.json (or a model name) in, plan.json out."""

from __future__ import annotations

import argparse

from hetpar.cli._common import add_link_arg, parse_config, parse_links
from hetpar.core import CostTable, HetparError


def register(subparsers) -> None:
    """Adds the `plan` sub-command."""
    p = subparsers.add_parser(
        "plan", help="place layers on devices with an ILP (graph.json -> plan.json)",
        description="Solve the placement ILP on a cost table and write plan.json. Prints the "
                    "assignment, the predicted objective of the plan and of every baseline, "
                    "and the solver status.")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="a zoo model to trace, cost and plan in one go (needs --devices)")
    p.add_argument("--devices", help="comma-separated device kinds for MODEL, e.g. cpu,h100")
    p.add_argument("--small", action="store_true", help="MODEL's small test config")
    p.add_argument("--batch", type=int, default=None, help="MODEL's batch size")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="MODEL config override (repeatable)")
    p.add_argument("--profiles", default=None,
                   help="MODEL: profile file from `hetpar profile` (default: spec sheets); "
                        "spec-sheet kinds borrow a measured sibling's calibration")
    p.add_argument("--calibrate", action="store_true",
                   help="MODEL: time the whole step (jax.jit) on the present devices listed "
                        "and scale every device's layers to it, spec-sheet kinds by a present "
                        "device of their class (e.g. --devices gpu:0,h100)")
    p.add_argument("--graph",
                   help="graph.json to plan (from `hetpar costs MODEL --devices LIST --out`)")
    p.add_argument("--objective", choices=("time", "cost", "energy"), default="time",
                   help="what the plan minimises: step time, dollars or joules per step "
                        "(default time)")
    p.add_argument("--mode", choices=("sequential", "pipelined"), default="sequential",
                   help="sequential: one batch through the layers in order; pipelined: "
                        "microbatches overlapping across devices (default sequential)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches M (pipelined mode; default 4 there, 1 otherwise; "
                        "M x layers at most 32768: the predicted step replays each)")
    p.add_argument("--contiguous", action="store_true",
                   help="pipelined: each device holds one contiguous run of layers (default: "
                        "the better of with and without, by the replayed schedule)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe",
                   help="pipelined: the schedule the plan will run under (replayed to predict "
                        "the step time)")
    p.add_argument("--max-cost", type=float, default=None, help="dollars per step at most")
    p.add_argument("--max-step-time", type=float, default=None, help="seconds per step at most")
    p.add_argument("--solver", choices=("auto", "cbc", "highs"), default="auto",
                   help="auto: HiGHS when highspy is installed, else CBC")
    p.add_argument("--time-limit", type=float, default=None, help="solver time limit, seconds")
    p.add_argument("--gap", type=float, default=None, help="relative optimality gap (1e-4)")
    p.add_argument("--memory", action="append", default=[], metavar="DEVICE=GB",
                   help="set a device's memory for planning, in GB (1e9 bytes): a device or a "
                        "kind, e.g. --memory gpu:0=40 or --memory h100=10 (repeatable). A device "
                        "present here may only be capped; one planned for (a spec sheet) may "
                        "be given more (--memory cpu=2000 for a 2 TB host)")
    add_link_arg(p)
    p.add_argument("--donate", action="store_true",
                   help="plan for a step that donates its state (hetpar.auto's "
                        "donate_argnums): one copy of the parameters and optimizer state "
                        "where they live, on the host too, instead of the old and the new")
    p.add_argument("--no-offload", dest="offload", action="store_false",
                   help="never keep layers' state apart from their compute device")
    p.add_argument("--explain", action="store_true", help="say why each layer sits where it does")
    p.add_argument("--out", help="where to write plan.json")
    p.set_defaults(func=_run)


def _table(args: argparse.Namespace) -> CostTable:
    if args.model is not None:
        if args.graph is not None:
            raise HetparError("give either MODEL (with --devices) or --graph, not both")
        if not args.devices:
            raise HetparError("planning from a model name needs --devices, e.g. --devices cpu,h100")
        from hetpar import zoo  # loads JAX: only when planning from a model name

        return zoo.cost_table(args.model, [d.strip() for d in args.devices.split(",")],
                              small=args.small, batch=args.batch,
                              config=parse_config(args.model, args.config),
                              profiles=args.profiles, calibrate=args.calibrate)
    if args.graph is None:
        raise HetparError("pass --graph graph.json (or a MODEL with --devices)")
    if (args.config or args.small or args.batch is not None or args.profiles
            or args.calibrate):
        raise HetparError("--profiles, --calibrate, --small, --batch and --config apply to a "
                          "MODEL, not to --graph (its costs are already in graph.json)")
    return CostTable.load(args.graph)


def parse_memory(items: list[str]) -> dict[str, float]:
    """['gpu:0=40', 'cpu:0=100'] -> {'gpu:0': 4e10, 'cpu:0': 1e11} (GB to bytes).

    Raises:
      HetparError: an item that is not DEVICE=GB with a positive number.
    """
    out = {}
    for item in items:
        dev, sep, value = item.partition("=")
        try:
            gb = float(value)
        except ValueError:
            gb = float("nan")
        if "," in item:
            raise HetparError(f"--memory takes one DEVICE=GB; repeat the flag for each device, "
                              f"e.g. --memory gpu:0=40 --memory gpu:1=40; got {item!r}")
        if not sep or not dev.strip() or not (gb > 0 and gb < float("inf")):
            raise HetparError(f"--memory expects DEVICE=GB with a positive number of GB, e.g. "
                              f"gpu:0=40; got {item!r}")
        out[dev.strip()] = gb * 1e9
    return out


def _run(args: argparse.Namespace) -> int:
    from hetpar.planner import plan

    memory = parse_memory(args.memory)  # checked before any model is traced
    links = parse_links(args.link)
    table = _table(args)
    if links:
        from hetpar.cost_models import override_network_links  # no JAX

        table = override_network_links(table, links)
    microbatches = args.microbatches
    if microbatches is None:
        microbatches = 4 if args.mode == "pipelined" else 1
    from hetpar.cli._run import _progress

    # Pipelined planning replays every microbatch: many of them take a while,
    # and the replays say so (hetpar.planner._simulate.REPLAY_PROGRESS_WORK).
    with _progress(args.mode == "pipelined"):
        result = plan(table, objective=args.objective, mode=args.mode,
                      microbatches=microbatches, contiguous=args.contiguous,
                      max_cost=args.max_cost, max_step_time=args.max_step_time,
                      solver=args.solver, time_limit=args.time_limit, gap=args.gap,
                      schedule=args.schedule, memory=memory or None, offload=args.offload,
                      donate=args.donate)
    # The file first: a reader that stops early (`| head`) must not cost the plan.
    if args.out:
        result.save(args.out)
    print(result.summary(table))
    if args.explain:
        print()
        print(result.explain(table))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0
