"""Why does a CPU stage run slower inside a plan than alone? (issue 17)

Memory-capped GPT-2 b16 plans put the head on the host CPU; the head took
0.85 s in the cost table and 0.87 s alone, but 0.95-1.28 s as a stage of
the plan (results/plan_memory). This times the same CPU layers alone and
beside what a plan runs at the same time on that host:

- `alone`: nothing else in flight;
- `gpu_busy`: a thread keeps the GPU computing (a chain of large matmuls,
  each waited for), as a pipeline's GPU stage does while the CPU works;
- `transfers`: a thread moves 256 MB between host and GPU, as a plan's
  crossings do;
- `fresh_inputs`: alone, but every run's inputs are new host arrays (a
  stage's inputs arrive freshly allocated, not reused).

Each condition: the lower quartile and median of k runs (each run's
inputs placed first, then the call timed to its results being ready; no
cache), and its ratio to `alone`. Writes DIR/cpu_contention.json (committed
as results/cpu_contention/cpu_contention_<card>.json).

    python experiments/probe_cpu_contention.py --batch 16 --layers lm_head,wte --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import hetpar
from hetpar import zoo


def _background(kind: str, stop: threading.Event, gpu) -> threading.Thread:
    def gpu_busy():
        x = jax.device_put(jnp.ones((8192, 8192), jnp.float32), gpu)
        f = jax.jit(lambda a: (a @ a) * 1e-4)
        while not stop.is_set():
            x = f(x)
            x.block_until_ready()

    def transfers():
        host = np.ones(2**26, np.float32)  # 256 MB
        while not stop.is_set():
            y = jax.device_put(host, gpu)
            y.block_until_ready()
            np.asarray(y)

    t = threading.Thread(target={"gpu_busy": gpu_busy, "transfers": transfers}[kind],
                         daemon=True)
    t.start()
    time.sleep(1.0)  # let it reach its steady state
    return t


def _time(fn, args, device, k: int, fresh: bool) -> list[float]:
    args = jax.device_put(args, device)
    jax.block_until_ready(fn(*args))  # compile
    out = []
    for _ in range(k):
        a = jax.device_put(jax.tree_util.tree_map(lambda x: np.array(x, copy=True), args),
                           device) if fresh else args
        jax.block_until_ready(a)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*a))
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    from hetpar.cost_models import random_inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--small", action="store_true", help="the small GPT-2 (a smoke test)")
    ap.add_argument("--layers", default="lm_head,wte")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    w = zoo.get("transformer", batch=args.batch, small=args.small)
    example = jax.tree_util.tree_map(np.asarray, w.example_args())
    g = hetpar.trace(w.train_step, *example)
    cpu = jax.devices("cpu")[0]
    gpus = [d for d in jax.devices() if d.platform != "cpu"]
    conds = ["alone", "fresh_inputs"] + (["gpu_busy", "transfers"] if gpus else [])
    rows = []
    for layer in args.layers.split(","):
        fn, _ = g.layer_callable(layer)
        fn = jax.jit(fn)
        inputs = random_inputs(g, layer)[1]
        base = None
        for cond in conds:
            stop = threading.Event()
            bg = _background(cond, stop, gpus[0]) if cond in ("gpu_busy", "transfers") else None
            try:
                ts = _time(fn, inputs, cpu, args.k, fresh=cond == "fresh_inputs")
            finally:
                stop.set()
                if bg:
                    bg.join()
            q25, med = float(np.percentile(ts, 25)), float(np.median(ts))
            base = base or q25
            row = dict(layer=layer, condition=cond, q25_s=q25, median_s=med,
                       ratio=q25 / base, samples=ts)
            rows.append(row)
            print(f"{layer:10s} {cond:13s} q25 {q25 * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms"
                  f"  x{q25 / base:.2f}", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(batch=args.batch, small=args.small, cpu_cores=os.cpu_count(),
                gpu=gpus[0].device_kind if gpus else None, jax=jax.__version__)
    (out / "cpu_contention.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
