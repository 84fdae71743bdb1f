"""Scale-out on paper (issue 16): the planner's predicted step of a GPT on many hosts.

2, 8 and 64 hosts of 8 H100s, each host on a network of 100 Gb/s, 400 Gb/s
or 3.2 Tb/s, a GPT of 1.3B and one of 13B parameters, and three kinds of
plan: data parallel over every GPU, hierarchical (one host's plan replicated
on every host, data parallel across hosts) and pipelined (one pipeline stage
per host, data parallel over the host's 8 GPUs inside each stage). Nothing
runs on a GPU: every figure is the planner's prediction from spec sheets.
The assumptions are written out in results/scaleout_paper/README.md.

    python experiments/scaleout_paper.py --out experiments/results/scaleout_paper

Costs of the layers come from hetpar itself: the zoo's GPT ("transformer")
traced at full width with two blocks (abstract shapes: nothing is
allocated), priced by the roofline on the H100 spec sheet
(`hetpar.cost_models.cost_table`), at one and two sequences; every figure
is affine in the batch, so the two traces give it at any batch, and the
model's depth comes from repeating the block. Plans are priced by the
planner's own functions: `evaluate_data_parallel` (data parallel);
`evaluate` in pipelined mode with M microbatches and `evaluate_replayed`
(the GPipe replay `plan` reports) for pipelines, whose stages are the
layers cut into balanced contiguous runs (`--ilp` checks them against the
planner's ILP, `plan(..., contiguous=True)`); `violations` and
`data_parallel_obstacle` for memory; the planner's recompute-priced table
where activations do not fit; and the ring all-reduce term of
`evaluate_data_parallel` (`ring_allreduce_s`, `hierarchical_allreduce_s`)
for the all-reduces across hosts. About 80 s on the 2-core development
machine (20 s with `--ilp 0`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hetpar import cost_models  # noqa: E402
from hetpar.core import (  # noqa: E402  # noqa: E402
    CostTable,
    Device,
    Edge,
    Layer,
    Link,
    hierarchical_allreduce_s,
    ring_allreduce_s,
)
from hetpar.planner import (  # noqa: E402
    Arrays,
    data_parallel_obstacle,
    evaluate,
    evaluate_data_parallel,
    evaluate_replayed,
    held_bytes,
    plan,
    violations,
)
from hetpar.planner._solve import _remat_table  # noqa: E402
from hetpar.zoo._costs import trace_model  # noqa: E402

# -- the setting ------------------------------------------------------------------

SEQ = 2048
VOCAB = 50257
#: GPT-3's 1.3B ("XL") and 13B shapes (Brown et al. 2020, Table 2.1), head
#: width 128; GPT-2's layout (learned positions, tied embedding, 4x MLP).
MODELS = {
    "GPT 1.3B": dict(d_model=2048, num_heads=16, num_layers=24),
    "GPT 13B": dict(d_model=5120, num_heads=40, num_layers=40),
}
HOSTS = (2, 8, 64)
GPUS = 8  # per host
#: Bytes per second each way per host (full duplex): 100 Gb/s, 400 Gb/s, 3.2 Tb/s.
NETWORKS = {"100 Gb/s": 100e9 / 8, "400 Gb/s": 400e9 / 8, "3.2 Tb/s": 3.2e12 / 8}
#: NVLink 4 on the H100 SXM5: 900 GB/s per GPU both ways together, 450 each
#: way, every pair of a host's 8 GPUs through NVSwitch (NVIDIA H100
#: datasheet). Not in cost_models/specs/h100.json, which has the host link only.
NVLINK_BW = 450e9
#: Per message (one ring step, one pipeline transfer): estimates, not
#: spec-sheet figures. hetpar's runtime paid 0.17-0.20 ms per jax.device_put
#: between two H200s (experiments/results/probe_peer_h200x2.txt); NCCL's ring
#: steps run inside one kernel and pay microseconds.
NVLINK_LAT = 5e-6
NET_LAT = 10e-6


# -- the GPT's costs from hetpar's own cost extraction ------------------------------


def traced(cfg: dict, batch: int) -> CostTable:
    """The zoo GPT with two blocks at full width, one H100 (spec sheet), `batch` sequences."""
    config = dict(seq_len=SEQ, max_positions=SEQ, vocab_size=VOCAB, num_layers=2,
                  d_model=cfg["d_model"], num_heads=cfg["num_heads"])
    _, graph = trace_model("transformer", batch=batch, config=config, depth=1)
    return cost_models.cost_table(graph, ["h100"], memory_places=False)


class GPTCost:
    """A GPT's per-layer figures on one H100 at any batch (sequences), affine in the batch.

    Two traces (batch 1 and 2) give each figure as a + b x batch: time,
    memory, saved activations and the bytes of every edge; parameters and
    optimizer state do not change with the batch. The model's blocks are
    the traced block repeated; its edges those of the trace, h0 -> h1
    repeated between consecutive blocks.
    """

    def __init__(self, name: str, cfg: dict, compute_scale: float = 1.0):
        self.name, self.cfg, self.scale = name, cfg, compute_scale
        self.t1, self.t2 = traced(cfg, 1), traced(cfg, 2)
        self._rows = [{layer.name: layer for layer in t.layers} for t in (self.t1, self.t2)]
        assert self.t1.layer_names == ("wte", "wpe", "h0", "h1", "ln_f", "lm_head"), \
            self.t1.layer_names
        self.device = self.t1.devices[0]  # the H100 of the spec sheet (h100:0)
        n = cfg["num_layers"]
        self.blocks = [f"h{i}" for i in range(n)]
        self.layers = ["wte", "wpe", *self.blocks, "ln_f", "lm_head"]
        # Each layer's row in the trace: every block is h0 (h0 and h1 agree).
        self.source = {"wte": "wte", "wpe": "wpe", "ln_f": "ln_f", "lm_head": "lm_head",
                       **dict.fromkeys(self.blocks, "h0")}
        rename = {"h0": self.blocks[0], "h1": self.blocks[-1]}
        self.edges = []  # (src, dst, traced src, traced dst)
        for e in self.t1.edges:
            if (e.src, e.dst) == ("h0", "h1"):
                self.edges += [(a, b, "h0", "h1") for a, b in zip(self.blocks, self.blocks[1:])]
            else:
                self.edges.append((rename.get(e.src, e.src), rename.get(e.dst, e.dst),
                                   e.src, e.dst))
        self.params = sum(self.row(n_, 1)["param"] for n_ in self.layers) / 4  # f32

    def row(self, layer: str, batch: float) -> dict:
        """One layer's figures on one H100 at `batch` sequences.

        `fixed` is the intercept of the time in the batch (the optimizer
        update and one launch: what a step pays however few sequences it
        runs), `launch` that intercept less the update.
        """
        src = self.source[layer]
        a, b = self._rows[0][src], self._rows[1][src]
        d = self.device.name

        def at(x1, x2):
            return x1 + (x2 - x1) * (batch - 1)

        k = self.scale  # --compute-scale: every second of compute times k
        t1, t2 = a.time_s[d] * k, b.time_s[d] * k
        update = 0.0 if a.update_s is None else a.update_s[d] * k
        fixed = max(2 * t1 - t2, 0.0)
        return dict(time=at(t1, t2), fixed=fixed, launch=max(fixed - update, 0.0),
                    mem=at(a.memory_bytes[d], b.memory_bytes[d]),
                    act=at(a.activation_bytes, b.activation_bytes), param=a.param_bytes,
                    opt=a.opt_state_bytes, update=None if a.update_s is None else update)

    def edge_bytes(self, tsrc: str, tdst: str, batch: float) -> tuple[float, float]:
        """(forward, backward) bytes of a traced edge at `batch` sequences."""
        e1 = {(e.src, e.dst): e for e in self.t1.edges}[(tsrc, tdst)]
        e2 = {(e.src, e.dst): e for e in self.t2.edges}[(tsrc, tdst)]
        return (e1.bytes + (e2.bytes - e1.bytes) * (batch - 1),
                e1.bytes_backward + (e2.bytes_backward - e1.bytes_backward) * (batch - 1))

    def table(self, devices: list[Device], links: list[Link], batch: float, *,
              fixed: str, edge_batch: float | None = None) -> CostTable:
        """The whole model's CostTable on `devices`, each layer at `batch` sequences.

        `fixed` picks each layer's `fixed_s` (the part of its time that does
        not shrink with the batch): "update" (the update and one launch) for
        data parallel, where every replica updates all its state whatever
        its share of the batch; "launch" (one launch) for pipelines, where
        the planner pays `fixed_s` once per microbatch and the update runs
        once a step (folded into the layer's time, as the planner does).
        `edge_batch`: the edges' bytes at this batch (default `batch`): a
        device standing for a whole host (8 GPUs data parallel) sends the 8
        GPUs' activations at once, and a weight (the tied embedding's edge)
        once.
        """
        names = [d.name for d in devices]
        key = {"update": "fixed", "launch": "launch"}[fixed]
        layers = []
        for n in self.layers:
            r = self.row(n, batch)
            layers.append(Layer(
                n, time_s=dict.fromkeys(names, r["time"]),
                memory_bytes=dict.fromkeys(names, r["mem"]),
                fixed_s=dict.fromkeys(names, min(r[key], r["time"])),
                activation_bytes=r["act"], param_bytes=r["param"], opt_state_bytes=r["opt"],
                update_s=None if r["update"] is None else dict.fromkeys(names, r["update"])))
        edges = []
        for src, dst, ts, td in self.edges:
            f, b = self.edge_bytes(ts, td, batch if edge_batch is None else edge_batch)
            edges.append(Edge(src, dst, f, b))
        return CostTable(devices=tuple(devices), links=tuple(links), layers=tuple(layers),
                         edges=tuple(edges), meta={"source": f"scaleout_paper {self.name}",
                                                   "batch": batch})

    def gpu(self, name: str) -> Device:
        return dataclasses.replace(self.device, name=name)


def all_pairs(names: list[str], bw: float, lat: float) -> list[Link]:
    return [Link(a, b, bw, lat) for a in names for b in names if a != b]


# -- pricing a pipeline ---------------------------------------------------------------


def balanced_stages(table: CostTable, devices: list[str]) -> dict[str, str]:
    """{layer: device}: the layers in order, cut into len(devices) contiguous stages
    whose largest time is least (linear partition; all devices alike). On one
    host of the 1.3B model this is the plan the planner's ILP returns
    (`plan(..., contiguous=True)`, which needs ~30 s per table here and cannot
    prove it optimal among 8 identical GPUs: `--ilp` checks it)."""
    names = list(table.layer_names)
    t = [layer.time_s[devices[0]] for layer in table.layers]
    pre = [0.0]
    for x in t:
        pre.append(pre[-1] + x)
    L, S = len(t), len(devices)
    best = [[math.inf] * (L + 1) for _ in range(S + 1)]
    cut = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for s in range(1, S + 1):
        for j in range(s, L + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], pre[j] - pre[i])
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    out, j = {}, L
    for s in range(S, 0, -1):
        i = cut[s][j]
        out.update(dict.fromkeys(names[i:j], devices[s - 1]))
        j = i
    return out


def price_pipeline(table: CostTable, devices: list[str], microbatches: int,
                   ilp_s: float = 0.0) -> dict:
    """A pipeline of `table` over `devices` (balanced contiguous stages), M microbatches:
    the planner's closed form (`evaluate`, pipelined mode) and its GPipe replay
    (`evaluate_replayed`, what `plan` reports), memory by `violations`. When the
    activations do not fit, the same on the planner's recompute-priced table
    (`_remat_table`: activations leave the GPU, each layer one more forward;
    the split pass runs it as `activations="remat"`)."""
    why = None
    for remat in (False, True):
        t = _remat_table(table, Arrays(table)) if remat else table
        arr = Arrays(t)
        asg = balanced_stages(t, devices)
        bad = violations(t, asg, arrays=arr)
        if bad:
            why = (why + "; recomputing activations: " if why else "") + bad[0]
            continue
        closed = evaluate(t, asg, "pipelined", microbatches, arrays=arr)
        replay = evaluate_replayed(t, asg, microbatches, "gpipe", arrays=arr)
        peak = held_bytes(arr, arr.placed(asg))
        ilp = check_with_ilp(t, microbatches, ilp_s) if ilp_s > 0 else None
        return {"fits": True, "step_s": replay.step_time_s, "closed_form_s": closed.step_time_s,
                "ilp": ilp, "bottleneck": closed.bottleneck, "remat": remat, "assignment": asg,
                "gpu_gb": gib(float(peak.max())), "microbatches": microbatches,
                "param_bytes": {d: float(sum(arr.param[arr.lindex[n]] for n, x in asg.items()
                                             if x == d)) for d in devices}}
    return {"fits": False, "why": why}


def check_with_ilp(table: CostTable, microbatches: int, seconds: float) -> dict:
    """The planner's own pipelined plan of `table` (contiguous stages, ILP under a time
    limit), to compare with `balanced_stages`."""
    t0 = time.perf_counter()
    p = plan(table, mode="pipelined", microbatches=microbatches, contiguous=True,
             baselines=False, offload=False, activations=False, data_parallel=False,
             time_limit=seconds, gap=1e-3)
    return {"step_s": p.predicted.step_time_s, "status": p.solver["status"],
            "gap": p.solver.get("gap"), "solve_s": round(time.perf_counter() - t0, 1),
            "same_stages": p.assignment == balanced_stages(table, list(table.device_names))}


# -- the three plan kinds -----------------------------------------------------------


def gib(x: float) -> float:
    return round(x / 1e9, 1)


def data_parallel(cost: GPTCost, hosts: int, net_bw: float, per_gpu: int) -> dict:
    """Every GPU a replica of the whole model: `evaluate_data_parallel` on all hosts x 8 GPUs.

    Replicas in a ring host by host: NVLink inside a host, the network for
    the one hop from each host's last GPU to the next host's first; that hop
    gets the host's whole bandwidth (NCCL's channels spread over all the
    host's NICs). The table's batch is the global one (the planner gives
    each replica 1/N of it; each pays its update whole). The hierarchical
    all-reduce of the same gradients is priced beside it
    (`hierarchical_allreduce_s`).
    """
    names = [f"p{h}/h100:{g}" for h in range(hosts) for g in range(GPUS)]
    links = []
    for h in range(hosts):
        links += all_pairs(names[h * GPUS:(h + 1) * GPUS], NVLINK_BW, NVLINK_LAT)
        if hosts > 1:
            nxt = names[((h + 1) % hosts) * GPUS]
            links += [Link(names[h * GPUS + GPUS - 1], nxt, net_bw, NET_LAT),
                      Link(nxt, names[h * GPUS + GPUS - 1], net_bw, NET_LAT)]
    n = len(names)
    table = cost.table([cost.gpu(d) for d in names], links, batch=per_gpu * n, fixed="update")
    arr = Arrays(table)
    reason = data_parallel_obstacle(table, names, arrays=arr)
    if reason:
        return {"fits": False, "why": reason}
    p = evaluate_data_parallel(table, names, arrays=arr)
    grads = float(arr.param.sum())
    compute = p.step_time_s - p.transfer_s
    hier = hierarchical_allreduce_s(grads, hosts, GPUS, NVLINK_BW, net_bw,
                                    intra_latency_s=NVLINK_LAT, inter_latency_s=NET_LAT)
    return {"fits": True, "step_s": p.step_time_s, "compute_s": compute,
            "allreduce_s": p.transfer_s, "step_hier_s": compute + hier, "allreduce_hier_s": hier,
            "gpu_gb": gib(max(p.memory_bytes.values())), "grad_bytes": grads}


def host_plan(cost: GPTCost, per_gpu: int, ilp_s: float) -> dict:
    """One host's plan, as the planner chooses between its two kinds on 8 NVLinked
    H100s at the host's batch (8 x per_gpu sequences): a pipeline over the 8
    GPUs (M = the host's sequences, one per microbatch, at most 4 x 8) or
    data parallel over them; the faster that fits."""
    names = [f"h100:{g}" for g in range(GPUS)]
    links = all_pairs(names, NVLINK_BW, NVLINK_LAT)
    host_dp = data_parallel(cost, 1, 0.0, per_gpu)
    m = min(GPUS * per_gpu, 4 * GPUS)
    table = cost.table([cost.gpu(d) for d in names], links, batch=GPUS * per_gpu,
                       fixed="launch")
    pipe = price_pipeline(table, names, m, ilp_s)
    out = {"data parallel": host_dp, "pipeline": {k: v for k, v in pipe.items()
                                                  if k != "assignment"}}
    fits = {k: r["step_s"] for k, r in (("data parallel", host_dp), ("pipeline", pipe))
            if r["fits"]}
    if not fits:
        return {"fits": False, "why": f"data parallel: {host_dp['why']}; pipeline: "
                f"{pipe['why']}", "candidates": out}
    choice = min(fits, key=fits.get)
    if choice == "data parallel":
        r = host_dp
        kind, shard = "data parallel over 8 GPUs", [r["grad_bytes"] / GPUS] * GPUS
    else:
        r = pipe
        kind = f"pipeline over 8 GPUs, M={m}" + (", activations recomputed" if pipe["remat"]
                                                else "")
        shard = list(pipe["param_bytes"].values())  # each GPU's own layers' gradients
    return {"fits": True, "step_s": r["step_s"], "kind": kind, "remat": r.get("remat", False),
            "shard_bytes": shard, "gpu_gb": r["gpu_gb"], "candidates": out}


def hierarchical(cost: GPTCost, hosts: int, net_bw: float, one_host: dict) -> dict:
    """The one-host plan on every host, data parallel across hosts.

    After the host's step, each of its 8 GPUs all-reduces its share of the
    gradients with its peers on the other hosts, the 8 rings at once, each
    on 1/8 of the host's bandwidth: with a pipeline inside, its own layers'
    gradients (the largest share decides); with data parallel inside, 1/8
    of all (the host's own all-reduce, already in its step, costs what the
    reduce-scatter and all-gather inside a hierarchical all-reduce cost).
    """
    if not one_host["fits"]:
        return {"fits": False, "why": one_host["why"]}
    across = max(ring_allreduce_s(s, hosts, net_bw / GPUS, NET_LAT)
                 for s in one_host["shard_bytes"])
    return {"fits": True, "step_s": one_host["step_s"] + across, "allreduce_s": across,
            "kind": one_host["kind"], "remat": one_host["remat"], "gpu_gb": one_host["gpu_gb"]}


def pipelined(cost: GPTCost, hosts: int, net_bw: float, per_gpu: int) -> dict:
    """Layers pipelined across the hosts, one stage per host, data parallel over its 8 GPUs.

    The planner sees one device per host: a layer's time is one GPU's
    (every GPU of the host runs 1/8 of the global batch, hosts x per_gpu
    sequences), its memory one GPU's (all the layer's parameters and state,
    1/8 of the activations); an edge carries the 8 GPUs' slices at once over
    the host's bandwidth. M = hosts x per_gpu microbatches (8 sequences
    each, one per GPU; at most 4 x hosts). After the pipeline, each host's
    8 GPUs all-reduce their stage's gradients over NVLink (the hosts at once;
    the slowest counts).
    """
    if hosts > len(cost.layers):
        return {"fits": False, "na": True, "why": f"one stage per host needs {hosts} "
                f"stages; the model has {len(cost.layers)} layers"}
    names = [f"host{h}" for h in range(hosts)]
    devices = [dataclasses.replace(cost.gpu(d), kind="h100x8",
                                   price_per_hour=GPUS * cost.device.price_per_hour)
               for d in names]
    table = cost.table(devices, all_pairs(names, net_bw, NET_LAT), batch=hosts * per_gpu,
                       fixed="launch", edge_batch=GPUS * hosts * per_gpu)
    m = min(hosts * per_gpu, 4 * hosts)
    pipe = price_pipeline(table, names, m)
    if not pipe["fits"]:
        return pipe
    inside = max(ring_allreduce_s(b, GPUS, NVLINK_BW, NVLINK_LAT)
                 for b in pipe["param_bytes"].values())
    return {"fits": True, "step_s": pipe["step_s"] + inside, "pipeline_s": pipe["step_s"],
            "closed_form_s": pipe["closed_form_s"], "allreduce_s": inside,
            "remat": pipe["remat"], "bottleneck": pipe["bottleneck"], "microbatches": m,
            "kind": f"{hosts} stages, M={m}" + (", activations recomputed" if pipe["remat"]
                                               else ""),
            "gpu_gb": pipe["gpu_gb"]}


# -- the run ------------------------------------------------------------------------

KINDS = ("data parallel", "data parallel (hier. all-reduce)", "hierarchical", "pipelined")


def run(per_gpu: int, ilp_s: float, compute_scale: float, say) -> dict:
    rows = []
    models = {}
    for mname, cfg in MODELS.items():
        t0 = time.perf_counter()
        cost = GPTCost(mname, cfg, compute_scale)
        say(f"{mname}: traced ({cost.params / 1e9:.2f}B parameters, block "
            f"{cost.row('h0', 1)['time'] * 1e3:.1f} ms a sequence on an H100) in "
            f"{time.perf_counter() - t0:.1f} s")
        one = host_plan(cost, per_gpu, ilp_s)
        say(f"{mname}: one host's plan: " + (f"{one['kind']}, {one['step_s']:.3f} s a step"
            if one["fits"] else f"none fits: {one['why']}"))
        ilp = one["candidates"]["pipeline"].get("ilp")
        if ilp:
            say(f"{mname}: the planner's ILP on one host's pipeline: {ilp['step_s']:.4f} s "
                f"({ilp['status']}, gap {ilp['gap']:.3f}, {ilp['solve_s']} s); balanced cut "
                f"{one['candidates']['pipeline']['step_s']:.4f} s")
        models[mname] = {"params": cost.params, **{k: cfg[k] for k in cfg},
                         "one_host": {k: v for k, v in one.items() if k != "shard_bytes"},
                         "block_s_per_seq": cost.row("h0", 1)["time"],
                         "block_act_bytes_per_seq": cost.row("h0", 1)["act"]}
        for hosts in HOSTS:
            for net, bw in NETWORKS.items():
                t0 = time.perf_counter()
                dp = data_parallel(cost, hosts, bw, per_gpu)
                res = {"data parallel": dp,
                       "data parallel (hier. all-reduce)": (
                           {"fits": True, "step_s": dp["step_hier_s"],
                            "allreduce_s": dp["allreduce_hier_s"], "gpu_gb": dp["gpu_gb"]}
                           if dp["fits"] else dp),
                       "hierarchical": hierarchical(cost, hosts, bw, one),
                       "pipelined": pipelined(cost, hosts, bw, per_gpu)}
                tokens = hosts * GPUS * per_gpu * SEQ
                for r in res.values():
                    if r["fits"]:
                        r["tokens_per_s"] = tokens / r["step_s"]
                        # Model FLOP/s per GPU at 6 x parameters x tokens (no attention, no
                        # recomputation), against the TF32 dense peak the roofline used.
                        r["model_tflops_per_gpu"] = 6 * cost.params * r["tokens_per_s"] / (
                            hosts * GPUS) / 1e12
                fit = {k: r["step_s"] for k, r in res.items() if r["fits"]}
                best = min(fit, key=fit.get) if fit else None
                scale = None
                if best and one["fits"]:
                    scale = res[best]["tokens_per_s"] / (hosts * GPUS * per_gpu * SEQ
                                                         / one["step_s"])
                rows.append({"model": mname, "hosts": hosts, "gpus": hosts * GPUS,
                             "network": net, "network_bytes_per_s": bw,
                             "global_batch_seqs": hosts * GPUS * per_gpu, "tokens": tokens,
                             "plans": res, "best": best, "scaling_efficiency": scale})
                say(f"{mname}, {hosts} hosts, {net}: " + ", ".join(
                    f"{k} {r['step_s']:.3f} s" if r["fits"] else f"{k} -"
                    for k, r in res.items()) + f"  ({time.perf_counter() - t0:.1f} s)")
    return {"models": models, "rows": rows}


def fmt(r: dict) -> str:
    if not r["fits"]:
        return "n/a" if r.get("na") else "does not fit"
    s = f"{r['step_s']:.3f} s / {r['tokens_per_s'] / 1e3:,.0f}k"
    return s + (" (remat)" if r.get("remat") else "")


def markdown(result: dict, per_gpu: int) -> str:
    scale = result["setting"]["compute_scale"]
    what_if = "" if scale == 1 else (f" What-if: every layer's compute x {scale:g} "
                                     "(memory unchanged).")
    out = ["# Scale-out on paper: predicted step (seconds) / tokens per second",
           "",
           f"Weak scaling: {per_gpu} sequence(s) of {SEQ} tokens per GPU, global batch "
           f"hosts x 8 x {per_gpu}.{what_if} Each cell: step seconds / thousand tokens per "
           "second. "
           "\"(remat)\": fits only with activations recomputed. \"does not fit\": no plan of that "
           "kind fits 80 GB per GPU. \"n/a\": more hosts than layers. Assumptions: README.md.",
           "",
           "| model | hosts (GPUs) | network | data parallel (ring, as the planner) "
           "| data parallel (hier. all-reduce) | hierarchical | pipelined | best | "
           "scaling eff. |",
           "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        p = row["plans"]
        eff = "" if row["scaling_efficiency"] is None else f"{row['scaling_efficiency']:.0%}"
        out.append(f"| {row['model']} | {row['hosts']} ({row['gpus']}) | {row['network']} | "
                   + " | ".join(fmt(p[k]) for k in KINDS)
                   + f" | {row['best'] or 'none fits'} | {eff} |")
    out += ["", "One host's plan (the planner's choice on 8 H100s; the hierarchical plan "
            "replicates it):", ""]
    for m, info in result["models"].items():
        one = info["one_host"]
        out.append(f"- {m} ({info['params'] / 1e9:.2f}B): " + (
            f"{one['kind']}, {one['step_s']:.3f} s a step, {one['gpu_gb']} GB on the fullest GPU"
            if one["fits"] else f"none fits: {one['why']}"))
        for kind, c in one["candidates"].items():
            line = (f"{c['step_s']:.3f} s, {c['gpu_gb']} GB" + (
                ", activations recomputed" if c.get("remat") else "")
                if c["fits"] else f"does not fit ({c['why']})")
            ilp = c.get("ilp")
            if ilp:
                line += (f"; the planner's ILP (contiguous stages, {ilp['solve_s']} s, "
                         f"{ilp['status']}, gap {ilp['gap']:.1%}): {ilp['step_s']:.3f} s")
            out.append(f"  - {kind}: {line}")
    out += ["", "Plan details (all-reduce seconds, GB on the fullest GPU, pipeline stages):", "",
            "| model | hosts | network | DP all-reduce ring / hier. | hierarchical all-reduce "
            "| pipelined | GB per GPU (DP / hier. / pipe.) |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        p = row["plans"]
        dp, hi, pi = p["data parallel"], p["hierarchical"], p["pipelined"]
        out.append(
            f"| {row['model']} | {row['hosts']} | {row['network']} | "
            + (f"{dp['allreduce_s']:.3f} / {dp['allreduce_hier_s']:.3f}" if dp["fits"] else "-")
            + " | " + (f"{hi['allreduce_s']:.3f}" if hi["fits"] else "-")
            + " | " + (f"{pi['kind']}, pipeline {pi['pipeline_s']:.3f} s + all-reduce "
                       f"{pi['allreduce_s']:.3f} s" if pi["fits"] else "-")
            + " | " + " / ".join(str(r["gpu_gb"]) if r["fits"] else "-" for r in (dp, hi, pi))
            + " |")
    return "\n".join(out) + "\n"


def plot(result: dict, path: str, per_gpu: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models, nets = list(MODELS), list(NETWORKS)
    fig, axes = plt.subplots(len(models), len(nets), figsize=(13, 7.5), sharex=True,
                             squeeze=False)
    styles = {"data parallel": ("C0", "o-"), "data parallel (hier. all-reduce)": ("C0", "s--"),
              "hierarchical": ("C1", "^-"), "pipelined": ("C2", "d-")}
    for i, m in enumerate(models):
        for j, net in enumerate(nets):
            ax = axes[i][j]
            rows = [r for r in result["rows"] if r["model"] == m and r["network"] == net]
            for kind, (color, style) in styles.items():
                xs = [r["hosts"] for r in rows if r["plans"][kind]["fits"]]
                ys = [r["plans"][kind]["tokens_per_s"] / r["gpus"] for r in rows
                      if r["plans"][kind]["fits"]]
                if xs:
                    ax.plot(xs, ys, style, color=color, label=kind)
            one = result["models"][m]["one_host"]
            if one["fits"]:
                ax.axhline(per_gpu * SEQ / one["step_s"], color="gray", lw=0.8, ls=":",
                           label="one host alone")
            ax.set_xscale("log", base=2)
            ax.set_xticks(HOSTS, [str(h) for h in HOSTS])
            ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
            ax.set_title(f"{m}, {net} per host", fontsize=10)
            if j == 0:
                ax.set_ylabel("predicted tokens/s per GPU")
            if i == len(models) - 1:
                ax.set_xlabel("hosts of 8 H100s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"hetpar planner, predicted (spec sheets; {per_gpu} x {SEQ}-token sequence "
                 "per GPU; missing point: does not fit or n/a)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results/scaleout_paper")
    ap.add_argument("--per-gpu-batch", type=int, default=1,
                    help="sequences per GPU (weak scaling), default 1")
    ap.add_argument("--ilp", type=float, default=30.0,
                    help="also solve one host's pipeline with the planner's ILP (contiguous "
                    "stages) under this many seconds, to check the balanced stages; 0: off")
    ap.add_argument("--compute-scale", type=float, default=1.0,
                    help="multiply every layer's compute seconds (a what-if: 0.2 for a GPT "
                    "five times faster than the roofline's f32 one); memory unchanged")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()

    def say(msg):
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    result = run(args.per_gpu_batch, args.ilp, args.compute_scale, say)
    result["setting"] = {
        "per_gpu_batch_seqs": args.per_gpu_batch, "seq_len": SEQ, "vocab": VOCAB,
        "gpus_per_host": GPUS, "hosts": list(HOSTS), "networks_bytes_per_s": NETWORKS,
        "nvlink_bytes_per_s": NVLINK_BW, "nvlink_latency_s": NVLINK_LAT,
        "network_latency_s": NET_LAT, "ilp_check_s": args.ilp,
        "compute_scale": args.compute_scale}
    with open(os.path.join(args.out, "table.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(markdown(result, args.per_gpu_batch))
    png = plot(result, os.path.join(args.out, "scaleout.png"), args.per_gpu_batch)
    say(f"wrote table.md, table.json{', scaleout.png' if png else ' (no matplotlib: no plot)'} "
        f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
