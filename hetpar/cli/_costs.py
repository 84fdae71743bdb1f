"""`hetpar costs MODEL --devices LIST`: per-layer time, dollars and joules; writes graph.json."""

from __future__ import annotations

import sys

from hetpar.cli._common import add_model_args, parse_config
from hetpar.core import nbytes, seconds


def register(sub) -> None:
    """Adds the `costs` sub-command."""
    p = sub.add_parser(
        "costs",
        help="per-layer time, cost and energy on each device; write graph.json for the planner",
        description=(
            "Time of every layer's stage (forward + backward + update) on each device, "
            "predicted by the calibrated roofline or, with --measure, measured on the "
            "present devices; cost per sample in dollars and energy per sample in joules. "
            "Devices mix present ones (cpu:0, gpu:0) and spec-sheet kinds for what-if "
            "planning (h100, tpu-v5e), which become h100:0, tpu-v5e:0 in graph.json."
        ),
    )
    add_model_args(p)
    p.add_argument("--devices", required=True,
                   help="comma-separated devices, e.g. cpu:0,gpu:0,h100")
    p.add_argument("--measure", action="store_true",
                   help="measure every layer on the present devices (cached on disk)")
    p.add_argument("--k", type=int, default=None,
                   help="timed runs per measurement (default: 40 per layer, at most, whose "
                        "lower quartile is its time; 10 per whole step)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="with --measure: also measure at batch/M and fit each layer's fixed_s "
                        "(what every microbatch of a pipeline pays whole)")
    p.add_argument("--calibrate", action="store_true",
                   help="time the whole step (jax.jit) on the present devices listed and scale "
                        "every device's layers to it; spec-sheet devices (h100) follow the "
                        "present device of their class")
    p.add_argument("--measure-all", action="store_true",
                   help="with --measure/--calibrate: also time the layers and steps of a device "
                        "predicted over 10x slower than the fastest present one (left predicted "
                        "by default: the host CPU beside a GPU on a large model)")
    p.add_argument("--profiles", default=None,
                   help="profile file from `hetpar profile` (default: spec sheets)")
    p.add_argument("--out", default=None, help="write graph.json here")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from hetpar import cost_models, zoo
    from hetpar.cost_models import per_sample

    devices = [d.strip() for d in args.devices.split(",") if d.strip()]

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    table = zoo.cost_table(
        args.model, devices, small=args.small, batch=args.batch,
        config=parse_config(args.model, args.config), measure=args.measure,
        profiles=args.profiles, k=args.k,
        progress=progress if args.measure or args.calibrate else None,
        microbatches=args.microbatches, calibrate=args.calibrate,
        budget=None if args.measure_all else cost_models.TimingBudget())
    batch = int(table.meta.get("batch") or 1)
    predicted = table.meta["predicted_s"]
    measured = table.meta.get("measured_s", {})
    costs = per_sample(table, batch)
    # Memory places (`gpu:0:pinned_host`) hold state; no layer computes there.
    names = [d.name for d in table.devices if d.kind != "pinned_host"]
    print(f"{args.model} (batch {batch}): seconds per step, then per sample "
          f"$ (price/h) and J (busy watts)")
    for d in table.devices:
        if d.kind == "pinned_host":
            print(f"  {d.name:<12} memory place (pinned host memory) {nbytes(d.memory_bytes)}")
            continue
        print(f"  {d.name:<12} kind {d.kind:<8} ${d.price_per_hour:.3f}/h  "
              f"{d.watts_busy:.0f} W busy  {nbytes(d.memory_bytes)}")
    head = f"{'layer':<28}" + "".join(f"{n:>38}" for n in names)
    print(head)
    total = {n: [0.0, 0.0, 0.0] for n in names}
    for layer in table.layers:
        cells = []
        for n in names:
            pred = predicted[layer.name][n]
            meas = measured.get(layer.name, {}).get(n)
            t = seconds(pred) + (f"/{seconds(meas)}" if meas is not None else "")
            c = costs[layer.name][n]
            cells.append(f"{t:>20} {c['usd']:>8.1e}$ {c['joules']:>6.1e}J")
            total[n][0] += layer.time_s[n]
            total[n][1] += c["usd"]
            total[n][2] += c["joules"]
        print(f"{layer.name[:27]:<28}" + "".join(f"{c:>38}" for c in cells))
    print(f"{'total (step)':<28}" + "".join(
        f"{seconds(t):>20} {u:>8.1e}$ {j:>6.1e}J".rjust(38) for t, u, j in total.values()))
    print("times: predicted" + ("/measured" if measured else "") +
          "; $ and J are per sample, from the time used in graph.json")
    if args.out:
        table.save(args.out)
        print(f"wrote {args.out}")
    return 0
