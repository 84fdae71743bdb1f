"""`hetpar run MODEL`: train a zoo model under `@hetpar.auto`, beside plain `jax.jit`.

Prints the cost report's summary, the plan, per-step time and loss, and the
same step under plain `jax.jit` on the best single device. Without an
accelerator it still runs (a CPU plan) and also shows what-if plans for
CPU + H100 and CPU + TPU v5e from spec sheets.
"""

from __future__ import annotations

import statistics
import time

from hetpar.cli._common import add_model_args, workload


def register(sub) -> None:
    p = sub.add_parser("run", help="train a zoo model under @hetpar.auto and compare with jax.jit")
    add_model_args(p)
    p.add_argument("--devices", default=None,
                   help="comma-separated devices to use, e.g. cpu:0,gpu:0 (default: all present)")
    p.add_argument("--plan", default=None, help="plan.json to run instead of planning")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    p.add_argument("--objective", choices=("time", "cost", "energy"), default="time")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain jax.jit comparison")
    p.add_argument("--no-what-if", action="store_true",
                   help="skip the spec-sheet what-if plans shown on CPU-only machines")
    p.set_defaults(func=_run)


def _timed_steps(step, state, batch, steps: int):
    import jax

    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        *state, loss = step(*state, batch)
        loss = float(jax.block_until_ready(loss))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return times, losses


def _ms(x: float) -> str:
    return f"{x * 1e3:8.2f} ms"


def _run(args) -> int:
    import jax

    import hetpar
    from hetpar.core import HetparError, human
    from hetpar.cost_models import cost_table

    if args.steps < 1:
        raise HetparError("--steps must be >= 1")
    w = workload(args)
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
    variables, opt_state, batch = w.example_args()

    step = hetpar.auto(w.train_step, devices=devices, plan=args.plan,
                       microbatches=args.microbatches, schedule=args.schedule,
                       objective=args.objective)
    print(f"== {args.model} (batch {w.config.get('batch_size')}, "
          f"{human(w.param_count)} parameters) on {jax.default_backend()}")
    t0 = time.perf_counter()
    compiled = step.lower(variables, opt_state, batch)
    graph = compiled.graph
    total = graph.total_work()
    print(f"   traced into {len(graph)} layers; per step {human(total.flops)}FLOP, "
          f"{human(total.bytes_accessed, 'B')} accessed (before XLA fusion); "
          f"traced and planned in {time.perf_counter() - t0:.1f} s")

    print("\n== plan")
    if compiled.plan is not None:
        print(compiled.plan.summary(compiled.table))
    else:
        used = sorted(set(compiled.assignment.values()))
        print(f"   every layer on {used[0]}" if len(used) == 1 else
              "\n".join(f"   {layer:<28} {dev}" for layer, dev in compiled.assignment.items()))
    if compiled.stages is not None:
        print(f"   {compiled.stages}")

    print(f"\n== training {args.steps} steps under hetpar.auto")
    times, losses = _timed_steps(step, (variables, opt_state), batch, args.steps)
    for i, (t, loss) in enumerate(zip(times, losses)):
        print(f"   step {i}: {_ms(t)}  loss {loss:.5f}" + ("  (includes compilation)" * (i == 0)))
    steady = statistics.median(times[1:]) if len(times) > 1 else times[0]

    if not args.no_baseline:
        dev = _best_single_device(compiled)
        print(f"\n== the same step under plain jax.jit on {dev}")
        jitted = jax.jit(w.train_step)
        placed = jax.device_put((variables, opt_state, batch), _device(dev))
        base_times, base_losses = _timed_steps(jitted, placed[:2], placed[2], args.steps)
        for i, (t, loss) in enumerate(zip(base_times, base_losses)):
            print(f"   step {i}: {_ms(t)}  loss {loss:.5f}" +
                  ("  (includes compilation)" * (i == 0)))
        base = statistics.median(base_times[1:]) if len(base_times) > 1 else base_times[0]
        print(f"\n   median step: hetpar {_ms(steady)}, jax.jit {_ms(base)}: "
              f"ratio {steady / base:.3f}")

    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if not accelerators and not args.no_what_if:
        print("\n== what-if plans from spec sheets (no accelerator here)")
        for kind in ("h100", "tpu-v5e"):
            table = cost_table(graph, ["cpu:0", kind])
            p = hetpar.plan(table, objective=args.objective)
            print(f"\n-- cpu:0 + {kind}")
            print(p.summary(table))
    return 0


def _device(name: str):
    from hetpar.cost_models import present_devices

    return present_devices()[name]


def _best_single_device(compiled) -> str:
    """The single device the planner predicts fastest (else the first accelerator, else cpu:0)."""
    from hetpar.cost_models import present_devices

    plan = compiled.plan
    if plan is not None and plan.baselines:
        # The planner's one-device baselines are named "only <device>".
        best = [(b.predicted.step_time_s, name.removeprefix("only "))
                for name, b in plan.baselines.items()
                if name.startswith("only ") and b.feasible]
        present = present_devices()
        best = [(t, d) for t, d in best if d in present]
        if best:
            return min(best)[1]
    used = sorted(set(compiled.assignment.values()), key=lambda d: (d.startswith("cpu"), d))
    return used[0]
