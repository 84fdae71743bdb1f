"""GPU -> GPU copy speed at the sizes a pipeline moves (activations of 10-500 MB).

`hetpar profile` fitted the peer link on buffers of 4 kB-16 MB (0.3 ms, 46-61
GB/s on two H200s). VGG16's cut moves ~400 MB a step and measured far faster
than that fit predicts. Fresh buffers each time, median of 7, both directions.
Usage: python experiments/probe_peer.py > $OUT/probe_peer.txt
"""

import time

import jax
import jax.numpy as jnp
import numpy as np


def main():
    a, b = jax.devices("gpu")[:2]
    print(f"# {a.device_kind} x2, jax {jax.__version__}: jax.device_put gpu->gpu, fresh buffers")
    print("direction | MB | median ms | GB/s")
    for src, dst in ((a, b), (b, a)):
        for mb in (1, 16, 64, 256, 512):
            n = mb * 2**20 // 4
            times = []
            for i in range(9):
                x = jax.device_put(jnp.full((n,), float(i), jnp.float32), src)
                x.block_until_ready()
                t0 = time.perf_counter()
                y = jax.device_put(x, dst)
                y.block_until_ready()
                times.append(time.perf_counter() - t0)
            t = float(np.median(times[2:]))
            print(f"gpu:{src.id}->gpu:{dst.id} | {mb} | {t * 1e3:.3f} | {mb * 2**20 / t / 1e9:.1f}")


if __name__ == "__main__":
    main()
