"""Does a memory-capped plan fit its cap on the real GPU? (issue 17)

The planner's GPU memory caps (`hetpar.auto(memory=...)`) are a constraint
it plans under; the cards it ran on had room, so a plan that held more than
it counted still ran (the batch-16 offload plans of
results/predictions_memory_bound recomputed layers the runtime could not).
This checks the other side: each step in a fresh process, where the GPU's
`peak_bytes_in_use` counts only that step.

    python experiments/probe_plan_memory.py plan --fraction 0.25 --batch 16 --out DIR
        # plans GPT-2 small under hetpar.auto(profile="measure") with the GPU
        # capped at fraction x what the step needs; writes DIR/plan_<f>.json
    python experiments/probe_plan_memory.py run --plan DIR/plan_<f>.json --batch 16 --out DIR
        # fresh process: 12 steps under the plan (--steps), the GPU's peak bytes
        # (--stages: each stage timed, serialised; --watch: one step's compute
        # and copies as it runs; --prefetch N: the runtime's Executor.PREFETCH;
        # --sharded_puts: the engine's copies put as before 2026-11-28;
        # --memory_trace: first a serialised step, the bytes after each stage;
        # --memory_timeline: a step as it runs, its bytes in use sampled)
    python experiments/probe_plan_memory.py jit --batch 16 --out DIR
        # fresh process: 5 steps under jax.jit on the GPU, its peak bytes
    python experiments/probe_plan_memory.py layers --layers lm_head,wte --device cpu:0 --out DIR
        # those layers timed alone (10 runs, every sample), as profile="measure" does
    python experiments/probe_plan_memory.py plan --small --batch 8 --device cpu:1 --out DIR
        # a smoke test on virtual CPU devices (no peak bytes there)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import numpy as np

import hetpar
from hetpar import zoo
from hetpar.cost_models import resolve_device


def _workload(batch: int, small: bool = False):
    # Built on the host: initialised on the default device (the GPU), the
    # state's 1.49 GB stayed in the GPU's peak bytes after it was copied off
    # (every run until 2026-11-28 peaked there, which was put down to the compile).
    with jax.default_device(jax.devices("cpu")[0]):
        w = zoo.get("transformer", batch=batch, small=small)
        example = jax.tree_util.tree_map(np.asarray, w.example_args())
    return w, example


def _peak(device: str) -> float | None:
    """The device's peak bytes in use in this process (None: not reported, a CPU)."""
    stats = resolve_device(device).memory_stats() or {}
    return float(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None


def _in_use(device: str) -> float | None:
    return (resolve_device(device).memory_stats() or {}).get("bytes_in_use")


def _resident(tree, device: str) -> float:
    """Bytes of `tree`'s arrays in `device`'s own memory (not its pinned host memory)."""
    dev = resolve_device(device)
    return float(sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)
                     if isinstance(x, jax.Array) and dev in x.devices()
                     and x.sharding.memory_kind in (None, "device")))


def _take(args: list) -> tuple[list, object]:
    """The state and batch, taken out of `args`: the list the caller passes, which
    each function here leaves holding the newest state. Only one state stays
    alive, as in a training loop that rebinds it; a caller holding on to the
    placed arguments kept a second copy on the GPU through every step (173 MB
    of the 1.36-1.38 GB peaks before 2026-11-28's memory_trace section)."""
    state, batch = list(args[:-1]), args[-1]
    if isinstance(args, list):
        args.clear()
    return state, batch


def _lowered(step, args: list) -> tuple:
    """(state, batch, the step's Executor), the state taken out of `args` (`_take`);
    given back and the Executor None where the whole step is one executable."""
    state, batch = _take(args)
    try:
        ex = step.lower(*state, batch)._executor
    except BaseException:
        args[:] = [*state, batch]
        raise
    if ex is None:
        args[:] = [*state, batch]
    return state, batch, ex


def _steps(step, args, n: int = 5, times: list | None = None,
           stacks: dict | None = None) -> float:
    """The median seconds of steps 2..n (each step's seconds appended to `times`;
    `stacks`, a dict: the threads sampled through the last step, `_Sampler`)."""
    state, batch = _take(args)
    times = [] if times is None else times
    sampler = None
    try:
        for i in range(n):
            if stacks is not None and i == n - 1:
                sampler = _Sampler()
                sampler.start()
            t0 = time.perf_counter()
            if sampler:
                sampler.t0 = t0
            *state, loss = step(*state, batch)
            jax.block_until_ready((state, loss))
            times.append(time.perf_counter() - t0)
    finally:
        if sampler:
            stacks.update(sampler.stop(), step_s=times[-1])
        if isinstance(args, list):
            args[:] = [*state, batch]
    return float(np.median(times[1:]))


def _alone(w, example, spec: str, device: str) -> dict:
    """Each layer of `spec` (LAYER or LAYER@DEVICE, comma-separated; `device`
    where none is named) timed alone in this process, as profile="measure"
    times it (10 runs, every sample): beside `run --stages`, a stage's time
    and its layer's with no spread between processes."""
    from hetpar.cost_models import measure_layer

    graph = hetpar.trace(w.train_step, *example)
    rows = {}
    for item in spec.split(","):
        layer, _, on = item.partition("@")
        t = measure_layer(graph, layer, on or device, k=10, budget_s=None)
        rows[item] = {"typical_s": t.typical_s, "median_s": t.median_s,
                      "samples": list(t.samples), "cached": t.cached}
    return rows


def _stage_times(step, args, n: int = 5) -> dict:
    """Each stage's median compute seconds over `n` steps (`Executor.record_events`
    serialises the step: a breakdown, not the step time), by device, with its
    layers and phase, the slowest first."""
    state, batch, ex = _lowered(step, args)
    if ex is None:
        return None
    stages = {s.index: s for s in ex.stages.stages}
    ex.record_events = True
    per: dict[int, list[float]] = {}
    walls = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            *state, loss = step(*state, batch)
            jax.block_until_ready((state, loss))
            walls.append(time.perf_counter() - t0)
            for ev in ex.last_events:
                if ev.what == "compute":
                    per.setdefault(ev.stage, []).append(ev.end_s - ev.start_s)
    finally:
        ex.record_events = False
        args[:] = [*state, batch]
    rows = sorted(({"stage": i, "device": stages[i].device, "phase": stages[i].phase,
                    "layers": list(stages[i].layers), "s": float(np.median(v))}
                   for i, v in per.items()), key=lambda r: -r["s"])
    busy: dict[str, float] = {}
    for r in rows:
        busy[r["device"]] = busy.get(r["device"], 0.0) + r["s"]
    return {"serialised_step_s": float(np.median(walls)), "busy_s": busy, "stages": rows[:12]}


def _watched(step, args, n: int = 3, stacks: dict | None = None) -> list[dict]:
    """The last of `n` steps as it runs, not serialised (`Executor.watch_events`):
    each stage's compute, copies in and copies out, seconds from the step's start.

    `stacks` (a dict, filled): the last step's Python threads sampled every
    ~2 ms (each thread's innermost frames) and the garbage collector's passes,
    on the events' clock: what the host does where no stage runs."""
    from hetpar.runtime import _executor

    state, batch, ex = _lowered(step, args)
    if ex is None:
        return None
    ex.watch_events = True
    sampler = _Sampler() if stacks is not None else None
    original = _executor._Run.__init__

    def init(run, *a, **k):  # the events' clock starts at the last _Run's t0
        original(run, *a, **k)
        if sampler:
            sampler.t0 = run.t0
    _executor._Run.__init__ = init
    try:
        for i in range(n):
            if sampler and i == n - 1:
                sampler.start()
            *state, loss = step(*state, batch)
            jax.block_until_ready((state, loss))
    finally:
        _executor._Run.__init__ = original
        if sampler:
            stacks.update(sampler.stop())
        ex.watch_events = False
        args[:] = [*state, batch]
    names = {s.index: list(s.layers) for s in ex.stages.stages}
    return [{**dataclasses.asdict(ev), "layers": names.get(ev.stage)} for ev in ex.last_events]


class _Sampler:
    """Samples every Python thread's innermost frames, and times the garbage
    collector's passes, from a daemon thread (a gap in its samples is a stretch
    where another thread held the interpreter)."""

    def __init__(self, every_s: float = 0.002, depth: int = 4):
        import threading

        self.every_s, self.depth, self.t0 = every_s, depth, None
        self.samples: list = []
        self.gc: list = []
        self._gc_start = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_gc(self, phase, info):
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
        elif self._gc_start is not None:
            self.gc.append({"start": self._gc_start, "s": now - self._gc_start,
                            "generation": info.get("generation"),
                            "collected": info.get("collected")})

    def _run(self):
        import sys
        import threading
        import traceback

        me = threading.get_ident()
        names = {}
        while not self._stop.is_set():
            now = time.perf_counter()
            for t in threading.enumerate():
                names[t.ident] = t.name
            threads = {}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = traceback.extract_stack(frame)[-self.depth:]
                threads[names.get(ident, str(ident))] = [
                    f"{pathlib.Path(f.filename).name}:{f.name}:{f.lineno}" for f in stack]
            self.samples.append({"t": now, "threads": threads})
            time.sleep(self.every_s)

    def start(self):
        import gc

        gc.callbacks.append(self._on_gc)
        self._thread.start()

    def stop(self) -> dict:
        import gc

        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_gc)
        t0 = self.t0 or 0.0
        return {"samples": [{**s, "t": s["t"] - t0} for s in self.samples],
                "gc": [{**g, "start": g["start"] - t0} for g in self.gc]}


def _memory_trace(step, args, device: str) -> list[dict]:
    """One step, serialised (`Executor.record_events`), with the device's bytes in
    use and peak after each stage, and what its live arrays are by shape: which
    stage reaches the peak, and holding what."""
    from hetpar.runtime import _executor

    state, batch, ex = _lowered(step, args)
    if ex is None:
        return None
    dev = resolve_device(device)
    rows = []
    original = _executor._Run._stage

    def traced(run, idx, st, name, d):
        outs = original(run, idx, st, name, d)
        jax.block_until_ready(outs)
        live = [x for x in jax.live_arrays() if dev in x.devices()  # not its pinned host
                and x.sharding.memory_kind in (None, "device")]
        shapes: dict[str, list] = {}
        for x in live:
            key = f"{x.dtype}{list(x.shape)}"
            shapes.setdefault(key, [0, 0.0])
            shapes[key][0] += 1
            shapes[key][1] += x.nbytes
        top = sorted(shapes.items(), key=lambda kv: -kv[1][1])[:8]
        stats = dev.memory_stats() or {}
        rows.append({"stage": idx, "device": name, "phase": st.phase, "layers": list(st.layers),
                     "in_use": stats.get("bytes_in_use"), "peak": stats.get("peak_bytes_in_use"),
                     "live_bytes": float(sum(x.nbytes for x in live)),
                     "live_by_shape": {k: {"count": c, "bytes": b} for k, (c, b) in top}})
        return outs

    ex.record_events = True
    _executor._Run._stage = traced
    try:
        *state, loss = step(*state, batch)
        jax.block_until_ready((state, loss))
    finally:
        _executor._Run._stage = original
        ex.record_events = False
        args[:] = [*state, batch]
    return rows


def _memory_timeline(step, args, device: str, n: int = 3) -> dict:
    """The last of `n` steps as it runs (not serialised): the device's bytes in
    use sampled from a thread every ~0.2 ms, beside each stage's compute and
    copies (`Executor.watch_events`), times from the step's start."""
    import threading

    state, batch, ex = _lowered(step, args)
    if ex is None:
        return None
    dev = resolve_device(device)
    samples: list = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.perf_counter(), (dev.memory_stats() or {}).get("bytes_in_use")))
            time.sleep(2e-4)

    thread = threading.Thread(target=sample, daemon=True)
    ex.watch_events = True
    try:
        for i in range(n):
            if i == n - 1:  # the last step alone is sampled
                thread.start()
                start = time.perf_counter()  # ~ the step's own t0 (events count from it)
            *state, loss = step(*state, batch)
            jax.block_until_ready((state, loss))
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        ex.watch_events = False
        args[:] = [*state, batch]
    names = {s.index: list(s.layers) for s in ex.stages.stages}
    peak_t, peak = max(samples, key=lambda s: s[1] or 0, default=(start, None))
    return {"peak_in_use": peak, "peak_s": peak_t - start,
            "samples": [(round(t - start, 5), b) for t, b in samples],
            "events": [{**dataclasses.asdict(ev), "layers": names.get(ev.stage)}
                       for ev in ex.last_events]}


def _write(out: pathlib.Path, name: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("plan", "run", "jit", "layers"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="gpu:0", help="the capped accelerator")
    ap.add_argument("--host", default="cpu:0", help="where state may go")
    ap.add_argument("--small", action="store_true", help="the small config (a smoke test)")
    ap.add_argument("--layers", default="lm_head",
                    help="layers: comma-separated layers to time alone on --device")
    ap.add_argument("--stages", action="store_true",
                    help="run: also time each stage alone (a serialised breakdown)")
    ap.add_argument("--watch", action="store_true",
                    help="run: also record one step's compute and copies as it runs")
    ap.add_argument("--stacks", action="store_true",
                    help="run: sample the Python threads' stacks and the garbage "
                         "collector's passes through the last timed step (and with "
                         "--watch, the watched step)")
    ap.add_argument("--no_gc", action="store_true",
                    help="run: the garbage collector off through the timed and watched steps")
    ap.add_argument("--steps", type=int, default=12,
                    help="run: steps timed (the first is left out of the median)")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="run: stages reading streamed state in flight per device "
                         "(Executor.PREFETCH; default the runtime's)")
    ap.add_argument("--alone", default="",
                    help="run: then time these layers alone in the same process, "
                         "LAYER@DEVICE,... (as profile='measure' times them; beside --stages)")
    ap.add_argument("--sharded_puts", action="store_true",
                    help="plan, run: the transfer engine puts copies to a SingleDeviceSharding, "
                         "as before 2026-11-28 (TransferEngine.PUT_TO_DEVICE = False)")
    ap.add_argument("--memory_trace", action="store_true",
                    help="run: first one serialised step with the GPU's bytes in use, peak "
                         "and live arrays after each stage")
    ap.add_argument("--memory_timeline", action="store_true",
                    help="run: then a step as it runs, the GPU's bytes in use sampled "
                         "beside each stage's compute and copies")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    w, example = _workload(args.batch, args.small)
    kind = resolve_device(args.device).device_kind
    if args.sharded_puts:
        from hetpar.runtime import TransferEngine

        TransferEngine.PUT_TO_DEVICE = False
    if args.what == "plan":
        graph = hetpar.trace(w.train_step, *example)
        need = sum(graph[la].memory_bytes for la in graph.layers)
        cap = args.fraction * need
        step = hetpar.auto(w.train_step, devices=[args.device, args.host],
                           memory={args.device: cap}, profile="measure")
        compiled = step.lower(*example)
        tag = "_sharded" if args.sharded_puts else ""
        path = out / f"plan_{args.fraction:g}{tag}.json"
        out.mkdir(parents=True, exist_ok=True)
        compiled.plan.save(path)
        compiled.table.save(out / f"table_{args.fraction:g}{tag}.json")  # what it planned with
        p = compiled.plan.predicted
        _write(out, f"planned_{args.fraction:g}{tag}.json", {
            "batch": args.batch, "fraction": args.fraction, "need_bytes": need,
            "cap_bytes": cap, "plan": str(path),
            "predicted_bytes": p.memory_bytes.get(args.device),
            "predicted_peak_bytes": (p.peak_memory_bytes or {}).get(args.device),
            "predicted_step_s": p.step_time_s, "solver": compiled.plan.solver})
    elif args.what == "run":
        if args.prefetch is not None:
            from hetpar.runtime import Executor

            Executor.PREFETCH = args.prefetch
        step = hetpar.auto(w.train_step, plan=args.plan)
        step.lower(*example)  # compiles: XLA's autotuning takes memory of its own
        compiled_peak = _peak(args.device)
        placed = list(step.place(*example))  # handed from function to function
        after_place = {"peak": _peak(args.device), "in_use": _in_use(args.device),
                       "resident": _resident(placed, args.device)}
        # The serialised step first (a fresh process: its peak is its own; it
        # peaks below the loop's), the sampled one after the loop (watched
        # steps keep a stage's copied inputs a stage longer).
        traced = _memory_trace(step, placed, args.device) if args.memory_trace else None
        peak_after_trace = _peak(args.device)
        if args.no_gc:
            import gc

            gc.collect()
            gc.disable()
        every: list[float] = []
        unwatched = {} if args.stacks else None
        t = _steps(step, placed, args.steps, every, stacks=unwatched)
        peak = _peak(args.device)
        in_use = _in_use(args.device)
        timeline = (_memory_timeline(step, placed, args.device) if args.memory_timeline
                    else None)
        stacks = {} if args.stacks and args.watch else None
        watched = _watched(step, placed, stacks=stacks) if args.watch else None
        stages = _stage_times(step, placed) if args.stages else None
        alone = _alone(w, example, args.alone, args.host) if args.alone else None
        tag = ("" if args.prefetch is None else f"_prefetch{args.prefetch}") + (
            "_sharded" if args.sharded_puts else "") + ("_nogc" if args.no_gc else "")
        _write(out, f"ran_{pathlib.Path(args.plan).stem}{tag}.json", {
            "batch": args.batch, "plan": args.plan, "peak_bytes_in_use": peak,
            "peak_after_compile": compiled_peak, "after_place": after_place,
            "in_use_after_steps": in_use, "step_s": t, "step_times_s": every, "device": kind,
            "prefetch": args.prefetch, "stage_breakdown": stages, "alone": alone,
            "timeline": watched, "stacks": stacks, "stacks_unwatched": unwatched,
            "peak_after_memory_trace": peak_after_trace if traced else None,
            "memory_trace": traced, "memory_timeline": timeline})
    elif args.what == "layers":
        _write(out, f"layers_{args.device.replace(':', '')}.json",
               {"batch": args.batch, "device": args.device, "kind": kind,
                "layers": _alone(w, example, args.layers, args.device)})
    else:
        step = jax.jit(w.train_step)
        t = _steps(step, jax.device_put(example, resolve_device(args.device)))
        _write(out, "ran_jit.json", {"batch": args.batch, "peak_bytes_in_use": _peak(args.device),
                                     "step_s": t, "device": kind})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
