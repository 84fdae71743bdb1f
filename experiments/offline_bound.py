"""An offline plan for a machine you do not have, against the PCIe bound (issue 41).

Issue 41's case: the zoo transformer at d_model 4096, 32 blocks, 32 heads
(6.6B parameters, 79 GB of parameters and Adam state), batch 8, planned
from spec sheets for a host CPU beside one H100 (80 GB), the state donated
so the host holds one copy of it. Before donation was priced, the plan
computed a block on the CPU and predicted 22.1 s a step.

The bound: a plan that keeps some layers' optimizer state (and perhaps
parameters) in the H100's pinned host memory streams it to the GPU and back
every step. The link moves each way at most its duplex bandwidth (PCIe
Gen5 x16 both ways at once: 46.5 GB/s measured on an H100 host), so no
plan that streams those bytes runs a step faster than bytes each way /
bandwidth, nor faster than the GPU's own work. The goal: the plan's
predicted step within 2x of that bound.

    python experiments/offline_bound.py [--batch 8] [--out results/offline_bound.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = {"d_model": 4096, "num_layers": 32, "num_heads": 32}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from hetpar import zoo
    from hetpar.cost_models import spec
    from hetpar.planner import plan

    table = zoo.cost_table("transformer", ["cpu", "h100"], batch=args.batch, config=CONFIG)
    result = {}
    for donate in (False, True):
        planned = plan(table, donate=donate)
        streamed = [n for n, pl in planned.placements.items()
                    if pl.state != pl.compute or pl.params != pl.compute]
        layers = {la.name: la for la in table.layers}
        # Each way: the optimizer state kept apart, and the parameters where
        # they live apart too (in for the forward, back once updated).
        moved = sum((layers[n].param_bytes or 0) * (pl.params != pl.compute)
                    + (layers[n].opt_state_bytes or 0) * (pl.state != pl.compute)
                    for n, pl in planned.placements.items() if n in streamed)
        host_compute = [n for n, pl in planned.placements.items() if pl.compute.startswith("cpu")]
        link = spec("h100").host_link
        bandwidth = link.duplex_bandwidth_bytes_per_s or link.bandwidth_bytes_per_s
        busy = planned.predicted.busy_s.get("h100:0", 0.0)
        bound = max(moved / bandwidth, busy)  # the link's time, or the GPU's, if more
        result["donated" if donate else "not donated"] = {
            "predicted_step_s": planned.predicted.step_time_s,
            "layers_streamed": len(streamed),
            "layers_on_the_cpu": host_compute,
            "state_streamed_each_way_gb": moved / 1e9,
            "link_each_way_gbps": bandwidth / 1e9,
            "gpu_busy_s": busy,
            "pcie_bound_s": bound,
            "predicted_over_bound": planned.predicted.step_time_s / bound,
        }
    params = sum(la.param_bytes or 0 for la in table.layers) / 4
    report = {"model": f"zoo transformer {CONFIG}, batch {args.batch}, {params / 1e9:.2f}B "
                       "parameters", "devices": "cpu + h100 (spec sheets)", **result}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
