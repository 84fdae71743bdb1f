"""Runtime benchmarks (issue: lowering and pipelined execution), measured side by side.

1. Overhead: a one-device hetpar plan against plain `jax.jit` on the same
   device, for resnet18 and transformer (goal: step-time ratio <= 1.03).
2. Overlap: a two-device CPU + GPU plan of cnn_preprocess (augmentation on the
   CPU, the CNN on the GPU), pipelined over microbatches: steady-state step
   time against the busier device's busy time (goal: <= 1.1x).
3. Transfers: GB/s of the transfer engine's path against plain
   `jax.device_put`, beside the best path `hetpar profile` measured and the
   PCIe Gen5 x16 peak (63 GB/s each way).

Every figure is a median over repeated steps after warm-up; the report names
the devices. Usage (on the GPU machine):
  python experiments/bench_runtime.py --out $OUT/runtime
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from _timing import median_step, write_results
from absl import app, flags

import hetpar
from hetpar import zoo
from hetpar.runtime import TransferEngine

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "experiments/results/runtime", "output path prefix (.md, .json)")
flags.DEFINE_integer("steps", 100, "timed steps per measurement")
flags.DEFINE_bool("quick", False, "small configs and few steps (a smoke test on CPU)")


def _accelerator() -> str:
    """The first accelerator; on a CPU-only smoke run, a second CPU device stands in."""
    accs = [d for d in jax.devices() if d.platform != "cpu"]
    if accs:
        return f"{accs[0].platform}:{accs[0].id}"
    return "cpu:1" if len(jax.devices("cpu")) > 1 else "cpu:0"


def overhead(name: str, steps: int, small: bool) -> dict:
    """hetpar one-device plan vs jax.jit, interleaved in blocks to share drift."""
    dev_name = _accelerator()
    dev = hetpar.cost_models.present_devices()[dev_name]
    w = zoo.get(name, small=small)
    variables, opt_state, batch = jax.device_put(w.example_args(), dev)
    auto = hetpar.auto(w.train_step, devices=[dev_name])
    jitted = jax.jit(w.train_step)
    s_auto, s_jit = (variables, opt_state), (variables, opt_state)
    for _ in range(3):  # warm-up and compile
        _, s_auto = median_step(auto, s_auto, batch, 1)
        _, s_jit = median_step(jitted, s_jit, batch, 1)
    # Alternate single steps so both see the same drift of the host.
    t_auto, t_jit = [], []
    for _ in range(steps):
        t, s_auto = median_step(auto, s_auto, batch, 1)
        t_auto.append(t)
        t, s_jit = median_step(jitted, s_jit, batch, 1)
        t_jit.append(t)
    a, j = statistics.median(t_auto), statistics.median(t_jit)
    return {"model": name, "device": str(dev.device_kind), "batch": w.config["batch_size"],
            "hetpar_s": a, "jit_s": j, "ratio": a / j}


def overlap(steps: int, small: bool, microbatches: int = 4) -> dict:
    """cnn_preprocess with its augmentation on the CPU and its CNN on the accelerator."""
    acc = _accelerator()
    w = zoo.get("cnn_preprocess", small=small, batch=8 if small else 64)
    args = w.example_args()
    # Input data arrives on the host, as from a data loader.
    args = (*args[:2], jax.device_put(args[2], jax.devices("cpu")[0]))
    layers = hetpar.trace(w.train_step, *args).layers
    augment = {"random_rotation", "random_zoom", "rescaling"}
    plan = {n: ("cpu:0" if n in augment else acc) for n in layers}
    out = {"model": "cnn_preprocess", "batch": w.config["batch_size"], "plan": plan}
    for m in (1, microbatches):
        step = hetpar.auto(w.train_step, plan=plan, microbatches=m, schedule="gpipe")
        compiled = step.lower(*args)
        state = args[:2]
        for _ in range(3):
            _, state = median_step(step, state, args[2], 1)
        t, state = median_step(step, state, args[2], steps)
        # The caller that does not block on each step's loss: CPU stages of step
        # k+1 that need no parameters (augmentation) run while the GPU finishes k.
        t0 = time.perf_counter()
        for _ in range(steps):
            *state, loss = step(*state, args[2])
        jax.block_until_ready((state, loss))
        t_async = (time.perf_counter() - t0) / steps
        # Busy time per device: each stage timed alone (blocking after each).
        ex = compiled._executor
        ex.record_events = True
        busy = {}
        for _ in range(5):
            step(*state, args[2])
            per = {}
            for ev in ex.last_events:
                per[ev.device] = per.get(ev.device, 0.0) + (ev.end_s - ev.start_s)
            for d, b in per.items():
                busy.setdefault(d, []).append(b)
        ex.record_events = False
        busy = {d: statistics.median(v) for d, v in busy.items()}
        out.setdefault("runs", {})[m] = {"step_s": t, "busy_s": busy,
                                         "ratio_to_busiest": t / max(busy.values()),
                                         "step_s_nonblocking": t_async,
                                         "ratio_nonblocking": t_async / max(busy.values())}
    return out


def transfers(sizes=(1 << 20, 16 << 20, 256 << 20)) -> list[dict]:
    accs = [d for d in jax.devices() if d.platform != "cpu"]
    if not accs:
        return []
    gpu, cpu = accs[0], jax.devices("cpu")[0]
    engine = TransferEngine()
    rows = []
    for src, dst in ((gpu, cpu), (cpu, gpu)):
        for n in sizes:
            for path in ("device_put", "engine"):
                times = []
                for k in range(7):
                    x = jax.device_put(np.full(n // 4, k, np.float32), src)  # fresh each time
                    jax.block_until_ready(x)
                    t0 = time.perf_counter()
                    y = jax.device_put(x, dst) if path == "device_put" else engine.move(x, dst)
                    jax.block_until_ready(y)
                    times.append(time.perf_counter() - t0)
                    assert float(np.asarray(y)[-1]) == k
                rows.append({"src": src.platform, "dst": dst.platform, "bytes": n, "path": path,
                             "engine_path": engine.path(src, dst),
                             "gb_per_s": n / statistics.median(times) / 1e9})
    return rows


def to_markdown(res: dict) -> str:
    lines = [f"# Runtime benchmarks ({res['host']})", "",
             f"jax {res['jax']}; devices: {res['devices']}. Medians after warm-up.", "",
             "## Overhead: one-device hetpar plan vs plain jax.jit (goal <= 1.03)", "",
             "| model | device | batch | hetpar | jax.jit | ratio |", "|---|---|---|---|---|---|"]
    for r in res["overhead"]:
        if "error" in r:
            lines.append(f"| failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['device']} | {r['batch']} | {r['hetpar_s']*1e3:.2f} ms"
                     f" | {r['jit_s']*1e3:.2f} ms | {r['ratio']:.3f} |")
    o = res["overlap"]
    if "error" in o:
        o = {"batch": "?", "runs": {}, "error": o["error"]}
    lines += ["", "## Overlap: cnn_preprocess, augmentation on cpu:0, CNN on the accelerator "
              "(goal: step <= 1.1x busier device)", "",
              f"batch {o['batch']}", "",
              "| microbatches | step (caller blocks each step) | busy per device | step / busiest "
              "| step (caller does not block) | step / busiest |", "|---|---|---|---|---|---|"]
    for m, r in o["runs"].items():
        busy = ", ".join(f"{d} {b*1e3:.2f} ms" for d, b in r["busy_s"].items())
        lines.append(f"| {m} | {r['step_s']*1e3:.2f} ms | {busy} | "
                     f"{r['ratio_to_busiest']:.3f} | {r['step_s_nonblocking']*1e3:.2f} ms | "
                     f"{r['ratio_nonblocking']:.3f} |")
    if isinstance(res["transfers"], list) and res["transfers"]:
        lines += ["", "## Transfers (fresh buffers, value checked; PCIe Gen5 x16 peak 63 GB/s)", "",
                  "| direction | size | jax.device_put | transfer engine (path) |",
                  "|---|---|---|---|"]
        by = {}
        for r in res["transfers"]:
            by.setdefault((r["src"], r["dst"], r["bytes"]), {})[r["path"]] = r
        for (s, d, n), r in by.items():
            lines.append(f"| {s}->{d} | {n >> 20} MB | {r['device_put']['gb_per_s']:.2f} GB/s | "
                         f"{r['engine']['gb_per_s']:.2f} GB/s ({r['engine']['engine_path']}) |")
    return "\n".join(lines) + "\n"


def _guard(fn, *args):
    """Runs one benchmark; a failure is reported in the results instead of ending the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the report says what failed
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv):
    del argv
    small = FLAGS.quick
    steps = 5 if FLAGS.quick else FLAGS.steps
    devs = hetpar.cost_models.present_devices()
    res = {
        "host": ", ".join(sorted({d.device_kind for d in devs.values()})),
        "jax": jax.__version__,
        "devices": sorted(devs),
        "overhead": [_guard(overhead, n, steps, small) for n in ("resnet18", "transformer")],
        "overlap": _guard(overlap, steps, small),
        "transfers": _guard(transfers, (1 << 20,) if small else (1 << 20, 16 << 20, 256 << 20)),
    }
    write_results(FLAGS.out, to_markdown(res), res)


if __name__ == "__main__":
    app.run(main)
