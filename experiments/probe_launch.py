"""Probe: how much of a one-GPU step is a fixed, batch-independent cost.

On the 2x H200 the transformer's step fits t(b) = 15.5 ms + 0.60 ms x b: every
microbatch of a pipeline pays the 15.5 ms again, which caps two-stage pipelines
far below 2x (issue 7). Counting FLOPs, the fixed part is not arithmetic (the
AdamW update moves ~3.5 GB: ~1 ms); the lead is kernel launches. This times the
step at several batches under the XLA flags given in $XLA_FLAGS (run it once per
setting, e.g. with CUDA-graph command buffers on and off), fits fixed + per
sample, and counts the kernels of the compiled step (top-level instructions of
the optimised HLO's entry computation that launch work). Usage:
  XLA_FLAGS=... python experiments/probe_launch.py --model transformer
"""

import json
import os
import re
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from hetpar import zoo

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "transformer", "zoo model")
flags.DEFINE_list("batches", ["8", "32", "128", "256"], "batch sizes")
flags.DEFINE_integer("steps", 15, "timed steps per batch")
flags.DEFINE_string("out", None, "append a JSON line here")

# Entry-computation instructions that are bookkeeping, not launches.
_FREE = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start",
         "copy-done")


def kernels(hlo: str) -> dict:
    """Counts launch-like instructions of the optimised module's ENTRY computation."""
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    counts: dict = {}
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+(?:\[[^\]]*\])?(?:\{[^}]*\})?\s+([a-z\-]+)\(", line)
        if not m and "= (" in line:  # tuple-shaped results
            m = re.search(r"\)\s+([a-z\-]+)\(", line)
        if m and m.group(1) not in _FREE:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def main(argv):
    del argv
    gpu = jax.devices("gpu")[0]
    rows = []
    for b in (int(x) for x in FLAGS.batches):
        w = zoo.get(FLAGS.model, batch=b)
        args = jax.device_put(w.example_args(), gpu)
        step = jax.jit(w.train_step)
        compiled = step.lower(*args).compile()
        count = kernels(compiled.as_text())
        state, batch = args[:-1], args[-1]
        times = []
        for i in range(FLAGS.steps + 3):
            t0 = time.perf_counter()
            *state, loss = compiled(*state, batch)
            jax.block_until_ready(loss)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        rows.append({"batch": b, "step_s": statistics.median(times),
                     "kernels": sum(count.values()), "by_kind": count})
        print(f"batch {b}: {rows[-1]['step_s'] * 1e3:.2f} ms, {rows[-1]['kernels']} launches "
              f"{dict(sorted(count.items(), key=lambda kv: -kv[1])[:6])}", flush=True)
    bs = np.array([r["batch"] for r in rows], float)
    ts = np.array([r["step_s"] for r in rows])
    per_sample, fixed = np.polyfit(bs, ts, 1)
    res = {"model": FLAGS.model, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "device": gpu.device_kind, "fixed_s": fixed, "per_sample_s": per_sample, "rows": rows}
    print(f"fit: t(b) = {fixed * 1e3:.2f} ms + {per_sample * 1e3:.3f} ms x b   "
          f"[XLA_FLAGS={res['xla_flags'] or '(default)'}]", flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    app.run(main)
