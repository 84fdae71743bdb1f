"""Seeded random cost tables: the planner's test and benchmark instances.

Shapes follow real training graphs loosely: a CPU that is slow but roomy and
cheap, accelerators that are fast, small and dear, PCIe-like links between
CPU and accelerators, and chains or DAGs with skip (residual) edges.
"""

from __future__ import annotations

import numpy as np

from hetpar.core import CostTable, Device, Edge, Layer, Link

_KINDS = (  # kind, speed-up over cpu, price $/h, busy W, idle W
    ("cpu", 1.0, 0.4, 150.0, 50.0),
    ("gpu", 8.0, 3.0, 400.0, 70.0),
    ("tpu", 6.0, 1.2, 250.0, 60.0),
    ("gpu", 5.0, 1.5, 300.0, 50.0),
)


def random_cost_table(seed: int, layers: int = 8, devices: int = 3, *, shape: str = "dag",
                      memory: str = "loose", missing_links: bool = False,
                      restrict: bool = False) -> CostTable:
    """A random CostTable.

    Args:
      seed: RNG seed; the same arguments give the same table.
      layers: number of layers.
      devices: number of devices (1..8; the first is a CPU).
      shape: "chain" (l_i -> l_{i+1}) or "dag" (a chain plus random skip edges).
      memory: "loose" (everything fits on any device), "tight" (every
        accelerator holds about a third of the model) or "one_tight" (the first
        accelerator holds about a third, the others everything: docs/architecture/planner.md's
        "tight GPU memory limit" instance).
      missing_links: drop some accelerator-to-accelerator links.
      restrict: give some layers `allowed` lists and pins.

    Returns:
      A validated CostTable.
    """
    rng = np.random.default_rng(seed)
    devs = []
    for j in range(devices):
        kind, speed, price, wb, wi = _KINDS[j % len(_KINDS)]
        devs.append((f"{kind}:{j}", kind, speed * rng.uniform(0.7, 1.3), price, wb, wi))
    base = rng.lognormal(mean=np.log(1e-3), sigma=0.8, size=layers)
    mem = rng.uniform(1e8, 1e9, size=layers)
    total = float(mem.sum())
    device_list = []
    for j, (name, kind, _, price, wb, wi) in enumerate(devs):
        if j == 0:
            cap = 4 * total
        elif memory == "tight" or (memory == "one_tight" and j == 1):
            cap = total * rng.uniform(0.25, 0.45)
        elif memory in ("loose", "one_tight"):
            cap = 2 * total
        else:
            raise ValueError(f"memory must be 'loose', 'tight' or 'one_tight', got {memory!r}")
        device_list.append(Device(name, kind, float(cap), price, wb, wi))
    layer_list = []
    for i in range(layers):
        # Per-layer affinity: some layers gain little from an accelerator.
        times = {}
        mems = {}
        for j, (name, _, speed, *_rest) in enumerate(devs):
            gain = speed ** rng.uniform(0.3, 1.0) if j else 1.0
            times[name] = float(base[i] / gain)
            mems[name] = float(mem[i])
        allowed = pinned = None
        if restrict and rng.random() < 0.2:
            allowed = tuple(sorted(rng.choice([d[0] for d in devs], size=max(1, devices - 1),
                                              replace=False).tolist()))
        elif restrict and rng.random() < 0.1:
            pinned = devs[int(rng.integers(devices))][0]
        layer_list.append(Layer(f"l{i}", times, mems, allowed=allowed, pinned=pinned))
    edges = []
    for i in range(layers - 1):
        b = float(rng.uniform(1e5, 5e7))
        edges.append(Edge(f"l{i}", f"l{i + 1}", b, b))
    if shape == "dag":
        for i in range(layers - 2):
            if rng.random() < 0.3:
                j = int(rng.integers(i + 2, min(layers, i + 6)))
                b = float(rng.uniform(1e5, 2e7))
                edges.append(Edge(f"l{i}", f"l{j}", b, b if rng.random() < 0.7 else 0.0))
    elif shape != "chain":
        raise ValueError(f"shape must be 'chain' or 'dag', got {shape!r}")
    links = []
    for a in range(devices):
        for b in range(devices):
            if a == b:
                continue
            if missing_links and a and b and rng.random() < 0.6:
                continue
            bw = 12e9 if 0 in (a, b) else 50e9
            links.append(Link(devs[a][0], devs[b][0], bw * rng.uniform(0.8, 1.2), 1e-5))
    return CostTable(devices=tuple(device_list), links=tuple(links), layers=tuple(layer_list),
                     edges=tuple(edges), meta={"source": f"random_cost_table(seed={seed})"})
