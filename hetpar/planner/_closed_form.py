"""The closed form of a step's cost: an assignment whose every layer keeps its
state with its compute, sequential or pipelined.

Sequential mode (one microbatch): step time = Σ layer times + Σ transfers of
edges that cross devices (DESIGN "Planner"; nothing overlaps).

Pipelined mode (M microbatches): each layer takes t/M per microbatch and each
crossing edge moves bytes/M per microbatch (a transfer still pays its full
latency). Every device and every directed link is one pipeline resource (links
are full duplex: a->b and b->a are separate), except that devices of one
`compute_group` (the virtual CPU devices of one process, which run on the
same cores) are one resource together: their work adds up, never overlaps.
The bottleneck B is the busiest resource's time per microbatch, and the step
time is

    step_time = T1 + (M - 1) * B

where T1 is one microbatch's latency through the whole graph (Σ t/M + Σ
per-microbatch transfers): the first microbatch takes T1, each later one
leaves B after the previous. With S stages of equal time B this is the
textbook GPipe (M + S - 1) * B. GPipe and non-interleaved 1F1B have the same
bubble, so they share this step time; they differ in activation memory in
flight: GPipe keeps all M microbatches' activations (the whole batch's, as in
`memory_bytes`), 1F1B at most min(M, S) of them, where S is the number of
devices used. The memory limit is checked with GPipe's (conservative) figure.
The parameter update is folded into each layer's time (it runs once a step;
we do not model that separately).

Energy counts devices only (busy watts while computing, idle watts for the rest
of the step on every device used); links are free. Cost is step time x the
hourly prices of the devices used / 3600.
"""

from __future__ import annotations

import numpy as np

from hetpar.core import PlanError
from hetpar.planner._arrays import MODES, Arrays, Placed, Predicted


def microbatches_of(mode: str, microbatches: int) -> int:
    """M, the microbatches a step in `mode` runs (1 when sequential).

    Raises:
      PlanError: an unknown mode, or M < 1.
    """
    if mode not in MODES:
        raise PlanError(f"mode must be one of {MODES}, got {mode!r}")
    M = int(microbatches) if mode == "pipelined" else 1
    if M < 1:
        raise PlanError(f"microbatches must be >= 1, got {microbatches}")
    return M


def closed_form(arr: Arrays, placed: Placed, mode: str, M: int) -> Predicted:
    """The Predicted of `placed` by the closed form (see the module docstring).

    Args:
      arr: the cost table's `Arrays`.
      placed: the assignment; no layer's state or parameters apart from its
        compute and no activations recomputed (`Placed.any_apart` False):
        those only the replay prices (`hetpar.planner.simulate`).
      mode: "sequential" or "pipelined".
      M: the microbatches (`microbatches_of`).
    """
    a = placed.compute
    L, D = len(a), len(arr.devices)
    t = arr.t_at(M)[np.arange(L), a]
    busy = np.bincount(a, weights=t, minlength=D)
    memory = np.bincount(a, weights=arr.mem_at(M)[np.arange(L), a], minlength=D)
    np.maximum.at(working := np.zeros(D), a, arr.ws)
    memory = memory + working
    used = np.bincount(a, minlength=D) > 0
    f, b = arr.edge_parts(M)
    ia, ib = a[arr.eu], a[arr.ev]
    ke = np.arange(len(ia))
    fe, be = f[ke, ia, ib], b[ke, ia, ib]
    transfer_mb = float(fe.sum() + be.sum())  # one microbatch
    compute = float(t.sum())
    extra = {}
    if mode == "sequential":
        step = compute + transfer_mb
    else:
        link = np.zeros((D, D))
        np.add.at(link, (ia, ib), fe)
        np.add.at(link, (ib, ia), be)
        np.fill_diagonal(link, 0.0)
        dev_mb = arr.resource_load(busy) / M
        kd, kl = int(np.argmax(dev_mb)), int(np.argmax(link))
        if link.flat[kl] > dev_mb[kd]:
            bottleneck = float(link.flat[kl])
            src, dst = divmod(kl, D)
            where = f"link {arr.devices[src]}->{arr.devices[dst]}"
        else:
            bottleneck = float(dev_mb[kd])
            where = arr.resource_label(kd, used)
        step = compute / M + transfer_mb + (M - 1) * bottleneck
        act = np.bincount(a, weights=arr.act, minlength=D)
        stages = int(used.sum())
        extra = dict(
            bottleneck_s=bottleneck, bottleneck=where,
            activation_bytes_in_flight={
                "gpipe": {arr.devices[j]: float(act[j]) for j in range(D) if used[j]},
                "1f1b": {arr.devices[j]: float(act[j] / M * min(M, stages))
                         for j in range(D) if used[j]}})
    cost = step * arr.hourly_price(used) / 3600.0
    energy = arr.joules(used, busy, step)
    return Predicted(
        step_time_s=float(step), cost_usd_per_step=float(cost), energy_j_per_step=energy,
        busy_s={arr.devices[j]: float(busy[j]) for j in range(D) if used[j]},
        compute_s=compute, transfer_s=transfer_mb * M,
        memory_bytes={arr.devices[j]: float(memory[j]) for j in range(D) if used[j]},
        peak_memory_bytes={arr.devices[j]: float(memory[j]) for j in range(D) if used[j]},
        **extra)
