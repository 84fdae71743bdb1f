"""What a compiled whole step moves between its devices: the collectives in
its HLO, as bytes over the ring and seconds at the group's measured ring.

The planner prices a sharded step's collectives from a model (fsdp: every
layer's parameters all-gathered for its forward and again for its backward,
its gradient reduce-scattered; `hetpar/planner/_sharded.py`). XLA's SPMD
partitioner decides what moves op by op. On the zoo's 5.04B transformer over
two H200s the compiled step's all-gathers and reduce-scatters moved about
3.7 GB a GPU where the model counts each GPU's 10 GB shard three times, and
the step ran in 109 ms, shorter than the modelled collectives alone
(experiments/results/fit_h200x2, runs 45-47). Its collectives' bytes at the
ring's bandwidth (no latency charged, nothing hidden) are what the step took
beyond its compute on three models over two H200s: 80.0 ms of 271.4 for the
6.74B Llama-style model (the compiled bytes 18.4 GB a GPU), 43.2 of 140.1 for
the Hugging Face 2.9B Llama (9.25 GB), the planner's compute being 191.3 and
97.3 ms (those two models' bytes read from their compiles for two virtual
CPUs, whose partitioning moved the zoo model's 3.9 GB against the GPU's 3.7);
15-16 ms against 24-32 ms for the zoo model (1.09-1.17x its step so
predicted, against 0.71-0.75x by the model). So once a sharded step (zero1, fsdp) has
compiled at its first call, its prediction takes the compiled collectives in
place of the planner's model (`repriced`), and `step.report()` shows both
(`step["collectives"]`, for replicated steps too).

Run on the GPUs (run 48, the bytes now read from the GPUs' own compiles):
1.04x for the 6.74B model (269.5 ms measured, 259.3 predicted) and 1.08x for
the HF 2.9B (138.5, 127.7), but 1.20x for the zoo model (112.9, 93.7). The
zoo model's step alone has 98 all-reduces, of 8 kB each (its biases' and
norms' gradients; the Llama models have one, of the loss); at the ring's
latency as the calibration timed it on that machine (109 us), each the
ring's 2 (n - 1) steps, they come to 21.4 ms, and its step to 115.1 ms
(0.98x), where the other two move by less than 0.2 ms. So each all-reduce
is charged its ring steps' latency; the all-gathers and reduce-scatters
(hundreds, 5-30 MB each) are not: charged one step each, the 6.74B model's
step would be predicted 0.84x. (Fitted on two GPUs: the 2 (n - 1) is the
ring model's, not measured at more.)

The HLO text prints each collective's result, not its operands: the bytes a
member sends or receives follow from the result by the op (`RING_SHARE`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
from absl import logging

OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# `%name = TYPE op(` or `op-start(` (TYPE: an array, or a tuple, perhaps nested).
_LINE = re.compile(r"=\s*(.+?)\s+(" + "|".join(OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+)(\d+)[a-z0-9]*\[([\d,]*)\]")


def ring_share(op: str, n: int) -> float:
    """Bytes each of `n` members sends over a ring, per byte of the op's
    result: an all-gather's result is the gathered whole (each member
    receives the n - 1 shards it lacks), a reduce-scatter's is one member's
    share (it sends n - 1 such), an all-reduce is both of those on the
    whole, an all-to-all keeps 1/n of its result, a permute sends all."""
    return {"all-gather": (n - 1) / n, "reduce-scatter": n - 1.0,
            "all-reduce": 2 * (n - 1) / n, "all-to-all": (n - 1) / n,
            "collective-permute": 1.0}[op]


def _array_bytes(type_text: str) -> float:
    """Bytes of every array a type names, by its element type's width
    (f32, bf16, s4, f8e4m3fn, c64, ...); `pred` is a byte."""
    total = 0.0
    for _kind, bits, dims in _ARRAY.findall(type_text.replace("pred[", "u8[")):
        width = int(bits) / 8
        total += width * float(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def _elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type (`((a, b), c)` -> ["(a, b)", "c"]);
    [type_text] for an array."""
    t = type_text.strip()
    if not t.startswith("("):
        return [t]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(t):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(t[start:i])
                break
        elif ch == "," and depth == 1:
            out.append(t[start:i])
            start = i + 1
    return [e.strip() for e in out]


def _result_bytes(type_text: str, started: bool) -> float:
    """Bytes of a collective's result: its whole type for a synchronous op; for
    an async start, whose type is (operands, result, contexts...), its
    second element."""
    parts = _elements(type_text)
    if started and len(parts) > 1:
        return _array_bytes(parts[1])
    return _array_bytes(type_text)


def hlo_collectives(text: str, n: int) -> dict[str, dict[str, float]]:
    """{op: {"count", "ring_bytes"}} for each collective kind in a compiled
    HLO text (`Compiled.as_text()`), over a group of `n` members (every
    collective taken over the whole group): how many there are and the
    bytes each member sends over a ring for them (`ring_share`). Async pairs
    are counted by their start."""
    out = {op: {"count": 0, "ring_bytes": 0.0} for op in OPS}
    for line in text.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        type_text, op, started = m.groups()
        out[op]["count"] += 1
        out[op]["ring_bytes"] += _result_bytes(type_text, bool(started)) * ring_share(op, n)
    return {op: v for op, v in out.items() if v["count"]}


def in_loops(text: str) -> bool:
    """Whether a compiled HLO text has a `while` loop: a collective in its body
    runs once per trip, which `hlo_collectives` (counting lines) does not
    know (a `lax.scan` over layers, gradient accumulation)."""
    return re.search(r"\swhile\(", text) is not None


def ring_seconds(collectives: Mapping[str, Mapping[str, float]], bandwidth: float,
                 latency: float = 0.0, n: int = 2) -> float:
    """Seconds the collectives take over a ring of `n` members at `bandwidth`
    bytes/s and `latency` s a ring step: their bytes one after another, none
    hidden behind compute, and each all-reduce's 2 (n - 1) ring steps'
    latency, as `core.ring_allreduce_s` has it (module docstring: a sharded
    step's all-gathers and reduce-scatters run ahead of the layers that need
    them; its all-reduces of leaves of a few kB do not)."""
    reduces = collectives.get("all-reduce", {}).get("count", 0)
    steps = 2 * (n - 1) * reduces
    return sum(v["ring_bytes"] for v in collectives.values()) / bandwidth + latency * steps


class Read(NamedTuple):
    """What `compiled_collectives` read: `hlo_collectives` of the executable,
    its group's ring (`bandwidth` bytes/s, `latency` s a ring step, as the
    calibration timed it or the spec sheets give it) and whether the
    program loops (`in_loops`)."""

    by_op: dict
    bandwidth: float
    latency: float
    in_loops: bool
    members: int = 2

    @property
    def seconds(self) -> float:
        """The collectives at the ring (`ring_seconds`)."""
        return ring_seconds(self.by_op, self.bandwidth, self.latency, self.members)


def compiled_collectives(step) -> Read | None:
    """The collectives of the executable a whole step over several devices in
    one process runs (`Read`), read once its first call compiled it and kept
    on the step; None for other plans, before that call, or where the
    executable cannot be read (a backend without HLO text: the step's
    results stand)."""
    cached = getattr(step, "_collectives_read", None)
    if cached is not None:
        return cached or None
    if not step.compiled_once:  # reading it now would compile it (report() before a call)
        return None
    import jax

    if getattr(jax.config, "jax_enable_pgle", False):
        # Under profile-guided compilation the call's executable is keyed apart
        # from `lower()`'s: reading it would compile the step again.
        step._collectives_read = ()
        return None
    runner, shapes = getattr(step, "_replicated", None), getattr(step, "_replicated_shapes", None)
    plan, table = step.plan, step.table
    step._collectives_read = ()
    if (runner is None or shapes is None or runner.size < 2 or plan is None or table is None
            or not set(plan.replicas) <= {d.name for d in table.devices}):
        return None
    from hetpar.planner._arrays import Arrays
    from hetpar.planner._evaluate import ring_of

    arr = Arrays(table)
    bandwidth, latency = ring_of(arr, [arr.dindex[d] for d in plan.replicas])
    try:  # jit's cache serves the executable its first call compiled
        text = runner.executable(shapes).as_text()
    except Exception as e:  # noqa: BLE001 - the prediction keeps the planner's figure
        logging.info("hetpar: the compiled step's collectives could not be read (%s)", e)
        return None
    step._collectives_read = Read(hlo_collectives(text, runner.size), float(bandwidth),
                                  float(latency), in_loops(text), runner.size)
    return step._collectives_read


def repriced(step, predicted):
    """`predicted` (a whole step's `Predicted`) with its collectives priced as
    its compiled executable moves them (`ring_seconds`) in place of the
    planner's model; cost and energy scaled with the step. Sharded state
    only (zero1, fsdp): a replicated step's all-reduce is the model's own
    (and what the calibration fits its compute to, timing that step whole).
    None where there is nothing to price: another plan, collectives in a
    loop (`in_loops`: counted once, run once a trip), nothing read."""
    import dataclasses

    if predicted is None or step.plan is None or not step.plan.sharding:
        return None  # (checked first: a replicated step's HLO is read for its report alone)
    read = compiled_collectives(step)
    if read is None or read.in_loops:
        return None
    seconds = read.seconds
    step_s = max(predicted.step_time_s - predicted.transfer_s, 0.0) + seconds
    scale = step_s / predicted.step_time_s if predicted.step_time_s > 0 else 1.0
    return dataclasses.replace(predicted, step_time_s=step_s, transfer_s=seconds,
                               cost_usd_per_step=predicted.cost_usd_per_step * scale,
                               energy_j_per_step=predicted.energy_j_per_step * scale)


def collectives_summary(step) -> dict | None:
    """For `step.report()` (`step["collectives"]`): a whole step run over
    several devices in one process, its collectives as the planner's model
    priced them (`planned_s`, fsdp's after `FSDP_HIDDEN`; `planned_step_s`,
    the planner's whole step) beside what its compiled executable moves
    (`compiled`, by op; `in_loops`) and those at the group's ring
    (`compiled_s`), which a sharded step's prediction takes (`repriced`).
    None for other plans, or before the step's first call."""
    read = compiled_collectives(step)
    if read is None:
        return None
    planned = step.plan.predicted
    return {"compiled": read.by_op, "compiled_s": read.seconds, "in_loops": read.in_loops,
            "ring_bandwidth_bytes_per_s": read.bandwidth, "ring_latency_s": read.latency,
            "planned_s": float(planned.transfer_s), "planned_step_s": float(planned.step_time_s)}
