"""`step.place(...)`: the arguments moved to where the plan keeps them
between steps, giving up the caller's donated arrays as it copies them
(issue 41, item 4: the host holds one copy of the state).

A 6.74B model's 81 GB of parameters and Adam state, built on the host and
placed for an offload plan, sat on the host twice (the caller's arrays and
their copies in pinned host memory), over a 125 GiB host's RAM. With
`donate_argnums`, `place` moves the donated arguments' arrays a chunk
(`CHUNK_BYTES`) at a time, waits for the chunk's copies, and only then
deletes the originals: the host holds at most one chunk twice. An array
whose copy shares a buffer with it (already placed, or a replicated array's
shard on the target), NumPy arrays and the other arguments are never given
up; nor anything under several processes. Nothing is lost when a copy fails:
`PlaceError.placed` holds the arguments as they then are, the arrays moved
so far beside those not moved yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from hetpar.core import HetparError, nbytes
from hetpar.passes import static_where
from hetpar.runtime import Executor, TransferEngine, copied_apart
from hetpar.runtime._replicated import host_view, misplaced

#: Bytes of donated arrays copied before their originals are given up.
CHUNK_BYTES = 1 << 30


class PlaceError(HetparError, RuntimeError):
    """A copy failed while placing donated arguments; `placed` holds them all."""

    def __init__(self, message: str, placed):
        super().__init__(message)
        self.placed = placed


def place(step, args: tuple) -> tuple:
    """`args` moved where `CompiledStep` `step`'s plan keeps them (see
    `auto`'s `place`). Arrays only: static leaves (an activation function)
    and Python numbers (a learning rate) stay as they are, so the step's
    signature does not change."""
    def is_array(x):
        return isinstance(x, (jax.Array, np.ndarray))

    replicated, executor = step._replicated, step._executor
    if replicated is not None and replicated.multi_process and step._static is None:
        return replicated.global_args(args)
    if executor is None and replicated is not None and step._static is not None:
        return args  # (its runner lays out the arguments without their static leaves)
    leaves, tree = jax.tree_util.tree_flatten(args)
    donated = (donated_leaves(args, step._donated)
               if step._donated and jax.process_count() == 1 else [])
    if executor is None and replicated is not None:
        # Replicas or sharded state: each leaf laid out as the step wants it
        # (`Replicated._placed`'s rule: a batch jit can lay out stays), here
        # rather than in the first call, a chunk at a time where donated. On
        # two H200s the zoo 5.04B's fsdp state took 35 s to lay out, counted
        # as the first step's run (experiments/results/fit_h200x2, run 67).
        want = replicated.flat_leaf_shardings()
        batch = [k in replicated.batch_argnums for k, a in enumerate(args)
                 for _ in jax.tree_util.tree_leaves(a)]

        def move(idx):
            at = [i for i in idx if is_array(leaves[i])
                  and misplaced(leaves[i], want[i], batch[i])]
            put = dict(zip(at, jax.device_put([host_view(leaves[i], want[i]) for i in at],
                                              [want[i] for i in at]))) if at else {}
            return [put.get(i, leaves[i]) for i in idx]
    elif executor is None:  # one device: the transfer engine's puts (to the bare
        # device where it is a plain copy in: host -> GPU, 5-8 GB/s against
        # 1.1-1.4 to its sharding, experiments/results/links)
        engine = TransferEngine()

        def move(idx):
            arrays = [i for i in idx if is_array(leaves[i])]
            put = dict(zip(arrays, engine.move_many([leaves[i] for i in arrays], step._device)))
            return [put.get(i, leaves[i]) for i in idx]
    else:
        fixed = set(static_where(args)) if step._static is not None else set()
        traced = [i for i in range(len(leaves)) if i not in fixed]
        at = {i: k for k, i in enumerate(traced)}
        flat = [leaves[i] for i in traced]

        def move(idx):  # (None: another process keeps it)
            placed = executor.place_inputs(flat, only=[at[i] for i in idx if i in at])
            return [placed[at[i]] if i in at and is_array(leaves[i])
                    and placed[at[i]] is not None else leaves[i] for i in idx]

        if isinstance(executor, Executor) and not executor.multi_process:  # (not a group's)
            warn_placing_growth(executor, flat, {at[i] for i in donated if i in at})
    return jax.tree_util.tree_unflatten(tree, place_donating(leaves, donated, move, tree))


def warn_placing_growth(executor, flat: list, donated: set[int]) -> float | None:
    """Warns (HostMemoryWarning) where placing would grow this process past
    the host RAM the OS has available: the inputs bound for pinned host
    memory grow XLA's pool by regions while the caller's host arrays not
    yet copied are still there (`hetpar.core.placing_growth`). An OS that
    runs out kills the process, and the caller's state with it: the 6.74B
    model at 45 GB of an H200 rose to 122.8 GB of the host's 134 while
    placing (fit_h200, run 58). Returns the growth (None: nothing bound
    for pinned memory)."""
    import warnings

    from hetpar._host_memory import HostMemoryWarning, pinned_pool_bytes
    from hetpar.core import pinned_pool_reserved, placing_growth
    from hetpar.cost_models._devices import os_memory

    served = from_host = already = 0.0
    for i, (x, target) in enumerate(zip(flat, executor._input_devices)):
        if getattr(target, "memory_kind", None) != "pinned_host" or not hasattr(x, "nbytes"):
            continue
        n = float(x.nbytes)
        served += n
        if getattr(getattr(x, "sharding", None), "memory_kind", None) == "pinned_host":
            already += n
        elif i in donated and isinstance(x, jax.Array) and all(
                d.platform == "cpu" for d in x.devices()):
            from_host += n
    if served <= 0:
        return None
    limit = pinned_pool_bytes()
    growth = placing_growth(served, from_host, limit, already)
    got = os_memory()
    if got is not None and growth > got[0]:
        warnings.warn(HostMemoryWarning(
            f"placing needs up to {nbytes(growth)} more of the host's RAM and the OS has "
            f"{nbytes(got[0])} available: XLA's pinned pool grows by regions (to "
            f"{nbytes(pinned_pool_reserved(served, limit))}) while the host arrays not yet "
            "copied are still there, and an OS out of memory kills the process. Build the "
            "state on the accelerator, or free host memory first"), stacklevel=4)
    return growth


def donated_leaves(args: tuple, donated: Sequence[int]) -> list[int]:
    """The flat positions of the leaves of arguments `donated` that are JAX arrays."""
    out, start = [], 0
    for k, a in enumerate(args):
        leaves = jax.tree_util.tree_leaves(a)
        if k in donated:
            out += [start + j for j, x in enumerate(leaves) if isinstance(x, jax.Array)]
        start += len(leaves)
    return out


def place_donating(leaves: list, donated: Sequence[int], move: Callable[[list[int]], list],
                   tree) -> list:
    """`leaves` with `move(positions) -> their placed arrays` applied to
    every position: the donated ones (`donated`) a chunk at a time, each
    original deleted once its copy is done (module docstring)."""
    out = list(leaves)
    given = set(donated)
    rest = [i for i in range(len(leaves)) if i not in given]
    for i, y in zip(rest, move(rest) if rest else ()):
        out[i] = y
    # An array at several donated positions (tied weights) is copied once,
    # at its first; the others take that copy, never the original.
    same: dict[int, list[int]] = {}  # id -> its donated positions
    for i in donated:
        same.setdefault(id(leaves[i]), []).append(i)
    unique = [i for i in donated if same[id(leaves[i])][0] == i]
    chunk: list[int] = []
    size = 0
    for n, i in enumerate(unique):
        chunk.append(i)
        size += int(getattr(leaves[i], "nbytes", 0) or 0)
        if size < CHUNK_BYTES and n + 1 < len(unique):
            continue
        try:
            moved = move(chunk)
            jax.block_until_ready(moved)
        except Exception as e:  # noqa: BLE001 - the state goes back to the caller whole
            placed = jax.tree_util.tree_unflatten(tree, out)
            raise PlaceError(
                f"place() failed copying {len(chunk)} donated arrays ({nbytes(size)}): "
                f"{type(e).__name__}: {str(e).splitlines()[0][:200]}. Nothing is lost: the "
                "arguments, those moved so far and the rest, are in this error's `placed`",
                placed) from e
        for i, y in zip(chunk, moved):
            for j in same[id(leaves[i])]:
                out[j] = y
            if copied_apart(leaves[i], y):
                leaves[i].delete()
        chunk, size = [], 0
    return out
