"""Probe: what a CPU <-> GPU (or GPU <-> GPU) crossing costs the split runtime.

On the H200 host, plans that moved one small layer to the CPU measured ~3 ms
per step more than predicted (experiments/results/baselines_h200.md), like
the ~3 ms per stage of the two-GPU pipeline. A first suspect, worker threads
waiting for the GIL (switch interval 5 ms), was ruled out on the H200
(probe_handoff_h200.txt: 1e-4 s changed nothing). The second: every transfer
call pays ~0.15-0.4 ms (the link latencies `hetpar profile` measured) and a
stage's inputs were moved one array per call. This measures mixed plans with
one call per array ("per array") against one batched call per source device
("batched", the runtime's default), beside plain `jax.jit` on the
accelerator. Usage: python experiments/probe_handoff.py
"""

import jax
from _timing import median_step

import hetpar
from hetpar import zoo


def case(model, plan_of, label):
    w = zoo.get(model)
    args = w.example_args()
    layers = list(hetpar.trace(w.train_step, *args).layers)
    asg = plan_of(layers)
    acc = [d for d in jax.devices() if d.platform != "cpu"][0]
    batch = jax.device_put(args[2], acc)
    jitted = jax.jit(w.train_step)
    s = jax.device_put(tuple(args[:2]), acc)
    _, s = median_step(jitted, s, batch, 3)
    t_jit, _ = median_step(jitted, s, batch, 30)
    step = hetpar.auto(w.train_step, plan=asg)
    state = tuple(args[:2])
    _, state = median_step(step, state, batch, 3)
    ex = step.lower(*state, batch)._executor
    out = [f"{model} {label}: jax.jit {t_jit * 1e3:.2f} ms"]
    batched = ex.transfer.move_many
    per_array = lambda xs, d: [ex.transfer.move(x, d) for x in xs]  # noqa: E731
    for label, mover in (("per array", per_array), ("batched", batched)) * 2:
        ex.transfer.move_many = mover
        t, state = median_step(step, state, batch, 30)
        out.append(f"{label}: {t * 1e3:.2f} ms")
    print("; ".join(out), f"({len(ex.stages.stages)} stages)", flush=True)


def main():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    case("lm_embed", lambda ls: {n: "cpu:0" if n == "fc2" else "gpu:0" for n in ls},
         "fc2 on cpu:0")
    case("cnn_preprocess", lambda ls: {n: "cpu:0" if n == "fc2" else "gpu:0" for n in ls},
         "fc2 on cpu:0")
    case("transformer", lambda ls: {n: "cpu:0" if n == "ln_f" else "gpu:0" for n in ls},
         "ln_f on cpu:0")
    if len(gpus) > 1:
        case("transformer", lambda ls: {n: "gpu:0" if i < len(ls) // 2 else "gpu:1"
                                        for i, n in enumerate(ls)}, "half/half on two GPUs")


if __name__ == "__main__":
    main()
