"""Why a table has no feasible plan, worked out from the table (not the solver).

A solver says only "infeasible"; users need to know which device is short of
memory and by how much, or which edge cannot cross any available link.
"""

from __future__ import annotations

import itertools

import numpy as np

from hetpar.core import InfeasibleError, nbytes
from hetpar.planner._arrays import Arrays

# Above this many devices, only single devices and the whole set are checked
# (2^D subsets would be too many); the diagnosis is then less specific.
_MAX_SUBSET_DEVICES = 10


def memory_shortfall(arr: Arrays) -> InfeasibleError | None:
    """An error naming the devices short of memory, or None if memory alone is no obstacle.

    Checks a Hall-type condition: for every set S of devices, the layers that
    may only run inside S need at least Σ (their smallest memory within S),
    which must fit in S's total memory. Passing it does not prove feasibility
    (memory is bin packing), but failing it proves infeasibility.
    """
    L, D = arr.ok.shape
    big = np.where(arr.ok, arr.mem, np.inf)
    minmem = big.min(axis=1)
    for i in range(L):
        devs = np.nonzero(arr.ok[i])[0]
        need = arr.mem[i, devs] + arr.ws[i]  # its working set too, while it runs
        if np.all(need > arr.cap[devs]):
            k = int(np.argmax(arr.cap[devs] - need))
            j = devs[k]
            d = arr.devices[j]
            return InfeasibleError(
                f"layer {arr.layers[i]} needs at least {nbytes(need[k])} on {d} but {d} "
                f"holds {nbytes(arr.cap[j])} ({nbytes(need[k] - arr.cap[j])} missing)",
                api=f"raise memory_bytes of {d}, allow the layer on a larger device, or "
                    "split it",
                cli=f"give {d} more memory (--memory {d}=GB, or its memory_bytes in "
                    "graph.json), allow the layer on a larger device there, or use a smaller "
                    "--batch")
    masks = (arr.ok * (1 << np.arange(D))).sum(axis=1)
    # Devices no layer may use (memory places) hold no layer: leave them out.
    usable = [int(j) for j in np.nonzero(arr.ok.any(axis=0))[0]]
    if len(usable) <= _MAX_SUBSET_DEVICES:
        subsets = [s for r in range(1, len(usable) + 1)
                   for s in itertools.combinations(usable, r)]
    else:
        subsets = [(j,) for j in usable] + [tuple(usable)]
    for s in subsets:
        smask = sum(1 << j for j in s)
        inside = (masks & ~smask) == 0
        need = float(minmem[inside].sum())
        hold = float(arr.cap[list(s)].sum())
        if need > hold * (1 + 1e-9):
            missing = need - hold
            cheapest = np.argmin(big[inside], axis=1)
            demand = np.bincount(cheapest, weights=minmem[inside], minlength=D)
            ratio = [demand[j] / max(arr.cap[j], 1.0) for j in s]
            tight = arr.devices[s[int(np.argmax(ratio))]]
            names = " + ".join(arr.devices[j] for j in s)
            who = "layers" if len(s) == len(usable) else f"layers that may only run on {names}"
            holds = "holds" if len(s) == 1 else "hold"
            return InfeasibleError(
                f"{who} need at least {nbytes(need)} but {names} {holds} {nbytes(hold)} "
                f"({nbytes(missing)} missing)",
                api=f"raise memory_bytes of {tight} by {nbytes(missing)}, allow those layers "
                    "on other devices, unpin some, or use a smaller batch",
                cli=f"give {tight} {nbytes(missing)} more memory (--memory {tight}=GB, or its "
                    "memory_bytes in graph.json), allow those layers on other devices or unpin "
                    "some there, or use a smaller --batch")
    return None


def link_obstacle(arr: Arrays) -> str | None:
    """A message naming an edge whose ends can sit on no linked pair of devices, or None."""
    for k, e in enumerate(arr.table.edges):
        u, v = arr.eu[k], arr.ev[k]
        ok = arr.pair_ok[k] & arr.ok[u][:, None] & arr.ok[v][None, :]
        if not ok.any():
            du = [arr.devices[j] for j in np.nonzero(arr.ok[u])[0]]
            dv = [arr.devices[j] for j in np.nonzero(arr.ok[v])[0]]
            return (f"edge {e.src} -> {e.dst} cannot be placed: {e.src} may use {du}, "
                    f"{e.dst} may use {dv}, and no pair of those is linked"
                    + (" both ways (the edge has bytes_backward)" if e.bytes_backward > 0 else "")
                    + "; add a link between them or widen allowed/pinned")
    return None
