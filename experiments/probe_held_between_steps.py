"""What a split step leaves on the GPU between steps (issue 41).

Run 24 (experiments/results/fit_h200): the 0.54B Llama-style offload plan at
7.5 GB held 2.41 GB on the GPU before each step after the first, where its
state homed there is 0.79 GB, and each later step peaked 1.7 GB over the
first. This plans the model from a saved cost table (no calibration), runs
a few steps with the plan given, and after each one reads the allocator
(`bytes_in_use`) beside what JAX's live arrays hold on the GPU (deduplicated
by buffer), grouped by shape, then drops suspects one at a time.

    python experiments/probe_held_between_steps.py --table T.json --out R.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def held(gpu) -> dict:
    import jax

    seen, by_shape, total = set(), {}, 0
    for a in jax.live_arrays():
        try:
            if a.is_deleted() or gpu not in a.devices():
                continue
            if getattr(a.sharding, "memory_kind", None) not in (None, "device"):
                continue
            ptr = a.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - an array being deleted
            continue
        if ptr in seen:
            continue
        seen.add(ptr)
        total += a.nbytes
        key = f"{a.shape} {a.dtype}"
        by_shape[key] = by_shape.get(key, 0) + a.nbytes
    top = sorted(by_shape.items(), key=lambda kv: -kv[1])[:8]
    return {"in_use_gb": (gpu.memory_stats() or {}).get("bytes_in_use", 0) / 1e9,
            "live_arrays_gb": total / 1e9, "top": [(k, v / 1e9) for k, v in top]}


def holders(gpu, n: int = 3) -> list:
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", required=True)
    p.add_argument("--model", default="llama")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=None, help="default: the model's own")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import bench_fit
    import jax

    import hetpar
    from hetpar._step_planning import within_split_margin
    from hetpar.core import CostTable
    from hetpar.planner import plan

    table = CostTable.load(args.table)
    accs = [d.name for d in table.devices if d.kind not in ("cpu", "pinned_host")]
    chosen = plan(within_split_margin(table, accs), donate=True)
    try:
        gpu, name = jax.devices("gpu")[0], "gpu:0"
    except RuntimeError:  # a smoke run on two CPU devices, the second as the GPU
        gpu, name = jax.devices("cpu")[1], "cpu:1"
    placements = {layer: {f: getattr(pl, f).replace("gpu:0", name) for f in
                          ("compute", "params", "state", "update", "activations")}
                  for layer, pl in chosen.placements.items()}
    train_step, init, _ = bench_fit._workload(args.model, args.batch)
    with jax.default_device(jax.devices("cpu")[0]):
        state = init(jax.random.key(0))
    step = hetpar.auto(train_step, devices=[name, "cpu:0"], plan=placements,
                       donate_argnums=(0, 1))
    params, opt_state, batch = step.place(*state)
    del state
    rows = [{"when": "placed", **held(gpu)}]
    for i in range(args.steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
        jax.block_until_ready((params, opt_state))
        rows.append({"when": f"after step {i}", "s": time.perf_counter() - t, **held(gpu)})
        gc.collect()
        rows.append({"when": f"after step {i}, gc", **held(gpu)})
        print(json.dumps(rows[-1])[:600], flush=True)
    rows.append({"when": "who holds the largest arrays", "holders": holders(gpu)})
    where = {}
    for leaf in jax.tree.leaves((params, opt_state)):
        d = str(next(iter(leaf.devices())))
        where[d] = where.get(d, 0) + leaf.nbytes / 1e9
    rows.append({"when": "outputs by device (GB)", "where": where})
    compiled = step._last
    ex = compiled._executor
    for name, drop in (("transfer engine", lambda: setattr(ex, "transfer", type(ex.transfer)())),
                       ("compiled step's last outputs", lambda: None),
                       ("jax caches", jax.clear_caches)):
        drop()
        gc.collect()
        rows.append({"when": f"dropped {name}", **held(gpu)})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        print(json.dumps(r)[:400])


if __name__ == "__main__":
    main()
