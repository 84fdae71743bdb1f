"""`hetpar report MODEL`: per-layer FLOPs, bytes and intensity, before and after XLA."""

from hetpar.cli._common import add_model_args, step_and_args, workload


def register(sub) -> None:
    p = sub.add_parser("report", help="HLO cost report of a zoo model's step")
    add_model_args(p)
    p.add_argument("--mode", choices=("train", "forward"), default="train")
    p.add_argument("--format", choices=("table", "json", "csv"), default="table")
    p.add_argument("--backend", default="cpu", help="XLA backend for the 'after' column")
    p.add_argument("--depth", type=int, default=None, help="module-path depth naming layers")
    p.add_argument("--by", choices=("layer", "op"), default="layer")
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
