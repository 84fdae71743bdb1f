"""A model larger than the GPU: hetpar's offload against JAX's and ZeRO's (issue 15).

Each variant runs in its own process (so each GPU memory high-water mark is
its own) on the zoo transformer, built on the GPU (its parameters and Adam
state fit; its training step does not), and trains for `--steps` steps. The
table gives the median step after two warm-up steps, the loss at the first
and last step, the GPU's peak bytes and the host's peak RSS.

Variants:
  fits           does the step fit the GPU? `jax.jit` with and without
                 donating the state (expected: out of memory)
  ideal          the GPU compute time had memory been unlimited: `jax.jit`
                 steps of the same model with 2 and 4 blocks, extrapolated
                 per block; and the pinned host <-> GPU bandwidth, each way
                 and both at once (1 GB copies)
  jax_offload    JAX's own host offload as its memory-kinds documentation
                 writes it: optimizer state in the GPU's `pinned_host`
                 memory, moved to the device inside the jitted step and back
  jax_offload_donated  the same, donating the parameters and optimizer state
  zero_offload   ZeRO-Offload's rule under hetpar: compute on gpu:0,
                 parameters, optimizer state and update on the host CPU
  pinned         hetpar running JAX's rule per layer: parameters on gpu:0,
                 optimizer state in gpu:0's pinned host memory, each layer's
                 update on gpu:0 as soon as its gradient is final, its state
                 streamed in ahead and back as soon as it is new
  planned        hetpar.auto's own plan over cpu:0 and gpu:0 (its predicted
                 step beside the measured one); also the predictions of the
                 plan without offload and of the memory-fill baseline, and
                 one step's stage timeline

    python experiments/bench_offload.py --d_model 4096 --num_layers 24 --num_heads 32 \
        --out experiments/results/offload_h100.json
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

VARIANTS = ("fits", "ideal", "jax_offload", "jax_offload_donated", "pinned", "planned",
            "zero_offload")


def _model(args, num_layers=None):
    from hetpar import zoo

    return zoo.get("transformer", batch=args.batch, d_model=args.d_model,
                   num_layers=num_layers or args.num_layers, num_heads=args.num_heads)


def _build(w, device):
    import jax

    t0 = time.perf_counter()
    with jax.default_device(device):
        params, opt_state, batch = w.example_args()
        jax.block_until_ready((params, opt_state, batch))
    return params, opt_state, batch, time.perf_counter() - t0


def _train(step, state, batch, steps, name):
    """Trains `steps` steps from `state` ([params, opt_state], emptied: no
    caller keeps the first step's state alive beside the new)."""
    import jax

    params, opt_state = state
    state.clear()
    times, losses = [], []
    for i in range(steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        jax.block_until_ready((params, opt_state))
        times.append(time.perf_counter() - t)
        losses.append(loss)
        print(f"  {name} step {i}: {times[-1] * 1e3:.1f} ms, loss {loss:.4f}",
              file=sys.stderr, flush=True)
    return params, opt_state, times, losses


def _gb(n):
    return None if n is None else n / 1e9


def _memory(gpu, what):
    """GPU bytes in use and the live arrays by memory kind, to stderr."""
    import jax

    live: dict = {}
    for a in jax.live_arrays():
        k = a.sharding.memory_kind
        live[k] = live.get(k, 0) + a.nbytes
    stats = gpu.memory_stats() or {}
    print(f"  memory {what}: GPU in use {_gb(stats.get('bytes_in_use')) or 0:.1f} GB of "
          f"{_gb(stats.get('bytes_limit')) or 0:.1f}; live arrays "
          + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in live.items()),
          file=sys.stderr, flush=True)


def _bandwidth(gpu):
    """Pinned host <-> GPU GB/s: each way alone and both at once, 1 GB copies."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    dev = SingleDeviceSharding(gpu)
    host = SingleDeviceSharding(gpu, memory_kind="pinned_host")
    n = 1 << 28  # float32: 1 GiB
    on_dev = jax.device_put(jnp.ones((n,), jnp.float32), dev)
    on_host = jax.device_put(jnp.ones((n,), jnp.float32), host)
    jax.block_until_ready((on_dev, on_host))
    out = {}
    for name, fn in (("h2d", lambda: jax.device_put(on_host, dev)),
                     ("d2h", lambda: jax.device_put(on_dev, host)),
                     ("both", lambda: (jax.device_put(on_host, dev),
                                       jax.device_put(on_dev, host)))):
        jax.block_until_ready(fn())
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t)
        out[name] = (n * 4 * (2 if name == "both" else 1)) / statistics.median(ts) / 1e9
    return out


def _warm_up(acc):
    """A tiny split step first, so every module hetpar and JAX import lazily
    loads before the big model exists: a module that keeps a traceback from
    an optional import it failed (pulp does) keeps the frames of the call
    that imported it, and their arguments, alive."""
    import jax

    import hetpar
    from hetpar import zoo

    w = zoo.get("mlp", small=True)
    args = w.example_args()
    layers = hetpar.trace(w.train_step, *args).layers
    plan = {n: {"compute": acc, "params": acc, "state": f"{acc}:pinned_host"} for n in layers}
    step = hetpar.auto(w.train_step, plan=plan)
    jax.block_until_ready(step(*step.place(*args)))


def run_variant(args) -> dict:
    import jax
    from jax.sharding import SingleDeviceSharding

    import hetpar
    from hetpar.runtime import Executor

    if args.prefetch:
        Executor.PREFETCH = args.prefetch
    try:
        gpu, acc = jax.devices("gpu")[0], "gpu:0"
    except RuntimeError:  # a smoke run on CPUs: XLA_FLAGS=--xla_force_host_platform_device_count=2
        gpu, acc = jax.devices("cpu")[1], "cpu:1"
    out = {"variant": args.variant, "device": gpu.device_kind, "prefetch": Executor.PREFETCH}
    if args.variant == "ideal":
        rows = {}
        for L in (2, 4):
            w = _model(args, L)
            params, opt_state, batch, _ = _build(w, gpu)
            _, _, times, _ = _train(jax.jit(w.train_step), [params, opt_state], batch, 6,
                                    f"jit@{L}")
            rows[L] = statistics.median(times[2:])
        per_block = (rows[4] - rows[2]) / 2
        out.update({"jit_2_blocks_s": rows[2], "jit_4_blocks_s": rows[4],
                    "per_block_s": per_block,
                    "ideal_s": rows[2] + (args.num_layers - 2) * per_block,
                    "pinned_gbps": _bandwidth(gpu)})
        return out
    if args.variant in ("pinned", "planned", "zero_offload"):
        _warm_up(acc)
    w = _model(args)
    params, opt_state, batch, init_s = _build(w, gpu)
    _memory(gpu, f"built ({init_s:.1f} s)")
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    out.update({"params": int(n_params), "init_s": init_s,
                "state_gb": sum(x.nbytes for x in jax.tree_util.tree_leaves(
                    (params, opt_state))) / 1e9})
    predicted = None
    if args.variant == "fits":
        for name, donate in (("jit", ()), ("jit_donated", (0, 1))):
            try:
                step = jax.jit(w.train_step, donate_argnums=donate)
                p2, o2, loss = step(params, opt_state, batch)
                float(loss)
                out[name] = "fits"
                params, opt_state = p2, o2
            except Exception as e:  # noqa: BLE001 - the point is to report it
                out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"  fits {name}: {out[name]}", file=sys.stderr, flush=True)
        return out
    if args.variant.startswith("jax_offload"):
        dev = SingleDeviceSharding(gpu)
        host = SingleDeviceSharding(gpu, memory_kind="pinned_host")
        opt_state = jax.device_put(opt_state, host)

        def offloaded(params, opt_state, batch):
            new_params, new_opt, loss = w.train_step(params, jax.device_put(opt_state, dev),
                                                     batch)
            return new_params, jax.device_put(new_opt, host), loss

        donate = (0, 1) if args.variant == "jax_offload_donated" else ()
        step = jax.jit(offloaded, out_shardings=(dev, host, dev), donate_argnums=donate)
    else:
        layers = hetpar.trace(w.train_step, params, opt_state, batch).layers
        if args.variant == "zero_offload":
            plan = {n: {"compute": acc, "state": "cpu:0", "update": "cpu:0"} for n in layers}
            step = hetpar.auto(w.train_step, plan=plan)
        elif args.variant == "pinned":
            plan = {n: {"compute": acc, "params": acc, "state": f"{acc}:pinned_host",
                        "update": acc} for n in layers}
            step = hetpar.auto(w.train_step, plan=plan)
        else:
            step = hetpar.auto(w.train_step, devices=["cpu:0", acc])
        t0 = time.perf_counter()
        # The state moves once to where the plan keeps it; the GPU copies free.
        params, opt_state, batch = step.place(params, opt_state, batch)
        jax.block_until_ready((params, opt_state))
        out["plan_and_place_s"] = time.perf_counter() - t0
        print(f"  planned and placed in {out['plan_and_place_s']:.1f} s",
              file=sys.stderr, flush=True)
    _memory(gpu, "placed")
    state = [params, opt_state]
    del params, opt_state
    try:
        params, opt_state, times, losses = _train(step, state, batch, args.steps, args.variant)
    except Exception:
        _memory(gpu, "at the failure")
        raise
    if args.variant in ("zero_offload", "pinned", "planned"):
        plan = step.plan
        out["placements"] = {n: p.to_json() if hasattr(p, "to_json") else p
                             for n, p in step.placements.items()}
        if plan is not None:
            predicted = plan.predicted.step_time_s
            out["plan_summary"] = str(plan)
            out["baselines_predicted_s"] = {
                k: getattr(getattr(v, "predicted", None), "step_time_s", None)
                for k, v in plan.baselines.items()}
            table = step._last.table
            try:
                no_offload = hetpar.plan(table, offload=False)
                out["no_offload_predicted_s"] = no_offload.predicted.step_time_s
                out["no_offload_placement"] = dict(no_offload.assignment)
            except Exception as e:  # noqa: BLE001
                out["no_offload_predicted_s"] = f"{type(e).__name__}: {e}"
        # One step's compute and copies each way, watched as it runs.
        ex = step._last._executor
        if ex is not None:
            ex.watch_events = True
            state = [params, opt_state]
            del params, opt_state
            _train(step, state, batch, 1, args.variant + " (timeline)")
            ex.watch_events = False
            out["timeline"] = [e.__dict__ for e in ex.last_events]
            out["bytes_moved_per_step"] = ex.transfer.bytes_moved / (args.steps + 1)
    stats = gpu.memory_stats() or {}
    out.update({
        "median_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
        "times_s": times, "loss_first": losses[0], "loss_last": losses[-1],
        "gpu_peak_gb": _gb(stats.get("peak_bytes_in_use")),
        "gpu_limit_gb": _gb(stats.get("bytes_limit")),
        "host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        "predicted_s": predicted,
    })
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d_model", type=int, default=4096)
    p.add_argument("--num_layers", type=int, default=24)
    p.add_argument("--num_heads", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--prefetch", type=int, default=None,
                   help="stages reading streamed state in flight per device "
                        "(default: hetpar's Executor.PREFETCH)")
    args = p.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    rows = []
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", v] + [
            f"--{k}={getattr(args, k)}" for k in
            ("d_model", "num_layers", "num_heads", "batch", "steps", "prefetch")
            if getattr(args, k) is not None]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=os.environ)
            sys.stderr.write(r.stderr[-4000:])
            line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
            rows.append(json.loads(line) if line.startswith("{") else
                        {"variant": v, "error": r.stderr.strip().splitlines()[-3:]})
        except subprocess.TimeoutExpired as e:
            sys.stderr.write((e.stderr or b"")[-3000:].decode(errors="replace")
                             if isinstance(e.stderr, bytes) else str(e.stderr or "")[-3000:])
            rows.append({"variant": v, "error": f"timed out after {args.timeout:.0f} s"})
        rows[-1]["wall_s"] = time.perf_counter() - t0
        print(f"[{v}] done in {rows[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
        if args.out:  # keep what is done if a later variant takes the machine down
            with open(args.out, "w") as f:
                json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    print(f"\ntransformer d_model {args.d_model}, {args.num_layers} layers, batch {args.batch}")
    print(f"{'variant':<14}{'median':>10}{'predicted':>11}{'loss first->last':>20}"
          f"{'GPU peak':>10}{'host RSS':>10}")
    for r in rows:
        if "median_s" not in r:
            extra = {k: r[k] for k in ("jit", "jit_donated", "ideal_s", "pinned_gbps", "error")
                     if k in r}
            print(f"{r['variant']:<14} {extra}")
            continue
        pred = f"{r['predicted_s'] * 1e3:.0f} ms" if r.get("predicted_s") else "-"
        print(f"{r['variant']:<14}{r['median_s'] * 1e3:>8.0f} ms{pred:>11}"
              f"{r['loss_first']:>10.3f}->{r['loss_last']:<8.3f}"
              f"{r['gpu_peak_gb'] or 0:>8.1f} GB{r['host_peak_rss_gb']:>8.1f} GB")


if __name__ == "__main__":
    main()
