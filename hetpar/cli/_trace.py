"""`hetpar trace MODEL --out layers.json`: the layer graph of a zoo model's step.

The file is the layers form (`"format": "hetpar.layers"`): layers, their
work and memory, and the tensors between them, with no devices. The
planner's input (graph.json) comes from `hetpar costs MODEL --devices LIST
--out graph.json`, which adds per-device times, the devices and the links.
"""

from hetpar.cli._common import add_model_args, step_and_args, workload
from hetpar.core import human, save_json


def register(sub) -> None:
    p = sub.add_parser(
        "trace", help="trace a zoo model's train step into layers; write layers.json",
        description="Trace a zoo model's train step and group it into layers: equations, "
                    "FLOPs, parameter and activation bytes per layer. --out writes them "
                    "(format hetpar.layers); for the planner's graph.json, run `hetpar costs "
                    "MODEL --devices LIST --out graph.json`.")
    add_model_args(p)
    p.add_argument("--depth", type=int, default=None, help="module-path depth naming layers")
    p.add_argument("--out", default=None,
                   help="write the layers here (layers.json, format hetpar.layers; not the "
                        "planner's graph.json)")
    p.set_defaults(func=_run)


def _run(args) -> int:
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
        save_json(args.out, data)
        print(f"wrote {args.out}")
    return 0
