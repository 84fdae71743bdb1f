"""Plans that hold on the machine they run on (issue 41): a grid of GPU sizes.

Each cell trains `hetpar.auto(step)`'s own plan over the GPU and its host CPU
for `--steps` steps, in its own process with `XLA_PYTHON_CLIENT_MEM_FRACTION`
set (so the GPU looks like a smaller card and each cell's memory high-water
mark is its own), beside `jax.jit` on the GPU in another process where it
fits. Per cell: the plan hetpar chose, whether anything ran out of memory
(and whether hetpar replanned), the predicted, compiled (the check before
the first step, hetpar/_memory_check.py) and measured GPU peak
(`peak_bytes_in_use`), the predicted and measured median step, and the
first call (trace, plan, compile, place; `step.report()`'s breakdown) against
`jax.jit`'s first step.

    python experiments/bench_fit.py --models llama,zoo --fractions 0.1,0.3,default \
        --out experiments/results/fit_h200/fit.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# The grid's models (issue 41): name -> (kind, config, batch). `llama` is
# experiments/llama_style.py, written as users write it; `zoo` the zoo
# transformer as bench_offload.py runs it.
MODELS = {
    "llama": ("llama", {}, 8),                                   # 0.54B
    "llama7b": ("llama", dict(d_model=4096, num_layers=32, num_heads=32, hidden=11008), 4),
    "zoo": ("zoo", dict(d_model=2048, num_layers=16, num_heads=16), 8),   # 0.91B
    "zoo5b": ("zoo", dict(d_model=4096, num_layers=24, num_heads=32), 8),  # 5.04B
    # A third-party model: Hugging Face's FlaxLlamaForCausalLM from a config,
    # trained as run_clm_flax.py trains (transformers 4.x; 5.x dropped Flax).
    "hf_llama3b": ("hf_llama", dict(hidden_size=3072, intermediate_size=8192,
                                    num_hidden_layers=24, num_attention_heads=24), 4),  # 2.9B
}


def _workload(name: str, batch: int | None, tiny: bool = False):
    """(train_step, init(key) -> (params, opt_state, batch), parameters)."""
    kind, config, default_batch = MODELS[name]
    batch = batch or default_batch
    if kind == "llama":
        import llama_style

        cfg = (llama_style.Config(vocab=256, d_model=64, num_layers=2, num_heads=4, hidden=128)
               if tiny else llama_style.Config(**config))
        step, init = llama_style.make(cfg, batch=batch, seq=16 if tiny else 512)
        return step, init, llama_style.parameter_count(cfg)
    if kind == "hf_llama":
        return _hf_llama(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, vocab_size=256) if tiny else config,
                         batch, 16 if tiny else 512)
    from hetpar import zoo

    w = (zoo.get("transformer", small=True) if tiny else
         zoo.get("transformer", batch=batch, **config))
    return w.train_step, (lambda key: w.example_args()), None


def _hf_llama(config: dict, batch: int, seq: int):
    """FlaxLlamaForCausalLM built from a config (no download) and the step
    Hugging Face's run_clm_flax.py writes: next-token cross-entropy, clipped
    AdamW, `jax.value_and_grad`."""
    import jax
    import optax

    try:
        from transformers import FlaxLlamaForCausalLM, LlamaConfig
    except ImportError as e:
        raise SystemExit(f"hf_llama3b needs transformers 4.x with Flax models ({e}); 5.x "
                         "dropped them: pip install 'transformers<5'") from e

    cfg = LlamaConfig(**{"vocab_size": 32000, **config})  # 2048 positions
    model = FlaxLlamaForCausalLM(cfg, input_shape=(1, seq), seed=0, _do_init=False)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.01))

    def train_step(params, opt_state, batch):
        def loss_fn(params):
            logits = model(batch["input_ids"], params=params, train=False).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], batch["input_ids"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init(key):
        params = jax.jit(lambda k: model.init_weights(k, (1, seq)))(key)
        ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)
        return params, jax.jit(tx.init)(params), {"input_ids": ids}

    return train_step, init, None


#: Each step's seconds to its loss, beside `_median_step`'s to its whole
#: state: waiting for every one of a step's results may itself cost (a step
#: clock waiting for 1,700 of them cost an fsdp step over two H200s 10-15
#: ms, fit_h200x2 run 71), where a loop that reads its loss waits for one.
_TO_LOSS: list = []


#: The steps each cell runs after its first call and before the timed
#: ones, in every mode (`--settle`), timed apart (`settle_times_s`):
#: hetpar's `StepClock` waits in its calls 2-8 for the step's results
#: (2 settling, 5 timed), which cost each of those calls 5-8 ms of a 50 ms
#: fsdp step over two H200s (run 75, experiments/probe_clock.py), and runs
#: 70-73 timed their ten steps mostly among them.
_TO_SETTLE: list = []


def _median_step(step, state, batch, steps, memory: list | None = None, gpu=None,
                 settle: int = 0):
    """Times `steps` steps to the whole new state (each step's time to its
    loss alone goes to `_TO_LOSS`) after `settle` steps timed apart
    (`_TO_SETTLE`); `memory`, a list, gets `gpu`'s bytes in
    use before each step, the settling ones first, and its high-water mark
    after it (GB): whether a
    later step holds more than the first (run 23's 0.54B cell ran out of
    memory on its second step, the first having peaked 0.8 GB under the
    limit)."""
    import jax

    params, opt_state = state
    times = []
    _TO_SETTLE.clear()
    _TO_LOSS.clear()
    for i in range(settle + steps):  # (`memory` gets the settling steps' too)
        if i == settle:  # the settling steps' times apart
            _TO_SETTLE[:] = times
            times, _TO_LOSS[:] = [], []
        before = (gpu.memory_stats() or {}) if gpu is not None else {}
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
        _TO_LOSS.append(time.perf_counter() - t)
        jax.block_until_ready((params, opt_state))
        times.append(time.perf_counter() - t)
        if memory is not None and gpu is not None:
            after = gpu.memory_stats() or {}
            memory.append([before.get("bytes_in_use", 0) / 1e9,
                           after.get("peak_bytes_in_use", 0) / 1e9])
    state[:] = [params, opt_state]  # the caller's list: what the last step returned
    return times, float(loss)


def _sample_stacks(every_s: float) -> None:
    """Every `every_s` seconds, one stderr line naming where the main thread
    is: its project frames (hetpar, cost_models, passes) and its innermost
    frame. A Python thread reading `sys._current_frames()`, not
    faulthandler's dump (run 17's cell died with SIGSEGV while faulthandler
    dumped its stacks): a timed-out cell's lines then say where its time went."""
    import threading
    import traceback

    main = threading.main_thread().ident
    import logging

    start = logging._startTime  # the progress lines' clock (%(relativeCreated))

    def sample():
        while True:
            time.sleep(every_s)
            frame = sys._current_frames().get(main)
            if frame is None:
                return
            stack = traceback.extract_stack(frame)
            # Not held while sleeping: a frame keeps its locals, and those of
            # the frames below it, alive. Held, the last sampled step's
            # values stayed on the GPU through the next steps (runs 20-25:
            # 1.6 GB of a 0.54B plan's weight copies, so that its later
            # steps peaked 1.7 GB over the first, and one ran out of memory).
            del frame
            ours = [f"{os.path.basename(f.filename)}:{f.name}" for f in stack
                    if re.search(r"/(hetpar|cost_models|passes)/", f.filename)]
            inner = stack[-1]
            print(f"{(time.time() - start) * 1e3:8.0f} ms hetpar-stack: "
                  f"{' > '.join(ours[-8:])} | {os.path.basename(inner.filename)}:{inner.name}"
                  f" {_host_rss()}", file=sys.stderr, flush=True)

    threading.Thread(target=sample, daemon=True).start()


def _sample_memory(every_s: float) -> None:
    """Every `every_s` seconds, one stderr line of what each GPU's allocator
    holds ("hetpar-memory: gpu:0 37.3 GB, gpu:1 30.3 GB"), on the progress
    lines' clock: which phase of a first call left memory held (on two
    H200s gpu:0 held 7 GB beyond its live arrays after the first call, gpu:1
    none: run 61)."""
    import logging
    import threading

    import jax

    start = logging._startTime
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]

    def sample():
        last = None
        while True:
            time.sleep(every_s)
            held = [((d.memory_stats() or {}).get("bytes_in_use", 0)) / 1e9 for d in gpus]
            if last is not None and max(abs(a - b) for a, b in zip(held, last)) < 0.05:
                continue  # a line per change of 50 MB or more
            last = held
            print(f"{(time.time() - start) * 1e3:8.0f} ms hetpar-memory: " + ", ".join(
                f"gpu:{d.id} {h:.2f} GB" for d, h in zip(gpus, held)), file=sys.stderr,
                flush=True)

    if gpus:
        threading.Thread(target=sample, daemon=True).start()


def _host_rss() -> str:
    """"host RSS 81.2 GB (high-water 83.0 GB)": the process's resident memory
    (`/proc/self/status`), what the OS kills a process for, where the planner
    counts only the CPU device's and memory places' arrays."""
    try:
        with open("/proc/self/status") as f:
            kb = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
        gb = {k: int(v.split()[0]) * 1024 / 1e9 for k, v in kb.items()}
        return f"host RSS {gb['VmRSS']:.1f} GB (high-water {gb['VmHWM']:.1f} GB)"
    except (OSError, KeyError, ValueError):
        return ""


def run_cell(args) -> dict:
    if args.stacks:
        _sample_stacks(args.stacks)
    if args.memory_every:
        _sample_memory(args.memory_every)
    import logging

    from absl import logging as absl_logging

    # hetpar's INFO lines (each layer timed, the plan's choices), stamped
    # with the seconds since the cell started: where its first call goes.
    absl_logging.set_verbosity(absl_logging.INFO)
    lines = logging.StreamHandler(sys.stderr)
    lines.addFilter(lambda r: r.getMessage().startswith("hetpar"))
    lines.setFormatter(logging.Formatter("%(relativeCreated)8.0f ms %(message)s"))
    logging.getLogger().addHandler(lines)
    import jax

    import hetpar

    try:
        gpus = jax.devices("gpu")[:args.gpus]
    except RuntimeError:  # a smoke run on CPUs (--tiny, host devices 1..gpus stand in)
        gpus = jax.devices("cpu")[1:1 + args.gpus]
    if len(gpus) < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: this machine has {len(gpus)}")
    accs = [f"{g.platform}:{g.id}" for g in gpus]
    gpu = gpus[0]
    cpu = jax.devices("cpu")[0]
    from hetpar.cost_models import cache_dir

    # hetpar calibrates at its first call (the default profile): a cell run
    # after another of the same model finds its timings on disk (warm).
    warm = (cache_dir() / "step").is_dir()
    out = {"model": args.model, "fraction": args.fraction, "mode": args.mode,
           "gpus": args.gpus, "cache": "warm" if warm else "cold", "card": gpu.device_kind,
           "limit_gb": (gpu.memory_stats() or {}).get("bytes_limit", 0) / 1e9,
           "host": _host()}
    train_step, init, n = _workload(args.model, args.batch, args.tiny)
    # hetpar's state is built on the host by default: a cell whose GPU is too
    # small must still get its state, and step.place() then copies it where
    # the plan wants it. --state device builds it on the GPU, as jit's is
    # (the first call's comparison: the same inputs on both sides).
    # (jit over several GPUs places its state sharded from the host: it need
    # not fit one GPU.)
    on_host = ((args.mode == "hetpar" and args.state == "host") or len(gpus) > 1
               or args.mode == "jax_offload")
    out["state_on"] = "host" if on_host else "device"
    with jax.default_device(cpu if on_host else gpu):
        params, opt_state, batch = init(jax.random.key(0))
        jax.block_until_ready((params, opt_state, batch))
    out["params"] = n or sum(x.size for x in jax.tree_util.tree_leaves(params))
    out["state_gb"] = sum(x.nbytes for x in jax.tree_util.tree_leaves((params, opt_state))) / 1e9
    # The allocator's high-water mark cannot be reset: what building the state
    # left there says whether the step's own peak can be read from it.
    out["peak_after_init_gb"] = (gpu.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9
    t0 = time.perf_counter()
    try:
        donate = (0, 1) if args.donate else ()
        out["donate_argnums"] = list(donate)
        if args.mode == "jit":
            if len(gpus) > 1:  # FSDP written by hand: shardings only (_fsdp.py)
                from _fsdp import hand_sharded_jit

                step, (params, opt_state, batch) = hand_sharded_jit(
                    train_step, (params, opt_state, batch), gpus, donate_argnums=donate)
                out["jit"] = "fsdp"
            else:
                step = jax.jit(train_step, donate_argnums=donate)
            p, o, loss = step(params, opt_state, batch)
            float(loss)
            out["first_call_s"] = time.perf_counter() - t0
            times, loss = _median_step(step, [p, o], batch, args.steps, settle=args.settle)
        elif args.mode == "jax_offload":
            step, (params, opt_state, batch) = _jax_offload(
                train_step, (params, opt_state, batch), gpu, donate)
            p, o, loss = step(params, opt_state, batch)
            float(loss)
            out["first_call_s"] = time.perf_counter() - t0
            times, loss = _median_step(step, [p, o], batch, args.steps, settle=args.settle)
        else:
            step = hetpar.auto(train_step, devices=[*accs, "cpu:0"], donate_argnums=donate)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                params, opt_state, batch = step.place(params, opt_state, batch)
                # Calibrated, planned, compiled and placed:
                if args.plan_out:
                    _save_plan(step, args.plan_out)
                out["held_after_place"] = _held(gpu)
                out["host_after_place"] = _host_rss()
                p, o, loss = step(params, opt_state, batch)
                float(loss)
                out["first_call_s"] = time.perf_counter() - t0
                # The first step's own high-water mark, before later steps
                # (run 20's 0.54B cell ran out of memory on a later one).
                out["peak_after_first_call_gb"] = (
                    (gpu.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9)
                del params, opt_state
                state = [p, o]
                del p, o
                # What the GPU holds once the first call returned: the
                # allocator beside JAX's live arrays there, and what holds
                # the largest (run 24: 2.41 GB before every later step of the
                # 0.54B plan, whose state homed there is 0.79 GB).
                out["held_after_first_call"] = {**_held(gpu), "holders": _holders(gpu, 4)}
                out["host_after_first_call"] = _host_rss()
                out["step_memory_gb"] = []  # [in use before, high-water mark after]
                times, loss = _median_step(step, state, batch, args.steps,
                                           out["step_memory_gb"], gpu, settle=args.settle)
                out["held_after_steps"] = {**_held(gpu), "holders": _holders(gpu, 4)}
                out["host_after_steps"] = _host_rss()
            out["warnings"] = [f"{type(w.message).__name__}: {str(w.message)[:300]}"
                               for w in caught if "Memory" in type(w.message).__name__]
            plan = step.plan
            placements = step.placements
            out["plan"] = {
                "compute": _count(p.compute for p in placements.values()),
                "state": _count(p.state for p in placements.values()),
                "activations": _count(p.activations for p in placements.values()),
                "replicas": list(plan.replicas) if plan is not None else [],
                "sharding": getattr(plan, "sharding", None),
                "groups": sorted(getattr(plan, "groups", None) or ()),
                "chosen": (plan.solver or {}).get("chosen") if plan is not None else None,
            }
            # Predicted, compiled (the check before the first step) and measured
            # per device, and where the first call's time went (step.report()).
            summary = step.report().step
            # (bytes to GB; a flag, `measured_before_step`, stays one: run 73
            # recorded it as 1e-09)
            out["memory_gb"] = {d: {k: (v if v is None or isinstance(v, bool) else v / 1e9)
                                    for k, v in m.items()}
                                for d, m in summary["memory"].items()}
            out["first_call"] = summary["first_call"]
            # The host's RAM: its CPU devices and memory places summed, beside
            # the process's resident peak (run 50 was killed by the OS).
            out["host_memory_gb"] = {k: (v / 1e9 if isinstance(v, float) else v)
                                     for k, v in (summary.get("host_memory") or {}).items()}
            # A whole step over several GPUs: the collectives the planner priced
            # beside those its compiled executable moves, which its prediction
            # takes (run 47: the zoo's fsdp moved 3.7 GB a GPU where the model
            # counts 30).
            out["collectives"] = summary.get("collectives")
            if args.timeline and plan is not None:
                try:
                    out["timeline"] = _timelines(step, state, batch, args.timeline)
                    out["timeline"].pop("state")
                except Exception as e:  # noqa: BLE001 - the cell's figures stand without it
                    out["timeline"] = {"error": f"{type(e).__name__}: {e}"[:400]}
            if plan is not None:
                pred = plan.predicted
                peaks = dict(pred.peak_memory_bytes or pred.memory_bytes or {})
                for a in accs:  # (a --tiny run's stand-ins under the GPUs' names)
                    peaks[f"gpu:{accs.index(a)}"] = peaks.get(a)
                # The step's prediction (a whole step over several GPUs: with its
                # compiled collectives, hetpar/_compiled_collectives.py) beside
                # the planner's own.
                out["planned_s"] = pred.step_time_s
                out["predicted_s"] = summary.get("predicted_s") or pred.step_time_s
                out["predicted_peak_gb"] = {d: None if v is None else v / 1e9
                                            for d, v in peaks.items()}
                out["memory_caps"] = dict(step.options.memory or {})
    except Exception as e:  # noqa: BLE001 - the cell reports what failed
        import traceback

        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
        out["where"] = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
                        for f in traceback.extract_tb(e.__traceback__)[-6:]]
        out["after_first_call"] = "first_call_s" in out
        out["at_error"] = _held(gpu)
        return out
    stats = gpu.memory_stats() or {}
    # (Without settling steps the first timed step is left out, as before
    # `--settle`: runs up to 73.)
    skip = 0 if args.settle else 1
    out.update({"median_s": statistics.median(times[skip:]), "times_s": times, "loss": loss,
                "settle": args.settle, "settle_times_s": list(_TO_SETTLE),
                "median_to_loss_s": statistics.median(_TO_LOSS[skip:])
                if len(_TO_LOSS) > skip else None, "times_to_loss_s": list(_TO_LOSS),
                "gpu_peak_gb": (stats.get("peak_bytes_in_use") or 0) / 1e9,
                "gpu_peaks_gb": {a: ((g.memory_stats() or {}).get("peak_bytes_in_use") or 0)
                                 / 1e9 for a, g in zip(accs, gpus)}})
    return out


def _jax_offload(train_step, state, gpu, donate):
    """JAX's own host offload, written as its memory-kinds documentation
    writes it: the optimizer state in the GPU's pinned host memory, moved to
    the GPU inside the jitted step and its new value back; the parameters and
    the batch on the GPU. What a user writes by hand where `jax.jit` alone
    does not fit (bench_offload.py's `jax_offload_donated`)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    dev = SingleDeviceSharding(gpu)
    host = SingleDeviceSharding(gpu, memory_kind="pinned_host")
    params, opt_state, batch = state

    def offloaded(params, opt_state, batch):
        new_params, new_opt, loss = train_step(params, jax.device_put(opt_state, dev), batch)
        return new_params, jax.device_put(new_opt, host), loss

    placed = (jax.device_put(params, dev), jax.device_put(opt_state, host),
              jax.device_put(batch, dev))
    return jax.jit(offloaded, out_shardings=(dev, host, dev), donate_argnums=donate), placed


def _save_plan(step, base: str) -> None:
    """The plan's cost table and plan files, `base`.table.json and
    `base`.plan.json, written once the step is placed: a cell that dies in
    its first step still leaves them to plan again offline
    (`experiments/replan_table.py`; run 62 timed out with neither)."""
    compiled = step._last
    try:
        if compiled.table is not None:
            compiled.table.save(f"{base}.table.json")
        step.plan.save(f"{base}.plan.json")
    except Exception as e:  # noqa: BLE001 - the cell's figures stand without them
        print(f"bench_fit: the plan's files were not written: {type(e).__name__}: {e}",
              file=sys.stderr)


def _timelines(step, state, batch, where: str) -> dict:
    """One step watched as it runs (each device's compute and its copies in
    and out: `Executor.watch_events`) beside the planner's replay of the same
    plan, and the plan's cost table saved to `where` (the step's costs as
    calibrated here, to replan offline)."""
    from hetpar.planner import simulate

    compiled = step._last
    table = compiled.table
    os.makedirs(os.path.dirname(where) or ".", exist_ok=True)
    table.save(where)
    replay = simulate(table, compiled.placements)
    out = {"table": os.path.basename(where), "predicted": replay.timeline(),
           "predicted_s": replay.step_time_s}
    ex = compiled._executor
    if ex is None:  # one executable: no stages to watch
        out["state"] = state
        return out
    ex.watch_events = True
    t = time.perf_counter()
    params, opt_state, loss = step(*state, batch)
    float(loss)
    out["watched_s"] = time.perf_counter() - t
    ex.watch_events = False
    out["measured"] = [dataclasses.asdict(e) for e in ex.last_events]
    # One more step serialised, each accelerator's allocator read after each
    # stage, beside the compiled replay's figure for the same point.
    from hetpar._memory_check import compiled_peaks

    walk: list = []
    compiled_peaks(ex, walk)
    ex.record_memory = True
    try:
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
    finally:
        ex.record_memory = False
    replayed = {(w["device"], w["stage"]): w for w in walk}
    out["memory_walk"] = [
        {"stage": i, "device": d, "layers": list(ex.stages.stages[i].layers)[:3],
         "in_use_gb": (b or 0) / 1e9,
         "replay_after_gb": replayed.get((d, i), {}).get("after", 0) / 1e9,
         "replay_during_gb": replayed.get((d, i), {}).get("during", 0) / 1e9}
        for i, d, b in ex.last_memory if b is not None]
    out["host_stages"] = _host_stages_alone(ex, out["measured"])
    out["state"] = [params, opt_state]
    return out


def _host() -> dict:
    """The host CPU as this process sees it: its cores by count, by affinity
    and by cgroup quota (a quota under the count throttles a thread pool
    sized by the count), and the malloc tunables it started with."""
    quota = None
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            q, period = f.read().split()
            quota = None if q == "max" else int(q) / int(period)
    except (OSError, ValueError):
        pass
    return {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "cgroup_cpus": quota, "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}


def _host_stages_alone(ex, measured: list, runs: int = 5) -> list:
    """Each host CPU stage of the watched step, timed again alone on fresh
    inputs of its shapes (ones), beside its time in the step: whether a host
    stage runs at its own speed in the step (run 19: the 0.54B plan's host
    update stage took 536 ms in the step, its layers' updates 260 ms timed one
    by one, with no copy beside it; run 24: 556 ms against 249-264 ms alone).
    Timed twice: its inputs put on the CPU, and those another device makes
    brought there as the step brings them (`alone_moved_in_s`)."""
    import jax
    import numpy as np

    in_step = {e["stage"]: e["end_s"] - e["start_s"] for e in measured
               if e["what"] == "compute"}
    out = []
    for st in ex.stages.stages:
        dev = ex.devices.get(st.device)
        if dev is None or dev.platform != "cpu" or ex.compiled[st.index] is None:
            continue
        row = {"stage": st.index, "layers": list(st.layers), "phase": st.phase,
               "in_step_s": in_step.get(st.index), "inputs_gb": sum(
                   np.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize
                   for v in st.inputs) / 1e9}
        def inputs(moved: bool, st=st, dev=dev) -> list:
            # moved: what another device made comes as the step brings it,
            # through the transfer engine (GPU -> CPU: staged in the GPU's
            # pinned host memory, which the CPU array may then alias).
            out = []
            for v in st.inputs:
                x = np.ones(v.aval.shape, v.aval.dtype)
                p = ex._producer.get(v)
                src = None if p is None else ex.devices.get(ex.stages.stages[p].device)
                if moved and src is not None and src != dev:
                    out.append(ex.transfer.move(jax.device_put(x, src), dev))
                else:
                    out.append(jax.device_put(x, dev))
            return out

        for key, moved in (("alone_s", False), ("alone_moved_in_s", True)):
            try:
                times = []
                for _ in range(runs):
                    args = inputs(moved)
                    jax.block_until_ready(args)
                    t = time.perf_counter()
                    jax.block_until_ready(ex.compiled[st.index](*args))
                    times.append(time.perf_counter() - t)
                    del args
                row[key] = times
            except Exception as e:  # noqa: BLE001 - a stage whose inputs ones cannot stand for
                row["error"] = f"{type(e).__name__}: {e}"[:200]
        out.append(row)
    return out


def _held(gpu) -> dict:
    """What the GPU's allocator holds (in use, high-water mark) beside what
    JAX's live arrays hold, deduplicated by buffer (GB): on the GPU's own
    memory, by shape, largest first, and per device and memory kind. After
    an error, whether something the step no longer needs still holds memory;
    between steps, what a step left there."""
    import jax

    seen, by_shape, by_place, total = set(), {}, {}, 0
    for a in jax.live_arrays():
        try:
            if a.is_deleted():
                continue
            kind = getattr(a.sharding, "memory_kind", None)
            for s in a.addressable_shards:
                ptr = (s.device.id, s.device.platform, s.data.unsafe_buffer_pointer())
                if ptr in seen:
                    continue
                seen.add(ptr)
                place = f"{s.device.platform}:{s.device.id}:{kind}"
                by_place[place] = by_place.get(place, 0) + s.data.nbytes / 1e9
                if s.device == gpu and kind in (None, "device"):
                    total += s.data.nbytes
                    key = f"{a.shape} {a.dtype}"
                    by_shape[key] = by_shape.get(key, 0) + s.data.nbytes
        except Exception:  # noqa: BLE001 - an array being deleted
            continue
    stats = gpu.memory_stats() or {}
    top = sorted(by_shape.items(), key=lambda kv: -kv[1])[:8]
    # Every GPU's allocator, set against its live arrays above: on two H200s
    # gpu:0 held 7 GB beyond its arrays where gpu:1 held none (run 61).
    every = {f"gpu:{d.id}": ((d.memory_stats() or {}).get("bytes_in_use", 0) / 1e9)
             for d in jax.local_devices() if d.platform == "gpu"}
    return {"in_use_gb": stats.get("bytes_in_use", 0) / 1e9,
            "peak_gb": stats.get("peak_bytes_in_use", 0) / 1e9,
            "in_use_by_gpu_gb": every,
            "live_arrays_gb": total / 1e9, "live_by_place_gb": by_place,
            "top": [(k, v / 1e9) for k, v in top]}


def _holders(gpu, n: int = 3) -> list:
    """For the `n` largest live arrays on the GPU, what refers to them, two
    levels up (type, size, and a dict's keys or an object's class)."""
    import jax

    arrays = sorted((a for a in jax.live_arrays() if not a.is_deleted() and gpu in a.devices()
                     and getattr(a.sharding, "memory_kind", None) in (None, "device")),
                    key=lambda a: -a.nbytes)[:n]
    here = {id(arrays)}

    def describe(o):
        kind = type(o).__name__
        if isinstance(o, dict):
            keys = [str(k)[:40] for k in list(o)[:3]]
            return f"dict[{len(o)}] keys {keys}"
        if isinstance(o, (list, tuple)):
            return f"{kind}[{len(o)}]"
        if hasattr(o, "f_code"):
            return f"frame {o.f_code.co_filename.split('/')[-1]}:{o.f_lineno} {o.f_code.co_name}"
        return kind

    out = []
    for a in arrays:
        chain = []
        for r in gc.get_referrers(a):
            if id(r) in here or r is arrays:
                continue
            ups = [describe(u) for u in gc.get_referrers(r)
                   if u is not arrays and not isinstance(u, type(sys._getframe()))][:4]
            chain.append({"holder": describe(r), "held by": ups})
        out.append({"shape": str(a.shape), "gb": a.nbytes / 1e9, "referrers": chain[:5]})
    return out


def _progress(err: list[str], timings: int = 40) -> list[str]:
    """hetpar's progress lines from a cell's stderr: every one but the
    per-layer timings ("[i/n] ..."), of which the first and last `timings`
    (run 19's cell kept its first and last 60 lines of all kinds, and lost
    the plan and the memory check's figures between them)."""
    lines = [ln[:400] for ln in err if " ms hetpar" in ln]
    layer = [i for i, ln in enumerate(lines) if re.search(r"hetpar: \[\d+/\d+\]", ln)]
    dropped = set(layer[timings:-timings]) if len(layer) > 2 * timings else set()
    return [ln for i, ln in enumerate(lines) if i not in dropped]


def _count(values) -> dict:
    out: dict = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def _row(cell: dict) -> str:
    def ms(x):
        return "" if x is None else f"{x * 1e3:.1f}"

    # Several GPUs: the one whose measured peak is furthest over its prediction.
    measured_by = cell.get("gpu_peaks_gb") or {"gpu:0": cell.get("gpu_peak_gb")}
    predicted_by = cell.get("predicted_peak_gb") or {}
    worst = max(measured_by, key=lambda d: (measured_by[d] or 0) / (predicted_by.get(d) or 1e-9))
    measured, pred_peak = measured_by[worst], predicted_by.get(worst)
    ratio = f"{measured / pred_peak:.2f}" if pred_peak and measured else ""
    # The check before the first step (the compiled stages replayed): the
    # memory model issue 41 asks to agree with the allocator.
    summary = (cell.get("memory_gb") or {}).get(worst) or {}
    compiled = summary.get("compiled")
    if compiled and measured:
        ratio += f" (compiled {measured / compiled:.2f})"
    if summary.get("measured_before_step"):  # the calibration's, not the step's (run 73)
        ratio += ", reached before the first step"
    step_ratio = (f"{cell['median_s'] / cell['predicted_s']:.2f}"
                  if cell.get("predicted_s") and cell.get("median_s") else "")
    plan = cell.get("plan") or {}
    what = cell.get("error") or ", ".join(f"{k}={v}" for k, v in plan.items() if v)
    warm = cell.get("cache") if cell["mode"] == "hetpar" else None
    mode = cell["mode"] + (f" ({warm})" if warm else "")
    gpus = cell.get("gpus", 1)
    return (f"| {cell['model']} | {cell['fraction']} ({cell['limit_gb']:.0f} GB"
            f"{f' x {gpus}' if gpus > 1 else ''}) | {mode} "
            f"| {ms(cell.get('median_s'))} | {ms(cell.get('predicted_s'))} | {step_ratio} "
            f"| {measured or 0:.1f} | {'' if pred_peak is None else f'{pred_peak:.1f}'} | {ratio} "
            f"| {cell.get('first_call_s') or 0:.1f} | {what[:160]} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama,zoo", help=", ".join(MODELS))
    p.add_argument("--fractions", default="0.1,0.3,default")
    p.add_argument("--modes", default="hetpar,jit",
                   help="hetpar, jit and jax_offload (JAX's host offload written by hand: "
                        "optimizer state in pinned host memory, moved inside the step)")
    p.add_argument("--batch", type=int, default=None,
                   help="default: the model's own (MODELS)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--settle", type=int, default=7,
                   help="steps after the first call and before the timed ones, in every "
                        "mode, timed apart (settle_times_s): hetpar's step clock waits for "
                        "results in calls 2-8 (StepClock.SETTLE + STEPS)")
    p.add_argument("--gpus", type=int, default=1,
                   help="GPUs per cell: hetpar plans over them and the CPU; jit over "
                        "several is FSDP written by hand (experiments/_fsdp.py)")
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="a smoke run's shapes (CPU)")
    p.add_argument("--state", choices=("host", "device"), default="host",
                   help="where hetpar's cells build the state (jit's is always on the GPU)")
    p.add_argument("--donate", action=argparse.BooleanOptionalAction, default=True,
                   help="donate the parameters and optimizer state (donate_argnums=(0, 1)) "
                        "under jit and hetpar alike, as training loops do")
    p.add_argument("--memory-every", type=float, default=0.0,
                   help="every this many seconds, each cell logs what each GPU's allocator "
                        "holds where it changed (on its stderr)")
    p.add_argument("--stacks", type=float, default=0.0,
                   help="every this many seconds, each cell logs where its main thread is "
                        "(its hetpar frames; kept in the results when the cell times out)")
    p.add_argument("--timeline", default=None,
                   help="a directory: each hetpar cell with a split plan saves its cost "
                        "table there and adds one watched step and the planner's replay "
                        "of it to its results")
    p.add_argument("--plan-out", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--fraction", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.settle < 0 or args.steps < 1:
        p.error(f"--steps must be at least 1 and --settle at least 0 (got --steps "
                f"{args.steps}, --settle {args.settle})")
    if args.model:
        print("CELL " + json.dumps(run_cell(args)), flush=True)
        return
    from hetpar._host_memory import malloc_env

    cells = []
    for model in args.models.split(","):
        for fraction in args.fractions.split(","):
            for mode in args.modes.split(","):
                env = dict(os.environ)
                # As the `hetpar` command starts Python (HostMemoryWarning): a
                # plan's CPU updates otherwise fault in their new state 4 KiB
                # at a time (run 19: the 0.54B plan's host update stage ran
                # 536 ms against 260 ms timed alone). jit's cells get it too.
                # (`malloc_env`: HETPAR_KEEP_FREED_MEMORY adds one arena keeping
                # what it frees, run 44.)
                env = malloc_env(env)
                if fraction != "default":
                    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
                cmd = [sys.executable, __file__, "--model", model, "--fraction", fraction,
                       "--mode", mode, "--steps", str(args.steps), "--gpus", str(args.gpus),
                       "--settle", str(args.settle)]
                cmd += ["--batch", str(args.batch)] if args.batch else []
                cmd += ["--tiny"] if args.tiny else []
                cmd += ["--stacks", str(args.stacks)] if args.stacks else []
                cmd += ["--memory-every", str(args.memory_every)] if args.memory_every else []
                cmd += ["--state", args.state]
                cmd += [] if args.donate else ["--no-donate"]
                if args.timeline:
                    cmd += ["--timeline", os.path.join(
                        args.timeline, f"table_{model}_{fraction}_{mode}.json")]
                if args.out and mode == "hetpar":
                    cmd += ["--plan-out", os.path.splitext(_cell_log(
                        args.out, model, fraction, mode))[0]]
                t = time.perf_counter()
                # The cell's stderr goes to a file as it runs, and the results
                # file names the cell before it starts: a cell whose process
                # is killed from outside (run 54: a 6.74B cell past the call's
                # own limit, whose teardown of 80 GB of pinned memory outlived
                # it) still leaves what it was doing.
                log = _cell_log(args.out, model, fraction, mode)
                if args.out:
                    _write(args.out, [*cells, {
                        "model": model, "fraction": fraction, "mode": mode, "limit_gb": 0,
                        "error": f"did not finish (its stderr: {log})"}])
                try:
                    with open(log, "w") as errf:
                        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                                              stderr=errf, text=True, timeout=args.timeout)
                    with open(log) as f:
                        stderr = f.read()
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CELL ")]
                    cell = json.loads(lines[-1][5:]) if lines else {
                        "model": model, "fraction": fraction, "mode": mode, "limit_gb": 0,
                        "error": f"exit {proc.returncode}: " + stderr.strip()[-400:]}
                    # hetpar's progress lines and warnings, without the
                    # allocator's per-chunk dumps.
                    err = stderr.splitlines()
                    cell["hetpar_lines"] = _progress(err)
                    cell["stderr_tail"] = "\n".join(
                        ln for ln in err if " ms hetpar" not in ln and "bfc_allocator" not in ln
                        and "InUse at" not in ln and "Chunk at" not in ln
                        and "Free at" not in ln)[-3000:]
                except subprocess.TimeoutExpired:
                    # What the cell was doing: hetpar's progress lines and the
                    # where its main thread was (--stacks) are on its stderr.
                    with open(log) as f:
                        err = f.read()
                    cell = {"model": model, "fraction": fraction, "mode": mode, "limit_gb": 0,
                            "error": f"timed out after {args.timeout:.0f} s",
                            "hetpar_lines": _progress(err.splitlines()),
                            "stderr_tail": err[-6000:]}
                cell["wall_s"] = time.perf_counter() - t
                cells.append(cell)
                print(_row(cell), flush=True)
                if args.out:
                    _write(args.out, cells)
    print("\n| model | GPU memory | run | step ms | predicted ms | measured/predicted "
          "| GPU peak GB | predicted peak GB | measured/predicted peak | first call s | plan |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cell in cells:
        print(_row(cell))


def _cell_log(out: str | None, model: str, fraction: str, mode: str) -> str:
    """Where a cell's stderr goes while it runs: beside the results file."""
    base = os.path.splitext(out)[0] if out else os.path.join(tempfile.gettempdir(), "bench_fit")
    return f"{base}.{model}_{fraction}_{mode}.stderr"


def _write(out: str, cells: list) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(cells, f, indent=1)


if __name__ == "__main__":
    main()
