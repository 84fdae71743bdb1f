"""Where a one-device plan's 1-3% over `jax.jit` comes from, in one process.

bench_fit times hetpar's one-device plan and `jax.jit` in separate
processes: on one H200 the plan ran 1.02-1.03x jit's step (the 0.54B
Llama-style model 61.7-62.4 against 60.6-60.7 ms, run 69; the zoo 5.04B
and HF 2.9B 1.02x, run 66). The plan runs `jax.jit` of the same step with
explicit single-device shardings (`CompiledStep._one_device_jit`), and on
CPU its executable holds the same instructions as plain jit's; hetpar's own
dispatch costs ~30 us a call for 300 state arrays. So the gap is either the
executable (XLA's GPU autotuning picking other kernels in another compile)
or the process (the calibration's leftovers in the allocator, the host-built
state), and this probe tells them apart:

  jit          `jax.jit(step, donate_argnums=(0, 1))`, the state built on the GPU;
  jit_sharded  the same with hetpar's explicit shardings in and out;
  hetpar       `hetpar.auto(step)` (calibrated at its first call, as users get it).

Each arm has its own copy of the state; the arms take turns, a few steps
each, in rounds whose order alternates, so drift (clocks, heat) falls on
all of them. Per arm: the median step and its ratio to jit's, and whether
its compiled executable's instructions equal jit's (kernel choices
included: the backend configs XLA's autotuner writes).

Usage (one GPU):
  python experiments/probe_jit_gap.py --models llama,hf_llama3b --out R_gap.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import time


def _normalized(text: str) -> collections.Counter:
    """An executable's instructions, names and source metadata taken out,
    counted: two compiles of one program compare equal unless XLA chose
    differently (fusions, layouts, kernels and the configs its autotuner
    wrote into them)."""
    out = collections.Counter()
    for line in text.splitlines():
        if line.startswith("HloModule") or not line.strip() or re.match(r"\s*\d+ [{\"]", line):
            continue  # the header, and the source tables (files, functions, frames)
        line = re.sub(r",? metadata=\{[^}]*\}", "", line)
        line = re.sub(r", sharding=\{[^}]*\}|, frontend_attributes=\{.*\}(?=$|,)", "", line)
        line = re.sub(r"%[\w.\-]+", "%", line)
        line = re.sub(r"[\w.\-]+: ", ": ", line)  # a computation's parameter names
        out[line.strip()] += 1
    return out


def _executable_lines(jitted, args) -> list[str]:
    from hetpar._compiled_step import _may_trace  # hetpar's jit traces only inside it

    with _may_trace():
        return _normalized(jitted.lower(*args).compile().as_text())


def run(models: list[str], rounds: int, per_round: int, arms: list[str],
        tiny: bool = False) -> list[dict]:
    import jax
    from bench_fit import _workload

    import hetpar

    gpu = jax.devices()[0]
    cells = []
    for name in models:
        train_step, init, _ = _workload(name, None, tiny)
        with jax.default_device(gpu):
            made = init(jax.random.key(0))
        state = {}
        steps = {}
        sharding = jax.sharding.SingleDeviceSharding(gpu)
        for arm in arms:
            state[arm] = list(jax.tree_util.tree_map(lambda x: x.copy(), made))
            if arm == "jit":
                steps[arm] = jax.jit(train_step, donate_argnums=(0, 1))
            elif arm == "jit_sharded":
                steps[arm] = jax.jit(train_step, in_shardings=sharding,
                                     out_shardings=sharding, donate_argnums=(0, 1))
            else:
                devices = list(dict.fromkeys([f"{gpu.platform}:0", "cpu:0"]))
                steps[arm] = hetpar.auto(train_step, devices=devices, donate_argnums=(0, 1))
                state[arm] = list(steps[arm].place(*state[arm]))
        del made
        first = {}
        for arm in arms:
            t = time.perf_counter()
            p, o, loss = steps[arm](*state[arm])
            float(loss)
            state[arm][:2] = [p, o]
            first[arm] = time.perf_counter() - t
            print(f"{name} {arm}: first call {first[arm]:.1f} s", file=sys.stderr, flush=True)
        times = {arm: [] for arm in arms}
        for r in range(rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                p, o, b = state[arm]
                for _ in range(per_round):
                    t = time.perf_counter()
                    p, o, loss = steps[arm](p, o, b)
                    float(loss)
                    jax.block_until_ready((p, o))
                    times[arm].append(time.perf_counter() - t)
                state[arm][:2] = [p, o]
        medians = {arm: statistics.median(ts[per_round:]) for arm, ts in times.items()}
        cell = {"model": name, "card": gpu.device_kind, "jax": jax.__version__,
                "rounds": rounds, "per_round": per_round, "first_call_s": first,
                "median_ms": {a: m * 1e3 for a, m in medians.items()},
                "vs_jit": {a: m / medians["jit"] for a, m in medians.items()},
                "times_ms": {a: [t * 1e3 for t in ts] for a, ts in times.items()}}
        # The executables: hetpar's one-device jit against plain jit's.
        try:
            base = _executable_lines(steps["jit"], state["jit"])
            for arm in arms[1:]:
                jitted = steps[arm]
                if arm == "hetpar":
                    jitted = steps[arm]._last._one_device_jits[gpu]
                lines = _executable_lines(jitted, state[arm])
                cell.setdefault("executable", {})[arm] = {
                    "lines": sum(lines.values()), "jit_lines": sum(base.values()),
                    "only_jit": sum((base - lines).values()),
                    "only_here": sum((lines - base).values()),
                    "examples": [[a[:300] for a in (base - lines)][:3],
                                 [b[:300] for b in (lines - base)][:3]]}
        except Exception as e:  # noqa: BLE001 - the timings stand without it
            cell["executable_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps({k: cell[k] for k in ("model", "median_ms", "vs_jit")}), flush=True)
        cells.append(cell)
        del state, steps
    return cells


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--per-round", type=int, default=5)
    p.add_argument("--arms", default="jit,jit_sharded,hetpar")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="a smoke run's shapes (CPU)")
    args = p.parse_args(argv)
    cells = run(args.models.split(","), args.rounds, args.per_round, args.arms.split(","),
                args.tiny)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
