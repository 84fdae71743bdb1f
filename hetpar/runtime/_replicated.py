"""Runs a data-parallel plan: the whole step jitted over a mesh of replicas.

The batch is split along axis 0 over the replicas and everything else (the
parameters, the optimizer state) is replicated; XLA's SPMD partitioner turns
the batch mean inside the loss into an all-reduce of the gradients, so every
replica applies the same update and the results equal one device's `jax.jit`
(up to the order of the reduction).

Across processes (`jax.distributed`, docs/distributed.md) the replicas may
belong to several processes: the mesh is then global, and every argument is
made a global `jax.Array` before the call (`global_args`). By default each
process passes the same, whole arguments (`batch="global"`), and each keeps
only its devices' part; with `batch="local"` each process passes only its
share of the batch arguments (leading axis = global batch / process count,
process i's share being rows [i B/P, (i+1) B/P) in the replicas' order),
while parameters and optimizer state are still passed whole. Results are
global arrays, replicated on every replica: `np.asarray(out)` reads one on
any process, and passing them back in costs no copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetpar.core import HetparError
from hetpar.runtime._memory import executable_peak


class Replicated:
    """`fn` under `jax.jit`, data parallel over `devices`.

    Args:
      fn: the training step.
      devices: the replicas (jax devices).
      args: example arguments (shapes decide how each batch leaf is split).
      batch_argnums: which arguments are batch data (None: the last).
      batch: "global" (every process passes the whole batch) or "local"
        (each process passes its share: see the module docstring). The same
        with one process.
      donate_argnums: arguments whose buffers the step may reuse (jax.jit's).

    Raises:
      HetparError: a batch leaf whose leading axis does not split evenly, or,
        with `batch="local"`, replicas that do not give each process an
        equal, contiguous share of the batch.
    """

    def __init__(self, fn: Callable, devices: Sequence[jax.Device], args: tuple,
                 batch_argnums: Sequence[int] | None, *, batch: str = "global",
                 donate_argnums: Sequence[int] = ()):
        n = len(devices)
        mesh = Mesh(np.array(devices), ("replica",))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.split = NamedSharding(mesh, PartitionSpec("replica"))
        nums = (len(args) - 1,) if batch_argnums is None else tuple(batch_argnums)
        self._nums = frozenset(nums)
        # Replicas on other processes: arguments must become global arrays.
        self.multi_process = not self.replicated.is_fully_addressable
        self.local_batch = batch == "local" and jax.process_count() > 1
        procs = jax.process_count() if self.local_batch else 1
        if self.local_batch:
            _check_local_batch(devices)

        def batch_sharding(x):
            shape = np.shape(x)
            if not shape:  # a scalar (a step count, an rng): every replica gets it
                return self.replicated
            if self.local_batch:  # this process's share: the global batch is P of them
                shape = (shape[0] * procs, *shape[1:])
            if shape[0] % n:
                raise HetparError(
                    f"a batch array of shape {shape} does not split over {n} replicas: its "
                    f"leading axis ({shape[0]}) must be a multiple of {n}. Use such a batch "
                    "size, or plan with hetpar.auto(..., data_parallel=False).")
            return self.split

        self.mesh, self.size = mesh, n
        leaf_shardings = [
            [batch_sharding(x) for x in jax.tree_util.tree_leaves(a)] if i in nums
            else [self.state_sharding(i, k, x) for k, x in enumerate(jax.tree_util.tree_leaves(a))]
            for i, a in enumerate(args)]
        self._leaf_shardings = leaf_shardings
        # jit and device_put take a tree prefix: one sharding per argument
        # where the whole argument is laid out alike.
        self.shardings = tuple(
            self.replicated if all(s is self.replicated for s in ls)
            else jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(a), ls)
            for a, ls in zip(args, leaf_shardings))
        self._jit = jax.jit(fn, in_shardings=self.shardings,
                            out_shardings=self.out_shardings(fn, args),
                            donate_argnums=tuple(donate_argnums))
        self._donated = tuple(sorted({i % len(args) for i in donate_argnums})) if args else ()
        # The arguments call_placed_batch checks (None: not yet known).
        self._recheck: frozenset[int] | None = None

    def state_sharding(self, arg: int, leaf: int, x) -> NamedSharding:
        """How leaf `leaf` of state argument `arg` is laid out: replicated
        (`Sharded` shards some)."""
        return self.replicated

    def out_shardings(self, fn: Callable, args: tuple):
        """jit's out_shardings: every result replicated (`Sharded` keeps state sharded)."""
        return self.replicated

    def _placed(self, args: tuple, only: frozenset[int] | None = None
                ) -> tuple[tuple, list[int]]:
        """`args` laid out so that every call runs what the first compiled,
        and which arguments had leaves put.

        jit keys its executable on each argument's sharding and whether it
        is committed. State passed uncommitted (or as numpy, or a Python
        number) to the first call and committed from the second (the first
        step's result) compiled the step twice (GPT-2 b64 over 2x H200:
        7.4 s at step 1). State leaves not laid out as the step wants are
        therefore put there: once for state the step returns (later calls
        pass its result, already there), every call for a constant passed
        afresh (a learning rate), whose leaves `call_placed_batch` keeps
        checking.

        Batch leaves are new every step and alike from step to step: numpy
        and uncommitted arrays (a batch made with `jnp` on the default
        device) pass untouched, since jit lays them out itself faster than a
        `device_put` first (1.25 ms of a 4.0 ms dispatch on the dev box,
        experiments/results/dp_b64_h200x2); committed ones laid out
        otherwise are put (jit refuses them).

        Only leaves that need it are put, all in one `device_put`; `only`
        limits the check to those arguments.
        """
        out, moved = None, []
        for i, (a, want) in enumerate(zip(args, self._leaf_shardings)):
            if only is not None and i not in only:
                continue
            leaves, tree = jax.tree_util.tree_flatten(a)
            batch = i in self._nums
            at = [j for j, (x, s) in enumerate(zip(leaves, want)) if misplaced(x, s, batch)]
            if at:
                put = jax.device_put([host_view(leaves[j], want[j]) for j in at],
                                     [want[j] for j in at])
                for j, y in zip(at, put):
                    leaves[j] = y
                out = out or list(args)
                out[i] = jax.tree_util.tree_unflatten(tree, leaves)
                moved.append(i)
        return (args if out is None else tuple(out)), moved

    @property
    def batch_argnums(self) -> frozenset[int]:
        """The positions of the batch arguments (split along axis 0)."""
        return frozenset(self._nums)

    def flat_leaf_shardings(self) -> list:
        """Every argument leaf's sharding, in `jax.tree_util.tree_flatten(args)` order."""
        return [s for leaf_shardings in self._leaf_shardings for s in leaf_shardings]

    def global_shapes(self, args: tuple) -> tuple:
        """`args` with each local batch leaf replaced by its global shape
        (`jax.ShapeDtypeStruct`) under `batch="local"`; else `args` as they are."""
        if not self.local_batch:
            return args
        procs = jax.process_count()

        def whole(x, s):
            shape = np.shape(x)
            if s is self.replicated or not shape:
                return x
            return jax.ShapeDtypeStruct((shape[0] * procs, *shape[1:]), np.result_type(x),
                                        weak_type=getattr(x, "weak_type", False))

        return tuple(
            jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(a),
                [whole(x, s) for x, s in zip(jax.tree_util.tree_leaves(a), want)])
            if i in self._nums else a
            for i, (a, want) in enumerate(zip(args, self._leaf_shardings)))

    def global_args(self, args: tuple) -> tuple:
        """`args` as global jax.Arrays laid out as the step wants (several processes).

        A jax.Array already laid out so (last step's result) passes as it is;
        a global one laid out otherwise is resharded (`jax.device_put`); host
        data (numpy, a Python number, an array of this process alone) becomes
        a global array of which this process fills its devices' parts: from
        the whole value (`jax.make_array_from_callback`), or, for a batch leaf
        under `batch="local"`, from this process's share
        (`jax.make_array_from_process_local_data`).
        """
        out = []
        for i, (a, want) in enumerate(zip(args, self._leaf_shardings)):
            leaves, tree = jax.tree_util.tree_flatten(a)
            local = self.local_batch and i in self._nums
            out.append(jax.tree_util.tree_unflatten(
                tree, [_global(x, s, local and s is self.split) for x, s in zip(leaves, want)]))
        return tuple(out)

    def shapes(self, args: tuple) -> tuple:
        """`args` as the first call lowers them, every leaf a ShapeDtypeStruct:
        a leaf `_placed` lays out (or that is committed) with its sharding, a
        batch leaf jit lays out itself without one (jit keys it apart from a
        committed one). Holds no array: kept for `executable` after the call."""
        def like_placed(x, sharding, batch: bool):
            aval = jax.typeof(x)
            placed = misplaced(x, sharding, batch) or isinstance(x, jax.Array) and x.committed
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                                        sharding=sharding if placed else None)

        return tuple(
            jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(a),
                [like_placed(x, s, i in self._nums)
                 for x, s in zip(jax.tree_util.tree_leaves(a), want)])
            for i, (a, want) in enumerate(zip(args, self._leaf_shardings)))

    def executable(self, shapes: tuple):
        """The step's compiled executable for `shapes` (`self.shapes(args)`): the
        one the first call runs, from jit's cache once that call compiled it."""
        return self._jit.lower(*shapes).compile()

    def memory_peak(self, shapes: tuple) -> float | None:
        """The step's executable's peak bytes on each replica (XLA's memory
        analysis of the partitioned program, `executable_peak`), compiled for
        `shapes` (`self.shapes(args)`, the arguments as `_placed` lays them
        out): the executable the first call runs (jit's cache serves it).
        None where the backend gives no analysis. One process only."""
        try:
            m = self.executable(shapes).memory_analysis()
        except Exception:  # noqa: BLE001 - no analysis on this backend (the call reports errors)
            return None
        return executable_peak(m)

    def __call__(self, *args):
        self._check_donated(args)
        if self.multi_process:
            return self._jit(*self.global_args(args))
        return self._jit(*self._placed(args)[0])

    def _check_donated(self, args: tuple) -> None:
        """Raises JAX's error for a deleted array where a donated argument's
        leaf was given up by an earlier step: passed to the jitted step
        over several devices, such an array crashed the process (jax 0.10,
        CPU devices: "Buffer has been deleted or donated", then a
        segmentation fault)."""
        for i in self._donated:
            deleted_error(jax.tree_util.tree_leaves(args[i]))

    def call_placed_batch(self, args: tuple, checked: bool = False):
        """Runs the step checking only the batch arguments and the state
        arguments that still needed a put at the second call, when the
        state passed is the first step's result (a constant passed afresh:
        a learning rate). A loop's other state is the last step's result,
        laid out as the step wants: checking every state leaf cost more
        than a small step's GPU time. A state leaf misplaced later still
        runs, but jit compiles the step again for it. `checked`: the caller
        has checked that no leaf was deleted (`deleted_error`)."""
        if not checked:
            self._check_donated(args)
        if self._recheck is None:  # the call after the first: everything, once more
            args, moved = self._placed(args)
            self._recheck = self._nums | frozenset(moved)
            return self._jit(*args)
        return self._jit(*self._placed(args, self._recheck)[0])


def host_view(x, sharding):
    """What to hand `jax.device_put` to lay `x` out as `sharding` says: a
    JAX array on a CPU device, going to other devices, as its NumPy view.

    Put as it is, a single-device array is cut into its shards by a jitted
    slice (`jax._src.array.shard_device_array`), which for an uncommitted
    array (one made under `jax.default_device(cpu)`, as a host-built model
    is) runs on the default device: the whole array went to the first GPU to
    be cut there (on CPU devices the slice compiled for device 0 where the
    array was on device 2). On two H200s the first GPU grew faster than the
    second while a 5.04B model's host-built state was laid out so, and kept
    6.8 GB beyond its arrays (experiments/results/fit_h200x2, run 67). Laid
    out by `place()` through this, both GPUs held their shards alone (run
    68: 30.26 GB each); a probe of eight 1 GB arrays put as they are left
    nothing either, so which part removed it is not separated. On CPU
    devices the NumPy view moved 15-100 GB/s where the array itself moved
    1-3. PRNG keys (no NumPy view) and arrays already on a target device
    stay as they are."""
    if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return x
    devices = x.devices()
    if len(devices) != 1 or not x.is_fully_addressable:
        return x
    (device,) = devices
    if device.platform != "cpu" or device in sharding.device_set:
        return x
    return np.asarray(x)


def deleted_error(leaves) -> None:
    """Raises JAX's error for a deleted array among `leaves` (a donated
    argument an earlier step gave up; see `Replicated._check_donated`)."""
    for x in leaves:
        if isinstance(x, jax.Array) and x.is_deleted():
            raise RuntimeError(f"Array has been deleted with shape={x.shape}: donated to an "
                               "earlier step")


def misplaced(x, sharding, batch: bool) -> bool:
    """Whether `Replicated._placed` puts leaf `x`: a committed array laid out
    otherwise, or, for state, anything not yet a committed array (a batch
    leaf jit can lay out itself is left to it)."""
    if isinstance(x, jax.Array) and x.committed:
        return x.sharding != sharding
    return not batch


def _global(x, sharding, local: bool):
    """One leaf as a global jax.Array with `sharding` (see `Replicated.global_args`)."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if not x.is_fully_addressable:  # global already, laid out otherwise
            return jax.device_put(x, sharding)
    if local:
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))
    if isinstance(x, (bool, int, float, complex)):
        return x  # a Python number: jit takes it as every process's same value (weak type kept)
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def _check_local_batch(devices: Sequence[jax.Device]) -> None:
    """Under batch="local" process i's share must be one contiguous run of the
    batch: the replicas grouped by process, in process order, equally many each."""
    procs = [d.process_index for d in devices]
    counts = {p: procs.count(p) for p in procs}
    grouped = procs == sorted(procs)
    if not grouped or set(counts) != set(range(jax.process_count())) or len(
            set(counts.values())) != 1:
        raise HetparError(
            "batch='local' needs the replicas to give every process an equal, contiguous "
            f"share of the batch: as many replicas on each of the {jax.process_count()} "
            f"processes, listed process by process; these replicas are on processes {procs}. "
            "Pass the whole batch on every process (batch='global'), or replicate over "
            "every process's devices.")
