"""Does a host update run slower on state XLA allocated than on NumPy's arrays?

The 0.54B Llama-style offload plan's host update stage (the Adam update of 9
layers' state on the CPU) ran 556-705 ms inside the step and 209-289 ms when
`bench_fit` timed the same executable alone on inputs made by `np.ones`, with
the gradients brought from the GPU as the step brings them or not
(experiments/results/fit_h200, runs 24 and 35). One difference left: inside
the step the state lives in buffers XLA's CPU client allocated (the update
writes the new state into them, donated), and NumPy advises the kernel to
back its large arrays with huge pages where XLA's allocations get them only
if malloc does (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which older glibc
ignores). This times one Adam-like update on CPU state of `--gb` GB made
either way, donated, and reports the host's glibc, its transparent huge page
setting and how much anonymous memory huge pages back after each:

    python experiments/probe_host_pages.py --gb 1.5 --out results/host_pages.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time


def _meminfo_huge_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.5, help="GB per array (4 arrays in, 3 out)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = jax.devices("cpu")[0]
    n = int(a.gb * 1e9 / 4)

    @jax.jit
    def made_by_xla():
        return tuple(jnp.full((n,), v, jnp.float32) for v in (1.0, 0.1, 0.01, 0.5))

    def update(p, m, v, g):  # Adam's arithmetic, as a host update stage does
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

    step = jax.jit(update, donate_argnums=(0, 1, 2))

    def inputs(how: str):
        if how == "numpy":
            return [jax.device_put(np.full((n,), v, np.float32), cpu)
                    for v in (1.0, 0.1, 0.01, 0.5)]
        with jax.default_device(cpu):
            return list(made_by_xla())

    rows = []
    for how in ("numpy", "xla", "numpy", "xla"):
        times, state = [], None
        for r in range(a.runs + 1):
            if state is None:
                state = inputs(how)
                jax.block_until_ready(state)
            t = time.perf_counter()
            p_, m_, v_ = step(*state)
            jax.block_until_ready((p_, m_, v_))
            if r:  # the first compiles
                times.append(time.perf_counter() - t)
            # the new state goes round again, as a step's donated state does
            state = [p_, m_, v_, state[3]]
        rows.append({"inputs": how, "median_s": statistics.median(times), "times_s": times,
                     "anon_huge_pages_gb": _meminfo_huge_gb()})
        print(json.dumps(rows[-1]), flush=True)
        del state, p_, m_, v_
    result = {"host": {"glibc": platform.libc_ver(), "cpus": os.cpu_count(),
                       "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
                       "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
                       "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag")},
              "gb_per_array": a.gb, "jax": jax.__version__, "rows": rows}
    print(json.dumps(result["host"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
