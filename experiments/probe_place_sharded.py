"""Where a host-built array laid out over several GPUs leaves memory (run 67),
and how fast state built on the host reaches a GPU or its pinned memory.

On two H200s, the first call of the zoo 5.04B model's fsdp plan laid its
host-built state (on the CPU device) out over both GPUs with one
`jax.device_put` per argument to the leaves' NamedShardings, and the first
GPU's allocator ended 6.8 GB above the second's, which no live array held
(experiments/results/fit_h200x2, run 67). This probe puts arrays of one
shape from the CPU device onto every GPU, sharded on axis 0 (each shard a
contiguous run of the source) or axis 1 (not), by four paths, and prints
what each GPU's allocator holds beside what the placed arrays' shards hold:

  device_put       `jax.device_put(cpu_array, NamedSharding)`, as
                   `Replicated._placed` does today
  numpy            `jax.device_put(np.asarray(cpu_array), NamedSharding)`
  callback         `jax.make_array_from_callback`, NumPy slices per shard
  per_device       each shard made contiguous on the host, put to its bare
                   `jax.Device` (the transfer engine's fast path), then
                   `jax.make_array_from_single_device_arrays`
  engine           hetpar's `TransferEngine.move_many` (one GPU's targets)

Targets: `sharded` (every GPU, as above), `pinned` (gpu:0's pinned host
memory: where `step.place` puts offloaded state, ~1.4 GB/s in runs 58 and
65, 44-86 s of a first call) and `device` (gpu:0). On CPU devices a CPU
array's `device_put` to another device ran 1-3 GB/s, its NumPy view's
15-20 GB/s.

    python experiments/probe_place_sharded.py --gb 4 --out R.json

Each path runs in its own process (the allocator's figures are its own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PATHS = ("device_put", "numpy", "callback", "per_device", "engine")
TARGETS = ("sharded", "pinned", "device")


def run_path(path: str, axis: int, gb: float, arrays: int, target: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:  # a smoke run: XLA_FLAGS=--xla_force_host_platform_device_count=3
        gpus = jax.devices("cpu")[1:]
    cpu = jax.devices("cpu")[0]
    n = len(gpus)
    rows = int((gb * 1e9 / arrays / 4 / 4096) // (2 * n) * (2 * n))
    shape = (rows, 4096) if axis == 0 else (4096, rows)
    mesh = Mesh(np.array(gpus), ("replica",))
    spec = PartitionSpec("replica") if axis == 0 else PartitionSpec(None, "replica")
    sharding = NamedSharding(mesh, spec)
    if target != "sharded":  # one GPU's device memory or its pinned host memory
        kind = "pinned_host" if target == "pinned" else None
        sharding = jax.sharding.SingleDeviceSharding(gpus[0], memory_kind=kind)
    with jax.default_device(cpu):
        xs = [jax.numpy.full(shape, float(i), jax.numpy.float32) for i in range(arrays)]
    jax.block_until_ready(xs)
    t0 = time.perf_counter()
    if path == "engine":
        from hetpar.runtime import TransferEngine

        ys = TransferEngine().move_many(xs, sharding if target == "pinned" else gpus[0])
    elif target != "sharded" and path in ("callback", "per_device"):
        return {"path": path, "axis": axis, "target": target, "skipped": "sharded only"}
    elif path == "device_put":
        ys = jax.device_put(xs, [sharding] * arrays)
    elif path == "numpy":
        ys = jax.device_put([np.asarray(x) for x in xs], [sharding] * arrays)
    elif path == "callback":
        ys = []
        for x in xs:
            value = np.asarray(x)
            ys.append(jax.make_array_from_callback(shape, sharding, lambda idx, v=value: v[idx]))
    else:
        ys = []
        for x in xs:
            value = np.asarray(x)
            index = sharding.addressable_devices_indices_map(shape)
            parts = [jax.device_put(np.ascontiguousarray(value[index[d]]), d) for d in gpus]
            ys.append(jax.make_array_from_single_device_arrays(shape, sharding, parts))
    jax.block_until_ready(ys)
    took = time.perf_counter() - t0
    held = {f"gpu:{d.id}": (d.memory_stats() or {}).get("bytes_in_use", 0) / 1e9 for d in gpus}
    shards = {f"gpu:{d.id}": 0.0 for d in gpus}
    for y in ys:
        for s in y.addressable_shards:
            if getattr(y.sharding, "memory_kind", None) != "pinned_host":
                shards[f"gpu:{s.device.id}"] += s.data.nbytes / 1e9
    del xs
    ok = all(float(y[0, 0]) == float(i) for i, y in enumerate(ys))
    return {"path": path, "axis": axis, "target": target, "shape": list(shape), "arrays": arrays,
            "seconds": took, "gb_per_s": gb / took, "in_use_gb": held, "shards_gb": shards,
            "extra_gb": {k: held[k] - shards[k] for k in held}, "values_ok": ok}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=4.0, help="bytes placed per path, in all")
    p.add_argument("--arrays", type=int, default=8)
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # path:axis, in a child
    args = p.parse_args(argv)
    if args.one:
        path, axis, target = args.one.split(":")
        print(json.dumps(run_path(path, int(axis), args.gb, args.arrays, target)))
        return 0
    rows = []
    for target, path, axis in ((t, p, a) for t in args.targets.split(",")
                               for p in args.paths.split(",") for a in (0, 1)):
        if target != "sharded" and (axis == 1 or path in ("callback", "per_device")):
            continue
        if True:
            cmd = [sys.executable, __file__, "--one", f"{path}:{axis}:{target}", "--gb",
                   str(args.gb), "--arrays", str(args.arrays)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            try:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                row = {"path": path, "axis": axis, "target": target,
                       "error": done.stderr.strip()[-400:]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
