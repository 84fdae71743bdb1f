"""Probe: hetpar's one-device plan against jax.jit, interleaved step by step.

bench_baselines (run 3, H200) measured hetpar's all-GPU plans 1-50% slower
than jax.jit when the two were timed minutes apart; bench_runtime (session 1),
interleaving single steps, measured ~1.02. This interleaves, with the batch
on the host (as in bench_baselines) and on the GPU. Usage:
  python experiments/probe_overhead.py
"""

import statistics
import time

import jax

import hetpar
from hetpar import zoo


def one(fn, state, batch):
    t0 = time.perf_counter()
    *state, loss = fn(*state, batch)
    jax.block_until_ready(loss)
    return time.perf_counter() - t0, tuple(state)


def main():
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    for name in ("mlp", "transformer", "resnet18", "alexnet"):
        w = zoo.get(name)
        args = w.example_args()
        jitted = jax.jit(w.train_step)
        auto = hetpar.auto(w.train_step, devices=["gpu:0"])
        for where, batch in (("host", jax.device_put(args[2], cpu)),
                             ("gpu", jax.device_put(args[2], gpu))):
            def jit_step(*a, jitted=jitted):
                return jitted(*a[:-1], jax.device_put(a[-1], gpu))
            s_j = s_a = jax.device_put(tuple(args[:2]), gpu)
            tj, ta = [], []
            for i in range(43):
                t, s_j = one(jit_step, s_j, batch)
                u, s_a = one(auto, s_a, batch)
                if i >= 3:
                    tj.append(t)
                    ta.append(u)
            j, a = statistics.median(tj), statistics.median(ta)
            print(f"{name:12s} batch on {where:4s}: jax.jit {j * 1e3:7.2f} ms  hetpar "
                  f"{a * 1e3:7.2f} ms  ratio {a / j:.3f}", flush=True)


if __name__ == "__main__":
    main()
