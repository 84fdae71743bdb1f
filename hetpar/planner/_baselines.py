"""Baseline placements, evaluated with the same evaluator as the ILP.

- `single_device`: every layer on one device (one baseline per device; none
  for a memory place, which computes nothing).
- `greedy_fastest`: each layer on its fastest device, ignoring transfers (the
  "recommend a device per layer" approach). It respects memory by falling back
  to the next fastest device that still has room, in layer order.
- `memory_fill`: what Accelerate's `device_map="auto"` does: rank devices by
  total layer time (fastest first), walk the layers in topological order and
  fill the current device until the next layer does not fit, then move on to
  the next device for good. A layer that may not use the current device goes
  to the first device in rank order that allows it and has room, without
  moving the fill pointer.
- `heft`: HEFT (Topcuoglu et al., 2002): layers in decreasing upward rank
  (mean time + mean transfer + the largest rank of a successor), each placed
  on the device giving the earliest finish time (no insertion), skipping
  devices without room or without a link to a predecessor's device; devices
  of one compute group are busy together.
- `exhaustive`: every assignment (the oracle; small graphs only).

Each returns a `BaselineResult`: an assignment and its Predicted costs, or the
reason it is infeasible.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetpar.core import CostTable, PlanError
from hetpar.planner._arrays import Arrays, Predicted
from hetpar.planner._evaluate import evaluate, violations

# The oracle's limit: about 12 layers x 3 devices.
MAX_EXHAUSTIVE_ASSIGNMENTS = 3**12


@dataclasses.dataclass(frozen=True)
class BaselineResult:
    """A baseline's outcome: predicted costs, or why it has none."""

    name: str
    # Not part of plan.json (plans stay small), so not part of equality either.
    # Device names, or Placements where state lives apart (zero_offload).
    assignment: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
    predicted: Predicted | None = None
    reason: str | None = None

    @property
    def feasible(self) -> bool:
        return self.predicted is not None

    def to_json(self) -> dict:
        if self.predicted is None:
            return {"status": "infeasible", "reason": self.reason}
        return {"status": "ok", "predicted": self.predicted.to_json()}

    @classmethod
    def from_json(cls, name: str, data: Mapping) -> BaselineResult:
        if not isinstance(data, Mapping) or data.get("status") not in ("ok", "infeasible"):
            raise PlanError(f"baselines[{name!r}] must have status 'ok' or 'infeasible'")
        if data["status"] == "ok":
            return cls(name, predicted=Predicted.from_json(
                data.get("predicted", {}), where=f"baselines[{name!r}].predicted"))
        return cls(name, reason=str(data.get("reason")))


def _result(name: str, table: CostTable, assignment: dict[str, str] | None, mode: str,
            microbatches: int, arr: Arrays, contiguous: bool = False,
            reason: str | None = None) -> BaselineResult:
    if assignment is None:
        return BaselineResult(name, reason=reason)
    broken = violations(table, assignment, contiguous=contiguous, arrays=arr,
                        microbatches=microbatches if mode == "pipelined" else 1)
    if broken:
        more = f" (+{len(broken) - 2} more)" if len(broken) > 2 else ""
        return BaselineResult(name, assignment, reason="; ".join(broken[:2]) + more)
    return BaselineResult(name, assignment, evaluate(table, assignment, mode, microbatches,
                                                     arrays=arr))


def single_device(table: CostTable, device: str, mode: str = "sequential",
                  microbatches: int = 1, *, arrays: Arrays | None = None) -> BaselineResult:
    """Every layer on `device`."""
    arr = arrays or Arrays(table)
    return _result(f"only {device}", table, {n: device for n in arr.layers}, mode, microbatches,
                   arr)


class _Room:
    """What each device has left: its cap less its layers' `memory_bytes` and
    the largest working set among them (`Arrays.ws`, held one at a time)."""

    def __init__(self, arr: Arrays, microbatches: int = 1):
        self.arr = arr
        self.mem = arr.mem_at(microbatches)
        self.left = arr.cap.astype(float).copy()
        self.ws = np.zeros(len(arr.cap))

    def need(self, i: int, j: int) -> float:
        return float(self.mem[i, j] + max(self.arr.ws[i] - self.ws[j], 0.0))

    def fits(self, i: int, j: int) -> bool:
        return bool(self.arr.ok[i, j]) and self.need(i, j) <= self.left[j]

    def take(self, i: int, j: int) -> None:
        self.left[j] -= self.need(i, j)
        self.ws[j] = max(self.ws[j], self.arr.ws[i])


def greedy_fastest(table: CostTable, mode: str = "sequential", microbatches: int = 1, *,
                   arrays: Arrays | None = None) -> BaselineResult:
    """Each layer on its fastest allowed device with room left (transfers ignored)."""
    arr = arrays or Arrays(table)
    t = arr.t_at(microbatches if mode == "pipelined" else 1)
    room = _Room(arr, microbatches if mode == "pipelined" else 1)
    out = {}
    for i in arr.order:
        for j in np.argsort(np.where(arr.ok[i], t[i], np.inf), kind="stable"):
            if room.fits(i, j):
                room.take(i, j)
                out[arr.layers[i]] = arr.devices[j]
                break
        else:
            return _result("greedy fastest", table, None, mode, microbatches, arr,
                           reason=f"no allowed device has room for {arr.layers[i]}")
    return _result("greedy fastest", table, out, mode, microbatches, arr)


def memory_fill(table: CostTable, mode: str = "sequential", microbatches: int = 1, *,
                arrays: Arrays | None = None) -> BaselineResult:
    """Accelerate-style `device_map="auto"`: fill the fastest device, then the next."""
    arr = arrays or Arrays(table)
    total = np.where(arr.ok, arr.t, 0.0).sum(axis=0) / np.maximum(arr.ok.sum(axis=0), 1)
    # A device no layer may use (a memory place) would rank first and hold the pointer.
    rank = [j for j in np.argsort(total, kind="stable") if arr.ok[:, j].any()]
    room = _Room(arr, microbatches if mode == "pipelined" else 1)
    pointer = 0
    out = {}
    for i in arr.order:
        placed = False
        while pointer < len(rank):
            j = rank[pointer]
            if room.fits(i, j):
                placed = True
                break
            if not arr.ok[i, j]:
                break
            pointer += 1  # current device is full: move on for good
        if not placed:
            for j in rank:
                if room.fits(i, j):
                    placed = True
                    break
        if not placed:
            return _result("memory fill", table, None, mode, microbatches, arr,
                           reason=f"no allowed device has room for {arr.layers[i]}")
        room.take(i, j)
        out[arr.layers[i]] = arr.devices[j]
    return _result("memory fill", table, out, mode, microbatches, arr)


def heft(table: CostTable, mode: str = "sequential", microbatches: int = 1, *,
         arrays: Arrays | None = None) -> BaselineResult:
    """HEFT list scheduling: upward rank order, earliest-finish-time device."""
    arr = arrays or Arrays(table)
    L, D = arr.ok.shape
    t = arr.t_at(microbatches if mode == "pipelined" else 1)
    f, b = arr.edge_parts(1)
    comm = f + b
    mean_t = np.array([t[i, arr.ok[i]].mean() for i in range(L)])
    off = ~np.eye(D, dtype=bool)
    succ: list[list[tuple[int, int]]] = [[] for _ in range(L)]
    pred: list[list[tuple[int, int]]] = [[] for _ in range(L)]
    for k in range(len(arr.eu)):
        succ[arr.eu[k]].append((k, arr.ev[k]))
        pred[arr.ev[k]].append((k, arr.eu[k]))
    mean_c = np.zeros(len(arr.eu))
    for k in range(len(arr.eu)):
        finite = comm[k][off & np.isfinite(comm[k])]
        mean_c[k] = finite.mean() if finite.size else 0.0
    rank = np.zeros(L)
    for i in reversed(arr.order):
        rank[i] = mean_t[i] + max((mean_c[k] + rank[v] for k, v in succ[i]), default=0.0)
    # Decreasing rank is a topological order when times are positive; break
    # ties by topological position so zero-time layers stay valid.
    pos = {i: p for p, i in enumerate(arr.order)}
    order = sorted(range(L), key=lambda i: (-rank[i], pos[i]))
    avail = np.zeros(D)
    finish = np.zeros(L)
    where = np.full(L, -1)
    room = _Room(arr, microbatches if mode == "pipelined" else 1)
    for i in order:
        best, best_j = np.inf, -1
        for j in range(D):
            if not room.fits(i, j):
                continue
            ready = 0.0
            for k, p in pred[i]:
                if where[p] < 0:
                    continue
                c = comm[k, where[p], j]
                ready = max(ready, finish[p] + c)
            eft = max(avail[arr.resource[j]], ready) + t[i, j]
            if eft < best:
                best, best_j = eft, j
        if best_j < 0 or not np.isfinite(best):
            return _result("heft", table, None, mode, microbatches, arr,
                           reason=f"no device with room and links for {arr.layers[i]}")
        where[i], finish[i] = best_j, best
        avail[arr.resource[best_j]] = best  # devices of one compute group wait together
        room.take(i, best_j)
    out = {arr.layers[i]: arr.devices[where[i]] for i in range(L)}
    return _result("heft", table, out, mode, microbatches, arr)


def exhaustive(table: CostTable, objective: str = "time", mode: str = "sequential",
               microbatches: int = 1, *, max_cost: float | None = None,
               max_step_time: float | None = None, contiguous: bool = False,
               arrays: Arrays | None = None) -> BaselineResult:
    """The best assignment found by trying them all (the optimality oracle).

    Vectorised with numpy over all assignments of allowed devices; refuses
    above MAX_EXHAUSTIVE_ASSIGNMENTS (about 12 layers x 3 devices).

    Raises:
      PlanError: the graph is too large to enumerate.
    """
    arr = arrays or Arrays(table)
    L, D = arr.ok.shape
    choices = [np.nonzero(arr.ok[i])[0] for i in range(L)]
    n = int(np.prod([len(c) for c in choices], dtype=float))
    if n > MAX_EXHAUSTIVE_ASSIGNMENTS:
        raise PlanError(f"exhaustive search would try {n:.3g} assignments (limit "
                        f"{MAX_EXHAUSTIVE_ASSIGNMENTS}, about 12 layers x 3 devices); use the ILP")
    A = np.array(list(itertools.product(*choices)), dtype=np.int64).reshape(n, L)
    M = microbatches if mode == "pipelined" else 1
    rows = np.arange(L)[None, :]
    t = arr.t_at(M)[rows, A]  # [n, L]
    feasible = np.ones(n, dtype=bool)
    busy = np.zeros((n, D))
    memory = np.zeros((n, D))
    for j in range(D):
        on = A == j
        busy[:, j] = np.where(on, t, 0.0).sum(axis=1)
        memory[:, j] = (np.where(on, arr.mem_at(M)[rows, A], 0.0).sum(axis=1)
                        + np.where(on, arr.ws[None, :], 0.0).max(axis=1))  # one working set
    feasible &= np.all(memory <= arr.cap[None] * (1 + 1e-9), axis=1)
    f, b = arr.edge_parts(M)
    ia, ib = A[:, arr.eu], A[:, arr.ev]  # [n, E]
    ke = np.arange(len(arr.eu))[None, :]
    fe, be = f[ke, ia, ib], b[ke, ia, ib]
    feasible &= np.all(np.isfinite(fe) & np.isfinite(be), axis=1)
    fe, be = np.where(np.isfinite(fe), fe, 0.0), np.where(np.isfinite(be), be, 0.0)
    transfer = fe.sum(axis=1) + be.sum(axis=1)
    compute = t.sum(axis=1)
    if mode == "sequential":
        step = compute + transfer
    else:
        bott = (arr.resource_load(busy) / M).max(axis=1)
        for a in range(D):
            for c in range(D):
                if a != c:
                    load = (np.where((ia == a) & (ib == c), fe, 0.0).sum(axis=1)
                            + np.where((ib == a) & (ia == c), be, 0.0).sum(axis=1))
                    bott = np.maximum(bott, load)
        step = compute / M + transfer + (M - 1) * bott
    if contiguous:
        seq = A[:, arr.order]
        change = np.concatenate([np.ones((n, 1), bool), seq[:, 1:] != seq[:, :-1]], axis=1)
        for j in range(D):
            feasible &= ((seq == j) & change).sum(axis=1) <= 1
    used = np.stack([(A == j).any(axis=1) for j in range(D)], axis=1)
    price = np.where((used.sum(axis=1) == 1)[:, None], arr.price_alone[None], arr.price[None])
    cost = step * (used * price).sum(axis=1) / 3600.0
    energy = ((busy * arr.watts_busy[None] + (step[:, None] - busy) * arr.watts_idle[None])
              * used).sum(axis=1)
    if max_cost is not None:
        feasible &= cost <= max_cost * (1 + 1e-9)
    if max_step_time is not None:
        feasible &= step <= max_step_time * (1 + 1e-9)
    value = {"time": step, "cost": cost, "energy": energy}[objective]
    if not feasible.any():
        return BaselineResult("exhaustive", reason="no assignment satisfies the constraints")
    best = int(np.argmin(np.where(feasible, value, np.inf)))
    out = {arr.layers[i]: arr.devices[A[best, i]] for i in range(L)}
    return _result("exhaustive", table, out, mode, microbatches, arr, contiguous)


def all_baselines(table: CostTable, objective: str = "time", mode: str = "sequential",
                  microbatches: int = 1, *, max_cost: float | None = None,
                  max_step_time: float | None = None, contiguous: bool = False,
                  arrays: Arrays | None = None) -> dict[str, BaselineResult]:
    """Every baseline on `table`; exhaustive only when small enough (else its reason says why)."""
    arr = arrays or Arrays(table)
    out = {}
    for j, d in enumerate(arr.devices):
        if arr.place[j]:  # a memory place holds state; no layer runs there
            continue
        r = single_device(table, d, mode, microbatches, arrays=arr)
        out[r.name] = r
    for fn in (greedy_fastest, memory_fill, heft):
        r = fn(table, mode, microbatches, arrays=arr)
        out[r.name] = r
    try:
        r = exhaustive(table, objective, mode, microbatches, max_cost=max_cost,
                       max_step_time=max_step_time, contiguous=contiguous, arrays=arr)
    except PlanError as e:
        r = BaselineResult("exhaustive", reason=f"skipped: {e}")
    out[r.name] = r
    return out
