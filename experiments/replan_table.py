"""Plan a committed cost table again, offline: what today's planner makes of a
GPU run's own calibrated table, beside the same planner without a way.

    python experiments/replan_table.py \
        experiments/results/fit_h200x2/run28_table_llama7b_0.56.json \
        --keep cpu:0,gpu:0,gpu:0:pinned_host --memory gpu:0=39.6 --memory cpu:0=118 --donate \
        [--without fetched] [--memory gpu:0:pinned_host=60.5]

Prints the plan's ways (compute, state, update, parameters: how many layers
each), its predicted step and peaks, and the offload search's report. The
tables were measured on the cards their READMEs name; the plan is made here,
on no GPU. `--keep` restricts a table to some of its devices (a two-GPU
table planned for one GPU); `--memory DEVICE=GB` sets a device's (or a
kind's) memory as `hetpar plan --memory` does, past a present device's
figure too (the table's own machine is not this one); `--without WAY`
drops one offload way
("fetched", "streamed", "host") from the search.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time


def restricted(table, keep: set):
    """`table` with only the devices in `keep` (and their links and figures)."""
    return dataclasses.replace(
        table,
        devices=tuple(d for d in table.devices if d.name in keep),
        links=tuple(lk for lk in table.links if lk.src in keep and lk.dst in keep),
        layers=tuple(dataclasses.replace(
            la, time_s={k: v for k, v in la.time_s.items() if k in keep},
            memory_bytes={k: v for k, v in la.memory_bytes.items() if k in keep},
            update_s={k: v for k, v in (la.update_s or {}).items() if k in keep},
            allowed=None if la.allowed is None else tuple(a for a in la.allowed if a in keep))
            for la in table.layers))


def capped(table, memory: dict):
    """`table` with devices' memory set as given (`with_memory`: by name or
    kind), its present capacities forgotten: this is not the machine that
    measured it, so a cap may also raise them."""
    from hetpar.planner._solve import with_memory

    # (and the pinned pool's limit and regions as read there: a place's
    # memory as given stands for its pool's)
    meta = {k: v for k, v in table.meta.items()
            if k not in ("present_capacity", "pinned_pool_bytes", "pinned_pool_regions")}
    return with_memory(dataclasses.replace(table, meta=meta), memory)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table")
    p.add_argument("--keep", help="comma-separated devices to keep")
    p.add_argument("--memory", action="append", default=[], metavar="DEVICE=GB")
    p.add_argument("--donate", action="store_true", help="plan for a step that donates")
    p.add_argument("--without", action="append", default=[],
                   choices=("fetched", "streamed", "host"))
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)

    from hetpar.core import HetparError
    from hetpar.planner import CostTable, _offload, plan

    table = CostTable.load(args.table)
    if args.keep:
        table = restricted(table, set(args.keep.split(",")))
    memory = {}
    for item in args.memory:
        name, _, gb = item.partition("=")
        try:
            memory[name] = float(gb) * 1e9
        except ValueError:
            p.error(f"--memory {item!r}: give DEVICE=GB, e.g. gpu:0=39.6")
    if args.without:  # neither an option of the search nor a variant of its plan
        real, every_way = _offload.options, _offload.variants
        _offload.options = lambda *a, **k: [o for o in real(*a, **k) if o.way not in args.without]
        # ("all pinned" streams from the place: the streamed way)
        way = {"pinned": "streamed"}
        _offload.variants = lambda *a, **k: [
            v for v in every_way(*a, **k)
            if way.get(v[0].removeprefix("all "), v[0].removeprefix("all ")) not in args.without]
    t0 = time.perf_counter()
    try:
        table = capped(table, memory)
        result = plan(table, donate=args.donate)
    except HetparError as e:  # a bad cap, an unknown device, nothing fits
        p.exit(1, f"replan_table.py: {e}\n")
    ways = collections.Counter(
        (pl.compute, pl.state, pl.update, pl.params, pl.activations)
        for pl in result.placements.values())
    out = {
        "table": args.table, "devices": [d.name for d in table.devices],
        "memory_gb": {d.name: d.memory_bytes / 1e9 for d in table.devices},
        "without": args.without, "donate": args.donate,
        "plan_s": time.perf_counter() - t0,
        "step_s": result.predicted.step_time_s,
        "peak_gb": {k: v / 1e9 for k, v in (result.predicted.peak_memory_bytes or {}).items()},
        "ways": [{"layers": n, "compute": c, "state": s, "update": u, "params": w,
                  "activations": a} for (c, s, u, w, a), n in ways.most_common()],
        "offload": (result.solver or {}).get("offload"),
    }
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return
    print(f"{args.table}: {', '.join(out['devices'])}")
    print(f"planned in {out['plan_s']:.1f} s: step {out['step_s'] * 1e3:.1f} ms predicted; "
          "peaks " + ", ".join(f"{k} {v:.1f} GB" for k, v in out["peak_gb"].items()))
    for w in out["ways"]:
        print(f"  {w['layers']:3d} layers: compute {w['compute']}, state {w['state']}, "
              f"update {w['update']}, parameters {w['params']}, activations {w['activations']}")
    if out["offload"]:
        print("  offload search:", {k: out["offload"][k] for k in
                                    ("status", "gap", "candidate", "replayed", "without_offload")
                                    if k in out["offload"]})


if __name__ == "__main__":
    main()
