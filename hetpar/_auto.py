"""`@hetpar.auto`: trace, cost, plan, split and run a training step across devices.

The first call with given shapes and dtypes traces the step into layers,
builds its cost table for the devices, solves the placement ILP (or takes
the plan given), splits the step into per-device stages and compiles them.
Later calls with the same shapes reuse all of that; new shapes retrace, as
`jax.jit` does. A plan that puts every layer on one device compiles the
whole step as one `jax.jit` executable on that device, and later calls go
straight to it (`AutoStep.__call__`): jit's own C++ signature check is the
only one, so the step costs what `jax.jit`'s does.

Leaves of the arguments that are not arrays or Python numbers (an Equinox
model's activation function) are static, as under `eqx.filter_jit`: part of
the signature, compared by equality (identity when unhashable), closed over
when tracing; the result's are returned as the trace produced them
(`StaticLeaves`, passes/_program.py).

Flax NNX objects among the arguments (a Module, an Optimizer, Rngs: any
`nnx.Pytree`) are handled as `nnx.jit` handles them: split into a GraphDef
and their state before the call, merged back inside the step, and updated
in place with the state the step leaves them in.

This module is the entry point: `auto`, its options checked when it is
called. The call path is `AutoStep` (hetpar/_auto_step.py); the step traced,
planned and compiled for one signature is `CompiledStep`
(hetpar/_compiled_step.py), planned by hetpar/_step_planning.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# Names tests and callers read from hetpar._auto stay importable here. A test
# that replaces one patches the module that calls it (`_auto_step.signature`,
# `_step_planning.whole_step_s`, `_compiled_step.warn_without_huge_pages`):
# patching it here changes nothing.
from hetpar._auto_step import AutoStep
from hetpar._calibration import whole_step_s  # noqa: F401
from hetpar._compiled_step import UNKNOWN, CompiledStep  # noqa: F401
from hetpar._host_memory import warn_without_huge_pages  # noqa: F401
from hetpar._options import Options, is_int
from hetpar._signature import signature  # noqa: F401
from hetpar.core import HetparError, PlanError


def auto(fn: Callable | None = None, *, devices: str | Sequence[str] | None = None,
         objective: str = "time", plan: Any = None, microbatches: int = 1,
         batch_argnums: Sequence[int] | int | None = None, schedule: str = "gpipe",
         profile: Any = "auto", depth: int | None = None,
         on_missing_device: str = "error", data_parallel: bool | str = True,
         memory: Mapping[str, float] | None = None, batch: str = "global",
         hierarchical: bool | str = "auto", donate_argnums: int | Sequence[int] = (),
         groups: Sequence[Sequence[str]] | None = None, group_state: str = "device"):
    """Runs a training step across the devices present, placed by hetpar's planner.

    Usable as `@hetpar.auto` or `hetpar.auto(step, devices=[...], ...)`.

    Args:
      fn: the step, e.g. `train_step(params, opt_state, batch)`. A step on
        Flax NNX objects that updates them in place (`optimizer.update(model,
        grads)`) updates them as under `nnx.jit`; it returns arrays only.
      devices: device names (`cpu:0`, `gpu:0`) to use, or one name as a
        string (`devices="gpu:0"`); default all present.
      objective: "time", "cost" or "energy".
      plan: a path to plan.json, a `hetpar.Plan`, or a dict naming every
        layer (layer names as `hetpar.trace(fn, *args).layers`) with its
        device, or with a placement `{"compute": "gpu:0", "state": "cpu:0",
        "update": "cpu:0"}` that keeps its parameters and optimizer state on
        another device between steps and runs its update there (or streams
        the state to `compute` for the update: `"update": "gpu:0"`). State
        may live in a memory place, `"state": "gpu:0:pinned_host"` (the
        GPU's pinned host memory), and parameters apart from it,
        `"params": "gpu:0"`; default: solve.
      microbatches: a positive int. With M > 1 and a step that takes its gradient with
        `hetpar.value_and_grad`/`hetpar.grad`, the gradient part runs as M
        microbatches through the device pipeline and the update runs once.
      batch_argnums: which arguments of `fn` are batch data: an int or ints
        (default: the last, and the arguments just before it every leaf of
        which has as many rows: `x` and `y` of `step(params, opt_state, x, y)`).
      schedule: "gpipe" or "1f1b".
      profile: "auto" (the default): calibrated here at the first call: each
        layer is timed alone on the present devices (cached on disk under
        $HETPAR_CACHE_DIR, reused by later processes and by other models
        with the same layers), the whole step runs under `jax.jit` on one
        device of each kind planned for (also cached), and each device's
        layer times are scaled to sum to it (`scale_to_step`); absent
        devices are priced from spec sheets. "auto" uses the file
        $HETPAR_PROFILES names instead, where it is set, and spec sheets
        where timing is off: under jax.distributed, or with
        $HETPAR_CALIBRATE=0 (test suites, jobs that must not spend the
        first call timing). "measure": calibrate, always (one process).
        "spec": spec sheets alone. Or a path to a `hetpar profile` file, or
        a ProfileSet.
      depth: module-path depth naming layers (see `hetpar.trace`).
      on_missing_device: "error", or "replan" to plan afresh when a loaded
        plan names devices that are not present.
      data_parallel: True: let the planner choose to run the whole step data
        parallel over two or more accelerators of one kind (batch split,
        `Plan.replicas`), its state replicated or sharded across them
        (`Plan.sharding`: "zero1", the optimizer state split; "fsdp", the
        parameters too, ZeRO-3), when it predicts that faster (or cheaper)
        than any placement of layers, or the only plan that fits.
        "replicated": the same, state replicated only (the planner before
        sharded state). False: layer placements only. "always", "zero1" or
        "fsdp": no ILP; the step runs data parallel over `devices` (default:
        the default backend's devices, of every process under
        jax.distributed), its state replicated ("always") or sharded as
        named. A sharded state leaf is split on its largest axis that the
        number of devices divides; a leaf no axis divides stays replicated.
      memory: {device: bytes} caps on devices' memory for planning (e.g.
        `{"gpu:0": 40e9}`), so the planner keeps state off a device (offload)
        as if it were that small. A cap bounds what the layers hold across
        the step (parameters, state, gradients, kept activations) plus the
        largest working set of a layer on the device while it runs (its
        temporaries, counted unfused from the trace: GPT-2's head at batch
        16 x 128 tokens, 1.23 GB) and the optimizer state streamed in flight.
        Not counted: XLA's own workspace and compiling (0.34-0.66 GB for
        GPT-2 b16 on an H100); leave room for those. A GPT-2 b16 plan
        counted at 1.29 GB under a 1.30 GB cap peaked at 1.16 GB in a
        serialised step, about 1.21 GB in a training loop
        (experiments/results/plan_memory). Before the first step, every
        plan's compiled executables (one device, data parallel, split) are
        checked against the capacities, caps included, and the CPU devices
        and memory places together against the host's RAM; a plan over is
        planned again (docs/architecture/runtime.md).
      batch: under `jax.distributed` with several processes, what each process
        passes as the batch arguments: "global" (the whole batch, the same on
        every process; each process uses its devices' share) or "local" (only
        its own share: leading axis = global batch / process count, process i
        holding rows [i B/P, (i+1) B/P)); parameters and optimizer state are
        passed whole either way. With one process both mean the same. Across
        processes hetpar.auto runs the step data parallel over every
        process's devices of the default backend (or `devices`, or a Plan's
        `replicas`), and returns global jax.Arrays, replicated (read one with
        `np.asarray`); see docs/distributed.md.
      hierarchical: under several processes, True plans the step over one
        process's devices (process 0's names, `p0/gpu:0`) and runs that plan
        on every process, each on its share of the batch, averaging the
        gradients (and the loss) across the processes before the update:
        data parallel across processes (hosts), the planner's placement or
        pipeline within each. "auto" (the default): the planner weighs that
        against its plan over every process's devices and runs the faster
        (objective "time", no plan given). False: never. Ignored with one
        process.
      donate_argnums: arguments the step replaces (its parameters and
        optimizer state), as `jax.jit` takes them: their buffers may hold
        the new state, so one copy of the state lives on the device instead
        of two, and the arrays passed are deleted by the call (pass the
        state the step returned, as with jax.jit). Every plan donates, a
        split one stage by stage (each input given up by its last reader,
        host-resident state included), but one split over several processes;
        the planner then counts one copy of the state where it lives.

      groups: device groups to place layers on instead of single devices,
        e.g. `[["gpu:0", "gpu:1"], ["gpu:2", "gpu:3"]]`: each group computes
        its layers data parallel over its devices (of one kind), its state
        sharded across them as `data_parallel` names ("zero1", "always":
        replicated; otherwise "fsdp"), and the ILP places the layers over
        the groups, pipelined with `microbatches` (`Plan.groups`). Without
        it the planner weighs such groups itself (each accelerator kind cut
        into equal groups) when `data_parallel` is True.
      group_state: with `groups`: "device", or "pinned_host" to keep each
        group's state in its devices' pinned host memory between steps
        (each member its own shard), streamed in for the step.

    Returns:
      An `AutoStep`: call it like `fn`; it has `.plan`, `.report()`,
      `.explain()` and `.lower(*args)`.

    Raises:
      HetparError: a bad option, here rather than at the first call (PlanError
        for a malformed `plan` or `devices` not present). A plan dict that
        does not name exactly the step's layers raises PlanError at the first call.
    """
    if isinstance(devices, str):
        devices = (devices,)
    elif devices is not None and not isinstance(devices, Sequence):
        raise PlanError(f"devices must be a device name or a sequence of them, got "
                        f"{type(devices).__name__}")
    if is_int(batch_argnums):
        batch_argnums = (batch_argnums,)
    elif batch_argnums is not None and not isinstance(batch_argnums, Sequence):
        raise HetparError("batch_argnums must be an int, a sequence of ints or None, got "
                          f"{type(batch_argnums).__name__}")
    options = Options(devices=tuple(devices) if devices else None, objective=objective,
                      plan=plan, microbatches=microbatches,
                      batch_argnums=None if batch_argnums is None else tuple(batch_argnums),
                      schedule=schedule, profile=profile, depth=depth,
                      on_missing_device=on_missing_device,
                      data_parallel=data_parallel if isinstance(data_parallel, str)
                      else bool(data_parallel),
                      memory=None if memory is None else dict(memory)
                      if isinstance(memory, Mapping) else memory, batch=batch,
                      hierarchical=hierarchical,
                      donate_argnums=(donate_argnums,) if is_int(donate_argnums)
                      else tuple(donate_argnums) if isinstance(donate_argnums, Sequence)
                      else donate_argnums,
                      groups=_group_lists(groups), group_state=group_state)
    if fn is None:
        return functools.partial(_wrap, options=options)
    return _wrap(fn, options)


def _group_lists(groups) -> tuple[tuple[str, ...], ...] | None:
    """`groups` as a tuple of device-name tuples (checked by `Options`)."""
    if groups is None:
        return None
    if isinstance(groups, str) or not isinstance(groups, Sequence) or not all(
            isinstance(g, Sequence) and not isinstance(g, str) for g in groups):
        raise PlanError(f"groups must be a list of device lists, e.g. [['gpu:0', 'gpu:1'], "
                        f"['gpu:2', 'gpu:3']], got {groups!r}")
    return tuple(tuple(g) for g in groups)


def _wrap(fn: Callable, options: Options) -> AutoStep:
    return AutoStep(fn, options)
