"""How fast does hetpar's transfer engine copy between a GPU and its host, by size? (issue 17)

`profile="measure"` prices every copy over a link at one bandwidth, measured
at one size (`hetpar.runtime.link_bandwidth`, `cost_models._table._copy_size`).
This times the engine's copies GPU <-> CPU device and GPU <-> its pinned host
memory at the sizes plans move (1-256 MB), each size three times: the copy's
median seconds (what a plan's transfer takes, fixed cost included) and
`link_bandwidth`'s slope against a 4 kB copy.

    python experiments/probe_links.py --out DIR     # writes DIR/links.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from hetpar.runtime import TransferEngine, link_bandwidth

MB = 1 << 20
SIZES_MB = (1, 4, 16, 28, 57, 128, 256)


def _copy_s(engine, x, dst, runs: int = 7) -> float:
    """Median seconds of `engine.move(x, dst)` until ready (after one warm-up)."""
    jax.block_until_ready(engine.move(x, dst))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(engine.move(x, dst))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    pinned = SingleDeviceSharding(gpu, memory_kind="pinned_host")
    ways = {"cpu->gpu": (cpu, gpu), "gpu->cpu": (gpu, cpu),
            "gpu->pinned_host": (gpu, pinned), "pinned_host->gpu": (pinned, gpu)}
    engine = TransferEngine()
    rows = []
    for way, (src, dst) in ways.items():
        for mb in SIZES_MB:
            x = jax.device_put(jnp.ones((mb * MB // 4,), jnp.float32), src)
            for r in range(args.repeats):
                t = _copy_s(engine, x, dst)
                slope = None
                if isinstance(src, jax.Device) and isinstance(dst, jax.Device):
                    slope = link_bandwidth(src, dst, mb * MB)
                rows.append({"way": way, "mb": mb, "repeat": r, "copy_s": t,
                             "effective_bytes_per_s": mb * MB / t, "slope_bytes_per_s": slope})
                print(f"{way:18s} {mb:4d} MB  copy {t * 1e3:8.3f} ms  "
                      f"{mb * MB / t / 1e9:7.2f} GB/s  slope "
                      f"{'-' if slope is None else f'{slope / 1e9:.2f} GB/s'}", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "links.json").write_text(json.dumps({
        "device": gpu.device_kind, "jax": jax.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
