"""`hetpar report MODEL`: per-layer FLOPs, bytes and intensity, before and after XLA."""

from hetpar.cli._common import add_model_args, step_and_args, workload


def register(sub) -> None:
    p = sub.add_parser(
        "report", help="HLO cost report of a zoo model's step",
        description="FLOPs, bytes accessed and intensity of each layer of a zoo model's step: "
                    "counted by hetpar on the jaxpr (before XLA's passes) and read from XLA's "
                    "cost analysis of each layer compiled alone (after them; --no-xla skips "
                    "it). No plan, nothing run.")
    add_model_args(p)
    p.add_argument("--mode", choices=("train", "forward"), default="train",
                   help="the training step, or the forward pass alone (default train)")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table",
                   help="output format (default table)")
    p.add_argument("--backend", default="cpu",
                   help="XLA backend for the 'after' column (default cpu)")
    p.add_argument("--depth", type=int, default=None,
                   help="module-path depth naming layers (default: hetpar.trace's)")
    p.add_argument("--by", choices=("layer", "op"), default="layer",
                   help="a row per layer, or per primitive (op) over the whole step "
                        "(default layer)")
    p.add_argument("--no-xla", action="store_true", help="skip compiling each layer with XLA")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hetpar._report import dumps, report_graph
    from hetpar.passes import trace

    w = workload(args)
    fn, ex = step_and_args(w, args.mode)
    graph = trace(fn, *ex, depth=args.depth)
    rep = report_graph(graph, backend=args.backend, xla=not args.no_xla, by=args.by,
                       model=args.model, batch=w.config.get("batch_size"), mode=args.mode)
    print(dumps(rep, args.format))
    return 0
