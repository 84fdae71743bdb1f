"""Why do the transfer engine's CPU -> GPU copies run slower than `hetpar profile`'s? (issue 17)

On an H200 host (experiments/results/links/profile_links_h200.md) `hetpar
profile` timed `jax.device_put(x, gpu)` of fresh CPU arrays at 5-8 GB/s, and
the engine's copies of the same sizes at ~1.2 GB/s from 40 MiB. This times
each way of writing the copy, fresh arrays each run and one array again,
CPU device <-> GPU and, with two GPUs, GPU -> GPU.

    python experiments/probe_put_forms.py --out DIR     # DIR/put_forms.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hetpar.runtime import TransferEngine

MIB = 1 << 20


def _maker(dev, n: int):
    make = jax.jit(lambda s: jnp.full((n,), s, jnp.float32),
                   out_shardings=SingleDeviceSharding(dev))
    seed = iter(range(1, 1 << 30))
    return lambda: jax.block_until_ready(make(float(next(seed))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes_mib", default="6,27,57,154")
    args = ap.parse_args(argv)
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    pairs = [(cpu, gpu), (gpu, cpu)]
    if len(jax.devices()) > 1 and gpu.platform != "cpu":
        pairs += [(gpu, jax.devices()[1])]
    engine = TransferEngine()

    def forms(dst):
        sh = SingleDeviceSharding(dst)
        on_device = SingleDeviceSharding(dst, memory_kind="device")
        return {
            "device_put(x, dev)": lambda x: jax.device_put(x, dst),
            "device_put([x], dev)": lambda x: jax.device_put([x], dst)[0],
            "device_put(x, sharding)": lambda x: jax.device_put(x, sh),
            "device_put([x], sharding)": lambda x: jax.device_put([x], sh)[0],
            "device_put(x, sharding 'device')": lambda x: jax.device_put(x, on_device),
            "device_put(np.asarray(x), dev)": lambda x: jax.device_put(np.asarray(x), dst),
            "engine.move": lambda x: engine.move(x, dst),
        }

    rows = []
    for src, dst in pairs:
        for mib in (float(s) for s in args.sizes_mib.split(",")):
            n = int(mib * MIB) // 4
            fresh = _maker(src, n)
            for name, put in forms(dst).items():
                jax.block_until_ready(put(fresh()))  # warm-up
                for reuse in (False, True):
                    x = fresh()
                    times = []
                    for _ in range(args.runs):
                        if not reuse:
                            x = fresh()
                        t0 = time.perf_counter()
                        jax.block_until_ready(put(x))
                        times.append(time.perf_counter() - t0)
                    t = statistics.median(times)
                    row = {"way": f"{src} -> {dst}", "mib": mib,
                           "form": name, "same_array": reuse, "median_s": t,
                           "gb_per_s": 4 * n / t / 1e9}
                    rows.append(row)
                    print(f"{row['way']} {mib:>5} MiB {name:<32} "
                          f"{'same ' if reuse else 'fresh'} {t * 1e3:8.3f} ms "
                          f"{row['gb_per_s']:6.2f} GB/s", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "put_forms.json").write_text(json.dumps(
        {"device": gpu.device_kind, "jax": jax.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
