"""Do GPUs streaming state from their pinned host memory at once share the host's bandwidth?

Issue 41's two-GPU cell at 45 GB a GPU (run 33, fit_h200x2) planned a layer
split with each GPU streaming 14 layers' state from its own pinned host
memory; it ran 1.30x its prediction, where the one-GPU offload plan of the
same model ran 1.00x. The calibration times each GPU's host link alone. This
times the copies a streaming plan makes (host -> GPU, GPU -> host, both at
once) on one GPU, then on every GPU at once, with the same `jax.device_put`
between memory kinds that hetpar's transfer engine uses:

    python experiments/probe_host_links.py --gb 2 --out results/host_links.json

Each figure is the median of `--runs` timings of moving `--gb` GB per GPU
per direction; `concurrent_ratio` is one GPU's bandwidth over the per-GPU
bandwidth when all move at once (1.0: they do not share).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    gpus = jax.devices("gpu")
    n = int(a.gb * 1e9 / 4)

    def on(dev, kind):
        return SingleDeviceSharding(dev, memory_kind=kind)

    host = [jax.device_put(jnp.ones((n,), jnp.float32), on(g, "pinned_host")) for g in gpus]
    dev = [jax.device_put(jnp.ones((n,), jnp.float32), on(g, "device")) for g in gpus]
    jax.block_until_ready((host, dev))

    def copies(which: list[int], way: str) -> list:
        out = []
        for i in which:
            if way in ("in", "both"):
                out.append(jax.device_put(host[i], on(gpus[i], "device")))
            if way in ("out", "both"):
                out.append(jax.device_put(dev[i], on(gpus[i], "pinned_host")))
        return out

    def timed(which: list[int], way: str) -> float:
        jax.block_until_ready(copies(which, way))  # warm
        times = []
        for _ in range(a.runs):
            t = time.perf_counter()
            jax.block_until_ready(copies(which, way))
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    rows = []
    for way in ("in", "out", "both"):
        per_copy = a.gb * 1e9 * (2 if way == "both" else 1)
        one = timed([0], way)
        row = {"way": way, "gb_per_gpu": a.gb, "one_gpu_s": one,
               "one_gpu_gb_per_s": per_copy / one / 1e9}
        if len(gpus) > 1:
            every = timed(list(range(len(gpus))), way)
            row.update({"gpus": len(gpus), "all_gpus_s": every,
                        "per_gpu_gb_per_s": per_copy / every / 1e9,
                        "concurrent_ratio": every / one})
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"card": gpus[0].device_kind, "gpus": len(gpus), "jax": jax.__version__,
              "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
