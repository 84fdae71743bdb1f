"""Do state copies in and out of pinned host memory overlap? (issue 15)

hetpar's offload runtime streams each layer's optimizer state in from the
GPU's pinned host memory before its update and the new state back out after.
On the 5B model a layer's 1.6 GB took about 55 ms each way-and-back, the sum
of the two directions, while 1 GB copies each way at once ran 92.9 GB/s
together. This probe times 24 "layers" (state in, an update, state out) under
different ways of issuing the copies, so the runtime can keep the fastest:

  put_put      device_put in, jitted update, device_put out (hetpar's way);
               at most `prefetch` layers in flight
  ahead        the same, but the next layer's copy in is issued before this
               layer's copy out (the copy-in never queues behind a copy-out
               that waits for compute)
  jit_out      device_put in; the update's result written to pinned host
               by the executable itself (out_shardings with memory kind)
  ahead_out    ahead and jit_out together
  jit_both     the executable reads its state from pinned host and writes
               it there (in and out shardings with memory kinds)
  bound        copies only, each way at once: the PCIe bound

    python experiments/probe_offload_streams.py --gb 1.6 --layers 24
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

WAYS = ("put_put", "ahead", "jit_out", "ahead_out", "jit_both", "bound")


def main(argv=None):
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.6, help="state per layer")
    p.add_argument("--arrays", type=int, default=8, help="arrays per layer's state")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--distinct", type=int, default=4, help="distinct host layers (reused)")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dim", type=int, default=4096, help="the update's matmul size")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        dev = jax.devices("cpu")[0]
    on_dev = SingleDeviceSharding(dev)
    on_host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    n = int(args.gb * 1e9 / 4 / args.arrays)
    layers = [[jax.device_put(jnp.full((n,), float(i + j), jnp.float32), on_host)
               for j in range(args.arrays)] for i in range(args.distinct)]
    grad = jax.device_put(jnp.ones((n,), jnp.float32), on_dev)
    w = jax.device_put(jnp.ones((args.dim, args.dim), jnp.float32), on_dev)
    jax.block_until_ready((layers, grad, w))

    def update(state, g, w):
        # Adam-like elementwise work plus a few matmuls (~ a block's backward).
        y = w
        for _ in range(8):
            y = jnp.tanh(y @ w)
        return [s * 0.9 + g * 0.1 + y[0, 0] * 1e-9 for s in state]

    f_dev = jax.jit(update)
    f_out = jax.jit(update, out_shardings=on_host)
    def update_from_host(state, g, w):
        return update([jax.device_put(s, on_dev) for s in state], g, w)

    f_both = jax.jit(update_from_host, in_shardings=([on_host] * args.arrays, on_dev, on_dev),
                     out_shardings=on_host)
    resident = jax.device_put(layers[0], on_dev)

    def run(way):
        inflight = collections.deque()
        pending_in = {}

        def copy_in(k):
            if k < args.layers and k not in pending_in:
                pending_in[k] = jax.device_put(layers[k % args.distinct], on_dev)

        for k in range(args.layers):
            if len(inflight) >= args.prefetch:
                jax.block_until_ready(inflight.popleft())
            if way == "bound":
                a = jax.device_put(layers[k % args.distinct], on_dev)
                out = jax.device_put(resident, on_host)
                inflight.append([a, out])
                continue
            if way == "jit_both":
                out = f_both(layers[k % args.distinct], grad, w)
            else:
                copy_in(k)
                state = pending_in.pop(k)
                if way in ("ahead", "ahead_out"):
                    copy_in(k + 1)
                if way in ("jit_out", "ahead_out"):
                    out = f_out(state, grad, w)
                else:
                    out = jax.device_put(f_dev(state, grad, w), on_host)
            inflight.append(out)
        jax.block_until_ready(list(inflight))

    def compute_only():
        state = jax.device_put(layers[0], on_dev)
        jax.block_until_ready(state)
        t = time.perf_counter()
        for _ in range(args.layers):
            out = f_dev(state, grad, w)
        jax.block_until_ready(out)
        return time.perf_counter() - t

    rows = {"device": dev.device_kind, "gb_per_layer": n * 4 * args.arrays / 1e9,
            "layers": args.layers, "prefetch": args.prefetch}
    compute_only()
    rows["compute_only_s"] = statistics.median(compute_only() for _ in range(args.reps))
    for way in WAYS:
        try:
            run(way)
            ts = []
            for _ in range(args.reps):
                t = time.perf_counter()
                run(way)
                ts.append(time.perf_counter() - t)
            rows[way + "_s"] = statistics.median(ts)
        except Exception as e:  # noqa: BLE001 - report and go on
            rows[way + "_s"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"  {way}: {rows[way + '_s']}", file=sys.stderr, flush=True)
    gb = rows["gb_per_layer"] * args.layers
    for way in WAYS:
        t = rows[way + "_s"]
        if isinstance(t, float):
            rows[way + "_gbps_each_way"] = gb / t
    print(json.dumps(rows, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
