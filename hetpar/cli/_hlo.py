"""`hetpar hlo MODEL [--optimized] [--layer NAME]`: HLO text of a step or a layer."""

from hetpar.cli._common import add_model_args, step_and_args, workload


def register(sub) -> None:
    p = sub.add_parser(
        "hlo", help="print the HLO of a zoo model's step, or of one layer",
        description="Print the HLO text of a zoo model's step, or of one layer lowered alone "
                    "(--layer), as lowered or (--optimized) after XLA's passes.")
    add_model_args(p)
    p.add_argument("--mode", choices=("train", "forward"), default="train",
                   help="the training step, or the forward pass alone (default train)")
    p.add_argument("--optimized", action="store_true", help="after XLA's optimisation passes")
    p.add_argument("--layer", default=None, help="one layer alone (see `hetpar trace`)")
    p.add_argument("--backend", default="cpu",
                   help="XLA backend to lower and compile for (default cpu)")
    p.add_argument("--depth", type=int, default=None,
                   help="module-path depth naming layers (default: hetpar.trace's)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hetpar.core import HetparError
    from hetpar.passes import hlo_text, trace

    w = workload(args)
    fn, ex = step_and_args(w, args.mode)
    graph = trace(fn, *ex, depth=args.depth)
    if args.layer is not None and args.layer not in graph.layers:
        raise HetparError(f"no layer {args.layer!r} in {args.model}; layers: {graph.layers}")
    print(hlo_text(graph, args.layer, optimized=args.optimized, backend=args.backend))
    return 0
