"""The hand-written baseline for several GPUs: `jax.jit` with shardings only.

FSDP as MaxText writes it: every parameter and optimizer-state leaf split on
its largest axis the device count divides, the batch split on axis 0, and
GSPMD inserting the all-gathers and reduce-scatters. With `sharded=False`,
the state is replicated (data parallel). Shared by bench_sharded.py and
bench_fit.py (`--gpus 2 --modes jit`)."""

from __future__ import annotations


def hand_sharded_jit(step, args, devs, sharded: bool = True, donate_argnums=(0, 1),
                     split_argnums=None):
    """(the jitted step, `args` placed on `devs` as it expects them).
    `split_argnums`: which state arguments are split when `sharded` (default
    all of them; `(1,)` splits the optimizer state only: ZeRO-1)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh, n = Mesh(np.array(devs), ("fsdp",)), len(devs)

    def state(x):
        axes = [a for a, s in enumerate(x.shape) if s % n == 0] if sharded else []
        if not axes:
            return NamedSharding(mesh, PartitionSpec())
        a = max(axes, key=lambda a: (x.shape[a], -a))
        return NamedSharding(mesh, PartitionSpec(*[None] * a, "fsdp"))

    def batch(x):
        return NamedSharding(mesh, PartitionSpec("fsdp" if x.ndim else None))

    def whole(x):
        return NamedSharding(mesh, PartitionSpec())

    split = range(len(args) - 1) if split_argnums is None else split_argnums
    layout = (*(jax.tree.map(state if k in split else whole, a) for k, a in enumerate(args[:-1])),
              jax.tree.map(batch, args[-1]))
    out = jax.eval_shape(step, *args)
    out_layout = (*layout[:len(out) - 1], NamedSharding(mesh, PartitionSpec()))
    placed = jax.device_put(args, layout)
    return jax.jit(step, in_shardings=layout, out_shardings=out_layout,
                   donate_argnums=donate_argnums), placed


def hetpar_fsdp(train_step, host_args, devs):
    """`hetpar.auto(train_step, data_parallel="fsdp")` over `devs` as the
    probes run it: `host_args` (state built on the host, consumed) placed,
    the first call run. Returns (the step, its compiled plan, the jit its
    call ends in, (params, opt_state, batch) after that call)."""
    import hetpar

    names = [f"{d.platform}:{d.id}" if d.platform == "cpu" else f"gpu:{d.id}" for d in devs]
    auto = hetpar.auto(train_step, devices=names, data_parallel="fsdp", donate_argnums=(0, 1))
    p, o, b = auto.place(*host_args)
    p, o, loss = auto(p, o, b)
    float(loss)
    step = auto._direct or auto._last
    return auto, step, step._replicated._jit, (p, o, b)
