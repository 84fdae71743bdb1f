"""Values crossing processes: collective transfers in one order every process agrees on.

Under `jax.distributed` a process runs computations on its own devices only,
and nothing reaches another process's device but a collective that both
processes run. So a value a stage on process p hands to a stage on process q
crosses as a `jax.lax.ppermute` over a two-device mesh (p's device, q's
device), jitted: p passes the value as its shard, q a buffer of zeros, and q's
shard of the result is the value (NCCL between GPUs, gloo between CPU
processes; `experiments/` has the timings).

Collectives must be issued in the same order on every process that takes part,
or they pair up wrongly (and hang). Worker threads run each device's stages in
that device's order, so the crossings cannot be issued from them: every
process issues its crossings from one thread, in an order fixed by the stage
graph alone (`crossings`): a list schedule of all devices' stages
(`global_order`), crossings sorted by when their value is made. A process
waits, before sending, only for a stage of its own that comes earlier in that
order, and every value that stage reads crosses earlier still: no process can
wait on another that waits on it.

`gather` brings arrays a plan left on one process's device to every process
(for reading results, and in tests), by the same kind of collective.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetpar.core import memory_place


@dataclasses.dataclass(frozen=True)
class Crossing:
    """Values one stage (or the step's inputs) hands to a device of another process.

    Attributes:
      vars: the program variables that cross, together (one collective).
      src: device name the values are on (a memory place's device for state kept there).
      dst: device name that receives them.
      producer: the stage that makes them, or None for step inputs.
    """

    vars: tuple[jcore.Var, ...]
    src: str
    dst: str
    producer: int | None


def global_order(device_order: Mapping[str, Sequence[int]], stages) -> list[int]:
    """Every stage in one order that respects each device's order and every
    dependency: the order they could run in one after another.

    Computed from the stage graph alone, so every process gets the same list.
    """
    producer = {v: st.index for st in stages for v in st.outputs}
    ptr = dict.fromkeys(device_order, 0)
    done: set[int] = set()
    order: list[int] = []
    while len(order) < len(stages):
        progress = False
        for d, ids in device_order.items():
            while ptr[d] < len(ids):
                st = stages[ids[ptr[d]]]
                if any(producer.get(v) is not None and producer[v] not in done
                       for v in st.inputs):
                    break
                order.append(st.index)
                done.add(st.index)
                ptr[d] += 1
                progress = True
        if not progress:  # a schedule no device order can run: a bug in the split
            raise RuntimeError("the stage graph's device orders deadlock")
    return order


def crossings(stages, process_of: Callable[[str], int], *, broadcast: Sequence = (),
              anchors: Mapping[int, str] | None = None) -> list[Crossing]:
    """The values that cross processes in a step of `stages` (a StageGraph), in
    the order every process issues them.

    A value crosses to every device of another process that reads it: from
    the stage that makes it, or, for a step input, from the device the plan
    keeps it on (`input_devices`). `broadcast` names outputs every process
    gets (the loss): they cross from where they are made to `anchors[q]`, a
    device of each other process q.
    """
    invars = list(stages.graph.program.jaxpr.jaxpr.invars)
    home = {v: memory_place(d)[0] for v, d in zip(invars, stages.input_devices)}
    made = {v: (st.index, st.device) for st in stages.stages for v in st.outputs}

    def source(v):
        if v in made:
            return made[v]
        return None, home[v]

    groups: dict[tuple, list] = {}
    for st in stages.stages:
        for v in st.inputs:
            producer, src = source(v)
            if process_of(src) != process_of(st.device):
                vs = groups.setdefault((producer, src, st.device), [])
                if v not in vs:
                    vs.append(v)
    for v in broadcast:
        if not isinstance(v, jcore.Var):
            continue
        producer, src = source(v)
        for q, anchor in sorted((anchors or {}).items()):
            if q != process_of(src):
                vs = groups.setdefault((producer, src, anchor), [])
                if v not in vs:
                    vs.append(v)
    position = {s: k for k, s in enumerate(global_order(stages.device_order, stages.stages))}
    out = [Crossing(tuple(vs), src, dst, producer)
           for (producer, src, dst), vs in groups.items()]
    # Step inputs first; then by when the value is made, then where it goes.
    out.sort(key=lambda c: (-1 if c.producer is None else position[c.producer],
                            process_of(c.dst), c.dst, c.src))
    return out


class Network:
    """Moves arrays between devices of different processes by jitted `ppermute`s.

    Both processes call `cross` with the same arguments but the value: the
    sender passes the arrays, the receiver None (and gets them back on its
    device). Compiled collectives and the receiver's zero buffers are cached.
    """

    def __init__(self):
        self._fns: dict = {}
        self._zeros: dict = {}
        self._lock = threading.Lock()

    def cross(self, values: Sequence | None, avals: Sequence, src: jax.Device,
              dst: jax.Device) -> list | None:
        """Sends `values` (this process owns `src`) or receives them (owns `dst`).

        Returns the values on `dst` on the receiving process, None on the sender.
        """
        sending = src.process_index == jax.process_index()
        raw = [_raw_aval(a) for a in avals]
        # Devices in id order: XLA:GPU wants an iota device assignment (it logs
        # an error for [1, 0]); the permutation says which way the values go.
        pair = sorted([src, dst], key=lambda d: d.id)
        mesh = Mesh(np.array(pair), ("pair",))
        sharding = NamedSharding(mesh, PartitionSpec("pair"))
        fn = self._fn(mesh, sharding, len(raw), pair.index(src))
        shards = ([_as_shard(x, a, src) for x, a in zip(values, avals)] if sending
                  else [self._zero(shape, dtype, dst) for shape, dtype in raw])
        arrays = [jax.make_array_from_single_device_arrays((2 * shape[0], *shape[1:]),
                                                           sharding, [x])
                  for x, (shape, _) in zip(shards, raw)]
        out = fn(*arrays)
        if src.platform == "cpu" or dst.platform == "cpu":
            # The CPU client may run executables issued one after another at
            # once, so their collectives could pair up out of order: one at a time.
            jax.block_until_ready(out)
        if sending:
            return None
        return [_from_shard(y.addressable_data(0), a) for y, a in zip(out, avals)]

    def mean(self, values: Sequence, avals: Sequence, devices: Sequence[jax.Device]) -> list:
        """The elementwise mean of `values` over every process (a hierarchical
        plan's gradients): `devices` holds one device per process, in process
        order, this process's value being on its own. Returns the means there."""
        me = next(d for d in devices if d.process_index == jax.process_index())
        raw = [_raw_aval(a) for a in avals]
        devices = sorted(devices, key=lambda d: d.id)  # an iota assignment, as in `cross`
        mesh = Mesh(np.array(devices), ("proc",))
        sharding = NamedSharding(mesh, PartitionSpec("proc"))
        key = ("mean", tuple(d.id for d in devices), len(raw))
        with self._lock:
            fn = self._fns.get(key)
            if fn is None:
                spec = (PartitionSpec("proc"),) * len(raw)

                def average(*xs):
                    return tuple(jax.lax.pmean(x, "proc") for x in xs)

                fn = self._fns[key] = jax.jit(
                    jax.shard_map(average, mesh=mesh, in_specs=spec, out_specs=spec),
                    out_shardings=(sharding,) * len(raw))
        arrays = [jax.make_array_from_single_device_arrays(
            (len(devices) * shape[0], *shape[1:]), sharding, [_as_shard(x, a, me)])
            for x, a, (shape, _) in zip(values, avals, raw)]
        out = fn(*arrays)
        if me.platform == "cpu":  # one at a time, as in `cross`
            jax.block_until_ready(out)
        return [_from_shard(y.addressable_data(0), a) for y, a in zip(out, avals)]

    def _fn(self, mesh, sharding, n: int, sender: int):
        key = (mesh.devices[0].id, mesh.devices[1].id, n, sender)
        with self._lock:
            fn = self._fns.get(key)
            if fn is None:
                spec = (PartitionSpec("pair"),) * n

                def send(*xs):
                    return tuple(jax.lax.ppermute(x, "pair", [(sender, 1 - sender)])
                                 for x in xs)

                fn = self._fns[key] = jax.jit(
                    jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec),
                    out_shardings=(sharding,) * n)
            return fn

    def _zero(self, shape, dtype, dev):
        key = (shape, str(dtype), dev.id)
        with self._lock:
            z = self._zeros.get(key)
            if z is None:
                z = self._zeros[key] = jax.device_put(np.zeros(shape, dtype), dev)
            return z


def _raw_aval(aval) -> tuple[tuple[int, ...], np.dtype]:
    """(shard shape, dtype) a value crosses as: PRNG keys as their raw data,
    scalars as one-element vectors (a shard needs an axis to split)."""
    shape, dtype = tuple(aval.shape), aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        shape, dtype = tuple(data.shape), data.dtype
    return (shape or (1,)), np.dtype(dtype)


def _as_shard(x, aval, dev):
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        x = jax.random.key_data(x)
    if not isinstance(x, jax.Array) or x.devices() != {dev} or _kind(x) is not None:
        x = jax.device_put(x, jax.sharding.SingleDeviceSharding(dev))
    return x.reshape(1) if x.ndim == 0 else x


def _from_shard(y, aval):
    if not aval.shape:
        y = y.reshape(())
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        y = jax.random.wrap_key_data(y, impl=aval.dtype._impl)
    return y


def _kind(x) -> str | None:
    kind = getattr(x.sharding, "memory_kind", None)
    return None if kind in (None, "device") else kind


def local_part(x):
    """This process's copy of `x`: `x` itself if all its devices are here, the
    local shard of a replicated global array, else None (held elsewhere)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    if x.is_fully_replicated and x.addressable_shards:
        return x.addressable_data(0)
    return None


def gather(tree, network: Network | None = None):
    """Every array of `tree` as a NumPy array on every process.

    For results of a plan whose stages run on several processes: a layer's
    new parameters are returned on the one device that computed them, and
    other processes hold a global array they cannot read. Every process must
    call `gather` with the same tree structure, in the same order (it runs
    one collective per array held on one device or sharded). Arrays every
    process can read (NumPy, replicated results) cost nothing; an array
    sharded over devices of several processes (a sharded-state plan's
    parameters and optimizer state) is all-gathered. With one process:
    `np.asarray` of each leaf.
    """
    network = network or _NETWORK
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    me = jax.process_index()
    for x in leaves:
        if not isinstance(x, jax.Array) or jax.process_count() == 1:
            out.append(np.asarray(x))
            continue
        devices = x.sharding.device_set
        if len(devices) > 1:
            if x.is_fully_replicated and x.addressable_shards:
                out.append(np.asarray(x.addressable_data(0)))
            else:  # sharded (ZeRO-1, FSDP): every process assembles the whole
                from jax.experimental import multihost_utils

                out.append(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
            continue
        (owner,) = devices  # one device: a plan's per-layer result
        value = None
        if owner.process_index == me:
            value = np.asarray(x)
        for q in range(jax.process_count()):
            if q == owner.process_index:
                continue
            dst = jax.local_devices(process_index=q)[0]
            if me == owner.process_index:
                network.cross([x], [x.aval], owner, dst)
            elif me == q:
                value = np.asarray(network.cross(None, [x.aval], owner, dst)[0])
        out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)


_NETWORK = Network()
