"""A CPU update stage's time and page faults per call under this process's
malloc settings (issue 41: the 0.54B offload plan's host update stage ran
2-5x slower in the step than alone, an unnamed thread taking thousands of
page faults meanwhile; experiments/results/fit_h200 runs 38-41).

glibc maps each allocation over 32 MB afresh and unmaps it when freed (and a
thread's own arena cannot hold one over 64 MB), so a jitted CPU function
touches fresh pages for its large outputs and temporaries on every call. Run
it under different `GLIBC_TUNABLES` to compare, e.g.:

    JAX_PLATFORMS=cpu python experiments/probe_host_malloc.py --mb 800
    K=glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=68719476736
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1:$K JAX_PLATFORMS=cpu \\
        python experiments/probe_host_malloc.py --mb 800

Prints one JSON line: the tunables, each call's seconds, minor page faults
and system CPU seconds, and their medians over the calls after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=800.0, help="parameters' size, MB (4 arrays)")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--donate", action="store_true", help="donate parameters and moments")
    a = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    cpu = jax.devices("cpu")[0]
    n = int(a.mb * 2**20 / 4 / 4)
    with jax.default_device(cpu):
        params = {f"w{i}": jnp.full((n,), 0.5, jnp.float32) for i in range(4)}
        grads = jax.tree.map(lambda p: p * 1e-3, params)
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
        state = opt.init(params)

        def update(p, s, g):
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(update, donate_argnums=(0, 1) if a.donate else ())
        params, state = jax.block_until_ready(f(params, state, grads))
        calls = []
        for _ in range(a.calls):
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            params, state = jax.block_until_ready(f(params, state, grads))
            dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            calls.append({"s": round(dt, 4), "faults": r1.ru_minflt - r0.ru_minflt,
                          "sys_s": round(r1.ru_stime - r0.ru_stime, 3)})
    later = calls[1:] or calls
    print(json.dumps({
        "tunables": os.environ.get("GLIBC_TUNABLES"), "mb": a.mb, "donate": a.donate,
        "cores": os.cpu_count(),
        "median_s": statistics.median(c["s"] for c in later),
        "median_faults": statistics.median(c["faults"] for c in later),
        "median_sys_s": statistics.median(c["sys_s"] for c in later),
        "calls": calls, "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))


if __name__ == "__main__":
    main()
