"""Does a host Adam update slow down on subnormal floats?

The 0.54B Llama-style offload plan's host update stage ran 556-705 ms inside
the step and 209-289 ms timed alone on `np.ones` inputs (fit_h200 run 24,
fit_h200x2 run 35); the pages its inputs sit on do not explain it (run 36).
Alone, its inputs are ones; in the step they are the training's own values,
and the model trains on one batch to a loss near 0.003, where many
gradients are tiny: their squares, and Adam's second moment decaying
towards them, fall below f32's smallest normal number (1.2e-38), and x86
cores take a slow path on subnormal operands unless the program flushes
them to zero. This times one Adam-like update of `--gb` GB per array on
the CPU with normal values, then with a share of the second moment and of
the gradients' squares subnormal:

    JAX_PLATFORMS=cpu python experiments/probe_host_denormals.py --gb 0.75 \
        --out results/denormals.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=0.75, help="GB per array (4 in, 3 out)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    n = int(a.gb * 1e9 / 4)

    @jax.jit
    def update(p, m, v, g):  # Adam's arithmetic, as a host update stage does
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

    def values(share: float, v_small: float, g_small: float) -> list:
        # `share` of the elements subnormal-making, the rest normal.
        k = int(share * n)
        v = np.full(n, 1e-6, np.float32)
        g = np.full(n, 1e-3, np.float32)
        v[:k], g[:k] = v_small, g_small
        return [jnp.asarray(np.ones(n, np.float32)), jnp.asarray(np.full(n, 1e-3, np.float32)),
                jnp.asarray(v), jnp.asarray(g)]

    cases = {"normal": (0.0, 0.0, 0.0),
             "10% subnormal v, tiny g": (0.1, 1e-39, 1e-21),
             "50% subnormal v, tiny g": (0.5, 1e-39, 1e-21),
             "all subnormal v, tiny g": (1.0, 1e-39, 1e-21),
             "all zero v and g": (1.0, 0.0, 0.0)}
    rows = []
    for name, spec in cases.items():
        args = values(*spec)
        jax.block_until_ready(update(*args))  # compile, warm
        times = []
        for _ in range(a.runs):
            t = time.perf_counter()
            jax.block_until_ready(update(*args))
            times.append(time.perf_counter() - t)
        rows.append({"case": name, "median_s": statistics.median(times), "times_s": times})
        print(json.dumps(rows[-1]), flush=True)
        del args
    base = rows[0]["median_s"]
    for r in rows:
        r["over_normal"] = r["median_s"] / base
    result = {"cpus": os.cpu_count(), "gb_per_array": a.gb, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS"), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
