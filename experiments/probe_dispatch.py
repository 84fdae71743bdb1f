"""Probe (not yet run): does a jitted GPU call block its caller?

Written to explain why hetpar's stages cost ~3 ms more than their compute on
two H200s (experiments/results/two_gpus_h200x2.md; a py-spy profile put ~80%
of the worker threads' time inside the stage call). Prints, per case, the time
until the call returns (dispatch) and until its result is ready. Run on the
GPU machine:
  python3 experiments/probe_dispatch.py
"""

import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def heavy(x):
    for _ in range(20):
        x = jnp.tanh(x @ x)
    return x


def timed(call):
    """(seconds until `call()` returns, seconds until its result is ready)."""
    t0 = time.perf_counter()
    y = call()
    t1 = time.perf_counter()
    jax.block_until_ready(y)
    return t1 - t0, time.perf_counter() - t0


def report(name, samples):
    d = statistics.median(s[0] for s in samples)
    t = statistics.median(s[1] for s in samples)
    print(f"{name:46s} dispatch {d * 1e3:8.3f} ms   total {t * 1e3:8.3f} ms", flush=True)


def main():
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    x = jax.device_put(jnp.ones((4096, 4096), jnp.float32), gpu)
    jax.block_until_ready(heavy(x))
    host = np.ones((4096, 4096), np.float32)
    on_cpu = jax.device_put(host, cpu)
    cases = {
        "ready input on the gpu": lambda: heavy(x),
        "input still being computed": lambda: heavy(heavy(x)),
        "input: numpy -> gpu device_put just issued": lambda: heavy(jax.device_put(host, gpu)),
        "input: cpu array -> gpu device_put": lambda: heavy(jax.device_put(on_cpu, gpu)),
    }
    for name, call in cases.items():
        report(name, [timed(call) for _ in range(5)])

    out = []
    worker = threading.Thread(target=lambda: out.append(timed(lambda: heavy(heavy(x)))))
    worker.start()
    worker.join()
    report("two chained calls from a worker thread", out)

    # A stage-like call: one activation and a hundred parameter buffers.
    ws = [jax.device_put(jnp.ones((768, 768)), gpu) for _ in range(100)]
    h = jax.device_put(jnp.ones((1024, 768)), gpu)

    @jax.jit
    def stage(h, *ws):
        for w in ws[:24]:
            h = jnp.tanh(h @ w)
        return h

    jax.block_until_ready(stage(h, *ws))
    report("stage-like call with 101 arguments", [timed(lambda: stage(h, *ws))
                                                  for _ in range(20)])


if __name__ == "__main__":
    main()
