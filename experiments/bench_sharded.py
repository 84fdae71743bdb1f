"""Sharded state against its hand-written baselines (issue 43), one run per machine.

For one model on N GPUs, each variant in a process of its own (so its peak
memory is its own, and an out-of-memory ends only it):

* `jit_fsdp`: `jax.jit` with every parameter and optimizer-state leaf sharded
  on its largest axis N divides and the batch split (FSDP as MaxText writes
  it: shardings only, GSPMD inserts the collectives);
* `jit_dp`: `jax.jit` data parallel, state replicated (where it fits);
* `hetpar_replicated`: `hetpar.auto(step, data_parallel="replicated")`, the
  planner as it was before sharded state;
* `hetpar_auto`: `hetpar.auto(step)`, the planner's own choice.

Reported per variant: median step time, tokens/s, model TFLOP/s per GPU
(6 x parameters x tokens per step / step time / N), peak memory per GPU
(`memory_stats()["peak_bytes_in_use"]`), and for hetpar its plan and
predicted step. `--lhs` turns XLA's latency-hiding scheduler on
(`--xla_gpu_enable_latency_hiding_scheduler=true`) to measure what
overlapping the collectives gives.

    python experiments/bench_sharded.py --model llama7b --batch 4 --gpus 2
    python experiments/bench_sharded.py --quick   # virtual CPU devices (CPUs form no
                                                  # group: hetpar places layers there)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from absl import app, flags

flags.DEFINE_string("model", "llama7b", "llama7b, llama13b, llama_small, or zoo:NAME")
flags.DEFINE_integer("batch", 4, "global batch (sequences)")
flags.DEFINE_integer("seq", 512, "tokens per sequence (llama models)")
flags.DEFINE_integer("gpus", 2, "devices in the group")
flags.DEFINE_integer("steps", 10, "timed steps per variant (after 2 untimed)")
flags.DEFINE_list("variants", ["jit_fsdp", "jit_dp", "hetpar_replicated", "hetpar_auto"],
                  "which variants to run")
flags.DEFINE_bool("lhs", False, "XLA's latency-hiding scheduler on (GPU)")
flags.DEFINE_bool("quick", False, "a tiny model on 4 virtual CPU devices (a smoke test)")
flags.DEFINE_string("out", None, "output path prefix (.md, .json); default: print only")
flags.DEFINE_string("only", None, "internal: run this one variant here, print its JSON")
flags.DEFINE_integer("timeout_s", 900, "seconds per variant")
FLAGS = flags.FLAGS

LLAMAS = {  # the Llama papers' shapes
    "llama7b": dict(d_model=4096, num_layers=32, num_heads=32, hidden=11008),
    "llama13b": dict(d_model=5120, num_layers=40, num_heads=40, hidden=13824),
    "llama_small": dict(d_model=1536, num_layers=16, num_heads=16, hidden=4096),
    "tiny": dict(vocab=256, d_model=64, num_layers=2, num_heads=4, hidden=128),
}


def _workload():
    """(train_step, (params, opt_state, batch), parameters, tokens per step)."""
    import jax

    if FLAGS.model.startswith("zoo:"):
        from hetpar import zoo

        w = zoo.get(FLAGS.model[4:], batch=FLAGS.batch)
        args = w.example_args()
        params = sum(x.size for x in jax.tree.leaves(args[0]))
        first = jax.tree.leaves(args[-1])[0]
        return w.train_step, args, params, int(first.size)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import llama_style

    cfg = llama_style.Config(**LLAMAS["tiny" if FLAGS.quick else FLAGS.model])
    seq = 16 if FLAGS.quick else FLAGS.seq
    step, init = llama_style.make(cfg, batch=FLAGS.batch, seq=seq)
    return step, init(jax.random.key(0)), llama_style.parameter_count(cfg), FLAGS.batch * seq


def _devices():
    import jax

    devs = jax.devices("cpu" if FLAGS.quick else "gpu")[:FLAGS.gpus]
    return [f"{d.platform}:{d.id}" for d in devs], devs


def run_variant(name: str) -> dict:
    """Times one variant here; its row of the results."""

    from _timing import median_step

    step, args, params, tokens = _workload()
    names, devs = _devices()
    row = {"variant": name, "devices": names}
    if name.startswith("jit"):
        from _fsdp import hand_sharded_jit

        fn, args = hand_sharded_jit(step, args, devs, sharded=name == "jit_fsdp")
    else:
        import hetpar

        mode = "replicated" if name == "hetpar_replicated" else True
        # As a user on that machine writes it (issue 43): the GPUs and their host.
        devices = names if FLAGS.quick else [*names, "cpu:0"]
        fn = hetpar.auto(step, devices=devices, data_parallel=mode, donate_argnums=(0, 1))
        plan = fn.lower(*args).plan
        if plan is not None:
            row.update(chosen=plan.solver.get("chosen", "layer plan"), sharding=plan.sharding,
                       predicted_s=plan.predicted.step_time_s,
                       predicted_peak_gb=[(plan.predicted.peak_memory_bytes
                                           or plan.predicted.memory_bytes or {}).get(d, 0) / 1e9
                                          for d in names])
    _, state = median_step(fn, tuple(args[:-1]), args[-1], 2)  # compile, settle
    t, _ = median_step(fn, state, args[-1], FLAGS.steps)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devs]
    row.update(step_s=t, tokens_per_s=tokens / t, tflops_per_gpu=6 * params * tokens / t / len(
        devs) / 1e12, peak_gb=[None if p is None else p / 1e9 for p in peaks], params=params)
    return row


def _child(variant: str) -> dict:
    env = dict(os.environ)
    if FLAGS.quick:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        env["JAX_PLATFORMS"] = "cpu"
    if FLAGS.lhs:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + " --xla_gpu_enable_latency_hiding_scheduler=true")
    argv = [a for a in sys.argv[1:] if not a.startswith("--only")]
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv,
                               f"--only={variant}"], env=env, capture_output=True, text=True,
                              timeout=FLAGS.timeout_s)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"over {FLAGS.timeout_s} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    oom = "RESOURCE_EXHAUSTED" in proc.stderr or "out of memory" in proc.stderr.lower()
    return {"variant": variant, "error": "out of memory" if oom else " | ".join(tail)}


def to_markdown(rows: list[dict]) -> str:
    model = "tiny llama (--quick)" if FLAGS.quick and not FLAGS.model.startswith("zoo:") \
        else FLAGS.model
    head = (f"# Sharded state: {model}, batch {FLAGS.batch}"
            + ("" if FLAGS.model.startswith("zoo:") else f" x {16 if FLAGS.quick else FLAGS.seq}")
            + f", {FLAGS.gpus} devices{', --quick' if FLAGS.quick else ''}"
            + f"{', latency-hiding scheduler' if FLAGS.lhs else ''}\n\n")
    lines = ["| variant | step | tokens/s | TFLOP/s per GPU | peak GB per GPU | plan "
             "(predicted) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error']} | | | | |")
            continue
        peak = ", ".join("-" if p is None else f"{p:.1f}" for p in r["peak_gb"])
        plan = (f"{r.get('chosen')} ({r['predicted_s'] * 1e3:.1f} ms)"
                if "predicted_s" in r else "")
        lines.append(f"| {r['variant']} | {r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:.0f} "
                     f"| {r['tflops_per_gpu']:.3g} | {peak} | {plan} |")
    return head + "\n".join(lines) + "\n"


def main(argv):
    del argv
    if FLAGS.only:
        print("ROW " + json.dumps(run_variant(FLAGS.only)), flush=True)
        return
    if FLAGS.quick:
        FLAGS.gpus, FLAGS.steps = min(FLAGS.gpus, 4), min(FLAGS.steps, 3)
    rows = [_child(v) for v in FLAGS.variants]
    text = to_markdown(rows)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out + ".md", "w") as f:
            f.write(text)
        with open(FLAGS.out + ".json", "w") as f:
            json.dump({"flags": {k: FLAGS[k].value for k in ("model", "batch", "seq", "gpus",
                                                             "steps", "lhs", "quick")},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    app.run(main)
