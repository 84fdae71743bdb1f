"""Two GPUs as one process or as two: hetpar's data parallel and pipeline plans
across processes (jax.distributed, NCCL) against the same plans in one process
and against `jax.jit` sharding (issue 16).

Three runs write JSON into --out; the last prints the table:

    python experiments/bench_processes.py --role inprocess --out DIR
    python -m hetpar.launch -n 2 --gpus_per_process 1 \\
        experiments/bench_processes.py --role processes --out DIR
    python experiments/bench_processes.py --role report --out DIR

In one process over both GPUs (`inprocess`): the step under `jax.jit` on one
GPU (the reference for results), `jax.jit` with the batch sharded over both
GPUs, hetpar's data parallel plan, and a pipeline (the first half of the
layers on one GPU, the rest on the other; M microbatches, 1F1B). As two
processes with one GPU each (`processes`): `jax.jit` over the global mesh,
hetpar's data parallel plan, the same pipeline with its stages on the two
processes (values crossing as NCCL ppermutes), and the plan hetpar.auto
chooses by itself. Every variant's loss after its steps is compared with the
one-GPU `jax.jit` reference. Step times are medians of --steps steps, each
timed to every local result being ready; across processes the slower
process's median counts.

`--quick` runs the small transformer on CPU devices (for trying it here:
`XLA_FLAGS=--xla_force_host_platform_device_count=2` for `inprocess`,
`--devices_per_process 1` for `processes`).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import statistics
import sys
import time

from hetpar.distributed import initialize

MULTI = initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import hetpar  # noqa: E402
from hetpar import zoo  # noqa: E402


def _ready(tree) -> None:
    """Waits for every result this process holds (others' are not readable here)."""
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                shard.data.block_until_ready()


def _timed(step, state, batch, steps: int, warmup: int = 3):
    """(median seconds per step, the losses of the first `warmup` steps).

    A hetpar step's arguments are placed first (`step.place`), as the
    baselines' are: the batch is not converted again every step.
    """
    if hasattr(step, "place"):
        step(*state, batch)  # compiles, so that place knows the plan
        *state, batch = step.place(*state, batch)
    losses = []
    for _ in range(warmup):
        *state, loss = step(*state, batch)
        _ready((state, loss))
        losses.append(float(np.asarray(loss)))
    if MULTI:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bench")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        *state, loss = step(*state, batch)
        _ready((state, loss))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), losses


def _workload(args):
    if args.quick:
        return zoo.get("transformer", small=True, batch=args.batch or 8)
    return zoo.get("transformer", batch=args.batch or 256)


def _pipeline(layers, devices) -> dict:
    """The layers (graph order) cut into len(devices) runs of equal count, in order."""
    return {name: devices[i * len(devices) // len(layers)] for i, name in enumerate(layers)}


def _row(name, seconds, losses, ref, batch, **extra):
    err = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref))
    return dict(variant=name, step_s=seconds, samples_per_s=batch / seconds,
                loss_rel_err_vs_one_device=err, losses=losses, **extra)


def _predicted(step) -> float | None:
    p = step.plan.predicted if step.plan is not None else None
    return None if p is None else p.step_time_s


def _variant(rows, args, ref, n, name, step, state, batch, *, predicted=False, **extra):
    """Times `step`, adds its row (its losses against `ref`'s; batch `n`), prints its step."""
    t, losses = _timed(step, state, batch, args.steps)
    if predicted:
        extra["predicted_s"] = _predicted(step)
    rows.append(_row(name, t, losses, ref, n, **extra))
    print(f"{name}: {t * 1e3:.2f} ms", flush=True)


def in_process(args, w, state, batch) -> list[dict]:
    kind = "cpu" if args.quick else "gpu"
    devs = jax.devices(kind)
    names = [f"{kind}:{d.id}" for d in devs]
    n = w.config["batch_size"]
    rows = []
    one = jax.jit(w.train_step)
    placed = jax.device_put((state, batch), devs[0])
    t, ref = _timed(lambda *a: one(*a), placed[0], placed[1], args.steps)
    rows.append(_row("jax.jit, one device", t, ref, ref, n))
    print(f"jit one device: {t * 1e3:.2f} ms", flush=True)
    mesh = Mesh(np.array(devs), ("data",))
    rep, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    sharded_batch = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, split if getattr(x, "ndim", 0) and x.shape[0] == n else rep),
        batch)
    run = functools.partial(_variant, rows, args, ref, n)
    run(f"jax.jit, batch sharded over {len(devs)} devices", one, jax.device_put(state, rep),
        sharded_batch)
    run("hetpar data parallel", hetpar.auto(w.train_step, data_parallel="always", devices=names),
        state, batch, predicted=True)
    layers = list(hetpar.trace(w.train_step, *state, batch).layers)
    run(f"hetpar pipeline M={args.microbatches} 1f1b",
        hetpar.auto(w.train_step, plan=_pipeline(layers, names), microbatches=args.microbatches,
                    schedule="1f1b"), state, batch, predicted=True)
    return rows


def across_processes(args, w, state, batch, ref) -> list[dict]:
    from hetpar.distributed import device_names

    n = w.config["batch_size"]
    kind = "cpu" if args.quick else "gpu"
    devs = [d for d in jax.devices() if d.platform == kind]
    names = device_names(devs)
    rows = []

    mesh = Mesh(np.array(devs), ("data",))
    rep, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))

    def global_array(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    g_state = jax.tree_util.tree_map(lambda x: global_array(x, rep), state)
    g_batch = jax.tree_util.tree_map(
        lambda x: global_array(x, split if x.ndim and x.shape[0] == n else rep), batch)
    run = functools.partial(_variant, rows, args, ref, n)
    run("jax.jit, global mesh over the processes", jax.jit(w.train_step), g_state, g_batch)
    run("hetpar data parallel across processes",
        hetpar.auto(w.train_step, data_parallel="always"), state, batch, predicted=True)
    run("hetpar hierarchical across processes (per-host plan, gradients averaged)",
        hetpar.auto(w.train_step, hierarchical=True), state, batch, predicted=True)
    pipeline = dict(microbatches=args.microbatches, schedule="1f1b")
    local = [nm for nm in names if nm.startswith("p0/")]
    if len(local) > 1:  # within each process a pipeline, data parallel across them
        half = jax.tree_util.tree_map(lambda x: x[:n // jax.process_count()], batch)
        host = _pipeline(list(hetpar.trace(w.train_step, *state, half).layers), local)
        run(f"hetpar hierarchical across processes (pipeline of {len(local)} "
            f"M={args.microbatches} in each)",
            hetpar.auto(w.train_step, hierarchical=True, plan=host, **pipeline), state, batch)
    layers = list(hetpar.trace(w.train_step, *state, batch).layers)
    run(f"hetpar pipeline M={args.microbatches} 1f1b across processes",
        hetpar.auto(w.train_step, plan=_pipeline(layers, names), **pipeline), state, batch)
    step = hetpar.auto(w.train_step)
    run("hetpar.auto's own plan across processes", step, state, batch, predicted=True)
    rows[-1]["chosen"] = (f"data parallel over {list(step.plan.replicas)}" if step.plan.replicas
                          else json.dumps(sorted(set(step.assignment.values()))))
    return rows


def report(out: pathlib.Path) -> str:
    inproc = json.loads((out / "inprocess.json").read_text())
    procs = [json.loads(p.read_text()) for p in sorted(out.glob("processes_p*.json"))]
    rows = list(inproc["rows"])
    for k in range(len(procs[0]["rows"])):
        slowest = max((p["rows"][k] for p in procs), key=lambda r: r["step_s"])
        rows.append(dict(slowest, processes=len(procs)))
    by = {r["variant"]: r for r in rows}
    one = by["jax.jit, one device"]["step_s"]
    lines = [f"# GPUs as one process or two ({inproc['device']}, {inproc['model']}, "
             f"batch {inproc['batch']})", "",
             f"JAX {inproc['jax']}; medians of {inproc['steps']} steps; across processes the "
             "slower process's median. Loss error: max relative difference of the first 3 "
             "losses from `jax.jit` on one device.", "",
             "| variant | step ms | samples/s | x one device | predicted ms | loss err |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        pred = r.get("predicted_s")
        lines.append(f"| {r['variant']}{' (' + r['chosen'] + ')' if r.get('chosen') else ''} | "
                     f"{r['step_s'] * 1e3:.2f} | {r['samples_per_s']:.0f} | "
                     f"{one / r['step_s']:.2f} | {'' if pred is None else f'{pred * 1e3:.2f}'} | "
                     f"{r['loss_rel_err_vs_one_device']:.1e} |")
    ratios = []
    sharded = next(r["variant"] for r in rows if r["variant"].startswith("jax.jit, batch sharded"))
    pairs = [("hetpar data parallel across processes", sharded),
             ("hetpar data parallel across processes", "jax.jit, global mesh over the processes"),
             (f"hetpar pipeline M={inproc['microbatches']} 1f1b across processes",
              f"hetpar pipeline M={inproc['microbatches']} 1f1b")]
    for a, b in pairs:
        if a in by and b in by:
            ratios.append(f"- {a} against {b}: {by[b]['step_s'] / by[a]['step_s']:.3f}x "
                          "its throughput")
    return "\n".join(lines + ["", *ratios]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("inprocess", "processes", "report"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.role == "report":
        text = report(out)
        print(text)
        (out / "README.md").write_text(text)
        return 0
    w = _workload(args)
    state_and_batch = jax.tree_util.tree_map(np.asarray, w.example_args())
    state, batch = tuple(state_and_batch[:-1]), state_and_batch[-1]
    meta = dict(model=w.name, batch=w.config["batch_size"], steps=args.steps,
                microbatches=args.microbatches, jax=jax.__version__, host=platform.node(),
                device=jax.devices()[0].device_kind)
    if args.role == "inprocess":
        rows = in_process(args, w, state, batch)
        (out / "inprocess.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
        return 0
    ref = json.loads((out / "inprocess.json").read_text())["rows"][0]["losses"]
    rows = across_processes(args, w, state, batch, ref)
    (out / f"processes_p{jax.process_index()}.json").write_text(
        json.dumps(dict(meta, rows=rows, process=jax.process_index()), indent=1))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
