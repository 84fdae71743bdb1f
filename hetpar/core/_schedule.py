"""Orders of work: which stage each device runs when (GPipe, 1F1B).

Shared by the split pass (stages of jaxpr equations) and the planner's
schedule simulator (stages of layers), so that what the planner predicts is
the order the runtime runs. Work items are numbered; `deps[i]` holds the
items item i reads from. A stage key is (device, microbatch, phase).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence

PHASE_RANK = {"pre": 0, "forward": 1, "main": 1, "backward": 2, "post": 3, "update": 3}
SCHEDULES = ("gpipe", "1f1b")

Key = tuple  # (device, microbatch or None, phase)


def device_aware_order(deps: Sequence[Collection[int]], keys: Sequence[Key]) -> list[int]:
    """A topological order of the items that stays on the current stage key while it can.

    When the current key has nothing ready, the next key is the one with the
    best (phase, microbatch) priority, ties broken by item number (program
    order): GPipe's order of work, and the fewest switches the dependencies
    allow.

    Raises:
      ValueError: the dependencies form a cycle.
    """
    n = len(keys)
    waiting = [len(d) for d in deps]
    users: list[list[int]] = [[] for _ in range(n)]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    ready: dict[Key, list[int]] = {}

    def priority(key, head):
        _, mb, ph = key[:3]  # a 4th part only cuts stages finer (offloaded layers)
        return (PHASE_RANK[ph], -1 if mb is None else mb, head)

    # The keys by priority, kept lazily: an entry is pushed whenever a key's
    # head changes and skipped when popped stale. A scan of every ready key
    # at each switch made the order quadratic in microbatches (all M
    # forwards of the first device are ready at once): 12.7 s at M=1024.
    choices: list[tuple[tuple, Key]] = []

    def push(i: int) -> None:
        queue = ready.setdefault(keys[i], [])
        if not queue or i < queue[0]:
            heapq.heappush(choices, (priority(keys[i], i), keys[i]))
        heapq.heappush(queue, i)

    for i in range(n):
        if waiting[i] == 0:
            push(i)

    order, current = [], None
    while ready:
        if current not in ready:
            while True:
                (*_, head), key = heapq.heappop(choices)
                if key in ready and ready[key][0] == head:
                    break
            current = key
        queue = ready[current]
        i = heapq.heappop(queue)
        if queue:
            heapq.heappush(choices, (priority(current, queue[0]), current))
        else:
            del ready[current]
        order.append(i)
        for j in users[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                push(j)
    if len(order) != n:
        raise ValueError("the work items' dependencies form a cycle")
    return order


def runs(order: Sequence[int], keys: Sequence[Key]) -> list[list[int]]:
    """`order` cut into runs of consecutive items with the same key: the stages."""
    out: list[list[int]] = []
    for i in order:
        if out and keys[out[-1][-1]] == keys[i]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def stage_deps(stage_of: Sequence[int], item_deps: Sequence[Collection[int]],
               n_stages: int) -> list[set[int]]:
    """Each stage's producer stages, from its items' dependencies."""
    out: list[set[int]] = [set() for _ in range(n_stages)]
    for i, d in enumerate(item_deps):
        s = stage_of[i]
        out[s].update(stage_of[j] for j in d if stage_of[j] != s)
    return out


def device_orders(stage_keys: Sequence[Key], deps: Sequence[Collection[int]],
                  schedule: str) -> tuple[dict[str, tuple[int, ...]], str]:
    """Each device's stage order under `schedule`, and the schedule it realises.

    Stages are numbered in one global topological order (forwards before
    backwards). GPipe runs each device's stages in that order. 1F1B runs
    (pipeline depth - position) warm-up forwards, then one backward and one
    forward in turn, bounding activations in flight; a 1F1B order that would
    deadlock is replaced by GPipe's (any order that follows one global
    topological order cannot deadlock).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    gpipe: dict[str, list[int]] = {}
    for s, key in enumerate(stage_keys):
        gpipe.setdefault(key[0], []).append(s)
    base = {d: tuple(v) for d, v in gpipe.items()}
    if schedule == "gpipe" or all(k[1] is None for k in stage_keys):
        return base, schedule  # without microbatches the two orders are one
    order = _one_f_one_b(stage_keys, base)
    if completes(deps, order):
        return order, "1f1b"
    return base, "gpipe"


def _one_f_one_b(stage_keys, gpipe) -> dict[str, tuple[int, ...]]:
    fwd_devices: list[str] = []
    for dev, _, phase in (k[:3] for k in stage_keys):
        if phase == "forward" and dev not in fwd_devices:
            fwd_devices.append(dev)
    depth = len(fwd_devices)
    out = {}
    for dev, ids in gpipe.items():
        units: dict[tuple[str, int], list[int]] = {}
        head, tail = [], []
        for i in ids:
            _, mb, phase = stage_keys[i][:3]
            if mb is None:
                (head if phase == "pre" else tail).append(i)
            else:
                units.setdefault((phase, mb), []).append(i)
        fwd = sorted(k[1] for k in units if k[0] == "forward")
        bwd = sorted(k[1] for k in units if k[0] == "backward")
        warm = depth - fwd_devices.index(dev) if dev in fwd_devices else 0
        seq = [("forward", m) for m in fwd[:warm]]
        rest_f = fwd[warm:]
        for n, m in enumerate(bwd):
            seq.append(("backward", m))
            if n < len(rest_f):
                seq.append(("forward", rest_f[n]))
        seq += [("forward", m) for m in rest_f[len(bwd):]]
        out[dev] = tuple(head + [i for key in seq for i in units[key]] + tail)
    return out


def completes(deps: Sequence[Collection[int]], device_order: Mapping[str, Sequence[int]]) -> bool:
    """True if running each device's stages in order completes (no deadlock)."""
    pos = dict.fromkeys(device_order, 0)
    done: set[int] = set()
    progress = True
    while progress:
        progress = False
        for dev, ids in device_order.items():
            while pos[dev] < len(ids) and set(deps[ids[pos[dev]]]) <= done:
                done.add(ids[pos[dev]])
                pos[dev] += 1
                progress = True
    return len(done) == len(deps)
