"""Does an accelerator pay to wake after idling? (issue 17)

The memory-capped GPT-2 plans of results/plan_memory leave the GPU idle for
~0.75 s while the host CPU computes the head, and the GPU's first backward
stage after it started 53-112 ms late in every watched step (H100 and H200).
This times one small jitted program (a block's worth of matmuls, ~0.5 ms)
right after the previous call, and after the device sat idle for a while.

    python experiments/probe_gpu_idle.py --out FILE [--device gpu:0]

Writes {idle_s: [seconds of each call, to its result being ready]}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

from hetpar.core import ProfileError
from hetpar.cost_models import resolve_device


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="gpu:0")
    ap.add_argument("--idles", default="0,0.01,0.05,0.2,0.75,2")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)
    try:  # a bad name: one line naming the present devices
        dev = resolve_device(args.device)
    except ProfileError as e:
        ap.error(str(e))
    x = jax.device_put(jnp.ones((16 * 128, 768), jnp.float32), dev)
    w1 = jax.device_put(jnp.ones((768, 3072), jnp.float32) * 1e-3, dev)
    w2 = jax.device_put(jnp.ones((3072, 768), jnp.float32) * 1e-3, dev)

    @jax.jit
    def block(x, w1, w2):
        for _ in range(4):
            x = jnp.tanh(x @ w1) @ w2
        return x

    for _ in range(5):
        block(x, w1, w2).block_until_ready()
    rows: dict[str, list[float]] = {}
    for idle in [float(s) for s in args.idles.split(",")]:
        times = []
        for _ in range(args.runs):
            block(x, w1, w2).block_until_ready()
            time.sleep(idle)
            t0 = time.perf_counter()
            block(x, w1, w2).block_until_ready()
            times.append(time.perf_counter() - t0)
        rows[f"{idle:g}"] = times
        print(f"idle {idle:g} s: median {statistics.median(times) * 1e3:.3f} ms, "
              f"max {max(times) * 1e3:.3f} ms", flush=True)
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": dev.device_kind, "seconds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
