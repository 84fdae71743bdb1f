"""`hetpar run MODEL`: train a zoo model under `@hetpar.auto`, beside plain `jax.jit`.

Prints the traced step's size, the plan, and per-step time and loss under
`hetpar.auto` and under plain `jax.jit` on the best single device, timed
interleaved step by step (each side one step in turn, same start, same batch),
then both medians, their ratio, and the planner's predicted step beside up to
10 more steps of `hetpar.auto` alone (the prediction is for the step alone;
interleaved, both sides run slower; with --no-baseline, beside its own
steps). The prediction is calibrated here at the first call (`--profile
measure`, the default unless $HETPAR_PROFILES names a `hetpar profile`
file): a command that runs the step on this machine can time it, and spec
sheets alone missed the README's small CPU step 11x. Without an
accelerator it still runs (a CPU plan) and also shows what-if plans for
CPU + H100 and CPU + TPU v5e from spec sheets.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time

from hetpar.cli._common import add_model_args, workload
from hetpar.core import seconds


def register(sub) -> None:
    p = sub.add_parser(
        "run", help="train a zoo model under @hetpar.auto and compare with jax.jit",
        description="Train a zoo model for a few steps under @hetpar.auto (planned here, or "
                    "--plan) and, interleaved step by step, under plain jax.jit on one device; "
                    "print the plan, both step times and the predicted step.")
    add_model_args(p)
    p.add_argument("--devices", default=None,
                   help="comma-separated devices to use, e.g. cpu:0,gpu:0 (default: all present)")
    p.add_argument("--plan", default=None, help="plan.json to run instead of planning")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--microbatches", type=int, default=1,
                   help="microbatches M through a pipeline of the planned stages (default 1)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe",
                   help="the pipeline's schedule with --microbatches > 1 (default gpipe)")
    p.add_argument("--objective", choices=("time", "cost", "energy"), default="time",
                   help="what the plan minimises: step time, dollars or joules per step "
                        "(default time)")
    p.add_argument("--profile", default=None,
                   help="where the planner's figures come from: measure (time the layers, "
                        "the step and the runtime's costs here at the first call; the "
                        "default), auto (hetpar.auto's default: the file $HETPAR_PROFILES "
                        "names, the default when it is set; else measure, unless "
                        "$HETPAR_CALIBRATE=0), spec (spec sheets alone), or a `hetpar "
                        "profile` file")
    p.add_argument("--no-baseline", action="store_true", help="skip the plain jax.jit comparison")
    p.add_argument("--no-what-if", action="store_true",
                   help="skip the spec-sheet what-if plans shown on CPU-only machines")
    p.set_defaults(func=_run)


def _profile(args) -> str:
    """--profile, defaulting to `measure` unless $HETPAR_PROFILES names a profile file."""
    if args.profile is not None:
        return args.profile
    return "auto" if os.environ.get("HETPAR_PROFILES") else "measure"


class _Progress(logging.Handler):
    """Prints hetpar's own progress lines (what the first call times) while
    planning, so a minute of measuring is not a silent minute; warnings go on
    to the usual handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            logging.getLogger().handle(record)
            return
        msg = record.getMessage()
        if msg.startswith("hetpar: "):
            print(f"   {msg.removeprefix('hetpar: ')}", flush=True)


@contextlib.contextmanager
def _progress(show: bool):
    from absl import flags
    from absl import logging as absl_logging

    # A user who set --verbosity sees absl's own log lines; leave them be.
    if not show or flags.FLAGS["verbosity"].present:
        yield
        return
    # The absl logger alone goes to INFO, into this handler only: absl's
    # set_verbosity would lower the root logger's level, letting JAX's and
    # other libraries' INFO records onto stderr under `app.run`.
    logger, handler = absl_logging.get_absl_logger(), _Progress()
    level, propagate = logger.level, logger.propagate
    try:
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
        yield
    finally:
        logger.setLevel(level)
        logger.propagate = propagate
        logger.removeHandler(handler)


def _timed_step(step, state: tuple, batch) -> tuple[float, tuple, float]:
    """(seconds, new state, loss) of one step, waited for to the last output."""
    import jax

    t0 = time.perf_counter()
    *state, loss = jax.block_until_ready(step(*state, batch))
    return time.perf_counter() - t0, tuple(state), float(loss)


def _ms(x: float) -> str:
    return f"{x * 1e3:8.2f} ms"


def _steps(n: int) -> str:
    return f"{n} step" + "s" * (n != 1)


def _median_steady(times: list[float]) -> float:
    """The median step time after the first (which compiles); the first alone if only one."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def _run(args) -> int:
    import jax

    import hetpar
    from hetpar.core import human
    from hetpar.cost_models import cost_table

    w = workload(args)
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
    variables, opt_state, batch = w.example_args()
    profile = _profile(args)

    step = hetpar.auto(w.train_step, devices=devices, plan=args.plan,
                       microbatches=args.microbatches, schedule=args.schedule,
                       objective=args.objective, profile=profile)
    print(f"== {args.model} (batch {w.config.get('batch_size')}, "
          f"{human(w.param_count)} parameters) on {jax.default_backend()}")
    t0 = time.perf_counter()
    measuring = step.options.calibrates()
    if measuring:
        print(f"   timing its layers and its step here (--profile {profile}; cached on disk)")
    with _progress(measuring):
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

    # Each side trains its own copy of the state from the same start on the
    # same batch, one step each in turn, so both meet the same machine load.
    runs = {"hetpar.auto": (step, (variables, opt_state), batch)}
    if not args.no_baseline:
        dev = _best_single_device(compiled)
        placed = jax.device_put((variables, opt_state, batch), _device(dev))
        runs["jax.jit"] = (jax.jit(w.train_step), placed[:2], placed[2])
        print(f"\n== training {_steps(args.steps)} under hetpar.auto and, interleaved step by "
              f"step, plain jax.jit on {dev}")
    else:
        print(f"\n== training {_steps(args.steps)} under hetpar.auto")
    names = list(runs)
    print(f"   {'':<10}" + "".join(f"{name:>30}" for name in names))
    times = {name: [] for name in names}
    for i in range(args.steps):
        losses = {}
        # Alternate who goes first, so neither always runs on a cache the other warmed.
        for name in (names if i % 2 == 0 else names[::-1]):
            fn, state, data = runs[name]
            t, state, losses[name] = _timed_step(fn, state, data)
            runs[name] = (fn, state, data)
            times[name].append(t)
        print(f"   {f'step {i}':<10}"
              + "".join(f"{_ms(times[n][-1]):>16}  loss {losses[n]:<7.5f}" for n in names)
              + ("  (includes compilation)" if i == 0 else ""))

    steady = _median_steady(times["hetpar.auto"])
    over = (f"median of steps 1-{args.steps - 1}" if args.steps > 1
            else "step 0 alone, compilation included")
    interleaved = " interleaved" if "jax.jit" in times else ""
    if "jax.jit" in times:
        base = _median_steady(times["jax.jit"])
        print(f"\n   measured step{interleaved} ({over}): hetpar.auto {_ms(steady).strip()}, "
              f"jax.jit {_ms(base).strip()}: ratio {steady / base:.3f} (hetpar.auto / jax.jit)")
    else:
        print(f"\n   measured step ({over}): hetpar.auto {_ms(steady).strip()}")
    predicted = compiled.predicted()
    if predicted is None:
        print("   predicted step: none")
    else:
        from hetpar._step_clock import StepClock, calibration_timing

        p = predicted.step_time_s
        own = calibration_timing(compiled)
        what = (f"the calibration's own timing of this step ({own}, timed while planning "
                f"and its layers scaled to it: --profile {profile})" if own else "planner")
        # The prediction is for the step alone; interleaved with jax.jit both
        # ran slower (GPT-2 b8 on an H200: 1.20x its prediction interleaved,
        # 1.01x alone), so a few more steps alone are what it is set beside.
        measured, timed, how = steady, args.steps - 1, f"hetpar.auto ({over})"
        if "jax.jit" in times:
            fn, state, data = runs["hetpar.auto"]
            timed = min(10, args.steps)
            alone = []
            for _ in range(timed):
                t, state, _ = _timed_step(fn, state, data)
                alone.append(t)
            measured = statistics.median(alone)
            how = f"hetpar.auto alone (median of {timed} more step{'s' * (timed != 1)})"
        print(f"   predicted step ({what}): {seconds(p)}")
        if timed == 0 or not p > 0:
            # Only the compiling step was timed: beside a prediction of the step
            # alone its ratio (6.5e+03 once) says nothing.
            print(f"   measured {how}: {seconds(measured)}; no measured / predicted: the one "
                  "step timed includes compilation (pass --steps 2 or more)")
            return _what_if(args, graph, hetpar, cost_table)
        ratio = "measured / calibration" if own else "measured / predicted"
        print(f"   measured {how}: {seconds(measured)}; {ratio} {measured / p:.3g}"
              + (" (how repeatable the step's time is, not the cost model's accuracy)"
                 if own else ""))

        if abs(measured / p - 1) > StepClock.TOLERANCE:
            if own:
                hint = ("the prediction is this step timed moments before: the gap is the "
                        "machine's, other work on it or the first steps settling; more "
                        "--steps steady the median")
            elif measuring:
                hint = _measured_hint(timed)
            elif profile == "auto" and os.environ.get("HETPAR_PROFILES"):
                hint = ("the figures come from the file $HETPAR_PROFILES names, a profile of "
                        "devices (microbenchmarks, not this step's layers); --profile measure "
                        "times this step's layers and the step here at the first call")
            elif profile not in ("auto", "spec"):
                hint = (f"the figures come from {profile}, a profile of this machine's or "
                        "another's devices (microbenchmarks, not this step's layers); "
                        "--profile measure times this step's layers and the step here at the "
                        "first call")
            else:
                hint = ("calibrate with --profile measure (timed here at the first call), or "
                        "`hetpar profile --out profiles.json` on this machine and --profile "
                        "profiles.json")
            print(f"   WARNING: measured and predicted differ by more than "
                  f"{StepClock.TOLERANCE:.0%}; {hint}")
    return _what_if(args, graph, hetpar, cost_table)


def _what_if(args, graph, hetpar, cost_table) -> int:
    """On a machine without accelerators, plans for CPU + H100 and + TPU v5e from spec sheets."""
    import jax

    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if not accelerators and not args.no_what_if:
        print("\n== what-if plans from spec sheets (no accelerator here)")
        for kind in ("h100", "tpu-v5e"):
            table = cost_table(graph, ["cpu:0", kind])
            p = hetpar.plan(table, objective=args.objective)
            print(f"\n-- cpu:0 + {kind}")
            print(p.summary(table))
    return 0


def _measured_hint(timed: int) -> str:
    """Why a step calibrated here (--profile measure), set beside `timed`
    steps after compiling, may still differ from its prediction."""
    hint = ("the layers, the step and the runtime's costs were measured here "
            "(--profile measure), alone")
    if timed == 0:
        hint += "; the one step timed includes compilation: pass --steps 10"
    elif timed < 9:
        hint += f"; {_steps(timed)} timed after compiling: more --steps steady the median"
    return hint


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
