"""What the collectives of sharded state cost, alone and inside a step (issue 43).

Two parts, on every GPU of the machine:

1. Alone: all-gather, reduce-scatter and all-reduce of 64 MB - 1 GB arrays
   over the GPUs (`shard_map`, median of 10): the bandwidth the planner's
   collectives should be priced at, beside the device_put link.
2. Inside a step: one Llama-style model (d_model 4096, hidden 11008, as the
   6.74B, with fewer blocks) under hand-written `jax.jit` shardings: FSDP,
   ZeRO-1 (optimizer state split), data parallel, and one GPU; each with
   XLA's defaults, with the latency-hiding scheduler on, and with async
   collectives off (every collective exposed). The gap between "no async"
   and the default is what XLA hides behind compute.

    python experiments/probe_collectives.py --out experiments/results/collectives_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NO_ASYNC = "--xla_gpu_disable_async_collectives=allreduce,allgather,reducescatter"
LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
VARIANTS = {  # name -> (state split, XLA flags)
    "fsdp": ("fsdp", ""), "fsdp_lhs": ("fsdp", LHS), "fsdp_no_async": ("fsdp", NO_ASYNC),
    "zero1": ("zero1", ""), "zero1_no_async": ("zero1", NO_ASYNC),
    "dp": ("dp", ""), "dp_no_async": ("dp", NO_ASYNC), "one_gpu": ("one", ""),
}


def alone(sizes_mb) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = jax.devices()
    n = len(devs)
    mesh = Mesh(np.array(devs), ("d",))
    from jax import shard_map

    ops = {
        "all_gather": lambda x: jax.lax.all_gather(x, "d", tiled=True),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, "d", tiled=True),
        "all_reduce": lambda x: jax.lax.psum(x, "d"),
    }
    rows = []
    for name, op in ops.items():
        out_spec = P() if name == "all_gather" else P("d")
        f = jax.jit(shard_map(op, mesh=mesh, in_specs=P("d"), out_specs=out_spec,
                              check_vma=False))
        for mb in sizes_mb:
            # the whole (gathered, or pre-reduction per member) array: mb MB
            whole = mb * 2**20 // 4
            shape = (whole,) if name == "all_gather" else (whole * n,)
            x = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P("d")))
            f(x).block_until_ready()
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                f(x).block_until_ready()
                ts.append(time.perf_counter() - t)
            t = statistics.median(ts)
            rows.append({"op": name, "gpus": n, "mb": mb, "median_ms": t * 1e3,
                         "gb_per_s": mb * 2**20 / t / 1e9})
            print(rows[-1], flush=True)
    return rows


def step_variant(name: str, layers: int, batch: int) -> dict:
    import jax
    import llama_style
    from _fsdp import hand_sharded_jit

    split, _ = VARIANTS[name]
    cfg = (llama_style.Config(vocab=256, d_model=64, num_layers=layers, num_heads=4, hidden=128)
           if os.environ.get("PROBE_TINY") else
           llama_style.Config(d_model=4096, num_layers=layers, num_heads=32, hidden=11008))
    step, init = llama_style.make(cfg, batch=batch, seq=16 if os.environ.get("PROBE_TINY") else 512)
    with jax.default_device(jax.devices("cpu")[0]):
        args = init(jax.random.key(0))
        jax.block_until_ready(args)
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # a smoke run on virtual CPU devices
        gpus = jax.devices("cpu")
    if split == "one":
        gpus = gpus[:1]
        fn = jax.jit(step, donate_argnums=(0, 1))
        args = jax.device_put(args, gpus[0])
    else:
        fn, args = hand_sharded_jit(step, args, gpus, sharded=split != "dp",
                                    split_argnums=(1,) if split == "zero1" else None)
    t0 = time.perf_counter()
    p, o, loss = fn(*args)
    float(loss)
    first = time.perf_counter() - t0
    batch_ = args[-1]
    del args
    ts = []
    for _ in range(8):
        t = time.perf_counter()
        p, o, loss = fn(p, o, batch_)
        float(loss)
        ts.append(time.perf_counter() - t)
    return {"variant": name, "flags": VARIANTS[name][1], "gpus": len(gpus), "layers": layers,
            "params": llama_style.parameter_count(cfg), "batch": batch,
            "median_ms": statistics.median(ts[1:]) * 1e3, "first_s": first,
            "peak_gb": [(g.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9 for g in gpus]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", default="64,256,1024")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    p.add_argument("--only", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.only == "alone":
        import jax

        print("ROW " + json.dumps({"card": jax.devices()[0].device_kind, "rows": alone(
            [int(s) for s in args.sizes_mb.split(",")])}), flush=True)
        return
    if args.only:
        print("ROW " + json.dumps(step_variant(args.only, args.layers, args.batch)), flush=True)
        return
    # Every part in a process of its own: this one never touches the GPUs (a
    # process holding them leaves the next none of their memory: run 29's
    # steps all failed to start NCCL).
    out = {"steps": []}
    for v in ["alone", *args.variants.split(",")]:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + VARIANTS.get(v, ("", ""))[1]).strip()
        cmd = [sys.executable, __file__, "--only", v, "--layers", str(args.layers),
               "--batch", str(args.batch), "--sizes-mb", args.sizes_mb]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
            rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
            row = json.loads(rows[-1][4:]) if rows else {"variant": v,
                                                         "error": proc.stderr[-600:]}
        except subprocess.TimeoutExpired:
            row = {"variant": v, "error": "timed out"}
        print(row, flush=True)
        if v == "alone":
            out.update(alone=row.get("rows", row), card=row.get("card"))
        else:
            out["steps"].append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
