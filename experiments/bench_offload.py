"""State apart from compute on one GPU: hetpar's offload against JAX's (issue 15).

Each variant runs in its own process (so each GPU memory high-water mark is
its own), on the zoo transformer built on the host CPU, and trains for
`--steps` steps; the table gives the median step after two warm-up steps,
the ratio to the all-GPU `jax.jit` step, the loss at the first and last
step, the GPU's peak bytes and the host's peak RSS.

Variants:
  jit            all on the GPU, `jax.jit` (the ideal when it fits)
  jax_offload    JAX's own host offload, as its memory-kinds documentation
                 writes it: optimizer state in the GPU's `pinned_host`
                 memory, `jax.device_put` to the device inside the jitted
                 step and back
  zero_offload   hetpar, ZeRO-Offload's rule: compute on gpu:0, parameters,
                 optimizer state and update on the host CPU device
  streamed       hetpar: compute and update on gpu:0, state on the host CPU
                 device between steps
  planned        hetpar.auto's own plan with gpu:0 capped to --cap_gb for
                 planning (its predicted step beside the measured one)

    python experiments/bench_offload.py --d_model 2048 --num_layers 16 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

VARIANTS = ("jit", "jax_offload", "zero_offload", "streamed", "planned")


def run_variant(args) -> dict:
    import jax
    from jax.sharding import SingleDeviceSharding

    import hetpar
    from hetpar import zoo

    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    w = zoo.get("transformer", batch=args.batch, d_model=args.d_model,
                num_layers=args.num_layers, num_heads=args.num_heads)
    t0 = time.perf_counter()
    with jax.default_device(cpu):
        params, opt_state, batch = w.example_args()
    init_s = time.perf_counter() - t0
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    out = {"variant": args.variant, "params": int(n_params), "init_s": init_s}
    predicted = None
    if args.variant == "jit":
        params, opt_state, batch = jax.device_put((params, opt_state, batch), gpu)
        step = jax.jit(w.train_step)
    elif args.variant == "jax_offload":
        dev = SingleDeviceSharding(gpu)
        host = SingleDeviceSharding(gpu, memory_kind="pinned_host")
        params, batch = jax.device_put((params, batch), gpu)
        opt_state = jax.device_put(opt_state, host)

        def offloaded(params, opt_state, batch):
            new_params, new_opt, loss = w.train_step(params, jax.device_put(opt_state, dev),
                                                     batch)
            return new_params, jax.device_put(new_opt, host), loss

        step = jax.jit(offloaded, out_shardings=(dev, host, dev))
    else:
        layers = hetpar.trace(w.train_step, params, opt_state, batch).layers
        if args.variant == "zero_offload":
            plan = {n: {"compute": "gpu:0", "state": "cpu:0", "update": "cpu:0"} for n in layers}
            step = hetpar.auto(w.train_step, plan=plan)
        elif args.variant == "streamed":
            plan = {n: {"compute": "gpu:0", "state": "cpu:0", "update": "gpu:0"} for n in layers}
            step = hetpar.auto(w.train_step, plan=plan)
        else:
            step = hetpar.auto(w.train_step, devices=["cpu:0", "gpu:0"],
                               memory={"gpu:0": args.cap_gb * 1e9})
        batch = jax.device_put(batch, gpu)
    times, losses = [], []
    for i in range(args.steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        jax.block_until_ready((params, opt_state))
        times.append(time.perf_counter() - t)
        losses.append(loss)
        print(f"  {args.variant} step {i}: {times[-1] * 1e3:.1f} ms, loss {loss:.4f}",
              file=sys.stderr, flush=True)
    if args.variant in ("zero_offload", "streamed", "planned"):
        plan = step.plan
        if plan is not None:
            predicted = plan.predicted.step_time_s
            out["placements"] = {n: p.to_json() for n, p in plan.placements.items()}
        else:
            out["placements"] = {n: p.to_json() for n, p in step.placements.items()}
    stats = gpu.memory_stats() or {}
    out.update({
        "median_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
        "times_s": times, "loss_first": losses[0], "loss_last": losses[-1],
        "gpu_peak_bytes": stats.get("peak_bytes_in_use"),
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "predicted_s": predicted,
    })
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d_model", type=int, default=2048)
    p.add_argument("--num_layers", type=int, default=16)
    p.add_argument("--num_heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--cap_gb", type=float, default=10.0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=240.0)
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    rows = []
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", v] + [
            f"--{k}={getattr(args, k)}" for k in
            ("d_model", "num_layers", "num_heads", "batch", "steps", "cap_gb")]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=os.environ)
            sys.stderr.write(r.stderr[-3000:])
            line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
            rows.append(json.loads(line) if line.startswith("{") else
                        {"variant": v, "error": r.stderr.strip().splitlines()[-1:]})
        except subprocess.TimeoutExpired:
            rows.append({"variant": v, "error": f"timed out after {args.timeout:.0f} s"})
    base = next((r["median_s"] for r in rows if r["variant"] == "jit" and "median_s" in r),
                None)
    print(f"\ntransformer d_model {args.d_model}, {args.num_layers} layers, batch {args.batch}")
    print(f"{'variant':<14}{'median':>10}{'x jit':>8}{'predicted':>11}{'loss first->last':>20}"
          f"{'GPU peak':>10}{'host RSS':>10}")
    for r in rows:
        if "median_s" not in r:
            print(f"{r['variant']:<14} failed: {r.get('error')}")
            continue
        ratio = f"{r['median_s'] / base:.2f}" if base else "-"
        pred = f"{r['predicted_s'] * 1e3:.0f} ms" if r.get("predicted_s") else "-"
        gpu = f"{(r['gpu_peak_bytes'] or 0) / 1e9:.1f} GB"
        print(f"{r['variant']:<14}{r['median_s'] * 1e3:>8.0f} ms{ratio:>8}{pred:>11}"
              f"{r['loss_first']:>10.3f}->{r['loss_last']:<8.3f}{gpu:>10}"
              f"{r['host_peak_rss_bytes'] / 1e9:>8.1f} GB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
