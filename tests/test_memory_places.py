"""Memory places: an accelerator's pinned host memory as a home for optimizer state.

Measured on an H100 host, copies between the GPU and its pinned host memory
run ~50 GB/s each way, between the GPU and the CPU device ~7 GB/s. The
tables here say so; the planner must then stream the optimizer state from
the place (parameters resident, JAX's own host offload) rather than through
the CPU device. JAX-free but for the cost-table tests (a small traced model).
"""

import dataclasses
import functools

import numpy as np
import pytest

from hetpar.core import InfeasibleError, Placement, pinned_pool_reserved
from hetpar.planner import (
    CostTable,
    Device,
    Edge,
    Layer,
    Link,
    Plan,
    _offload,
    evaluate,
    held_bytes,
    memory_fill,
    plan,
    replica_groups,
    simulate,
    violations,
)
from hetpar.planner._evaluate import Arrays

GB = 1e9
PARAM, OPT, ACT = 1 * GB, 2 * GB, 0.5 * GB
RESIDENT = 2 * PARAM + OPT + ACT  # 4.5 GB: each block's memory_bytes
# What a block holds with everything on its GPU: its memory_bytes and, as
# nothing is donated, its new parameters and optimizer state: 7.5 GB.
HELD = RESIDENT + PARAM + OPT
# One batch at a time a block's activations (0.5 GB) are freed in its backward
# as its gradient (1 GB) is made: the two count once, the larger (`Arrays.overlap`).
HELD_ONE = HELD - ACT  # 7 GB
PLACE = "gpu:0:pinned_host"
CPU_BW, PLACE_BW, LAT = 7e9, 50e9, 3e-4


def table(blocks: int = 6, *, gpu_gb: float = 100.0, host_gb: float = 200.0,
          place: bool = True, cpu_compute: bool = True, act: float = ACT) -> CostTable:
    """A chain of equal blocks on a slow CPU and a fast GPU, the GPU's pinned host
    memory beside them (sharing the host's RAM); `act`: each block's activations."""
    resident = 2 * PARAM + OPT + act
    devices = [Device("cpu:0", "cpu", host_gb * GB, 0.0, 270.0, 100.0, price_alone_per_hour=1.4),
               Device("gpu:0", "h100", gpu_gb * GB, 6.9, 700.0, 70.0)]
    links = [Link("cpu:0", "gpu:0", CPU_BW, LAT), Link("gpu:0", "cpu:0", CPU_BW, LAT)]
    if place:
        devices.append(Device(PLACE, "pinned_host", host_gb * GB))
        links += [Link("gpu:0", PLACE, PLACE_BW, LAT), Link(PLACE, "gpu:0", PLACE_BW, LAT)]
    names = [f"b{i}" for i in range(blocks)]
    layers = tuple(
        Layer(n, time_s={"cpu:0": 5.0, "gpu:0": 0.02},
              memory_bytes={"cpu:0": resident, "gpu:0": resident},
              allowed=None if cpu_compute else ("gpu:0",), activation_bytes=act,
              param_bytes=PARAM, opt_state_bytes=OPT, update_s={"cpu:0": 0.3, "gpu:0": 0.008})
        for n in names)
    edges = tuple(Edge(u, v, 1e7, 1e7) for u, v in zip(names, names[1:], strict=False))
    return CostTable(tuple(devices), tuple(links), layers, edges,
                     # analysed: no update waits for another's gradient (no clip)
                     meta={"update_reads": {}})


JAX_OFFLOAD = Placement("gpu:0", PLACE, "gpu:0", params="gpu:0")


# -- the planner ---------------------------------------------------------------


def test_plan_streams_optimizer_state_from_pinned_host_not_the_cpu_device():
    roomy = table()
    # 42 GB held resident on a 28 GB GPU; streamed from the place, a block
    # holds 2.5 GB (its old and new optimizer state away, its gradient only
    # while its backward runs: `quick_gradients`), the state visits for the
    # updates, three at most in flight (2 GB each), and the largest
    # gradient is the working set: five streamed and one resident hold
    # 12.5 + 7 + 6 + 1 = 26.5 GB (four would hold 10 + 14 + 6 + 1).
    p = plan(roomy, memory={"gpu:0": 28 * GB}, activations=False)  # the state search alone
    assert set(p.assignment.values()) == {"gpu:0"}
    assert len(p.offloaded) == 5 and set(p.offloaded.values()) == {JAX_OFFLOAD}
    assert p.predicted.peak_memory_bytes["gpu:0"] == pytest.approx(26.5 * GB)
    assert PLACE not in p.predicted.busy_s
    slow = plan(table(place=False), memory={"gpu:0": 28 * GB}, activations=False)
    assert {pl.state for pl in slow.offloaded.values()} == {"cpu:0"}
    assert p.predicted.step_time_s < slow.predicted.step_time_s
    # The streamed way keeps parameters on the GPU, through the CPU device too.
    assert all(pl.params == "gpu:0" for pl in slow.offloaded.values()
               if pl.update == "gpu:0")


def test_places_never_compute_in_plans_or_baselines():
    t = table(gpu_gb=20)
    for mode, mb in (("sequential", 1), ("pipelined", 2)):
        p = plan(t, mode=mode, microbatches=mb, activations=False)
        assert PLACE not in p.assignment.values()
        assert all(pl.update != PLACE for pl in p.placements.values())
        assert not any(PLACE in name for name in p.baselines if name != "jax_offload")
        for r in p.baselines.values():
            if r.assignment is not None:
                assert all(Placement.parse(v).compute != PLACE for v in r.assignment.values())
    filled = memory_fill(table(gpu_gb=100))  # the place ranks nowhere
    assert set(filled.assignment.values()) == {"gpu:0"}
    text = plan(t).explain(t)
    assert f"{PLACE}: no time" not in text and f"{PLACE} -" not in text
    two = CostTable(
        t.devices + (Device("gpu:1", "h100", 20 * GB), Device("gpu:1:pinned_host",
                                                               "pinned_host", 200 * GB)),
        t.links, t.layers, t.edges)
    assert replica_groups(two) == [("gpu:0", "gpu:1")]
    with pytest.raises(Exception, match="memory place"):
        Placement(PLACE)


def test_streamed_from_a_place_moves_only_the_optimizer_state():
    t = table()
    resident = {n: Placement("gpu:0") for n in t.layer_names}
    base = simulate(t, resident).transfer_s
    one = {**resident, "b2": JAX_OFFLOAD}
    # Optimizer state in before the update, the new state back: 2 x 2 GB at 50 GB/s.
    assert simulate(t, one).transfer_s == pytest.approx(base + 2 * (LAT + OPT / PLACE_BW),
                                                        rel=1e-9)
    via_cpu = {**resident, "b2": Placement("gpu:0", "cpu:0", "gpu:0", params="gpu:0")}
    assert simulate(t, via_cpu).transfer_s == pytest.approx(
        base + 2 * (LAT + OPT / CPU_BW), rel=1e-9)
    # A given placement with the parameters on the host (they default to the
    # state) still brings the weights in and the new parameters back.
    user = {**resident, "b2": Placement("gpu:0", "cpu:0", "gpu:0")}
    assert simulate(t, user).transfer_s == pytest.approx(
        base + 3 * LAT + (PARAM + OPT + (PARAM + OPT)) / CPU_BW, rel=1e-9)
    assert evaluate(t, user).step_time_s > evaluate(t, via_cpu).step_time_s


def test_held_bytes_with_places_and_shared_host_ram():
    t = table(host_gb=12.6)
    arr = Arrays(t)
    resident = {n: Placement("gpu:0") for n in t.layer_names}
    two = {**resident, "b0": JAX_OFFLOAD, "b1": JAX_OFFLOAD}
    held = dict(zip(arr.devices, held_bytes(arr, arr.placed(two)), strict=True))
    assert held[PLACE] == pytest.approx(2 * 2 * OPT)  # old and new optimizer state
    assert held["cpu:0"] == 0
    # Two blocks' old and new optimizer state leave the GPU; both blocks'
    # visit for the updates, once each (the copy in donated to the new
    # state), at most three in flight (`streamed_in_flight`). Updated as
    # soon as it is made, a streamed block's gradient (1 GB) lives only in
    # its backward: what of it the activations (0.5 GB) did not cover leaves
    # the count, and one gradient is the working set.
    quick = PARAM - min(ACT, PARAM)
    assert held["gpu:0"] == pytest.approx(6 * HELD_ONE - 2 * (2 * OPT + quick) + 2 * OPT + PARAM)
    four = {**two, "b2": JAX_OFFLOAD, "b3": JAX_OFFLOAD}
    held = dict(zip(arr.devices, held_bytes(arr, arr.placed(four)), strict=True))
    assert held["gpu:0"] == pytest.approx(6 * HELD_ONE - 4 * (2 * OPT + quick) + 3 * OPT + PARAM)
    assert violations(t, two) == []
    # The place and the CPU device draw on one 12.6 GB RAM: the place's 8 GB
    # as the regions XLA's pinned pool holds to serve them (8 GiB, 8.59 GB).
    host = Placement("gpu:0", "cpu:0", "gpu:0", params="gpu:0")
    fits = {**two, "b2": host}  # 8 GB in the place + 4 GB on the CPU device
    assert violations(t, fits) == []
    assert violations(table(host_gb=12.5), fits) != []  # 8 GB alone would fit
    over = {**fits, "b3": host}
    broken = violations(t, over)
    assert any("host memory exceeded" in b and PLACE in b for b in broken), broken
    bad = {**resident, "b0": Placement("gpu:0", "cpu:0", "cpu:0", params="gpu:0")}
    assert any("needs its parameters there too" in b for b in violations(t, bad))


def test_the_planner_counts_the_pinned_pools_regions_on_the_host():
    """XLA's pinned pool holds its doubling regions of the host's RAM, not
    the arrays alone (run 56: the OS killed a plan that fit as arrays). On a
    30 GB host beside a 20 GB GPU, two layers computing on the CPU device (14
    GB) and four streaming from the place (16 GB of state) fit as arrays,
    but the pool holds 16 GiB (17.2 GB) to serve them: the planner plans
    otherwise, and what it plans fits with the regions counted."""
    t = table(gpu_gb=20, host_gb=30)
    p = plan(t, activations=False)
    assert violations(t, p.placements) == []
    arr = Arrays(t)
    held = held_bytes(arr, arr.placed(p.placements))
    place = arr.dindex[PLACE]
    drawn = held[arr.dindex["cpu:0"]] + pinned_pool_reserved(held[place], arr.cap[place])
    assert drawn <= 30 * GB
    old = {**{f"b{i}": Placement("cpu:0") for i in range(2)},
           **{f"b{i}": Placement("gpu:0", PLACE, "gpu:0", params="gpu:0") for i in range(2, 6)}}
    assert sum(held_bytes(arr, arr.placed(old))[[arr.dindex["cpu:0"], place]]) <= 30 * GB
    assert any("host memory exceeded" in v for v in violations(t, old))


def test_a_gradient_updated_as_soon_as_it_is_made_is_held_only_in_its_backward():
    """Streamed (or fetched), a layer updated on its compute device as its
    own gradient is made holds it only while its backward stage runs (the
    zoo 5.04B plan at 45 GB of an H200, no clip: planned at 39.1 GB with
    every gradient held through the step, measured at 26.0). Under a
    global-norm clip (`update_reads`) every update waits for the whole
    backward: the gradients are held; so with microbatches (accumulated)."""
    t = table()
    clipped = dataclasses.replace(t, meta={"update_reads": dict.fromkeys(t.layer_names, "all")})
    four = {**{n: Placement("gpu:0") for n in t.layer_names},
            **{f"b{i}": JAX_OFFLOAD for i in range(4)}}
    gpu = Arrays(t).dindex["gpu:0"]
    quick = held_bytes(Arrays(t), Arrays(t).placed(four))[gpu]
    held = held_bytes(Arrays(clipped), Arrays(clipped).placed(four))[gpu]
    # four gradients' 0.5 GB beyond their activations leave; one gradient
    # (1 GB) is the working set of the backward that makes it
    assert held - quick == pytest.approx(4 * (PARAM - min(ACT, PARAM)) - PARAM)
    assert held_bytes(Arrays(t), Arrays(t).placed(four), 2)[gpu] == pytest.approx(
        held_bytes(Arrays(clipped), Arrays(clipped).placed(four), 2)[gpu])
    # The planner streams fewer layers for the step without a clip.
    # (26.5 GB: five streamed and one resident, 12.5 + 7 + 6 + 1; clipped,
    # five would hold 15 + 7 + 6 = 28, so all six stream: 18 + 6 = 24.)
    p = plan(t, memory={"gpu:0": 26.5 * GB}, activations=False)
    c = plan(clipped, memory={"gpu:0": 26.5 * GB}, activations=False)
    assert (len(p.offloaded), len(c.offloaded)) == (5, 6)
    assert violations(with_cap(t, 26.5), p.placements) == []


def test_one_pinned_pool_serves_a_process_s_places():
    """XLA's GPU client keeps one pinned pool for its GPUs: their places draw
    its regions for what they hold together (33 + 2 GB: 64 GiB, where apart
    they would be 32 + 2 GiB), up to its limit as read on this machine
    (`meta["pinned_pool_bytes"]`, not the place's capacity); a CPU device's
    own place has no such pool."""
    from hetpar.core import pinned_pool_reserved
    from hetpar.planner._arrays import ram_bytes

    GiB = float(1 << 30)
    devices = (Device("cpu:0", "cpu", 120 * GB, 0.0, 270.0, 100.0),
               Device("gpu:0", "h100", 80 * GB, 6.9, 700.0, 70.0),
               Device("gpu:1", "h100", 80 * GB, 6.9, 700.0, 70.0),
               Device("gpu:0:pinned_host", "pinned_host", 50 * GB),
               Device("gpu:1:pinned_host", "pinned_host", 50 * GB),
               Device("cpu:0:pinned_host", "pinned_host", 120 * GB))
    layer = Layer("b0", time_s={"gpu:0": 0.02}, memory_bytes={"gpu:0": RESIDENT})
    t = CostTable(devices, (), (layer,), ())
    arr = Arrays(t)
    held = np.zeros(len(arr.devices))
    held[arr.dindex["gpu:0:pinned_host"]] = 33 * GB
    held[arr.dindex["gpu:1:pinned_host"]] = 2 * GB
    cpu = arr.dindex["cpu:0"]
    assert ram_bytes(arr, held)[cpu] == 50 * GB  # the limit: the places' capacity here
    limited = dataclasses.replace(t, meta={"pinned_pool_bytes": dict.fromkeys(
        ["gpu:0:pinned_host", "gpu:1:pinned_host"], 93 * GiB)})
    assert ram_bytes(Arrays(limited), held)[cpu] == 64 * GiB - 2 * 2**20  # 15 regions
    assert ram_bytes(Arrays(limited), held)[cpu] > (
        pinned_pool_reserved(33 * GB, 93 * GiB) + pinned_pool_reserved(2 * GB, 93 * GiB))
    held[arr.dindex["cpu:0:pinned_host"]] = 7 * GB  # the CPU's own: its bytes
    assert ram_bytes(Arrays(limited), held)[cpu] == 64 * GiB - 2 * 2**20 + 7 * GB
    # The regions the pool held when the table was read stay its own (a
    # replan after a step): what it draws never falls under them.
    kept = dataclasses.replace(limited, meta={**limited.meta, "pinned_pool_regions": dict.fromkeys(
        ["gpu:0:pinned_host", "gpu:1:pinned_host"], 90 * GiB)})
    assert ram_bytes(Arrays(kept), held)[cpu] == 90 * GiB + 7 * GB


def test_each_process_s_places_draw_on_its_own_host_and_pool():
    """Two processes, each a CPU device, a GPU and its place: each place
    draws on its own process's host RAM, in its own pool (40 GB each: 64
    GiB of regions each, not one pool's 64 GiB for 80 GB on the first host)."""
    from hetpar.planner._arrays import ram_bytes

    GiB = float(1 << 30)
    devices = tuple(d for p in ("p0", "p1") for d in (
        Device(f"{p}/cpu:0", "cpu", 120 * GB, 0.0, 270.0, 100.0),
        Device(f"{p}/gpu:0", "h100", 80 * GB, 6.9, 700.0, 70.0),
        Device(f"{p}/gpu:0:pinned_host", "pinned_host", 93 * GiB)))
    layer = Layer("b0", time_s={"p0/gpu:0": 0.02}, memory_bytes={"p0/gpu:0": RESIDENT})
    arr = Arrays(CostTable(devices, (), (layer,), ()))
    assert arr.ram[arr.dindex["p1/gpu:0:pinned_host"]] == arr.dindex["p1/cpu:0"]
    held = np.zeros(len(arr.devices))
    held[arr.dindex["p0/gpu:0:pinned_host"]] = held[arr.dindex["p1/gpu:0:pinned_host"]] = 40 * GB
    ram = ram_bytes(arr, held)
    assert ram[arr.dindex["p0/cpu:0"]] == ram[arr.dindex["p1/cpu:0"]] == 64 * GiB - 2 * 2**20


def test_a_table_that_does_not_say_whether_updates_wait_is_planned_as_if_they_did():
    """`hetpar costs` writes `update_reads` (empty without a clip); a table
    without it (written by hand, or before) holds every gradient through
    the step, the safe side."""
    t = table()
    silent = dataclasses.replace(t, meta={})
    clipped = dataclasses.replace(t, meta={"update_reads": dict.fromkeys(t.layer_names, "all")})
    four = {**{n: Placement("gpu:0") for n in t.layer_names},
            **{f"b{i}": JAX_OFFLOAD for i in range(4)}}
    gpu = Arrays(t).dindex["gpu:0"]
    held = {name: held_bytes(Arrays(x), Arrays(x).placed(four))[gpu]
            for name, x in (("quick", t), ("silent", silent), ("clipped", clipped))}
    assert held["silent"] == held["clipped"] > held["quick"]


def test_the_offload_ilp_counts_the_pinned_pools_regions_as_ram_bytes():
    """For every choice of which blocks stream from the place, the offload
    ILP with the host capped at what `ram_bytes` says the choice draws (the
    pool's regions with what the CPU device holds) is feasible, and 0.1%
    under it infeasible."""
    base = table(blocks=3, cpu_compute=False, host_gb=200)
    base = dataclasses.replace(base, meta={**base.meta, "pinned_pool_bytes": {PLACE: 40 * GB}})
    _assert_ilp_host_rows(base)
    # Under 2 GiB too (the regions' sums from 64 MiB are exact): blocks of
    # a tenth the size, 0.4-1.2 GB in the place.
    small = dataclasses.replace(base, layers=tuple(dataclasses.replace(
        la, param_bytes=la.param_bytes / 10, opt_state_bytes=la.opt_state_bytes / 10,
        activation_bytes=la.activation_bytes / 10,
        memory_bytes={d: b / 10 for d, b in la.memory_bytes.items()}) for la in base.layers))
    _assert_ilp_host_rows(small)


def _assert_ilp_host_rows(base):
    import itertools

    from hetpar.planner import _ilp
    from hetpar.planner._arrays import ram_bytes
    from hetpar.planner._offload import _model
    from hetpar.planner._solve import with_memory

    arr = Arrays(base)
    host = arr.dindex["cpu:0"]
    on_cpu = Placement("gpu:0", "cpu:0", "cpu:0")
    for combo in itertools.product(("streamed", "host", "resident"), repeat=3):
        ways = {"streamed": JAX_OFFLOAD, "host": on_cpu, "resident": Placement("gpu:0")}
        placed = {n: ways[w] for n, w in zip(base.layer_names, combo)}
        need = float(ram_bytes(arr, held_bytes(arr, arr.placed(placed)))[host])
        if need <= 0 or "streamed" not in combo:
            continue
        for cap, fits in ((need, True), (need * 0.999, False)):
            capped = Arrays(with_memory(base, {"cpu:0": cap}))
            m, y, _ = _model(capped, dict.fromkeys(base.layer_names, "gpu:0"), 1,
                             slack=[False] * len(arr.devices))
            for o, v in y.items():
                way = combo[o.layer]
                m.prob.addConstraint(v == int(o.way == way and (
                    way == "host" or arr.devices[o.state] == PLACE)))
            status, _, _ = _ilp._run_solver(m.prob, "cbc", 10.0, 0.0)
            assert (status in ("optimal", "feasible")) == fits, (combo, cap / GB, status)


def test_jax_offload_baseline():
    t = table(gpu_gb=28)  # all six streamed from the place hold 28 GB
    placements, why = _offload.jax_offload(t)
    assert why is None and set(placements.values()) == {JAX_OFFLOAD}
    p = plan(t, activations=False)
    base = p.baselines["jax_offload"]
    assert base.feasible
    assert base.predicted.step_time_s == pytest.approx(evaluate(t, placements).step_time_s)
    assert "jax_offload" in p.summary(t)
    placements, why = _offload.jax_offload(table(place=False))
    assert placements is None and "pinned_host" in why
    assert "jax_offload" in plan(table(gpu_gb=20, place=False)).baselines
    assert not plan(table(gpu_gb=20, place=False)).baselines["jax_offload"].feasible


def test_plan_json_round_trip_with_params_and_a_place(tmp_path):
    t = table(gpu_gb=28)  # every block streamed from the place (28 GB held)
    p = plan(t, activations=False)
    obj = p.to_json()["assignment"][next(iter(p.offloaded))]
    assert obj == {"compute": "gpu:0", "params": "gpu:0", "state": PLACE, "update": "gpu:0"}
    p.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again == p and again.placements == p.placements
    again.check(t)
    assert evaluate(t, again.placements).step_time_s == pytest.approx(p.predicted.step_time_s)


def test_no_streaming_from_the_cpu_device_beside_a_memory_place():
    """The same RAM, but the runtime reaches the CPU device by device_put
    (~6 GB/s into a GPU) and the place by DMA (~50 GB/s): even where the
    table's links call them equal, state streams from the place."""
    from hetpar.planner import Arrays
    from hetpar.planner._offload import options

    t = table()
    even = dataclasses.replace(t, links=tuple(
        dataclasses.replace(lk, bandwidth_bytes_per_s=PLACE_BW) for lk in t.links))
    for tab in (t, even):
        streamed = {tab.devices[o.state].name for o in options(Arrays(tab))
                    if o.way == "streamed"}
        assert streamed == {PLACE}, streamed
    # Without a place, the CPU device is the home.
    streamed = {o.state for o in options(Arrays(table(place=False))) if o.way == "streamed"}
    assert streamed == {0}


def test_link_profile_keeps_its_duplex_bandwidth():
    from hetpar.cost_models import LinkProfile

    lk = LinkProfile("gpu:0", "cpu:0", "pinned_host_duplex", 1e-4, 5e10, "measured",
                     duplex_bandwidth_bytes_per_s=4e10)
    assert LinkProfile.from_json(lk.to_json()) == lk
    assert "duplex_bandwidth_bytes_per_s" not in LinkProfile.from_json(
        {**lk.to_json(), "duplex_bandwidth_bytes_per_s": None}).to_json()


def test_planner_recomputes_activations_when_that_keeps_state_on_the_gpu():
    """Blocks whose activations (2.5 GB) outweigh their gradient (1 GB) hold
    6 x 8.5 = 51 GB resident (the gradient made as the activations go);
    recomputed, 6 x 7 = 42 GB, plus one block's 2.5 GB of activations back
    while its backward runs. Under a 45 GB GPU the plan that keeps
    activations must stream some blocks' state; recomputing them all keeps
    everything on the GPU for a second forward each (20 ms x 1/3), far less
    than the state's copies."""
    t = table(act=2.5 * GB)
    keep = plan(t, memory={"gpu:0": 45 * GB}, activations=False)
    assert keep.offloaded  # some state goes to the place
    p = plan(t, memory={"gpu:0": 45 * GB})
    acts = {pl.activations for pl in p.placements.values()}
    assert acts == {"remat"}, p.placements
    assert all(pl.state == "gpu:0" for pl in p.placements.values())
    assert p.predicted.step_time_s < keep.predicted.step_time_s
    assert p.predicted.peak_memory_bytes["gpu:0"] <= 45 * GB
    # The table itself, told the layers recompute, agrees: it fits, same step.
    from hetpar.planner import evaluate
    from hetpar.planner._solve import with_memory
    capped = with_memory(t, {"gpu:0": 45 * GB})
    assert not violations(capped, p.placements)
    assert violations(capped, {n: pl.compute for n, pl in p.placements.items()})
    assert evaluate(capped, p.placements).step_time_s == pytest.approx(p.predicted.step_time_s)
    # Its summary says so, with each layer's second forward in its time.
    text = p.summary(capped)
    assert "6 of 6 layers recompute their forward" in text and " remat " in text
    assert "26.7 ms" in text  # 20 ms x (1 + 1/3)
    # Its plan.json says so, and loads back.
    from hetpar.planner import Plan
    again = Plan.from_json(p.to_json())
    assert {pl.activations for pl in again.placements.values()} == {"remat"}
    # Where memory is not tight, nothing is recomputed.
    roomy = plan(t)
    assert {pl.activations for pl in roomy.placements.values()} == {"keep"}


def test_only_as_many_layers_recompute_as_memory_needs():
    """2 GB of activations a block (1 GB over its gradient): 6 x 8 = 48 GB
    resident. Under 47 GB, three blocks recomputed fit (45 GB, and one
    block's activations back while its backward runs), and the other three
    keep their activations (each recomputation costs 20 ms / 3). No pinned
    host memory: the state could only go to the CPU device, whose updates
    cost more."""
    t = table(place=False, act=2 * GB)
    p = plan(t, memory={"gpu:0": 47 * GB})
    acts = [pl.activations for pl in p.placements.values()]
    assert acts.count("remat") == 3 and acts.count("keep") == 3, p.placements
    assert all(pl.state == "gpu:0" for pl in p.placements.values())
    assert p.predicted.step_time_s == pytest.approx(6 * 0.02 + 3 * 0.02 / 3)
    assert p.predicted.peak_memory_bytes["gpu:0"] <= 47 * GB
    everything = plan(t, memory={"gpu:0": 44 * GB})  # all six must recompute
    assert [pl.activations for pl in everything.placements.values()] == ["remat"] * 6
    assert p.predicted.step_time_s < everything.predicted.step_time_s


def test_layers_with_parameters_elsewhere_recompute_too():
    """A layer whose parameters stay on the CPU (state and update there) may
    recompute its activations: the split pass reads its parameters again
    for the backward (test_user_steps checks it), so its activations are
    freed as the plan counts. Until that was built such layers kept theirs,
    and GPT-2's batch-16 plans at 0.25x and 0.1x of the GPU's memory moved
    to the CPU, 4.8x and 2.5x slower (experiments/results/predictions_memory_bound)."""
    from hetpar.planner._solve import with_memory

    t = table(place=False, act=1.5 * GB)
    p = plan(t, memory={"gpu:0": 39 * GB})
    places = list(p.placements.values())
    assert any(pl.activations == "remat" and pl.params != pl.compute for pl in places)
    recomputed = sum(pl.activations == "remat" for pl in places)
    assert p.solver["recomputed"] == f"{recomputed} of 6 layers"
    assert not violations(with_memory(t, {"gpu:0": 39 * GB}), p.placements)


def test_recompute_costs_only_the_forward_the_backward_reads():
    """A layer whose backward reads half its forward (recompute_fraction 0.5,
    as traced) recomputes 20 ms x 1/3 x 0.5, not a whole forward."""
    import dataclasses

    t = table(act=2.5 * GB)
    half = dataclasses.replace(t, layers=tuple(dataclasses.replace(la, recompute_fraction=0.5)
                                                for la in t.layers))
    whole = plan(t, memory={"gpu:0": 45 * GB})
    p = plan(half, memory={"gpu:0": 45 * GB})
    assert {pl.activations for pl in p.placements.values()} == {"remat"}
    assert p.predicted.step_time_s < whole.predicted.step_time_s
    from hetpar.planner import evaluate
    from hetpar.planner._solve import with_memory
    capped = with_memory(half, {"gpu:0": 45 * GB})
    assert evaluate(capped, p.placements).step_time_s == pytest.approx(p.predicted.step_time_s)
    assert "23.3 ms" in p.summary(capped)  # 20 ms x (1 + 1/3 x 0.5)


def test_state_beyond_host_ram_names_the_smallest_footprint():
    with pytest.raises(InfeasibleError) as e:
        plan(table(gpu_gb=20, host_gb=5, cpu_compute=False))
    msg = str(e.value)
    # 42 GB held on a 20 GB GPU (7 GB a block). Streamed from the place, a
    # block holds 2.5 GB and its host 4 GB; fetched (its parameters there
    # too), 0.5 GB and 6 GB (its gradient lives in its backward only:
    # `quick_gradients`); the state (and fetched, the weights) in flight,
    # at most three (3 GB each with any fetched), and one gradient the
    # working set (1 GB). Smallest: three streamed and three fetched, the
    # GPU 7.5 + 1.5 + 9 + 1 = 19 GB, the host 12 + 18 = 30 GB of its 5 GB
    # (four streamed and two fetched need 21 GB of GPU). The pool's regions
    # are at most what it serves here: its limit is the place's 5 GB.
    assert "does not fit host memory" in msg and "30 GB" in msg and "holds 5 GB" in msg


# -- the cost table --------------------------------------------------------------


@functools.cache
def _graph():
    from hetpar import zoo

    return zoo.trace_model("lm_embed", small=True)[1]


@pytest.fixture
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HETPAR_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.usefixtures("_cache")
def test_cost_table_adds_the_pinned_host_place_of_each_accelerator():
    from hetpar import cost_models

    t = cost_models.cost_table(_graph(), ["cpu:0", "h100"])
    place = t.device("h100:0:pinned_host")
    assert place.kind == "pinned_host" and place.compute_group is None
    assert place.memory_bytes == t.device("cpu:0").memory_bytes
    assert place.price_per_hour == 0 and place.watts_busy == 0
    h100 = cost_models.spec("h100").host_link
    # Streamed state moves both ways at once: the place's links run at the
    # sheet's duplex figure (46.5 GB/s each way measured on an H100 host,
    # against 53.6 one way and 63 on paper), the CPU device's at the one-way one.
    assert h100.duplex_bandwidth_bytes_per_s < h100.bandwidth_bytes_per_s
    for a, b in (("h100:0", place.name), (place.name, "h100:0")):
        assert t.link(a, b).bandwidth_bytes_per_s == h100.duplex_bandwidth_bytes_per_s
    assert t.link("h100:0", "cpu:0").bandwidth_bytes_per_s == h100.bandwidth_bytes_per_s
    assert t.link("cpu:0", place.name) is None and t.link(place.name, "cpu:0") is None
    for layer in t.layers:
        assert place.name not in layer.time_s and place.name not in layer.memory_bytes
        assert place.name not in (layer.update_s or {})
    assert CostTable.from_json(t.to_json()).devices == t.devices
    assert [d.name for d in cost_models.cost_table(_graph(), ["cpu:0"]).devices] == ["cpu:0"]
    assert [d.name for d in cost_models.cost_table(_graph(), ["h100"]).devices] == ["h100:0"]
    off = cost_models.cost_table(_graph(), ["cpu:0", "h100"], memory_places=False)
    assert off.device_names == ("cpu:0", "h100:0")
    # A plan's own devices rebuild the same names, CPU or not.
    again = cost_models.cost_table(_graph(), ["h100", "h100:0:pinned_host"])
    assert again.device_names == ("h100:0", "h100:0:pinned_host")


@pytest.mark.usefixtures("_cache")
def test_a_measured_staged_path_prices_the_place():
    from hetpar import cost_models
    from hetpar.cost_models import LinkProfile, ProfileSet, spec

    devices = {"gpu:0": spec("h100").replace(name="gpu:0", origin="measured"),
               "cpu:0": spec("cpu").replace(name="cpu:0", origin="measured")}
    links = (LinkProfile("cpu:0", "gpu:0", "device_put", 1e-4, 7e9, "test"),
             LinkProfile("gpu:0", "cpu:0", "device_put", 1e-4, 7e9, "test"),
             LinkProfile("cpu:0", "gpu:0", "pinned_host_staged", 1e-5, 50e9, "test"),
             LinkProfile("gpu:0", "cpu:0", "pinned_host_staged", 1e-5, 45e9, "test"))
    t = cost_models.cost_table(_graph(), ["cpu:0", "gpu:0"],
                               profiles=ProfileSet(devices, links))
    assert t.link("gpu:0:pinned_host", "gpu:0").bandwidth_bytes_per_s == 50e9
    assert t.link("gpu:0", "gpu:0:pinned_host").bandwidth_bytes_per_s == 45e9
    assert t.link("cpu:0", "gpu:0").bandwidth_bytes_per_s == 7e9  # the CPU device's path


@pytest.mark.usefixtures("_cache")
def test_measured_samples_price_copies_by_the_runtimes_path_as_a_curve():
    """A profile's samples become the table's link curves, on the path the
    transfer engine takes (CPU device -> GPU by device_put even where a
    pinned-host path measured faster); a place's link takes its staged
    path's samples; a link measured at too few sizes keeps its line."""
    from hetpar import cost_models
    from hetpar.cost_models import LinkProfile, ProfileSet, spec

    mib = float(1 << 20)

    def samples(*rates):  # (bytes, seconds) at 4 KB, 16, 32 and 64 MiB
        sizes = (4096.0, 16 * mib, 32 * mib, 64 * mib)
        return tuple((b, 1e-4 + b / r) for b, r in zip(sizes, (1e12, *rates)))

    devices = {"gpu:0": spec("h100").replace(name="gpu:0", origin="measured"),
               "cpu:0": spec("cpu").replace(name="cpu:0", origin="measured")}
    links = (LinkProfile("cpu:0", "gpu:0", "device_put", 1e-4, 2e9, "test",
                         samples(3.5e9, 1.2e9, 1.2e9)),
             LinkProfile("cpu:0", "gpu:0", "pinned_host", 1e-4, 20e9, "test",
                         samples(20e9, 20e9, 20e9)),
             LinkProfile("gpu:0", "cpu:0", "pinned_host", 1e-4, 40e9, "test",
                         samples(40e9, 40e9, 40e9)[:2]),
             LinkProfile("cpu:0", "gpu:0", "pinned_host_staged", 1e-4, 50e9, "test",
                         samples(50e9, 25e9, 50e9)),
             LinkProfile("gpu:0", "cpu:0", "pinned_host_staged", 1e-5, 45e9, "test"))
    t = cost_models.cost_table(_graph(), ["cpu:0", "gpu:0"],
                               profiles=ProfileSet(devices, links))
    up = t.link("cpu:0", "gpu:0")
    # device_put's path, not the faster pinned one's: its curve over its
    # latency, and a bandwidth read off it at 1 MiB (the small model's copies
    # are smaller: their rate off the curve would be the samples' noise)
    assert up.latency_s == 1e-4
    assert up.bandwidth_bytes_per_s == pytest.approx(mib / up.copy_s(mib))
    assert up.copy_s(16 * mib) == pytest.approx(16 * mib / 3.5e9, rel=1e-3)
    assert up.copy_s(48 * mib) == pytest.approx(48 * mib / 1.2e9, rel=0.05)  # the fall
    assert up.copy_s(48 * mib) > 1.5 * 48 * mib / up.bandwidth_bytes_per_s  # not the line
    assert t.link("gpu:0", "cpu:0").curve == ()  # two samples: its fitted line
    place_in = t.link("gpu:0:pinned_host", "gpu:0")
    assert place_in.copy_s(32 * mib) == pytest.approx(32 * mib / 25e9, rel=1e-3)
    assert t.link("gpu:0", "gpu:0:pinned_host").curve == ()  # no samples


def test_a_stages_working_set_counts_against_the_cap():
    """A head whose stage holds 3 GB while it runs (its logits' softmax and
    gradient, `workspace_bytes`) beside six blocks: the largest working set
    on a device is held on top of what its layers hold. Under a cap that the
    blocks and the head's resident bytes fit but not its working set too,
    the plan streams state out to make room; the table without it says the
    GPU fits as is, and the replay and `violations` agree with the planner."""
    from hetpar.planner._evaluate import held_bytes

    t = table(place=True)
    head = dataclasses.replace(t.layers[-1], name="head", workspace_bytes=3 * GB,
                               param_bytes=0.0, opt_state_bytes=0.0, update_s=None,
                               memory_bytes={"cpu:0": ACT, "gpu:0": ACT})
    with_head = dataclasses.replace(t, layers=t.layers + (head,),
                                    edges=t.edges + (Edge("b5", "head", 1e7, 1e7),))
    all_gpu = {n.name: "gpu:0" for n in with_head.layers}
    arr = Arrays(with_head)
    held = held_bytes(arr, arr.placed(all_gpu))
    assert held[arr.dindex["gpu:0"]] == pytest.approx(6 * HELD_ONE + ACT + 3 * GB)
    cap = 6 * HELD_ONE + ACT + 1 * GB  # room for everything it holds, not the head's working set
    from hetpar.planner._solve import with_memory
    capped = with_memory(with_head, {"gpu:0": cap})
    assert any("gpu:0 memory exceeded" in v for v in violations(capped, all_gpu))
    without = dataclasses.replace(with_head, layers=tuple(
        dataclasses.replace(la, workspace_bytes=None) for la in with_head.layers))
    assert not violations(with_memory(without, {"gpu:0": cap}), all_gpu)
    p = plan(with_head, memory={"gpu:0": cap}, activations=False)
    assert p.offloaded  # state streamed out to make room for the head's working set
    assert not violations(capped, p.placements)
    assert p.predicted.peak_memory_bytes["gpu:0"] <= cap


def test_a_pipelined_plan_offloads_what_its_microbatches_need():
    """Pipelined, a block's activations and gradient both count (7.5 GB a
    block, 45 GB in all): under a 42.2 GB GPU the offload search still runs
    (it found the one-batch figure, 42 GB, under the cap and tried nothing)
    and its plan fits by the pipelined figures."""
    from hetpar.planner._solve import with_memory

    t = table()
    p = plan(t, memory={"gpu:0": 42.2 * GB}, mode="pipelined", microbatches=2,
             activations=False)
    assert p.offloaded
    assert not violations(with_memory(t, {"gpu:0": 42.2 * GB}), p.placements, microbatches=2)
    assert p.predicted.peak_memory_bytes["gpu:0"] <= 42.2 * GB


def test_place_links_take_the_bandwidth_measured_with_every_gpu_streaming_at_once():
    # Two H200s streaming state from their pinned host memory at once copied
    # 31 GB/s each way, where one alone one way copied 52 (fit_h200x2, run
    # 35): the calibration prices every place link at what was measured over
    # all of them at once, and a streaming plan's step grows to match.
    from cost_models._calibrate_table import _with_place_links

    t = table()
    two = CostTable(
        t.devices + (Device("gpu:1", "h100", 100 * GB),
                     Device("gpu:1:pinned_host", "pinned_host", 200 * GB)),
        t.links + (Link("gpu:1", "gpu:1:pinned_host", PLACE_BW, LAT),
                   Link("gpu:1:pinned_host", "gpu:1", PLACE_BW, LAT),
                   Link("gpu:1", "gpu:0", 100e9, LAT)), t.layers, t.edges)
    asked = []

    def measured(names, devs):
        asked.append((names, devs))
        return {"bandwidth_bytes_per_s": 31e9}  # as a profile file before curves reads

    present = {"gpu:0": "jax gpu 0", "gpu:1": "jax gpu 1", "cpu:0": "jax cpu"}
    timed = _with_place_links(two, present, measured)
    assert asked == [(["gpu:0", "gpu:1"], ["jax gpu 0", "jax gpu 1"])]  # one timing, both at once
    assert timed.meta["place_links"] == {"gpu:0+gpu:1": {"bandwidth_bytes_per_s": 31e9,
                                                         "at_once": 2}}
    by_pair = {(k.src, k.dst): k for k in timed.links}
    for g in ("gpu:0", "gpu:1"):
        for pair in ((g, f"{g}:pinned_host"), (f"{g}:pinned_host", g)):
            assert by_pair[pair].bandwidth_bytes_per_s == 31e9
            assert by_pair[pair].latency_s == LAT
    # Links to the CPU device and between the GPUs are not the places'.
    assert by_pair["gpu:0", "cpu:0"].bandwidth_bytes_per_s == CPU_BW
    assert by_pair["gpu:1", "gpu:0"].bandwidth_bytes_per_s == 100e9
    streamed = {n: JAX_OFFLOAD for n in t.layer_names}
    assert evaluate(timed, streamed).step_time_s > evaluate(two, streamed).step_time_s
    # No place among the present devices, or nothing measured: the table as it was.
    assert _with_place_links(two, {"cpu:0": "jax cpu"}, measured) is two
    assert _with_place_links(two, present, lambda names, devs: None) is two

    # Measured as `place_link_figures` measures them now: a call's latency and
    # what each array of a batch adds by its size, which the links take and
    # the table's meta keeps.
    curve = [[1e6, 1e-4], [64e6, 1.5e-3]]
    batched = _with_place_links(two, present, lambda names, devs: {
        "bandwidth_bytes_per_s": 31e9, "latency_s": 2e-5, "curve": curve})
    assert batched.meta["place_links"]["gpu:0+gpu:1"] == {
        "bandwidth_bytes_per_s": 31e9, "at_once": 2, "latency_s": 2e-5, "curve": curve}
    k = batched.link("gpu:1:pinned_host", "gpu:1")
    assert k.latency_s == 2e-5 and k.curve == ((1e6, 1e-4), (64e6, 1.5e-3))
    assert batched.link("gpu:0", "cpu:0").curve == ()


def test_place_link_figures_time_every_device_at_once():
    # A real timing (the CPU devices here have pinned host memory too); on
    # GPUs, tests/test_gpu.py.
    import jax

    from hetpar.runtime import place_link_figures

    cpus = jax.devices("cpu")
    each_way = place_link_figures(cpus[:2], nbytes=1 << 20)
    assert each_way is not None and each_way["bandwidth_bytes_per_s"] > 1e6
    assert each_way["latency_s"] > 0
    # Each array of a batch, by its size (16 and 256 kB, 32 and four a
    # call; the whole 1 MiB alone).
    sizes, secs = zip(*each_way["curve"])
    assert sizes == (16 << 10, 256 << 10, 1 << 20) and secs[-1] > 0


@pytest.mark.slow  # one solve of the 35-layer, five-place ILP: ~35 s
def test_the_two_h200_table_streams_on_both_gpus_as_it_measured(monkeypatch):
    # Run 32's calibrated table (2x H200, the 6.74B Llama-style step), capped
    # at the 39.6 GB a split plan may use at 45 GB a GPU, as run 34 replanned
    # it: the layers split over both GPUs, most state streamed from each
    # one's pinned host memory. Priced at the place links measured with both
    # GPUs copying both ways at once (31 GB/s, run 35), the step predicted is
    # within 15% of the 1375 ms it ran (1061 ms predicted at the spec
    # sheet's 38 GB/s), and the peak within 10% of the 39.0 GB measured.
    import collections
    import pathlib

    from cost_models._calibrate_table import _with_place_links

    path = (pathlib.Path(__file__).parent.parent / "experiments/results/fit_h200x2"
            / "run32_table_llama7b_default.json")
    table = _with_place_links(CostTable.load(path), {"gpu:0": 0, "gpu:1": 1},
                              lambda names, devs: {"bandwidth_bytes_per_s": 31e9})
    # That run's runtime held each streamed state old and new (its copies in
    # were not donated yet) and fetched no weights: planned and counted as
    # it ran (the fetched options also make the ILP slower to close, and its
    # 10 s limit then leaves a worse plan on a loaded machine).
    from hetpar.planner import _arrays, _evaluate
    for module in (_arrays, _offload, _evaluate):
        monkeypatch.setattr(module, "streamed_in_flight", lambda n: min(2 * int(n), 5))
    monkeypatch.setattr(_offload, "STREAMED_IN_FLIGHT", 5)
    real = _offload.options
    monkeypatch.setattr(_offload, "options", lambda *a, **k: [
        o for o in real(*a, **k) if o.way != "fetched"])
    p = plan(table, memory={"gpu:0": 39.6e9, "gpu:1": 39.6e9}, donate=True)
    states = collections.Counter(pl.state for pl in p.placements.values())
    assert p.sharding is None and set(p.assignment.values()) == {"gpu:0", "gpu:1"}
    assert states["gpu:0:pinned_host"] >= 10 and states["gpu:1:pinned_host"] >= 10
    assert p.predicted.step_time_s == pytest.approx(1.375, rel=0.15)
    assert max(p.predicted.peak_memory_bytes[g] for g in ("gpu:0", "gpu:1")) \
        == pytest.approx(39.0e9, rel=0.10)


# -- fetched: parameters in the place too ------------------------------------------

FETCHED = Placement("gpu:0", PLACE, "gpu:0", params=PLACE)


def test_weights_fetched_from_the_place_when_even_streaming_does_not_fit(monkeypatch):
    """A GPU that cannot hold every block's weights and gradient beside the
    streamed state computes there anyway with the weights fetched from the
    place for each read (the forward; the backward with its update), never
    kept: 6 blocks streamed hold 22 GB, fetched 13 GB. Without the way, the
    same cap puts blocks' updates or compute on the CPU."""
    t = table(cpu_compute=True)
    p = plan(t, memory={"gpu:0": 20 * GB}, activations=False)
    assert set(p.assignment.values()) == {"gpu:0"}
    fetched = [n for n, pl in p.offloaded.items() if pl == FETCHED]
    assert len(fetched) >= 3, p.offloaded
    assert p.predicted.peak_memory_bytes["gpu:0"] <= 20 * GB
    assert violations(with_cap(t, 20), p.placements) == []
    # held_bytes: a fetched block holds its activations alone (0.5 GB: its
    # gradient lives in its backward only, `quick_gradients`); in flight the
    # largest state and weights, three at most (3 GB each); one gradient
    # the working set.
    arr = Arrays(t)
    every = {n: FETCHED for n in t.layer_names}
    held = dict(zip(arr.devices, held_bytes(arr, arr.placed(every)), strict=True))
    quick = PARAM - min(ACT, PARAM)
    assert held["gpu:0"] == pytest.approx(
        6 * (HELD_ONE - 2 * (OPT + PARAM) - quick) + 3 * (OPT + PARAM) + PARAM)
    assert held[PLACE] == pytest.approx(6 * 2 * (OPT + PARAM))
    # The replay moves the weights in twice (forward; backward with the
    # update), the state in once, and the new weights and state back.
    resident = {n: Placement("gpu:0") for n in t.layer_names}
    base = simulate(t, resident).transfer_s
    one = {**resident, "b2": FETCHED}
    assert simulate(t, one).transfer_s == pytest.approx(
        base + 4 * LAT + (3 * PARAM + 2 * OPT) / PLACE_BW, rel=1e-9)
    # Its one-line description and the plan's summary say the weights travel too.
    assert "with their parameters" in _offload.describe(arr, every, 1.0)
    assert "fetching their weights from their state's home" in p.summary(with_cap(t, 20))
    assert "fetched: weights in" in p.explain(with_cap(t, 20))
    # Without the way, the same cap updates blocks on the CPU (0.3 s each)
    # or computes them there (5 s).
    real, every_way = _offload.options, _offload.variants
    monkeypatch.setattr(_offload, "options", lambda *a, **k: [
        o for o in real(*a, **k) if o.way != "fetched"])
    monkeypatch.setattr(_offload, "variants", lambda *a, **k: [
        v for v in every_way(*a, **k) if v[0] != "all fetched"])
    without = plan(t, memory={"gpu:0": 20 * GB}, activations=False)
    assert "cpu:0" in {*without.assignment.values(), *without.update_assignment.values()}
    assert without.predicted.step_time_s > 2 * p.predicted.step_time_s


def with_cap(t: CostTable, gpu_gb: float) -> CostTable:
    from hetpar.planner._solve import with_memory
    return with_memory(t, {"gpu:0": gpu_gb * GB})


def test_offload_ilp_memory_rows_are_held_bytes_for_fetched_weights():
    """The ILP's rows agree with `held_bytes` for every choice of which
    blocks are fetched from the place (weights in flight, not held)."""
    from .test_offload_planner import _assert_ilp_rows_are_held_bytes

    base = table(blocks=3, cpu_compute=False)
    base = dataclasses.replace(base, layers=tuple(  # unequal blocks
        dataclasses.replace(layer, param_bytes=(k + 1) * 0.5 * GB, opt_state_bytes=(k + 1) * GB,
                            memory_bytes={d: 4 * (k + 1) * 0.5 * GB + ACT
                                          for d in layer.memory_bytes})
        for k, layer in enumerate(base.layers)))
    _assert_ilp_rows_are_held_bytes(base, base, "fetched", FETCHED, Placement("gpu:0"))


def test_weights_in_flight_count_per_streaming_stage():
    """In flight on the GPU: a streaming stage's state and weights, per
    stage, not per layer: with two microbatches a fetched layer's weights
    come in for each one's forward and backward (two in flight where one
    batch has one). And a layer whose parameters alone live in the place
    (its state on the GPU) has its weights in flight too."""
    t = table()
    arr = Arrays(t)
    gpu = arr.dindex["gpu:0"]
    resident = {n: Placement("gpu:0") for n in t.layer_names}
    one = {**resident, "b2": FETCHED}
    overlap = 6 * min(ACT, PARAM)  # pipelined, activations and gradients both count
    held1 = held_bytes(arr, arr.placed(one), 1)[gpu]
    held2 = held_bytes(arr, arr.placed(one), 2)[gpu]
    # (and with one batch the fetched block's gradient lives in its backward
    # only, the working set: `quick_gradients`)
    quick = PARAM - min(ACT, PARAM)
    assert held2 - held1 == pytest.approx(overlap + (OPT + PARAM) + quick - PARAM)
    weights_only = {**resident, "b2": Placement("gpu:0", "gpu:0", "gpu:0", params=PLACE)}
    base = held_bytes(arr, arr.placed(resident))[gpu]
    # its weights (old and new: nothing donated) leave; one copy is in flight
    assert held_bytes(arr, arr.placed(weights_only))[gpu] == pytest.approx(
        base - 2 * PARAM + PARAM)


def test_a_full_memory_place_names_xlas_pinned_pool():
    """Where the state does not fit a GPU's pinned host memory itself, the
    error says that XLA's pinned pool holds it too, and how to widen it."""
    t = table(gpu_gb=20, cpu_compute=False)
    t = dataclasses.replace(t, layers=tuple(
        dataclasses.replace(la, update_s={"gpu:0": 0.008}) for la in t.layers))
    with pytest.raises(InfeasibleError) as e:
        plan(t, memory={PLACE: 5 * GB})
    msg = str(e.value)
    assert PLACE in msg and "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in msg, msg


def test_a_state_copy_pays_each_of_its_arrays_on_the_place_links_curve():
    # A layer's state moves as one call of a few dozen arrays, each adding a
    # cost of its own: a 0.54B model's fetched plan (27 arrays a layer, 16-46
    # MB) ran 1.15-1.17x its prediction priced as one array (fit_h200, runs
    # 54 and 60). Each array here adds 0.2 ms and its bytes at 50 GB/s.
    per_array = 2e-4
    curve = ((1e6, per_array + 1e6 / PLACE_BW), (1e9, per_array + 1e9 / PLACE_BW))
    leaves = (tuple(("param", (100,), PARAM / 10) for _ in range(10))
              + tuple(("opt_state", (100,), OPT / 20) for _ in range(20)))
    base = table()
    curved = dataclasses.replace(base, links=tuple(
        dataclasses.replace(k, curve=curve) if PLACE in (k.src, k.dst) else k
        for k in base.links))
    split = dataclasses.replace(curved, layers=tuple(
        dataclasses.replace(la, state_leaves=leaves) for la in curved.layers))
    for way, copies in ((JAX_OFFLOAD, 2 * 19),  # optimizer state in and out: 20 arrays each
                        # weights in for the forward and for the backward with the
                        # update (10 each), state in (20), new weights and state out (30);
                        # the last block's forward and backward are one stage, one copy
                        (FETCHED, 9 + 9 + 19 + 29 - 9 / 6)):
        asg = {n: way for n in base.layer_names}
        whole, each = simulate(curved, asg, 1), simulate(split, asg, 1)
        assert each.transfer_s - whole.transfer_s == pytest.approx(6 * copies * per_array)
        assert evaluate(split, asg).step_time_s > evaluate(curved, asg).step_time_s
    # Without a curve (a spec sheet's bandwidth) the arrays change nothing.
    plain = dataclasses.replace(base, layers=split.layers)
    asg = {n: FETCHED for n in base.layer_names}
    assert simulate(plain, asg, 1).transfer_s == pytest.approx(
        simulate(base, asg, 1).transfer_s)
    # The planner's search prices the copies the same way: each streamed
    # option's optimizer state in and out costs each of its arrays on the
    # link's row, as the replay prices it.
    arr = Arrays(split)
    gpu, place = arr.dindex["gpu:0"], arr.dindex[PLACE]
    m, y, _ = _offload._model(arr, dict.fromkeys(base.layer_names, "gpu:0"), 1,
                              slack=np.zeros(len(arr.devices), bool))
    bus = int(arr.ram[place])
    rows = m.prob.constraints[f"link{bus}_{gpu}"], m.prob.constraints[f"link{gpu}_{bus}"]
    streamed = [(o, v) for o, v in y.items() if o.way == "streamed" and o.state == place]
    assert streamed
    for o, v in streamed:
        each = arr.link_s(place, gpu, OPT, arr.state_leaves(o.layer, "opt_state"))
        assert each == pytest.approx(arr.link_s(place, gpu, OPT) + 19 * per_array)
        for row in rows:
            assert row[v] * m.scale == pytest.approx(each)
    # A fetched option: its weights for each of its two reads and its
    # optimizer state, three copies in (a latency each, as the replay sends
    # them), its new weights and state in one copy out.
    fetched = [(o, v) for o, v in y.items() if o.way == "fetched" and o.state == place]
    assert fetched
    for o, v in fetched:
        params, opt = arr.state_leaves(o.layer, "param"), arr.state_leaves(o.layer, "opt_state")
        into = 2 * arr.link_s(place, gpu, PARAM, params) + arr.link_s(place, gpu, OPT, opt)
        out = arr.link_s(gpu, place, PARAM + OPT, params + opt)
        assert rows[0][v] * m.scale == pytest.approx(into)
        assert rows[1][v] * m.scale == pytest.approx(out)
    p = plan(split, memory={"gpu:0": 28 * GB}, activations=False)
    assert p.predicted.step_time_s == pytest.approx(
        evaluate(split, p.placements).step_time_s)
    assert p.predicted.step_time_s > plan(curved, memory={"gpu:0": 28 * GB},
                                          activations=False).predicted.step_time_s
