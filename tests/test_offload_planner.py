"""Tests of the offload planner: state and update apart from compute (JAX-free but one)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetpar.core import GraphFormatError, InfeasibleError, Placement, PlanError
from hetpar.planner import (
    Arrays,
    CostTable,
    Device,
    Edge,
    Layer,
    Link,
    Plan,
    evaluate,
    evaluate_replayed,
    held_bytes,
    plan,
    simulate,
    violations,
)
from hetpar.planner._solve import with_donation

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
PARAM, OPT, ACT = 1 * GB, 2 * GB, 0.5 * GB  # each block's parameters, optimizer state, activations
RESIDENT = 2 * PARAM + OPT + ACT  # 4.5 GB: each block's memory_bytes
# What a block holds with its state on its compute device: its memory_bytes and,
# as nothing is donated, its new parameters and optimizer state: 7.5 GB, of
# which 7 GB count at the step's peak: its activations (0.5 GB) are freed in
# its backward as its gradient (1 GB) is made (`Arrays.overlap`).
HELD = RESIDENT + PARAM + OPT


def table(blocks: int = 6, *, gpu_gb: float = 100.0, host_gb: float = 200.0,
          bandwidth: float = 63e9, cpu_compute: bool = True) -> CostTable:
    """A chain of equal blocks on a slow, roomy CPU and a fast GPU linked both ways."""
    devices = (Device("cpu:0", "cpu", host_gb * GB, 0.0, 270.0, 100.0, price_alone_per_hour=1.4),
               Device("gpu:0", "h100", gpu_gb * GB, 6.9, 700.0, 70.0))
    links = (Link("cpu:0", "gpu:0", bandwidth, 3e-4), Link("gpu:0", "cpu:0", bandwidth, 3e-4))
    names = [f"b{i}" for i in range(blocks)]
    layers = tuple(
        Layer(n, time_s={"cpu:0": 5.0, "gpu:0": 0.02},
              memory_bytes={"cpu:0": RESIDENT, "gpu:0": RESIDENT},
              allowed=None if cpu_compute else ("gpu:0",), activation_bytes=ACT, param_bytes=PARAM,
              opt_state_bytes=OPT, update_s={"cpu:0": 0.3, "gpu:0": 0.008})
        for n in names)
    edges = tuple(Edge(u, v, 1e7, 1e7) for u, v in zip(names, names[1:], strict=False))
    return CostTable(devices, links, layers, edges,
                     # analysed: no update waits for another's gradient (no clip)
                     meta={"update_reads": {}})


def _apart(p: Plan) -> set[str]:
    return set(p.offloaded)


def test_state_that_does_not_fit_goes_to_the_host_and_compute_stays_on_the_gpu():
    tight = table(gpu_gb=20)  # 6 x 7 GB held resident = 42 GB
    p = plan(tight, activations=False)  # the state search alone
    assert set(p.assignment.values()) == {"gpu:0"}
    assert _apart(p) and all(pl.state == "cpu:0" for pl in p.offloaded.values())
    assert p.state_assignment["b0"] in ("cpu:0", "gpu:0")
    assert set(p.update_assignment.values()) <= {"cpu:0", "gpu:0"}
    assert p.predicted.peak_memory_bytes["gpu:0"] <= 20 * GB
    assert violations(tight, p.placements) == []
    without = plan(tight, offload=False, activations=False)  # some blocks must compute on the CPU
    assert "cpu:0" in without.assignment.values()
    assert p.predicted.step_time_s < without.predicted.step_time_s / 3
    assert p.predicted.step_time_s < p.baselines["only cpu:0"].predicted.step_time_s / 10
    assert p.solver["offload"]["chosen"] is True
    assert p.solver["offload"]["without_offload"] == pytest.approx(without.predicted.step_time_s)
    assert evaluate(tight, p.placements).step_time_s == pytest.approx(p.predicted.step_time_s)


def test_with_enough_memory_nothing_is_offloaded():
    p = plan(table(gpu_gb=100))
    assert p.offloaded == {} and set(p.assignment.values()) == {"gpu:0"}
    assert "offload" not in p.solver
    assert p.placements == {n: Placement("gpu:0") for n in p.assignment}
    assert p.to_json()["assignment"] == dict.fromkeys(p.assignment, "gpu:0")


def test_partial_offload_beats_offloading_everything():
    # 42 GB held resident on a 35 GB GPU: each streamed block's old and new
    # optimizer state leave (4 GB), and visit for its update (2 GB each), so
    # some blocks' state must go, not all six.
    tight = table(gpu_gb=35)
    p = plan(tight, activations=False)  # the state search alone
    assert 0 < len(p.offloaded) < 6
    assert p.predicted.peak_memory_bytes["gpu:0"] <= 35 * GB
    everything = {n: Placement("gpu:0", "cpu:0", "cpu:0") for n in tight.layer_names}
    assert violations(tight, everything) == []
    assert p.predicted.step_time_s < evaluate(tight, everything).step_time_s
    zero = p.baselines["zero_offload"]  # ZeRO-Offload's rule: that very placement
    assert zero.feasible
    assert zero.predicted.step_time_s == pytest.approx(evaluate(tight, everything).step_time_s)
    assert p.predicted.step_time_s < zero.predicted.step_time_s


def test_memory_caps_plan_for_a_smaller_device():
    roomy = table(gpu_gb=100)
    capped = plan(roomy, memory={"gpu:0": 20 * GB})
    assert capped.offloaded and capped.predicted.peak_memory_bytes["gpu:0"] <= 20 * GB
    assert capped.placements == plan(table(gpu_gb=20)).placements
    assert capped.fingerprint == roomy.fingerprint()
    capped.check(roomy)
    with pytest.raises(PlanError, match="unknown device 'tpu:0'"):
        plan(roomy, memory={"tpu:0": 1e9})
    with pytest.raises(PlanError, match="positive number of bytes"):
        plan(roomy, memory={"gpu:0": -1})


def test_cli_memory_caps(tmp_path):
    graph = tmp_path / "graph.json"
    table(gpu_gb=100).save(graph)
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "hetpar", "plan", "--graph", str(graph),
                          "--memory", "gpu:0=20", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "state apart:" in run.stdout and "zero_offload" in run.stdout
    assert Plan.load(out).offloaded
    bad = subprocess.run([sys.executable, "-m", "hetpar", "plan", "--graph", str(graph),
                          "--memory", "gpu:0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert "--memory expects DEVICE=GB" in bad.stderr


def test_plan_json_round_trip_with_placements_and_old_files(tmp_path):
    tight = table(gpu_gb=35)  # a partial plan: some blocks resident, some offloaded
    p = plan(tight, activations=False)  # the state search alone
    data = p.to_json()
    kinds = {type(v) for v in data["assignment"].values()}
    assert kinds == {str, dict}  # resident layers stay device names
    obj = next(v for v in data["assignment"].values() if isinstance(v, dict))
    assert {"compute", "state", "update"} <= set(obj) <= {"compute", "params", "state", "update"}
    p.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again == p and again.placements == p.placements
    again.check(tight)
    old = {"format": "hetpar.plan", "version": 1, "fingerprint": tight.fingerprint(),
           "mode": "sequential", "objective": "time", "microbatches": 1,
           "assignment": dict.fromkeys(tight.layer_names, "gpu:0"),
           "predicted": {"step_time_s": 0.12, "cost_usd_per_step": 2e-4,
                         "energy_j_per_step": 80.0, "busy_s": {"gpu:0": 0.12},
                         "memory_bytes": {"gpu:0": 27e9}},
           "solver": {"name": "cbc", "status": "optimal"}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = Plan.load(tmp_path / "old.json")
    assert loaded.offloaded == {} and loaded.predicted.peak_memory_bytes is None
    assert loaded.state_assignment == dict.fromkeys(tight.layer_names, "gpu:0")
    bad = dict(old, assignment={**old["assignment"], "b0": {"state": "cpu:0"}})
    with pytest.raises(PlanError, match="needs 'compute'"):
        Plan.from_json(bad)
    elsewhere = dict(old, assignment={**old["assignment"],
                                      "b0": {"compute": "gpu:0", "state": "cpu:7"}})
    with pytest.raises(PlanError, match="cpu:7"):
        Plan.from_json(elsewhere).check(tight)


def test_graph_json_keeps_update_times_and_optimizer_state(tmp_path):
    t = table()
    t.save(tmp_path / "g.json")
    again = CostTable.load(tmp_path / "g.json")
    assert again.layers == t.layers
    assert again.layers[0].update_s == {"cpu:0": 0.3, "gpu:0": 0.008}
    data = t.to_json()
    for layer in data["layers"]:  # a graph written before these fields loads unchanged
        del layer["update_s"], layer["opt_state_bytes"]
    old = CostTable.from_json(data)
    assert old.layers[0].update_s is None and old.layers[0].opt_state_bytes is None
    data["layers"][0]["update_s"] = {"tpu:0": 1.0}
    with pytest.raises(GraphFormatError, match=r"update_s names unknown device 'tpu:0'"):
        CostTable.from_json(data)


def test_state_that_does_not_fit_the_host_names_the_host_and_bytes():
    small_host = table(gpu_gb=20, host_gb=5, cpu_compute=False)
    with pytest.raises(InfeasibleError) as e:
        plan(small_host)
    msg = str(e.value)
    assert "does not fit host memory" in msg and "cpu:0" in msg
    # 42 GB held on a 20 GB GPU (7 GB a block). Streamed, a block leaves 4 GB
    # (old and new optimizer state) and 0.5 GB of its gradient (which lives
    # in its backward only, `quick_gradients`) and costs the host 4 GB, but
    # its state visits for the update: 2 GB, once (the copy in takes the new
    # state), three at most in flight, and its gradient is the working set
    # (1 GB). The host way (ZeRO-Offload) leaves 5 GB (its new parameters
    # too) and costs the host 8 GB (state and parameters x2, the gradient,
    # and the parameters in the runtime's pinned staging). The smallest
    # host footprint: one block resident, five the host way: the GPU 7 + 5 x
    # 2 = 17 GB, the host 5 x 8 = 40 GB (one streamed and four the host way
    # need 7 + 2.5 + 4 x 2 + 2 + 1 = 20.5 GB of GPU).
    assert "40 GB" in msg and "holds 5 GB" in msg
    assert "5 layers' offloaded state: parameters and optimizer state x2" in msg
    assert "gradients of its 5 updates and their parameters staged" in msg


def test_a_cap_no_plan_meets_names_the_smallest_footprint():
    with pytest.raises(InfeasibleError) as e:
        plan(table(cpu_compute=False), memory={"gpu:0": 5 * GB})
    msg = str(e.value)
    # Every block's state on the host still leaves its weights and gradient
    # (its activations freed as the gradient is made): 6 x 2 GB.
    assert "smallest footprint found needs 12 GB on gpu:0" in msg and "5 GB" in msg


def test_replayed_step_includes_the_transfers():
    fast, slow = table(gpu_gb=20), table(gpu_gb=20, bandwidth=2e9)
    placements = plan(fast).placements
    t_fast = evaluate(fast, placements).step_time_s
    t_slow = evaluate(slow, placements).step_time_s
    assert t_slow > t_fast + 1.0  # 2 GB/s moves each offloaded block's weights in 0.5 s
    replay = simulate(fast, placements)
    updates = [s for s in replay.stages if s.device == "cpu:0"]
    host = [n for n, pl in placements.items() if pl.update == "cpu:0"]
    assert sorted(la for s in updates for la in s.layers) == sorted(host)
    assert replay.transfer_s > 0
    # Host updates run while the GPU computes earlier layers' backward.
    gpu_end = max(s.end_s for s in replay.stages if s.device == "gpu:0")
    if host:
        assert min(s.start_s for s in updates) < gpu_end


def test_streamed_state_moves_both_ways():
    t = table(gpu_gb=100)
    resident = {n: Placement("gpu:0") for n in t.layer_names}
    streamed = {**resident, "b2": Placement("gpu:0", "cpu:0", "gpu:0")}
    base = simulate(t, resident)
    replay = simulate(t, streamed)
    # weights (1 GB) and state (2 GB) in, 3 GB back: 6 GB at 63 GB/s in three copies
    assert replay.transfer_s == pytest.approx(base.transfer_s + 6 * GB / 63e9 + 3 * 3e-4,
                                              rel=1e-6)
    assert replay.step_time_s > base.step_time_s
    held = evaluate(t, streamed).peak_memory_bytes
    # Its state and parameters, old and new, and the parameters once more in
    # the pinned staging that takes them from the CPU device to the GPU.
    assert held["cpu:0"] == pytest.approx(2 * (PARAM + OPT) + PARAM)
    # Its old and new optimizer state and new parameters (apart: they default
    # to the state) leave the GPU, but its state visits for the update, once
    # (the copy in takes the new state); each block's activations and
    # gradient count once (`Arrays.overlap`), the streamed block's gradient
    # only while its backward runs (the working set: `quick_gradients`).
    assert held["gpu:0"] == pytest.approx(
        6 * (HELD - ACT) - 2 * OPT - PARAM + OPT - (PARAM - ACT) + PARAM)


def test_pipelined_plans_offload_and_replay():
    tight = table(gpu_gb=20)
    for schedule in ("gpipe", "1f1b"):
        p = plan(tight, mode="pipelined", microbatches=2, schedule=schedule,
                 activations=False)
        assert p.offloaded and set(p.assignment.values()) == {"gpu:0"}
        assert p.predicted.step_time_s == pytest.approx(
            evaluate_replayed(tight, p.placements, 2, schedule).step_time_s)


def test_explain_and_summary_say_why_state_is_on_the_host():
    tight = table(gpu_gb=20)
    p = plan(tight, activations=False)  # the state search alone
    text = p.explain(tight)
    name = next(iter(p.offloaded))
    block = text.split(f"\n{name} -> ")[1]
    assert "state on cpu:0: gpu:0 would need" in block and "holds 20 GB" in block
    summary = p.summary(tight)
    assert "state" in summary.splitlines()[2] and "update" in summary.splitlines()[2]
    assert "peak memory:" in summary and "zero_offload" in summary


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_cost_tables_price_each_layers_update():
    from hetpar import zoo  # JAX

    t = zoo.cost_table("mlp", ["cpu", "h100"], small=True)
    for layer in t.layers:
        assert layer.opt_state_bytes is not None and layer.opt_state_bytes > 0
        assert set(layer.update_s) == set(layer.time_s)
        for d, u in layer.update_s.items():
            assert 0 < u <= layer.time_s[d]


def test_offload_ilp_memory_rows_are_held_bytes():
    """The ILP's memory rows are `held_bytes`, streamed state in flight
    included (old and new of each streamed layer, at most five states, in
    the largest; binaries count the streamed layers) beside the largest
    working set: each choice of which
    blocks stream fits a cap in the ILP exactly when it fits by
    `held_bytes`. The blocks update on the GPU only, so each is resident or
    streamed."""
    base = table(blocks=4, cpu_compute=False)
    # Unequal blocks, so which ones stream matters: optimizer state 1-4 GB.
    base = dataclasses.replace(base, layers=tuple(
        dataclasses.replace(layer, opt_state_bytes=(k + 1) * GB, update_s={"gpu:0": 0.008},
                            memory_bytes={d: 2 * PARAM + (k + 1) * GB + ACT
                                          for d in layer.memory_bytes},
                            workspace_bytes=(3 - k) * 0.7 * GB)
        for k, layer in enumerate(base.layers)))
    streamed = Placement("gpu:0", "cpu:0", "gpu:0", params="gpu:0")
    _assert_ilp_rows_are_held_bytes(base, base, "streamed", streamed, Placement("gpu:0"))


def _assert_ilp_rows_are_held_bytes(base, priced, way, away, here, device="gpu:0"):
    """For every choice of which layers of `base` go `away` (offload option
    `way`) and which stay `here`, the offload ILP on `priced` (with `device`
    capped at what `held_bytes` says the choice holds there) is feasible, and
    infeasible 0.1% under it."""
    import itertools

    from hetpar.planner import _ilp
    from hetpar.planner._offload import _model
    from hetpar.planner._solve import with_memory

    names = base.layer_names
    arr = Arrays(base)
    j = arr.dindex[device]
    for combo in itertools.product((False, True), repeat=len(names)):
        placed = {n: away if s else here for n, s in zip(names, combo)}
        need = float(held_bytes(arr, arr.placed(placed))[j])
        if need <= 0:
            continue
        for cap, fits in ((need, True), (need * 0.999, False)):
            capped = Arrays(with_memory(priced, {device: cap}))
            m, y, _ = _model(capped, dict.fromkeys(names, "gpu:0"), 1,
                             slack=[False] * len(arr.devices))
            for o, v in y.items():
                m.prob.addConstraint(v == int(combo[o.layer] and o.way == way))
            status, _, _ = _ilp._run_solver(m.prob, "cbc", 10.0, 0.0)
            assert (status in ("optimal", "feasible")) == fits, (combo, cap / GB, status)


def test_one_batch_counts_activations_and_gradient_once_pipelines_both():
    """One batch at a time, a layer's activations are freed in its backward
    as its gradient is made, so the step's peak holds the larger of the two
    per layer, not their sum (the sum ran 1.27-1.41x the compiled peak of
    one-device steps on an H200). Pipelined, microbatches' activations wait
    beside the gradients accumulating: both count."""
    t = table()
    arr = Arrays(t)
    gpu = dict.fromkeys(t.layer_names, "gpu:0")
    placed = arr.placed(gpu)
    one = held_bytes(arr, placed)[arr.dindex["gpu:0"]]
    two = held_bytes(arr, placed, 2)[arr.dindex["gpu:0"]]
    assert one == pytest.approx(6 * (HELD - min(ACT, PARAM)))
    assert two == pytest.approx(6 * HELD)
    assert evaluate(t, gpu).memory_bytes["gpu:0"] == pytest.approx(one)
    assert evaluate(t, gpu, "pipelined", 2).memory_bytes["gpu:0"] == pytest.approx(two)
    # A GPU between the two: the step runs there whole, one batch at a time;
    # pipelined over two microbatches it does not fit there alone.
    between = table(gpu_gb=(one + two) / 2 / GB, cpu_compute=False)
    p = plan(between, activations=False)
    assert not p.offloaded and set(p.assignment.values()) == {"gpu:0"}
    assert violations(between, gpu) == []
    assert violations(between, gpu, microbatches=2)
    # Recomputed, a layer holds its gradient (not its activations) at the peak.
    remat = arr.placed({n: Placement("gpu:0", activations="remat") for n in t.layer_names})
    assert held_bytes(arr, remat)[arr.dindex["gpu:0"]] == pytest.approx(6 * (HELD - ACT) + ACT)
    # Where the trace counted the recomputation's own working set
    # (`remat_workspace_bytes`: the backward frees activations as it goes),
    # that, not all the activations beside the working set, is what runs.
    counted = dataclasses.replace(t, layers=tuple(
        dataclasses.replace(la, remat_workspace_bytes=0.6 * ACT) for la in t.layers))
    arr = Arrays(counted)
    remat = arr.placed({n: Placement("gpu:0", activations="remat") for n in t.layer_names})
    assert held_bytes(arr, remat)[arr.dindex["gpu:0"]] == pytest.approx(
        6 * (HELD - ACT) + 0.6 * ACT)


def test_host_updates_wait_for_the_gradients_they_read():
    """A host update that reads every gradient (the table's `update_reads`: a
    global-norm clip) starts after the whole backward, not as its own
    gradient arrives: on an H200 a plan's host CPU ran its layers' updates
    as one stage after the backward (experiments/results/fit_h200, run 19)."""
    t = table(gpu_gb=100)
    host = Placement("gpu:0", "cpu:0", "cpu:0")
    placements = {n: Placement("gpu:0") for n in t.layer_names}
    placements["b5"] = host  # the top layer: its backward comes first
    alone = simulate(t, placements)
    coupled = dataclasses.replace(t, meta={**t.meta, "update_reads": {"b5": "all"}})
    waits = simulate(coupled, placements)

    def update_start(replay):
        return min(s.start_s for s in replay.stages if s.device == "cpu:0")

    backward_end = max(s.end_s for s in waits.stages if s.device == "gpu:0")
    assert update_start(alone) < backward_end  # overlapping the others' backward
    assert update_start(waits) >= max(s.end_s for s in waits.stages
                                      if s.device == "gpu:0" and "b0" in s.layers)
    assert waits.step_time_s > alone.step_time_s
    # Naming the layers read works the same.
    named = dataclasses.replace(t, meta={**t.meta, "update_reads": {"b5": list(t.layer_names[:5])}})
    assert simulate(named, placements).step_time_s == pytest.approx(waits.step_time_s)


@pytest.mark.parametrize("reads, why", [
    (["b1"], "got list"),
    ({"b9": "all"}, "'b9': 'all'"),
    ({"b5": ["b0", "nope"]}, "'nope'"),
    ({"b5": "some"}, "'some'"),
])
def test_a_malformed_update_reads_is_named_at_load(reads, why):
    data = table().to_json()
    data["meta"] = {"update_reads": reads}
    with pytest.raises(GraphFormatError, match="meta.update_reads must map a layer") as e:
        CostTable.from_json(data)
    assert why in str(e.value)
    data["meta"] = {"update_reads": {"b5": "all", "b4": ["b0"]}}
    assert CostTable.from_json(data).meta["update_reads"]["b4"] == ["b0"]


@pytest.mark.parametrize("recomputed", [False, True])
def test_offload_ilp_memory_rows_are_held_bytes_for_host_updates(recomputed):
    """Updated on the host, a layer's gradient waits on the GPU until the
    host's update takes it (the runtime pulls it then). The ILP's rows agree
    with `held_bytes` for every choice of which blocks go to the host, kept
    and recomputed alike; a recomputed plan is solved on the remat-priced
    table and checked on the table itself (where they disagreed by the
    overlap, a 0.54B model's recomputed plan was dropped for one computing
    six of its layers on the CPU)."""
    from hetpar.planner._solve import _remat_table

    base = table(blocks=3, cpu_compute=False)
    # Unequal blocks (parameters 0.5-1.5 GB), so which ones go matters.
    base = dataclasses.replace(base, layers=tuple(
        dataclasses.replace(layer, param_bytes=(k + 1) * 0.5 * GB,
                            opt_state_bytes=(k + 1) * GB,
                            memory_bytes={d: 4 * (k + 1) * 0.5 * GB + ACT
                                          for d in layer.memory_bytes})
        for k, layer in enumerate(base.layers)))
    host = Placement("gpu:0", "cpu:0", "cpu:0", params="cpu:0",
                     activations="remat" if recomputed else "keep")
    here = Placement("gpu:0", activations="remat" if recomputed else "keep")
    priced = _remat_table(base, Arrays(base)) if recomputed else base
    _assert_ilp_rows_are_held_bytes(base, priced, "host", host, here)


def test_the_host_holds_a_host_updated_layers_parameters_twice():
    """Updated on the host, a layer computed on the GPU costs the host its
    optimizer state, its gradient and its parameters twice: where they live,
    and in the runtime's pinned staging that takes them to the GPU each step
    (a 6.74B plan counted once was killed by the OS at 130 GB of 134;
    `staging_bytes`). The ILP's host rows say the same as `held_bytes`."""
    host = Placement("gpu:0", "cpu:0", "cpu:0", params="cpu:0")
    for base, copies in ((with_donation(table(blocks=3, cpu_compute=False)), 1),
                         (table(blocks=3, cpu_compute=False), 2)):
        arr = Arrays(base)
        held = held_bytes(arr, arr.placed({**dict.fromkeys(base.layer_names, Placement("gpu:0")),
                                           "b1": host}))
        # state and parameters (old and new without donation), the gradient, the staging
        assert held[arr.dindex["cpu:0"]] == pytest.approx(copies * (OPT + PARAM) + 2 * PARAM)
        _assert_ilp_rows_are_held_bytes(base, base, "host", host, Placement("gpu:0"),
                                        device="cpu:0")


def test_the_alternatives_solved_side_by_side_give_the_plan_solved_in_turn(monkeypatch):
    """Where memory is tight the planner solves the layer ILP, the offload
    ILP and both again with recomputed activations: independent solves,
    run side by side where the host has the cores for them (the 6.74B
    model's plan over two 45 GB H200s, run 32's table: 28 s in turn, 13 s
    side by side on this 2-core machine). The plan is the same."""
    from hetpar.planner import _solve

    t = table(gpu_gb=10)
    monkeypatch.setattr(_solve, "CONCURRENT_FROM_CORES", 10**6)  # in turn
    in_turn = plan(t)
    started = []

    class Recorded(_solve._Background):
        def __init__(self, fn, *args):
            super().__init__(fn, *args)
            started.append(self._thread is not None)

    monkeypatch.setattr(_solve, "CONCURRENT_FROM_CORES", 1)
    monkeypatch.setattr(_solve, "_Background", Recorded)
    side_by_side = plan(t)
    assert started and all(started)  # the offload search and the remat plan
    assert len(started) >= 2
    assert side_by_side.assignment == in_turn.assignment
    assert side_by_side.predicted == in_turn.predicted
    assert side_by_side.offloaded

    # What a background solve raises reaches the caller.
    def fails():
        raise InfeasibleError("no plan")

    with pytest.raises(InfeasibleError, match="no plan"):
        _solve._Background(fails).result()
