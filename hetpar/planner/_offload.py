"""The offload search: where each layer's state lives and where its update runs.

DESIGN "State apart from compute": beside an 80 GB GPU, the host adds memory
and a CPU that can run an elementwise optimizer update, not FLOPs. So a layer
computing on an accelerator has three ways to hold its state (`Placement`):

- resident: parameters and optimizer state on the compute device, update
  there (every plan before offload);
- host: parameters and optimizer state on a host CPU device linked both
  ways, update on that CPU (ZeRO-Offload's rule, here per layer): weights go
  to the accelerator each step, gradients come back;
- streamed: parameters on the accelerator, optimizer state on a host CPU
  device or in a memory place linked both ways (the accelerator's pinned
  host memory, `gpu:0:pinned_host`), update on the accelerator: the
  optimizer state goes in before the update and the new state comes back;
  the new parameters stay (JAX's own host offload). A memory place cannot
  compute, so it only ever holds streamed state. Measured on an H100 host,
  copies between the GPU and its pinned host memory run ~50 GB/s each way,
  between the GPU and the CPU device ~7 GB/s: the same host RAM, reached
  faster through the place.
- fetched: parameters and optimizer state both in the accelerator's memory
  place, update on the accelerator (ZeRO-Infinity's parameter offload, per
  layer): the weights come in for each read (each microbatch's forward and
  backward, and the update) and leave again, so the accelerator holds only
  those in flight; the state comes in for the update and the new
  parameters and state go back. What lets a model whose weights,
  gradients and activations together exceed the GPU compute on it: a
  6.74B Llama-style model at 45 GB of an H200 otherwise computes 15 of its
  35 layers on the host CPU.

The search is one small ILP (pulp) over layer x compute device x way, built
on the placement ILP's variables (`_ilp`: x[l, d] and the edges' marginal
z): a binary y per offload option, at most x[l, c] of them per layer.

Memory (`hetpar.planner._arrays.held_bytes`, linear but for one max): a
resident layer holds its `memory_bytes`; an offloaded layer holds on its
compute device its weights, gradient and activations (memory_bytes less its
optimizer state; fetched, less its weights too; streamed or fetched with
one batch and an update waiting for no other gradient, its gradient only
in its backward's working set, `quick_gradients`), plus, streamed or fetched,
the optimizer state (and fetched, the weights) in flight for the
updates (`streamed_in_flight`: one of each, its copy donated, at most three, in
the largest; `_add_in_flight` linearises it); its host holds
`Arrays.state_copies` x its optimizer state (2, old and new; 1 where the step
donates its state), plus, host way, as many copies of its parameters, its
gradient, and its parameters once more in the runtime's pinned staging
(`staging_bytes`). A memory place and its host's CPU device draw on one RAM: their
sum is capped by the CPU device's memory too, a process's GPU places as the
doubling regions their one XLA pinned pool holds for them (`_pool_reserved`,
`ram_bytes`).

Time: the replay overlaps transfers with compute, which no linear form
captures; the ILP minimises T under lower bounds of the replayed step:

- the chain: layer times (less the update a host runs) + crossing edges;
- each link direction host -> accelerator: the weights (host way: once;
  fetched: once per stage reading them, the forward and the backward with
  its update, or each microbatch's and the update) and streamed states
  it carries (copies start at the step's start);
- accelerator -> host: the forward share of the accelerator's work (no
  gradient leaves before the backward) + the gradients and new streamed
  states;
- each host: the forward share of the accelerators' work + the host's own
  layers + its updates.

Its solution is then replayed (`simulate`), and `plan` keeps it only when its
replayed objective beats the best plan without offload. When no plan fits,
the same model with slack on every device's memory names the smallest
footprint found (`diagnose`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import numpy as np
import pulp

from hetpar.core import CostTable, InfeasibleError, Placement, nbytes, seconds
from hetpar.core._placement import pinned_pool_regions
from hetpar.planner import _ilp
from hetpar.planner._arrays import (
    STREAMED_IN_FLIGHT,
    Arrays,
    Placed,
    gradient_beyond_activations,
    held_bytes,
    ram_bytes,
    streamed_in_flight,
)

WAYS = ("resident", "host", "streamed", "fetched")
#: The baselines' names in plans.
ZERO_OFFLOAD = "zero_offload"
JAX_OFFLOAD = "jax_offload"
#: The search's defaults when `plan` is given no gap or time limit. Its time
#: is a linear bound that the replay corrects, so a 1% gap loses nothing
#: the replay would keep; identical blocks make proofs slow (a 36-layer
#: transformer capped to half its GPU: 1% in 6 s, 0.1% in 23 s with HiGHS).
DEFAULT_GAP = 1e-2
DEFAULT_TIME_LIMIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to place a layer: compute, state and update device positions."""

    layer: int
    compute: int
    state: int
    way: str  # "host", "streamed" or "fetched" (resident is x without any y)

    @property
    def update(self) -> int:
        return self.state if self.way == "host" else self.compute

    @property
    def params(self) -> int:
        """Where its parameters live: with the state on the host that updates
        them or in the memory place they are fetched from, else on the
        compute device (only the optimizer state streams)."""
        return self.state if self.way in ("host", "fetched") else self.compute


@dataclasses.dataclass(frozen=True)
class Search:
    """What the offload ILP found.

    Attributes:
      placements: {layer: Placement}, or None when no plan fits.
      status: the solver's status.
      gap: the relative gap at the end (None when unknown).
      objective: the ILP's (linearised) step time, seconds.
      solve_time_s, build_time_s: seconds.
      variables, constraints: model size.
    """

    placements: dict[str, Placement] | None
    status: str
    gap: float | None
    objective: float | None
    solve_time_s: float
    build_time_s: float
    variables: int
    constraints: int

    def info(self) -> dict:
        return {"status": self.status, "gap": self.gap, "objective": self.objective,
                "solve_time_s": self.solve_time_s, "build_time_s": self.build_time_s,
                "variables": self.variables, "constraints": self.constraints}


def hosts(arr: Arrays, c: int) -> list[int]:
    """The CPU devices that can hold accelerator c's offloaded state (linked both ways)."""
    return [h for h in homes(arr, c) if arr.cpu[h]]


def places(arr: Arrays, c: int) -> list[int]:
    """The memory places that can hold accelerator c's optimizer state (linked both ways)."""
    return [h for h in homes(arr, c) if arr.place[h]]


def homes(arr: Arrays, c: int) -> list[int]:
    """Where accelerator c's offloaded state may live: CPU devices and memory
    places linked both ways to it."""
    if arr.cpu[c] or arr.place[c]:
        return []
    return [int(h) for h in np.nonzero(arr.cpu | arr.place)[0] if h != c and arr.bw[c, h] > 0
            and arr.bw[h, c] > 0]


def options(arr: Arrays, compute: Mapping[str, str] | None = None) -> list[Option]:
    """Every offload option of every layer (resident ones are implied).

    A layer may offload from an accelerator it may run on (or the one
    `compute` gives) when its parameter bytes are known and it has optimizer
    state to move. Streamed, to its accelerator's memory place, or to a
    CPU device where the accelerator has none; fetched, parameters and
    state both to a memory place; the host way, to a CPU device with its
    update's time there.

    Why not stream from a CPU device beside a memory place: they are the
    same host RAM, but the runtime reaches the CPU device by `device_put`
    (~6 GB/s into an H200, against ~50 GB/s for the place's DMA), which a
    spec sheet's single host link does not tell apart: planned on spec
    sheets, the 5B offload plan chose the CPU device and predicted a step
    several times shorter than it would run.
    """
    out = []
    for i, n in enumerate(arr.layers):
        devs = [arr.dindex[compute[n]]] if compute is not None else np.nonzero(arr.ok[i])[0]
        for c in devs:
            if np.isnan(arr.opt[i, c]) or arr.opt[i, c] <= 0:
                continue
            has_place = bool(places(arr, c))
            for h in homes(arr, c):
                if not (has_place and arr.cpu[h]):
                    out.append(Option(i, int(c), int(h), "streamed"))
                if arr.place[h] and np.nan_to_num(arr.param[i]) > 0:
                    out.append(Option(i, int(c), int(h), "fetched"))
                if arr.cpu[h] and np.isfinite(arr.upd[i, h]):
                    out.append(Option(i, int(c), int(h), "host"))
    return out


def memory_tight(arr: Arrays, microbatches: int = 1) -> bool:
    """Whether some device with offload options could not hold every layer it
    may run (`Arrays.mem_at(microbatches)`), with the largest working set among them."""
    devs = {o.compute for o in options(arr)}
    mem = arr.mem_at(microbatches)
    return any(mem[arr.ok[:, j], j].sum() + arr.ws[arr.ok[:, j]].max(initial=0.0)
               > arr.cap[j] * (1 + 1e-9) for j in devs)


def placements_of(arr: Arrays, compute: np.ndarray, chosen: Mapping[int, Option]
                  ) -> dict[str, Placement]:
    """{layer: Placement} from compute positions and the chosen offload options."""
    out = {}
    for i, n in enumerate(arr.layers):
        o = chosen.get(i)
        c = arr.devices[compute[i]]
        out[n] = Placement(c) if o is None else Placement(
            c, arr.devices[o.state], arr.devices[o.update], params=arr.devices[o.params])
    return out


def search(arr: Arrays, *, compute: Mapping[str, str] | None = None, solver: str = "cbc",
           time_limit: float | None = None, gap: float | None = None,
           microbatches: int = 1, contiguous: bool = False) -> Search:
    """The offload ILP: the placements minimising the linearised step under memory.

    Args:
      arr: the table's arrays (device capacities already capped).
      compute: fix each layer's compute device ({layer: device}); None: the
        search places compute too (a layer may move to the host CPU when that
        frees the accelerator better than offloading its state).
      solver: "cbc" or "highs".
      time_limit, gap: as for `hetpar.plan` (None: DEFAULT_TIME_LIMIT_S,
        DEFAULT_GAP); on the time limit the best placements found are kept.
      microbatches: gradients cross once per microbatch.
      contiguous: each device holds one contiguous run of layers.
    """
    t0 = time.perf_counter()
    m, y, step = _model(arr, compute, microbatches, slack=np.zeros(len(arr.devices), bool))
    if contiguous:
        _ilp._add_contiguity(m)
    return _solve(m, y, step, solver, time_limit, gap, time.perf_counter() - t0)


def diagnose(arr: Arrays, *, solver: str = "cbc", time_limit: float | None = None,
             microbatches: int = 1) -> InfeasibleError:
    """Why no placement with offload fits memory, naming the smallest footprint found.

    First with the accelerators' memory kept and the CPUs' allowed to
    overflow: if that fits, the host is what is short, and the error names
    the least it would need. Else with every device allowed to overflow,
    minimising the total overflow: the error names each device that
    overflows and its footprint there.
    """
    for elastic in (arr.cpu | arr.place, np.ones(len(arr.devices), bool)):
        if not elastic.any():
            continue
        m, y, slack = _model(arr, None, microbatches, slack=elastic)
        status, _, _ = _ilp._run_solver(m.prob, solver, time_limit or DEFAULT_TIME_LIMIT_S,
                                        DEFAULT_GAP)
        if status in ("optimal", "feasible"):
            break
    else:
        return InfeasibleError("no placement fits memory even with state offloaded to the "
                               "host", api="raise memory_bytes of the accelerators",
                               cli="give the accelerators more memory (--memory DEVICE=GB, or "
                                   "devices[].memory_bytes in graph.json), or a smaller --batch")
    over = {j: float(v.varValue or 0.0) * _GB for j, v in slack.items()}
    compute = np.array([max(m.dev_of[i], key=lambda j, i=i: m.x[i, j].varValue or 0.0)
                        for i in range(len(arr.layers))])
    chosen = {o.layer: o for o, v in y.items()
              if (v.varValue or 0.0) > 0.5 and compute[o.layer] == o.compute}
    held = held_bytes(arr, _placed(arr, compute, chosen), microbatches)
    ram = ram_bytes(arr, held)
    parts = []
    # A place over its own cap (XLA's pinned pool, under its host's RAM)
    # overflows into the slack it shares with its host's CPU device: name it
    # apart from the RAM, which may have room.
    for k in np.nonzero(arr.place)[0]:
        j = int(arr.ram[k])
        if j != k and j in over and held[k] > arr.cap[k] * (1 + 1e-6) and ram[j] <= arr.cap[j]:
            over[int(k)], over[j] = over[j], 0.0
    for j in sorted(over, key=lambda j: -over[j]):
        if over[j] <= arr.cap[j] * 1e-6:
            continue
        d = arr.devices[j]
        holds = f"{d} holds {nbytes(arr.cap[j])}"
        n = sum(o.state == j for o in chosen.values())
        sharing = [k for k in np.nonzero((arr.ram == j) & arr.place)[0] if held[k] > 0]
        if arr.place[j]:
            params = sum(o.state == j and o.params == j for o in chosen.values())
            kept = f", {params} of them with their parameters" if params else ""
            parts.append(f"the state does not fit host memory: {d} would need at least "
                         f"{nbytes(held[j])} ({n} layers' optimizer state{kept} "
                         f"x{arr.state_copies}), {holds} (a GPU's pinned host memory "
                         "is held to XLA's pool too: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, in "
                         "GiB, set before JAX starts)")
        elif arr.cpu[j] and sharing and ram[j] > held[j]:
            names = " + ".join(arr.devices[k] for k in sharing)
            pooled = [k for k in sharing if arr.pooled[k]]
            regions = (f"; XLA's pinned pool holding its regions for the "
                       f"{nbytes(float(held[pooled].sum()))} in "
                       f"{' + '.join(arr.devices[k] for k in pooled)}" if pooled else "")
            parts.append(f"the state does not fit host memory: {d} and {names} share it and "
                         f"would need at least {nbytes(ram[j])} (offloaded state "
                         f"x{arr.state_copies} with what the host updates and stages, and "
                         f"{nbytes(held[j])} of it on {d}{regions}), {holds}")
        elif arr.cpu[j]:
            ups = sum(o.state == j and o.way == "host" for o in chosen.values())
            grads = (f", and the gradients of its {ups} updates and their parameters "
                     "staged for the accelerator" if ups else "")
            params = sum(o.state == j and o.params == j for o in chosen.values())
            kept = ("parameters and optimizer state" if params == n else "optimizer state"
                    if not params else f"optimizer state, and {params} of them parameters,")
            what = [f"{n} layers' offloaded state: {kept} x{arr.state_copies}{grads}"] if n else []
            k = int((compute == j).sum())
            what += [f"the {k} layers it computes"] if k else []
            lead = "the state does not fit host memory: " if n else ""
            parts.append(f"{lead}{d} would need at least {nbytes(held[j])} "
                         f"({' and '.join(what)}), {holds}")
        else:
            parts.append(f"the smallest footprint found needs {nbytes(held[j])} on {d} "
                         f"(weights, gradients and activations, with {len(chosen)} layers' "
                         f"state on the host), {holds}")
    if not parts:
        return InfeasibleError("no placement fits memory with state offloaded to the host "
                               "(the solver found none in time; raise time_limit)")
    return InfeasibleError("no plan fits memory, even with state offloaded to the host: "
                           + "; ".join(parts) + "; raise the memory (or --memory caps) of "
                           "those devices or use a smaller batch")


_GB = 1e9  # slack variables count gigabytes, so solver tolerances stay meaningful


def _placed(arr: Arrays, compute: np.ndarray, chosen: Mapping[int, Option]) -> Placed:
    state, update, params = compute.copy(), compute.copy(), compute.copy()
    for i, o in chosen.items():
        state[i], update[i], params[i] = o.state, o.update, o.params
    return Placed(np.asarray(compute), state, update, params)


def _add_in_flight(prob, s, streamed: list, tag: str) -> None:
    """s >= `streamed_in_flight(n)` x the largest optimizer state of the chosen
    streamed options [(y, state GB, streaming stages)] (`held_bytes`), n =
    their streaming stages: a binary per count k up to where the bound stops
    rising says n >= k, each relaxing its bound when off."""
    if not streamed:
        return
    n, big = sum(k for _, _, k in streamed), max(opt for _, opt, _ in streamed)
    count = [(v, float(k)) for v, _, k in streamed]
    streamed = [(v, opt) for v, opt, _ in streamed]
    bounds = [(streamed_in_flight(1), None)]
    for k in range(2, STREAMED_IN_FLIGHT + 1):
        if n >= k and streamed_in_flight(k) > bounds[-1][0]:
            z = prob.add_variable(f"n{tag}_{k}", cat=pulp.LpBinary)
            prob.addConstraint(_ilp._affine(count + [(z, -float(n))]) <= k - 1, f"n{tag}_{k}")
            bounds.append((streamed_in_flight(k), z))
    for copies, z in bounds:
        for v, opt in streamed:
            terms = [(s, 1.0), (v, -copies * opt)]
            if z is not None:  # off (fewer chosen): s >= copies (opt y - big)
                terms.append((z, -copies * big))
            prob.addConstraint(_ilp._affine(terms) >= (0.0 if z is None else -copies * big),
                               f"fl{tag}_{copies}_{v.name}")


def _pool_reserved(prob, arr: Arrays, j: int, held: list, limit: float):
    """A variable r >= what XLA's pinned pool draws of host j's RAM, in GB,
    to serve `held` (an affine list, GB) under its `limit` (bytes): the
    smallest sum of its doubling regions that covers it, at most the limit
    (`pinned_pool_reserved`, `ram_bytes`). A binary per region sum T above
    64 MiB says held > T, and r >= the next sum (or the limit); below, r >=
    twice what it serves."""
    r = prob.add_variable(f"pool{j}", lowBound=0)
    # what the pool could ever be asked to serve: a bound for the binaries
    most = 2 * float(np.nansum(arr.table_mem.max(axis=1)) + 3 * np.nansum(arr.param)
                     + np.nansum(arr.opt.max(axis=1, initial=0.0))) / _GB + limit / _GB
    sums = [0.0, *pinned_pool_regions(limit)]
    first = next((n for n, t in enumerate(sums) if t >= 1 << 26), len(sums) - 1)
    first = min(first, len(sums) - 2)
    above = []
    for n in range(first, len(sums) - 1):
        b = prob.add_variable(f"pool{j}_{n}", cat=pulp.LpBinary)
        above.append(b)
        prob.addConstraint(_ilp._affine(held + [(b, -most)]) <= sums[n] / _GB, f"pool{j}_{n}")
        prob.addConstraint(_ilp._affine([(r, 1.0), (b, -min(sums[n + 1], limit) / _GB)]) >= 0,
                           f"poolr{j}_{n}")
    # below the first sum counted: twice what it serves
    low = [(r, 1.0)] + [(v, -2 * c) for v, c in held] + ([(above[0], 2 * most)] if above else [])
    prob.addConstraint(_ilp._affine(low) >= 0, f"pool{j}")
    # never less than it serves (over its limit only in the overflow model),
    # nor than the regions it holds already (`Arrays.pool_floor`)
    prob.addConstraint(_ilp._affine([(r, 1.0)] + [(v, -c) for v, c in held]) >= 0,
                       f"poolheld{j}")
    floor = float(arr.pool_floor[(arr.ram == j) & arr.pooled].max(initial=0.0))
    if floor > 0:
        prob.addConstraint(_ilp._affine([(r, 1.0)]) >= floor / _GB, f"poolfloor{j}")
    return r


def _model(arr: Arrays, compute: Mapping[str, str] | None, microbatches: int, *,
           slack: np.ndarray | bool):
    """The offload ILP: (model, {Option: y}, T), or with `slack` ([D] bool: the
    devices whose memory may overflow) the overflow model: (model, {Option: y},
    {device: overflow in GB})."""
    elastic = np.broadcast_to(np.asarray(slack, bool), (len(arr.devices),))
    slack = bool(elastic.any())
    m = _ilp._new_model(arr, "sequential", 1)
    _ilp._add_placement(m)
    prob, x, scale = m.prob, m.x, m.scale
    if compute is not None:
        for i, n in enumerate(arr.layers):
            prob.addConstraint(x[i, arr.dindex[compute[n]]] == 1, f"fix{i}")
    opts = options(arr, compute)
    y = {o: prob.add_variable(f"y{k}_{o.way[0]}", cat=pulp.LpBinary) for k, o in enumerate(opts)}
    by_pair: dict[tuple[int, int], list] = {}
    for o, v in y.items():
        by_pair.setdefault((o.layer, o.compute), []).append((v, 1.0))
    for (i, c), terms in by_pair.items():
        prob.addConstraint(_ilp._affine(terms + [(x[i, c], -1.0)]) <= 0, f"way{i}_{c}")
    p = np.nan_to_num(arr.param)
    M = max(int(microbatches), 1)

    # Memory, in GB.
    D = len(arr.devices)
    use: list[list] = [[] for _ in range(D)]
    transient: dict[int, list] = {}
    streams: dict[int, list] = {}  # streamed options' optimizer state, per device
    mem = arr.mem_at(M)  # pipelined, activations and gradients both count
    for (i, j), v in x.items():
        use[j].append((v, float(mem[i, j]) / _GB))
        if arr.ws[i] > 0:  # its working set, while it runs (`held_bytes`)
            transient.setdefault(j, []).append((v, float(arr.ws[i]) / _GB))
    # One batch, an update waiting for no other layer's gradient: a streamed
    # or fetched layer's gradient lives in its backward's stage only
    # (`held_bytes`, `quick_gradients`).
    quick = ~arr.waits if M == 1 else np.zeros(len(arr.layers), dtype=bool)
    beyond = gradient_beyond_activations(arr)
    for o, v in y.items():
        opt = float(arr.opt[o.layer, o.compute])
        # The old (and without donation the new) optimizer state leave the
        # device (`held_bytes`), and the new parameters where the host
        # updates them; fetched, the weights too (only those in flight stay).
        copies = arr.state_copies
        kept_weights = {"host": copies - 1, "fetched": copies}.get(o.way, 0)
        leaves = copies * opt + kept_weights * p[o.layer]
        if o.way != "host" and quick[o.layer]:  # its gradient, in its backward's stage only
            leaves += float(beyond[o.layer])
            transient.setdefault(o.compute, []).append(
                (v, float(arr.ws[o.layer] + p[o.layer]) / _GB))
        # never more than the layer holds there (`held_bytes` floors it at 0)
        leaves = min(leaves, float(mem[o.layer, o.compute]))
        use[o.compute].append((v, -leaves / _GB))
        # The host way: its parameters and its gradient there, and its
        # parameters once more in the runtime's pinned staging
        # (`staging_bytes`); fetched, its parameters beside the state.
        there = {"host": copies + 2, "fetched": copies}.get(o.way, 0)
        use[o.state].append((v, (copies * opt + there * p[o.layer]) / _GB))
        if o.way != "host":  # in flight: the state, and fetched, the weights
            visiting = opt + (p[o.layer] if o.way == "fetched" else 0.0)
            # (streaming stages: a fetched layer's each microbatch, `held_bytes`)
            stages = M if o.way == "fetched" else 1
            streams.setdefault(o.compute, []).append((v, visiting / _GB, stages))
    slacks, held_once = {}, {}
    for j in range(D):
        terms = list(use[j])
        if j in transient:  # the largest working set
            s = prob.add_variable(f"S{j}", lowBound=0)
            held_once.setdefault(j, []).append(s)
            for v, ws in transient[j]:
                prob.addConstraint(_ilp._affine([(s, 1.0), (v, -ws)]) >= 0, f"tr{j}_{v.name}")
            terms.append((s, 1.0))
        if j in streams:  # beside it, the streamed state in flight
            f = prob.add_variable(f"F{j}", lowBound=0)
            held_once.setdefault(j, []).append(f)
            _add_in_flight(prob, f, streams[j], f"{j}")
            terms.append((f, 1.0))
        if not terms:
            continue
        if elastic[j]:
            # A memory place overflows its host's RAM: one slack for both, or
            # the objective would count the same missing gigabytes twice and
            # the diagnosis would name a larger footprint than the smallest.
            r = int(arr.ram[j])
            k = r if arr.place[j] and r != j and elastic[r] else j
            if k not in slacks:
                slacks[k] = prob.add_variable(f"over{k}", lowBound=0)
            terms.append((slacks[k], -1.0))
        prob.addConstraint(_ilp._affine(terms) <= float(arr.cap[j]) / _GB, f"mem{j}")
    for j in np.unique(arr.ram[arr.place]):  # a host CPU device and its memory places: one RAM
        sharing = np.nonzero((arr.ram == j) & arr.place)[0]
        if arr.place[j] or not any(use[k] for k in sharing):
            continue  # a place without a CPU device in the table has its own cap only
        shared = list(use[j]) + [(v, 1.0) for v in held_once.get(j, [])]
        pooled = []  # one XLA pinned pool serves the accelerators' places
        for k in sharing:
            terms = use[k] + [(v, 1.0) for v in held_once.get(k, [])]
            (pooled if arr.pooled[k] else shared).extend(terms)
        if pooled:
            limit = float(arr.pool[sharing[arr.pooled[sharing]]].max())
            shared.append((_pool_reserved(prob, arr, j, pooled, limit), 1.0))
        if elastic[j]:
            if j not in slacks:
                slacks[j] = prob.add_variable(f"over{j}", lowBound=0)
            shared.append((slacks[j], -1.0))
        prob.addConstraint(_ilp._affine(shared) <= float(arr.cap[j]) / _GB, f"ram{j}")
    if slack:
        _ilp._add_transfers(m, [])  # only links: two unlinked neighbours stay apart
        prob.setObjective(_ilp._affine([(v, 1.0) for v in slacks.values()]))
        return m, y, slacks

    # Time, in the model's scaled units.
    chain = [(v, float(m.t_s[i, j])) for (i, j), v in x.items()]
    _ilp._add_transfers(m, chain)
    fwd_on: dict[int, list] = {}
    for (i, j), v in x.items():
        fwd_on.setdefault(j, []).append((v, _FORWARD_SHARE * float(m.t_s[i, j])))
    links: dict[tuple[int, int], list] = {}  # by bus: a memory place's is its host CPU's
    host_work: dict[int, list] = {}
    slower: list = []
    for o, v in y.items():
        i, c, h = o.layer, o.compute, o.state
        opt = float(arr.opt[i, c])
        bus_in, bus_out = (int(arr.ram[h]), c), (c, int(arr.ram[h]))

        def move(a, b, nbytes, params=0, opt_state=False, v=v, i=i):
            # One copy of the arrays it moves, each at its size on a measured
            # curve, as the replay sends it.
            leaves = (arr.state_leaves(i, "param") * params
                      + (arr.state_leaves(i, "opt_state") if opt_state else ()))
            return (v, arr.link_s(a, b, nbytes, leaves) / scale)

        if o.way == "host":
            links.setdefault(bus_in, []).append(move(h, c, p[i], 1))  # the weights
            u_here = min(float(np.nan_to_num(arr.upd[i, c])), float(arr.t[i, c]))
            chain.append((v, -u_here / scale))
            v_, t_ = move(c, h, p[i])  # the gradient: an edge, whole, as the replay
            links.setdefault(bus_out, []).append((v_, M * t_))
            host_work.setdefault(h, []).append((v, float(arr.upd[i, h]) / scale))
        elif o.way == "fetched":  # weights in per read; new weights and state back
            # (one batch: the update shares its backward's stage and copy,
            # unless it waits for other layers' gradients, which the replay counts)
            # The replay sends each read's weights apart, and the optimizer
            # state apart: a latency each.
            reads = 2 if M == 1 else 2 * M + 1
            weights, state = move(h, c, p[i], 1), move(h, c, opt, 0, True)
            links.setdefault(bus_in, []).append((v, reads * weights[1] + state[1]))
            links.setdefault(bus_out, []).append(move(c, h, p[i] + opt, 1, True))
        else:  # parameters stay on c: only the optimizer state goes and comes back
            links.setdefault(bus_in, []).append(move(h, c, opt, 0, True))
            links.setdefault(bus_out, []).append(move(c, h, opt, 0, True))
            if arr.cpu[h] and places(arr, c):
                # At equal figures prefer the memory place: a spec sheet gives both
                # the bus's speed, but on an H100 host the CPU device's path
                # measured ~7 GB/s against ~50 GB/s through pinned host memory.
                slower.append(move(h, c, opt, 0, True))
    step = prob.add_variable("T", lowBound=0)
    prob.addConstraint(_ilp._affine(chain + [(step, -1.0)]) <= 0, "chain")
    for (a, b), terms in links.items():
        # gradients leave after the forward
        lead = fwd_on.get(a, []) if arr.cpu[b] or arr.place[b] else []
        prob.addConstraint(_ilp._affine(terms + lead + [(step, -1.0)]) <= 0, f"link{a}_{b}")
    for h, terms in host_work.items():
        own = [(v, float(m.t_s[i, j])) for (i, j), v in x.items() if j == h]
        lead = [t for c, ts in fwd_on.items() if c != h for t in ts]
        prob.addConstraint(_ilp._affine(terms + own + lead + [(step, -1.0)]) <= 0, f"host{h}")
    # Only the largest bound sets T; a small weight on the chain and the links
    # keeps the rest from growing where it costs the replay (an activation
    # queued behind the weight copies) but not the bound.
    tie = [(v, _TIE * c) for v, c in chain] + [
        (v, _TIE * c) for terms in links.values() for v, c in terms] + [
        (v, _TIE * c) for v, c in slower]
    prob.setObjective(_ilp._affine([(step, 1.0)] + tie))
    return m, y, step


_FORWARD_SHARE = 1.0 / 3.0  # as the replay's (`_simulate.FORWARD_SHARE`)
_TIE = 0.01


def _solve(m, y: Mapping[Option, pulp.LpVariable], step, solver: str,
           time_limit: float | None, gap: float | None, build: float) -> Search:
    arr = m.arr
    status, final_gap, solve_s = _ilp._run_solver(
        m.prob, solver, DEFAULT_TIME_LIMIT_S if time_limit is None else time_limit,
        DEFAULT_GAP if gap is None else gap)
    n_vars, n_cons = m.prob.numVariables(), m.prob.numConstraints()
    if status not in ("optimal", "feasible"):
        return Search(None, status, None, None, solve_s, build, n_vars, n_cons)
    compute = np.array([max(m.dev_of[i], key=lambda j, i=i: m.x[i, j].varValue or 0.0)
                        for i in range(len(arr.layers))])
    chosen = {}
    for o, v in y.items():
        if (v.varValue or 0.0) > 0.5 and compute[o.layer] == o.compute:
            chosen[o.layer] = o
    value = step.varValue
    return Search(placements_of(arr, compute, chosen), status, final_gap,
                  None if value is None else float(value) * m.scale, solve_s, build,
                  n_vars, n_cons)


def variants(arr: Arrays, placements: Mapping[str, Placement]
             ) -> list[tuple[str, dict[str, Placement]]]:
    """The same offloaded layers with every update on the host, every one streamed,
    every one streamed from its compute device's memory place, or every one
    fetched from there (parameters too).

    The ILP's time is a linear bound; the replay, which overlaps the
    transfers with compute, may prefer another way for all of them.
    """
    out = []
    for way in ("host", "streamed", "pinned", "fetched"):
        changed, new = False, dict(placements)
        for n, p in placements.items():
            if not p.offloaded:
                continue
            i, c = arr.lindex[n], arr.dindex[p.compute]
            s = arr.dindex[p.state]
            if way == "host":
                host = s if arr.cpu[s] else next(iter(hosts(arr, c)), None)
                if host is None or not np.isfinite(arr.upd[i, host]):
                    continue
                q = Placement(p.compute, arr.devices[host], arr.devices[host])
            elif way == "streamed":
                q = Placement(p.compute, p.state, p.compute, params=p.compute)
            else:
                home = next(iter(places(arr, c)), None)
                if home is None:
                    continue
                weights = arr.devices[home] if way == "fetched" else p.compute
                q = Placement(p.compute, arr.devices[home], p.compute, params=weights)
            if q != p:
                new[n], changed = q, True
        if changed:
            out.append((f"all {way}", new))
    return out


def _fastest_accelerator(arr: Arrays, homes) -> int | None:
    """The accelerator that runs every layer in the least total time and has
    somewhere to put state (`homes(arr, c)`: its hosts or its memory places)."""
    best, best_t = None, np.inf
    for c in range(len(arr.devices)):
        if arr.cpu[c] or arr.place[c] or not arr.ok[:, c].all() or not homes(arr, c):
            continue
        total = float(arr.t[:, c].sum())
        if total < best_t:
            best, best_t = c, total
    return best


def zero_offload(table: CostTable, *, arrays: Arrays | None = None
                 ) -> tuple[dict[str, Placement] | None, str | None]:
    """ZeRO-Offload's rule: all compute on one accelerator, every offloadable
    layer's state and update on its host CPU.

    The accelerator is the one every layer may run on with the least total
    time; the host the linked CPU with the most memory.

    Returns:
      (placements, None), or (None, why the rule does not apply).
    """
    arr = arrays or Arrays(table)
    best = _fastest_accelerator(arr, hosts)
    if best is None:
        return None, "no accelerator runs every layer with a host CPU linked both ways"
    h = max(hosts(arr, best), key=lambda j: arr.cap[j])
    out, moved = {}, 0
    for i, n in enumerate(arr.layers):
        if np.isfinite(arr.opt[i, best]) and arr.opt[i, best] > 0 and np.isfinite(
                arr.upd[i, h]):
            out[n] = Placement(arr.devices[best], arr.devices[h], arr.devices[h])
            moved += 1
        else:
            out[n] = Placement(arr.devices[best])
    if not moved:
        return None, ("no layer's state can go to the host (the table lacks param_bytes or "
                      "update_s on the host)")
    return out, None


def jax_offload(table: CostTable, *, arrays: Arrays | None = None
                ) -> tuple[dict[str, Placement] | None, str | None]:
    """JAX's own host offload, as its memory-kinds docs write it: every layer
    computes and updates on one accelerator, its parameters stay there, its
    optimizer state lives in the accelerator's pinned host memory (a memory
    place) and streams in for the update.

    The accelerator is the one every layer may run on with a memory place
    linked both ways and the least total time.

    Returns:
      (placements, None), or (None, why the rule does not apply).
    """
    arr = arrays or Arrays(table)
    best = _fastest_accelerator(arr, places)
    if best is None:
        return None, ("no accelerator runs every layer with a pinned_host memory place "
                      "linked both ways")
    h = arr.devices[places(arr, best)[0]]
    c = arr.devices[best]
    out, moved = {}, 0
    for i, n in enumerate(arr.layers):
        if np.isfinite(arr.opt[i, best]) and arr.opt[i, best] > 0:
            out[n] = Placement(c, h, c, params=c)
            moved += 1
        else:
            out[n] = Placement(c)
    if not moved:
        return None, "no layer's optimizer state can leave the accelerator (no param_bytes)"
    return out, None


def describe(arr: Arrays, placements: Mapping[str, Placement], step_s: float) -> str:
    """One line on a plan's offload: how many layers, where, the bytes moved."""
    apart = [(n, p) for n, p in placements.items() if p.offloaded]
    if not apart:
        return "no state offloaded"
    host = sum(p.update != p.compute for _, p in apart)
    fetched = sum(p.update == p.compute and p.params != p.compute for _, p in apart)
    states = sorted({p.state for _, p in apart})
    # Weights kept on a CPU device move in once a step; fetched from a
    # memory place, once per stage that reads them (the forward, the
    # backward with the update: one batch).
    moved = sum((2 if arr.place[arr.dindex[p.params]] else 1)
                * float(np.nan_to_num(arr.param[arr.lindex[n]]))
                for n, p in apart if p.params != p.compute)
    with_params = f", {fetched} with their parameters" if fetched else ""
    return (f"{len(apart)} layers' state on {', '.join(states)} ({host} updated there, "
            f"{len(apart) - host} streamed to their compute device{with_params}); weights "
            f"in each step {nbytes(moved)}; step {seconds(step_s)}")
