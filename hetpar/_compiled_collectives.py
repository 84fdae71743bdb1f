"""What a compiled whole step moves between its devices: the collectives in
its HLO, as bytes over the ring and seconds at the group's measured ring.

The planner prices a sharded step's collectives from a model (fsdp: every
layer's parameters all-gathered for its forward and again for its backward,
its gradient reduce-scattered; `hetpar/planner/_sharded.py`). XLA's SPMD
partitioner decides what moves op by op. On the zoo's 5.04B transformer over
two H200s the compiled step's all-gathers and reduce-scatters moved about
3.7 GB a GPU where the model counts each GPU's 10 GB shard three times, and
the step ran in 109 ms, shorter than the modelled collectives alone
(experiments/results/fit_h200x2, runs 45-47). `step.report()` shows both
(`step["collectives"]`) so that a prediction can be read against what runs.

The HLO text prints each collective's result, not its operands: the bytes a
member sends or receives follow from the result by the op (`RING_SHARE`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
                "c64": 8, "c128": 16}
# `%name = TYPE op(` or `op-start(`: TYPE is an array or a tuple of arrays.
_LINE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def ring_share(op: str, n: int) -> float:
    """Bytes each of `n` members sends over a ring, per byte of the op's
    result: an all-gather's result is the gathered whole (each member
    receives the n - 1 shards it lacks), a reduce-scatter's is one member's
    share (it sends n - 1 such), an all-reduce is both of those on the
    whole, an all-to-all keeps 1/n of its result, a permute sends all."""
    return {"all-gather": (n - 1) / n, "reduce-scatter": n - 1.0,
            "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n,
            "collective-permute": 1.0}[op]


def _result_bytes(type_text: str, op: str, started: bool) -> float:
    arrays = [_DTYPE_BYTES.get(dtype, 4) * float(np.prod([int(d) for d in dims.split(",") if d]))
              for dtype, dims in _ARRAY.findall(type_text)]
    if not arrays:
        return 0.0
    if started and op == "all-gather":  # (operands..., results...)
        return sum(arrays[len(arrays) // 2:])
    if started and op == "collective-permute":  # (operand, result, contexts...)
        return arrays[1] if len(arrays) > 1 else arrays[0]
    return sum(arrays)


def hlo_collectives(text: str, n: int) -> dict[str, dict[str, float]]:
    """{op: {"count", "ring_bytes"}} for each collective kind in a compiled
    HLO text (`Compiled.as_text()`), over a group of `n` members (every
    collective taken over the whole group): how many there are and the
    bytes each member sends over a ring for them (`ring_share`). Async pairs
    are counted by their start."""
    out = {op: {"count": 0, "ring_bytes": 0.0} for op in OPS}
    for type_text, op, started in _LINE.findall(text):
        out[op]["count"] += 1
        out[op]["ring_bytes"] += _result_bytes(type_text, op, bool(started)) * ring_share(op, n)
    return {op: v for op, v in out.items() if v["count"]}


def ring_seconds(collectives: Mapping[str, Mapping[str, float]], bandwidth: float,
                 latency: float) -> float:
    """Seconds the collectives take on a ring of `bandwidth` bytes/s and
    `latency` s a collective, one after another, none hidden behind compute."""
    return sum(v["ring_bytes"] / bandwidth + v["count"] * latency for v in collectives.values())


def collectives_summary(step) -> dict | None:
    """For `step.report()` (`step["collectives"]`): a whole step run over
    several devices in one process, its collectives as the planner priced
    them beside what its compiled executable does. None for other plans.

    `planned_s` is what the prediction adds for collectives (fsdp's after
    `FSDP_HIDDEN`); `compiled` is `hlo_collectives` of the executable the
    step runs, and `compiled_s` those at the group's ring (the calibration's
    timing of its collectives, else its slowest link), none hidden."""
    runner, shapes = getattr(step, "_replicated", None), getattr(step, "_replicated_shapes", None)
    if runner is None or shapes is None or runner.size < 2:
        return None
    compiled = hlo_collectives(runner.executable(shapes).as_text(), runner.size)
    out: dict = {"compiled": compiled}
    predicted = step.predicted()
    if predicted is not None:
        out["planned_s"] = float(predicted.transfer_s)
    table, replicas = step.table, list(step.plan.replicas) if step.plan is not None else []
    if table is not None and replicas and all(d in {x.name for x in table.devices}
                                              for d in replicas):
        from hetpar.planner._arrays import Arrays
        from hetpar.planner._evaluate import ring_of

        arr = Arrays(table)
        bandwidth, latency = ring_of(arr, [arr.dindex[d] for d in replicas])
        out["ring"] = {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency}
        out["compiled_s"] = ring_seconds(compiled, bandwidth, latency)
    return out
