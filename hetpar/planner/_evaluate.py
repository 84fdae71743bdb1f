"""The planner's cost model: what any assignment of layers to devices costs.

One evaluator serves the ILP (its reported objective is recomputed here), the
baselines and the exhaustive oracle, so they are all compared on the same terms.

An assignment that keeps every layer's state with its compute has a closed
form, sequential or pipelined (`_closed_form`, which has the formulas).

Data parallel (`evaluate_data_parallel`), the other way to use several
accelerators of one kind: each replica runs the whole step on batch / N
(fixed part whole, the rest / N), then the gradients are all-reduced.

State apart from compute (offload): an assignment may give a layer a
`Placement` whose optimizer state (and maybe parameters) lives on a host CPU
device or in a memory place (an accelerator's pinned host memory, a device
of kind "pinned_host" in the table, on which no layer computes), its update
running on the host CPU, or on the compute device with the state streamed
in and back. Such a plan's step is always replayed
(`hetpar.planner.simulate`: weight copies, gradients, streamed state and
host updates on their links and devices), and its memory follows
`held_bytes` (see there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetpar.core import CostTable, PlanError, nbytes, ring_allreduce_s

# The data model lived here before `_arrays`; code and tests import it from here too.
from hetpar.planner._arrays import (  # noqa: F401
    _PREDICTED_FIELDS,
    HOST_STATE_COPIES,
    MODES,
    OBJECTIVES,
    STREAMED_IN_FLIGHT,
    Arrays,
    Placed,
    Predicted,
    held_bytes,
    is_place,
    ram_bytes,
    streamed_in_flight,
)
from hetpar.planner._closed_form import closed_form, microbatches_of
from hetpar.planner._simulate import evaluate_replayed


def placement_obstacles(arr: Arrays, placed: Placed) -> list[str]:
    """Why layers' state or update cannot be where `placed` puts them, in words."""
    out = []
    for i in np.nonzero(placed.apart)[0]:
        n, c, s, w = arr.layers[i], placed.compute[i], placed.state[i], placed.params[i]
        dc = arr.devices[c]
        if np.isnan(arr.opt[i, c]):
            out.append(f"{n}'s state cannot leave {dc}: the table lacks its param_bytes")
        for what, j in (("state", s), ("parameters", w)):
            if j != c and (arr.bw[c, j] <= 0 or arr.bw[j, c] <= 0):
                out.append(f"{n}'s {what} on {arr.devices[j]} needs links {dc} <-> "
                           f"{arr.devices[j]} both ways")
        if placed.host_update[i]:
            ds = arr.devices[s]
            if not np.isfinite(arr.upd[i, s]):
                out.append(f"{n}'s update has no time on {ds} (update_s)")
            if w != s:
                out.append(f"{n}'s update on {ds} needs its parameters there too, not on "
                           f"{arr.devices[w]}")
    return out


def violations(table: CostTable, assignment: Mapping[str, Any], *, contiguous: bool = False,
               arrays: Arrays | None = None, microbatches: int = 1) -> list[str]:
    """Every constraint an assignment breaks, in words (empty if it is feasible).

    `assignment` maps layers to device names or `Placement`s; memory follows
    `held_bytes` (for `microbatches` in flight).
    """
    arr = arrays or Arrays(table)
    placed = arr.placed(assignment)
    a = placed.compute
    out = []
    for i, layer in enumerate(table.layers):
        d = arr.devices[a[i]]
        if not arr.ok[i, a[i]]:
            if d not in layer.time_s:
                out.append(f"{layer.name} has no time on {d}")
            elif layer.pinned is not None and layer.pinned != d:
                out.append(f"{layer.name} is pinned to {layer.pinned}, not {d}")
            else:
                out.append(f"{layer.name} is not allowed on {d}")
    out += placement_obstacles(arr, placed)
    used = held_bytes(arr, placed, microbatches)
    for j, d in enumerate(arr.devices):
        if used[j] > arr.cap[j] * (1 + 1e-9):
            out.append(f"{d} memory exceeded: needs {nbytes(used[j])}, holds {nbytes(arr.cap[j])}")
    ram = ram_bytes(arr, used)
    for j in np.unique(arr.ram[arr.place & (used > 0)]):
        if ram[j] > arr.cap[j] * (1 + 1e-9) and used[j] <= arr.cap[j] * (1 + 1e-9):
            places = " + ".join(arr.devices[k] for k in np.nonzero(
                (arr.ram == j) & arr.place & (used > 0))[0])
            pool = arr.pooled & (arr.ram == j)
            pooled = " + ".join(arr.devices[k] for k in np.nonzero(pool & (used > 0))[0])
            regions = (f" (XLA's pinned pool holding its regions for the "
                       f"{nbytes(float(used[pool].sum()))} in {pooled})" if pooled else "")
            out.append(f"host memory exceeded: {arr.devices[j]} + {places} share it and need "
                       f"{nbytes(ram[j])}{regions}, {arr.devices[j]} holds {nbytes(arr.cap[j])}")
    for k, e in enumerate(table.edges):
        if not arr.pair_ok[k, a[arr.eu[k]], a[arr.ev[k]]]:
            out.append(f"edge {e.src} -> {e.dst} crosses {arr.devices[a[arr.eu[k]]]} -> "
                       f"{arr.devices[a[arr.ev[k]]]}, which have no link"
                       + (" both ways" if e.bytes_backward > 0 else ""))
    if contiguous:
        seq = a[arr.order]
        starts = np.bincount(seq[np.r_[True, seq[1:] != seq[:-1]]], minlength=len(arr.devices))
        for j in np.nonzero(starts > 1)[0]:
            out.append(f"{arr.devices[j]} holds {starts[j]} separate runs of layers "
                       "(contiguous stages asked for)")
    return out


def evaluate(table: CostTable, assignment: Mapping[str, Any], mode: str = "sequential",
             microbatches: int = 1, *, arrays: Arrays | None = None) -> Predicted:
    """Predicts step time, dollars, joules and device busy time of any assignment.

    An assignment that keeps some layer's state apart from its compute (a
    `Placement`) is replayed (`hetpar.planner.simulate`, GPipe order when
    pipelined): its transfers overlap compute, so no closed form prices it.

    Args:
      table: the cost table.
      assignment: {layer name: device name or Placement} for every layer.
      mode: "sequential" or "pipelined" (`hetpar.planner._closed_form` has the formulas).
      microbatches: M, pipelined mode only.
      arrays: a precomputed `Arrays(table)` (saves time in loops).

    Returns:
      The Predicted costs. Memory limits are not checked here (see
      `violations`); an edge across two devices without a link has infinite
      transfer time.
    """
    M = microbatches_of(mode, microbatches)
    arr = arrays or Arrays(table)
    placed = arr.placed(assignment)
    if placed.any_apart:
        return evaluate_replayed(table, assignment, M, "gpipe", arrays=arr)
    return closed_form(arr, placed, mode, M)


def group_obstacle(table: CostTable, group: Sequence[str], *,
                   arrays: Arrays | None = None) -> str | None:
    """Why the whole step cannot run data parallel over `group` at all (its
    memory apart), or None: two or more distinct devices of the table, every
    layer allowed on each, gradient sizes known, a ring of links."""
    arr = arrays or Arrays(table)
    if len(group) < 2 or len(set(group)) != len(group):
        return f"data parallel needs two or more distinct devices, got {list(group)}"
    unknown = [d for d in group if d not in arr.dindex]
    if unknown:
        return f"{unknown} are not devices of the table ({', '.join(arr.devices)})"
    idx = [arr.dindex[d] for d in group]
    for i, layer in enumerate(table.layers):
        bad = [arr.devices[j] for j in idx if not arr.ok[i, j]]
        if bad:
            return (f"layer {layer.name!r} cannot run on {bad} (no time there, pinned "
                    "or not allowed)")
    if np.isnan(arr.param).any():
        return "the cost table lacks param_bytes (gradient sizes); rebuild it with `hetpar costs`"
    for k, j in enumerate(idx):
        nxt = idx[(k + 1) % len(idx)]
        if arr.bw[j, nxt] <= 0:
            return f"no link {arr.devices[j]} -> {arr.devices[nxt]} for the gradient all-reduce"
    return None


def memory_obstacle(arr: Arrays, idx: Sequence[int], need: np.ndarray, what: str) -> str | None:
    """The first device of `idx` whose `need` (bytes, one per device) exceeds
    its memory, in words (`what` says what it holds), or None."""
    for k, j in enumerate(idx):
        if need[k] > arr.cap[j] * (1 + 1e-9):
            return (f"{arr.devices[j]} memory: {what}, {nbytes(need[k])}, and the device "
                    f"holds {nbytes(arr.cap[j])}")
    return None


def data_parallel_obstacle(table: CostTable, replicas: Sequence[str], *,
                           arrays: Arrays | None = None) -> str | None:
    """Why the whole step cannot run data parallel over `replicas`, or None if it can.

    Data parallel: every replica holds all parameters and optimizer state,
    runs every layer on its share of the batch, and the gradients are
    all-reduced around a ring of the replicas.
    """
    arr = arrays or Arrays(table)
    reason = group_obstacle(table, replicas, arrays=arr)
    if reason:
        return reason
    idx = [arr.dindex[d] for d in replicas]
    return memory_obstacle(arr, idx, replica_memory(arr, idx),
                           "a replica holds all parameters and optimizer state")


def replica_memory(arr: Arrays, idx: Sequence[int], *, params: np.ndarray | None = None,
                   opt: np.ndarray | None = None, grads: np.ndarray | None = None,
                   gathered: float = 0.0) -> np.ndarray:
    """[N] bytes each member of a group running the whole step holds.

    Per layer: its parameters and optimizer state (`params`, `opt`: [L]
    bytes a member keeps, whole by default; old and new both unless the
    step donates them, `Arrays.state_copies`), its gradient (`grads`, whole
    by default; sharded state's is reduce-scattered as the backward makes
    it), and its activations for batch / N. As on one device
    (`Arrays.overlap`), the backward frees a layer's activations as it makes
    its gradient, so the two count once, the larger. Then the largest
    working set / N and `gathered`, what a sharded layer holds whole while
    it runs. Measured on two H200s (a 6.74B Llama-style step, batch 4 x
    512, donated): zero1 planned 75.1 GB against 70.3 GB measured, fsdp
    61.5 GB against 58.1 GB (experiments/results/fit_h200x2, runs 28, 30)."""
    n, cols = len(idx), list(idx)
    param = np.nan_to_num(arr.param)
    state = np.nan_to_num(arr.opt[:, cols])
    act = np.nan_to_num(arr.act)
    other = arr.other[:, cols]
    keep_p = param if params is None else params
    keep_o = state if opt is None else np.broadcast_to(opt[:, None], state.shape)
    grad = param if grads is None else grads
    mine = act / n
    per_layer = (arr.state_copies * (keep_p[:, None] + keep_o) + grad[:, None]
                 + (mine - np.minimum(mine, grad))[:, None] + other)
    return per_layer.sum(axis=0) + arr.ws.max(initial=0.0) / n + gathered


def replica_busy(arr: Arrays, idx: Sequence[int], update_share: np.ndarray | float = 1.0
                 ) -> np.ndarray:
    """[N] seconds each member of a data-parallel group computes: every layer
    on batch / N, its fixed part whole, its optimizer update (`update_s`)
    times `update_share` ([L] or one number: 1 where each member updates
    all of its state, its shard's share where the state is sharded), the
    rest / N."""
    n = len(idx)
    fixed, t = arr.fixed[:, idx], arr.t[:, idx]
    update = np.clip(np.nan_to_num(arr.upd[:, idx]), 0.0, t - fixed)
    share = np.broadcast_to(np.asarray(update_share, float), (len(arr.layers),))[:, None]
    return (fixed + update * share + (t - fixed - update) / n).sum(axis=0)


def ring_of(arr: Arrays, idx: Sequence[int]) -> tuple[float, float]:
    """(bandwidth, latency) of a ring over `idx`: as measured over those
    devices (`meta["collectives"]`: the calibration timed their all-gathers
    and reduce-scatters, `hetpar.runtime.ring_figures`; a group measured
    with more members stands for its subsets), else its slowest link's and
    its worst latency."""
    names = {arr.devices[j] for j in idx}
    for group, ring in (arr.table.meta.get("collectives") or {}).items():
        if names <= set(group.split("+")):
            return float(ring["bandwidth_bytes_per_s"]), float(ring["latency_s"])
    ring = [(j, idx[(k + 1) % len(idx)]) for k, j in enumerate(idx)]
    return min(arr.bw[a, b] for a, b in ring), max(arr.lat[a, b] for a, b in ring)


def group_predicted(arr: Arrays, idx: Sequence[int], busy: np.ndarray, collectives_s: float,
                    memory: np.ndarray) -> Predicted:
    """The Predicted of a whole step run over a group: its members' busy time
    (shared cores add up), then the collectives, not overlapped."""
    load = np.zeros(len(arr.devices))
    load[idx] = busy
    step = float(arr.resource_load(load).max()) + collectives_s
    used = np.zeros(len(arr.devices), bool)
    used[idx] = True
    return Predicted(
        step_time_s=step, cost_usd_per_step=step * arr.hourly_price(used) / 3600.0,
        energy_j_per_step=arr.joules(used, load, step),
        busy_s={arr.devices[j]: float(busy[k]) for k, j in enumerate(idx)},
        compute_s=float(busy.sum()), transfer_s=collectives_s,
        memory_bytes={arr.devices[j]: float(memory[k]) for k, j in enumerate(idx)})


def evaluate_data_parallel(table: CostTable, replicas: Sequence[str], *,
                           arrays: Arrays | None = None) -> Predicted:
    """Predicts the step run data parallel over `replicas` (see `data_parallel_obstacle`).

    Each replica runs every layer on batch / N: the layer's fixed part and
    its optimizer update (`update_s`: every replica updates all of its
    parameters) whole, the rest / N. Then a ring all-reduce of the gradients, 2 (N - 1)
    steps each sending gradient bytes / N over the ring's slowest link, not
    overlapped with compute (XLA may overlap some: a conservative estimate).
    Replicas of one compute group share its cores: their work adds up.

    Raises:
      PlanError: `data_parallel_obstacle` names a reason.
    """
    arr = arrays or Arrays(table)
    reason = data_parallel_obstacle(table, replicas, arrays=arr)
    if reason:
        raise PlanError(reason)
    idx = [arr.dindex[d] for d in replicas]
    bw, lat = ring_of(arr, idx)
    allreduce = ring_allreduce_s(float(arr.param.sum()), len(idx), bw, lat)
    return group_predicted(arr, idx, replica_busy(arr, idx), allreduce,
                           replica_memory(arr, idx))
