"""Sharded state: the whole step data parallel over a group, its state split
across the group (ZeRO-1, FSDP), priced beside replicated data parallel.

Each member runs every layer on batch / N, as a data-parallel replica does
(`replica_busy`). What changes is what each holds and what crosses the links:

* "zero1": the optimizer state is split N ways, the parameters replicated.
  The gradients are reduce-scattered (each member gets the sum of its
  shard), each member updates its shard of the state (its update / N), and
  the new parameters are all-gathered: the same bytes on the ring as the
  replicated step's all-reduce, `2 (N - 1) (latency + P / N / bandwidth)`.
  ZeRO-2 (gradients split too) is this under GSPMD: the runtime's one
  jitted program holds the gradients only inside the step.
* "fsdp" (ZeRO-3): the parameters are split too. Each layer's parameters
  are all-gathered before its forward and again before its backward, and
  its gradients reduce-scattered: three ring collectives per layer,
  `3 (N - 1) (latency + P_l / N / bandwidth)`, of which XLA hides
  `FSDP_HIDDEN` behind the layers' compute (measured).

The ring's bandwidth and latency are the group's collectives as the
calibration timed them (`planner.ring_of`, `meta["collectives"]`), else
its slowest copy link's.

A state leaf is split on an axis that N divides (the runtime's rule: its
largest such axis); a leaf no axis of which N divides stays whole on every
member and is all-reduced as in the replicated step. Where the table lacks
the leaves' shapes (`Layer.state_leaves`), every byte counts as divisible.

Memory per member (`replica_memory`, whose terms are the replicated
step's): its share of the split optimizer state (zero1, fsdp) and
parameters (fsdp), old and new unless donated; its shard of each split
gradient (GSPMD reduce-scatters it as the backward makes it), plus the
largest layer's unreduced gradient (zero1) or its gathered parameters and
unreduced gradient (fsdp), 2 P_l (1 - 1/N), alive while it runs; 1/N of the
activations, counted once with the gradients as on one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetpar.core import CostTable, PlanError, ring_allgather_s, ring_allreduce_s
from hetpar.planner._arrays import Arrays, Predicted
from hetpar.planner._evaluate import (
    group_obstacle,
    group_predicted,
    memory_obstacle,
    replica_busy,
    replica_memory,
    ring_of,
)

#: The sharded-state stages a plan may carry (`Plan.sharding`).
SHARDINGS = ("zero1", "fsdp")

#: Share of fsdp's per-layer collectives that XLA hides behind compute: it
#: issues the next layer's all-gather (and the last layer's reduce-scatter)
#: while a layer computes, but NCCL's kernels share the GPU's cores and
#: memory bandwidth with it. Measured on two H200s (a 6.74B Llama-style
#: step, batch 4 x 512, run 28): hand-written FSDP ran 266 ms where its
#: compute alone is ~191 ms and its collectives, at the measured ring, ~151
#: ms: half of them exposed. zero1's collectives are not hidden: its
#: all-gather of the new parameters follows the update, and its 296 ms was
#: its compute plus both collectives (295 ms).
FSDP_HIDDEN = 0.5


def split_bytes(table: CostTable, arr: Arrays, idx: Sequence[int]
                ) -> tuple[np.ndarray, np.ndarray]:
    """([L] parameter bytes, [L] optimizer-state bytes) of each layer that the
    group `idx` can split (the rest stays whole on every member)."""
    n = len(idx)
    params = np.nan_to_num(arr.param).copy()
    opt = np.nan_to_num(arr.opt[:, idx[0]]).copy()
    for i, layer in enumerate(table.layers):
        if layer.state_leaves is None:
            continue
        whole = {"param": 0.0, "opt_state": 0.0}
        for role, shape, b in layer.state_leaves:
            if not any(size > 0 and size % n == 0 for size in shape):
                whole[role] += b
        params[i] = max(params[i] - whole["param"], 0.0)
        opt[i] = max(opt[i] - whole["opt_state"], 0.0)
    return params, opt


def unsplit_layers(table: CostTable, n: int) -> dict[str, int]:
    """{layer: how many of its state leaves no axis lets `n` divide} (those
    stay replicated on every member), for layers with any."""
    out = {}
    for layer in table.layers:
        whole = sum(not any(size > 0 and size % n == 0 for size in shape) and b > 0
                    for _, shape, b in layer.state_leaves or ())
        if whole:
            out[layer.name] = whole
    return out


def sharded_memory(table: CostTable, arr: Arrays, idx: Sequence[int], stage: str) -> np.ndarray:
    """[N] bytes each member holds under `stage` (the module docstring has the terms)."""
    n = len(idx)
    p_split, o_split = split_bytes(table, arr, idx)
    params = np.nan_to_num(arr.param)
    opt = np.nan_to_num(arr.opt[:, idx[0]]) - o_split * (1 - 1 / n)
    # GSPMD reduce-scatters each split gradient as the backward makes it
    # (ZeRO-2): a member keeps its shard, the layer's whole one only while
    # it is made.
    grads = params - p_split * (1 - 1 / n)
    gathered = float((p_split * (1 - 1 / n)).max(initial=0.0))
    if stage == "fsdp":  # the parameters too; the running layer's gathered
        params, gathered = grads, 2 * gathered
    return replica_memory(arr, idx, params=params, opt=opt, grads=grads, gathered=gathered)


def sharded_obstacle(table: CostTable, group: Sequence[str], stage: str, *,
                     arrays: Arrays | None = None) -> str | None:
    """Why the whole step cannot run over `group` with its state sharded by
    `stage`, or None if it can."""
    if stage not in SHARDINGS:
        return f"sharding must be one of {SHARDINGS}, got {stage!r}"
    arr = arrays or Arrays(table)
    reason = group_obstacle(table, group, arrays=arr)
    if reason:
        return reason
    idx = [arr.dindex[d] for d in group]
    held = ("its shard of the optimizer state, the parameters whole" if stage == "zero1"
            else "its shard of parameters and optimizer state, the largest layer gathered")
    return memory_obstacle(arr, idx, sharded_memory(table, arr, idx, stage), held)


def evaluate_sharded(table: CostTable, group: Sequence[str], stage: str, *,
                     arrays: Arrays | None = None) -> Predicted:
    """Predicts the step run over `group` with its state sharded by `stage`
    ("zero1" or "fsdp"; the module docstring has the formulas).

    Raises:
      PlanError: `sharded_obstacle` names a reason.
    """
    arr = arrays or Arrays(table)
    reason = sharded_obstacle(table, group, stage, arrays=arr)
    if reason:
        raise PlanError(reason)
    idx = [arr.dindex[d] for d in group]
    n = len(idx)
    bw, lat = ring_of(arr, idx)
    p_split, o_split = split_bytes(table, arr, idx)
    params = np.nan_to_num(arr.param)
    state = params + np.nan_to_num(arr.opt[:, idx[0]])
    # Each member updates its shard of the split state (parameters whose
    # optimizer state it holds, under zero1 too) and all of the rest.
    split = p_split + o_split
    whole_share = np.divide(state - split + split / n, state, out=np.ones_like(state),
                            where=state > 0)
    busy = replica_busy(arr, idx, whole_share)
    # The leaves that stay whole are all-reduced as in the replicated step.
    whole = float((params - p_split).sum())
    collectives = ring_allreduce_s(whole, n, bw, lat) if whole > 0 else 0.0
    if stage == "zero1":  # reduce-scatter, then all-gather of the new parameters
        collectives += 2 * ring_allgather_s(float(p_split.sum()), n, bw, lat)
    else:  # per layer: gathered for its forward and its backward, gradient scattered
        collectives += (1 - FSDP_HIDDEN) * sum(
            3 * ring_allgather_s(float(p), n, bw, lat) for p in p_split if p > 0)
    return group_predicted(arr, idx, busy, collectives, sharded_memory(table, arr, idx, stage))
