"""`hetpar trace MODEL --out graph.json`: the layer graph of a zoo model's step."""

import json

from hetpar.cli._common import add_model_args, step_and_args, workload


def register(sub) -> None:
    p = sub.add_parser("trace", help="trace a zoo model's train step into layers; write graph.json")
    add_model_args(p)
    p.add_argument("--depth", type=int, default=None, help="module-path depth naming layers")
    p.add_argument("--out", default=None, help="write the graph.json form here")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hetpar._report import human
    from hetpar.passes import trace

    w = workload(args)
    fn, ex = step_and_args(w)
    graph = trace(fn, *ex, depth=args.depth)
    print(f"{args.model}: {len(graph)} layers, {graph.graph.number_of_edges()} edges, "
          f"{len(graph.program.eqns)} equations")
    for name in graph.layers:
        info = graph[name]
        print(f"  {name:<28} {len(info.eqns):>5} eqns  {human(info.flops):>8}FLOP  "
              f"params {human(info.param_bytes, 'B'):>8}  "
              f"act {human(info.activation_bytes, 'B'):>8}")
    if args.out:
        data = graph.to_json()
        data["meta"].update({"model": args.model, "batch": w.config.get("batch_size")})
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.out}")
    return 0
